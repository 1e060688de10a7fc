#include "model/generate.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>

#include <fmt/format.h>

#include "model/block_allocator.h"
#include "parallel/in_process_communicator.h"

namespace moebius::model {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

uint64_t float_bytes(const std::vector<float>& v) { return static_cast<uint64_t>(v.size()) * sizeof(float); }

// One generation step's host side, the same for every backend: samples from the last logits,
// records the hash, and either stops at an eos id (nullopt) or records and streams the token.
Result<std::optional<int32_t>> take_token(Sampler& sampler, std::span<const float> last,
                                          std::span<const int32_t> eos_token_ids, const TokenCallback& on_token,
                                          GenerateStats& stats) {
  MOEBIUS_ASSIGN_OR_RETURN(int32_t id, sampler.sample(last));
  stats.logits_hash = fnv1a_logits(last);
  if (std::find(eos_token_ids.begin(), eos_token_ids.end(), id) != eos_token_ids.end()) {
    stats.stopped_at_eos = true;
    return std::optional<int32_t>{};
  }
  stats.generated.push_back(id);
  if (on_token) on_token(id);
  return std::optional<int32_t>{id};
}

}  // namespace

Result<std::optional<WeightFormat>> parse_experts_format(const std::string& name) {
  if (name.empty()) return std::optional<WeightFormat>{};
  if (name == "bf16") return std::optional<WeightFormat>(WeightFormat::kBF16);
  if (name == "nvfp4") return std::optional<WeightFormat>(WeightFormat::kNvFp4);
  if (name == "int4") return std::optional<WeightFormat>(WeightFormat::kInt4);
  if (name == "int2") return std::optional<WeightFormat>(WeightFormat::kInt2);
  return Error::format("unknown expert format '{}'; expected bf16, nvfp4, int4 or int2", name).in_field("--experts");
}

Result<SamplerParams> resolve_sampler_params(const GenerateOptions& o, const GenerationConfig& g) {
  SamplerParams p;
  if (g.do_sample.has_value() && !*g.do_sample) p.temperature = 0.0f;
  else if (g.temperature) p.temperature = *g.temperature;
  if (g.top_k) p.top_k = *g.top_k;
  if (g.top_p) p.top_p = *g.top_p;
  if (g.min_p) p.min_p = *g.min_p;
  if (g.repetition_penalty) p.repetition_penalty = *g.repetition_penalty;
  if (o.temperature) p.temperature = *o.temperature;
  if (o.top_k) p.top_k = *o.top_k;
  if (o.top_p) p.top_p = *o.top_p;
  if (o.min_p) p.min_p = *o.min_p;
  if (o.repetition_penalty) p.repetition_penalty = *o.repetition_penalty;
  p.presence_penalty = o.presence_penalty;
  p.frequency_penalty = o.frequency_penalty;
  p.seed = o.seed;
  MOEBIUS_TRY(validate_sampler_params(p));
  return p;
}

uint32_t fnv1a_logits(std::span<const float> logits) {
  uint32_t h = 2166136261u;
  for (float x : logits) {
    unsigned char b[sizeof(float)];
    std::memcpy(b, &x, sizeof(float));
    for (unsigned char c : b) h = (h ^ c) * 16777619u;
  }
  return h;
}

uint64_t decode_weight_bytes(const Qwen3MoeCpu& model) {
  const Qwen3MoeConfig& c = model.config();
  // One embedding row; the final norm; lm_head (the embedding itself when tied: all of it).
  uint64_t bytes = static_cast<uint64_t>(c.hidden_size) * sizeof(float);
  bytes += static_cast<uint64_t>(c.hidden_size) * sizeof(float);
  bytes += static_cast<uint64_t>(c.vocab_size) * static_cast<uint64_t>(c.hidden_size) * sizeof(float);
  for (const Qwen3MoeLayerWeights& w : model.layers()) {
    bytes += float_bytes(w.input_norm) + float_bytes(w.post_norm) + float_bytes(w.q_proj) + float_bytes(w.k_proj) +
             float_bytes(w.v_proj) + float_bytes(w.o_proj) + float_bytes(w.q_norm) + float_bytes(w.k_norm);
    if (w.is_moe) {
      bytes += float_bytes(w.moe.router_weight);
      if (!w.moe.experts.empty()) {
        const cpu::ExpertWeights& e = w.moe.experts.front();
        const uint64_t expert = weight_bytes(e.gate) + weight_bytes(e.up) + weight_bytes(e.down);
        bytes += static_cast<uint64_t>(c.num_experts_per_tok) * expert;
      }
    } else {
      bytes += float_bytes(w.gate_proj) + float_bytes(w.up_proj) + float_bytes(w.down_proj);
    }
  }
  return bytes;
}

Result<GenerateStats> generate(const Qwen3MoeCpu& model, std::span<const int32_t> prompt, int max_tokens,
                               Sampler& sampler, std::span<const int32_t> eos_token_ids,
                               const TokenCallback& on_token) {
  const Qwen3MoeConfig& c = model.config();
  if (prompt.empty()) return Error("the prompt is empty").in_field("--prompt-ids");
  if (max_tokens < 0) return Error::format("must be >= 0, got {}", max_tokens).in_field("--max-tokens");
  for (int32_t id : prompt)
    if (id < 0 || id >= c.vocab_size)
      return Error::format("token id {} is outside the vocabulary [0, {})", id, c.vocab_size).in_field("--prompt-ids");
  const int64_t context = c.context_limit();
  if (static_cast<int64_t>(prompt.size()) > context)
    return Error::format("the prompt has {} tokens; the model's context is {}", prompt.size(), context)
        .in_field("--prompt-ids");

  GenerateStats stats;
  stats.prompt_tokens = static_cast<int64_t>(prompt.size());
  stats.weight_bytes_per_token = decode_weight_bytes(model);
  // The last generated token is never run through the model, hence the - 1.
  const int64_t cache_tokens = std::min<int64_t>(context, stats.prompt_tokens + std::max(max_tokens - 1, 0));
  KvCache cache = model.make_cache(cache_tokens);
  const size_t V = static_cast<size_t>(c.vocab_size);
  // The prefill's last row only: every row would be prompt x V floats (20 GB for a 32k prompt at
  // Qwen3's vocabulary), and forward_batch computes the same bits for the rows it returns.
  std::vector<float> logits(V);

  auto t0 = std::chrono::steady_clock::now();
  const Qwen3MoeCpu::BatchSeq seq{prompt, &cache, /*want_logits=*/true, /*all_logits=*/false};
  MOEBIUS_TRY(model.forward_batch(std::span<const Qwen3MoeCpu::BatchSeq>(&seq, 1), logits.data()));
  stats.prefill_seconds = seconds_since(t0);
  std::span<const float> last(logits.data(), V);
  stats.logits_hash = fnv1a_logits(last);

  t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < max_tokens; ++i) {
    MOEBIUS_ASSIGN_OR_RETURN(std::optional<int32_t> next, take_token(sampler, last, eos_token_ids, on_token, stats));
    if (!next) break;
    const int32_t id = *next;
    // Stop when the budget is spent or the context is full (the next step would not fit).
    if (i + 1 == max_tokens || cache.position() >= cache.max_tokens()) break;
    MOEBIUS_TRY(model.forward(&id, 1, cache, logits.data()));
    ++stats.decode_steps;
    last = std::span<const float>(logits.data(), V);
  }
  stats.decode_seconds = stats.decode_steps > 0 ? seconds_since(t0) : 0.0;
  return stats;
}

#ifdef MOEBIUS_HAS_CUDA
Result<GenerateStats> generate(Qwen3MoeCuda& model, std::span<const int32_t> prompt, int max_tokens, Sampler& sampler,
                               std::span<const int32_t> eos_token_ids, const TokenCallback& on_token) {
  const Qwen3MoeConfig& c = model.config();
  if (prompt.empty()) return Error("the prompt is empty").in_field("--prompt-ids");
  if (max_tokens < 0) return Error::format("must be >= 0, got {}", max_tokens).in_field("--max-tokens");
  for (int32_t id : prompt)
    if (id < 0 || id >= c.vocab_size)
      return Error::format("token id {} is outside the vocabulary [0, {})", id, c.vocab_size).in_field("--prompt-ids");
  const int64_t context = model.max_context();
  if (static_cast<int64_t>(prompt.size()) > context)
    return Error::format("the prompt has {} tokens; the runner's context is {}", prompt.size(), context)
        .in_field("--prompt-ids");

  GenerateStats stats;
  stats.prompt_tokens = static_cast<int64_t>(prompt.size());
  stats.weight_bytes_per_token = model.decode_weight_bytes();
  const offload::ModelCacheStats cache_before = model.expert_cache_stats();
  const int64_t cache_tokens = std::min<int64_t>(context, stats.prompt_tokens + std::max(max_tokens - 1, 0));
  BlockAllocator blocks(model.num_blocks());
  std::vector<int32_t> table;
  MOEBIUS_TRY(blocks.ensure(table, cache_tokens, model.block_size()));
  std::vector<float> logits(static_cast<size_t>(c.vocab_size));

  auto t0 = std::chrono::steady_clock::now();
  for (int64_t start = 0; start < stats.prompt_tokens; start += model.max_tokens()) {
    const int64_t n = std::min<int64_t>(model.max_tokens(), stats.prompt_tokens - start);
    const SequenceStep seq{prompt.subspan(static_cast<size_t>(start), static_cast<size_t>(n)), start, table};
    MOEBIUS_ASSIGN_OR_RETURN(StepBatch batch, model.make_batch(std::span<const SequenceStep>(&seq, 1)));
    MOEBIUS_TRY(model.forward(batch, logits.data()));
  }
  stats.prefill_seconds = seconds_since(t0);
  std::span<const float> last(logits);
  stats.logits_hash = fnv1a_logits(last);

  int64_t pos = stats.prompt_tokens;
  t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < max_tokens; ++i) {
    MOEBIUS_ASSIGN_OR_RETURN(std::optional<int32_t> next, take_token(sampler, last, eos_token_ids, on_token, stats));
    if (!next) break;
    const int32_t id = *next;
    if (i + 1 == max_tokens || pos >= cache_tokens) break;
    const SequenceStep seq{std::span<const int32_t>(&id, 1), pos, table};
    MOEBIUS_ASSIGN_OR_RETURN(StepBatch batch, model.make_batch(std::span<const SequenceStep>(&seq, 1)));
    MOEBIUS_TRY(model.forward(batch, logits.data()));
    ++pos;
    ++stats.decode_steps;
  }
  stats.decode_seconds = stats.decode_steps > 0 ? seconds_since(t0) : 0.0;
  if (model.expert_cache_on()) stats.expert_cache = model.expert_cache_stats().since(cache_before);
  blocks.release(table);
  return stats;
}
#endif  // MOEBIUS_HAS_CUDA

namespace {

// `generate --ep N` on the CPU: N threads as ranks, each holding E / N experts; rank 0 runs the
// generation, every rank then idles (serving experts) until all are done. The error reported is
// the failing rank's own, not the "aborted" the others see.
Result<GenerateStats> generate_ep_cpu(const GenerateOptions& o, const Qwen3MoeLoadOptions& load, Sampler& sampler,
                                      const std::vector<int32_t>& eos, const TokenCallback& on_token) {
  // Checked before any rank's thread starts (each rank would refuse it only after starting).
  MOEBIUS_ASSIGN_OR_RETURN(const Qwen3MoeConfig config, load_qwen3_moe_config(o.model_dir));
  if (config.num_experts % o.ep != 0)
    return Error::format("{} ranks cannot split num_experts = {} evenly", o.ep, config.num_experts)
        .in_field("--ep");
  Result<GenerateStats> out = Error("rank 0 did not run");
  std::vector<Status> st = parallel::run_ranks(o.ep, [&](parallel::Communicator& c) -> Status {
    Qwen3MoeLoadOptions l = load;
    l.ep_comm = std::shared_ptr<parallel::Communicator>(&c, [](parallel::Communicator*) {});  // outlives the model
    MOEBIUS_ASSIGN_OR_RETURN(Qwen3MoeCpu m, Qwen3MoeCpu::load(o.model_dir, l));
    if (c.rank() == 0) {
      out = generate(m, o.prompt_ids, o.max_tokens, sampler, eos, on_token);
      if (!out.ok()) return out.error();
    }
    return m.ep_idle_until_all_done();
  });
  for (auto& s : st)
    if (!s.ok() && s.error().message().rfind("in-process communicator aborted", 0) != 0) return std::move(s).error();
  for (auto& s : st)
    if (!s.ok()) return std::move(s).error();
  return out;
}

}  // namespace

Result<GenerateStats> run_generate(const GenerateOptions& o, const TokenCallback& on_token) {
  // Everything a flag can get wrong is checked before the (slow) model load.
  if (o.backend != "cpu" && o.backend != "cuda")
    return Error::format("unknown backend '{}'; expected cpu or cuda", o.backend).in_field("--backend");
  if (o.load_format != "auto" && o.load_format != "dummy")
    return Error::format("unknown load format '{}'; expected auto or dummy", o.load_format).in_field("--load-format");
  if (o.load_format == "dummy" && o.backend != "cuda")
    return Error("dummy weights need --backend cuda").in_field("--load-format");
  // After the flag values themselves, so a malformed flag is named the same way in every build.
#ifndef MOEBIUS_HAS_CUDA
  if (o.backend == "cuda") return Error("this build of moebius has no CUDA support").in_field("--backend");
#endif
  if (o.ep < 1 || o.ep > 1024) return Error::format("must be in [1, 1024], got {}", o.ep).in_field("--ep");
  if (o.ep > 1 && o.backend == "cuda" && (!o.ep_comm || o.ep_comm->size() != o.ep))
    return Error("expert parallelism on the CUDA backend runs one worker process per GPU; `moebius generate` "
                 "starts them (or mpirun does)")
        .in_field("--ep");
  if (o.model_dir.empty()) return Error("is required").in_field("--model");
  if (o.prompt_ids.empty()) return Error("the prompt is empty").in_field("--prompt-ids");
  if (o.max_tokens < 0) return Error::format("must be >= 0, got {}", o.max_tokens).in_field("--max-tokens");
  if (o.prefill_chunk < 1) return Error::format("must be >= 1, got {}", o.prefill_chunk).in_field("--prefill-chunk");
  if (const std::string f =
          offload::first_offload_flag(o.gpu_memory_budget, o.placement_file, o.expert_cache, o.expert_prefetch,
                                      o.expert_dma);
      !f.empty() && o.backend != "cuda")
    return Error("expert offload needs --backend cuda").in_field(f);
  MOEBIUS_ASSIGN_OR_RETURN(std::optional<offload::CacheOptions> expert_cache,
                           offload::parse_expert_cache_flags(o.expert_cache, !o.gpu_memory_budget.empty()));
  MOEBIUS_ASSERT(!expert_cache || o.backend == "cuda");  // refused above otherwise
  MOEBIUS_ASSIGN_OR_RETURN(std::optional<WeightFormat> experts, parse_experts_format(o.experts));
  MOEBIUS_ASSIGN_OR_RETURN(GenerationConfig gen_config, load_generation_config(o.model_dir));
  MOEBIUS_ASSIGN_OR_RETURN(SamplerParams params, resolve_sampler_params(o, gen_config));
  MOEBIUS_ASSIGN_OR_RETURN(Sampler sampler, Sampler::create(params));
  sampler.observe_prompt(o.prompt_ids);
  const std::vector<int32_t>& eos = o.eos_token_ids ? *o.eos_token_ids : gen_config.eos_token_ids;

#ifdef MOEBIUS_HAS_CUDA
  if (o.backend == "cuda") {
    const WeightSource source{o.model_dir, "", o.load_format};
    MOEBIUS_ASSIGN_OR_RETURN(Qwen3MoeConfig config, weight_source_config(source));
    Qwen3MoeCudaOptions co;
    co.experts_format = experts;
    const int64_t P = static_cast<int64_t>(o.prompt_ids.size());
    co.max_context = static_cast<int>(
        std::clamp<int64_t>(P + std::max(o.max_tokens - 1, 0), 1, config.context_limit()));
    co.max_tokens = static_cast<int>(std::clamp<int64_t>(P, 1, o.prefill_chunk));
    co.max_seqs = 1;
    co.graph_batches = {1};
    co.progress = o.on_progress;
    co.autotune = o.autotune;
    co.gpu_memory_budget = o.gpu_memory_budget;
    co.placement_file = o.placement_file;
    co.expert_cache = expert_cache;
    co.expert_prefetch = o.expert_prefetch;
    co.expert_dma_slots = o.expert_dma;
    if (o.ep > 1) co.ep_comm = o.ep_comm;
    MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<Qwen3MoeCuda> model, Qwen3MoeCuda::open(source, co));
    if (model->ep_rank() != 0) {  // expert parallelism: serve rank 0's steps until it is done
      MOEBIUS_TRY(model->ep_idle_until_all_done());
      GenerateStats follower;
      follower.ep_follower = true;
      return follower;
    }
    if (o.on_report) o.on_report(format_memory_plan(model->memory_plan()));
    // With EP rank 0 owns the one sequence; the other ranks run empty steps in lockstep.
    auto stats = generate(*model, o.prompt_ids, o.max_tokens, sampler, eos, on_token);
    if (!stats.ok()) return stats;  // the launcher (or mpirun) stops the other ranks
    MOEBIUS_TRY(model->ep_idle_until_all_done());
    return stats;
  }
#endif
  Qwen3MoeLoadOptions load;
  load.experts_format = experts;
  if (o.ep > 1) return generate_ep_cpu(o, load, sampler, eos, on_token);
  MOEBIUS_ASSIGN_OR_RETURN(Qwen3MoeCpu model, Qwen3MoeCpu::load(o.model_dir, load));
  return generate(model, o.prompt_ids, o.max_tokens, sampler, eos, on_token);
}

std::string format_generate_stats(const GenerateStats& s) {
  std::string out;
  out += fmt::format("prompt tokens:    {}\n", s.prompt_tokens);
  out += fmt::format("generated tokens: {}{}\n", s.generated.size(), s.stopped_at_eos ? " (stopped at eos)" : "");
  out += fmt::format("prefill:          {:.2f} tok/s\n", s.prefill_tok_s());
  out += fmt::format("decode:           {:.2f} tok/s, {:.3f} GB/s ({:.2f} MB of weights per token)\n",
                     s.decode_tok_s(), s.decode_gb_s(), static_cast<double>(s.weight_bytes_per_token) / 1e6);
  if (s.expert_cache) {
    const offload::ModelCacheStats& c = *s.expert_cache;
    out += fmt::format("expert cache:     {:.1f}% of routed (token, expert) pairs resident over {} steps; {} swaps "
                       "({:.2f} MB over PCIe)\n",
                       100.0 * c.hit_rate(), c.steps, c.swaps, static_cast<double>(c.swap_bytes) / 1e6);
  }
  out += fmt::format("logits hash:      #{:08x}\n", s.logits_hash);
  return out;
}

}  // namespace moebius::model
