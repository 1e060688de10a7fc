// Text generation with the CPU model: prefill the prompt, then decode one token at a time with the
// KV cache, sampling each token (sampler.h) until an eos id or the token budget. Tokenization is
// the caller's job (src/model does not depend on src/tokenizer): prompts come in as ids and each
// generated id goes out through a callback; `moebius generate` (src/cli/generate.cpp) adds the
// tokenizer and the streaming detokenizer around run_generate().
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "formats/quant_matrix.h"
#include "model/generation_config.h"
#include "model/qwen3_moe_cpu.h"
#include "model/qwen3_moe_cuda.h"
#include "model/sampler.h"
#include "offload/expert_cache.h"
#include "offload/model_expert_cache.h"

namespace moebius::model {

struct GenerateOptions {
  std::string model_dir;
  std::vector<int32_t> prompt_ids;  // non-empty, each in [0, vocab_size)
  int max_tokens = 128;             // >= 0; generation also stops when the context is full
  // Sampling. Unset fields take generation_config.json's value, else SamplerParams' default;
  // do_sample: false there makes the default temperature 0 (greedy), as in HF.
  std::optional<float> temperature;
  std::optional<int> top_k;
  std::optional<float> top_p;
  std::optional<float> min_p;
  std::optional<float> repetition_penalty;  // generation_config.json has it for some models
  float presence_penalty = 0.0f;            // OpenAI's; generation_config.json never sets them
  float frequency_penalty = 0.0f;
  uint64_t seed = 0;
  std::string experts;          // "" keeps the checkpoint's precision; bf16, nvfp4, int4, int2
  std::string backend = "cpu";  // cpu or cuda
  // "auto" reads the checkpoint; "dummy" (cuda only) builds random weights of config.json's
  // geometry with neutral expert scales, for benchmarks.
  std::string load_format = "auto";
  int prefill_chunk = 2048;     // cuda: prompt tokens per forward (chunked prefill past it)
  bool autotune = false;        // cuda: tune the MoE kernels (Qwen3MoeCudaOptions::autotune)
  // cuda: expert offload (Qwen3MoeCudaOptions::gpu_memory_budget / placement_file / expert_cache /
  // expert_prefetch; expert_dma: expert_dma_slots, -1 (no --expert-dma) for its environment default).
  std::string gpu_memory_budget;
  std::string placement_file;
  offload::ExpertCacheFlags expert_cache;
  int expert_prefetch = 0;
  int expert_dma = -1;
  // Expert parallelism: the experts split over `ep` ranks (cpu: threads of this process over the
  // in-process communicator; rank 0 runs the prompt, the others serve their experts). 1: off.
  // cuda: this process is one rank of ep_comm (an NCCL communicator of size ep, made by the
  // worker set-up in src/cli/ep_workers.h); rank 0 generates, the others serve their experts in
  // lockstep (Qwen3MoeCuda::ep_idle_until_all_done) and return stats with ep_follower set.
  int ep = 1;
  std::shared_ptr<parallel::Communicator> ep_comm;
  // Called while loading (done, total layers) and with the memory plan text before generation
  // (cuda); either may be empty.
  std::function<void(int done, int total)> on_progress;
  std::function<void(const std::string& text)> on_report;
  // Overrides generation_config.json's eos_token_id when set (an empty list: never stop early).
  std::optional<std::vector<int32_t>> eos_token_ids;
};

struct GenerateStats {
  int64_t prompt_tokens = 0;
  std::vector<int32_t> generated;  // the sampled ids, without the eos id that ended the run
  bool stopped_at_eos = false;
  int64_t decode_steps = 0;        // single-token forward passes (generated tokens after the first)
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;
  // Weight bytes one decode step reads; see decode_weight_bytes().
  uint64_t weight_bytes_per_token = 0;
  uint32_t logits_hash = 0;        // fnv1a_logits() of the logits the last token was sampled from
  bool ep_follower = false;        // cuda --ep: this process was a rank other than 0 (no output)
  // cuda --expert-cache: the cache's counts over the run (the steps whose routing it was fed).
  std::optional<offload::ModelCacheStats> expert_cache;

  double prefill_tok_s() const { return prefill_seconds > 0 ? prompt_tokens / prefill_seconds : 0.0; }
  double decode_tok_s() const { return decode_seconds > 0 ? decode_steps / decode_seconds : 0.0; }
  double decode_gb_s() const { return decode_tok_s() * static_cast<double>(weight_bytes_per_token) / 1e9; }
};

// Called with each generated id as soon as it is sampled (never with the eos id).
using TokenCallback = std::function<void(int32_t id)>;

// Validates `options` (before loading anything), loads the model from options.model_dir and its
// generation_config.json, and generates. Errors name the offending flag (--temperature, ...).
Result<GenerateStats> run_generate(const GenerateOptions& options, const TokenCallback& on_token);

// The generation loop on an already-loaded model. `sampler` carries the request's RNG.
Result<GenerateStats> generate(const Qwen3MoeCpu& model, std::span<const int32_t> prompt, int max_tokens,
                               Sampler& sampler, std::span<const int32_t> eos_token_ids,
                               const TokenCallback& on_token);

#ifdef MOEBIUS_HAS_CUDA
// The same loop on the CUDA runner (a batch of one sequence; decode steps replay a CUDA graph).
Result<GenerateStats> generate(Qwen3MoeCuda& model, std::span<const int32_t> prompt, int max_tokens, Sampler& sampler,
                               std::span<const int32_t> eos_token_ids, const TokenCallback& on_token);
#endif

// The SamplerParams `options` asks for once `config`'s defaults fill the unset fields; validated.
Result<SamplerParams> resolve_sampler_params(const GenerateOptions& options, const GenerationConfig& config);

// "" -> nullopt (checkpoint precision); bf16, nvfp4, int4, int2; anything else is an Error.
Result<std::optional<WeightFormat>> parse_experts_format(const std::string& name);

// 32-bit FNV-1a over the fp32 bytes of `logits`; printed as #%08x after every run.
uint32_t fnv1a_logits(std::span<const float> logits);

// Approximate weight bytes read per decode token, as stored in memory: every dense weight (one
// embedding row, attention, norms, routers, dense MLPs, the final norm and lm_head; fp32 on the
// CPU backend) plus, per MoE layer, top_k experts' packed weights and scales. The approximation:
// it assumes the k routed experts are distinct and all the same size, and ignores the KV cache.
uint64_t decode_weight_bytes(const Qwen3MoeCpu& model);

// The end-of-run report (several lines, newline-terminated), for stderr.
std::string format_generate_stats(const GenerateStats& stats);

}  // namespace moebius::model
