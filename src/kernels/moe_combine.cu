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

// Warp per (expert e, 8 tokens): lanes stride over H in pairs, the expert row element pair is
// loaded once and used for the 8 tokens; shuffle reduction at the end.
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
  for (int h = lane; h < hidden; h += 32) {
    const float wv = __bfloat162float(wrow[h]);
#pragma unroll
    for (int j = 0; j < kRouterTokens; ++j)
      if (j < nt) acc[j] += wv * __bfloat162float(x[static_cast<int64_t>(t0 + j) * x_stride + h]);
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
  moe_router_logits_kernel<<<grid, kWarpsPerBlock * 32, 0, stream>>>(x, x_stride, router_weight, num_tokens, capacity,
                                                                     hidden, num_experts, logits);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moebius::kernels
