#include "cpu/moe_router.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace moebius::cpu {

Status RouterConfig::validate() const {
  if (num_experts <= 0) return Error::format("must be positive, got {}", num_experts).in_field("num_experts");
  if (top_k <= 0 || top_k > num_experts)
    return Error::format("must be in [1, num_experts={}], got {}", num_experts, top_k).in_field("top_k");
  if (scoring == RouterScoring::kSigmoid) {
    if (n_groups <= 0 || num_experts % n_groups != 0)
      return Error::format("must divide num_experts={}, got {}", num_experts, n_groups).in_field("n_group");
    if (topk_groups <= 0 || topk_groups > n_groups)
      return Error::format("must be in [1, n_group={}], got {}", n_groups, topk_groups).in_field("topk_group");
    if (top_k > topk_groups * (num_experts / n_groups))
      return Error::format("top_k={} exceeds the {} experts in the kept groups", top_k,
                           topk_groups * (num_experts / n_groups))
          .in_field("top_k");
    if (!correction_bias.empty() && static_cast<int>(correction_bias.size()) != num_experts)
      return Error::format("has {} entries, expected num_experts={}", correction_bias.size(), num_experts)
          .in_field("e_score_correction_bias");
  } else if (n_groups != 1 || !correction_bias.empty()) {
    return Error("group-limited routing and correction bias need sigmoid scoring").in_field("scoring_func");
  }
  return Ok{};
}

namespace {

// Indices of the k largest values, descending, ties to the lower index. `allowed` masks entries.
void top_k_indices(const float* v, int n, int k, const std::vector<char>& allowed, int32_t* out) {
  std::vector<int32_t> idx;
  idx.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i)
    if (allowed.empty() || allowed[static_cast<size_t>(i)]) idx.push_back(i);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [v](int32_t a, int32_t b) {
    return v[a] > v[b] || (v[a] == v[b] && a < b);
  });
  std::copy(idx.begin(), idx.begin() + k, out);
}

}  // namespace

Status route_reference(const RouterConfig& cfg, const float* logits, int64_t num_tokens, int32_t* expert_ids,
                       float* weights) {
  MOEBIUS_TRY(cfg.validate());
  const int E = cfg.num_experts, k = cfg.top_k;

#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* x = logits + t * E;
    int32_t* ids = expert_ids + t * k;
    float* w = weights + t * k;
    std::vector<float> score(static_cast<size_t>(E));

    if (cfg.scoring == RouterScoring::kSoftmax) {
      const float mx = *std::max_element(x, x + E);
      double sum = 0;
      for (int e = 0; e < E; ++e) {
        score[e] = std::exp(x[e] - mx);
        sum += score[e];
      }
      for (int e = 0; e < E; ++e) score[e] = static_cast<float>(score[e] / sum);
      top_k_indices(score.data(), E, k, {}, ids);
      for (int j = 0; j < k; ++j) w[j] = score[ids[j]];
    } else {
      std::vector<float> choice(static_cast<size_t>(E));
      for (int e = 0; e < E; ++e) {
        score[e] = 1.0f / (1.0f + std::exp(-x[e]));
        choice[e] = score[e] + (cfg.correction_bias.empty() ? 0.0f : cfg.correction_bias[e]);
      }
      std::vector<char> allowed;
      if (cfg.n_groups > 1) {
        const int per = E / cfg.n_groups;
        std::vector<float> group_score(static_cast<size_t>(cfg.n_groups));
        for (int g = 0; g < cfg.n_groups; ++g) {
          // The sum of the two best choice scores in the group (one if the group has one expert).
          std::vector<float> c(choice.begin() + g * per, choice.begin() + (g + 1) * per);
          std::sort(c.begin(), c.end(), std::greater<float>());
          group_score[g] = c[0] + (per > 1 ? c[1] : 0.0f);
        }
        std::vector<int32_t> keep(static_cast<size_t>(cfg.topk_groups));
        top_k_indices(group_score.data(), cfg.n_groups, cfg.topk_groups, {}, keep.data());
        allowed.assign(static_cast<size_t>(E), 0);
        for (int32_t g : keep)
          for (int e = g * per; e < (g + 1) * per; ++e) allowed[e] = 1;
      }
      top_k_indices(choice.data(), E, k, allowed, ids);
      for (int j = 0; j < k; ++j) w[j] = score[ids[j]];
    }

    if (cfg.renormalize) {
      double s = 0;
      for (int j = 0; j < k; ++j) s += w[j];
      // DeepSeek-V3 adds 1e-20 to the denominator; softmax weights are strictly positive anyway.
      for (int j = 0; j < k; ++j) w[j] = static_cast<float>(w[j] / (s + 1e-20));
    }
    if (cfg.scoring == RouterScoring::kSigmoid)
      for (int j = 0; j < k; ++j) w[j] *= cfg.routed_scaling_factor;
  }
  return Ok{};
}

}  // namespace moebius::cpu
