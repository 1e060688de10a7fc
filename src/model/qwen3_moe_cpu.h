// Qwen3-MoE on the CPU: weight loading from a Hugging Face checkpoint and the fp32 reference
// forward pass. This is the oracle the CUDA model runner is compared with, so it is written to be
// plainly right rather than fast (dot products accumulate in double; OpenMP spreads rows).
//
// Per layer (x: [T, H] residual stream, positions p0 .. p0+T-1):
//   h = RMSNorm(x) * input_layernorm                       [T, H]
//   q = h Wq^T [T, nh, hd]; k = h Wk^T, v = h Wv^T [T, nkv, hd]
//   q, k = RMSNorm over hd * q_norm / k_norm, per head      (Qwen3's QK-norm, before RoPE)
//   q, k = RoPE, neox layout (x[i] pairs with x[i + hd/2]), absolute positions
//   k, v -> KV cache; a = causal GQA softmax(q k^T / sqrt(hd)) v over cache rows [0, p]
//   x += a Wo^T                                            [T, H]
//   h = RMSNorm(x) * post_attention_layernorm
//   x += MoE(h) (softmax top-k router, SwiGLU experts) or dense SwiGLU MLP
// then logits = RMSNorm(x) * norm  lm_head^T              [T, V]
//
// Weight storage: dense weights (embeddings, attention, norms, router, dense MLP, lm_head) are
// upcast to fp32 vectors. Experts are QuantMatrix: by default kBF16 pointing straight into the
// mmap'd checkpoint for BF16 checkpoints (no copy, exact values), kF32 upcast for F16/F32 ones;
// `experts_format` re-quantizes them online (e.g. nvfp4 or int4) to study quantization error.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "cpu/moe_layer.h"
#include "formats/quant_matrix.h"
#include "model/kv_cache.h"
#include "model/qwen3_moe_config.h"

namespace moebius {
class SafetensorsCheckpoint;
}

namespace moebius::model {

struct Qwen3MoeLoadOptions {
  // Format of the expert weights; nullopt keeps the checkpoint's precision (see above). kBF16 and
  // kF32 convert; kNvFp4 and the int formats quantize the (upcast) weights with quantize().
  std::optional<WeightFormat> experts_format;
  int experts_group_size = 128;  // int formats only (-1 = per-channel); NVFP4 always uses 16
  // Round the SwiGLU intermediate to bf16 before the down projection, as the GPU kernels do.
  // Off (pure fp32) for comparisons with transformers in fp32.
  bool round_intermediate_to_bf16 = false;
};

struct Qwen3MoeLayerWeights {
  std::vector<float> input_norm;  // [H]
  std::vector<float> post_norm;   // [H]
  std::vector<float> q_proj;      // [nh * hd, H]
  std::vector<float> k_proj;      // [nkv * hd, H]
  std::vector<float> v_proj;      // [nkv * hd, H]
  std::vector<float> o_proj;      // [H, nh * hd]
  std::vector<float> q_norm;      // [hd]
  std::vector<float> k_norm;      // [hd]
  bool is_moe = false;
  cpu::MoeLayerReference moe;     // is_moe: router [E, H] + experts
  std::vector<float> gate_proj;   // !is_moe: [I, H]
  std::vector<float> up_proj;     // !is_moe: [I, H]
  std::vector<float> down_proj;   // !is_moe: [H, I]
};

// Checkpoint reading shared with the CUDA backend (qwen3_moe_cuda.h), which loads one layer at a
// time through these and uploads it:
// The tensor `name` upcast to fp32; it must exist with exactly `shape` and dtype BF16, F16 or F32.
Result<std::vector<float>> load_float_tensor(const SafetensorsCheckpoint& ck, const std::string& name,
                                             const Shape& shape);
// Layer `layer`'s weights (experts per options.experts_format, see Qwen3MoeLoadOptions).
Result<Qwen3MoeLayerWeights> load_qwen3_moe_layer(const std::shared_ptr<const SafetensorsCheckpoint>& ck,
                                                  const Qwen3MoeConfig& config, int layer,
                                                  const Qwen3MoeLoadOptions& options);

class Qwen3MoeCpu {
 public:
  // `dir`: a model directory with config.json and model.safetensors (or an index + shards).
  static Result<Qwen3MoeCpu> load(const std::string& dir, const Qwen3MoeLoadOptions& options = {});

  const Qwen3MoeConfig& config() const { return config_; }
  const std::vector<Qwen3MoeLayerWeights>& layers() const { return layers_; }

  // A cache shaped for this model; max_tokens defaults to max_position_embeddings.
  KvCache make_cache(int64_t max_tokens = 0, int block_size = 16) const;

  // Runs T tokens at positions cache.position() .. +T-1 (a prefill when the cache is empty, a
  // decode step when T == 1), appends their K/V to the cache and writes logits [T, V] fp32.
  // Errors (cache unchanged) for an id outside [0, V), a cache of another shape, or running past
  // the cache or max_position_embeddings.
  Status forward(const int32_t* ids, int T, KvCache& cache, float* logits) const;

 private:
  Status attention(const Qwen3MoeLayerWeights& w, int layer, const float* h, int T, int64_t p0, KvCache& cache,
                   float* out) const;

  Qwen3MoeConfig config_;
  std::shared_ptr<const SafetensorsCheckpoint> checkpoint_;  // owns the mmap that bf16 experts point into
  std::vector<float> embed_;    // [V, H]
  std::vector<float> norm_;     // [H]
  std::vector<float> lm_head_;  // [V, H]; empty when tied (embed_ is used)
  std::vector<Qwen3MoeLayerWeights> layers_;
  std::vector<float> inv_freq_;  // [hd / 2] RoPE inverse frequencies
};

}  // namespace moebius::model
