#include "tune/moe_tune_key.h"

#include <cmath>

namespace moebius::tune {

using nlohmann::json;

std::string MoeTuneKey::str() const {
  return fmt::format("moe.v{} H={} I={} E={} k={} fmt={} g={} act={} combine={} bucket={}", kMoeTuneKeyVersion, hidden,
                     intermediate, num_experts, top_k, format, group_size, activation, combine, bucket);
}

std::string MoeTuneConfig::str() const {
  return fmt::format("{} bm={}{}{}{}", gemm_path, block_m, fuse_routing ? " fused" : "",
                     rows_per_block ? fmt::format(" rows={}", rows_per_block) : "",
                     split_k_warps != 4 ? fmt::format(" warps={}", split_k_warps) : "");
}

namespace {

json config_json(const MoeTuneConfig& c) {
  return json{{"gemm_path", c.gemm_path},
              {"block_m", c.block_m},
              {"fuse_routing", c.fuse_routing},
              {"rows_per_block", c.rows_per_block},
              {"split_k_warps", c.split_k_warps}};
}

Result<MoeTuneConfig> config_from(const json& j, const char* field) {
  if (!j.contains(field) || !j[field].is_object()) return Error("missing or not an object").in_field(field);
  const json& c = j[field];
  MoeTuneConfig out;
  if (!c.contains("gemm_path") || !c["gemm_path"].is_string() || c["gemm_path"].get<std::string>().empty())
    return Error("not a non-empty string").in_field(std::string(field) + ".gemm_path");
  if (!c.contains("block_m") || !c["block_m"].is_number_integer() || c["block_m"].get<int64_t>() < 1 ||
      c["block_m"].get<int64_t>() > 1024)
    return Error("not an integer in [1, 1024]").in_field(std::string(field) + ".block_m");
  if (!c.contains("fuse_routing") || !c["fuse_routing"].is_boolean())
    return Error("not a boolean").in_field(std::string(field) + ".fuse_routing");
  // Optional: entries written before the knob existed ran the heuristic (0).
  if (c.contains("rows_per_block")) {
    const json& r = c["rows_per_block"];
    if (!r.is_number_integer() || r.get<int64_t>() < 0 || r.get<int64_t>() > 64)
      return Error("not an integer in [0, 64]").in_field(std::string(field) + ".rows_per_block");
    out.rows_per_block = r.get<int>();
  }
  // Optional: entries written before the knob existed ran 4 warps.
  if (c.contains("split_k_warps")) {
    const json& w = c["split_k_warps"];
    if (!w.is_number_integer() || (w.get<int64_t>() != 4 && w.get<int64_t>() != 8))
      return Error("not 4 or 8").in_field(std::string(field) + ".split_k_warps");
    out.split_k_warps = w.get<int>();
  }
  out.gemm_path = c["gemm_path"].get<std::string>();
  out.block_m = c["block_m"].get<int>();
  out.fuse_routing = c["fuse_routing"].get<bool>();
  return out;
}

Result<double> positive_number(const json& j, const char* field) {
  if (!j.contains(field) || !j[field].is_number()) return Error("not a number").in_field(field);
  const double v = j[field].get<double>();
  if (!std::isfinite(v) || v < 0) return Error::format("{} is not a finite time >= 0", v).in_field(field);
  return v;
}

}  // namespace

json MoeTuneChoice::to_json() const {
  return json{{"winner", config_json(winner)},   {"heuristic", config_json(heuristic)},
              {"winner_us", winner_us},          {"heuristic_us", heuristic_us},
              {"candidates", candidates}};
}

Result<MoeTuneChoice> MoeTuneChoice::from_json(const json& j) {
  if (!j.is_object()) return Error("a tuning choice is not a JSON object");
  MoeTuneChoice c;
  MOEBIUS_ASSIGN_OR_RETURN(c.winner, config_from(j, "winner"));
  MOEBIUS_ASSIGN_OR_RETURN(c.heuristic, config_from(j, "heuristic"));
  MOEBIUS_ASSIGN_OR_RETURN(c.winner_us, positive_number(j, "winner_us"));
  MOEBIUS_ASSIGN_OR_RETURN(c.heuristic_us, positive_number(j, "heuristic_us"));
  if (j.contains("candidates") && j["candidates"].is_number_integer()) c.candidates = j["candidates"].get<int>();
  return c;
}

}  // namespace moebius::tune
