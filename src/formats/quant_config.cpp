#include "formats/quant_config.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/json_depth.h"
#include "core/memory.h"

namespace moebius {

namespace {


// ---- typed field readers: absent or null -> nullopt; wrong type -> Error naming the field ------

template <class J>
const J* find(const J& obj, std::string_view key) {
  auto it = obj.find(key);
  return (it == obj.end() || it->is_null()) ? nullptr : &*it;
}

template <class J>
Result<std::optional<int>> get_int(const J& obj, std::string_view key, const std::string& path) {
  const J* v = find(obj, key);
  if (v == nullptr) return std::optional<int>{};
  if (!v->is_number_integer())
    return Error::format("expected an integer, got {}", v->dump()).in_field(path);
  const int64_t x = v->template get<int64_t>();
  if (x < -(int64_t{1} << 30) || x > (int64_t{1} << 30)) return Error::format("{} is out of range", x).in_field(path);
  return std::optional<int>(static_cast<int>(x));
}

template <class J>
Result<std::optional<bool>> get_bool(const J& obj, std::string_view key, const std::string& path) {
  const J* v = find(obj, key);
  if (v == nullptr) return std::optional<bool>{};
  if (!v->is_boolean()) return Error::format("expected true or false, got {}", v->dump()).in_field(path);
  return std::optional<bool>(v->template get<bool>());
}

template <class J>
Result<std::optional<std::string>> get_string(const J& obj, std::string_view key, const std::string& path) {
  const J* v = find(obj, key);
  if (v == nullptr) return std::optional<std::string>{};
  if (!v->is_string()) return Error::format("expected a string, got {}", v->dump()).in_field(path);
  return std::optional<std::string>(v->template get<std::string>());
}

template <class J>
Result<std::vector<std::string>> get_string_list(const J& obj, std::string_view key, const std::string& path) {
  std::vector<std::string> out;
  const J* v = find(obj, key);
  if (v == nullptr) return out;
  if (!v->is_array()) return Error::format("expected a list of strings, got {}", v->dump()).in_field(path);
  for (size_t i = 0; i < v->size(); ++i) {
    const auto& e = (*v)[i];
    if (!e.is_string())
      return Error::format("entry {} is {}, expected a string", i, e.dump()).in_field(path);
    out.push_back(e.template get<std::string>());
  }
  return out;
}

Status check_int_bits(int bits, const std::string& path) {
  if (bits != 2 && bits != 4 && bits != 8)
    return Error::format("{}-bit weights are not supported (supported: 2, 4, 8)", bits).in_field(path);
  return Ok{};
}

Status check_group_size(int g, const std::string& path) {
  if (g != -1 && g <= 0) return Error::format("group size {} is neither -1 (per-channel) nor positive", g).in_field(path);
  return Ok{};
}

// Real patterns are under 100 characters. std::regex compiles by recursive descent, and its
// executors recurse per state: 20000 nested groups or "a*" repeated 20000 times overflow the stack.
constexpr size_t kMaxRegexBytes = 1024;

// libstdc++'s default executor backtracks: "(.|.)*q" takes time exponential in the module name's
// length. Its __polynomial flag picks the Thompson-NFA executor instead (polynomial; it refuses
// back-references, which no real pattern uses). We only ask whether a pattern matches, which both
// executors answer alike.
#if defined(__GLIBCXX__)
constexpr auto kRegexFlags = std::regex::ECMAScript | std::regex_constants::__polynomial;
#else
constexpr auto kRegexFlags = std::regex::ECMAScript;
#endif

Result<std::shared_ptr<const std::regex>> compile_regex(const std::string& pattern, const std::string& path) {
  if (pattern.size() > kMaxRegexBytes)
    return Error::format("regex is longer than {} characters ({})", kMaxRegexBytes, pattern.size()).in_field(path);
  // libstdc++ reads a back-reference's or a repeat count's digits into a long without an overflow
  // check (_Compiler::_M_cur_int_value): refuse long numbers before it sees them.
  size_t digits = 0;
  for (char ch : pattern) {
    digits = (ch >= '0' && ch <= '9') ? digits + 1 : 0;
    if (digits > 9) return Error("regex has a number of more than 9 digits").in_field(path);
  }
  try {
    return std::make_shared<const std::regex>(pattern, kRegexFlags);
  } catch (const std::regex_error& e) {
    return Error::format("cannot compile regex '{}': {}", pattern, e.what()).in_field(path);
  }
}

// Every module name of a checkpoint (~18.7k for Qwen3-30B-A3B's experts, ~37k for 235B) is matched
// against every regex override, and a match costs time in proportion to the pattern's length
// (the Thompson executor above). So the patterns' total length bounds the load's regex time: at
// the 16 KiB allowed, a few minutes in the worst case; real configs hold a few hundred bytes
// (a handful of "dynamic" entries, or AutoRound's exact module names, which are compared, not
// matched, and do not count). A config of thousands of long patterns would otherwise take hours.
constexpr size_t kMaxRegexTotalBytes = 16 << 10;

Status check_regex_budget(const std::vector<QuantOverride>& overrides, const std::string& path) {
  size_t total = 0;
  for (const QuantOverride& ov : overrides)
    if (ov.regex) total += ov.pattern.size();
  if (total > kMaxRegexTotalBytes)
    return Error::format("its regex patterns total {} bytes; at most {} are matched against every module name",
                         total, kMaxRegexTotalBytes)
        .in_field(path);
  return Ok{};
}

bool has_glob_chars(std::string_view p) { return p.find_first_of("*?[") != std::string_view::npos; }
bool has_regex_chars(std::string_view p) { return p.find_first_of("*?[]()|\\^$+{}") != std::string_view::npos; }

bool is_lm_head(std::string_view name) {
  return name == "lm_head" || (name.size() > 8 && name.substr(name.size() - 8) == ".lm_head");
}

// ---- ModelOpt --------------------------------------------------------------------------------

Status finish_modelopt(QuantConfig& c, const std::string& algo_path, std::optional<int> group_size,
                       const std::string& group_path) {
  if (c.quant_algo == "MIXED_PRECISION")
    return Error("ModelOpt MIXED_PRECISION checkpoints (per-layer quant_algo in quantized_layers) are not supported")
        .in_field(algo_path);
  if (c.quant_algo != "NVFP4")
    return Error::format("quant_algo '{}' is not supported (supported: NVFP4)", c.quant_algo).in_field(algo_path);
  if (group_size.has_value() && *group_size != 16)
    return Error::format("NVFP4 group size is {}, expected 16", *group_size).in_field(group_path);
  c.method = QuantMethod::kModelOpt;
  c.bits = 4;
  c.group_size = 16;
  return Ok{};
}

template <class J>
Result<std::string> producer_string(const J& obj, const std::string& path) {
  const J* p = find(obj, "producer");
  if (p == nullptr) return std::string();
  if (!p->is_object()) return Error::format("expected an object, got {}", p->dump()).in_field(path);
  MOEBIUS_ASSIGN_OR_RETURN(auto name, get_string(*p, "name", path + ".name"));
  MOEBIUS_ASSIGN_OR_RETURN(auto version, get_string(*p, "version", path + ".version"));
  std::string s = name.value_or("");
  if (version) s += (s.empty() ? "" : " ") + *version;
  return s;
}

template <class J>
Result<QuantConfig> parse_modelopt_quant_config(const J& qc) {
  QuantConfig c;
  const std::string base = "quantization_config.";
  MOEBIUS_ASSIGN_OR_RETURN(auto algo, get_string(qc, "quant_algo", base + "quant_algo"));
  if (!algo) return Error("missing (quant_method 'modelopt' needs quant_algo)").in_field(base + "quant_algo");
  c.quant_algo = *algo;
  MOEBIUS_ASSIGN_OR_RETURN(c.producer, producer_string(qc, base + "producer"));

  // group_size: top level, else the weights of the config groups (compressed-tensors style).
  MOEBIUS_ASSIGN_OR_RETURN(std::optional<int> gs, get_int(qc, "group_size", base + "group_size"));
  std::string gs_path = base + "group_size";
  if (const J* groups = find(qc, "config_groups"); groups != nullptr && !gs) {
    if (!groups->is_object())
      return Error::format("expected an object, got {}", groups->dump()).in_field(base + "config_groups");
    for (auto it = groups->begin(); it != groups->end() && !gs; ++it) {
      const std::string gpath = base + "config_groups." + it.key();
      if (!it->is_object()) return Error::format("expected an object, got {}", it->dump()).in_field(gpath);
      const J* w = find(*it, "weights");
      if (w == nullptr) continue;
      if (!w->is_object()) return Error::format("expected an object, got {}", w->dump()).in_field(gpath + ".weights");
      gs_path = gpath + ".weights.group_size";
      MOEBIUS_ASSIGN_OR_RETURN(gs, get_int(*w, "group_size", gs_path));
    }
  }
  MOEBIUS_TRY(finish_modelopt(c, base + "quant_algo", gs, gs_path));

  MOEBIUS_ASSIGN_OR_RETURN(auto ignore, get_string_list(qc, "ignore", base + "ignore"));
  MOEBIUS_ASSIGN_OR_RETURN(auto exclude, get_string_list(qc, "exclude_modules", base + "exclude_modules"));
  c.exclude_modules = std::move(ignore);
  c.exclude_modules.insert(c.exclude_modules.end(), exclude.begin(), exclude.end());

  MOEBIUS_ASSIGN_OR_RETURN(auto kv_algo, get_string(qc, "kv_cache_quant_algo", base + "kv_cache_quant_algo"));
  if (kv_algo) c.kv_cache_quant_algo = *kv_algo;
  if (const J* kv = find(qc, "kv_cache_scheme"); kv != nullptr) {
    const std::string kpath = base + "kv_cache_scheme";
    if (kv->is_string()) {
      c.kv_cache_quant_algo = kv->template get<std::string>();
    } else if (kv->is_object()) {
      MOEBIUS_ASSIGN_OR_RETURN(auto nb, get_int(*kv, "num_bits", kpath + ".num_bits"));
      MOEBIUS_ASSIGN_OR_RETURN(auto type, get_string(*kv, "type", kpath + ".type"));
      if (nb == 8 && type == "float") c.kv_cache_quant_algo = "FP8";
      else
        return Error::format("unsupported KV cache scheme {}", kv->dump()).in_field(kpath);
    } else {
      return Error::format("expected an object or a string, got {}", kv->dump()).in_field(kpath);
    }
  }
  return c;
}

// ---- GPTQ (AutoGPTQ, GPTQModel) --------------------------------------------------------------

template <class J>
Status parse_common_int(const J& qc, QuantConfig& c, const std::string& base) {
  MOEBIUS_ASSIGN_OR_RETURN(auto bits, get_int(qc, "bits", base + "bits"));
  if (!bits) return Error("missing").in_field(base + "bits");
  MOEBIUS_TRY(check_int_bits(*bits, base + "bits"));
  c.bits = *bits;
  MOEBIUS_ASSIGN_OR_RETURN(auto gs, get_int(qc, "group_size", base + "group_size"));
  c.group_size = gs.value_or(128);  // GPTQ's and AutoRound's default
  MOEBIUS_TRY(check_group_size(c.group_size, base + "group_size"));
  MOEBIUS_ASSIGN_OR_RETURN(auto sym, get_bool(qc, "sym", base + "sym"));
  if (sym == false)
    return Error("asymmetric quantization (sym=false) is not supported; only symmetric checkpoints load")
        .in_field(base + "sym");
  MOEBIUS_ASSIGN_OR_RETURN(auto desc_act, get_bool(qc, "desc_act", base + "desc_act"));
  c.desc_act = desc_act.value_or(false);
  MOEBIUS_ASSIGN_OR_RETURN(auto not_convert, get_string_list(qc, "modules_to_not_convert", base + "modules_to_not_convert"));
  c.exclude_modules = std::move(not_convert);
  return Ok{};
}

// bits / group_size / sym of one override object (GPTQModel dynamic, AutoRound extra_config).
template <class J>
Status parse_override_fields(const J& o, QuantOverride& ov, const std::string& path) {
  MOEBIUS_ASSIGN_OR_RETURN(ov.bits, get_int(o, "bits", path + ".bits"));
  MOEBIUS_ASSIGN_OR_RETURN(ov.group_size, get_int(o, "group_size", path + ".group_size"));
  MOEBIUS_ASSIGN_OR_RETURN(auto sym, get_bool(o, "sym", path + ".sym"));
  MOEBIUS_ASSIGN_OR_RETURN(auto act_bits, get_int(o, "act_bits", path + ".act_bits"));
  MOEBIUS_ASSIGN_OR_RETURN(auto data_type, get_string(o, "data_type", path + ".data_type"));
  if (ov.bits && *ov.bits >= 16) {  // kept in high precision
    ov.skip = true;
    return Ok{};
  }
  if (ov.bits) MOEBIUS_TRY(check_int_bits(*ov.bits, path + ".bits"));
  if (ov.group_size) MOEBIUS_TRY(check_group_size(*ov.group_size, path + ".group_size"));
  if (sym == false) return Error("asymmetric quantization (sym=false) is not supported").in_field(path + ".sym");
  if (act_bits && *act_bits < 16)
    return Error::format("activation quantization (act_bits {}) is not supported", *act_bits).in_field(path + ".act_bits");
  if (data_type && *data_type != "int")
    return Error::format("data_type '{}' is not supported (supported: int)", *data_type).in_field(path + ".data_type");
  return Ok{};
}

template <class J>
Result<QuantConfig> parse_gptq_quant_config(const J& qc) {
  QuantConfig c;
  c.method = QuantMethod::kGptq;
  const std::string base = "quantization_config.";
  MOEBIUS_TRY(parse_common_int(qc, c, base));

  // "checkpoint_format" in config.json; GPTQModel's quantize_config.json spells it "format".
  std::string fmt_path = base + "checkpoint_format";
  MOEBIUS_ASSIGN_OR_RETURN(auto fmt_, get_string(qc, "checkpoint_format", fmt_path));
  if (!fmt_) {
    fmt_path = base + "format";
    MOEBIUS_ASSIGN_OR_RETURN(fmt_, get_string(qc, "format", fmt_path));
  }
  c.checkpoint_format = fmt_.value_or("gptq");
  if (c.checkpoint_format == "gptq") c.zeros = gptq::ZeroFormat::kV1MinusOne;
  else if (c.checkpoint_format == "gptq_v2") c.zeros = gptq::ZeroFormat::kV2Exact;
  else
    return Error::format("checkpoint format '{}' is not supported (supported: gptq, gptq_v2)", c.checkpoint_format)
        .in_field(fmt_path);
  MOEBIUS_ASSIGN_OR_RETURN(auto marlin, get_bool(qc, "is_marlin_format", base + "is_marlin_format"));
  if (marlin == true)
    return Error("Marlin-repacked GPTQ checkpoints are not supported").in_field(base + "is_marlin_format");

  MOEBIUS_ASSIGN_OR_RETURN(auto pack_dtype, get_string(qc, "pack_dtype", base + "pack_dtype"));
  if (pack_dtype && *pack_dtype != "int32")
    return Error::format("pack_dtype '{}' is not supported (supported: int32)", *pack_dtype).in_field(base + "pack_dtype");
  MOEBIUS_ASSIGN_OR_RETURN(auto lm_head, get_bool(qc, "lm_head", base + "lm_head"));
  c.lm_head_quantized = lm_head.value_or(false);
  if (find(qc, "modules_in_block_to_quantize") != nullptr)
    return Error("modules_in_block_to_quantize is not supported yet").in_field(base + "modules_in_block_to_quantize");

  if (const J* dyn = find(qc, "dynamic"); dyn != nullptr) {
    if (!dyn->is_object()) return Error::format("expected an object, got {}", dyn->dump()).in_field(base + "dynamic");
    for (auto it = dyn->begin(); it != dyn->end(); ++it) {
      const std::string path = base + "dynamic." + it.key();
      QuantOverride ov;
      ov.match = QuantOverride::Match::kRegexPrefix;  // GPTQModel: re.match
      std::string key = it.key();
      if (key.rfind("-:", 0) == 0) {
        ov.skip = true;
        key = key.substr(2);
      } else if (key.rfind("+:", 0) == 0) {
        key = key.substr(2);
      }
      ov.pattern = key;
      MOEBIUS_ASSIGN_OR_RETURN(ov.regex, compile_regex(key, path));
      if (!it->is_object()) return Error::format("expected an object, got {}", it->dump()).in_field(path);
      if (!ov.skip) {
        MOEBIUS_TRY(parse_override_fields(*it, ov, path));
        MOEBIUS_ASSIGN_OR_RETURN(auto da, get_bool(*it, "desc_act", path + ".desc_act"));
        (void)da;  // act-order per layer is caught by the g_idx check at load
      }
      c.overrides.push_back(std::move(ov));
    }
    MOEBIUS_TRY(check_regex_budget(c.overrides, base + "dynamic"));
  }
  return c;
}

// ---- AutoRound ---------------------------------------------------------------------------------

template <class J>
Result<QuantConfig> parse_autoround_quant_config(const J& qc) {
  QuantConfig c;
  c.method = QuantMethod::kAutoRound;
  const std::string base = "quantization_config.";
  MOEBIUS_TRY(parse_common_int(qc, c, base));

  MOEBIUS_ASSIGN_OR_RETURN(auto data_type, get_string(qc, "data_type", base + "data_type"));
  if (data_type && *data_type != "int")
    return Error::format("data_type '{}' is not supported (supported: int)", *data_type).in_field(base + "data_type");
  MOEBIUS_ASSIGN_OR_RETURN(auto act_bits, get_int(qc, "act_bits", base + "act_bits"));
  if (act_bits && *act_bits < 16)
    return Error::format("activation quantization (act_bits {}) is not supported", *act_bits).in_field(base + "act_bits");
  for (const char* key : {"super_bits", "super_group_size"})
    if (find(qc, key) != nullptr)
      return Error("double-quantized (GGUF-style) AutoRound weights are not supported").in_field(base + key);

  // Zero-point convention from the packing (see gptq.h). Older exports call it "backend".
  std::string pf_path = base + "packing_format";
  MOEBIUS_ASSIGN_OR_RETURN(auto pf, get_string(qc, "packing_format", pf_path));
  if (!pf) {
    pf_path = base + "backend";
    MOEBIUS_ASSIGN_OR_RETURN(pf, get_string(qc, "backend", pf_path));
  }
  c.packing_format = pf.value_or("auto_round:auto_gptq");  // transformers' AutoRoundConfig default is gptq
  const std::string& p = c.packing_format;
  auto has = [&](const char* s) { return p.find(s) != std::string::npos; };
  if (has("awq") || has("fp") || has("fake") || has("gguf") || has("llm_compressor") || has("mlx"))
    return Error::format("packing_format '{}' is not supported (supported: auto_round:auto_gptq, "
                         "auto_round:gptqmodel, auto_round)", p)
        .in_field(pf_path);
  if (has("gptqmodel")) c.zeros = gptq::ZeroFormat::kV2Exact;
  else if (has("gptq")) c.zeros = gptq::ZeroFormat::kV1MinusOne;
  else if (p.rfind("auto_round", 0) == 0) c.zeros = gptq::ZeroFormat::kV2Exact;  // qlinear_torch: zero as is
  else
    return Error::format("packing_format '{}' is not supported", p).in_field(pf_path);

  // block_name_to_quantize: "model.layers" or "a,b" or a list; nested lists are reduced to their
  // common prefix, as AutoRound does when it writes them.
  const std::string bpath = base + "block_name_to_quantize";
  const J* blocks = find(qc, "block_name_to_quantize");
  if (blocks == nullptr) blocks = find(qc, "to_quant_block_names");
  if (blocks != nullptr) {
    auto add = [&](std::string s) {
      while (!s.empty() && s.back() == '.') s.pop_back();
      if (!s.empty()) c.block_name_to_quantize.push_back(std::move(s));
    };
    if (blocks->is_string()) {
      std::stringstream ss(blocks->template get<std::string>());
      for (std::string part; std::getline(ss, part, ',');) add(part);
    } else if (blocks->is_array()) {
      for (const auto& e : *blocks) {
        if (e.is_string()) {
          add(e.template get<std::string>());
        } else if (e.is_array() && !e.empty() && e[0].is_string()) {
          std::string prefix = e[0].template get<std::string>();
          for (const auto& s : e) {
            if (!s.is_string()) return Error::format("expected strings, got {}", s.dump()).in_field(bpath);
            const std::string t = s.template get<std::string>();
            size_t i = 0;
            while (i < prefix.size() && i < t.size() && prefix[i] == t[i]) ++i;
            prefix.resize(i);
          }
          add(prefix);
        } else {
          return Error::format("expected a string or a list of strings, got {}", e.dump()).in_field(bpath);
        }
      }
    } else {
      return Error::format("expected a string or a list, got {}", blocks->dump()).in_field(bpath);
    }
  }

  if (const J* extra = find(qc, "extra_config"); extra != nullptr) {
    if (!extra->is_object()) return Error::format("expected an object, got {}", extra->dump()).in_field(base + "extra_config");
    for (auto it = extra->begin(); it != extra->end(); ++it) {
      const std::string path = base + "extra_config." + it.key();
      if (!it->is_object()) return Error::format("expected an object, got {}", it->dump()).in_field(path);
      QuantOverride ov;
      ov.pattern = it.key();
      if (has_regex_chars(ov.pattern)) {
        ov.match = QuantOverride::Match::kRegexSearch;
        MOEBIUS_ASSIGN_OR_RETURN(ov.regex, compile_regex(ov.pattern, path));
      }
      MOEBIUS_TRY(parse_override_fields(*it, ov, path));
      c.overrides.push_back(std::move(ov));
    }
    MOEBIUS_TRY(check_regex_budget(c.overrides, base + "extra_config"));
  }
  return c;
}

// Parsed into ordered_json: GPTQModel's "dynamic" and AutoRound's "extra_config" are applied in
// the order the file lists them, which std::map-backed nlohmann::json would lose.
Result<nlohmann::ordered_json> parse_json_text(std::string_view text, const std::string& source) {
  // [TAG_JSON_DEPTH] An ordered_json object copies its values when it grows (its pairs have a const
  // key, so they are not moved), and the copy recurses per level: refuse deep text first.
  if (Status depth = check_json_depth(text); !depth.ok()) return std::move(depth).error().in_file(source);
  auto j = nlohmann::ordered_json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Error("not valid JSON").in_file(source);
  return j;
}

Result<std::string> read_text_file(const std::string& path) { return read_small_file(path); }

}  // namespace

std::string_view quant_method_name(QuantMethod m) {
  switch (m) {
    case QuantMethod::kNone: return "none";
    case QuantMethod::kModelOpt: return "modelopt";
    case QuantMethod::kGptq: return "gptq";
    case QuantMethod::kAutoRound: return "auto-round";
  }
  return "?";
}

bool QuantOverride::matches(std::string_view name) const {
  if (match == Match::kExact) return name == pattern;
  if (!regex) return false;
  try {
    const auto flags = match == Match::kRegexPrefix ? std::regex_constants::match_continuous
                                                    : std::regex_constants::match_default;
    return std::regex_search(name.begin(), name.end(), *regex, flags);
  } catch (const std::regex_error&) {
    return false;  // complexity / stack limits on pathological patterns: treat as no match
  }
}

bool fnmatch_glob(std::string_view pat, std::string_view s) {
  // One pattern element against one character; `pi` advances past the element. A '[' without a
  // closing ']' is a literal, as in Python's fnmatch.translate.
  auto match_one = [&](size_t& pi, char c) -> bool {
    const char pc = pat[pi];
    if (pc == '?') { ++pi; return true; }
    if (pc == '[') {
      size_t j = pi + 1;
      if (j < pat.size() && pat[j] == '!') ++j;
      if (j < pat.size() && pat[j] == ']') ++j;  // a leading ']' is literal
      while (j < pat.size() && pat[j] != ']') ++j;
      if (j < pat.size()) {
        size_t i = pi + 1;
        const bool negate = pat[i] == '!';
        if (negate) ++i;
        bool hit = false;
        while (i < j) {
          if (i + 2 < j && pat[i + 1] == '-') {
            hit |= pat[i] <= c && c <= pat[i + 2];
            i += 3;
          } else {
            hit |= pat[i] == c;
            ++i;
          }
        }
        pi = j + 1;
        return hit != negate;
      }
    }
    ++pi;
    return pc == c;
  };
  size_t pi = 0, si = 0, star_p = std::string_view::npos, star_s = 0;
  while (si < s.size()) {
    if (pi < pat.size() && pat[pi] == '*') {
      star_p = ++pi;
      star_s = si;
      continue;
    }
    size_t next = pi;
    if (pi < pat.size() && match_one(next, s[si])) {
      pi = next;
      ++si;
      continue;
    }
    if (star_p == std::string_view::npos) return false;
    pi = star_p;  // let the last '*' swallow one more character and retry
    si = ++star_s;
  }
  while (pi < pat.size() && pat[pi] == '*') ++pi;
  return pi == pat.size();
}

bool QuantConfig::is_excluded(std::string_view name) const {
  if (method == QuantMethod::kNone) return true;
  for (const std::string& p : exclude_modules) {
    if (has_glob_chars(p)) {
      if (fnmatch_glob(p, name)) return true;
    } else if (name == p || (name.size() > p.size() && name.substr(0, p.size()) == p && name[p.size()] == '.')) {
      return true;
    }
  }
  for (const QuantOverride& ov : overrides)
    if (ov.matches(name)) return ov.skip;
  if (method == QuantMethod::kModelOpt) return false;
  if (is_lm_head(name)) return method == QuantMethod::kAutoRound || !lm_head_quantized;
  if (!block_name_to_quantize.empty()) {
    for (const std::string& b : block_name_to_quantize)
      if (name.size() > b.size() && name.substr(0, b.size()) == b && name[b.size()] == '.') return false;
    return true;
  }
  return false;
}

LayerQuant QuantConfig::layer(std::string_view name) const {
  LayerQuant q;
  if (is_excluded(name)) return q;
  q.quantized = true;
  q.bits = bits;
  q.group_size = group_size;
  q.zeros = zeros;
  if (method == QuantMethod::kModelOpt) {
    q.format = WeightFormat::kNvFp4;
    return q;
  }
  for (const QuantOverride& ov : overrides) {
    if (!ov.matches(name)) continue;
    if (ov.bits) q.bits = *ov.bits;
    if (ov.group_size) q.group_size = *ov.group_size;
    break;
  }
  auto f = int_format_for_bits(q.bits);
  MOEBIUS_ASSERT(f.ok(), "bits {} passed parse", q.bits);  // parse validated every bits value
  q.format = *f;
  return q;
}

namespace {

template <class J>
Result<QuantConfig> parse_quantization_config_impl(const J& qc) {
  if (!qc.is_object()) return Error::format("expected an object, got {}", qc.dump()).in_field("quantization_config");
  MOEBIUS_ASSIGN_OR_RETURN(auto method, get_string(qc, "quant_method", "quantization_config.quant_method"));
  if (!method) return Error("missing").in_field("quantization_config.quant_method");
  if (*method == "modelopt") return parse_modelopt_quant_config(qc);
  if (*method == "gptq") return parse_gptq_quant_config(qc);
  if (*method == "auto-round" || *method == "auto_round" || *method == "intel/auto-round")
    return parse_autoround_quant_config(qc);
  return Error::format("quant_method '{}' is not supported (supported: modelopt, gptq, auto-round)", *method)
      .in_field("quantization_config.quant_method");
}

template <class J>
Result<QuantConfig> parse_hf_quant_config_impl(const J& j) {
  if (!j.is_object()) return Error("hf_quant_config.json is not a JSON object");
  const J* q = find(j, "quantization");
  if (q == nullptr) return Error("missing").in_field("quantization");
  if (!q->is_object()) return Error::format("expected an object, got {}", q->dump()).in_field("quantization");
  QuantConfig c;
  MOEBIUS_ASSIGN_OR_RETURN(c.producer, producer_string(j, "producer"));
  MOEBIUS_ASSIGN_OR_RETURN(auto algo, get_string(*q, "quant_algo", "quantization.quant_algo"));
  if (!algo) return Error("missing").in_field("quantization.quant_algo");
  c.quant_algo = *algo;
  MOEBIUS_ASSIGN_OR_RETURN(auto gs, get_int(*q, "group_size", "quantization.group_size"));
  MOEBIUS_TRY(finish_modelopt(c, "quantization.quant_algo", gs, "quantization.group_size"));
  MOEBIUS_ASSIGN_OR_RETURN(c.exclude_modules, get_string_list(*q, "exclude_modules", "quantization.exclude_modules"));
  MOEBIUS_ASSIGN_OR_RETURN(auto kv, get_string(*q, "kv_cache_quant_algo", "quantization.kv_cache_quant_algo"));
  c.kv_cache_quant_algo = kv.value_or("");
  return c;
}

}  // namespace

Result<QuantConfig> parse_quantization_config(const nlohmann::json& qc) { return parse_quantization_config_impl(qc); }
Result<QuantConfig> parse_quantization_config(const nlohmann::ordered_json& qc) {
  return parse_quantization_config_impl(qc);
}
Result<QuantConfig> parse_hf_quant_config(const nlohmann::json& j) { return parse_hf_quant_config_impl(j); }
Result<QuantConfig> parse_hf_quant_config(const nlohmann::ordered_json& j) { return parse_hf_quant_config_impl(j); }

Result<QuantConfig> parse_quantization_config_text(std::string_view text, const std::string& source) {
  MOEBIUS_ASSIGN_OR_RETURN(auto j, parse_json_text(text, source));
  auto r = parse_quantization_config(j);
  if (!r.ok()) return std::move(r).error().in_file(source);
  return r;
}

Result<QuantConfig> parse_hf_quant_config_text(std::string_view text, const std::string& source) {
  MOEBIUS_ASSIGN_OR_RETURN(auto j, parse_json_text(text, source));
  auto r = parse_hf_quant_config(j);
  if (!r.ok()) return std::move(r).error().in_file(source);
  return r;
}

Result<QuantConfig> load_quant_config(const std::string& model_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string hf = (fs::path(model_dir) / "hf_quant_config.json").string();
  if (fs::exists(hf, ec)) {
    MOEBIUS_ASSIGN_OR_RETURN(std::string text, read_text_file(hf));
    return parse_hf_quant_config_text(text, hf);
  }
  const std::string cfg = (fs::path(model_dir) / "config.json").string();
  MOEBIUS_ASSIGN_OR_RETURN(std::string text, read_text_file(cfg));
  MOEBIUS_ASSIGN_OR_RETURN(auto j, parse_json_text(text, cfg));
  if (!j.is_object()) return Error("not a JSON object").in_file(cfg);
  const auto* qc = find(j, "quantization_config");
  if (qc == nullptr) return QuantConfig{};
  auto r = parse_quantization_config(*qc);
  if (!r.ok()) return std::move(r).error().in_file(cfg);
  return r;
}

}  // namespace moebius
