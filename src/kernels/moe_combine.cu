#include "kernels/moe_combine.cuh"

#include "kernels/cuda_check.h"
#include "kernels/moe_combine_sum.cuh"
#include "kernels/pdl.cuh"

namespace moebius::kernels {

namespace {

constexpr int kCombineThreads = 128;

// Grid (column blocks, capacity): a thread owns 4 consecutive columns of one token (kVec: one
// 16-byte load per slot) and issues all k slot loads before the first add, so a decode token is
// one L2 round trip spread over H/512 blocks instead of a single block walking the row (the first
// version, one 256-thread block per token, measured 6.5 us at T=1 on the H200; docs/PERF.md).
// The sum runs in slot order j = 0..k-1 in fp32, the same order for every thread and every run
// (moe_combine_sum.cuh, shared with the combine folded into the qkv GEMV).
template <bool kVec>
__global__ void __launch_bounds__(kCombineThreads)
    moe_combine_kernel(const float* __restrict__ y, int y_stride,  // [capacity*k, y_stride]
                       const float* __restrict__ w,                // [capacity*k]
                       const int32_t* __restrict__ num_tokens, int capacity, int top_k, int hidden,
                       __nv_bfloat16* __restrict__ out, int out_stride,  // [capacity, out_stride]
                       bool early_trigger) {
  // [TAG_PDL_EARLY_TRIGGER] Optional (launch_moe_combine's trigger_early): the next kernel launches
  // with this one instead of after its wait.
  if (early_trigger) pdl_launch_dependents();
  pdl_wait();  // y comes from GEMM2
  if (!early_trigger) pdl_launch_dependents();
  const int t = blockIdx.y;
  const int T = min(max(*num_tokens, 0), capacity);
  if (t >= T) return;  // [TAG_MOE_GRAPH_CAPACITY]
  const int n0 = (blockIdx.x * kCombineThreads + threadIdx.x) * 4;
  if (n0 >= hidden) return;
  const float* yt = y + static_cast<int64_t>(t) * top_k * y_stride + n0;
  const float* wt = w + static_cast<int64_t>(t) * top_k;
  __nv_bfloat16* o = out + static_cast<int64_t>(t) * out_stride + n0;
  if constexpr (kVec) {  // hidden, y_stride multiples of 4 and y 16-byte aligned: whole quads
    const float4 s = moe_detail::moe_combine_quad</*kStreaming=*/true>(yt, y_stride, wt, top_k);
    o[0] = __float2bfloat16(s.x);
    o[1] = __float2bfloat16(s.y);
    o[2] = __float2bfloat16(s.z);
    o[3] = __float2bfloat16(s.w);
  } else {
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int nc = min(4, hidden - n0);
    for (int j = 0; j < top_k; ++j)
      for (int c = 0; c < nc; ++c) s[c] = fmaf(wt[j], yt[static_cast<int64_t>(j) * y_stride + c], s[c]);
    for (int c = 0; c < nc; ++c) o[c] = __float2bfloat16(s[c]);
  }
}

}  // namespace

void launch_moe_combine(const float* y, int y_stride, const float* topk_weights, const int32_t* num_tokens,
                        int capacity, int top_k, int hidden, __nv_bfloat16* out, int out_stride, cudaStream_t stream,
                        bool trigger_early) {
  MOEBIUS_LAUNCH_ASSERT(top_k >= 1 && hidden >= 1, "bad combine shape");
  MOEBIUS_LAUNCH_ASSERT(capacity <= 65535, "capacity must fit grid.y");
  if (capacity <= 0) return;
  const dim3 grid((hidden + kCombineThreads * 4 - 1) / (kCombineThreads * 4), capacity);
  const bool vec = hidden % 4 == 0 && y_stride % 4 == 0 && reinterpret_cast<uintptr_t>(y) % 16 == 0;
  if (vec)
    launch_pdl(moe_combine_kernel<true>, grid, dim3(kCombineThreads), 0, stream, y, y_stride, topk_weights, num_tokens,
               capacity, top_k, hidden, out, out_stride, trigger_early);
  else
    launch_pdl(moe_combine_kernel<false>, grid, dim3(kCombineThreads), 0, stream, y, y_stride, topk_weights,
               num_tokens, capacity, top_k, hidden, out, out_stride, trigger_early);
}

}  // namespace moebius::kernels
