// The CPU backend of StepRunner: Qwen3MoeCpu; a step is one Qwen3MoeCpu::forward_batch over all
// its sequences.
//
// The KV cache is a model::KvBlockPool of the engine's block ids, and each step views it through
// the sequences' block tables (model::KvCache's view), as the CUDA runner's paged cache does. The
// block tables are then the whole cache state: the runner keeps nothing per sequence, and blocks
// of a common prefix are shared ([TAG_PREFIX_CACHE]).
//
// `--ep N` ([TAG_SERVE_DP]): ranks 1..N-1 are threads with their own model (their E / N experts of
// every MoE layer) and their own KV pool, and the runner is data-parallel over them: the engine
// places each sequence on a rank (RunnerSeq::pool) and allocates its blocks from that rank's pool;
// each step rank 0 (the engine's thread) sends each rank its part (server/dp_step.h), all ranks
// run forward_batch over their own sequences (the MoE layers exchange tokens between them), and
// rank 0 collects the wanted logits rows in the step's order. Each rank computes exactly what the
// single-process model computes for its sequences, so the logits are bit-identical to `--ep 1`.
#include <algorithm>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/log.h"
#include "model/generate.h"
#include "model/qwen3_moe_cpu.h"
#include "offload/memory_budget.h"
#include "parallel/in_process_communicator.h"
#include "server/dp_driver.h"
#include "server/step_runner.h"

namespace moebius::server {
namespace {

// The forward_batch batch of `seqs`, each viewing `pool` through its block table (the views go
// in `views`, which BatchSeq points into), and its checks (Qwen3MoeCpu::check_batch); *rows: the
// wanted logits rows.
Status prepare_views(const model::Qwen3MoeCpu& model, model::KvBlockPool& pool, const RunnerLimits& limits,
                     std::span<const RunnerSeq> seqs, std::vector<model::KvCache>& views,
                     std::vector<model::Qwen3MoeCpu::BatchSeq>& batch, size_t* rows) {
  views.clear();
  views.reserve(seqs.size());  // no reallocation: BatchSeq keeps pointers into it
  batch.clear();
  *rows = 0;
  for (const RunnerSeq& s : seqs) {
    for (int32_t b : s.block_table)
      if (b < 0 || b >= pool.num_blocks())
        return Error::format("sequence {}'s block table lists block {}, the pool has {}", s.id, b, pool.num_blocks());
    if (s.start < 0 || s.start > static_cast<int64_t>(s.block_table.size()) * pool.block_size())
      return Error::format("sequence {} starts at {}, its block table covers {} tokens", s.id, s.start,
                           s.block_table.size() * static_cast<size_t>(pool.block_size()));
    if (s.start > limits.max_context)
      return Error::format("sequence {} starts at {}, past the context of {} tokens", s.id, s.start, limits.max_context);
    views.emplace_back(pool, s.block_table, s.start, limits.max_context);
    batch.push_back(model::Qwen3MoeCpu::BatchSeq{s.tokens, &views.back(), s.want_logits, s.all_logits});
    *rows += logits_rows(s);
  }
  return model.check_batch(batch);
}

// A rank's part of a step (the whole step without --ep): one forward_batch over its sequences,
// each viewing `pool` through its block table; `logits` gets the wanted rows in order.
class CpuPart final : public DpPart {
 public:
  CpuPart(const model::Qwen3MoeCpu& model, model::KvBlockPool& pool, const RunnerLimits& limits)
      : model_(model), pool_(pool), limits_(limits) {}
  Status prepare(std::span<const RunnerSeq> seqs, size_t* rows) override {
    MOEBIUS_TRY(prepare_views(model_, pool_, limits_, seqs, views_, batch_, &rows_));
    *rows = rows_;
    return Ok{};
  }
  Status run(std::vector<float>& logits) override {
    logits.resize(rows_ * static_cast<size_t>(model_.config().vocab_size));
    return model_.forward_batch(batch_, logits.data());
  }

 private:
  const model::Qwen3MoeCpu& model_;  // a weight update swaps its weights in place (commit_reload)
  model::KvBlockPool& pool_;
  const RunnerLimits& limits_;
  std::vector<model::KvCache> views_;
  std::vector<model::Qwen3MoeCpu::BatchSeq> batch_;  // points into views_
  size_t rows_ = 0;
};

std::unique_ptr<model::KvBlockPool> make_pool(const model::Qwen3MoeConfig& c, const RunnerLimits& l) {
  return std::make_unique<model::KvBlockPool>(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, l.block_size,
                                              l.num_blocks);
}

// A follower rank (1..N-1) of the DP runner, with its own KV pool: steps until rank 0 says stop
// (server/dp_driver.h).
Status follow_dp_steps(const model::Qwen3MoeCpu& model, parallel::Communicator& comm, const RunnerLimits& limits) {
  const std::unique_ptr<model::KvBlockPool> pool = make_pool(model.config(), limits);
  CpuPart part(model, *pool, limits);
  return follow_dp_steps(comm, part, model.config().vocab_size);
}

// `--ep N` on the CPU: ranks 1..N-1 as threads.
struct EpFollowers {
  std::shared_ptr<parallel::InProcessGroup> group;
  std::shared_ptr<parallel::Communicator> comm0;  // rank 0's (its model holds it too)
  std::vector<std::thread> threads;
  std::vector<Status> status;
};

class CpuRunner final : public StepRunner {
 public:
  CpuRunner(model::Qwen3MoeCpu model, RunnerLimits limits, std::unique_ptr<EpFollowers> ep = nullptr)
      : model_(std::move(model)),
        limits_(limits),
        ep_(std::move(ep)),
        pool_(make_pool(model_.config(), limits_)),
        part_(model_, *pool_, limits_) {
    if (ep_) driver_ = std::make_unique<DpStepDriver>(*ep_->comm0, model_.config().vocab_size);
  }
  ~CpuRunner() override {
    if (!ep_) return;
    // Lets the follower ranks return (after a failure they already have).
    if (broken_.ok() && !driver_->stop().ok()) ep_->group->abort("rank 0: stopping");
    for (auto& t : ep_->threads) t.join();
  }

  const model::Qwen3MoeConfig& config() const override { return model_.config(); }
  const RunnerLimits& limits() const override { return limits_; }
  std::string describe() const override {
    std::string s = fmt::format("cpu backend: {} layers, vocab {}, context {}, KV pool {} blocks of {} tokens{}",
                                config().num_hidden_layers, config().vocab_size, limits_.max_context,
                                limits_.num_blocks, limits_.block_size, ep_ ? " per rank" : "");
    if (ep_)
      s += fmt::format("; data parallel over {} expert-parallel ranks (threads), up to {} sequences and {} tokens a "
                       "step",
                       limits_.kv_pools, limits_.max_seqs, limits_.max_step_tokens);
    return s;
  }

  // One forward_batch over every sequence of the step (bit-identical to running them one by one).
  Status step(std::span<const RunnerSeq> seqs, std::vector<float>& logits) override {
    if (!ep_) {
      size_t rows = 0;
      MOEBIUS_TRY(part_.prepare(seqs, &rows));
      return part_.run(logits);
    }
    if (!broken_.ok()) return broken_;
    return dp_step(seqs, logits);
  }

  bool failed() const override { return !broken_.ok(); }

  // The block tables are the cache state, on every rank.
  bool shares_kv_blocks() const override { return true; }
  void release(int64_t) override {}

  Result<std::unique_ptr<StagedWeights>> stage_weights(const std::string& dir) const override {
    if (ep_)
      return Error("weight updates are not supported with --ep yet (every rank would have to reload its experts)")
          .in_field("model_path");
    MOEBIUS_ASSIGN_OR_RETURN(model::Qwen3MoeCpu next, model_.stage_reload(dir));
    return std::unique_ptr<StagedWeights>(new Staged(std::move(next)));
  }

  // The KV stays: same shape, and its rows (made with the old weights) are kept.
  void commit_weights(StagedWeights& staged) override {
    model_.commit_reload(std::move(static_cast<Staged&>(staged).model));
  }

 private:
  struct Staged final : StagedWeights {
    explicit Staged(model::Qwen3MoeCpu m) : model(std::move(m)) {}
    model::Qwen3MoeCpu model;
  };

  // [TAG_SERVE_DP] server/dp_driver.h; a collective's failure stops the group, since the ranks
  // may then be out of step (one failed inside a collective the others wait in): every later step
  // reports it.
  Status dp_step(std::span<const RunnerSeq> seqs, std::vector<float>& logits) {
    Status refused = Ok{};
    if (Status st = driver_->step(seqs, part_, logits, &refused); !st.ok()) {
      broken_ = Error("the data-parallel ranks stopped: " + st.error().what());
      ep_->group->abort("rank 0: " + st.error().what());
      return st;
    }
    return refused;
  }

  model::Qwen3MoeCpu model_;
  RunnerLimits limits_;
  std::unique_ptr<EpFollowers> ep_;
  std::unique_ptr<model::KvBlockPool> pool_;  // rank 0's (--ep: the followers have their own)
  CpuPart part_;                              // rank 0's model over pool_
  std::unique_ptr<DpStepDriver> driver_;      // --ep
  Status broken_ = Ok{};
};

// Starts ranks 1..N-1 and loads rank 0's model; every rank checks in with a barrier after its
// load, so a rank that fails to load fails the whole runner (the group is aborted, no one waits).
Result<std::unique_ptr<StepRunner>> load_cpu_ep_runner(const RunnerOptions& o, const model::Qwen3MoeLoadOptions& load,
                                                       RunnerLimits l) {
  auto ep = std::make_unique<EpFollowers>();
  ep->group = parallel::InProcessGroup::create(o.ep);
  ep->status.assign(static_cast<size_t>(o.ep), Status(Ok{}));
  for (int r = 1; r < o.ep; ++r) {
    ep->threads.emplace_back([dir = o.source.model_dir, load, l, r, g = ep->group, st = &ep->status[static_cast<size_t>(r)]] {
      model::Qwen3MoeLoadOptions mine = load;
      mine.ep_comm = g->communicator(r);
      *st = [&]() -> Status {
        MOEBIUS_ASSIGN_OR_RETURN(model::Qwen3MoeCpu m, model::Qwen3MoeCpu::load(dir, mine));
        MOEBIUS_TRY(mine.ep_comm->barrier());
        return follow_dp_steps(m, *mine.ep_comm, l);
      }();
      if (!st->ok()) g->abort("rank " + std::to_string(r) + ": " + st->error().what());
    });
  }
  model::Qwen3MoeLoadOptions zero = load;
  zero.ep_comm = ep->group->communicator(0);
  ep->comm0 = zero.ep_comm;
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
  return std::unique_ptr<StepRunner>(new CpuRunner(std::move(m).value(), l, std::move(ep)));
}

}  // namespace

namespace {

// The bytes of a checkpoint's safetensors files: what its weights take once loaded, as an estimate
// made before loading (quantizing experts at load makes them smaller; 0 where the directory cannot
// be listed, and then only the free memory's margin guards the pools).
uint64_t checkpoint_bytes(const std::string& dir) {
  std::error_code ec;
  uint64_t total = 0;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path().extension() != ".safetensors") continue;
    const uint64_t n = it->file_size(ec);
    if (!ec) total += n;
    ec.clear();
  }
  return total;
}

// The CPU KV pool allocates a block when a sequence first needs it and keeps it, so a pool larger
// than the host's memory starts fine and is OOM-killed under load (--kv-blocks 2e9 also made a
// 16 GB table of empty slots at once). Sized against MemAvailable after the weights are loaded,
// keeping max(2 GiB, 10%) free: an explicit --kv-blocks above that is an error; the default
// (--max-running full contexts) is lowered to what fits, and the scheduler preempts instead.
// `pools` pools of l.num_blocks each (--ep: one per rank, all in this process); `reserve`: bytes
// still to be loaded (--ep sizes the pools before its ranks load their weights).
Status fit_kv_pool_in_host_memory(const model::Qwen3MoeConfig& c, bool explicit_blocks, RunnerLimits& l, int pools = 1,
                                  uint64_t reserve = 0) {
  const uint64_t total = offload::host_available_bytes();
  if (total == 0) return Ok{};  // no /proc/meminfo: nothing to size against
  const uint64_t available = total > reserve ? total - reserve : 0;
  const uint64_t block_bytes = sizeof(float) * static_cast<uint64_t>(c.num_hidden_layers) * 2 *
                                   static_cast<uint64_t>(l.block_size) * static_cast<uint64_t>(c.num_key_value_heads) *
                                   static_cast<uint64_t>(c.head_dim) +
                               sizeof(void*);
  const uint64_t pool_bytes = block_bytes * static_cast<uint64_t>(pools);  // one block in every pool
  const uint64_t keep = std::max<uint64_t>(uint64_t{2} << 30, available / 10);
  const uint64_t fit = available > keep ? (available - keep) / pool_bytes : 0;
  if (static_cast<uint64_t>(l.num_blocks) <= fit) return Ok{};
  const double gib = static_cast<double>(uint64_t{1} << 30);
  const std::string per = pools > 1 ? fmt::format(" in each of {} pools (--ep)", pools) : "";
  const std::string weights =
      reserve > 0 ? fmt::format(" after {:.1f} GiB of weights", static_cast<double>(reserve) / gib) : "";
  if (explicit_blocks || fit == 0)
    return Error::format("{} KV blocks of {:.2f} MiB{} could grow to {:.1f} GiB; the host has {:.1f} GiB available{}, "
                         "of which {:.1f} must stay free: at most {} blocks{}",
                         l.num_blocks, static_cast<double>(block_bytes) / (1 << 20), per,
                         static_cast<double>(l.num_blocks) * static_cast<double>(pool_bytes) / gib,
                         static_cast<double>(available) / gib, weights, static_cast<double>(keep) / gib, fit, per)
        .in_field("--kv-blocks");
  log_info("KV pool: {} blocks ({} full contexts) would not fit in host memory; {} blocks of {} tokens fit",
           l.num_blocks, l.max_seqs, fit, l.block_size);
  l.num_blocks = static_cast<int32_t>(fit);  // < the int32 default it replaces
  return Ok{};
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
    MOEBIUS_ASSIGN_OR_RETURN(l.max_context, checked_max_context(o.max_context, config, config.max_position_embeddings));
    l.block_size = o.block_size;
    // [TAG_SERVE_DP] Each rank runs up to --max-running sequences over its own KV pool (--kv-blocks
    // blocks, by default --max-running full contexts), so the engine schedules N times as many.
    // --max-step-tokens is the step's total, raised to one token per sequence where it is below
    // N x --max-running (the engine needs that much), which describe() reports.
    const int64_t seqs = int64_t{o.max_seqs} * o.ep;
    const int64_t blocks = (int64_t{l.max_context} + l.block_size - 1) / l.block_size * o.max_seqs;
    if (seqs > std::numeric_limits<int32_t>::max())
      return Error::format("--max-running {} x --ep {} is too many sequences", o.max_seqs, o.ep).in_field("--max-running");
    if (o.num_blocks == 0 && blocks > std::numeric_limits<int32_t>::max())
      return Error::format("{} sequences of {} tokens need {} KV blocks, more than a pool holds; lower --max-context",
                           o.max_seqs, l.max_context, blocks)
          .in_field("--max-context");
    l.max_seqs = static_cast<int>(seqs);
    l.max_step_tokens = std::max(o.max_step_tokens, l.max_seqs);
    l.num_blocks = o.num_blocks > 0 ? o.num_blocks : static_cast<int32_t>(blocks);
    l.kv_pools = o.ep;
    l.max_all_logits_rows = l.max_step_tokens;  // the CPU lm_head keeps no buffer per row
    // The ranks copy the limits when they start, before any weights are loaded: size the N pools
    // now, against what the host has left once the checkpoint is in memory.
    MOEBIUS_TRY(fit_kv_pool_in_host_memory(config, o.num_blocks > 0, l, o.ep, checkpoint_bytes(o.source.model_dir)));
    return load_cpu_ep_runner(o, load, l);
  }
  MOEBIUS_ASSIGN_OR_RETURN(model::Qwen3MoeCpu m, model::Qwen3MoeCpu::load(o.source.model_dir, load));
  RunnerLimits l;
  MOEBIUS_ASSIGN_OR_RETURN(l.max_context,
                           checked_max_context(o.max_context, m.config(), m.config().max_position_embeddings));
  l.block_size = o.block_size;
  l.max_seqs = o.max_seqs;
  l.max_step_tokens = o.max_step_tokens;
  l.max_all_logits_rows = l.max_step_tokens;
  // --max-running full contexts by default; a context of up to 2^30 tokens (what config.json may
  // say) times the sequences can pass a block id's int32.
  const int64_t blocks = (int64_t{l.max_context} + l.block_size - 1) / l.block_size * l.max_seqs;
  if (o.num_blocks == 0 && blocks > std::numeric_limits<int32_t>::max())
    return Error::format("{} sequences of {} tokens need {} KV blocks, more than a pool holds; lower --max-context",
                         l.max_seqs, l.max_context, blocks)
        .in_field("--max-context");
  l.num_blocks = o.num_blocks > 0 ? o.num_blocks : static_cast<int32_t>(blocks);
  MOEBIUS_TRY(fit_kv_pool_in_host_memory(m.config(), o.num_blocks > 0, l));
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
  if (o.prompt_logprob_rows < 0 || o.prompt_logprob_rows > 1 << 20)
    return Error::format("must be in [0, {}], got {}", 1 << 20, o.prompt_logprob_rows).in_field("--prompt-logprob-rows");
  if (o.ep < 1 || o.ep > 1024) return Error::format("must be in [1, 1024], got {}", o.ep).in_field("--ep");
  if (o.ep_comm && o.ep_comm->size() != o.ep)
    return Error::format("the worker communicator has {} ranks, --ep is {}", o.ep_comm->size(), o.ep).in_field("--ep");
  if (o.ep > 1 && o.backend == "cuda" && !o.ep_comm)
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
