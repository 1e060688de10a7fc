// The CUDA backend of StepRunner: Qwen3MoeCuda over one paged KV cache whose blocks the engine's
// BlockAllocator hands out ([TAG_KV_CACHE_LAYOUT]). The runner keeps nothing per sequence: the
// block table is the sequence's whole cache state, so release() has nothing to do.
//
// `--ep N` ([TAG_SERVE_DP]): one process per GPU, each rank a Qwen3MoeCuda over its E / N experts
// and its own KV pool, data parallel as the CPU runner's ranks are (server/dp_driver.h): the
// engine places each sequence on a rank, rank 0 sends every rank its part of the step, each rank
// runs attention over its own sequences (a rank with none runs only the MoE collectives), and the
// wanted logits rows come back to rank 0. Those messages are host data over the NCCL communicator
// (parallel/host_staged_communicator.h); the MoE dispatch inside the forward stays on the device.
#ifdef MOEBIUS_HAS_CUDA

#include <algorithm>
#include <cstring>
#include <limits>

#include <fmt/format.h>

#include "core/log.h"
#include "core/memory.h"
#include "core/thread_pool.h"
#include "model/generate.h"
#include "model/qwen3_moe_cuda.h"
#include "server/dp_driver.h"
#include "server/step_runner.h"

#ifdef MOEBIUS_HAS_NCCL
#include "parallel/host_staged_communicator.h"
#include "parallel/nccl_communicator.h"
#endif

namespace moebius::server {
namespace {

// A rank's part of a step (the whole step without --ep): one forward over its sequences, whose
// batch has one logits row per sequence (its last new token); the wanted ones are returned. A
// data-parallel rank with no sequences in the step still takes part in every MoE layer's
// collectives (Qwen3MoeCuda::ep_empty_step).
class CudaPart final : public DpPart {
 public:
  explicit CudaPart(model::Qwen3MoeCuda& model) : model_(model) {
    // The step's logits land in pinned memory: a copy to pageable memory goes through the
    // driver's staging buffer at a fraction of the PCIe rate, and a decode step of 64 sequences
    // returns 39 MB of Qwen3 logits. Without pinned memory (a locked-memory limit) the vector
    // below serves, slower.
    if (auto b = Buffer::allocate(MemoryKind::kPinnedHost, readback_bytes()); b.ok()) pinned_ = std::move(b).value();
    else log_warn("logits read-back: no pinned host memory ({}); using pageable memory", b.error().what());
  }

  Status prepare(std::span<const RunnerSeq> seqs, size_t* rows) override {
    steps_.clear();
    row_count_.clear();
    keep_.clear();
    *rows = 0;
    for (const RunnerSeq& s : seqs) {
      steps_.push_back(model::SequenceStep{s.tokens, s.start, s.block_table, s.all_logits});
      // The batch has a row for every token of an all_logits sequence, one for any other.
      row_count_.push_back(s.all_logits ? s.tokens.size() : 1);
      keep_.push_back(s.all_logits || s.want_logits);
      *rows += logits_rows(s);
    }
    rows_ = *rows;
    if (steps_.empty()) return data_parallel_ ? Status(Ok{}) : Status(Error("a step with no sequences"));
    MOEBIUS_ASSIGN_OR_RETURN(batch_, model_.make_batch(steps_));
    return model_.check_batch(batch_);
  }

  Status run(std::vector<float>& logits) override {
    if (steps_.empty()) {
      logits.clear();
      return model_.ep_empty_step();
    }
    const size_t V = static_cast<size_t>(model_.config().vocab_size);
    std::vector<const float*> rows;
    MOEBIUS_TRY(forward_rows(rows));
    // The kept rows into the caller's buffer, on the pool's threads: a decode step of 64 sequences
    // is 39 MB of Qwen3 logits, several ms for one thread's memcpy. (resize() zero-fills the rows
    // beyond the previous step's; the engine reads rows in place through step_rows instead.)
    logits.resize(rows.size() * V);
    const auto copy = [&](int64_t j) {
      std::memcpy(logits.data() + static_cast<size_t>(j) * V, rows[static_cast<size_t>(j)], V * sizeof(float));
    };
    ThreadPool::global().parallel_for(0, static_cast<int64_t>(rows.size()), copy);
    return Ok{};
  }

  // After prepare(): the forward, its logits read back into host memory of the part's own, and
  // `rows` pointed at the kept ones (valid until the next forward).
  Status forward_rows(std::vector<const float*>& rows) {
    const size_t V = static_cast<size_t>(model_.config().vocab_size);
    float* all = pinned_.data() != nullptr ? pinned_.as<float>() : nullptr;
    if (all == nullptr) {
      all_.resize(batch_.logit_rows.size() * V);
      all = all_.data();
    }
    MOEBIUS_TRY(model_.forward(batch_, all));
    rows.clear();
    for (size_t i = 0, src = 0; i < steps_.size(); src += row_count_[i], ++i)
      if (keep_[i])
        for (size_t r = 0; r < row_count_[i]; ++r) rows.push_back(all + (src + r) * V);
    return Ok{};
  }
  // The read-back's size at most (max_logit_rows x V fp32), and whether it is pinned.
  size_t readback_bytes() const {
    return static_cast<size_t>(model_.max_logit_rows()) * static_cast<size_t>(model_.config().vocab_size) * sizeof(float);
  }
  bool readback_pinned() const { return pinned_.data() != nullptr; }

  void set_data_parallel() { data_parallel_ = true; }

 private:
  model::Qwen3MoeCuda& model_;
  bool data_parallel_ = false;
  std::vector<model::SequenceStep> steps_;
  std::vector<size_t> row_count_;  // the batch's logits rows per sequence
  std::vector<bool> keep_;         // whether the caller wants them
  model::StepBatch batch_;
  size_t rows_ = 0;
  Buffer pinned_;            // [max_logit_rows, V] fp32, the forward's logits
  std::vector<float> all_;   // the same when no pinned memory could be had
};

// [TAG_SERVE_DP] Data-parallel serving over the EP ranks (one process per GPU): the step messages
// and logits rows go over the NCCL communicator through host staging.
struct DpState {
  std::unique_ptr<parallel::Communicator> comm;  // host-staged, over the model's NCCL communicator
  std::unique_ptr<DpStepDriver> driver;          // rank 0
  uint64_t scratch_bytes = 0;                    // the host-staged collectives' device scratch
};

class CudaRunner final : public StepRunner {
 public:
  CudaRunner(std::unique_ptr<model::Qwen3MoeCuda> model, RunnerLimits limits, std::unique_ptr<DpState> dp)
      : model_(std::move(model)), limits_(limits), part_(*model_), dp_(std::move(dp)) {
    if (dp_) part_.set_data_parallel();
  }
  // Data parallel: the followers return from their step loop (after a failure they may be stuck
  // in a collective; `serve` then exits with an error, and the launcher or mpirun ends them).
  ~CudaRunner() override {
    if (dp_ && broken_.ok()) (void)dp_->driver->stop();
  }

  const model::Qwen3MoeConfig& config() const override { return model_->config(); }
  std::optional<offload::ModelCacheStats> expert_cache_stats() const override {
    if (!model_->expert_cache_on()) return std::nullopt;
    return model_->expert_cache_stats();
  }
  const RunnerLimits& limits() const override { return limits_; }
  std::string describe() const override {
    const int N = model_->ep_size();
    return fmt::format(
        "cuda backend: {} layers, vocab {}, context {}, KV pool {} blocks of {} tokens{}; logits read-back {:.1f} MiB "
        "{}{}\n{}",
        config().num_hidden_layers, config().vocab_size, limits_.max_context, limits_.num_blocks, limits_.block_size,
        dp_ ? " per rank" : "", static_cast<double>(part_.readback_bytes()) / (1 << 20),
        part_.readback_pinned() ? "pinned (host)" : "pageable (host; no pinned memory could be had)",
        dp_ ? fmt::format("; data parallel over {} expert-parallel GPUs ({} of {} experts per layer on each), up to {} "
                          "sequences and {} tokens a step; this rank's step-message scratch {:.1f} MiB (GPU, beside the "
                          "plan below)",
                          N, config().num_experts / N, config().num_experts, limits_.max_seqs, limits_.max_step_tokens,
                          static_cast<double>(dp_->scratch_bytes) / (1 << 20))
            : std::string(),
        model::format_memory_plan(model_->memory_plan()));
  }

  // One GPU: the engine reads the rows in the pinned read-back, no copy. Data parallel: the rows
  // are gathered from the ranks into `scratch` (the default).
  Status step_rows(std::span<const RunnerSeq> seqs, std::vector<float>& scratch,
                   std::vector<const float*>& rows) override {
    if (dp_) return StepRunner::step_rows(seqs, scratch, rows);
    size_t n = 0;
    MOEBIUS_TRY(part_.prepare(seqs, &n));
    return part_.forward_rows(rows);
  }

  Status step(std::span<const RunnerSeq> seqs, std::vector<float>& logits) override {
    if (!dp_) {
      size_t rows = 0;
      MOEBIUS_TRY(part_.prepare(seqs, &rows));
      return part_.run(logits);
    }
    if (!broken_.ok()) return broken_;
    Status refused = Ok{};
    if (Status st = dp_->driver->step(seqs, part_, logits, &refused); !st.ok()) {
      // A collective failed: the ranks may be out of step, so no later step runs.
      broken_ = Error("the data-parallel ranks stopped: " + st.error().what());
      return st;
    }
    return refused;
  }

  bool failed() const override { return !broken_.ok(); }
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
  CudaPart part_;
  std::unique_ptr<DpState> dp_;
  Status broken_ = Ok{};
};

// [TAG_SERVE_DP] Each rank runs up to --max-running sequences over its own KV pool, so the engine
// schedules N times as many; --max-step-tokens is the step's total, raised to one token per
// sequence where it is below N x --max-running. Any one rank may be given the whole step (the
// engine places by cached prefix and load, not by tokens), so every rank's runner holds the
// step's total.
struct DpSizes {
  int seqs_per_rank = 0;
  int step_tokens = 0;
};

Result<DpSizes> dp_sizes(const RunnerOptions& o) {
  const int N = o.ep_comm ? o.ep_comm->size() : 1;
  const int64_t seqs = int64_t{o.max_seqs} * N;
  if (seqs > std::numeric_limits<int32_t>::max())
    return Error::format("--max-running {} x --ep {} is too many sequences", o.max_seqs, N).in_field("--max-running");
  return DpSizes{o.max_seqs, static_cast<int>(std::max<int64_t>(o.max_step_tokens, seqs))};
}

// The runner's options from the server's; the same on every EP rank (the capacities must match).
Result<model::Qwen3MoeCudaOptions> cuda_options(const RunnerOptions& o) {
  MOEBIUS_ASSIGN_OR_RETURN(std::optional<WeightFormat> experts, model::parse_experts_format(o.experts));
  MOEBIUS_ASSIGN_OR_RETURN(model::Qwen3MoeConfig config, model::weight_source_config(o.source));
  MOEBIUS_ASSIGN_OR_RETURN(DpSizes dp, dp_sizes(o));
  model::Qwen3MoeCudaOptions co;
  co.experts_format = experts;
  // A full-length context for every running sequence would not fit a real model's pool: default
  // to 8192 tokens a sequence unless --max-context says otherwise.
  MOEBIUS_ASSIGN_OR_RETURN(co.max_context, checked_max_context(o.max_context, config,
                                                                std::min<int64_t>(config.max_position_embeddings, 8192)));
  co.max_seqs = o.max_seqs;
  co.max_tokens = dp.step_tokens;
  // One row per sequence, plus the prompt-logprob rows (all of them may land on one rank). A step
  // never has more rows than tokens, so the step's tokens cap it.
  co.max_logit_rows = static_cast<int>(
      std::min<int64_t>(int64_t{o.max_seqs} + std::max(0, o.prompt_logprob_rows), co.max_tokens));
  co.block_size = o.block_size;
  co.num_blocks = o.num_blocks;
  co.graph_batches = o.graph_batches;
  co.autotune = o.autotune;
  co.gpu_memory_budget = o.gpu_memory_budget;
  co.placement_file = o.placement_file;
  MOEBIUS_ASSIGN_OR_RETURN(co.expert_cache,
                           offload::parse_expert_cache_flags(o.expert_cache, !o.gpu_memory_budget.empty()));
  co.expert_prefetch = o.expert_prefetch;
  co.expert_dma_slots = o.expert_dma;
  if (co.graph_batches.empty())
    for (int b = 1; b <= o.max_seqs; b *= 2) co.graph_batches.push_back(b);
  co.ep_comm = o.ep_comm;
  return co;
}

RunnerLimits runner_limits(const model::Qwen3MoeCuda& m, const RunnerOptions& o) {
  RunnerLimits l;
  l.block_size = m.block_size();
  l.num_blocks = m.num_blocks();
  l.max_context = m.max_context();
  l.max_step_tokens = m.max_tokens();
  l.max_seqs = m.max_seqs() * m.ep_size();
  l.kv_pools = m.ep_size();
  // A rank's rows: one per sequence without all_logits, one per token of one with it, so at most
  // min(max_seqs + these, step tokens) = its max_logit_rows.
  l.max_all_logits_rows = std::min(std::max(0, o.prompt_logprob_rows), m.max_tokens());
  return l;
}

// The host-staged communicator over the model's NCCL one, after checking that every rank holds
// the same limits (the first DP collective: a rank that cannot match fails them all at start-up).
// Its device scratch is allocated here for the largest collective the limits allow, so a step
// never allocates (an allocation failing on one rank mid-step would leave the others waiting in
// NCCL): rank 0's logits gather, (N - 1) ranks x max_logit_rows x V fp32, or a follower's own rows,
// plus the step messages (ids and block tables, a few hundred KiB).
Result<std::unique_ptr<parallel::Communicator>> dp_communicator(const RunnerOptions& o, model::Qwen3MoeCuda& m,
                                                                const RunnerLimits& l, uint64_t* scratch_bytes) {
#ifdef MOEBIUS_HAS_NCCL
  auto* nccl = dynamic_cast<parallel::NcclCommunicator*>(o.ep_comm.get());
  if (nccl == nullptr) return Error("data-parallel serving on the CUDA backend runs over NCCL").in_field("--ep");
  auto c = std::make_unique<parallel::HostStagedCommunicator>(*nccl, m.stream());
  const uint64_t N = static_cast<uint64_t>(nccl->size());
  const uint64_t row_bytes = static_cast<uint64_t>(m.config().vocab_size) * sizeof(float);
  const uint64_t rows = static_cast<uint64_t>(m.max_logit_rows()) * (nccl->rank() == 0 ? N - 1 : 1);
  const uint64_t messages = 2 * (uint64_t{64} + static_cast<uint64_t>(l.max_step_tokens) * 4 +
                                 static_cast<uint64_t>(l.max_seqs) * (64 + static_cast<uint64_t>(m.max_blocks_per_seq()) * 4));
  const uint64_t need = std::max(rows * row_bytes, messages) + 4096;
  if (need > parallel::HostStagedCommunicator::kMaxBytes)
    return Error::format("rank {} would exchange {} MiB of logits rows a step ({} rows of {} ids), more than the {} MiB "
                         "the host-staged collectives allow; lower --max-running or --prompt-logprob-rows",
                         nccl->rank(), need >> 20, rows, m.config().vocab_size,
                         parallel::HostStagedCommunicator::kMaxBytes >> 20)
        .in_field("--ep");
  MOEBIUS_TRY(c->reserve(static_cast<size_t>(need)));
  *scratch_bytes = need;
  MOEBIUS_TRY(dp_check_same_limits(*c, l));
  return std::unique_ptr<parallel::Communicator>(std::move(c));
#else
  (void)o, (void)m, (void)l, (void)scratch_bytes;
  return Error("this build of moebius has no NCCL; expert parallelism on the CUDA backend needs it").in_field("--ep");
#endif
}

}  // namespace

Status run_ep_follower(const RunnerOptions& o) {
  if (!o.ep_comm || o.ep_comm->size() != o.ep || o.ep_comm->rank() == 0 || o.backend != "cuda")
    return Error("a follower rank needs --backend cuda and its worker communicator").in_field("--ep");
  MOEBIUS_ASSIGN_OR_RETURN(model::Qwen3MoeCudaOptions co, cuda_options(o));
  MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<model::Qwen3MoeCuda> m, model::Qwen3MoeCuda::open(o.source, co));
  const RunnerLimits l = runner_limits(*m, o);
  uint64_t scratch = 0;
  MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<parallel::Communicator> comm, dp_communicator(o, *m, l, &scratch));
  CudaPart part(*m);
  part.set_data_parallel();
  return follow_dp_steps(*comm, part, m->config().vocab_size);
}

Result<std::unique_ptr<StepRunner>> load_cuda_runner(const RunnerOptions& o) {
  MOEBIUS_ASSIGN_OR_RETURN(model::Qwen3MoeCudaOptions co, cuda_options(o));
  MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<model::Qwen3MoeCuda> m, model::Qwen3MoeCuda::open(o.source, co));
  const RunnerLimits l = runner_limits(*m, o);
  std::unique_ptr<DpState> dp;
  if (o.ep_comm) {
    dp = std::make_unique<DpState>();
    MOEBIUS_ASSIGN_OR_RETURN(dp->comm, dp_communicator(o, *m, l, &dp->scratch_bytes));
    dp->driver = std::make_unique<DpStepDriver>(*dp->comm, m->config().vocab_size);
  }
  return std::unique_ptr<StepRunner>(new CudaRunner(std::move(m), l, std::move(dp)));
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
