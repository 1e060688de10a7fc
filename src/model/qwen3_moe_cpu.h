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
//
// Pre-quantized checkpoints (load_quant_config: hf_quant_config.json or config.json's
// "quantization_config"; ModelOpt NVFP4, GPTQ / AutoRound int2/4/8), see docs/FORMATS.md:
//   - An expert projection the config quantizes is built straight from its checkpoint tensors
//     (nvfp4::from_checkpoint / gptq::from_checkpoint, zero copy into the mmap) and its shape is
//     checked against config.json. Its tensors must be there: a missing weight_scale_2 or qweight
//     is an error naming the tensor.
//   - `experts_format` may only name the checkpoint's own format (the checkpoint's group size is
//     kept); any other format is refused: re-quantizing already-quantized weights would stack two
//     rounding errors into a model nobody validated. Start from the bf16 checkpoint instead.
//   - Expert projections the config excludes keep their source precision (never quantized
//     online, even with `experts_format`; a warning says so once per layer).
//   - Dense linear modules (attention, dense MLP, router, lm_head) the config quantizes and the
//     checkpoint stores quantized are dequantized to fp32 at load; when the checkpoint stores
//     them as float (tools leave e.g. the router unquantized without listing it), the float
//     tensor is used.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "cpu/moe_layer.h"
#include "formats/quant_config.h"
#include "formats/quant_matrix.h"
#include "model/kv_cache.h"
#include "model/qwen3_moe_config.h"
#include "moe/ep_moe_cpu.h"
#include "parallel/communicator.h"

namespace moebius {
class SafetensorsCheckpoint;
}

namespace moebius::model {

struct Qwen3MoeLoadOptions {
  // Format of the expert weights; nullopt keeps the checkpoint's precision (see above). kBF16 and
  // kF32 convert; kNvFp4 and the int formats quantize the (upcast) weights with quantize().
  std::optional<WeightFormat> experts_format;
  int experts_group_size = 128;  // int formats only (-1 = per-channel); NVFP4 always uses 16
  // Unquantized experts that experts_format does not convert (none given, or modules a
  // pre-quantized checkpoint excludes) become kBF16 even from F16/F32 checkpoints (the CUDA
  // runner has no fp32 experts); otherwise BF16 stays as is and F16/F32 is upcast to kF32.
  bool unquantized_experts_bf16 = false;
  // Round the SwiGLU intermediate to bf16 before the down projection, as the GPU kernels do.
  // Off (pure fp32) for comparisons with transformers in fp32.
  bool round_intermediate_to_bf16 = false;
  // Expert parallelism (moe/ep_moe_cpu.h): with a communicator, this model is rank
  // ep_comm->rank() of ep_comm->size(). It loads only its own E / N experts of every MoE layer
  // (Qwen3MoeLayerWeights::moe.experts holds those, [TAG_EP_EXPERT_OWNER]) and its MoE layers
  // dispatch to and combine from the other ranks. Every rank must then call forward /
  // forward_batch the same number of times (a rank with nothing to run passes no sequences), since
  // each MoE layer is a collective. Null: a single process holding every expert.
  std::shared_ptr<parallel::Communicator> ep_comm;
  moe::EpPayload ep_payload = moe::EpPayload::kF32;  // the dispatched rows' precision
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
// Linear module `module` ("lm_head", "model.layers.0.self_attn.q_proj") as fp32 [rows, cols]:
// dequantized when `quant` quantizes it and the checkpoint stores it quantized, else the float
// tensor "<module>.weight" (load_float_tensor).
Result<std::vector<float>> load_linear_weight(const SafetensorsCheckpoint& ck, const QuantConfig& quant,
                                              const std::string& module, int64_t rows, int64_t cols);
// Layer `layer`'s weights (experts per options.experts_format and `quant`, the checkpoint's
// load_quant_config(); see the notes above).
Result<Qwen3MoeLayerWeights> load_qwen3_moe_layer(const std::shared_ptr<const SafetensorsCheckpoint>& ck,
                                                  const Qwen3MoeConfig& config, const QuantConfig& quant,
                                                  int layer, const Qwen3MoeLoadOptions& options);
// The format of the checkpoint's quantized experts (the first MoE layer's expert 0 gate_proj as
// `quant` describes it); nullopt when it is not quantized.
std::optional<WeightFormat> quantized_experts_format(const Qwen3MoeConfig& config, const QuantConfig& quant);

class Qwen3MoeCpu {
 public:
  // `dir`: a model directory with config.json and model.safetensors (or an index + shards), and
  // for pre-quantized checkpoints hf_quant_config.json or config.json's quantization_config.
  static Result<Qwen3MoeCpu> load(const std::string& dir, const Qwen3MoeLoadOptions& options = {});

  const Qwen3MoeConfig& config() const { return config_; }
  const QuantConfig& quant_config() const { return quant_; }
  const std::vector<Qwen3MoeLayerWeights>& layers() const { return layers_; }

  // A cache shaped for this model; max_tokens defaults to max_position_embeddings.
  KvCache make_cache(int64_t max_tokens = 0, int block_size = 16) const;

  // Weight updates (`moebius serve`'s POST /update_weights_from_disk), in two steps so that
  // nothing of this model changes before the new checkpoint has been read and checked in full:
  //  1. stage_reload(dir) loads `dir` with this model's load options into a new model (which
  //     reads and checks every tensor: presence, shape, dtype, quantized layout, finite values
  //     where quantizing) and checks that it can take this one's place: config.json identical
  //     (check_same_config) and every expert projection in the same format, shape and group size.
  //     It reads only this model's config and expert formats, which never change outside
  //     commit_reload, so it may run on another thread while forward() runs.
  //  2. commit_reload(staged) takes the staged model's weights. The CPU backend keeps no state that
  //     holds weight addresses (the CUDA runner's captured graphs do, so it copies into its
  //     buffers instead), so the weights are swapped. KV caches made for this model stay valid.
  Result<Qwen3MoeCpu> stage_reload(const std::string& dir) const;
  void commit_reload(Qwen3MoeCpu&& staged);

  // Runs T tokens at positions cache.position() .. +T-1 (a prefill when the cache is empty, a
  // decode step when T == 1), appends their K/V to the cache and writes logits [T, V] fp32.
  // Errors (cache unchanged) for an id outside [0, V), a cache of another shape, or running past
  // the cache or max_position_embeddings.
  Status forward(const int32_t* ids, int T, KvCache& cache, float* logits) const;

  // One sequence of forward_batch: its new tokens, continuing its own cache.
  struct BatchSeq {
    std::span<const int32_t> ids;  // at least one, at positions cache->position() ..
    KvCache* cache = nullptr;      // distinct for each sequence of a batch
    bool want_logits = false;      // the logits of its last token are wanted
    bool all_logits = false;       // the logits of every new token are wanted (prompt logprobs)
  };
  // Several sequences in one pass (the server's step): every token of every sequence goes through
  // the norms, projections, router and experts together (each touched expert is dequantized once
  // per step, not once per sequence), attention runs per sequence over its own cache, and the
  // lm_head only for the wanted rows. Every op is per token, so each sequence's results are
  // bit-identical to forward() on it alone. Writes logits [R, V], in order: every new token's row
  // of a sequence with all_logits, the last token's of one with want_logits. Errors (every cache unchanged) as forward()'s, for any sequence.
  // With expert parallelism (options.ep_comm) `seqs` may be empty: the rank then only serves its
  // experts to the other ranks' tokens for this step.
  Status forward_batch(std::span<const BatchSeq> seqs, float* logits) const;
  // The checks forward_batch makes before it changes anything (token counts and ids, cache shapes
  // and room, positions): an error names the first failing sequence. Under expert parallelism
  // forward_batch is a collective, and a rank that returned early from it would leave the others
  // waiting, so a caller that may fail on one rank only runs these first and agrees with the
  // other ranks whether to step ([TAG_SERVE_DP]).
  Status check_batch(std::span<const BatchSeq> seqs) const;

  // Routing observer (`moebius profile-experts`): called once per MoE layer of every forward with
  // that layer's routing of the forward's N tokens, ids/weights [N, k] row-major. Empty: none.
  using RoutingObserver = std::function<void(int layer, const int32_t* ids, const float* weights, int64_t tokens)>;
  void set_routing_observer(RoutingObserver observer) { routing_observer_ = std::move(observer); }

  // Expert offload on the CPU backend, the analogue of the CUDA runner's cold experts in pinned
  // host memory: every expert that `placement` (offload/placement.h; one entry per MoE layer)
  // marks cold is copied into ONE separate host store, allocated once here, and its matrices are
  // pointed at that copy; the resident ones stay where they were. The forward reads experts through
  // their matrices exactly as before, so its results are bit-identical (tests check this). Returns
  // the store's bytes. Errors for a placement of another model.
  Result<uint64_t> move_cold_experts(const std::vector<int>& moe_layers,
                                     const std::vector<std::vector<uint8_t>>& resident);
  // Expert parallelism: every step starts with an all-gather of each rank's state (its token
  // count, or -1 for a rank that has no more work), so ranks that finish early keep serving their
  // experts. A rank with no more work calls this: it runs the other ranks' steps with no tokens of
  // its own and returns once every rank has called it. Without ep_comm it returns at once.
  Status ep_idle_until_all_done() const;

 private:
  // forward() (all_rows: logits of every token of the single sequence) and forward_batch().
  Status run(std::span<const BatchSeq> seqs, bool all_rows, float* logits) const;
  // The step header: all-gathers this rank's state (token count, or -1: done); *all_done when
  // every rank posted -1.
  Status ep_step_header(int32_t mine, bool* all_done) const;
  // The MoE layers of a step with no tokens on this rank (the other ranks' dispatches).
  Status ep_empty_step() const;
  // Attention of layer `layer` for the N tokens of `seqs` (rows in sequence order, h [N, H]),
  // their absolute positions [N]; writes their K/V into each sequence's cache and out [N, H].
  void attention(const Qwen3MoeLayerWeights& w, int layer, const float* h, std::span<const BatchSeq> seqs,
                 const std::vector<int64_t>& positions, float* out) const;

  Qwen3MoeConfig config_;
  Qwen3MoeLoadOptions options_;  // as loaded; a reload uses the same
  QuantConfig quant_;
  std::shared_ptr<const SafetensorsCheckpoint> checkpoint_;  // owns the mmap that bf16 experts point into
  std::vector<float> embed_;    // [V, H]
  std::vector<float> norm_;     // [H]
  std::vector<float> lm_head_;  // [V, H]; empty when tied (embed_ is used)
  std::vector<Qwen3MoeLayerWeights> layers_;
  std::vector<float> inv_freq_;  // [hd / 2] RoPE inverse frequencies
  RoutingObserver routing_observer_;
  std::shared_ptr<std::vector<uint8_t>> cold_store_;  // move_cold_experts' host store
};

}  // namespace moebius::model
