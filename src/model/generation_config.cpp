#include "model/generation_config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/json_depth.h"
#include "core/memory.h"

namespace moebius::model {
namespace {

using nlohmann::json;

Result<int32_t> to_token_id(const json& v, const char* field) {
  if (!v.is_number_integer()) return Error::format("expected a token id (integer), got {}", v.dump()).in_field(field);
  if (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())
                             : (v.get<int64_t>() < 0 || v.get<int64_t>() > std::numeric_limits<int32_t>::max()))
    return Error::format("token id {} is outside [0, 2^31)", v.dump()).in_field(field);
  return static_cast<int32_t>(v.get<int64_t>());
}

// null counts as absent: HF writes "temperature": null when unset. The value must lie in [lo, hi],
// or (lo, hi] when lo_open: the range validate_sampler_params accepts. These become the sampler's
// parameters when no flag overrides them, and an error there would name a flag nobody passed
// instead of this file and field.
Result<std::optional<float>> read_float(const json& j, const char* key, double lo, bool lo_open, double hi,
                                        const char* range) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::optional<float>{};
  if (!it->is_number()) return Error::format("expected a number, got {}", it->dump()).in_field(key);
  const double x = it->get<double>();
  // hi <= FLT_MAX, so the cast is defined; the open bound is checked after it (1e-50 rounds to 0).
  const bool in_range = x >= lo && x <= hi && (!lo_open || static_cast<float>(x) > lo);
  if (!in_range) return Error::format("{} is outside {}", it->dump(), range).in_field(key);
  return std::optional<float>(static_cast<float>(x));
}

Result<GenerationConfig> parse_json(const json& j) {
  if (!j.is_object()) return Error("expected a JSON object");
  GenerationConfig c;
  if (auto it = j.find("eos_token_id"); it != j.end() && !it->is_null()) {
    if (it->is_array()) {
      for (const json& v : *it) {
        MOEBIUS_ASSIGN_OR_RETURN(int32_t id, to_token_id(v, "eos_token_id"));
        c.eos_token_ids.push_back(id);
      }
    } else {
      MOEBIUS_ASSIGN_OR_RETURN(int32_t id, to_token_id(*it, "eos_token_id"));
      c.eos_token_ids.push_back(id);
    }
  }
  // Temperatures above float's range would become infinite; 0 is greedy.
  MOEBIUS_ASSIGN_OR_RETURN(c.temperature, read_float(j, "temperature", 0.0, false, std::numeric_limits<float>::max(),
                                                     "[0, FLT_MAX] (0 = greedy)"));
  MOEBIUS_ASSIGN_OR_RETURN(c.top_p, read_float(j, "top_p", 0.0, true, 1.0, "(0, 1] (1 = off)"));
  // min_p in [0, 1), as the sampler takes it: the closed bound is the largest float below 1.
  MOEBIUS_ASSIGN_OR_RETURN(c.min_p, read_float(j, "min_p", 0.0, false, std::nextafter(1.0f, 0.0f), "[0, 1)"));
  MOEBIUS_ASSIGN_OR_RETURN(c.repetition_penalty, read_float(j, "repetition_penalty", 0.0, true,
                                                            std::numeric_limits<float>::max(), "(0, FLT_MAX] (1 = off)"));
  if (auto it = j.find("top_k"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > std::numeric_limits<int>::max())
      return Error::format("expected an integer >= 0, got {}", it->dump()).in_field("top_k");
    c.top_k = static_cast<int>(it->get<int64_t>());
  }
  if (auto it = j.find("do_sample"); it != j.end() && !it->is_null()) {
    if (!it->is_boolean()) return Error::format("expected true or false, got {}", it->dump()).in_field("do_sample");
    c.do_sample = it->get<bool>();
  }
  return c;
}

}  // namespace

Result<GenerationConfig> parse_generation_config(std::string_view text, const std::string& source) {
  // [TAG_JSON_DEPTH] Errors quote values with dump(), which recurses per level.
  if (Status depth = check_json_depth(text); !depth.ok()) return std::move(depth).error().in_file(source);
  const json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Error("not valid JSON").in_file(source);
  auto r = parse_json(j);
  if (!r.ok()) return std::move(r).error().in_file(source);
  return r;
}

Result<GenerationConfig> load_generation_config(const std::string& dir) {
  const std::string file = (std::filesystem::path(dir) / "generation_config.json").string();
  std::error_code ec;
  if (!std::filesystem::exists(file, ec)) return GenerationConfig{};
  MOEBIUS_ASSIGN_OR_RETURN(std::string text, read_small_file(file));
  return parse_generation_config(text, file);
}

}  // namespace moebius::model
