#include "model/rope_frequencies.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

#include "cpu/rope.h"

namespace moebius::model {
namespace {

double yarn_mscale(double scale, double k) { return scale <= 1.0 ? 1.0 : 0.1 * k * std::log(scale) + 1.0; }

// The dimension (of d) whose frequency turns `rotations` times over `context` positions.
double correction_dim(double rotations, int d, double theta, double context) {
  return d * std::log(context / (rotations * 2.0 * std::numbers::pi)) / (2.0 * std::log(theta));
}

// A double as float, +inf past float's range (a plain cast of such a value is undefined): the
// config check then refuses it as not finite.
float to_float_or_inf(double v) {
  return std::fabs(v) <= static_cast<double>(std::numeric_limits<float>::max()) ? static_cast<float>(v)
                                                                                : std::numeric_limits<float>::infinity();
}

}  // namespace

float rope_attention_factor(const Qwen3MoeConfig& c) {
  const RopeScaling& r = c.rope_scaling;
  if (r.type != RopeScaling::Type::kYarn) return 1.0f;
  if (r.attention_factor > 0.0) return to_float_or_inf(r.attention_factor);
  if (r.mscale > 0.0 && r.mscale_all_dim > 0.0)
    return to_float_or_inf(yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim));
  return to_float_or_inf(yarn_mscale(r.factor, 1.0));
}

RopeFrequencies rope_frequencies(const Qwen3MoeConfig& c) {
  const RopeScaling& r = c.rope_scaling;
  const int d = c.head_dim;
  RopeFrequencies out;
  switch (r.type) {
    case RopeScaling::Type::kDefault:
      out.inv_freq = cpu::rope_inv_freq(c.rope_theta, d);
      return out;
    case RopeScaling::Type::kLinear:
      for (int i = 0; i < d / 2; ++i)
        out.inv_freq.push_back(static_cast<float>(std::pow(c.rope_theta, -2.0 * i / d) / r.factor));
      return out;
    case RopeScaling::Type::kYarn:
      break;
  }
  const double orig = static_cast<double>(r.original_max_position_embeddings);
  double low = correction_dim(r.beta_fast, d, c.rope_theta, orig);
  double high = correction_dim(r.beta_slow, d, c.rope_theta, orig);
  if (r.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(d - 1));
  if (low == high) high += 0.001;  // transformers' guard against a zero-width ramp
  for (int i = 0; i < d / 2; ++i) {
    const double extrapolation = std::pow(c.rope_theta, -2.0 * i / d);
    const double interpolation = extrapolation / r.factor;
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    const double keep = 1.0 - ramp;  // the share of the unscaled frequency
    out.inv_freq.push_back(static_cast<float>(interpolation * (1.0 - keep) + extrapolation * keep));
  }
  out.attention_factor = rope_attention_factor(c);
  return out;
}

}  // namespace moebius::model
