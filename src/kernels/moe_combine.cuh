// The MoE combine and the router GEMV: the two small kernels around the expert GEMMs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moebius::kernels {

// out[t][n] = bf16( sum_{s=0..k-1} w[t*k+s] * y[t*k+s][n] ), summed in slot order in fp32, so the
// default (non-atomic) MoE output is bit-identical run to run.
//   y            [capacity*k, y_stride] fp32
//   topk_weights [capacity*k] fp32
//   out          [capacity, out_stride] bf16; rows >= *num_tokens untouched.
// [TAG_MOE_GRAPH_CAPACITY] num_tokens is a device pointer; the grid covers `capacity` rows.
void launch_moe_combine(const float* y, int y_stride, const float* topk_weights, const int32_t* num_tokens,
                        int capacity, int top_k, int hidden, __nv_bfloat16* out, int out_stride, cudaStream_t stream);

// logits[t][e] = sum_h W[e][h] * x[t][h] in fp32 (the router, "mlp.gate").
//   x       [capacity, x_stride] bf16;  W [E, H] bf16 row-major;  logits [capacity, E] fp32.
// One warp per (expert, 8 tokens): the warp's expert row is reused from registers for 8 tokens.
void launch_moe_router_logits(const __nv_bfloat16* x, int x_stride, const __nv_bfloat16* router_weight,
                              const int32_t* num_tokens, int capacity, int hidden, int num_experts, float* logits,
                              cudaStream_t stream);

}  // namespace moebius::kernels
