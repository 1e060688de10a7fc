#include "model/sampler.h"

#include <algorithm>
#include <cmath>

namespace moebius::model {

Status validate_sampler_params(const SamplerParams& p) {
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature))
    return Error::format("must be a finite number >= 0 (0 = greedy), got {}", p.temperature).in_field("--temperature");
  if (p.top_k < 0) return Error::format("must be >= 0 (0 = off), got {}", p.top_k).in_field("--top-k");
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f))
    return Error::format("must be in (0, 1] (1 = off), got {}", p.top_p).in_field("--top-p");
  if (!(p.min_p >= 0.0f && p.min_p < 1.0f))
    return Error::format("must be in [0, 1) (0 = off), got {}", p.min_p).in_field("--min-p");
  return Ok{};
}

int32_t argmax(std::span<const float> logits) {
  int32_t best = 0;
  bool found = false;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (std::isnan(logits[i])) continue;
    if (!found || logits[i] > logits[static_cast<size_t>(best)]) {  // strict: first max wins
      best = static_cast<int32_t>(i);
      found = true;
    }
  }
  return best;
}

Result<Sampler> Sampler::create(const SamplerParams& params) {
  MOEBIUS_TRY(validate_sampler_params(params));
  return Sampler(params);
}

Result<std::vector<std::pair<int32_t, float>>> Sampler::candidates(std::span<const float> logits) {
  if (logits.empty()) return Error("empty logits row");
  // A NaN means a broken forward pass: refuse it rather than sample around it.
  for (size_t i = 0; i < logits.size(); ++i)
    if (std::isnan(logits[i])) return Error::format("logit {} is NaN", i);
  std::vector<std::pair<int32_t, float>> out;
  if (params_.temperature == 0.0f) {
    const int32_t id = argmax(logits);
    if (logits[static_cast<size_t>(id)] == -INFINITY) return Error("every logit is -inf");
    out.emplace_back(id, 1.0f);
    return out;
  }
  // 1. temperature. -inf logits (masked tokens) stay out.
  scratch_.clear();
  const float inv_t = 1.0f / params_.temperature;
  for (size_t i = 0; i < logits.size(); ++i) {
    const float x = logits[i];
    if (x == -INFINITY) continue;
    scratch_.emplace_back(x * inv_t, static_cast<int32_t>(i));
  }
  if (scratch_.empty()) return Error("every logit is -inf");
  // Most probable first; equal logits by ascending id, so the order (and so the draw) is total.
  const auto before = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  // 2. top-k: only the k kept need sorting.
  size_t n = scratch_.size();
  if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < n) n = static_cast<size_t>(params_.top_k);
  std::partial_sort(scratch_.begin(), scratch_.begin() + static_cast<std::ptrdiff_t>(n), scratch_.end(), before);
  // 3. softmax (double accumulation, max subtracted), then top-p.
  const double mx = scratch_[0].first;
  std::vector<double> prob(n);
  double total = 0.0;
  for (size_t i = 0; i < n; ++i) total += prob[i] = std::exp(static_cast<double>(scratch_[i].first) - mx);
  size_t keep = n;
  if (params_.top_p < 1.0f) {
    double cum = 0.0;
    for (size_t i = 0; i < n; ++i) {
      cum += prob[i] / total;
      if (cum >= params_.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  // 4. min-p, relative to the largest probability (prob[0] == 1 before normalization).
  if (params_.min_p > 0.0f) {
    size_t m = 1;
    while (m < keep && prob[m] >= static_cast<double>(params_.min_p) * prob[0]) ++m;
    keep = m;
  }
  double kept = 0.0;
  for (size_t i = 0; i < keep; ++i) kept += prob[i];
  out.reserve(keep);
  for (size_t i = 0; i < keep; ++i) out.emplace_back(scratch_[i].second, static_cast<float>(prob[i] / kept));
  return out;
}

Result<int32_t> Sampler::sample(std::span<const float> logits) {
  MOEBIUS_ASSIGN_OR_RETURN(auto cands, candidates(logits));
  if (params_.temperature == 0.0f) return cands[0].first;
  // 5. u in [0, 1) from the top 53 bits (drawn even for one candidate, so the RNG stream does not
  // depend on the filters' outcome); walk the cumulative distribution.
  const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53;
  double cum = 0.0;
  for (const auto& [id, p] : cands) {
    cum += p;
    if (u < cum) return id;
  }
  return cands.back().first;  // rounding left u just above the float sum
}

}  // namespace moebius::model
