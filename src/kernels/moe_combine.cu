#include "kernels/moe_combine.cuh"

#include "kernels/cuda_check.h"
#include "kernels/moe_combine_sum.cuh"
#include "kernels/pdl.cuh"

namespace moebius::kernels {

namespace {

constexpr int kCombineThreads = 128;

// Both kernels' start: the PDL wait (y comes from GEMM2) and trigger, then the thread's token t
// (blockIdx.y) and first column n0 of its `cols`; false for a thread with nothing to combine.
// [TAG_PDL_EARLY_TRIGGER] Optional (launch_moe_combine's trigger_early): the next kernel launches
// with this one instead of after its wait.
__device__ __forceinline__ bool combine_thread(bool early_trigger, const int32_t* num_tokens, int capacity, int hidden,
                                               int cols, int& t, int& n0) {
  if (early_trigger) pdl_launch_dependents();
  pdl_wait();
  if (!early_trigger) pdl_launch_dependents();
  t = blockIdx.y;
  const int T = min(max(*num_tokens, 0), capacity);
  if (t >= T) return false;  // [TAG_MOE_GRAPH_CAPACITY]
  n0 = (blockIdx.x * kCombineThreads + threadIdx.x) * cols;
  return n0 < hidden;
}

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
  int t, n0;
  if (!combine_thread(early_trigger, num_tokens, capacity, hidden, 4, t, n0)) return;
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

// [TAG_MOE_BF16_Y] The combine of bf16 y rows (MoeCombineMode::kStoreBf16): the same slot-order
// fp32 sum, each value widened exactly from bf16. A thread owns 8 columns (one 16-byte load per
// slot, as the fp32 kernel's 4), all k loads issued before the first add.
__global__ void __launch_bounds__(kCombineThreads)
    moe_combine_bf16_kernel(const __nv_bfloat16* __restrict__ y, int y_stride,  // [capacity*k, y_stride]
                            const float* __restrict__ w, const int32_t* __restrict__ num_tokens, int capacity,
                            int top_k, int hidden, __nv_bfloat16* __restrict__ out, int out_stride, bool early_trigger) {
  int t, n0;
  if (!combine_thread(early_trigger, num_tokens, capacity, hidden, 8, t, n0)) return;
  const __nv_bfloat16* yt = y + static_cast<int64_t>(t) * top_k * y_stride + n0;
  const float* wt = w + static_cast<int64_t>(t) * top_k;
  __nv_bfloat16* o = out + static_cast<int64_t>(t) * out_stride + n0;
  constexpr int kBatch = 8;
  float s[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (int j0 = 0; j0 < top_k; j0 += kBatch) {
    uint4 v[kBatch];
    float wj[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (j0 + j < top_k) {
        v[j] = __ldcs(reinterpret_cast<const uint4*>(yt + static_cast<int64_t>(j0 + j) * y_stride));
        wj[j] = wt[j0 + j];
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (j0 + j < top_k) {
        const uint32_t words[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          s[2 * q] = fmaf(wj[j], __uint_as_float(words[q] << 16), s[2 * q]);
          s[2 * q + 1] = fmaf(wj[j], __uint_as_float(words[q] & 0xFFFF0000u), s[2 * q + 1]);
        }
      }
    }
  }
  // Output rows at any element offset (the layer takes the caller's out): bf16 pairs where the
  // thread's 8 columns start 4-byte aligned (out and out_stride even: every thread), else scalars.
  if ((reinterpret_cast<uintptr_t>(o) & 3) == 0) {
#pragma unroll
    for (int q = 0; q < 4; ++q) reinterpret_cast<__nv_bfloat162*>(o)[q] = __floats2bfloat162_rn(s[2 * q], s[2 * q + 1]);
  } else {
#pragma unroll
    for (int c = 0; c < 8; ++c) o[c] = __float2bfloat16(s[c]);
  }
}

}  // namespace

void launch_moe_combine(const __nv_bfloat16* y, int y_stride, const float* topk_weights, const int32_t* num_tokens,
                        int capacity, int top_k, int hidden, __nv_bfloat16* out, int out_stride, cudaStream_t stream,
                        bool trigger_early) {
  MOEBIUS_LAUNCH_ASSERT(top_k >= 1 && hidden >= 1, "bad combine shape");
  MOEBIUS_LAUNCH_ASSERT(capacity <= 65535, "capacity must fit grid.y");
  MOEBIUS_LAUNCH_ASSERT(hidden % 8 == 0 && y_stride % 8 == 0 && reinterpret_cast<uintptr_t>(y) % 16 == 0,
                        "bf16 y combine: y rows 16-byte aligned (hidden, y_stride multiples of 8)");
  if (capacity <= 0) return;
  const dim3 grid((hidden + kCombineThreads * 8 - 1) / (kCombineThreads * 8), capacity);
  launch_pdl(moe_combine_bf16_kernel, grid, dim3(kCombineThreads), 0, stream, y, y_stride, topk_weights, num_tokens,
             capacity, top_k, hidden, out, out_stride, trigger_early);
}

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
