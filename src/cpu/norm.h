// The CPU reference RMSNorm, shared by the Qwen3-MoE CPU backend and the CUDA norm tests.
#pragma once

#include <cstdint>

namespace moebius::cpu {

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w for `rows` rows of n: x, out [rows, n],
// w [n], all fp32. The sum of squares is accumulated in double; the scale is rounded to fp32 and
// applied as (x * inv) * w, the order the CUDA kernels follow. In place (out == x) is fine.
// Per-head norms (Qwen3's q_norm / k_norm) are this over [T * heads, hd].
void rms_norm_reference(const float* x, const float* w, int64_t rows, int64_t n, float eps, float* out);

}  // namespace moebius::cpu
