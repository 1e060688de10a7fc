// The CUDA backend of StepRunner: Qwen3MoeCuda over one paged KV cache whose blocks the engine's
// BlockAllocator hands out ([TAG_KV_CACHE_LAYOUT]). The runner keeps nothing per sequence: the
// block table is the sequence's whole cache state, so release() has nothing to do.
#ifdef MOEBIUS_HAS_CUDA

#include <algorithm>

#include <fmt/format.h>

#include "model/generate.h"
#include "model/qwen3_moe_cuda.h"
#include "server/step_runner.h"

namespace moebius::server {
namespace {

class CudaRunner final : public StepRunner {
 public:
  CudaRunner(std::unique_ptr<model::Qwen3MoeCuda> model, RunnerLimits limits)
      : model_(std::move(model)), limits_(limits) {}
  // Expert parallelism: rank 0 posts "done" so the follower ranks return (a no-op without EP).
  ~CudaRunner() override { (void)model_->ep_idle_until_all_done(); }

  const model::Qwen3MoeConfig& config() const override { return model_->config(); }
  std::optional<offload::ModelCacheStats> expert_cache_stats() const override {
    if (!model_->expert_cache_on()) return std::nullopt;
    return model_->expert_cache_stats();
  }
  const RunnerLimits& limits() const override { return limits_; }
  std::string describe() const override {
    return fmt::format("cuda backend: {} layers, vocab {}, context {}, KV pool {} blocks of {} tokens{}\n{}",
                       config().num_hidden_layers, config().vocab_size, limits_.max_context, limits_.num_blocks,
                       limits_.block_size,
                       model_->ep_size() > 1
                           ? fmt::format(", expert parallel over {} GPUs (this rank: every sequence, {} of {} "
                                         "experts per layer)",
                                         model_->ep_size(), config().num_experts / model_->ep_size(),
                                         config().num_experts)
                           : std::string(),
                       model::format_memory_plan(model_->memory_plan()));
  }

  Status step(std::span<const RunnerSeq> seqs, std::vector<float>& logits) override {
    steps_.clear();
    for (const RunnerSeq& s : seqs) steps_.push_back(model::SequenceStep{s.tokens, s.start, s.block_table});
    MOEBIUS_ASSIGN_OR_RETURN(model::StepBatch batch, model_->make_batch(steps_));
    const size_t V = static_cast<size_t>(config().vocab_size);
    all_.resize(seqs.size() * V);  // one logit row per sequence: its last new token
    MOEBIUS_TRY(model_->forward(batch, all_.data()));
    logits.clear();
    for (size_t i = 0; i < seqs.size(); ++i)
      if (seqs[i].want_logits)
        logits.insert(logits.end(), all_.begin() + static_cast<std::ptrdiff_t>(i * V),
                      all_.begin() + static_cast<std::ptrdiff_t>((i + 1) * V));
    return Ok{};
  }

  void release(int64_t) override {}
  bool shares_kv_blocks() const override { return true; }  // [TAG_PREFIX_CACHE]

  Result<std::unique_ptr<StagedWeights>> stage_weights(const std::string& dir) const override {
    MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<model::Qwen3MoeStagedWeights> w, model_->stage_weights(dir));
    return std::unique_ptr<StagedWeights>(new Staged(std::move(w)));
  }

  void commit_weights(StagedWeights& staged) override {
    model_->commit_weights(*static_cast<Staged&>(staged).weights);
  }

 private:
  struct Staged final : StagedWeights {
    explicit Staged(std::unique_ptr<model::Qwen3MoeStagedWeights> w) : weights(std::move(w)) {}
    std::unique_ptr<model::Qwen3MoeStagedWeights> weights;
  };

  std::unique_ptr<model::Qwen3MoeCuda> model_;
  RunnerLimits limits_;
  std::vector<model::SequenceStep> steps_;
  std::vector<float> all_;
};

}  // namespace

namespace {

// The runner's options from the server's; the same on every EP rank (the capacities must match).
Result<model::Qwen3MoeCudaOptions> cuda_options(const RunnerOptions& o) {
  MOEBIUS_ASSIGN_OR_RETURN(std::optional<WeightFormat> experts, model::parse_experts_format(o.experts));
  MOEBIUS_ASSIGN_OR_RETURN(model::Qwen3MoeConfig config, model::weight_source_config(o.source));
  model::Qwen3MoeCudaOptions co;
  co.experts_format = experts;
  // A full-length context for every running sequence would not fit a real model's pool: default
  // to 8192 tokens a sequence unless --max-context says otherwise.
  const int64_t ctx = config.max_position_embeddings;
  co.max_context = static_cast<int>(o.max_context > 0 ? std::min<int64_t>(o.max_context, ctx) : std::min<int64_t>(ctx, 8192));
  co.max_seqs = o.max_seqs;
  co.max_tokens = o.max_step_tokens;
  co.max_logit_rows = o.max_seqs;
  co.block_size = o.block_size;
  co.num_blocks = o.num_blocks;
  co.graph_batches = o.graph_batches;
  co.autotune = o.autotune;
  co.gpu_memory_budget = o.gpu_memory_budget;
  co.placement_file = o.placement_file;
  MOEBIUS_ASSIGN_OR_RETURN(co.expert_cache,
                           offload::parse_expert_cache_flags(o.expert_cache, !o.gpu_memory_budget.empty()));
  if (co.graph_batches.empty())
    for (int b = 1; b <= o.max_seqs; b *= 2) co.graph_batches.push_back(b);
  if (o.ep > 1) co.ep_comm = o.ep_comm;
  return co;
}

}  // namespace

Status run_ep_follower(const RunnerOptions& o) {
  if (!o.ep_comm || o.ep_comm->size() != o.ep || o.ep_comm->rank() == 0 || o.backend != "cuda")
    return Error("a follower rank needs --backend cuda and its worker communicator").in_field("--ep");
  MOEBIUS_ASSIGN_OR_RETURN(model::Qwen3MoeCudaOptions co, cuda_options(o));
  MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<model::Qwen3MoeCuda> m, model::Qwen3MoeCuda::open(o.source, co));
  return m->ep_idle_until_all_done();
}

Result<std::unique_ptr<StepRunner>> load_cuda_runner(const RunnerOptions& o) {
  MOEBIUS_ASSIGN_OR_RETURN(model::Qwen3MoeCudaOptions co, cuda_options(o));
  MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<model::Qwen3MoeCuda> m, model::Qwen3MoeCuda::open(o.source, co));
  RunnerLimits l;
  l.block_size = m->block_size();
  l.num_blocks = m->num_blocks();
  l.max_context = m->max_context();
  l.max_step_tokens = m->max_tokens();
  l.max_seqs = m->max_seqs();
  return std::unique_ptr<StepRunner>(new CudaRunner(std::move(m), l));
}

}  // namespace moebius::server

#else  // !MOEBIUS_HAS_CUDA

#include "server/step_runner.h"

namespace moebius::server {

Status run_ep_follower(const RunnerOptions&) {
  return Error("this build of moebius has no CUDA support").in_field("--backend");
}

}  // namespace moebius::server

#endif  // MOEBIUS_HAS_CUDA
