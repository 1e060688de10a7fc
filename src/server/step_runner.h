// The engine's view of a model: one forward step over a batch of sequences, whatever the backend.
// The scheduler (engine.h) owns the sequences and the KV block accounting (a BlockAllocator over
// num_blocks() blocks of block_size() tokens); a runner only computes.
//
//   cpu:  Qwen3MoeCpu; a step is one forward_batch (dense ops and experts over every token of the
//         step, attention per sequence) over one KV block pool viewed through the scheduler's block
//         tables (--ep N: one pool per data-parallel rank, [TAG_SERVE_DP]). A weight update swaps
//         the model's weights for the staged model's.
//   cuda: Qwen3MoeCuda, one paged cache for every sequence (--ep N: one per data-parallel rank,
//         a GPU each); the step is one StepBatch whose block tables are the scheduler's
//         ([TAG_KV_CACHE_LAYOUT]); pure decode steps replay the runner's CUDA graphs. A weight update copies the staged host weights into the device
//         buffers they replace, so the graphs stay valid.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/qwen3_moe_config.h"
#include "model/weight_source.h"
#include "offload/expert_cache.h"
#include "offload/model_expert_cache.h"
#include "parallel/communicator.h"

namespace moebius::server {

struct RunnerSeq {
  int64_t id = 0;                        // stable for the sequence's life (a preempted one keeps it)
  std::span<const int32_t> tokens;       // new tokens, at least one
  int64_t start = 0;                     // tokens of this sequence already in the cache
  std::span<const int32_t> block_table;  // covers start + tokens.size(); blocks of pool `pool`
  bool want_logits = false;              // the last new token's logits are wanted
  int pool = 0;                          // the KV pool (data-parallel rank) it runs on
  // Every new token's logits are wanted (a prompt's logprobs): tokens.size() rows instead of one.
  // At most RunnerLimits::max_all_logits_rows such rows a step on one pool.
  bool all_logits = false;
};

// The logits rows a sequence's step returns.
inline size_t logits_rows(const RunnerSeq& s) { return s.all_logits ? s.tokens.size() : s.want_logits ? 1 : 0; }

struct RunnerLimits {
  int block_size = 16;
  int32_t num_blocks = 0;    // KV blocks in each pool
  int max_context = 0;       // tokens per sequence
  int max_step_tokens = 0;   // tokens per step (the prefill chunk)
  int max_seqs = 0;          // sequences per step, over every pool
  // KV pools: 1, or one per data-parallel rank ([TAG_SERVE_DP]: a sequence runs on the rank whose
  // pool holds its blocks, at most max_seqs / kv_pools sequences per rank). The engine places.
  int kv_pools = 1;
  // Rows of all_logits sequences (RunnerSeq::all_logits) one step may ask of one pool; 0: none
  // (prompt logprobs are then refused).
  int max_all_logits_rows = 0;
};

// A checkpoint a runner has read and checked, ready for commit_weights (backend-specific).
class StagedWeights {
 public:
  virtual ~StagedWeights() = default;
};

class StepRunner {
 public:
  virtual ~StepRunner() = default;
  virtual const model::Qwen3MoeConfig& config() const = 0;
  virtual const RunnerLimits& limits() const = 0;
  virtual std::string describe() const = 0;  // a line for the startup log
  // Runs one step. `logits` receives [R, V] fp32, the sequences' logits_rows() in order.
  // Errors leave every sequence's cache as it was before the step's tokens.
  virtual Status step(std::span<const RunnerSeq> seqs, std::vector<float>& logits) = 0;
  // The same step, with the rows left where they lie: row r (the sequences' logits_rows() in
  // order) at rows[r], V floats, valid until the next call. The default runs step() into
  // `scratch`; a runner whose forward already holds the rows in host memory (cuda: the pinned
  // read-back) points into it and saves the engine a copy of every row.
  virtual Status step_rows(std::span<const RunnerSeq> seqs, std::vector<float>& scratch,
                           std::vector<const float*>& rows) {
    MOEBIUS_TRY(step(seqs, scratch));
    const size_t V = static_cast<size_t>(config().vocab_size);
    rows.clear();
    for (size_t r = 0; r * V < scratch.size(); ++r) rows.push_back(scratch.data() + r * V);
    return Ok{};
  }
  // The sequence is gone (finished, cancelled or preempted): drop whatever the runner keeps for it
  // (the runners here keep nothing: the block tables are the cache state).
  virtual void release(int64_t id) = 0;
  // True when a sequence's block table is its whole cache state (the KV lives in the pool blocks
  // the table lists, and nothing else is kept per sequence), so sequences may share blocks: the
  // engine's prefix cache ([TAG_PREFIX_CACHE]) is on only then.
  virtual bool shares_kv_blocks() const { return false; }
  // True once the runner cannot run another step (cpu --ep: a step failed inside the ranks'
  // collectives, which may leave them out of step); the engine then stops and /health says so.
  virtual bool failed() const { return false; }
  // The dynamic expert cache's counts since the runner started (--expert-cache), or nothing when
  // the runner has no cache.
  virtual std::optional<offload::ModelCacheStats> expert_cache_stats() const { return std::nullopt; }

  // Weight updates (POST /update_weights_from_disk; Engine::update_weights), in two steps:
  // stage_weights reads the checkpoint directory `dir` completely and checks it against the
  // serving model (identical config, every tensor with its shape and dtype, the same expert
  // formats); an error names what is wrong, and nothing has changed. It may run on any thread
  // while step() runs (it reads nothing a step changes); updates must not overlap each other.
  // commit_weights, between two steps on the engine thread, puts the staged weights in place
  // (cuda: copied into the buffers they replace, so captured graphs stay valid). It cannot fail.
  virtual Result<std::unique_ptr<StagedWeights>> stage_weights(const std::string& dir) const = 0;
  virtual void commit_weights(StagedWeights& staged) = 0;
};

// --max-context against the model's positions (Qwen3MoeConfig::context_limit: max_position_embeddings
// stretched by rope scaling): 0 takes `fallback` (capped at the limit); a value past the limit is
// an error naming the flag, not a silent clamp.
inline Result<int> checked_max_context(int requested, const model::Qwen3MoeConfig& c, int64_t fallback) {
  if (requested < 0) return Error::format("must be >= 0, got {}", requested).in_field("--max-context");
  if (requested == 0) return static_cast<int>(std::min<int64_t>(fallback, c.context_limit()));
  if (requested > c.context_limit())
    return Error::format("{} is past the model's {} positions (max_position_embeddings {}, rope scaling {})", requested,
                         c.context_limit(), c.max_position_embeddings, model::rope_scaling_text(c.rope_scaling))
        .in_field("--max-context");
  return requested;
}

struct RunnerOptions {
  model::WeightSource source;   // --model, or --geometry with --load-format dummy (cuda: random weights)
  std::string backend = "cpu";  // cpu or cuda
  std::string experts;          // "" keeps the checkpoint's format; bf16, nvfp4, int4, int2
  int max_context = 0;          // 0: max_position_embeddings
  int max_seqs = 64;
  int max_step_tokens = 512;
  int block_size = 16;
  int32_t num_blocks = 0;       // 0: enough for max_seqs full contexts (cpu), the runner's pool (cuda)
  std::vector<int> graph_batches;  // cuda: decode graph buckets; empty: 1, 2, 4, ... up to max_seqs
  bool autotune = false;        // cuda: tune the MoE kernels (Qwen3MoeCudaOptions::autotune)
  // cuda: logits rows a step may compute besides one per sequence, for prompt logprobs
  // (RunnerLimits::max_all_logits_rows; each row is a [V] fp32 buffer row on the GPU: 0.6 MB for
  // Qwen3's 151,936 ids). cpu: no limit beyond the step's tokens.
  int prompt_logprob_rows = 128;
  // cuda: expert offload (Qwen3MoeCudaOptions::gpu_memory_budget / placement_file / expert_cache /
  // expert_prefetch; expert_dma: expert_dma_slots, -1 (no --expert-dma) for its environment default).
  std::string gpu_memory_budget;
  std::string placement_file;
  offload::ExpertCacheFlags expert_cache;
  int expert_prefetch = 0;
  int expert_dma = -1;
  // Expert parallelism over `ep` ranks. cpu: threads of this process over the in-process
  // communicator, data parallel ([TAG_SERVE_DP]): one KV pool per rank (the engine places each
  // sequence on a rank), every rank holds its E / N experts. cuda: one process per GPU, this one rank
  // ep_comm->rank() of ep_comm (NCCL, src/cli/ep_workers.h), data parallel the same way: rank 0 runs
  // the runner (the scheduler lives there), the others run_ep_follower. The runner's destructor
  // releases the followers. A cuda runner given ep_comm is data parallel even over one rank (the
  // GPU tests run the protocol that way); ep_comm->size() must equal ep.
  int ep = 1;
  std::shared_ptr<parallel::Communicator> ep_comm;
};

// Loads the model for `options.backend`. Errors name the offending flag.
Result<std::unique_ptr<StepRunner>> load_runner(const RunnerOptions& options);

// Backends (step_runner_cpu.cpp, step_runner_cuda.cpp).
Result<std::unique_ptr<StepRunner>> load_cpu_runner(const RunnerOptions& options);
#ifdef MOEBIUS_HAS_CUDA
Result<std::unique_ptr<StepRunner>> load_cuda_runner(const RunnerOptions& options);
#endif
// cuda --ep, ranks other than 0: loads this rank's part of the model with exactly the runner's
// options (so the EP capacities match rank 0's) and runs its part of rank 0's data-parallel steps
// (server/dp_driver.h) until rank 0's runner is destroyed. Errors name the flag.
Status run_ep_follower(const RunnerOptions& options);

}  // namespace moebius::server
