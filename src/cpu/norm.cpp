#include "cpu/norm.h"

#include <cmath>

namespace moebius::cpu {

void rms_norm_reference(const float* x, const float* w, int64_t rows, int64_t n, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(n)) + eps);
    for (int64_t i = 0; i < n; ++i) out[r * n + i] = xr[i] * inv * w[i];
  }
}

}  // namespace moebius::cpu
