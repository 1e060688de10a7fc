// libFuzzer target: the model directory's small JSON files, each parser on the same bytes:
//   parse_qwen3_moe_config (config.json), parse_generation_config (generation_config.json),
//   parse_hf_quant_config_text (hf_quant_config.json), parse_quantization_config_text, and
//   parse_quantization_config on the input's "quantization_config" object, as load_quant_config
//   reads it out of config.json.
// Beyond "no crash, no sanitizer report": a refusal is an Error with a message, the file and a
// field; what is accepted keeps the invariants the model code relies on:
//   - Qwen3MoeConfig: positive sizes, nh % nkv == 0, an even head_dim, 1 <= k <= E (k == 0 when
//     E == 0), mlp_only_layers inside the model, finite positive rope_theta and rms_norm_eps,
//     finite RoPE frequencies, and every weight's rows x cols (and its fp32 bytes) in int64;
//   - GenerationConfig: eos ids >= 0, and defaults that validate_sampler_params accepts (they
//     become the sampler's parameters when no flag overrides them);
//   - QuantConfig: layer() of typical module names (which asserts that every bit width passed
//     the parse) gives 2/4/8-bit integer or NVFP4 formats with a group size -1 or > 0.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "fuzz_check.h"
#include "core/json_depth.h"
#include "cpu/rope.h"
#include "formats/quant_config.h"
#include "model/generation_config.h"
#include "model/qwen3_moe_config.h"
#include "model/sampler.h"

using namespace moebius;

namespace {

using moebius::fuzz::check;

template <class T>
void check_error(const Result<T>& r) {
  check(!r.error().message().empty() && r.error().file() == "fuzz.json");
}

// rows * cols elements, and the same in fp32 bytes, without int64 overflow.
void check_shape(int64_t rows, int64_t cols) {
  int64_t n = 0, bytes = 0;
  check(rows >= 1 && cols >= 1);
  check(!__builtin_mul_overflow(rows, cols, &n) && !__builtin_mul_overflow(n, int64_t{4}, &bytes));
}

void check_model(const model::Qwen3MoeConfig& c) {
  check(c.vocab_size >= 1 && c.hidden_size >= 1 && c.num_hidden_layers >= 1);
  check(c.num_attention_heads >= 1 && c.num_key_value_heads >= 1 && c.num_attention_heads % c.num_key_value_heads == 0);
  check(c.head_dim >= 2 && c.head_dim % 2 == 0);
  check(c.num_experts >= 0 && c.num_experts_per_tok >= 0 && c.num_experts_per_tok <= c.num_experts);
  check(c.num_experts == 0 || c.num_experts_per_tok >= 1);
  check(c.moe_intermediate_size >= 1 && c.intermediate_size >= 1);
  check(c.decoder_sparse_step >= 1 && c.max_position_embeddings >= 1);
  for (int l : c.mlp_only_layers) check(l >= 0 && l < c.num_hidden_layers);
  check(std::isfinite(c.rope_theta) && c.rope_theta > 0);
  check(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps > 0);
  for (float f : cpu::rope_inv_freq(c.rope_theta, c.head_dim)) check(std::isfinite(f) && f >= 0);
  // The loader's shapes (qwen3_moe_cpu.cpp, qwen3_moe_cuda.cpp).
  const int64_t H = c.hidden_size, q_dim = int64_t{c.num_attention_heads} * c.head_dim,
                kv_dim = int64_t{c.num_key_value_heads} * c.head_dim;
  check_shape(c.vocab_size, H);
  check_shape(q_dim, H);
  check_shape(kv_dim, H);
  check_shape(c.intermediate_size, H);
  check_shape(c.moe_intermediate_size, H);
  if (c.num_experts > 0) check_shape(c.num_experts, H);
  check(check_same_config(c, c).ok());
  for (int l = 0; l < std::min(c.num_hidden_layers, 256); ++l) (void)c.is_moe_layer(l);
}

void check_generation(const model::GenerationConfig& g) {
  for (int32_t id : g.eos_token_ids) check(id >= 0);
  model::SamplerParams p;
  if (g.temperature) p.temperature = *g.temperature;
  if (g.top_k) p.top_k = *g.top_k;
  if (g.top_p) p.top_p = *g.top_p;
  check(model::validate_sampler_params(p).ok());
}

void check_quant(const QuantConfig& q) {
  check(q.is_quantized());
  check(q.bits == 2 || q.bits == 4 || q.bits == 8);
  check(q.group_size == -1 || q.group_size > 0);
  static const char* const kModules[] = {
      "lm_head",
      "model.layers.0.self_attn.q_proj",
      "model.layers.1.mlp.gate",
      "model.layers.3.mlp.experts.7.down_proj",
      "model.layers.10.mlp.experts.0.gate_proj",
      "model.layers.0.mlp.shared_expert.up_proj",
  };
  for (const char* m : kModules) {
    const LayerQuant l = q.layer(m);  // asserts the override's bit width was checked
    if (!l.quantized) continue;
    check(l.bits == 2 || l.bits == 4 || l.bits == 8);
    check(l.group_size == -1 || l.group_size > 0);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 64 * 1024) return 0;  // config files are a few KiB; the parsers are linear
  const std::string_view text(reinterpret_cast<const char*>(data), size);

  if (auto c = model::parse_qwen3_moe_config(text, "fuzz.json"); c.ok()) check_model(*c);
  else check_error(c);

  if (auto g = model::parse_generation_config(text, "fuzz.json"); g.ok()) check_generation(*g);
  else check_error(g);

  for (auto* parse : {&parse_hf_quant_config_text, &parse_quantization_config_text}) {
    if (auto q = parse(text, "fuzz.json"); q.ok()) check_quant(*q);
    else check_error(q);
  }
  // load_quant_config's path: config.json's "quantization_config" object, parsed as there (ordered,
  // after the same depth check).
  if (!check_json_depth(text).ok()) return 0;
  const auto j = nlohmann::ordered_json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && j.contains("quantization_config") && !j["quantization_config"].is_null()) {
    auto q = parse_quantization_config(j["quantization_config"]);
    if (q.ok()) check_quant(*q);
    else check(!q.error().message().empty() && !q.error().field().empty());
  }
  return 0;
}
