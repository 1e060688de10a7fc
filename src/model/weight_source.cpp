#include "model/weight_source.h"

namespace moebius::model {

Status validate_weight_source(const WeightSource& s) {
  if (s.load_format != "auto" && s.load_format != "dummy")
    return Error::format("unknown load format '{}'; expected auto or dummy", s.load_format).in_field("--load-format");
  if (s.model_dir.empty() && s.geometry.empty())
    return Error("give --model DIR, or --geometry NAME with --load-format dummy").in_field("--model");
  if (!s.model_dir.empty() && !s.geometry.empty())
    return Error("give either --model or --geometry, not both").in_field("--geometry");
  if (!s.geometry.empty() && !s.dummy())
    return Error("--geometry has no checkpoint to read; add --load-format dummy").in_field("--load-format");
  if (!s.geometry.empty()) {
    if (auto c = named_qwen3_moe_config(s.geometry); !c.ok()) return std::move(c).error();
  }
  return Ok{};
}

Result<Qwen3MoeConfig> weight_source_config(const WeightSource& s) {
  MOEBIUS_TRY(validate_weight_source(s));
  if (!s.geometry.empty()) return named_qwen3_moe_config(s.geometry);
  return load_qwen3_moe_config(s.model_dir);
}

}  // namespace moebius::model
