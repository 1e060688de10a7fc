#include "offload/cost_model.h"

#include <algorithm>
#include <cmath>

namespace moebius::offload {

const char* cold_path_name(ColdPath p) { return p == ColdPath::kStaged ? "staged" : "zero-copy"; }

ColdCost cold_path_cost(const ColdLayerShape& s, const LinkRates& r) {
  ColdCost c;
  if (s.cold_experts <= 0 || s.expert_bytes == 0 || s.num_experts <= 0) return c;
  const int64_t pairs = s.tokens;
  const double p = std::min(1.0, static_cast<double>(s.top_k) / s.num_experts);
  // E[ceil(n / block_m)] for n ~ Binomial(T, k / E), summed over n (the pmf by recurrence in logs
  // so a large T stays finite); the n = 0 term reads nothing.
  double tiles = 0, touched = 0;
  if (p >= 1.0) {  // k == E: every token routes to every expert
    touched = 1;
    tiles = static_cast<double>((pairs + s.block_m - 1) / s.block_m);
  } else {
    const double lq = std::log1p(-p), lp = std::log(p);
    double log_pmf = static_cast<double>(pairs) * lq;  // n = 0
    const int64_t n_max = pairs;
    for (int64_t n = 1; n <= n_max; ++n) {
      log_pmf += std::log(static_cast<double>(pairs - n + 1)) - std::log(static_cast<double>(n)) + lp - lq;
      const double pmf = std::exp(log_pmf);
      touched += pmf;
      tiles += pmf * static_cast<double>((n + s.block_m - 1) / s.block_m);
      if (static_cast<double>(n) > static_cast<double>(pairs) * p * 4 + 64 && pmf < 1e-12) break;  // the tail is negligible
    }
  }
  const double eb = static_cast<double>(s.expert_bytes);
  c.touched_cold = touched * s.cold_experts;
  c.zero_copy_bytes = tiles * s.cold_experts * eb;
  c.staged_bytes = static_cast<double>(s.cold_experts) * eb;
  c.zero_copy_us = c.zero_copy_bytes / (r.zero_copy_gbps * 1e3);
  const double copy_us = c.staged_bytes / (r.dma_gbps * 1e3) + r.dma_latency_us;
  c.staged_us = std::max(0.0, copy_us - s.hidden_compute_us);
  c.choice = c.staged_us < c.zero_copy_us ? ColdPath::kStaged : ColdPath::kZeroCopy;
  return c;
}

}  // namespace moebius::offload
