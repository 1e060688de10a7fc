// The fused QK-norm + RoPE + KV-cache write; the launcher is declared in rope.cuh.
//
// Grid (T, ceil((nh + 2 nkv) / 4)): a block of 4 warps per token and group of 4 heads. The block
// first fills cos/sin of its position for the hd/2 frequencies in shared memory (double sincos,
// once per block instead of per head), then each warp takes one whole head of the token's nh q
// heads, nkv k heads and nkv v heads. Splitting the heads over blocks matters at decode: with one
// block per token, a T=1 step walked Qwen3-30B-A3B's 40 heads 10 deep per warp, each a dependent
// global round trip, 11 us per layer on the H200 (ncu, docs/PERF.md run E). A lane holds the pairs i = 2*lane + 64*j
// and i + 1 of the first half and the same pairs of the second half (one 4-byte bf16x2 load
// each), so the rotation partner of every value is in the same lane and a head needs one
// warp-shuffle sum of squares and no shared memory. Rows are 256 bytes at hd 128: the warp's
// loads are fully coalesced. Compute is negligible; the kernel moves (nh + 2 nkv) * hd * 2 bytes
// in and out per token. Launched with programmatic dependent launch (pdl.cuh): the launch and
// the block set-up overlap the GEMM's tail; everything is read after the wait.
#include "kernels/rope.cuh"

#include "kernels/cuda_check.h"
#include "kernels/kv_cache.cuh"
#include "kernels/pdl.cuh"
#include "kernels/rope_pair.cuh"

namespace moebius::kernels {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxHeadDim = 256;
constexpr int kIters = kMaxHeadDim / 128;  // pairs of pairs per lane per half at the largest hd

__global__ void __launch_bounds__(kWarps * 32)
    qk_norm_rope_kv_kernel(__nv_bfloat16* __restrict__ q, int64_t q_stride,        // [T, q_stride]
                           const __nv_bfloat16* __restrict__ k, int64_t k_stride,  // [T, k_stride]
                           const __nv_bfloat16* __restrict__ v, int64_t v_stride,  // [T, v_stride]
                           const float* __restrict__ q_norm,                       // [hd] or nullptr
                           const float* __restrict__ k_norm,                       // [hd] or nullptr
                           const int32_t* __restrict__ positions,                  // [T]
                           const float* __restrict__ inv_freq,                     // [hd / 2]
                           const int32_t* __restrict__ slot_mapping,               // [T]
                           __nv_bfloat16* __restrict__ k_cache,  // [num_blocks, nkv, block_size, hd]
                           __nv_bfloat16* __restrict__ v_cache,  // [num_blocks, nkv, block_size, hd]
                           int nh, int nkv, int hd, int block_size, float eps) {
  __shared__ float s_cos[kMaxHeadDim / 2], s_sin[kMaxHeadDim / 2];
  pdl_wait();  // q/k/v come from the QKV GEMM (positions and slots from the step's upload)
  pdl_launch_dependents();
  const int t = blockIdx.x;
  const int half = hd / 2;
  const float pos = static_cast<float>(positions[t]);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const float angle = pos * inv_freq[i];  // fp32 product, like the reference
    double s, c;
    sincos(static_cast<double>(angle), &s, &c);
    s_cos[i] = static_cast<float>(c);
    s_sin[i] = static_cast<float>(s);
  }
  __syncthreads();

  const int slot = slot_mapping[t];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int items = nh + 2 * nkv;
  for (int item = blockIdx.y * kWarps + warp; item < items; item += kWarps * gridDim.y) {
    // Which head, where it comes from and where it goes.
    const __nv_bfloat16* src;
    __nv_bfloat16* dst;
    const float* norm_w = nullptr;
    bool rotate = true;
    if (item < nh) {
      src = dst = q + t * q_stride + static_cast<int64_t>(item) * hd;
      norm_w = q_norm;
    } else {
      if (slot < 0) break;  // padding token: q only (k/v items come after every q item)
      const int kvh = item < nh + nkv ? item - nh : item - nh - nkv;
      const int64_t off = kv_cache_offset(slot / block_size, kvh, slot % block_size, nkv, block_size, hd);
      if (item < nh + nkv) {
        src = k + t * k_stride + static_cast<int64_t>(kvh) * hd;
        dst = k_cache + off;
        norm_w = k_norm;
      } else {
        src = v + t * v_stride + static_cast<int64_t>(kvh) * hd;
        dst = v_cache + off;
        rotate = false;
      }
    }
    float2 a[kIters], b[kIters];  // (x[i], x[i+1]) and (x[half+i], x[half+i+1]), i = 2*lane + 64*j
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const int i = 2 * lane + 64 * j;
      if (i < half) {
        a[j] = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(src + i));
        b[j] = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(src + half + i));
        ss += a[j].x * a[j].x + a[j].y * a[j].y + b[j].x * b[j].x + b[j].y * b[j].y;
      }
    }
    float inv = 1.0f;
    if (norm_w != nullptr) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      inv = 1.0f / sqrtf(ss / static_cast<float>(hd) + eps);
    }
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const int i = 2 * lane + 64 * j;
      if (i >= half) continue;
      float2 x = a[j], y = b[j];
      const bool norm = norm_w != nullptr;
      const float4 w = norm ? make_float4(norm_w[i], norm_w[i + 1], norm_w[half + i], norm_w[half + i + 1])
                            : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
      rope_detail::norm_rope_pair(x, y, norm, inv, w, rotate, s_cos, s_sin, i);
      *reinterpret_cast<__nv_bfloat162*>(dst + i) = __floats2bfloat162_rn(x.x, x.y);
      *reinterpret_cast<__nv_bfloat162*>(dst + half + i) = __floats2bfloat162_rn(y.x, y.y);
    }
  }
}

}  // namespace

void launch_qk_norm_rope_kv(__nv_bfloat16* q, int64_t q_stride, const __nv_bfloat16* k, int64_t k_stride,
                            const __nv_bfloat16* v, int64_t v_stride, const float* q_norm, const float* k_norm,
                            const int32_t* positions, const float* inv_freq, const int32_t* slot_mapping,
                            __nv_bfloat16* k_cache, __nv_bfloat16* v_cache, int T, int nh, int nkv, int hd,
                            int block_size, float eps, cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(T >= 0 && nh > 0 && nkv > 0 && block_size > 0, "qk_norm_rope_kv: bad dims");
  MOEBIUS_LAUNCH_ASSERT(hd > 0 && hd % 4 == 0 && hd <= kMaxHeadDim, "qk_norm_rope_kv: hd must be a multiple of 4, <= 256");
  MOEBIUS_LAUNCH_ASSERT(q_stride % 2 == 0 && k_stride % 2 == 0 && v_stride % 2 == 0 &&
                            reinterpret_cast<uintptr_t>(q) % 4 == 0 && reinterpret_cast<uintptr_t>(k) % 4 == 0 &&
                            reinterpret_cast<uintptr_t>(v) % 4 == 0,
                        "qk_norm_rope_kv: q/k/v and their strides must be 4-byte aligned");
  if (T == 0) return;
  const dim3 grid(T, (nh + 2 * nkv + kWarps - 1) / kWarps);
  MOEBIUS_LAUNCH_ASSERT(grid.y <= 65535, "qk_norm_rope_kv: too many heads");
  launch_pdl(qk_norm_rope_kv_kernel, grid, dim3(kWarps * 32), 0, stream, q, q_stride, k, k_stride, v, v_stride, q_norm,
             k_norm, positions, inv_freq, slot_mapping, k_cache, v_cache, nh, nkv, hd, block_size, eps);
}

}  // namespace moebius::kernels
