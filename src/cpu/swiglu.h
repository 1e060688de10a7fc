// SwiGLU of a dense MLP in fp32: the reference for kernels::launch_swiglu and the activation of
// the Qwen3-MoE CPU backend's dense layers.
#pragma once

#include <cstdint>

namespace moebius::cpu {

// out[t, i] = silu(gate[t, i]) * up[t, i],  silu(g) = g / (1 + exp(-g)); gate, up, out [T, I]
// with row strides gate_stride, up_stride and I (out may alias gate).
void swiglu_reference(const float* gate, int64_t gate_stride, const float* up, int64_t up_stride, int64_t T,
                      int64_t I, float* out);

}  // namespace moebius::cpu
