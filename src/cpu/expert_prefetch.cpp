#include "cpu/expert_prefetch.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace moebius::cpu {

std::vector<float> expert_prefetch_logits(const ExpertPrefetchShape& s, int tokens, std::span<const float> resid,
                                          std::span<const bf16> delta, std::span<const float> norm_weight,
                                          std::span<const bf16> router, std::span<const float> correction_bias) {
  const size_t H = static_cast<size_t>(s.hidden), E = static_cast<size_t>(s.num_experts);
  const size_t T = static_cast<size_t>(std::max(tokens, 0));
  MOEBIUS_ASSERT(resid.size() >= T * H && (delta.empty() || delta.size() >= T * H) && norm_weight.size() >= H &&
                 router.size() >= E * H && (correction_bias.empty() || correction_bias.size() >= E));
  std::vector<float> logits(T * E);
  std::vector<float> x(H), xn(H);
  for (size_t t = 0; t < T; ++t) {
    double ss = 0;
    for (size_t i = 0; i < H; ++i) {
      x[i] = resid[t * H + i] + (delta.empty() ? 0.0f : static_cast<float>(delta[t * H + i]));
      ss += static_cast<double>(x[i]) * x[i];
    }
    const float r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(H) + s.eps));
    for (size_t i = 0; i < H; ++i) xn[i] = static_cast<float>(bf16(x[i] * r * norm_weight[i]));
    for (size_t e = 0; e < E; ++e) {
      double acc = 0;
      for (size_t i = 0; i < H; ++i) acc += static_cast<double>(static_cast<float>(router[e * H + i])) * xn[i];
      logits[t * E + e] = static_cast<float>(acc) + (correction_bias.empty() ? 0.0f : correction_bias[e]);
    }
  }
  return logits;
}

std::vector<int> expert_prefetch_select(const ExpertPrefetchShape& s, int tokens, std::span<const float> logits,
                                        std::span<const uint8_t> cold, int slots) {
  const int E = s.num_experts, k = s.top_k;
  MOEBIUS_ASSERT(logits.size() >= static_cast<size_t>(std::max(tokens, 0)) * static_cast<size_t>(E) &&
                 cold.size() >= static_cast<size_t>(E));
  std::vector<int> score(static_cast<size_t>(E), 0);
  for (int t = 0; t < tokens; ++t) {
    const float* l = logits.data() + static_cast<size_t>(t) * static_cast<size_t>(E);
    for (int e = 0; e < E; ++e) {
      int rank = 0;
      for (int o = 0; o < E; ++o) rank += (l[o] > l[e] || (l[o] == l[e] && o < e)) ? 1 : 0;
      score[static_cast<size_t>(e)] += std::max(0, k - rank);
    }
  }
  std::vector<int> ids;
  for (int e = 0; e < E; ++e)
    if (cold[static_cast<size_t>(e)] != 0 && score[static_cast<size_t>(e)] > 0) ids.push_back(e);
  std::stable_sort(ids.begin(), ids.end(),
                   [&](int a, int b) { return score[static_cast<size_t>(a)] > score[static_cast<size_t>(b)]; });
  if (static_cast<int>(ids.size()) > slots) ids.resize(static_cast<size_t>(std::max(slots, 0)));
  return ids;
}

}  // namespace moebius::cpu
