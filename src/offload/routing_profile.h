// Routing profiles: how often, and with how much router weight, each expert of each MoE layer was
// chosen over a set of prompts. `moebius profile-experts` writes one; `--placement FILE` reads it
// to decide which experts stay on the GPU (placement.h).
//
// JSON (one object; every field required, nothing else allowed at the top level):
//   {"format": "moebius-routing-profile", "version": 1,
//    "num_experts": E, "top_k": k, "tokens": N,          N: tokens routed per layer
//    "layers": [{"layer": l, "counts": [E ints], "mass": [E numbers]}, ...]}
// `layer` is the model's layer index (dense layers are absent); `counts[e]` the (token, slot)
// pairs routed to e; `mass[e]` the sum of their routing weights (after renormalization).
// Reading is strict and bounded: a file over kMaxProfileBytes, more than kMaxProfileExperts or
// kMaxProfileLayers, negative or non-finite values, or a layer listed twice is an error naming
// the file and the field.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"

namespace moebius::offload {

inline constexpr uint64_t kMaxProfileBytes = 64ull << 20;
inline constexpr int kMaxProfileExperts = 4096;
inline constexpr int kMaxProfileLayers = 1024;

struct LayerRouting {
  int layer = 0;                // the model's layer index
  std::vector<uint64_t> counts;  // [E]
  std::vector<double> mass;      // [E]
};

struct RoutingProfile {
  int num_experts = 0;
  int top_k = 0;
  uint64_t tokens = 0;
  std::vector<LayerRouting> layers;  // ascending layer index

  // The entry of model layer `layer`, or null.
  const LayerRouting* find(int layer) const;
  // Adds one forward's routing of model layer `layer`: ids/weights [T, k] (row-major). Creates the
  // layer's entry on first use. Ids outside [0, E) are our bug (the router made them).
  void add(int layer, const int32_t* ids, const float* weights, int64_t num_tokens);
  Status validate() const;
};

RoutingProfile make_profile(int num_experts, int top_k);

std::string profile_to_json(const RoutingProfile& p);
// `source` names the file in errors.
Result<RoutingProfile> profile_from_json(const std::string& text, const std::string& source);
Status write_profile(const RoutingProfile& p, const std::string& path);
Result<RoutingProfile> read_profile(const std::string& path);

}  // namespace moebius::offload
