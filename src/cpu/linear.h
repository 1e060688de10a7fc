// The CPU reference dense linear layer, shared by the MoE router and the model runner.
#pragma once

#include <cstdint>

namespace moebius::cpu {

// y[t, n] = sum_k x[t, k] * W[n, k]: x [T, K], W [N, K] (torch's Linear layout), y [T, N] fp32.
// Accumulated in double so the reference is never the noisier side of a comparison.
void linear_reference(const float* x, const float* w, int64_t T, int64_t N, int64_t K, float* y);

}  // namespace moebius::cpu
