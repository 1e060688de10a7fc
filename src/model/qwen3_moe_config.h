// Qwen3-MoE model configuration, parsed from a Hugging Face config.json
// ("architectures": ["Qwen3MoeForCausalLM"]).
//
// Every field the forward pass depends on is read and type-checked; a missing or mistyped field is
// an Error naming the field and the file. Fields that transformers' Qwen3MoeConfig gives a default
// (head_dim, num_key_value_heads, norm_topk_prob, decoder_sparse_step, mlp_only_layers,
// tie_word_embeddings, max_position_embeddings, rope_scaling) may be absent and take that default.
// Features this engine does not implement (rope scaling other than linear and yarn, sliding-window
// attention, attention biases, activations other than silu) are refused rather than silently
// ignored. Values the model code would divide by, overflow on or allocate from are bounded here,
// defaults included: every size and nh x hd at most 2^30 (so every weight's rows x cols stays in
// int64), rope_theta >= 1, rms_norm_eps inside float's normal range.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace moebius::model {

// RoPE scaling: config.json's "rope_scaling" (transformers 4) or "rope_parameters" (transformers 5),
// with transformers' meaning (modeling_rope_utils.py; model/rope_frequencies.h computes the
// frequencies). Qwen3 documents YaRN for contexts past its 32k training length:
// {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}.
struct RopeScaling {
  enum class Type { kDefault, kLinear, kYarn };
  Type type = Type::kDefault;
  double factor = 1.0;  // linear, yarn: >= 1; yarn without one: max_position_embeddings / original
                        // (transformers 4.5x's reading; transformers 5 refuses it)
  // yarn: the pretrained context the correction range is computed from; the config's
  // max_position_embeddings when absent (resolved at parse time, so never 0 for yarn).
  int64_t original_max_position_embeddings = 0;
  double attention_factor = 0.0;  // yarn: > 0 when given; 0 = derived from factor (and mscale)
  double beta_fast = 32.0;        // yarn: rotations bounding the ramp (transformers' defaults)
  double beta_slow = 1.0;
  double mscale = 0.0;            // yarn, DeepSeek-style attention factor; 0 = absent
  double mscale_all_dim = 0.0;
  bool truncate = true;           // yarn: floor/ceil the correction range
  bool operator==(const RopeScaling&) const = default;
};

// "default", "linear (factor 4)", "yarn (factor 4, original 32768, ...)": for messages.
std::string rope_scaling_text(const RopeScaling& r);

struct Qwen3MoeConfig {
  int64_t vocab_size = 0;               // V
  int64_t hidden_size = 0;              // H
  int num_hidden_layers = 0;            // L
  int num_attention_heads = 0;          // nh (query heads)
  int num_key_value_heads = 0;          // nkv; nh % nkv == 0 (GQA)
  int head_dim = 0;                     // hd; default H / nh; must be even for RoPE
  double rope_theta = 10000.0;          // RoPE base
  float rms_norm_eps = 1e-6f;
  int num_experts = 0;                  // E; 0 means every layer is dense
  int num_experts_per_tok = 0;          // k
  int64_t moe_intermediate_size = 0;    // per-expert I
  int64_t intermediate_size = 0;        // dense-layer I
  bool norm_topk_prob = false;          // renormalise the k routing weights to sum to 1
  int decoder_sparse_step = 1;
  std::vector<int> mlp_only_layers;     // layers forced dense
  bool tie_word_embeddings = false;     // lm_head shares model.embed_tokens.weight
  int64_t max_position_embeddings = 32768;
  RopeScaling rope_scaling;

  // The positions a sequence may use: max_position_embeddings, stretched by RoPE scaling (linear:
  // x factor; yarn: original x factor, at least max_position_embeddings), as vLLM does. Context
  // limits check against this; default allocations stay at max_position_embeddings.
  int64_t context_limit() const;

  // transformers' Qwen3MoeDecoderLayer rule: a layer is MoE iff it is not in mlp_only_layers,
  // num_experts > 0 and (layer + 1) % decoder_sparse_step == 0.
  bool is_moe_layer(int layer) const;
};

// `text` is the JSON of a config.json; `source` names it in errors (usually its path).
Result<Qwen3MoeConfig> parse_qwen3_moe_config(std::string_view text, const std::string& source);
// Reads `path`, or `path`/config.json when `path` is a directory.
Result<Qwen3MoeConfig> load_qwen3_moe_config(const std::string& path);

// Ok when a model of `incoming` can take the place of one of `serving` (a weight update): every
// field is identical (geometry, RoPE, norms, routing, which layers are MoE). Otherwise an Error
// naming the first field that differs and both values; the caller adds the file.
Status check_same_config(const Qwen3MoeConfig& serving, const Qwen3MoeConfig& incoming);

// The published configs of real models, for dummy-weight benchmarks without a checkpoint:
// "qwen3-30b-a3b" (Qwen/Qwen3-30B-A3B) and "qwen3-235b-a22b" (Qwen/Qwen3-235B-A22B).
Result<Qwen3MoeConfig> named_qwen3_moe_config(const std::string& name);

}  // namespace moebius::model
