// The dynamic expert cache of a whole model: one ExpertCache (expert_cache.h) per MoE layer, fed
// once per step with every MoE layer's routing as the CUDA runner reads it back from the GPU
// (model/qwen3_moe_cuda_cache.h: one step late, asynchronously). Host logic only, so the
// bookkeeping the runner depends on is unit-tested without a GPU (tests/test_offload.cpp).
//
// Two residencies are kept apart on purpose. The caches' state is the residency after every swap
// they returned so far (what the NEXT step runs with, since the runner enqueues each returned swap
// before that step). A fed step may have run before some of those swaps (the runner reads the
// routing back one or two steps late), so its hits are counted against `ran_with`, the snapshot of
// the residency the runner took when it enqueued that step.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/error.h"
#include "offload/expert_cache.h"

namespace moebius::offload {

struct ModelCacheStats {
  uint64_t steps = 0;          // steps whose routing was fed
  uint64_t dropped_steps = 0;  // steps whose routing was never fed (not read back in time)
  uint64_t tokens = 0;         // tokens of the fed steps
  uint64_t routed_pairs = 0;   // (token, expert) pairs of the fed steps, summed over the MoE layers
  uint64_t resident_pairs = 0; // of those, the pairs whose expert was on the GPU when the step ran
  uint64_t ignored_ids = 0;    // ids outside [0, E) (never expected: a bug upstream if not 0)
  uint64_t swaps = 0;          // swaps returned, all layers
  uint64_t swap_bytes = 0;     // swaps * bytes_per_swap (create)
  // resident_pairs / routed_pairs (0 before any pair).
  double hit_rate() const;
  // The counts of a run: this (later) minus `before`.
  ModelCacheStats since(const ModelCacheStats& before) const;
};

class ModelExpertCache {
 public:
  // A residency change: in MoE layer `layer` (the index among the MoE layers), cold expert `admit`
  // takes the device slot of resident expert `evict` (MoeLayerCuda::swap_experts(admit, evict)).
  struct Swap {
    int layer = -1;
    int admit = -1;
    int evict = -1;
  };

  // `resident`: [MoE layers][E] the placement at load. `bytes_per_swap`: PCIe bytes one swap moves
  // (the runner's: the incoming expert host-to-device plus the outgoing one device-to-host).
  static Result<ModelExpertCache> create(const std::vector<std::vector<uint8_t>>& resident, const CacheOptions& options,
                                         uint64_t bytes_per_swap);

  int num_layers() const { return static_cast<int>(caches_.size()); }
  int num_experts() const { return num_experts_; }
  const CacheOptions& options() const { return opt_; }
  bool resident(int layer, int e) const { return caches_[static_cast<size_t>(layer)].resident(e); }
  // The residency now (after every swap returned so far) as [MoE layers][E] 0/1 bytes; `out` holds
  // num_layers() * num_experts().
  void snapshot(std::span<uint8_t> out) const;

  // One step's routing: layer i's ids are ids[i * stride, i * stride + rows * k) (token-major, k per
  // token; stride >= rows * k), `ran_with` the snapshot taken when the step was enqueued. Counts the
  // pairs, steps every layer's cache, and returns the swaps to apply before the next step, layer by
  // layer (within a layer no swap evicts an expert another admits).
  std::vector<Swap> feed(std::span<const int32_t> ids, size_t stride, int rows, int k, std::span<const uint8_t> ran_with);
  // A step whose routing will never be fed.
  void drop() { ++stats_.dropped_steps; }
  const ModelCacheStats& stats() const { return stats_; }

 private:
  CacheOptions opt_;
  int num_experts_ = 0;
  uint64_t bytes_per_swap_ = 0;
  std::vector<ExpertCache> caches_;
  std::vector<int32_t> valid_;  // one layer's ids in range (feed's scratch)
  ModelCacheStats stats_;
};

}  // namespace moebius::offload
