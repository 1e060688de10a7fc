// Named MoE geometries for benchmarks and dummy models.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"

namespace moebius::cli {

struct MoeGeometry {
  std::string name;
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I (moe_intermediate_size)
  int num_experts = 0;       // E
  int top_k = 0;             // k
};

// "qwen3-30b-a3b", "qwen3-235b-a22b", or "H,I,E,k".
Result<MoeGeometry> parse_geometry(const std::string& spec);

// "1,8,64" -> {1, 8, 64}; each value in [1, max_value].
Result<std::vector<int64_t>> parse_int_list(const std::string& spec, const std::string& flag, int64_t max_value);

}  // namespace moebius::cli
