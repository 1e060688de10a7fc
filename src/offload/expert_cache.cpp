#include "offload/expert_cache.h"

#include <algorithm>
#include <cmath>

namespace moebius::offload {

const char* cache_policy_name(CachePolicy p) {
  switch (p) {
    case CachePolicy::kStatic: return "static";
    case CachePolicy::kLru: return "lru";
    case CachePolicy::kFreqDecay: return "freq";
  }
  return "?";
}

Result<CachePolicy> parse_cache_policy(const std::string& s, const std::string& field) {
  if (s == "static") return CachePolicy::kStatic;
  if (s == "lru") return CachePolicy::kLru;
  if (s == "freq") return CachePolicy::kFreqDecay;
  return Error::format("'{}' is not a cache policy (static, lru, freq)", s).in_field(field);
}

Result<std::optional<CacheOptions>> parse_expert_cache_flags(const ExpertCacheFlags& f, bool offloading) {
  if (f.policy != "off" && f.policy != "lru" && f.policy != "freq")
    return Error::format("'{}': expected off, lru or freq", f.policy).in_field("--expert-cache");
  if (!(f.decay > 0 && f.decay <= 1))
    return Error::format("must be in (0, 1], got {}", f.decay).in_field("--expert-cache-decay");
  if (f.max_swaps < 0) return Error::format("must be >= 0, got {}", f.max_swaps).in_field("--expert-cache-swaps");
  if (f.policy == "off") return std::optional<CacheOptions>{};
  if (!offloading)
    return Error::format("--expert-cache {} needs expert offload (--gpu-memory-budget): without it every expert "
                         "stays on the GPU and none is cold",
                         f.policy)
        .in_field("--expert-cache");
  CacheOptions o;
  MOEBIUS_ASSIGN_OR_RETURN(o.policy, parse_cache_policy(f.policy, "--expert-cache"));
  o.decay = f.decay;
  o.max_swaps_per_step = f.max_swaps;
  return std::optional<CacheOptions>{o};
}

std::string first_offload_flag(const std::string& gpu_memory_budget, const std::string& placement_file,
                               const ExpertCacheFlags& cache, int expert_prefetch, int expert_dma) {
  if (!gpu_memory_budget.empty()) return "--gpu-memory-budget";
  if (!placement_file.empty()) return "--placement";
  if (cache.policy != "off") return "--expert-cache";
  if (expert_prefetch != 0) return "--expert-prefetch";
  if (expert_dma > 0) return "--expert-dma";  // 0 is off, -1 absent
  return "";
}

Result<ExpertCache> ExpertCache::create(std::span<const uint8_t> resident, const CacheOptions& o) {
  if (resident.empty()) return Error("a layer needs at least one expert");
  if (!(o.decay > 0 && o.decay <= 1)) return Error::format("must be in (0, 1], got {}", o.decay).in_field("decay");
  if (o.max_swaps_per_step < 0)
    return Error::format("must be >= 0, got {}", o.max_swaps_per_step).in_field("max_swaps_per_step");
  ExpertCache c;
  c.opt_ = o;
  const size_t E = resident.size();
  c.slot_of_.assign(E, -1);
  c.last_use_.assign(E, 0);
  c.score_.assign(E, 0.0);
  c.seen_.assign(E, 0);
  for (size_t e = 0; e < E; ++e)
    if (resident[e]) {
      c.slot_of_[e] = static_cast<int>(c.expert_in_.size());
      c.expert_in_.push_back(static_cast<int>(e));
    }
  return c;
}

std::vector<CacheSwap> ExpertCache::step(std::span<const int32_t> experts) {
  ++step_;
  const uint64_t now = step_;
  // Distinct routed experts of this forward, in first-seen order.
  std::vector<int> routed;
  for (int32_t e : experts) {
    MOEBIUS_ASSERT(e >= 0 && static_cast<size_t>(e) < slot_of_.size(), "expert {} outside the layer", e);
    if (seen_[static_cast<size_t>(e)] == now) continue;
    seen_[static_cast<size_t>(e)] = now;
    routed.push_back(e);
  }
  if (opt_.policy == CachePolicy::kFreqDecay)
    for (double& s : score_) s *= opt_.decay;
  std::vector<int> missed;
  for (int e : routed) {
    const size_t ue = static_cast<size_t>(e);
    last_use_[ue] = now;
    score_[ue] += 1.0;
    if (slot_of_[ue] >= 0) {
      ++hits_;
    } else {
      ++misses_;
      missed.push_back(e);
    }
  }
  std::vector<CacheSwap> swaps;
  if (opt_.policy == CachePolicy::kStatic || expert_in_.empty()) return swaps;
  // Hottest misses first (freq), or in routing order (LRU: all are equally recent).
  if (opt_.policy == CachePolicy::kFreqDecay)
    std::stable_sort(missed.begin(), missed.end(),
                     [&](int a, int b) { return score_[static_cast<size_t>(a)] > score_[static_cast<size_t>(b)]; });
  for (int e : missed) {
    if (static_cast<int>(swaps.size()) >= opt_.max_swaps_per_step) break;
    // Victim: a resident expert not routed in this forward, least recently used (LRU) or lowest
    // score (freq); ties go to the lower slot.
    int victim_slot = -1;
    for (size_t s = 0; s < expert_in_.size(); ++s) {
      const size_t v = static_cast<size_t>(expert_in_[s]);
      if (seen_[v] == now) continue;
      if (victim_slot < 0) {
        victim_slot = static_cast<int>(s);
        continue;
      }
      const size_t best = static_cast<size_t>(expert_in_[static_cast<size_t>(victim_slot)]);
      const bool better = opt_.policy == CachePolicy::kLru ? last_use_[v] < last_use_[best] : score_[v] < score_[best];
      if (better) victim_slot = static_cast<int>(s);
    }
    if (victim_slot < 0) break;  // every resident expert is in use by this forward
    const int victim = expert_in_[static_cast<size_t>(victim_slot)];
    if (opt_.policy == CachePolicy::kFreqDecay && !(score_[static_cast<size_t>(e)] > score_[static_cast<size_t>(victim)]))
      break;  // missed experts are sorted by score: no later one beats the victim either
    slot_of_[static_cast<size_t>(victim)] = -1;
    slot_of_[static_cast<size_t>(e)] = victim_slot;
    expert_in_[static_cast<size_t>(victim_slot)] = e;
    seen_[static_cast<size_t>(e)] = now;  // the new resident is not a victim of this step either
    swaps.push_back({victim, e, victim_slot});
    ++swaps_;
  }
  return swaps;
}

Result<double> simulate_hit_rate(std::span<const uint8_t> resident, const CacheOptions& options,
                                 const std::vector<std::vector<int32_t>>& trace) {
  MOEBIUS_ASSIGN_OR_RETURN(ExpertCache c, ExpertCache::create(resident, options));
  for (const std::vector<int32_t>& step : trace) (void)c.step(step);
  return c.hit_rate();
}

}  // namespace moebius::offload
