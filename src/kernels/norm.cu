// RMSNorm kernels; the launchers are declared in norm.cuh.
//
// One block per row: a row of H = 2048 (Qwen3-30B-A3B) is 4 KiB of bf16, too little to split
// across blocks, and a decode step has few rows, so the grid is the row count. At decode the
// kernel is pure latency (one row: 8 KB of fp32 residual + 4 KB of bf16 input in, 8 + 4 KB out):
// its time is the dependent chain load -> block reduction -> store. Splitting a row over blocks
// would add a cross-block reduction (another global round trip) to that chain, so instead the
// chain is made as short as it can be:
//  - rows of H <= 8 * 256 * 4 = 8192 (every Qwen3) are held in registers, kChunks 16-byte chunks
//    of 8 elements per thread: x and y are loaded once, the residual stored once, and the output
//    formed from registers (the former second pass re-read x from L2 after storing it: a second
//    round trip on the critical path);
//  - the weight is a constant: it is loaded into registers BEFORE pdl_wait(), so with programmatic
//    dependent launch (pdl.cuh) those loads overlap the previous kernel's tail;
//  - pdl_launch_dependents() comes even BEFORE the wait ([TAG_PDL_EARLY_TRIGGER], pdl.cuh): the
//    next kernel (the QKV GEMV, which prefetches its weights; the MoE routing; the lm_head) then
//    launches while the kernel before this one still runs, and its own wait still covers this
//    kernel's completion.
// Larger H takes the loop (a second pass re-reads x; the row is in L1/L2 by then).
// Each thread owns chunks of 8 consecutive elements (one 16-byte load for bf16, two for fp32):
// x (+ y) is formed, the residual written back and the sum of squares accumulated in fp32; a
// warp-shuffle tree then a 32-entry shared-memory step reduce it.
// Math in fp32, in the CPU reference's order: inv = 1 / sqrt(ss / H + eps), out = (x * inv) * w.
// The CPU reference sums squares in double; fp32 here differs by ~1e-7 relative in inv, far below
// the bf16 output's rounding. A bf16 residual is rounded after the add and the norm reads the
// rounded value, exactly as if it re-read the stored residual.
#include "kernels/norm.cuh"

#include <cstdint>

#include "kernels/cuda_check.h"
#include "kernels/pdl.cuh"

namespace moebius::kernels {
namespace {

constexpr int kMaxThreads = 256;

__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&v)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&v)[8]) {
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = u;
}
__device__ __forceinline__ void store8(float* p, const float (&v)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
// Weights may sit at any 2/4-byte aligned address (a slice of a loaded checkpoint): scalar loads,
// all from L1 after the first row.
__device__ __forceinline__ float weight(const __nv_bfloat16* w, int i) { return __bfloat162float(w[i]); }
__device__ __forceinline__ float weight(const float* w, int i) { return w[i]; }
__device__ __forceinline__ float round_like(const __nv_bfloat16*, float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
__device__ __forceinline__ float round_like(const float*, float v) { return v; }

// Sum over the block; every thread gets the total.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = lane < warps ? warp_sums[lane] : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// kAdd: x += y, written back. !kAdd: x is read only (y is ignored).
template <typename X, typename W, bool kAdd>
__global__ void __launch_bounds__(kMaxThreads)
    rms_norm_kernel(X* __restrict__ x,                    // [T, H]
                    const __nv_bfloat16* __restrict__ y,  // [T, H] (kAdd)
                    const W* __restrict__ w,              // [H]
                    int H, float eps,
                    __nv_bfloat16* __restrict__ out) {  // [T, H]
  const int64_t row = static_cast<int64_t>(blockIdx.x) * H;
  pdl_launch_dependents();  // [TAG_PDL_EARLY_TRIGGER]
  pdl_wait();               // x and y come from the previous kernels
  X* xr = x + row;
  float ss = 0.0f;
  for (int c = threadIdx.x * 8; c < H; c += blockDim.x * 8) {
    float v[8];
    load8(xr + c, v);
    if constexpr (kAdd) {
      float yv[8];
      load8(y + row + c, yv);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] += yv[i];
      store8(xr + c, v);
      if constexpr (sizeof(X) == 2) load8(xr + c, v);  // the norm reads the rounded residual
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) ss = fmaf(v[i], v[i], ss);
  }
  const float inv = 1.0f / sqrtf(block_sum(ss) / static_cast<float>(H) + eps);
  for (int c = threadIdx.x * 8; c < H; c += blockDim.x * 8) {
    float v[8];
    load8(xr + c, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = v[i] * inv * weight(w, c + i);
    store8(out + row + c, v);
  }
}

// Rows of at most kChunks * blockDim.x chunks, held in registers (see the top of the file).
template <typename X, typename W, bool kAdd, int kChunks>
__global__ void __launch_bounds__(kMaxThreads)
    rms_norm_reg_kernel(X* __restrict__ x,                    // [T, H]
                        const __nv_bfloat16* __restrict__ y,  // [T, H] (kAdd)
                        const W* __restrict__ w,              // [H]
                        int H, float eps,
                        __nv_bfloat16* __restrict__ out) {  // [T, H]
  const int64_t row = static_cast<int64_t>(blockIdx.x) * H;
  float wv[kChunks][8];
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int c = (threadIdx.x + j * blockDim.x) * 8;
#pragma unroll
    for (int i = 0; i < 8; ++i) wv[j][i] = c < H ? weight(w, c + i) : 0.0f;
  }
  pdl_launch_dependents();  // before the wait: [TAG_PDL_EARLY_TRIGGER] (see the top of the file)
  pdl_wait();               // x and y come from the previous kernels
  X* xr = x + row;
  float v[kChunks][8];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int c = (threadIdx.x + j * blockDim.x) * 8;
    if (c >= H) continue;
    load8(xr + c, v[j]);
    if constexpr (kAdd) {
      float yv[8];
      load8(y + row + c, yv);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[j][i] = round_like(xr, v[j][i] + yv[i]);
      store8(xr + c, v[j]);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) ss = fmaf(v[j][i], v[j][i], ss);
  }
  const float inv = 1.0f / sqrtf(block_sum(ss) / static_cast<float>(H) + eps);
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int c = (threadIdx.x + j * blockDim.x) * 8;
    if (c >= H) continue;
    float o[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = v[j][i] * inv * wv[j][i];
    store8(out + row + c, o);
  }
}

template <typename X, typename W, bool kAdd>
void launch(X* x, const __nv_bfloat16* y, const W* w, int T, int H, float eps, __nv_bfloat16* out,
            cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(T >= 0 && H > 0 && H % 8 == 0, "rms_norm needs H > 0, a multiple of 8");
  MOEBIUS_LAUNCH_ASSERT(reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0 &&
                            reinterpret_cast<uintptr_t>(y) % 16 == 0,
                        "rms_norm x, y and out must be 16-byte aligned");
  if (T == 0) return;
  int threads = (H / 8 + 31) / 32 * 32;
  threads = threads > kMaxThreads ? kMaxThreads : threads;
  const int chunks = (H / 8 + threads - 1) / threads;  // per thread
  const dim3 grid(T), block(threads);
  switch (chunks) {
    case 1: launch_pdl(rms_norm_reg_kernel<X, W, kAdd, 1>, grid, block, 0, stream, x, y, w, H, eps, out); break;
    case 2: launch_pdl(rms_norm_reg_kernel<X, W, kAdd, 2>, grid, block, 0, stream, x, y, w, H, eps, out); break;
    case 3:
    case 4: launch_pdl(rms_norm_reg_kernel<X, W, kAdd, 4>, grid, block, 0, stream, x, y, w, H, eps, out); break;
    default: launch_pdl(rms_norm_kernel<X, W, kAdd>, grid, block, 0, stream, x, y, w, H, eps, out); break;
  }
}

}  // namespace

template <typename X, typename W>
void launch_rms_norm(const X* x, const W* w, int T, int H, float eps, __nv_bfloat16* out, cudaStream_t stream) {
  launch<X, W, false>(const_cast<X*>(x), nullptr, w, T, H, eps, out, stream);  // kAdd = false never writes x
}

template <typename X, typename W>
void launch_add_rms_norm(X* x, const __nv_bfloat16* y, const W* w, int T, int H, float eps, __nv_bfloat16* out,
                         cudaStream_t stream) {
  if (y == nullptr) launch<X, W, false>(x, nullptr, w, T, H, eps, out, stream);
  else launch<X, W, true>(x, y, w, T, H, eps, out, stream);
}

#define MOEBIUS_INSTANTIATE_NORM(X, W)                                                                            \
  template void launch_rms_norm<X, W>(const X*, const W*, int, int, float, __nv_bfloat16*, cudaStream_t);       \
  template void launch_add_rms_norm<X, W>(X*, const __nv_bfloat16*, const W*, int, int, float, __nv_bfloat16*, \
                                          cudaStream_t);
MOEBIUS_INSTANTIATE_NORM(__nv_bfloat16, __nv_bfloat16)
MOEBIUS_INSTANTIATE_NORM(__nv_bfloat16, float)
MOEBIUS_INSTANTIATE_NORM(float, __nv_bfloat16)
MOEBIUS_INSTANTIATE_NORM(float, float)
#undef MOEBIUS_INSTANTIATE_NORM

}  // namespace moebius::kernels
