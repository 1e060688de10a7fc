#include "kernels/moe_combine.cuh"

#include "kernels/cuda_check.h"
#include "kernels/pdl.cuh"

namespace moebius::kernels {

namespace {

// One block per token row; threads stride over the hidden dimension. Reads k fp32 rows of y once.
__global__ void moe_combine_kernel(const float* __restrict__ y, int y_stride, const float* __restrict__ w,
                                   const int32_t* __restrict__ num_tokens, int capacity, int top_k, int hidden,
                                   __nv_bfloat16* __restrict__ out, int out_stride) {
  pdl_wait();  // y comes from GEMM2
  pdl_launch_dependents();
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

}  // namespace

void launch_moe_combine(const float* y, int y_stride, const float* topk_weights, const int32_t* num_tokens,
                        int capacity, int top_k, int hidden, __nv_bfloat16* out, int out_stride, cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(top_k >= 1 && hidden >= 1, "bad combine shape");
  if (capacity <= 0) return;
  launch_pdl(moe_combine_kernel, dim3(capacity), dim3(256), 0, stream, y, y_stride, topk_weights, num_tokens, capacity,
             top_k, hidden, out, out_stride);
}

}  // namespace moebius::kernels
