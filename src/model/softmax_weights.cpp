#include "model/softmax_weights.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace moebius::model {

namespace {

// The weight, written once over float and over a vector of 4 floats. The constant 12582912 is
// 1.5 * 2^23: adding and subtracting it rounds to the nearest integer in the current (nearest)
// rounding mode; ln2 is split in two (0.693359375 is exact in a few bits) so n * ln2 loses
// nothing; 2^n is n + 127 in the exponent bits. d is first clamped to -87 so the reduction stays
// finite, and the lanes below it are zeroed at the end.
template <typename F, typename I>
F exp_weight_t(F d) {
  const F lim = F{} - 87.0f;
  const auto live = d >= lim;
  d = live ? d : lim;
  const F shift = F{} + 12582912.0f;
  const F n = (d * 1.44269504088896341f + shift) - shift;
  const F r = (d - n * 0.693359375f) - n * -2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  I bits;
  if constexpr (std::is_same_v<F, float>) bits = (static_cast<I>(n) + 127) << 23;
  else bits = (__builtin_convertvector(n, I) + 127) << 23;
  F scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const F w = p * scale;
  return live ? w : F{};
}

// 16-byte vectors: the width baseline x86-64 has (32-byte ones would change the calling ABI by
// compiler flags).
using Floats4 = float __attribute__((vector_size(16)));
using Ints4 = int32_t __attribute__((vector_size(16)));
using Doubles2 = double __attribute__((vector_size(16)));

}  // namespace

float exp_weight(float d) { return exp_weight_t<float, int32_t>(d); }

double combine_partial_sums(const double (&part)[8]) {
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

double exp_weight_sum(std::span<const float> logits, float scale, float mx) {
  Doubles2 acc[4] = {};  // partials 0-1, 2-3, 4-5, 6-7
  const size_t V = logits.size(), full = V / 8 * 8;
  for (size_t i = 0; i < full; i += 8) {
    Floats4 x[2];
    std::memcpy(x, logits.data() + i, sizeof x);
    for (int h = 0; h < 2; ++h) {
      const Floats4 w = exp_weight_t<Floats4, Ints4>(x[h] * scale - mx);  // -inf * scale - mx = -inf: 0
      acc[2 * h] += __builtin_convertvector(__builtin_shufflevector(w, w, 0, 1), Doubles2);
      acc[2 * h + 1] += __builtin_convertvector(__builtin_shufflevector(w, w, 2, 3), Doubles2);
    }
  }
  double part[8] = {acc[0][0], acc[0][1], acc[1][0], acc[1][1], acc[2][0], acc[2][1], acc[3][0], acc[3][1]};
  for (size_t i = full; i < V; ++i)
    if (logits[i] != -INFINITY) part[i & 7] += static_cast<double>(exp_weight(logits[i] * scale - mx));
  return combine_partial_sums(part);
}

}  // namespace moebius::model
