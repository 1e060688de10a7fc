// Row gathers (gather.cuh). Memory-bound copies: one block per output row, each thread moves
// 16-byte chunks (8 bf16), so a 2048-wide row (Qwen3-30B-A3B) is 256 threads x one load.
#include "kernels/gather.cuh"

#include "kernels/cuda_check.h"

namespace moebius::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void embedding_kernel(const __nv_bfloat16* __restrict__ table, int64_t vocab,
                                 const int32_t* __restrict__ ids, int H, float* __restrict__ out) {
  const int t = blockIdx.x;
  const int32_t id = ids[t];
  const bool live = id >= 0 && id < vocab;
  float* dst = out + static_cast<int64_t>(t) * H;
  for (int c = threadIdx.x * 8; c < H; c += blockDim.x * 8) {
    float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (live) {
      const uint4 u = *reinterpret_cast<const uint4*>(table + static_cast<int64_t>(id) * H + c);
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
      }
    }
    reinterpret_cast<float4*>(dst + c)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(dst + c)[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
}

__global__ void gather_rows_kernel(const __nv_bfloat16* __restrict__ src, int64_t src_stride,
                                   const int32_t* __restrict__ rows, int H, __nv_bfloat16* __restrict__ out) {
  const int s = blockIdx.x;
  const int32_t r = rows[s];
  __nv_bfloat16* dst = out + static_cast<int64_t>(s) * H;
  for (int c = threadIdx.x * 8; c < H; c += blockDim.x * 8) {
    uint4 u = make_uint4(0, 0, 0, 0);
    if (r >= 0) u = *reinterpret_cast<const uint4*>(src + r * src_stride + c);
    *reinterpret_cast<uint4*>(dst + c) = u;
  }
}

int threads_for(int H) { return H / 8 < kThreads ? ((H / 8 + 31) / 32) * 32 : kThreads; }

}  // namespace

void launch_embedding(const __nv_bfloat16* table, int64_t vocab, const int32_t* ids, int T, int H, float* out,
                      cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(T >= 0 && H > 0 && H % 8 == 0, "embedding: H must be a positive multiple of 8");
  MOEBIUS_LAUNCH_ASSERT(reinterpret_cast<uintptr_t>(table) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0,
                        "embedding: table and out must be 16-byte aligned");
  if (T == 0) return;
  embedding_kernel<<<T, threads_for(H), 0, stream>>>(table, vocab, ids, H, out);
  CUDA_CHECK_LAUNCH();
}

void launch_gather_rows(const __nv_bfloat16* src, int64_t src_stride, const int32_t* rows, int S, int H,
                        __nv_bfloat16* out, cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(S >= 0 && H > 0 && H % 8 == 0 && src_stride % 8 == 0 && src_stride >= H,
                        "gather_rows: H and src_stride must be multiples of 8, src_stride >= H");
  MOEBIUS_LAUNCH_ASSERT(reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0,
                        "gather_rows: src and out must be 16-byte aligned");
  if (S == 0) return;
  gather_rows_kernel<<<S, threads_for(H), 0, stream>>>(src, src_stride, rows, H, out);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moebius::kernels
