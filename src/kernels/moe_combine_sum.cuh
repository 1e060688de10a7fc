// The MoE combine's arithmetic, as a device function: the routed weights applied to one token's k
// expert outputs for 4 consecutive columns. Two kernels run it and must produce the same bits:
// moe_combine.cu (the combine stage) and dense_gemv.cu, whose RMSNorm prologue can fold the
// combine of the previous MoE layer ([TAG_MOE_DEFERRED_COMBINE]). One definition keeps the order
// of the fp32 operations, and so the bits, the same in both.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moebius::kernels::moe_detail {

// sum_{s=0..k-1} w[s] * y[s * y_stride + c] for c = 0..3, in slot order, each step one fp32
// multiply-add (fmaf: the rounding does not depend on the compiler's contraction choices).
//   y  slot 0's 4 columns: [k][y_stride] fp32, 16-byte aligned, y_stride a multiple of 4
//   w  [k] fp32
// kStreaming: the loads are evict-first (ld.global.cs), for a reader that touches each value once
// (the combine stage); the folded combine reads the same rows from every GEMV block, so it keeps
// the default policy and the rows stay in L2.
template <bool kStreaming>
__device__ __forceinline__ float4 moe_combine_quad(const float* __restrict__ y, int64_t y_stride,
                                                   const float* __restrict__ w, int top_k) {
  constexpr int kBatch = 8;  // slots in flight per thread: a decode token is one L2 round trip
  float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int j0 = 0; j0 < top_k; j0 += kBatch) {
    float4 v[kBatch];
    float wj[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (j0 + j < top_k) {
        const float4* p = reinterpret_cast<const float4*>(y + static_cast<int64_t>(j0 + j) * y_stride);
        v[j] = kStreaming ? __ldcs(p) : *p;
        wj[j] = w[j0 + j];
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (j0 + j < top_k) {
        s.x = fmaf(wj[j], v[j].x, s.x);
        s.y = fmaf(wj[j], v[j].y, s.y);
        s.z = fmaf(wj[j], v[j].z, s.z);
        s.w = fmaf(wj[j], v[j].w, s.w);
      }
    }
  }
  return s;
}

}  // namespace moebius::kernels::moe_detail
