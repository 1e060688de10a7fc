#include "cpu/rope.h"

#include <cmath>

namespace moebius::cpu {

std::vector<float> rope_inv_freq(double theta, int head_dim) {
  std::vector<float> f;
  for (int i = 0; i < head_dim / 2; ++i) f.push_back(static_cast<float>(std::pow(theta, -2.0 * i / head_dim)));
  return f;
}

void rope_neox_reference(float* x, int64_t T, int heads, int hd, const int64_t* positions, const float* inv_freq) {
  const int half = hd / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float pos = static_cast<float>(positions[t]);
    for (int i = 0; i < half; ++i) {
      const float angle = pos * inv_freq[i];
      const float c = static_cast<float>(std::cos(static_cast<double>(angle)));
      const float s = static_cast<float>(std::sin(static_cast<double>(angle)));
      for (int h = 0; h < heads; ++h) {
        float* v = x + (t * heads + h) * hd;
        const float a = v[i], b = v[i + half];
        v[i] = a * c - b * s;
        v[i + half] = b * c + a * s;
      }
    }
  }
}

}  // namespace moebius::cpu
