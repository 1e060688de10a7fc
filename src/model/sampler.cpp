#include "model/sampler.h"

#include <algorithm>
#include <cfloat>
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
  if (!(p.repetition_penalty > 0.0f) || !std::isfinite(p.repetition_penalty))
    return Error::format("must be a finite number > 0 (1 = off), got {}", p.repetition_penalty)
        .in_field("--repetition-penalty");
  if (!(std::fabs(p.presence_penalty) <= kMaxOpenAiPenalty))
    return Error::format("must be in [-2, 2] (0 = off), got {}", p.presence_penalty).in_field("--presence-penalty");
  if (!(std::fabs(p.frequency_penalty) <= kMaxOpenAiPenalty))
    return Error::format("must be in [-2, 2] (0 = off), got {}", p.frequency_penalty).in_field("--frequency-penalty");
  for (const auto& [id, bias] : p.logit_bias) {
    if (id < 0) return Error::format("token id {} is negative", id).in_field("logit_bias");
    if (!(std::fabs(bias) <= kMaxLogitBias))
      return Error::format("the bias of token {} must be in [-100, 100], got {}", id, bias).in_field("logit_bias");
  }
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

void Sampler::observe_prompt(std::span<const int32_t> ids) {
  if (params_.repetition_penalty != 1.0f) prompt_ids_.insert(ids.begin(), ids.end());
}

Result<std::span<const float>> Sampler::adjusted(std::span<const float> logits) {
  const size_t V = logits.size();
  for (const auto& [id, bias] : params_.logit_bias)
    if (static_cast<size_t>(id) >= V)
      return Error::format("token id {} is outside the vocabulary [0, {})", id, V).in_field("logit_bias");
  const bool repetition = params_.repetition_penalty != 1.0f && (!prompt_ids_.empty() || !output_counts_.empty());
  const bool openai = (params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) && !output_counts_.empty();
  if (!repetition && !openai && params_.logit_bias.empty()) return logits;
  adjusted_.assign(logits.begin(), logits.end());
  if (repetition) {
    // Each seen id once, whether the prompt, the output or both saw it.
    const float p = params_.repetition_penalty;
    // A finite logit stays finite: a penalty near 0 (1e-39 is > 0) would divide a positive logit
    // to +inf, and inf - inf in the softmax is NaN.
    const auto penalize = [&](int32_t id) {
      if (id < 0 || static_cast<size_t>(id) >= V) return;
      float& l = adjusted_[static_cast<size_t>(id)];
      if (!std::isfinite(l)) return;  // -inf stays masked
      l = std::clamp(l > 0.0f ? l / p : l * p, -FLT_MAX, FLT_MAX);
    };
    for (int32_t id : prompt_ids_) penalize(id);
    for (const auto& [id, count] : output_counts_)
      if (!prompt_ids_.contains(id)) penalize(id);
  }
  if (openai) {
    for (const auto& [id, count] : output_counts_) {
      if (id < 0 || static_cast<size_t>(id) >= V) continue;
      adjusted_[static_cast<size_t>(id)] -=
          static_cast<float>(count) * params_.frequency_penalty + params_.presence_penalty;
    }
  }
  for (const auto& [id, bias] : params_.logit_bias) adjusted_[static_cast<size_t>(id)] += bias;
  return std::span<const float>(adjusted_);
}

Result<std::vector<std::pair<int32_t, float>>> Sampler::candidates(std::span<const float> raw) {
  if (raw.empty()) return Error("empty logits row");
  // A NaN means a broken forward pass: refuse it rather than sample around it. The adjustments
  // never make one: their factors and terms are finite, a penalized logit is clamped finite, and
  // -inf stays -inf.
  for (size_t i = 0; i < raw.size(); ++i)
    if (std::isnan(raw[i])) return Error::format("logit {} is NaN", i);
  MOEBIUS_ASSIGN_OR_RETURN(std::span<const float> logits, adjusted(raw));
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
  int32_t chosen = cands.back().first;  // if rounding leaves u just above the float sum
  if (params_.temperature == 0.0f) {
    chosen = cands[0].first;
  } else {
    // 5. u in [0, 1) from the top 53 bits (drawn even for one candidate, so the RNG stream does
    // not depend on the filters' outcome); walk the cumulative distribution.
    const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53;
    double cum = 0.0;
    for (const auto& [id, p] : cands) {
      cum += p;
      if (u < cum) {
        chosen = id;
        break;
      }
    }
  }
  if (tracks_output()) ++output_counts_[chosen];
  return chosen;
}

}  // namespace moebius::model
