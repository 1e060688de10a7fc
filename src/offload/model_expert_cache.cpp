#include "offload/model_expert_cache.h"

#include <fmt/format.h>

namespace moebius::offload {

double ModelCacheStats::hit_rate() const {
  return routed_pairs ? static_cast<double>(resident_pairs) / static_cast<double>(routed_pairs) : 0.0;
}

ModelCacheStats ModelCacheStats::since(const ModelCacheStats& b) const {
  ModelCacheStats d;
  d.steps = steps - b.steps;
  d.dropped_steps = dropped_steps - b.dropped_steps;
  d.tokens = tokens - b.tokens;
  d.routed_pairs = routed_pairs - b.routed_pairs;
  d.resident_pairs = resident_pairs - b.resident_pairs;
  d.ignored_ids = ignored_ids - b.ignored_ids;
  d.swaps = swaps - b.swaps;
  d.swap_bytes = swap_bytes - b.swap_bytes;
  return d;
}

Result<ModelExpertCache> ModelExpertCache::create(const std::vector<std::vector<uint8_t>>& resident,
                                                  const CacheOptions& options, uint64_t bytes_per_swap) {
  if (resident.empty()) return Error("a model cache needs at least one MoE layer");
  ModelExpertCache m;
  m.opt_ = options;
  m.num_experts_ = static_cast<int>(resident.front().size());
  m.bytes_per_swap_ = bytes_per_swap;
  for (size_t i = 0; i < resident.size(); ++i) {
    if (static_cast<int>(resident[i].size()) != m.num_experts_)
      return Error::format("MoE layer {} has {} experts, layer 0 has {}", i, resident[i].size(), m.num_experts_);
    auto c = ExpertCache::create(resident[i], options);
    if (!c.ok()) return std::move(c).error().with_context(fmt::format("MoE layer {}", i));
    m.caches_.push_back(std::move(c).value());
  }
  return m;
}

void ModelExpertCache::snapshot(std::span<uint8_t> out) const {
  const size_t E = static_cast<size_t>(num_experts_);
  MOEBIUS_ASSERT(out.size() == caches_.size() * E);
  for (size_t i = 0; i < caches_.size(); ++i)
    for (size_t e = 0; e < E; ++e) out[i * E + e] = caches_[i].resident(static_cast<int>(e)) ? 1 : 0;
}

std::vector<ModelExpertCache::Swap> ModelExpertCache::feed(std::span<const int32_t> ids, size_t stride, int rows, int k,
                                                           std::span<const uint8_t> ran_with) {
  const size_t E = static_cast<size_t>(num_experts_), n = static_cast<size_t>(rows) * static_cast<size_t>(k);
  MOEBIUS_ASSERT(rows >= 0 && k >= 1 && n <= stride);
  MOEBIUS_ASSERT(ids.size() >= (caches_.size() - 1) * stride + n && ran_with.size() == caches_.size() * E);
  ++stats_.steps;
  stats_.tokens += static_cast<uint64_t>(rows);
  std::vector<Swap> out;
  for (size_t i = 0; i < caches_.size(); ++i) {
    valid_.clear();
    for (int32_t e : ids.subspan(i * stride, n)) {
      if (e < 0 || static_cast<size_t>(e) >= E) {
        ++stats_.ignored_ids;
        continue;
      }
      valid_.push_back(e);
      ++stats_.routed_pairs;
      stats_.resident_pairs += ran_with[i * E + static_cast<size_t>(e)] ? 1 : 0;
    }
    for (const CacheSwap& s : caches_[i].step(valid_)) out.push_back({static_cast<int>(i), s.admit, s.evict});
  }
  stats_.swaps += out.size();
  stats_.swap_bytes += out.size() * bytes_per_swap_;
  return out;
}

}  // namespace moebius::offload
