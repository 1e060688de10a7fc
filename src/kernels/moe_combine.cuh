// The MoE combine: the routed weights applied to the expert outputs, after GEMM2.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moebius::kernels {

// [TAG_MOE_DEFERRED_COMBINE] The inputs of a combine that a later kernel performs instead of the
// combine stage: the qkv GEMV's RMSNorm prologue (dense_gemv.cuh, DenseGemvRmsNorm::combine) forms
// the same bf16 row from them as launch_moe_combine would have written (moe_combine_sum.cuh).
struct MoeCombineSource {
  const float* y = nullptr;        // [capacity*k, y_stride] fp32, GEMM2's kStore rows (pair t*k+s)
  int y_stride = 0;
  const float* weights = nullptr;  // [capacity*k] fp32, the routed weights
  int top_k = 0;
  const int32_t* num_tokens = nullptr;  // device: live rows; the combine of rows past it is zero
  int capacity = 0;                     // rows y and weights hold
};

// out[t][n] = bf16( sum_{s=0..k-1} w[t*k+s] * y[t*k+s][n] ), summed in slot order in fp32, so the
// default (non-atomic) MoE output is bit-identical run to run.
//   y            [capacity*k, y_stride] fp32
//   topk_weights [capacity*k] fp32
//   out          [capacity, out_stride] bf16; rows >= *num_tokens untouched.
// [TAG_MOE_GRAPH_CAPACITY] num_tokens is a device pointer; the grid covers `capacity` rows.
// trigger_early ([TAG_PDL_EARLY_TRIGGER]): the next kernel on the stream may launch as soon as this
// one does (before its PDL wait), for a next kernel that streams weights before its own wait.
void launch_moe_combine(const float* y, int y_stride, const float* topk_weights, const int32_t* num_tokens,
                        int capacity, int top_k, int hidden, __nv_bfloat16* out, int out_stride, cudaStream_t stream,
                        bool trigger_early = false);

// [TAG_MOE_BF16_Y] The same for bf16 y rows (GEMM2 with MoeCombineMode::kStoreBf16): each value
// widened to fp32, the same slot-order fp32 sum. hidden and y_stride multiples of 8, y 16-byte
// aligned; out rows at any offset.
void launch_moe_combine(const __nv_bfloat16* y, int y_stride, const float* topk_weights, const int32_t* num_tokens,
                        int capacity, int top_k, int hidden, __nv_bfloat16* out, int out_stride, cudaStream_t stream,
                        bool trigger_early = false);

}  // namespace moebius::kernels
