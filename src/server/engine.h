// The serving engine: continuous batching over a StepRunner, on one thread that owns the model.
//
// Every iteration of the engine thread is one forward step. Requests join and leave at any step:
//   1. new requests move from the submit queue to `waiting`; cancelled ones (client gone) are
//      dropped wherever they are and their KV blocks are freed before anything else runs;
//   2. the step is filled under a token budget (max_step_tokens) and a sequence cap (max_seqs):
//      running sequences first, oldest first (a decode is one token, a prefill a chunk of its
//      prompt), then waiting ones are admitted in arrival order while their next chunk's KV blocks
//      can be allocated (admission control). Prefill chunks and decodes share a step;
//   3. when a running sequence needs a block and the pool is empty, the newest running sequence
//      is preempted: its blocks go back to the pool and it returns to the head of the queue with
//      its tokens so far, to be recomputed as a prefill when it is admitted again (nothing of its
//      output is lost or repeated: the text already sent stays sent) [TAG_SERVE_RECOMPUTE];
//   4. sequences whose step reached their last token sample one token with their own sampler
//      (seeded per request), then detokenize it, match stop strings (held back while partial),
//      and stop at eos, a stop string, max_tokens or the context limit.
// HTTP threads talk to the engine only through submit() and the RequestStream it returns, both
// thread-safe. The queue is bounded: submit() refuses when max_queue requests already wait (429).
//
// Weight updates (update_weights, POST /update_weights_from_disk): the calling thread reads and
// checks the whole new checkpoint (StepRunner::stage_weights) while the engine keeps stepping;
// a checkpoint that does not fit is refused with the reason and the old weights keep serving.
// A staged checkpoint is handed to the engine thread, which puts it in place BETWEEN two steps
// (StepRunner::commit_weights), so no step ever sees half-copied weights. Requests in flight are
// neither aborted nor drained: they pause for the copy and continue on the new weights, with the
// KV cache their earlier tokens left under the old ones (what SGLang and vLLM also do unless told
// to abort or drain; a client that needs one set of weights per request waits for its requests
// first). Updates run one at a time.
//
// Every request's prompt plus max_tokens must fit max_context(), which is at most the KV pool:
// the oldest running sequence can then always grow, by preempting newer ones, and finish.
//
// Prefix caching [TAG_PREFIX_CACHE] (on unless EngineOptions::prefix_caching is false, and only on
// runners whose block tables are their whole cache state): after every step a sequence publishes
// its whole, computed KV blocks in the allocator (model/block_allocator.h) under the chain of
// tokens that leads to them, prompt and generated tokens alike. A sequence being admitted with
// nothing computed (new, or preempted) first takes the published blocks of its longest
// whole-block prefix, short of its last token, and computes from there: a shared system prompt,
// a next chat turn (the previous turn's prompt and answer) or a preempted sequence's own prefix is
// not computed again. The tokens are the same as without the cache, because a token's KV does not
// depend on what else shared its step (the CPU backend is bit-identical; the CUDA backend computes
// a reused block's KV with the kernel of the step that made it, prefill or decode). Cached blocks
// no table holds are evicted, least recently released first, only when the pool has no never-used
// block left. A weight update starts new chains, so no KV of the old weights is matched again.
// usage.prompt_tokens_details.cached_tokens reports the hit of the request's first admission.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "model/block_allocator.h"
#include "model/sampler.h"
#include "server/metrics.h"
#include "server/step_runner.h"
#include "server/stop_strings.h"
#include "tokenizer/bpe_tokenizer.h"

namespace moebius::server {

// Wakes one waiter on any of several requests' streams (an API request with n > 1 choices): each
// stream's publish bumps `events` and notifies. A waiter reads events(), drains its streams, and
// waits for a change only if they gave nothing, so no publish between is missed.
class StreamListener {
 public:
  uint64_t events() const;
  // Waits until events() differs from `seen` or `timeout` passes; returns the current count.
  uint64_t wait_for_change(uint64_t seen, std::chrono::milliseconds timeout);
  void notify();

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t events_ = 0;
};

struct EngineRequest {
  std::vector<int32_t> prompt;  // non-empty, ids in [0, vocab)
  int64_t max_tokens = 16;      // >= 1; prompt + max_tokens <= Engine::max_context()
  model::SamplerParams sampling;
  std::vector<std::string> stop;
  int top_logprobs = -1;  // -1: none; k >= 0: the chosen token's logprob and the k best
  // -1: none; k >= 0: each prompt token's logprob given the tokens before it (from the second
  // token on), its rank and the k best, delivered once before the first generated token. The
  // prompt is then computed whole: its cached prefix blocks are not reused.
  int prompt_logprobs = -1;
  bool ignore_eos = false;
  // Generation also stops at these ids (as at eos: the id is not part of the output). Before
  // min_tokens tokens neither eos nor these ids can be sampled, and stop strings complete only in
  // the text of later tokens.
  std::vector<int32_t> stop_token_ids;
  int64_t min_tokens = 0;  // <= max_tokens
  bool include_stop_str = false;  // a stop string that ends generation stays in the text
  std::shared_ptr<StreamListener> listener;  // optional: notified with the request's stream
};

struct GeneratedToken {
  int32_t id = 0;
  float logprob = 0.0f;                       // of the model's distribution (before sampling filters)
  std::vector<std::pair<int32_t, float>> top;  // the top_logprobs most likely ids
  int64_t rank = 0;  // prompt logprobs: 1 + the ids more likely than `id` (0 where not computed)
};

// Output produced since the last take(), merged.
struct RequestUpdate {
  std::string text;
  std::vector<GeneratedToken> tokens;  // only with top_logprobs >= 0
  // With prompt_logprobs >= 0: prompt tokens 1..P-1 (the first has no context), once, before any
  // generated token. prompt_logprobs_ready marks the delivery (the list is empty for P = 1).
  std::vector<GeneratedToken> prompt_logprobs;
  bool prompt_logprobs_ready = false;
  bool finished = false;
  std::string finish_reason;  // "stop" or "length" (when finished without error)
  std::string error;          // non-empty: the engine failed the request
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;  // prompt tokens found in the prefix cache at first admission
};

class RequestStream {
 public:
  // Appends what the engine produced since the last call to *out; when nothing is there, waits up
  // to `timeout` for it. Returns true when something arrived or the request has finished.
  bool take(RequestUpdate* out, std::chrono::milliseconds timeout);
  // The client is gone: the engine drops the request and frees its KV at its next iteration.
  void cancel();
  bool cancelled() const { return cancelled_.load(); }

 private:
  friend class Engine;
  struct Wake;
  RequestStream(std::shared_ptr<Wake> wake, std::shared_ptr<StreamListener> listener)
      : wake_(std::move(wake)), listener_(std::move(listener)) {}
  void publish(const std::string& text, GeneratedToken* token, bool finished, const std::string& reason,
               const std::string& error, int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens);
  void publish_prompt_logprobs(std::vector<GeneratedToken> prompt);

  std::shared_ptr<Wake> wake_;  // the engine's condition, to wake it on cancel()
  std::shared_ptr<StreamListener> listener_;  // EngineRequest::listener, or null
  std::mutex mu_;
  std::condition_variable cv_;
  RequestUpdate pending_;
  bool delivered_end_ = false;
  std::atomic<bool> cancelled_{false};
};

struct EngineOptions {
  int max_queue = 256;             // waiting requests before submit() refuses
  std::vector<int32_t> eos_ids;    // generation stops at these (unless ignore_eos)
  // [TAG_PREFIX_CACHE] Reuse the KV of whole blocks of tokens other sequences computed (the
  // allocator's prefix cache). Takes effect only where the runner's block tables are its whole
  // cache state (StepRunner::shares_kv_blocks).
  bool prefix_caching = true;
};

struct WeightUpdate {
  enum class Outcome {
    kUpdated,   // the new weights serve
    kRefused,   // the checkpoint was refused (message says why); the old weights serve
    kStopped,   // the engine stopped before the commit; nothing changed
  };
  Outcome outcome = Outcome::kRefused;
  std::string message;
  int64_t paused_requests = 0;  // kUpdated: requests running or waiting while the weights changed
  double seconds = 0.0;         // staging and commit, wall time
};

struct Submitted {
  std::shared_ptr<RequestStream> stream;  // null when refused
  bool queue_full = false;
  std::string error;  // when refused for another reason (engine stopped, bad request)
};

// submit_group: every request queued (one stream each, in order), or none.
struct SubmittedGroup {
  std::vector<std::shared_ptr<RequestStream>> streams;  // empty when refused
  bool queue_full = false;
  std::string error;  // when refused for another reason: the first bad request's, or the engine's
  // The request field that error names, in the OpenAI API's terms ("prompt", "max_tokens",
  // "top_p", ...); "" when it names none (the engine's own state).
  std::string error_param;
};

class Engine {
 public:
  // `tokenizer` must outlive the engine. Starts the engine thread.
  Engine(std::unique_ptr<StepRunner> runner, const tokenizer::BpeTokenizer* tokenizer, EngineOptions options);
  ~Engine();  // stop()
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  Submitted submit(EngineRequest request);
  // Queues several requests at once (an API request's n choices): all, next to each other in
  // arrival order, or none of them, when any is malformed or the queue lacks room for all
  // (queue_full; one rejection counted). Thread-safe.
  SubmittedGroup submit_group(std::vector<EngineRequest> requests);
  // Reloads the weights from the checkpoint directory `dir` (see the header comment). Blocks until
  // the new weights serve, or returns why not. Thread-safe.
  WeightUpdate update_weights(const std::string& dir);
  // Ends the thread; requests still queued or running finish with an error.
  void stop();
  bool alive() const { return !failed_.load(); }

  // Prompt plus completion tokens a request may use: the runner's context, capped by the KV pool.
  int64_t max_context() const { return max_context_; }
  int max_queue() const { return options_.max_queue; }  // waiting requests before submit() refuses
  int vocab_size() const;
  const RunnerLimits& limits() const { return runner_->limits(); }
  const StepRunner& runner() const { return *runner_; }
  bool prefix_caching() const { return prefix_caching_; }
  EngineMetrics& metrics() { return metrics_; }
  const EngineMetrics& metrics() const { return metrics_; }

 private:
  struct Seq;
  struct Commit;
  void loop();
  void commit_weights();
  bool take_incoming(bool block);
  void drop_cancelled();
  void schedule(std::vector<Seq*>& batch, std::vector<int>& chunk);
  void preempt(size_t running_index);
  void run_step(const std::vector<Seq*>& batch, const std::vector<int>& chunk);
  // A sequence's next token: drawn from its logits row (any thread), then applied (the engine
  // thread: the stream, stops, metrics).
  struct Draw {
    int32_t id = -1;  // -1: sampling failed, `error` says why
    std::string error;
    std::optional<GeneratedToken> logprobs;
  };
  Draw draw(Seq& seq, const float* logits) const;
  void on_token(Seq& seq, Draw draw);
  // Prompt logprobs: whether the sequence's next chunk must return every token's logits, and
  // what one step's rows of it give.
  static bool needs_prompt_logits(const Seq& seq);
  void on_prompt_rows(Seq& seq, int64_t first, int64_t count, std::span<const float* const> rows);
  void finish(Seq& seq, const std::string& reason, const std::string& error);
  std::unique_ptr<Seq> make_seq(EngineRequest request, std::string* error, std::string* param) const;
  void emit(Seq& seq, const std::string& text, GeneratedToken* token);
  static StopMatcher::Out match_stops(Seq& seq, std::string_view text);
  void release_kv(Seq& seq);
  void start_from_prefix_cache(Seq& seq, int pool);
  struct PoolPrefix {
    int pool;
    int64_t cached_blocks;
  };
  std::vector<PoolPrefix> pool_prefixes(Seq& seq) const;  // non-const seq: token_chains() memoizes
  std::vector<int> admission_order(const std::vector<PoolPrefix>& prefixes) const;
  // [TAG_PREFIX_CACHE_INFLIGHT] The chain hashes of seq's whole token blocks under the current
  // weights (kept on the sequence, extended as it grows). The prefix-cache walks of admission
  // and of the in-flight wait look them up instead of hashing the prompt again every step.
  const std::vector<uint64_t>& token_chains(Seq& seq) const;
  // Whether a waiting sequence should wait a step: the block after its longest cached prefix is
  // one a running sequence is computing now (in `inflight`), so it will be cached soon.
  bool prefix_in_flight(Seq& seq, const std::vector<PoolPrefix>& prefixes,
                        const std::unordered_set<uint64_t>& inflight) const;
  static uint64_t inflight_key(int pool, uint64_t chain);
  // [TAG_SERVE_DP] Whether `pool` runs fewer sequences than its share of max_seqs (max_seqs /
  // kv_pools, the remainder spread over the first pools).
  bool pool_has_room(int pool) const;
  int running_on(int pool) const;
  void publish_computed_blocks(Seq& seq);
  void update_gauges();

  std::unique_ptr<StepRunner> runner_;
  const tokenizer::BpeTokenizer* tokenizer_;
  EngineOptions options_;
  int64_t max_context_ = 0;
  EngineMetrics metrics_;

  // Shared with submit() and RequestStream::cancel().
  std::shared_ptr<RequestStream::Wake> wake_;
  std::deque<std::unique_ptr<Seq>> incoming_;  // guarded by wake_->mu
  bool stopping_ = false;                      // guarded by wake_->mu
  std::shared_ptr<Commit> commit_;             // staged weights for the engine thread; guarded by wake_->mu
  std::atomic<int64_t> queued_{0};             // incoming + waiting: the bound submit() checks
  std::atomic<bool> failed_{false};
  int64_t next_id_ = 0;                        // guarded by wake_->mu
  std::mutex update_mu_;                       // one weight update at a time

  // Engine thread only.
  std::deque<std::unique_ptr<Seq>> waiting_;
  std::vector<std::unique_ptr<Seq>> running_;  // admission order: oldest first
  // One block allocator per KV pool (RunnerLimits::kv_pools: data-parallel ranks, [TAG_SERVE_DP]).
  std::vector<std::unique_ptr<model::BlockAllocator>> pools_;
  bool prefix_caching_ = false;
  uint64_t weights_version_ = 0;  // the prefix chains' root (BlockAllocator::root_chain)
  std::vector<float> logits_;        // the step's rows, for runners that copy them (StepRunner::step_rows)
  std::vector<const float*> rows_;   // the step's rows, wherever they lie
  std::deque<std::pair<std::chrono::steady_clock::time_point, int64_t>> rate_window_;

  std::thread thread_;
};

}  // namespace moebius::server
