// The CPU backend of StepRunner: Qwen3MoeCpu with one KvCache per sequence; a step is one
// Qwen3MoeCpu::forward_batch over all its sequences.
#include <algorithm>
#include <memory>
#include <optional>
#include <thread>
#include <unordered_map>

#include <fmt/format.h>

#include "model/generate.h"
#include "model/qwen3_moe_cpu.h"
#include "parallel/in_process_communicator.h"
#include "server/step_runner.h"

namespace moebius::server {
namespace {

// `--ep N` on the CPU: ranks 1..N-1 as threads, each with its own experts, serving every step of
// rank 0 (the runner's model) until rank 0 says it is done (Qwen3MoeCpu::ep_idle_until_all_done).
struct EpFollowers {
  std::shared_ptr<parallel::InProcessGroup> group;
  std::vector<std::thread> threads;
  std::vector<Status> status;
};

class CpuRunner final : public StepRunner {
 public:
  CpuRunner(model::Qwen3MoeCpu model, RunnerLimits limits, std::unique_ptr<EpFollowers> ep = nullptr)
      : model_(std::move(model)), limits_(limits), ep_(std::move(ep)) {}
  ~CpuRunner() override {
    if (!ep_) return;
    (void)model_.ep_idle_until_all_done();  // lets the follower ranks return (or they were aborted)
    for (auto& t : ep_->threads) t.join();
  }

  const model::Qwen3MoeConfig& config() const override { return model_.config(); }
  const RunnerLimits& limits() const override { return limits_; }
  std::string describe() const override {
    return fmt::format("cpu backend: {} layers, vocab {}, context {}, KV pool {} blocks of {} tokens",
                       config().num_hidden_layers, config().vocab_size, limits_.max_context, limits_.num_blocks,
                       limits_.block_size);
  }

  // One forward_batch over every sequence of the step (bit-identical to running them one by one).
  Status step(std::span<const RunnerSeq> seqs, std::vector<float>& logits) override {
    batch_.clear();
    size_t rows = 0;
    for (const RunnerSeq& s : seqs) {
      auto it = caches_.find(s.id);
      if (it == caches_.end())
        it = caches_.emplace(s.id, model_.make_cache(limits_.max_context, limits_.block_size)).first;
      model::KvCache& cache = it->second;
      // A recomputed (preempted) sequence starts over from 0; anything else must continue where
      // its cache ends. [TAG_SERVE_RECOMPUTE]
      if (s.start == 0) cache.clear();
      MOEBIUS_ASSERT(cache.position() == s.start, "sequence {} at {} steps from {}", s.id, cache.position(), s.start);
      batch_.push_back(model::Qwen3MoeCpu::BatchSeq{s.tokens, &cache, s.want_logits});
      rows += s.want_logits ? 1 : 0;
    }
    logits.resize(rows * static_cast<size_t>(config().vocab_size));
    return model_.forward_batch(batch_, logits.data());
  }

  void release(int64_t id) override { caches_.erase(id); }

  Result<std::unique_ptr<StagedWeights>> stage_weights(const std::string& dir) const override {
    if (ep_)
      return Error("weight updates are not supported with --ep yet (every rank would have to reload its experts)")
          .in_field("model_path");
    MOEBIUS_ASSIGN_OR_RETURN(model::Qwen3MoeCpu next, model_.stage_reload(dir));
    return std::unique_ptr<StagedWeights>(new Staged(std::move(next)));
  }

  // The sequences' caches stay: same shape, and their rows (made with the old weights) are kept.
  void commit_weights(StagedWeights& staged) override {
    model_.commit_reload(std::move(static_cast<Staged&>(staged).model));
  }

 private:
  struct Staged final : StagedWeights {
    explicit Staged(model::Qwen3MoeCpu m) : model(std::move(m)) {}
    model::Qwen3MoeCpu model;
  };

  model::Qwen3MoeCpu model_;
  RunnerLimits limits_;
  std::unordered_map<int64_t, model::KvCache> caches_;  // node-based: the pointers in batch_ stay valid
  std::vector<model::Qwen3MoeCpu::BatchSeq> batch_;
  std::unique_ptr<EpFollowers> ep_;
};

// Starts ranks 1..N-1 and loads rank 0's model; every rank checks in with a barrier after its
// load, so a rank that fails to load fails the whole runner (the group is aborted, no one waits).
Result<std::unique_ptr<StepRunner>> load_cpu_ep_runner(const RunnerOptions& o, const model::Qwen3MoeLoadOptions& load,
                                                       RunnerLimits l) {
  auto ep = std::make_unique<EpFollowers>();
  ep->group = parallel::InProcessGroup::create(o.ep);
  ep->status.assign(static_cast<size_t>(o.ep), Status(Ok{}));
  for (int r = 1; r < o.ep; ++r) {
    ep->threads.emplace_back([dir = o.source.model_dir, load, r, g = ep->group, st = &ep->status[static_cast<size_t>(r)]] {
      model::Qwen3MoeLoadOptions mine = load;
      mine.ep_comm = g->communicator(r);
      *st = [&]() -> Status {
        MOEBIUS_ASSIGN_OR_RETURN(model::Qwen3MoeCpu m, model::Qwen3MoeCpu::load(dir, mine));
        MOEBIUS_TRY(mine.ep_comm->barrier());
        return m.ep_idle_until_all_done();
      }();
      if (!st->ok()) g->abort("rank " + std::to_string(r) + ": " + st->error().what());
    });
  }
  model::Qwen3MoeLoadOptions zero = load;
  zero.ep_comm = ep->group->communicator(0);
  auto m = model::Qwen3MoeCpu::load(o.source.model_dir, zero);
  Status joined = m.ok() ? zero.ep_comm->barrier() : Status(m.error());
  if (!joined.ok()) {
    ep->group->abort("rank 0: " + joined.error().what());
    for (auto& t : ep->threads) t.join();
    for (size_t r = 1; r < ep->status.size(); ++r)  // a follower's own error, rather than "aborted"
      if (!ep->status[r].ok() && ep->status[r].error().message().rfind("in-process communicator aborted", 0) != 0)
        return std::move(ep->status[r]).error();
    return joined.error();
  }
  l.num_blocks = o.num_blocks > 0 ? o.num_blocks : l.num_blocks;
  return std::unique_ptr<StepRunner>(new CpuRunner(std::move(m).value(), l, std::move(ep)));
}

}  // namespace

Result<std::unique_ptr<StepRunner>> load_cpu_runner(const RunnerOptions& o) {
  MOEBIUS_ASSIGN_OR_RETURN(std::optional<WeightFormat> experts, model::parse_experts_format(o.experts));
  model::Qwen3MoeLoadOptions load;
  load.experts_format = experts;
  if (o.ep > 1) {
    MOEBIUS_ASSIGN_OR_RETURN(model::Qwen3MoeConfig config, model::load_qwen3_moe_config(o.source.model_dir));
    MOEBIUS_TRY(parallel::check_expert_split(config.num_experts, o.ep));
    RunnerLimits l;
    const int ctx = config.max_position_embeddings;
    l.max_context = o.max_context > 0 ? std::min(o.max_context, ctx) : ctx;
    l.block_size = o.block_size;
    l.max_seqs = o.max_seqs;
    l.max_step_tokens = o.max_step_tokens;
    l.num_blocks = ((l.max_context + l.block_size - 1) / l.block_size) * l.max_seqs;
    return load_cpu_ep_runner(o, load, l);
  }
  MOEBIUS_ASSIGN_OR_RETURN(model::Qwen3MoeCpu m, model::Qwen3MoeCpu::load(o.source.model_dir, load));
  RunnerLimits l;
  const int ctx = m.config().max_position_embeddings;
  l.max_context = o.max_context > 0 ? std::min(o.max_context, ctx) : ctx;
  l.block_size = o.block_size;
  l.max_seqs = o.max_seqs;
  l.max_step_tokens = o.max_step_tokens;
  const int32_t per_seq = (l.max_context + l.block_size - 1) / l.block_size;
  l.num_blocks = o.num_blocks > 0 ? o.num_blocks : per_seq * l.max_seqs;
  return std::unique_ptr<StepRunner>(new CpuRunner(std::move(m), l));
}

Result<std::unique_ptr<StepRunner>> load_runner(const RunnerOptions& o) {
  MOEBIUS_TRY(model::validate_weight_source(o.source));
  if (o.max_seqs < 1) return Error::format("must be >= 1, got {}", o.max_seqs).in_field("--max-running");
  if (o.max_step_tokens < o.max_seqs)
    return Error::format("must be >= --max-running ({}), got {}", o.max_seqs, o.max_step_tokens)
        .in_field("--max-step-tokens");
  if (o.block_size < 1) return Error::format("must be >= 1, got {}", o.block_size).in_field("--block-size");
  if (o.num_blocks < 0) return Error::format("must be >= 0, got {}", o.num_blocks).in_field("--kv-blocks");
  if (o.ep < 1 || o.ep > 1024) return Error::format("must be in [1, 1024], got {}", o.ep).in_field("--ep");
  if (o.ep > 1 && o.backend == "cuda" && (!o.ep_comm || o.ep_comm->size() != o.ep))
    return Error("expert parallelism on the CUDA backend runs one worker process per GPU; `moebius serve` starts "
                 "them (or mpirun does)")
        .in_field("--ep");
  if (o.backend == "cpu") {
    if (o.source.dummy()) return Error("dummy weights need --backend cuda").in_field("--load-format");
    return load_cpu_runner(o);
  }
  if (o.backend == "cuda") {
#ifdef MOEBIUS_HAS_CUDA
    return load_cuda_runner(o);
#else
    return Error("this build of moebius has no CUDA support").in_field("--backend");
#endif
  }
  return Error::format("unknown backend '{}'; expected cpu or cuda", o.backend).in_field("--backend");
}

}  // namespace moebius::server
