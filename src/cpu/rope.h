// The CPU reference rotary position embedding (RoPE), neox layout, shared by the Qwen3-MoE CPU
// backend and the CUDA rope tests.
#pragma once

#include <cstdint>
#include <vector>

namespace moebius::cpu {

// inv_freq[i] = theta^(-2i / hd) for i < hd / 2, computed in double and rounded to fp32 as
// transformers stores it (its default rope type; rope_scaling other than "default" is refused by
// the config parser). The CUDA kernels take this same array, uploaded.
std::vector<float> rope_inv_freq(double theta, int head_dim);

// RoPE, neox layout, in place on x [T, heads, hd] fp32; token t is at positions[t]. The pair
// (x[i], x[i + hd/2]) is rotated by angle = float(pos) * inv_freq[i], formed in fp32 as transformers
// does so long positions round the same way; cos/sin of that fp32 angle are computed in double
// and rounded to fp32.
void rope_neox_reference(float* x, int64_t T, int heads, int hd, const int64_t* positions, const float* inv_freq);

}  // namespace moebius::cpu
