// How a checkpoint is quantized, parsed from
//   - hf_quant_config.json (NVIDIA ModelOpt):
//       {"producer": {"name": "modelopt", "version": ...},
//        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": null | "FP8",
//                         "group_size": 16, "exclude_modules": ["lm_head", ...]}}
//   - config.json's "quantization_config" object, with quant_method
//       "modelopt"    {"quant_algo": "NVFP4", "ignore": [...], "config_groups": {...},
//                      "kv_cache_scheme": {...}, "producer": {...}}  (ModelOpt's
//                     compressed-tensors-style export; "exclude_modules"/"group_size" also read)
//       "gptq"        {"bits", "group_size", "sym", "desc_act", "checkpoint_format",
//                      "lm_head", "dynamic", "modules_to_not_convert", ...}  (AutoGPTQ/GPTQModel)
//       "auto-round"  {"bits", "group_size", "sym", "data_type", "packing_format",
//                      "block_name_to_quantize", "extra_config", "act_bits", ...}  (AutoRound;
//                     the older "intel/auto-round" spelling and "backend" key are accepted)
// Anything moebius cannot run is refused here, at parse time, with an error naming the field:
// asymmetric weights, bit widths other than 2/4/8, activation quantization, non-int AutoRound
// data types, repacked GPTQ formats (marlin, bitblas), AWQ packing. (desc_act is only recorded:
// act-order is refused by the g_idx check when the tensors load, see gptq.h.)
//
// Which modules are quantized. is_excluded(name) answers for one linear module name
// ("model.layers.3.mlp.experts.7.down_proj"), combining:
//   - ModelOpt exclude_modules / ignore and modules_to_not_convert: fnmatch-style patterns
//     ('*' matches any run of characters including '.', '?' one character, [seq] / [!seq] a set),
//     matched against the whole name; a pattern without wildcards also matches the children of
//     the named module ("model.layers.0.mlp" excludes "model.layers.0.mlp.gate").
//   - GPTQModel "dynamic": keys "-:<regex>" exclude modules the regex matches at the start of the
//     name (Python re.match); "+:<regex>" or "<regex>" keys override bits/group_size/sym.
//   - AutoRound "extra_config": keys are module names (exact match) or, when they contain regex
//     characters, regexes searched anywhere in the name (re.search); "bits" >= 16 means not
//     quantized. "block_name_to_quantize": only modules under one of these prefixes are
//     quantized (others only through an extra_config entry).
//   - GPTQ "lm_head": false (the default) means lm_head is not quantized.
// Regexes use std::regex's ECMAScript grammar, which agrees with Python's re for the patterns
// these tools write (., *, +, ?, [], (), |, \d, \.); one it cannot compile is a parse error, and
// so is one longer than 1024 characters or with a back-reference: patterns run on libstdc++'s
// Thompson-NFA executor, in time polynomial in the name, never by backtracking.
#pragma once

#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/error.h"
#include "formats/gptq.h"
#include "formats/quant_matrix.h"

namespace moebius {

enum class QuantMethod : uint8_t {
  kNone,       // not quantized
  kModelOpt,   // NVFP4
  kGptq,       // AutoGPTQ / GPTQModel
  kAutoRound,  // Intel AutoRound, GPTQ-compatible packing
};
std::string_view quant_method_name(QuantMethod m);

// A per-module override (GPTQModel "dynamic", AutoRound "extra_config").
struct QuantOverride {
  enum class Match : uint8_t {
    kExact,        // the whole name equals `pattern`
    kRegexPrefix,  // regex matches at the start of the name (Python re.match)
    kRegexSearch,  // regex matches anywhere in the name (Python re.search)
  };
  std::string pattern;  // as written in the config, without GPTQModel's "+:" / "-:" prefix
  Match match = Match::kExact;
  bool skip = false;    // module stays unquantized
  std::optional<int> bits;
  std::optional<int> group_size;
  std::shared_ptr<const std::regex> regex;  // compiled `pattern` for the regex kinds

  bool matches(std::string_view module_name) const;
};

// The effective quantization of one linear module.
struct LayerQuant {
  bool quantized = false;
  WeightFormat format = WeightFormat::kBF16;  // meaningful when quantized
  int bits = 16;
  int group_size = 0;  // 16 for NVFP4; -1 per-channel or > 0 for GPTQ
  gptq::ZeroFormat zeros = gptq::ZeroFormat::kV1MinusOne;
};

struct QuantConfig {
  QuantMethod method = QuantMethod::kNone;

  // ModelOpt
  std::string quant_algo;           // "NVFP4"
  std::string kv_cache_quant_algo;  // "" (none) or e.g. "FP8"; recorded, not acted on here
  std::string producer;             // "modelopt 0.29.0", informational

  // Weights (all methods)
  int bits = 0;         // 4 for NVFP4
  int group_size = 0;   // 16 for NVFP4; -1 (per-channel) or > 0 for GPTQ / AutoRound
  bool sym = true;      // always true after a successful parse
  bool desc_act = false;
  gptq::ZeroFormat zeros = gptq::ZeroFormat::kV1MinusOne;
  std::string checkpoint_format;    // GPTQ: "gptq" / "gptq_v2"
  std::string packing_format;       // AutoRound: "auto_round:auto_gptq", ...
  bool lm_head_quantized = false;   // GPTQ "lm_head"

  std::vector<std::string> exclude_modules;        // fnmatch patterns
  std::vector<std::string> block_name_to_quantize; // AutoRound prefixes; empty = no restriction
  std::vector<QuantOverride> overrides;            // first match wins, in config order

  bool is_quantized() const { return method != QuantMethod::kNone; }
  bool is_excluded(std::string_view module_name) const;
  LayerQuant layer(std::string_view module_name) const;
};

// fnmatch.fnmatchcase semantics over the whole string.
bool fnmatch_glob(std::string_view pattern, std::string_view name);

// `qc` is config.json's "quantization_config" object; `j` is the whole hf_quant_config.json.
// Overrides apply in file order, which only ordered_json keeps: a std::map-backed nlohmann::json
// visits "dynamic" / "extra_config" keys sorted, which matters only when two patterns match the
// same module. The _text functions and load_quant_config() keep file order.
Result<QuantConfig> parse_quantization_config(const nlohmann::json& qc);
Result<QuantConfig> parse_quantization_config(const nlohmann::ordered_json& qc);
Result<QuantConfig> parse_hf_quant_config(const nlohmann::json& j);
Result<QuantConfig> parse_hf_quant_config(const nlohmann::ordered_json& j);
// The same from JSON text; `source` names the file in errors.
Result<QuantConfig> parse_quantization_config_text(std::string_view text, const std::string& source);
Result<QuantConfig> parse_hf_quant_config_text(std::string_view text, const std::string& source);

// For a model directory: hf_quant_config.json when present, else config.json's
// "quantization_config", else an unquantized QuantConfig (method kNone).
Result<QuantConfig> load_quant_config(const std::string& model_dir);

}  // namespace moebius
