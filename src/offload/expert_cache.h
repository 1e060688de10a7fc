// The dynamic expert cache of one MoE layer: pure host logic that decides, after each forward,
// which cold experts to promote into the layer's fixed set of GPU slots and which resident ones
// to demote. Moving an expert is a copy into a slot plus a write to the expert address table
// ([TAG_EXPERT_PTR_TABLE]); the forward itself never waits for it (a miss is served from pinned
// host memory in that forward), so correctness never depends on the cache's decisions.
//
// Policies (the issue: public evidence conflicts on which wins, so both are measured):
//   kStatic     never changes the placement it starts from;
//   kLru        a miss is admitted at once, evicting the least recently used resident expert;
//   kFreqDecay  every expert has a score, multiplied by `decay` each forward and raised by 1 when
//               routed to; a missed expert is admitted only when its score beats the lowest
//               resident score (a one-off miss does not evict a steadily hot expert).
// Experts routed to in the current forward are never evicted by it. At most max_swaps_per_step
// promotions per forward bound the PCIe traffic the cache adds (0: the cache only counts hits, so
// a run measures its starting placement with the same bookkeeping).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"

namespace moebius::offload {

enum class CachePolicy : uint8_t { kStatic, kLru, kFreqDecay };
const char* cache_policy_name(CachePolicy p);
// "static", "lru", "freq" (CLI spelling); error naming `field` otherwise.
Result<CachePolicy> parse_cache_policy(const std::string& s, const std::string& field);

struct CacheOptions {
  CachePolicy policy = CachePolicy::kStatic;
  double decay = 0.9;           // kFreqDecay: score multiplier per forward, in (0, 1]
  int max_swaps_per_step = 4;   // promotions per forward (>= 0)
};

// The CUDA runner's dynamic cache as the command line gives it (generate, serve, bench generate;
// cli/common_options.cpp): `--expert-cache off|lru|freq`, `--expert-cache-decay D` (freq),
// `--expert-cache-swaps N` (promotions per MoE layer per step).
struct ExpertCacheFlags {
  std::string policy = "off";
  double decay = 0.9;
  int max_swaps = 2;
};
// The options the flags ask for (nullopt: off). Every value is checked, whatever the policy; then
// a cache without expert offload (`offloading`: --gpu-memory-budget or another way of making
// experts cold was given) is an error, since no expert would be cold. Errors name the flag.
Result<std::optional<CacheOptions>> parse_expert_cache_flags(const ExpertCacheFlags& flags, bool offloading);
// The first expert-offload flag a command was given ("--gpu-memory-budget", "--placement",
// "--expert-cache", "--expert-prefetch", "--expert-dma"), or "" for none: the commands refuse them
// on the CPU backend, naming it. expert_dma: 0 (off) and -1 (not given) are no flag.
std::string first_offload_flag(const std::string& gpu_memory_budget, const std::string& placement_file,
                               const ExpertCacheFlags& cache, int expert_prefetch = 0, int expert_dma = -1);

struct CacheSwap {
  int evict = -1;  // expert leaving the GPU; its slot goes to `admit`
  int admit = -1;
  int slot = -1;
};

class ExpertCache {
 public:
  // `resident`: [E] the starting placement (placement.h); its count is the slot count.
  static Result<ExpertCache> create(std::span<const uint8_t> resident, const CacheOptions& options);

  // One forward routed to `experts` (any order, repeats allowed). Counts hits and misses, then
  // returns the swaps to apply before the next forward.
  std::vector<CacheSwap> step(std::span<const int32_t> experts);

  bool resident(int e) const { return slot_of_[static_cast<size_t>(e)] >= 0; }
  int slot_of(int e) const { return slot_of_[static_cast<size_t>(e)]; }
  int expert_in_slot(int s) const { return expert_in_[static_cast<size_t>(s)]; }
  int num_experts() const { return static_cast<int>(slot_of_.size()); }
  int slots() const { return static_cast<int>(expert_in_.size()); }
  uint64_t hits() const { return hits_; }
  uint64_t misses() const { return misses_; }
  uint64_t swaps() const { return swaps_; }
  double hit_rate() const { return hits_ + misses_ ? static_cast<double>(hits_) / static_cast<double>(hits_ + misses_) : 0; }

 private:
  CacheOptions opt_;
  std::vector<int> slot_of_;     // [E] slot or -1
  std::vector<int> expert_in_;   // [slots] expert
  std::vector<uint64_t> last_use_;  // [E] step of the last routing (LRU)
  std::vector<double> score_;       // [E] decayed routing frequency
  std::vector<uint64_t> seen_;      // [E] step stamp of "routed in this forward"
  uint64_t step_ = 0;
  uint64_t hits_ = 0, misses_ = 0, swaps_ = 0;
};

// Replays a routing trace (per forward, the experts routed to) through a cache that starts from
// `resident`, applying its swaps; returns the hit rate (share of routed experts found resident).
Result<double> simulate_hit_rate(std::span<const uint8_t> resident, const CacheOptions& options,
                                 const std::vector<std::vector<int32_t>>& trace);

}  // namespace moebius::offload
