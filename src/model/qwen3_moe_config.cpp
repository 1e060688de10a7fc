#include "model/qwen3_moe_config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/json_depth.h"
#include "core/memory.h"
#include "model/rope_frequencies.h"

namespace moebius::model {
namespace {

using nlohmann::json;

// Field readers: nullopt-with-default when absent (for optional fields), an Error naming the
// field when present with the wrong type or out of range. The caller adds the file.
const json* find(const json& j, const char* key) {
  auto it = j.find(key);
  return it == j.end() ? nullptr : &*it;
}

// A default is range-checked too: head_dim's, hidden_size / num_attention_heads, can be 0.
Result<int64_t> read_int(const json& j, const char* key, std::optional<int64_t> dflt, int64_t lo, int64_t hi) {
  const json* v = find(j, key);
  if (v == nullptr || (v->is_null() && dflt)) {
    if (!dflt) return Error("missing").in_field(key);
    if (*dflt < lo || *dflt > hi)
      return Error::format("absent, and its default {} is outside [{}, {}]", *dflt, lo, hi).in_field(key);
    return *dflt;
  }
  if (!v->is_number_integer()) return Error::format("expected an integer, got {}", v->dump()).in_field(key);
  if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(hi))
    return Error::format("{} is outside [{}, {}]", v->dump(), lo, hi).in_field(key);
  const int64_t x = v->get<int64_t>();
  if (x < lo || x > hi) return Error::format("{} is outside [{}, {}]", x, lo, hi).in_field(key);
  return x;
}

Result<double> read_float(const json& j, const char* key, std::optional<double> dflt) {
  const json* v = find(j, key);
  if (v == nullptr) {
    if (dflt) return *dflt;
    return Error("missing").in_field(key);
  }
  if (!v->is_number()) return Error::format("expected a number, got {}", v->dump()).in_field(key);
  const double x = v->get<double>();
  if (!std::isfinite(x) || x <= 0) return Error::format("expected a positive number, got {}", v->dump()).in_field(key);
  return x;
}

Result<bool> read_bool(const json& j, const char* key, bool dflt) {
  const json* v = find(j, key);
  if (v == nullptr) return dflt;
  if (!v->is_boolean()) return Error::format("expected true or false, got {}", v->dump()).in_field(key);
  return v->get<bool>();
}

constexpr int64_t kMaxInt = int64_t{1} << 30;  // far above any real dimension; keeps products in int64

// An optional number inside the rope scaling object: `dflt` when absent or null, else a finite
// number >= lo; errors name "<field>.<key>".
Result<double> read_rope_number(const json& rs, const char* field, const char* key, double dflt, double lo) {
  const json* v = find(rs, key);
  if (v == nullptr || v->is_null()) return dflt;
  if (!v->is_number()) return Error::format("expected a number, got {}", v->dump()).in_field(std::string(field) + "." + key);
  const double x = v->get<double>();
  if (!std::isfinite(x) || x < lo)
    return Error::format("{} is not a finite number >= {}", v->dump(), lo).in_field(std::string(field) + "." + key);
  return x;
}

// Which object holds the scaling, as transformers 5 picks it (`rope_scaling or rope_parameters`): a
// non-empty "rope_scaling", else "rope_parameters" (transformers 5's type, theta and scaling
// together). Absent or null: none.
const char* rope_scaling_field(const json& j) {
  const json* rs = find(j, "rope_scaling");
  if (rs != nullptr && !rs->is_null() && !(rs->is_object() && rs->empty())) return "rope_scaling";
  return find(j, "rope_parameters") != nullptr ? "rope_parameters" : "rope_scaling";
}

// Types: default, linear, yarn; the others (dynamic and ntk, which change the frequencies with the
// sequence length, longrope, llama3) are refused by name, as is a partial rotary dimension.
Result<RopeScaling> parse_rope_scaling(const json& j, int64_t max_position_embeddings, double rope_theta) {
  const char* field = rope_scaling_field(j);
  const json* rs = find(j, field);
  RopeScaling r;
  for (const json* holder : {&j, rs}) {
    if (holder == nullptr || !holder->is_object()) continue;
    if (const json* prf = find(*holder, "partial_rotary_factor");
        prf != nullptr && !prf->is_null() && !(prf->is_number() && prf->get<double>() == 1.0))
      return Error::format("{}: rotating part of each head is not supported (only 1)", prf->dump())
          .in_field(holder == &j ? std::string("partial_rotary_factor") : std::string(field) + ".partial_rotary_factor");
  }
  if (rs == nullptr || rs->is_null()) return r;
  if (!rs->is_object()) return Error::format("expected null or an object, got {}", rs->dump()).in_field(field);
  const json* type = find(*rs, "rope_type");
  if (type == nullptr) type = find(*rs, "type");  // transformers' older key
  const std::string name = type == nullptr ? "default" : type->is_string() ? type->get<std::string>() : "";
  if (name == "default") return r;
  if (name != "linear" && name != "yarn")
    return Error::format("rope scaling {} is not supported (default, linear or yarn)", type->dump()).in_field(field);
  const std::string f = field;
  const json* factor = find(*rs, "factor");
  // The pretrained context: the scaling's own, or (transformers 5) a top-level one; both present
  // and different is refused rather than guessed. A whole-number float (32768.0) is taken.
  const auto read_original = [](const json* v, const std::string& name) -> Result<int64_t> {
    const bool whole = v->is_number_integer() || (v->is_number_float() && std::isfinite(v->get<double>()) &&
                                                  v->get<double>() == std::floor(v->get<double>()));
    const double x = whole ? v->get<double>() : 0.0;
    if (!whole || x < 1 || x > static_cast<double>(kMaxInt))
      return Error::format("expected an integer in [1, 2^30], got {}", v->dump()).in_field(name);
    return static_cast<int64_t>(x);
  };
  const json* original = find(*rs, "original_max_position_embeddings");
  const json* top_original = find(j, "original_max_position_embeddings");
  r.original_max_position_embeddings = max_position_embeddings;
  if (original != nullptr && !original->is_null()) {
    MOEBIUS_ASSIGN_OR_RETURN(r.original_max_position_embeddings,
                             read_original(original, f + ".original_max_position_embeddings"));
  }
  if (top_original != nullptr && !top_original->is_null()) {
    MOEBIUS_ASSIGN_OR_RETURN(const int64_t top, read_original(top_original, "original_max_position_embeddings"));
    if (original != nullptr && !original->is_null() && top != r.original_max_position_embeddings)
      return Error::format("{} at the top level, {} in {}: which one is meant is unclear", top,
                           r.original_max_position_embeddings, f)
          .in_field("original_max_position_embeddings");
    r.original_max_position_embeddings = top;
  }
  if (name == "linear") {
    r.type = RopeScaling::Type::kLinear;
    if (factor == nullptr || factor->is_null()) return Error("linear rope scaling needs a factor").in_field(f + ".factor");
    MOEBIUS_ASSIGN_OR_RETURN(r.factor, read_rope_number(*rs, field, "factor", 1.0, 1.0));
    r.original_max_position_embeddings = 0;  // yarn's alone
    return r;
  }
  r.type = RopeScaling::Type::kYarn;
  // YaRN's correction range divides by ln(theta).
  if (rope_theta <= 1.0) return Error::format("yarn needs rope_theta above 1, got {}", rope_theta).in_field(f);
  // Without a factor: the ratio of the two contexts, as transformers 4.5x read it (transformers
  // 5.17 refuses a yarn entry without one; tests/data/rope/rope_scaling_ref.json records that).
  const double ratio = static_cast<double>(max_position_embeddings) / static_cast<double>(r.original_max_position_embeddings);
  MOEBIUS_ASSIGN_OR_RETURN(r.factor, read_rope_number(*rs, field, "factor", ratio, 1.0));
  if (r.factor < 1.0)
    return Error::format("{} (max_position_embeddings / original_max_position_embeddings) is below 1", r.factor)
        .in_field(f + ".factor");
  MOEBIUS_ASSIGN_OR_RETURN(r.attention_factor, read_rope_number(*rs, field, "attention_factor", 0.0, 0.0));
  if (const json* af = find(*rs, "attention_factor"); af != nullptr && !af->is_null() && r.attention_factor == 0.0)
    return Error("must be positive").in_field(f + ".attention_factor");
  // transformers takes `beta or default`, so 0 means the default too.
  MOEBIUS_ASSIGN_OR_RETURN(r.beta_fast, read_rope_number(*rs, field, "beta_fast", 32.0, 0.0));
  MOEBIUS_ASSIGN_OR_RETURN(r.beta_slow, read_rope_number(*rs, field, "beta_slow", 1.0, 0.0));
  if (r.beta_fast == 0.0) r.beta_fast = 32.0;
  if (r.beta_slow == 0.0) r.beta_slow = 1.0;
  MOEBIUS_ASSIGN_OR_RETURN(r.mscale, read_rope_number(*rs, field, "mscale", 0.0, 0.0));
  MOEBIUS_ASSIGN_OR_RETURN(r.mscale_all_dim, read_rope_number(*rs, field, "mscale_all_dim", 0.0, 0.0));
  // transformers reads it with .get("truncate", True): a null is falsy, so no truncation.
  if (const json* t = find(*rs, "truncate"); t != nullptr) {
    if (!t->is_boolean() && !t->is_null())
      return Error::format("expected true, false or null, got {}", t->dump()).in_field(f + ".truncate");
    r.truncate = t->is_boolean() && t->get<bool>();
  }
  return r;
}

Result<Qwen3MoeConfig> parse_json(const json& j) {
  if (!j.is_object()) return Error("expected a JSON object");
  // Architecture: "architectures": ["Qwen3MoeForCausalLM"]; model_type, when present, must agree.
  const json* arch = find(j, "architectures");
  if (arch == nullptr) return Error("missing").in_field("architectures");
  if (!arch->is_array() || arch->size() != 1 || !(*arch)[0].is_string())
    return Error::format("expected a list with one string, got {}", arch->dump()).in_field("architectures");
  if ((*arch)[0].get<std::string>() != "Qwen3MoeForCausalLM")
    return Error::format("architecture {} is not supported (supported: Qwen3MoeForCausalLM)", (*arch)[0].dump())
        .in_field("architectures");
  if (const json* mt = find(j, "model_type"); mt != nullptr && *mt != "qwen3_moe")
    return Error::format("expected \"qwen3_moe\", got {}", mt->dump()).in_field("model_type");

  Qwen3MoeConfig c;
  MOEBIUS_ASSIGN_OR_RETURN(c.vocab_size, read_int(j, "vocab_size", {}, 1, kMaxInt));
  MOEBIUS_ASSIGN_OR_RETURN(c.hidden_size, read_int(j, "hidden_size", {}, 1, kMaxInt));
  MOEBIUS_ASSIGN_OR_RETURN(int64_t layers, read_int(j, "num_hidden_layers", {}, 1, 100000));
  MOEBIUS_ASSIGN_OR_RETURN(int64_t heads, read_int(j, "num_attention_heads", {}, 1, 100000));
  MOEBIUS_ASSIGN_OR_RETURN(int64_t kv_heads, read_int(j, "num_key_value_heads", heads, 1, 100000));
  MOEBIUS_ASSIGN_OR_RETURN(int64_t head_dim, read_int(j, "head_dim", c.hidden_size / heads, 1, 100000));
  c.num_hidden_layers = static_cast<int>(layers);
  c.num_attention_heads = static_cast<int>(heads);
  c.num_key_value_heads = static_cast<int>(kv_heads);
  c.head_dim = static_cast<int>(head_dim);
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    return Error::format("{} query heads are not a multiple of {} KV heads", heads, kv_heads)
        .in_field("num_key_value_heads");
  if (c.head_dim % 2 != 0) return Error::format("head_dim {} is odd; RoPE needs it even", head_dim).in_field("head_dim");
  // Every weight is at most kMaxInt x kMaxInt, so rows x cols (and its fp32 bytes) stay in int64;
  // q_proj's rows are nh x hd, which the per-field bounds alone let reach 10^10.
  if (heads * head_dim > kMaxInt)
    return Error::format("num_attention_heads {} x head_dim {} = {} is more than 2^30", heads, head_dim,
                         heads * head_dim)
        .in_field("head_dim");
  // transformers 5 keeps the base inside rope_parameters, and that one wins over a top-level one.
  const json* rope_params = find(j, "rope_parameters");
  const bool theta_inside = rope_params != nullptr && rope_params->is_object() && find(*rope_params, "rope_theta") != nullptr;
  if (theta_inside) {
    auto theta = read_float(*rope_params, "rope_theta", {});
    if (!theta.ok()) return Error(theta.error().message()).in_field("rope_parameters.rope_theta");
    c.rope_theta = *theta;
  } else {
    MOEBIUS_ASSIGN_OR_RETURN(c.rope_theta, read_float(j, "rope_theta", {}));
  }
  // rope_inv_freq computes theta^(-2i/hd) in double and stores floats: below 1 the frequencies grow
  // instead of decaying, past float's range for a tiny base (real models use 1e4 to 1e7).
  if (c.rope_theta < 1.0) return Error::format("{} is below 1", c.rope_theta).in_field("rope_theta");
  MOEBIUS_ASSIGN_OR_RETURN(double eps, read_float(j, "rms_norm_eps", {}));
  // Stored as a float: past float's range the conversion is undefined; below its normal range it
  // rounds towards 0, and RMSNorm of a zero row then divides by 0.
  if (eps > std::numeric_limits<float>::max() || eps < std::numeric_limits<float>::min())
    return Error::format("{} does not fit a float32 in [{}, {}]", eps, std::numeric_limits<float>::min(),
                         std::numeric_limits<float>::max())
        .in_field("rms_norm_eps");
  c.rms_norm_eps = static_cast<float>(eps);

  MOEBIUS_ASSIGN_OR_RETURN(int64_t experts, read_int(j, "num_experts", {}, 0, 1 << 20));
  c.num_experts = static_cast<int>(experts);
  MOEBIUS_ASSIGN_OR_RETURN(int64_t topk, read_int(j, "num_experts_per_tok", {}, experts > 0 ? 1 : 0, 1 << 20));
  c.num_experts_per_tok = static_cast<int>(topk);
  if (c.num_experts_per_tok > c.num_experts)
    return Error::format("{} experts per token but only {} experts", topk, experts).in_field("num_experts_per_tok");
  MOEBIUS_ASSIGN_OR_RETURN(c.moe_intermediate_size, read_int(j, "moe_intermediate_size", {}, 1, kMaxInt));
  MOEBIUS_ASSIGN_OR_RETURN(c.intermediate_size, read_int(j, "intermediate_size", {}, 1, kMaxInt));
  MOEBIUS_ASSIGN_OR_RETURN(c.norm_topk_prob, read_bool(j, "norm_topk_prob", false));
  MOEBIUS_ASSIGN_OR_RETURN(int64_t step, read_int(j, "decoder_sparse_step", 1, 1, 100000));
  c.decoder_sparse_step = static_cast<int>(step);
  if (const json* m = find(j, "mlp_only_layers"); m != nullptr && !m->is_null()) {
    if (!m->is_array()) return Error::format("expected a list of layer indices, got {}", m->dump()).in_field("mlp_only_layers");
    for (const json& e : *m) {
      if (!e.is_number_integer() || e.get<int64_t>() < 0 || e.get<int64_t>() >= layers)
        return Error::format("entry {} is not a layer index in [0, {})", e.dump(), layers).in_field("mlp_only_layers");
      c.mlp_only_layers.push_back(e.get<int>());
    }
  }
  MOEBIUS_ASSIGN_OR_RETURN(c.tie_word_embeddings, read_bool(j, "tie_word_embeddings", false));
  MOEBIUS_ASSIGN_OR_RETURN(c.max_position_embeddings, read_int(j, "max_position_embeddings", 32768, 1, kMaxInt));
  MOEBIUS_ASSIGN_OR_RETURN(c.rope_scaling, parse_rope_scaling(j, c.max_position_embeddings, c.rope_theta));
  if (c.context_limit() > kMaxInt)
    return Error::format("factor {} stretches the context past 2^30 positions", c.rope_scaling.factor)
        .in_field(rope_scaling_field(j));
  // Settings each in range can still combine into a degenerate YaRN: beta_fast = beta_slow near 0
  // make the correction range inf (a NaN ramp), an mscale ratio or attention_factor can overflow
  // float. Every frequency must come out finite (0 is a dimension that never turns: a huge
  // rope_theta gives it, harmlessly) and the attention factor finite and positive.
  {
    const RopeFrequencies f = rope_frequencies(c);
    const auto bad_freq = [](float v) { return !std::isfinite(v) || v < 0.0f; };
    if (std::any_of(f.inv_freq.begin(), f.inv_freq.end(), bad_freq) || !std::isfinite(f.attention_factor) ||
        f.attention_factor <= 0.0f)
      return Error("these settings give a RoPE frequency or attention factor that is not a finite number")
          .in_field(rope_scaling_field(j));
  }

  // Refuse what the forward pass would silently get wrong.
  MOEBIUS_ASSIGN_OR_RETURN(bool bias, read_bool(j, "attention_bias", false));
  if (bias) return Error("attention biases are not supported").in_field("attention_bias");
  MOEBIUS_ASSIGN_OR_RETURN(bool sliding, read_bool(j, "use_sliding_window", false));
  if (sliding) return Error("sliding-window attention is not supported").in_field("use_sliding_window");
  if (const json* act = find(j, "hidden_act"); act != nullptr && *act != "silu")
    return Error::format("activation {} is not supported (supported: \"silu\")", act->dump()).in_field("hidden_act");
  return c;
}

}  // namespace

std::string rope_scaling_text(const RopeScaling& r) {
  switch (r.type) {
    case RopeScaling::Type::kDefault:
      return "default";
    case RopeScaling::Type::kLinear:
      return fmt::format("linear (factor {})", r.factor);
    case RopeScaling::Type::kYarn:
      return fmt::format("yarn (factor {}, original {}, attention_factor {}, beta {}/{}, mscale {}/{}, truncate {})",
                         r.factor, r.original_max_position_embeddings, r.attention_factor, r.beta_fast, r.beta_slow,
                         r.mscale, r.mscale_all_dim, r.truncate);
  }
  return "?";
}

int64_t Qwen3MoeConfig::context_limit() const {
  double stretched = 0.0;
  switch (rope_scaling.type) {
    case RopeScaling::Type::kDefault:
      return max_position_embeddings;
    case RopeScaling::Type::kLinear:
      stretched = static_cast<double>(max_position_embeddings) * rope_scaling.factor;
      break;
    case RopeScaling::Type::kYarn:
      stretched = static_cast<double>(rope_scaling.original_max_position_embeddings) * rope_scaling.factor;
      break;
  }
  // A huge factor saturates (the parser refuses anything past 2^30) instead of overflowing the cast.
  if (!(stretched < 4.0e18)) return int64_t{4} << 60;
  return std::max(max_position_embeddings, static_cast<int64_t>(stretched));
}

bool Qwen3MoeConfig::is_moe_layer(int layer) const {
  const bool forced_dense = std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end();
  return !forced_dense && num_experts > 0 && (layer + 1) % decoder_sparse_step == 0;
}

Status check_same_config(const Qwen3MoeConfig& a, const Qwen3MoeConfig& b) {
  std::optional<Error> first;  // the first field that differs
  const auto same = [&first](const char* field, const auto& serving, const auto& incoming) {
    if (first || serving == incoming) return;
    first = Error::format("is {} here, the serving model has {}; a weight update needs an identical config",
                          incoming, serving)
                .in_field(field);
  };
  same("vocab_size", a.vocab_size, b.vocab_size);
  same("hidden_size", a.hidden_size, b.hidden_size);
  same("num_hidden_layers", a.num_hidden_layers, b.num_hidden_layers);
  same("num_attention_heads", a.num_attention_heads, b.num_attention_heads);
  same("num_key_value_heads", a.num_key_value_heads, b.num_key_value_heads);
  same("head_dim", a.head_dim, b.head_dim);
  same("rope_theta", a.rope_theta, b.rope_theta);
  same("rms_norm_eps", a.rms_norm_eps, b.rms_norm_eps);
  same("num_experts", a.num_experts, b.num_experts);
  same("num_experts_per_tok", a.num_experts_per_tok, b.num_experts_per_tok);
  same("moe_intermediate_size", a.moe_intermediate_size, b.moe_intermediate_size);
  same("intermediate_size", a.intermediate_size, b.intermediate_size);
  same("norm_topk_prob", a.norm_topk_prob, b.norm_topk_prob);
  same("decoder_sparse_step", a.decoder_sparse_step, b.decoder_sparse_step);
  same("mlp_only_layers", fmt::format("[{}]", fmt::join(a.mlp_only_layers, ", ")),
       fmt::format("[{}]", fmt::join(b.mlp_only_layers, ", ")));
  same("tie_word_embeddings", a.tie_word_embeddings, b.tie_word_embeddings);
  same("max_position_embeddings", a.max_position_embeddings, b.max_position_embeddings);
  same("rope_scaling", rope_scaling_text(a.rope_scaling), rope_scaling_text(b.rope_scaling));
  if (first) return std::move(*first);
  return Ok{};
}

Result<Qwen3MoeConfig> parse_qwen3_moe_config(std::string_view text, const std::string& source) {
  // [TAG_JSON_DEPTH] Errors quote values with dump(), which recurses per level.
  if (Status depth = check_json_depth(text); !depth.ok()) return std::move(depth).error().in_file(source);
  const json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Error("not valid JSON").in_file(source);
  auto r = parse_json(j);
  if (!r.ok()) return std::move(r).error().in_file(source);
  return r;
}

Result<Qwen3MoeConfig> load_qwen3_moe_config(const std::string& path) {
  std::string file = path;
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    file = (std::filesystem::path(path) / "config.json").string();
  } else if (std::filesystem::exists(path, ec) && std::filesystem::path(path).extension() != ".json") {
    return Error("is not a model directory (config.json, safetensors, tokenizer.json) nor a config.json file")
        .in_file(path);
  }
  MOEBIUS_ASSIGN_OR_RETURN(std::string text, read_small_file(file));
  return parse_qwen3_moe_config(text, file);
}

Result<Qwen3MoeConfig> named_qwen3_moe_config(const std::string& name) {
  Qwen3MoeConfig c;
  // Shared by both (their config.json files): vocab 151936, hd 128, rope_theta 1e6, eps 1e-6,
  // 128 experts, top-8, renormalised top-k, every layer MoE, untied lm_head, 40960 positions.
  c.vocab_size = 151936;
  c.head_dim = 128;
  c.rope_theta = 1e6;
  c.rms_norm_eps = 1e-6f;
  c.num_experts = 128;
  c.num_experts_per_tok = 8;
  c.norm_topk_prob = true;
  c.decoder_sparse_step = 1;
  c.tie_word_embeddings = false;
  c.max_position_embeddings = 40960;
  if (name == "qwen3-30b-a3b") {
    c.hidden_size = 2048;
    c.num_hidden_layers = 48;
    c.num_attention_heads = 32;
    c.num_key_value_heads = 4;
    c.moe_intermediate_size = 768;
    c.intermediate_size = 6144;
    return c;
  }
  if (name == "qwen3-235b-a22b") {
    c.hidden_size = 4096;
    c.num_hidden_layers = 94;
    c.num_attention_heads = 64;
    c.num_key_value_heads = 4;
    c.moe_intermediate_size = 1536;
    c.intermediate_size = 12288;
    return c;
  }
  return Error::format("unknown model geometry '{}'; expected qwen3-30b-a3b or qwen3-235b-a22b", name)
      .in_field("--geometry");
}

}  // namespace moebius::model
