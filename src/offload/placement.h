// Expert placement: which experts of each MoE layer stay resident on the GPU when the memory
// budget (memory_budget.h) cannot hold them all. The rest live in pinned host memory and are read
// through the per-expert address table ([TAG_EXPERT_PTR_TABLE]).
//
// With a routing profile (routing_profile.h), each layer keeps its hottest experts by routing
// mass (ties: more routed pairs first, then the lower id), so the resident set serves the largest
// share of the router's weight. Without one, the resident experts are spread uniformly over the
// ids (every layer keeps the same count), which is what a router trained with a load-balancing
// loss looks like on average.
#pragma once

#include <cstdint>
#include <vector>

#include "core/error.h"
#include "offload/routing_profile.h"

namespace moebius::offload {

struct Placement {
  int num_experts = 0;
  std::vector<int> layers;                      // model layer indices of the MoE layers, ascending
  std::vector<std::vector<uint8_t>> resident;   // [layers][E]: 1 = on the GPU
  bool from_profile = false;

  int resident_count(size_t i) const;
  int64_t total_resident() const;
  bool is_resident(size_t i, int expert) const { return resident[i][static_cast<size_t>(expert)] != 0; }
  // Share of `profile`'s routing mass that lands on resident experts, over all layers (1 when every
  // expert is resident; 0 when the profile is empty).
  double resident_mass_fraction(const RoutingProfile& profile) const;
};

// Resident experts per layer: `resident_total` spread over `num_layers` layers, the same count in
// each, the remainder one each to the first layers. At most num_experts per layer.
std::vector<int> per_layer_counts(int64_t resident_total, int num_layers, int num_experts);

// Uniform: layer i keeps counts[i] experts at evenly spaced ids (floor(j * E / n), j = 0..n-1).
Placement place_uniform(const std::vector<int>& moe_layers, int num_experts, const std::vector<int>& counts);

// Hottest by mass per layer. The profile must match the model: same num_experts, and an entry for
// every MoE layer (error naming the layer otherwise; `source` names the profile in errors).
Result<Placement> place_hottest(const RoutingProfile& profile, const std::vector<int>& moe_layers, int num_experts,
                                const std::vector<int>& counts, const std::string& source);

}  // namespace moebius::offload
