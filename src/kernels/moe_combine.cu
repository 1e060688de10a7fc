#include "kernels/moe_combine.cuh"

#include "kernels/cuda_check.h"

namespace moebius::kernels {

namespace {

// One block per token row; threads stride over the hidden dimension. Reads k fp32 rows of y once.
__global__ void moe_combine_kernel(const float* __restrict__ y, int y_stride, const float* __restrict__ w,
                                   const int32_t* __restrict__ num_tokens, int capacity, int top_k, int hidden,
                                   __nv_bfloat16* __restrict__ out, int out_stride) {
  const int t = blockIdx.x;
  const int T = min(max(*num_tokens, 0), capacity);
  if (t >= T) return;  // [TAG_MOE_GRAPH_CAPACITY]
  const float* yt = y + static_cast<int64_t>(t) * top_k * y_stride;
  const float* wt = w + static_cast<int64_t>(t) * top_k;
  for (int n = threadIdx.x; n < hidden; n += blockDim.x) {
    float s = 0.0f;
    for (int j = 0; j < top_k; ++j) s += wt[j] * yt[static_cast<int64_t>(j) * y_stride + n];
    out[static_cast<int64_t>(t) * out_stride + n] = __float2bfloat16(s);
  }
}

constexpr int kRouterTokens = 8;

// Warp per (expert e, 8 tokens). Each lane takes 8 consecutive h per step (one 16-byte load of
// the expert row, reused for the 8 tokens), so a 2048-wide row is 8 steps, not 64 dependent
// scalar loads; shuffle reduction at the end. kVec needs H and the x stride to be multiples of 8.
template <bool kVec>
__global__ void moe_router_logits_kernel(const __nv_bfloat16* __restrict__ x, int x_stride,
                                         const __nv_bfloat16* __restrict__ wr, const int32_t* __restrict__ num_tokens,
                                         int capacity, int hidden, int num_experts, float* __restrict__ logits) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int e = blockIdx.x * (blockDim.x / 32) + warp;
  const int t0 = blockIdx.y * kRouterTokens;
  const int T = min(max(*num_tokens, 0), capacity);
  if (t0 >= T || e >= num_experts) return;  // [TAG_MOE_GRAPH_CAPACITY]
  const int nt = min(kRouterTokens, T - t0);
  float acc[kRouterTokens] = {};
  const __nv_bfloat16* wrow = wr + static_cast<int64_t>(e) * hidden;
  if constexpr (kVec) {
    for (int h = lane * 8; h < hidden; h += 256) {
      const uint4 wv = __ldg(reinterpret_cast<const uint4*>(wrow + h));
      const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv);
#pragma unroll
      for (int j = 0; j < kRouterTokens; ++j) {
        if (j < nt) {
          const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(t0 + j) * x_stride + h));
          const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const float2 a = __bfloat1622float2(w2[q]), b = __bfloat1622float2(x2[q]);
            acc[j] += a.x * b.x + a.y * b.y;
          }
        }
      }
    }
  } else {
    for (int h = lane; h < hidden; h += 32) {
      const float wv = __bfloat162float(wrow[h]);
#pragma unroll
      for (int j = 0; j < kRouterTokens; ++j)
        if (j < nt) acc[j] += wv * __bfloat162float(x[static_cast<int64_t>(t0 + j) * x_stride + h]);
    }
  }
#pragma unroll
  for (int j = 0; j < kRouterTokens; ++j) {
    float v = acc[j];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0 && j < nt) logits[static_cast<int64_t>(t0 + j) * num_experts + e] = v;
  }
}

}  // namespace

void launch_moe_combine(const float* y, int y_stride, const float* topk_weights, const int32_t* num_tokens,
                        int capacity, int top_k, int hidden, __nv_bfloat16* out, int out_stride, cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(top_k >= 1 && hidden >= 1, "bad combine shape");
  if (capacity <= 0) return;
  moe_combine_kernel<<<capacity, 256, 0, stream>>>(y, y_stride, topk_weights, num_tokens, capacity, top_k, hidden,
                                                   out, out_stride);
  CUDA_CHECK_LAUNCH();
}

void launch_moe_router_logits(const __nv_bfloat16* x, int x_stride, const __nv_bfloat16* router_weight,
                              const int32_t* num_tokens, int capacity, int hidden, int num_experts, float* logits,
                              cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(hidden >= 1 && num_experts >= 1, "bad router shape");
  if (capacity <= 0) return;
  constexpr int kWarpsPerBlock = 8;
  const dim3 grid((num_experts + kWarpsPerBlock - 1) / kWarpsPerBlock, (capacity + kRouterTokens - 1) / kRouterTokens);
  const bool vec = hidden % 8 == 0 && x_stride % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(router_weight) % 16 == 0;
  if (vec)
    moe_router_logits_kernel<true><<<grid, kWarpsPerBlock * 32, 0, stream>>>(x, x_stride, router_weight, num_tokens,
                                                                           capacity, hidden, num_experts, logits);
  else
    moe_router_logits_kernel<false><<<grid, kWarpsPerBlock * 32, 0, stream>>>(x, x_stride, router_weight, num_tokens,
                                                                            capacity, hidden, num_experts, logits);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moebius::kernels
