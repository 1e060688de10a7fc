#include "server/engine.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <future>
#include <optional>

#include "core/log.h"
#include "core/thread_pool.h"
#include "model/softmax_weights.h"
#include "tokenizer/streaming_decoder.h"

namespace moebius::server {

using Clock = std::chrono::steady_clock;

struct RequestStream::Wake {
  std::mutex mu;
  std::condition_variable cv;
  bool cancel_seen = false;  // a cancel() since the engine last looked
};

struct Engine::Seq {
  int64_t id = 0;
  std::shared_ptr<RequestStream> stream;
  EngineRequest req;
  std::vector<int32_t> tokens;  // prompt, then the generated ids
  int64_t prompt_len = 0;
  int64_t computed = 0;         // tokens[0, computed) are in the KV cache
  std::vector<int32_t> blocks;  // the block table, into pool `pool`
  int pool = 0;                 // [TAG_SERVE_DP] the KV pool (rank) holding its blocks, while it holds any
  // [TAG_PREFIX_CACHE] blocks[0, chained) are published (or an equal block is), and `chain` is the
  // prefix chain's hash after them; cached_tokens: the prefix cache's hit at first admission.
  int64_t chained = 0;
  uint64_t chain = 0;
  // False once its chain hash is ambiguous (a collision) or its KV predates a weight update:
  // it publishes nothing more until it is admitted again.
  bool publishing = true;
  int64_t cached_tokens = 0;
  std::optional<model::Sampler> sampler;
  std::optional<tokenizer::StreamingDecoder> decoder;
  StopMatcher stop;
  int64_t generated = 0;
  Clock::time_point arrival, last_token;
  bool admitted_once = false;
  // [TAG_PREFIX_CACHE_INFLIGHT] token_chains(): the chain hash after each whole block of `tokens`,
  // under weights version chains_version.
  std::vector<uint64_t> chains;
  uint64_t chains_version = 0;
  // Prompt logprobs (req.prompt_logprobs >= 0): entry i is prompt token i + 1's, filled as the
  // prompt's chunks run (again after a preemption before delivery); sent once the prompt is done.
  std::vector<GeneratedToken> prompt_lp;
  bool prompt_lp_sent = false;

  int64_t pending() const { return static_cast<int64_t>(tokens.size()) - computed; }
};

// A staged checkpoint on its way to the engine thread, and the answer coming back.
struct Engine::Commit {
  std::unique_ptr<StagedWeights> staged;
  std::promise<std::optional<int64_t>> done;  // the paused request count; nullopt: not committed
};

// ---------------------------------------------------------------------------------------------
// RequestStream
// ---------------------------------------------------------------------------------------------

uint64_t StreamListener::events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_;
}

uint64_t StreamListener::wait_for_change(uint64_t seen, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return events_ != seen; });
  return events_;
}

void StreamListener::notify() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++events_;
  }
  cv_.notify_all();
}

bool RequestStream::take(RequestUpdate* out, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto ready = [&] {
    return !pending_.text.empty() || !pending_.tokens.empty() || pending_.prompt_logprobs_ready ||
           (pending_.finished && !delivered_end_);
  };
  if (!ready()) cv_.wait_for(lock, timeout, ready);
  if (!ready()) return false;
  if (pending_.prompt_logprobs_ready) {
    out->prompt_logprobs = std::move(pending_.prompt_logprobs);
    out->prompt_logprobs_ready = true;
    pending_.prompt_logprobs.clear();
    pending_.prompt_logprobs_ready = false;
  }
  out->text += pending_.text;
  for (GeneratedToken& t : pending_.tokens) out->tokens.push_back(std::move(t));
  pending_.text.clear();
  pending_.tokens.clear();
  if (pending_.finished) {
    delivered_end_ = true;
    out->finished = true;
    out->finish_reason = pending_.finish_reason;
    out->error = pending_.error;
    out->prompt_tokens = pending_.prompt_tokens;
    out->completion_tokens = pending_.completion_tokens;
    out->cached_tokens = pending_.cached_tokens;
  }
  return true;
}

void RequestStream::cancel() {
  if (cancelled_.exchange(true)) return;
  std::lock_guard<std::mutex> lock(wake_->mu);
  wake_->cancel_seen = true;
  wake_->cv.notify_one();
}

void RequestStream::publish_prompt_logprobs(std::vector<GeneratedToken> prompt) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.prompt_logprobs = std::move(prompt);
    pending_.prompt_logprobs_ready = true;
  }
  cv_.notify_all();
  if (listener_) listener_->notify();
}

void RequestStream::publish(const std::string& text, GeneratedToken* token, bool finished, const std::string& reason,
                            const std::string& error, int64_t prompt_tokens, int64_t completion_tokens,
                            int64_t cached_tokens) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.text += text;
    if (token != nullptr) pending_.tokens.push_back(std::move(*token));
    pending_.prompt_tokens = prompt_tokens;
    pending_.completion_tokens = completion_tokens;
    pending_.cached_tokens = cached_tokens;
    if (finished) {
      pending_.finished = true;
      pending_.finish_reason = reason;
      pending_.error = error;
    }
  }
  cv_.notify_all();
  if (listener_) listener_->notify();
}

// ---------------------------------------------------------------------------------------------
// Engine
// ---------------------------------------------------------------------------------------------

Engine::Engine(std::unique_ptr<StepRunner> runner, const tokenizer::BpeTokenizer* tokenizer, EngineOptions options)
    : runner_(std::move(runner)),
      tokenizer_(tokenizer),
      options_(std::move(options)),
      wake_(std::make_shared<RequestStream::Wake>()) {
  const RunnerLimits& l = runner_->limits();
  prefix_caching_ = options_.prefix_caching && runner_->shares_kv_blocks();
  MOEBIUS_ASSERT(l.kv_pools >= 1 && l.max_seqs >= l.kv_pools, "runner limits: {} KV pools, {} sequences",
                 l.kv_pools, l.max_seqs);
  for (int p = 0; p < l.kv_pools; ++p)
    pools_.push_back(std::make_unique<model::BlockAllocator>(l.num_blocks, prefix_caching_));
  max_context_ = std::min<int64_t>(l.max_context, int64_t{l.num_blocks} * l.block_size);
  metrics_.kv_blocks_total = int64_t{l.num_blocks} * l.kv_pools;
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() { stop(); }

int Engine::vocab_size() const { return runner_->config().vocab_size; }

void Engine::stop() {
  {
    std::lock_guard<std::mutex> lock(wake_->mu);
    stopping_ = true;
  }
  wake_->cv.notify_one();
  if (thread_.joinable()) thread_.join();
}

Submitted Engine::submit(EngineRequest request) {
  std::vector<EngineRequest> one;
  one.push_back(std::move(request));
  SubmittedGroup g = submit_group(std::move(one));
  return Submitted{g.streams.empty() ? nullptr : std::move(g.streams[0]), g.queue_full, std::move(g.error)};
}

// Checks one request and builds its sequence (not yet queued); null with *error (and *param, the
// field it names) set when refused.
std::unique_ptr<Engine::Seq> Engine::make_seq(EngineRequest r, std::string* error, std::string* param) const {
  const auto refuse = [&](std::string why, std::string field) {
    *error = std::move(why);
    *param = std::move(field);
    return std::unique_ptr<Seq>();
  };
  if (r.prompt.empty()) return refuse("the prompt is empty", "prompt");
  if (r.max_tokens < 1 || static_cast<int64_t>(r.prompt.size()) + r.max_tokens > max_context_)
    return refuse("the prompt plus max_tokens exceeds the context", "max_tokens");
  for (int32_t id : r.prompt)
    if (id < 0 || id >= vocab_size())
      return refuse(fmt::format("token id {} is outside the vocabulary [0, {})", id, vocab_size()), "prompt");
  for (const auto& [id, bias] : r.sampling.logit_bias)
    if (id < 0 || id >= vocab_size())
      return refuse(fmt::format("logit_bias: token id {} is outside the vocabulary [0, {})", id, vocab_size()),
                    "logit_bias");
  for (int32_t id : r.stop_token_ids)
    if (id < 0 || id >= vocab_size())
      return refuse(fmt::format("stop_token_ids: token id {} is outside the vocabulary [0, {})", id, vocab_size()),
                    "stop_token_ids");
  if (r.prompt_logprobs >= 0 && runner_->limits().max_all_logits_rows < 1)
    return refuse("prompt logprobs are not available: this server computes no extra logits rows "
                  "(--prompt-logprob-rows 0)",
                  "prompt_logprobs");
  if (r.min_tokens < 0 || r.min_tokens > r.max_tokens)
    return refuse(fmt::format("min_tokens ({}) must be in [0, max_tokens ({})]", r.min_tokens, r.max_tokens),
                  "min_tokens");
  auto sampler = model::Sampler::create(r.sampling);
  if (!sampler.ok()) {
    // The sampler names its fields as the CLI flags: --top-p is the API's top_p.
    std::string field = sampler.error().field();
    if (field.rfind("--", 0) == 0) field.erase(0, 2);
    std::replace(field.begin(), field.end(), '-', '_');
    return refuse(sampler.error().what(), field);
  }
  auto seq = std::make_unique<Seq>();
  seq->sampler.emplace(std::move(sampler).value());
  seq->sampler->observe_prompt(r.prompt);
  seq->decoder.emplace(*tokenizer_, tokenizer::DecodeOptions{.skip_special_tokens = true});
  seq->stop = StopMatcher(r.stop, r.include_stop_str);
  seq->tokens = r.prompt;
  seq->prompt_len = static_cast<int64_t>(r.prompt.size());
  seq->req = std::move(r);
  seq->arrival = Clock::now();
  seq->stream.reset(new RequestStream(wake_, seq->req.listener));
  return seq;
}

SubmittedGroup Engine::submit_group(std::vector<EngineRequest> requests) {
  SubmittedGroup out;
  if (requests.empty()) {
    out.error = "no requests";
    return out;
  }
  std::vector<std::unique_ptr<Seq>> seqs;
  for (EngineRequest& r : requests) {
    seqs.push_back(make_seq(std::move(r), &out.error, &out.error_param));
    if (!seqs.back()) return out;
  }
  const auto n = static_cast<int64_t>(seqs.size());
  {
    std::lock_guard<std::mutex> lock(wake_->mu);
    if (stopping_ || failed_.load()) {
      out.error = "the engine is not running";
      return out;
    }
    // All or none: a group that does not fit whole is refused whole, so no part of it runs.
    if (queued_.load() + n > options_.max_queue) {
      out.queue_full = true;
      ++metrics_.requests_rejected_total;
      return out;
    }
    for (auto& seq : seqs) {
      seq->id = next_id_++;
      out.streams.push_back(seq->stream);
      incoming_.push_back(std::move(seq));
    }
    queued_ += n;
    metrics_.queue_depth = queued_.load();
  }
  wake_->cv.notify_one();
  return out;
}

WeightUpdate Engine::update_weights(const std::string& dir) {
  std::lock_guard<std::mutex> serial(update_mu_);  // staging reads what another update's commit changes
  const auto t0 = Clock::now();
  WeightUpdate out;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    out.message = std::filesystem::exists(dir, ec)
                      ? fmt::format("'{}' is not a directory; model_path names a checkpoint directory", dir)
                      : fmt::format("'{}' does not exist", dir);
    log_warn("weight update refused: {}", out.message);
    return out;
  }
  // The slow part (reading, converting, checking the whole checkpoint) runs here, on the caller's
  // thread, while the engine keeps stepping.
  auto staged = runner_->stage_weights(dir);
  if (!staged.ok()) {
    out.message = staged.error().what();
    log_warn("weight update from '{}' refused: {}", dir, out.message);
    return out;
  }
  auto commit = std::make_shared<Commit>();
  commit->staged = std::move(staged).value();
  std::future<std::optional<int64_t>> done = commit->done.get_future();
  bool posted = false;
  {
    std::lock_guard<std::mutex> lock(wake_->mu);
    if (!stopping_) {
      commit_ = commit;
      posted = true;
    }
  }
  if (!posted) {
    out.outcome = WeightUpdate::Outcome::kStopped;
    out.message = "the engine is not running";
    return out;
  }
  wake_->cv.notify_one();
  const std::optional<int64_t> paused = done.get();
  out.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!paused) {
    out.outcome = WeightUpdate::Outcome::kStopped;
    out.message = "the server shut down before the new weights were put in place; nothing changed";
    return out;
  }
  out.outcome = WeightUpdate::Outcome::kUpdated;
  out.paused_requests = *paused;
  out.message = fmt::format("Succeeded to update the model weights from '{}' in {:.2f} s.", dir, out.seconds);
  return out;
}

// Engine thread, between two steps: puts staged weights in place.
void Engine::commit_weights() {
  std::shared_ptr<Commit> c;
  {
    std::lock_guard<std::mutex> lock(wake_->mu);
    c = std::move(commit_);
    commit_.reset();
  }
  if (!c) return;
  const auto t0 = Clock::now();
  runner_->commit_weights(*c->staged);
  c->staged.reset();  // the host copy (cuda) goes now, not when the caller wakes
  // [TAG_PREFIX_CACHE] Cached KV was computed with the old weights: new sequences start new
  // chains (running ones keep theirs, on the KV they have, as they keep their tokens).
  ++weights_version_;
  for (auto& p : pools_) p->clear_prefix_cache();
  for (auto& s : running_) s->publishing = false;  // their chains are the old weights'; they hold KV

  const int64_t paused = static_cast<int64_t>(running_.size() + waiting_.size());
  ++metrics_.weight_updates_total;
  log_info("weights updated ({:.3f} s with the engine paused; requests in flight, which continue on them: {})",
           std::chrono::duration<double>(Clock::now() - t0).count(), paused);
  c->done.set_value(paused);
}

// Moves submitted requests into `waiting_`. With `block`, sleeps until there is something to do.
// Returns false when the engine is stopping.
bool Engine::take_incoming(bool block) {
  std::unique_lock<std::mutex> lock(wake_->mu);
  if (block)
    wake_->cv.wait(lock, [&] { return stopping_ || !incoming_.empty() || wake_->cancel_seen || commit_ != nullptr; });
  wake_->cancel_seen = false;
  while (!incoming_.empty()) {
    waiting_.push_back(std::move(incoming_.front()));
    incoming_.pop_front();
  }
  return !stopping_;
}

void Engine::release_kv(Seq& seq) {
  if (!seq.blocks.empty()) pools_[static_cast<size_t>(seq.pool)]->release(seq.blocks);
  runner_->release(seq.id);
  seq.computed = 0;
  seq.chained = 0;
}

// [TAG_PREFIX_CACHE] A sequence about to be admitted on `pool` with nothing in the cache: take the
// pool's cached blocks of its longest whole-block prefix, short of its last token (whose logits
// the step must produce), and start computing after them.
void Engine::start_from_prefix_cache(Seq& s, int pool) {
  MOEBIUS_ASSERT(s.blocks.empty() && s.computed == 0, "sequence {} already holds KV", s.id);
  s.pool = pool;
  s.chain = model::BlockAllocator::root_chain(weights_version_);
  s.chained = 0;
  s.publishing = true;
  // Prompt logprobs need every prompt token's logits: nothing of the prompt may be skipped.
  if (!prefix_caching_ || needs_prompt_logits(s)) return;
  const int bs = runner_->limits().block_size;
  const std::span<const int32_t> lookup = std::span<const int32_t>(s.tokens).first(s.tokens.size() - 1);
  const model::BlockAllocator::PrefixMatch m =
      pools_[static_cast<size_t>(pool)]->match_prefix(s.chain, lookup, bs, s.blocks, token_chains(s));
  s.chain = m.chain;
  s.chained = m.blocks;
  s.computed = m.blocks * bs;
}

// [TAG_PREFIX_CACHE] After a step: publish the sequence's blocks that are now whole and computed.
void Engine::publish_computed_blocks(Seq& s) {
  if (!prefix_caching_ || !s.publishing) return;
  const int bs = runner_->limits().block_size;
  for (const int64_t whole = s.computed / bs; s.chained < whole; ++s.chained) {
    const auto tokens = std::span<const int32_t>(s.tokens).subspan(static_cast<size_t>(s.chained * bs),
                                                                   static_cast<size_t>(bs));
    const std::optional<uint64_t> next =
        pools_[static_cast<size_t>(s.pool)]->publish(s.blocks[static_cast<size_t>(s.chained)], s.chain, tokens);
    if (!next) {
      s.publishing = false;
      return;
    }
    s.chain = *next;
  }
}

void Engine::update_gauges() {
  metrics_.running = static_cast<int64_t>(running_.size());
  metrics_.queue_depth = queued_.load();
  int64_t used = 0, cached = 0;
  for (const auto& p : pools_) {
    used += p->num_used();
    cached += p->num_cached();
  }
  metrics_.kv_blocks_used = used;
  metrics_.kv_blocks_cached = cached;
  if (pools_.size() > 1) {
    std::vector<int> per_rank(pools_.size());
    for (size_t p = 0; p < pools_.size(); ++p) per_rank[p] = running_on(static_cast<int>(p));
    metrics_.set_dp_rank_sequences(std::move(per_rank));
  }
}

void Engine::drop_cancelled() {
  for (size_t i = 0; i < running_.size();) {
    if (running_[i]->stream->cancelled()) {
      release_kv(*running_[i]);
      ++metrics_.requests_cancelled_total;
      running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
  for (size_t i = 0; i < waiting_.size();) {
    if (waiting_[i]->stream->cancelled()) {
      release_kv(*waiting_[i]);  // holds nothing unless preempted mid-way; cheap either way
      ++metrics_.requests_cancelled_total;
      --queued_;
      waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
  update_gauges();
}

void Engine::preempt(size_t i) {
  std::unique_ptr<Seq> seq = std::move(running_[i]);
  running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
  release_kv(*seq);  // [TAG_SERVE_RECOMPUTE] computed = 0: everything is recomputed on readmission
  ++metrics_.preemptions_total;
  ++queued_;
  waiting_.push_front(std::move(seq));
}

void Engine::schedule(std::vector<Seq*>& batch, std::vector<int>& chunk) {
  const RunnerLimits& l = runner_->limits();
  int64_t budget = l.max_step_tokens;
  // Prompt logprobs: the rows of every-token logits each pool may still compute this step (a
  // prompt's chunk is capped by its pool's; the runner holds that many rows per rank).
  std::vector<int64_t> spare(pools_.size(), l.max_all_logits_rows);
  // Running sequences, oldest first; a block shortage preempts the newest sequence of the same
  // pool (its blocks are the only ones that can help).
  for (size_t i = 0; i < running_.size() && budget > 0 && static_cast<int>(batch.size()) < l.max_seqs;) {
    Seq& s = *running_[i];
    int64_t n = std::min(s.pending(), budget);
    const bool rows = needs_prompt_logits(s);
    if (rows) n = std::min(n, spare[static_cast<size_t>(s.pool)]);
    if (n == 0) {  // its pool's logits rows are taken: it continues next step
      ++i;
      continue;
    }
    model::BlockAllocator& pool = *pools_[static_cast<size_t>(s.pool)];
    bool preempted_self = false;
    while (!pool.ensure(s.blocks, s.computed + n, l.block_size).ok()) {
      size_t victim = running_.size() - 1;
      while (running_[victim]->pool != s.pool) --victim;  // stops at i at the latest
      preempted_self = victim == i;
      preempt(victim);
      if (preempted_self) break;
    }
    if (preempted_self) continue;  // running_[i] is now the next sequence
    batch.push_back(&s);
    chunk.push_back(static_cast<int>(n));
    budget -= n;
    if (rows) spare[static_cast<size_t>(s.pool)] -= n;
    ++i;
  }
  // [TAG_PREFIX_CACHE_INFLIGHT] The blocks running sequences are computing and will publish: a
  // waiting sequence whose next uncached block is among them waits for it rather than computing
  // it again (n choices of one prompt, requests arriving together with one system prompt).
  // Sequences admitted in this step count too: they compute their blocks in it. Keyed by pool:
  // a block computed on one data-parallel rank serves only sequences placed on that rank.
  std::unordered_set<uint64_t> inflight;
  const auto computing = [&](Seq& r) {
    if (!prefix_caching_ || !r.publishing) return;
    const std::vector<uint64_t>& chains = token_chains(r);
    for (size_t j = static_cast<size_t>(r.chained); j < chains.size(); ++j)
      inflight.insert(inflight_key(r.pool, chains[j]));
  };
  if (!waiting_.empty())
    for (const auto& r : running_) computing(*r);
  // Admission, in arrival order (preempted sequences went back to the front) except for those
  // waiting on an in-flight prefix, while the chunk's blocks can be had without preempting
  // anyone, on the first pool in admission_order() where they can.
  for (size_t w = 0; w < waiting_.size() && budget > 0 && static_cast<int>(batch.size()) < l.max_seqs &&
                     static_cast<int>(running_.size()) < l.max_seqs;) {
    Seq& s = *waiting_[w];
    const std::vector<PoolPrefix> prefixes = pool_prefixes(s);
    // (A sequence that needs its prompt's logprobs computes its whole prompt: it never waits.)
    if (!inflight.empty() && !needs_prompt_logits(s) && prefix_in_flight(s, prefixes, inflight)) {
      ++metrics_.prefix_cache_waits_total;
      ++w;
      continue;
    }
    const int64_t budget_left = budget;
    bool placed = false, rows_short = false, blocks_short = false;
    int64_t n = 0;
    for (int pool : admission_order(prefixes)) {
      // A prompt scored for its logprobs needs logits rows on the pool: none left there this step.
      if (needs_prompt_logits(s) && spare[static_cast<size_t>(pool)] == 0) {
        rows_short = true;
        continue;
      }
      start_from_prefix_cache(s, pool);
      n = std::min(s.pending(), budget_left);
      if (needs_prompt_logits(s)) n = std::min(n, spare[static_cast<size_t>(pool)]);
      if (pools_[static_cast<size_t>(pool)]->ensure(s.blocks, s.computed + n, l.block_size).ok()) {
        placed = true;
        break;
      }
      blocks_short = true;
      release_kv(s);  // the cached prefix it took on that pool
    }
    // Only the logits rows were short: later arrivals may run meanwhile (it goes first next step).
    // Short of blocks, admission stops here as for any sequence, so arrival order holds.
    if (!placed && rows_short && !blocks_short) {
      ++w;
      continue;
    }
    if (!placed) break;
    if (needs_prompt_logits(s)) spare[static_cast<size_t>(s.pool)] -= n;
    if (prefix_caching_) {
      metrics_.prefix_cache_queries_total += static_cast<int64_t>(s.tokens.size());
      metrics_.prefix_cache_hits_total += s.computed;
    }
    if (!s.admitted_once) {
      s.admitted_once = true;
      s.cached_tokens = s.computed;
      metrics_.prompt_tokens_total += s.prompt_len;
    }
    computing(s);
    running_.push_back(std::move(waiting_[w]));
    waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(w));
    --queued_;
    batch.push_back(&s);
    chunk.push_back(static_cast<int>(n));
    budget -= n;
  }
}

const std::vector<uint64_t>& Engine::token_chains(Seq& s) const {
  if (s.chains_version != weights_version_) {
    s.chains.clear();
    s.chains_version = weights_version_;
  }
  const size_t bs = static_cast<size_t>(runner_->limits().block_size);
  for (size_t j = s.chains.size(); j < s.tokens.size() / bs; ++j)
    s.chains.push_back(model::BlockAllocator::chain_hash(
        j == 0 ? model::BlockAllocator::root_chain(weights_version_) : s.chains[j - 1],
        std::span<const int32_t>(s.tokens).subspan(j * bs, bs)));
  return s.chains;
}

uint64_t Engine::inflight_key(int pool, uint64_t chain) { return chain ^ (0x9E3779B97F4A7C15ull * (pool + 1u)); }

// The pools a waiting sequence may be placed on (those with room, [TAG_SERVE_DP]) and the blocks of
// its longest cached prefix on each (0 without prefix caching), walked once per sequence and step:
// the in-flight wait and the admission order read the same walk.
std::vector<Engine::PoolPrefix> Engine::pool_prefixes(Seq& s) const {
  const int bs = runner_->limits().block_size;
  const std::span<const int32_t> lookup = std::span<const int32_t>(s.tokens).first(s.tokens.size() - 1);
  const uint64_t root = model::BlockAllocator::root_chain(weights_version_);
  std::vector<PoolPrefix> out;
  for (int p = 0; p < static_cast<int>(pools_.size()); ++p) {
    if (!pool_has_room(p)) continue;
    out.push_back({p, prefix_caching_ ? pools_[static_cast<size_t>(p)]->cached_prefix_blocks(root, lookup, bs,
                                                                                             token_chains(s))
                                      : 0});
  }
  return out;
}

// The sequence waits when the best cached prefix it could be placed behind is followed by a block
// in flight on that same pool.
bool Engine::prefix_in_flight(Seq& s, const std::vector<PoolPrefix>& prefixes,
                              const std::unordered_set<uint64_t>& inflight) const {
  const int bs = runner_->limits().block_size;
  const int64_t lookup_blocks = (static_cast<int64_t>(s.tokens.size()) - 1) / bs;  // short of the last token
  if (lookup_blocks <= 0) return false;
  int64_t best = -1;
  for (const PoolPrefix& p : prefixes) best = std::max(best, p.cached_blocks);
  if (best < 0 || best >= lookup_blocks) return false;
  const uint64_t next = token_chains(s)[static_cast<size_t>(best)];
  for (const PoolPrefix& p : prefixes)
    if (p.cached_blocks == best && inflight.count(inflight_key(p.pool, next)) > 0) return true;
  return false;
}

bool Engine::pool_has_room(int pool) const {
  const RunnerLimits& l = runner_->limits();
  return running_on(pool) < l.max_seqs / l.kv_pools + (pool < l.max_seqs % l.kv_pools ? 1 : 0);
}

int Engine::running_on(int pool) const {
  int n = 0;
  for (const auto& s : running_) n += s->pool == pool ? 1 : 0;
  return n;
}

// [TAG_SERVE_DP] The pools a waiting sequence may be admitted on, best first: those running fewer
// sequences than their share of max_seqs (max_seqs / kv_pools, the remainder spread over the first
// pools), ordered by the longest cached prefix of its tokens (its
// own, after a preemption, or a shared prompt's: cache-aware placement), then the fewest running
// sequences, then the most free blocks, then the lowest pool.
std::vector<int> Engine::admission_order(const std::vector<PoolPrefix>& prefixes) const {
  struct Option {
    int pool;
    int64_t cached_blocks;
    int running;
    int32_t free;
  };
  std::vector<Option> options;
  for (const PoolPrefix& p : prefixes)
    options.push_back({p.pool, p.cached_blocks, running_on(p.pool), pools_[static_cast<size_t>(p.pool)]->num_free()});
  std::sort(options.begin(), options.end(), [](const Option& a, const Option& b) {
    if (a.cached_blocks != b.cached_blocks) return a.cached_blocks > b.cached_blocks;
    if (a.running != b.running) return a.running < b.running;
    if (a.free != b.free) return a.free > b.free;
    return a.pool < b.pool;
  });
  std::vector<int> order;
  for (const Option& o : options) order.push_back(o.pool);
  return order;
}

void Engine::run_step(const std::vector<Seq*>& batch, const std::vector<int>& chunk) {
  std::vector<RunnerSeq> seqs(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    Seq& s = *batch[i];
    RunnerSeq& r = seqs[i];
    r.id = s.id;
    r.tokens = std::span<const int32_t>(s.tokens).subspan(static_cast<size_t>(s.computed), static_cast<size_t>(chunk[i]));
    r.start = s.computed;
    r.block_table = s.blocks;
    r.pool = s.pool;
    // The step writes rows [computed, computed + chunk): their blocks must be this sequence's alone
    // (a shared block is whole and computed, [TAG_PREFIX_CACHE]).
    const int bs = runner_->limits().block_size;
    for (int64_t b = s.computed / bs; b <= (s.computed + chunk[i] - 1) / bs; ++b)
      MOEBIUS_ASSERT(pools_[static_cast<size_t>(s.pool)]->holders(s.blocks[static_cast<size_t>(b)]) == 1,
                     "sequence {} would write block {}, which {} tables hold", s.id, s.blocks[static_cast<size_t>(b)],
                     pools_[static_cast<size_t>(s.pool)]->holders(s.blocks[static_cast<size_t>(b)]));
    r.want_logits = s.computed + chunk[i] == static_cast<int64_t>(s.tokens.size());
    r.all_logits = needs_prompt_logits(s);
  }
  Status st = runner_->step_rows(seqs, logits_, rows_);
  ++metrics_.steps_total;
  if (const std::optional<offload::ModelCacheStats> c = runner_->expert_cache_stats()) {
    metrics_.expert_cache_on = true;
    metrics_.expert_cache_routed_pairs_total = static_cast<int64_t>(c->routed_pairs);
    metrics_.expert_cache_resident_pairs_total = static_cast<int64_t>(c->resident_pairs);
    metrics_.expert_cache_swaps_total = static_cast<int64_t>(c->swaps);
    metrics_.expert_cache_swap_bytes_total = static_cast<int64_t>(c->swap_bytes);
  }
  if (!st.ok()) {
    log_error("engine step failed: {}", st.error().what());
    for (Seq* s : batch) finish(*s, "", "the model step failed: " + st.error().what());
    if (runner_->failed()) {
      // The runner cannot step again (cpu --ep: its ranks stopped): stop serving, /health says so.
      log_error("the model runner cannot run another step; the engine stops");
      failed_ = true;
    }
    return;
  }
  size_t row = 0;
  std::vector<std::pair<Seq*, const float*>> next;  // the sequences that get a token, and its row
  for (size_t i = 0; i < batch.size(); ++i) {
    Seq& s = *batch[i];
    const int64_t first = s.computed;
    s.computed += chunk[i];
    publish_computed_blocks(s);  // before on_token, which may finish s and release its blocks
    if (seqs[i].all_logits) {  // a row per token; the last is also the next token's when the prompt ends
      on_prompt_rows(s, first, chunk[i], std::span<const float* const>(rows_).subspan(row, static_cast<size_t>(chunk[i])));
      row += static_cast<size_t>(chunk[i]);
      if (seqs[i].want_logits) next.emplace_back(&s, rows_[row - 1]);
    } else if (seqs[i].want_logits) {
      next.emplace_back(&s, rows_[row++]);
    }
  }
  // The draws touch only their own sequence's sampler and row, so they run on the pool's threads;
  // a row costs ~0.1-1 ms (docs/PERF.md), a decode step of 64 sequences tens of ms on one thread.
  // What they lead to (the stream, the metrics, finishing) stays on the engine thread, in order.
  std::vector<Draw> draws(next.size());
  const auto draw_one = [&](int64_t j) {
    draws[static_cast<size_t>(j)] = draw(*next[static_cast<size_t>(j)].first, next[static_cast<size_t>(j)].second);
  };
  ThreadPool::global().parallel_for(0, static_cast<int64_t>(next.size()), draw_one);
  for (size_t j = 0; j < next.size(); ++j) on_token(*next[j].first, std::move(draws[j]));
}

bool Engine::needs_prompt_logits(const Seq& s) { return s.req.prompt_logprobs >= 0 && !s.prompt_lp_sent; }

namespace {

// log-softmax of the chosen id, its rank (1 + the ids with a larger logit) and the k most likely
// ids (ties: the smaller id first), from the raw logits. Passes over V (the maximum and the rank,
// the softmax sum 8 ids a step: model/softmax_weights.h) plus a k-entry insertion list: a
// prompt's logprobs run this once per prompt token.
GeneratedToken token_logprobs(const float* logits, size_t V, int32_t id, int k) {
  float mx = -INFINITY;
  int64_t above = 0;
  const float chosen = logits[id];
  for (size_t i = 0; i < V; ++i) {
    mx = std::max(mx, logits[i]);
    above += logits[i] > chosen ? 1 : 0;
  }
  const double lse = mx + std::log(model::exp_weight_sum(std::span<const float>(logits, V), 1.0f, mx));
  GeneratedToken t;
  t.id = id;
  t.logprob = static_cast<float>(logits[id] - lse);
  t.rank = above + 1;
  const size_t kk = std::min<size_t>(static_cast<size_t>(std::max(k, 0)), V);
  if (kk > 0) {
    std::vector<int32_t> best;  // descending logit, ascending id among equals
    best.reserve(kk + 1);
    for (size_t i = 0; i < V; ++i) {
      const float v = logits[i];
      if (best.size() == kk && !(v > logits[best.back()])) continue;
      size_t at = best.size();
      while (at > 0 && v > logits[best[at - 1]]) --at;
      best.insert(best.begin() + static_cast<std::ptrdiff_t>(at), static_cast<int32_t>(i));
      if (best.size() > kk) best.pop_back();
    }
    for (int32_t b : best) t.top.emplace_back(b, static_cast<float>(logits[b] - lse));
  }
  return t;
}

}  // namespace

// Rows [first, first + count) of a prompt's all-logits chunk: row j predicts token first + j + 1.
// The prompt's logprobs are delivered when its last chunk has run. The chunk's rows are scored on
// the thread pool while the engine thread waits: the next step cannot start before they are
// scored anyway (the rows live in the runner's or the engine's buffer until then).
void Engine::on_prompt_rows(Seq& s, int64_t first, int64_t count, std::span<const float* const> rows) {
  const size_t V = static_cast<size_t>(vocab_size());
  const int64_t P = s.prompt_len;
  s.prompt_lp.resize(static_cast<size_t>(P - 1));
  const int64_t scored = std::max<int64_t>(0, std::min(count, P - 1 - first));  // rows with a next prompt token
  // A row costs ~0.4-0.7 ms (docs/PERF.md): the rows run on the pool's threads.
  const auto score = [&](int64_t j) {
    s.prompt_lp[static_cast<size_t>(first + j)] = token_logprobs(
        rows[static_cast<size_t>(j)], V, s.tokens[static_cast<size_t>(first + j + 1)], s.req.prompt_logprobs);
  };
  ThreadPool::global().parallel_for(0, scored, score);
  if (first + count >= P) {
    s.stream->publish_prompt_logprobs(std::move(s.prompt_lp));
    s.prompt_lp.clear();
    s.prompt_lp_sent = true;
  }
}

void Engine::emit(Seq& s, const std::string& text, GeneratedToken* token) {
  s.stream->publish(text, token, false, "", "", s.prompt_len, s.generated, s.cached_tokens);
}

// The token of `s` from its logits row, and its logprobs when the request wants them. Runs on a
// pool thread: it reads the sequence's request and counters and advances only its sampler.
Engine::Draw Engine::draw(Seq& s, const float* logits) const {
  const size_t V = static_cast<size_t>(vocab_size());
  const std::vector<int32_t>& eos = options_.eos_ids;
  const std::vector<int32_t>& stop_ids = s.req.stop_token_ids;
  // Before min_tokens the ids that would end the sequence cannot be sampled (vLLM's min_tokens);
  // the logprobs stay the model's.
  const bool early = s.generated < s.req.min_tokens;
  std::span<const float> row(logits, V);
  thread_local std::vector<float> masked;
  if (early && ((!s.req.ignore_eos && !eos.empty()) || !stop_ids.empty())) {
    masked.assign(logits, logits + V);
    if (!s.req.ignore_eos)
      for (int32_t id : eos)
        if (id >= 0 && static_cast<size_t>(id) < V) masked[static_cast<size_t>(id)] = -INFINITY;
    for (int32_t id : stop_ids) masked[static_cast<size_t>(id)] = -INFINITY;
    row = masked;
  }
  Draw d;
  Result<int32_t> sampled = s.sampler->sample(row);
  if (!sampled.ok()) {
    d.error = sampled.error().what();
    return d;
  }
  d.id = *sampled;
  if (s.req.top_logprobs >= 0) d.logprobs = token_logprobs(logits, V, d.id, s.req.top_logprobs);
  return d;
}

void Engine::on_token(Seq& s, Draw d) {
  const std::vector<int32_t>& eos = options_.eos_ids;
  const std::vector<int32_t>& stop_ids = s.req.stop_token_ids;
  if (d.id < 0) {
    finish(s, "", "sampling failed: " + d.error);
    return;
  }
  const int32_t id = d.id;
  const auto now = Clock::now();
  const double since = std::chrono::duration<double>(now - (s.generated == 0 ? s.arrival : s.last_token)).count();
  (s.generated == 0 ? metrics_.ttft : metrics_.itl).observe(since);
  s.last_token = now;
  if ((!s.req.ignore_eos && std::find(eos.begin(), eos.end(), id) != eos.end()) ||
      std::find(stop_ids.begin(), stop_ids.end(), id) != stop_ids.end()) {
    finish(s, "stop", "");
    return;
  }
  s.tokens.push_back(id);
  ++s.generated;
  ++metrics_.generation_tokens_total;
  std::string text = s.decoder->feed(static_cast<tokenizer::TokenId>(id));
  StopMatcher::Out out = match_stops(s, text);
  emit(s, out.text, d.logprobs ? &*d.logprobs : nullptr);
  if (out.stopped) finish(s, "stop", "");
  else if (s.generated >= s.req.max_tokens || static_cast<int64_t>(s.tokens.size()) >= max_context_)
    finish(s, "length", "");
}

// Stop strings apply to the text of the tokens after the first min_tokens (vLLM's rule: a stop
// string wholly inside the first min_tokens tokens' text is not a stop, one that completes after
// them is, even when it began inside them).
StopMatcher::Out Engine::match_stops(Seq& s, std::string_view text) {
  return s.generated <= s.req.min_tokens ? s.stop.feed_unchecked(text) : s.stop.feed(text);
}

// Ends `s`: flushes held-back text (unless an error ended it), frees its KV, tells the client.
// The sequence is removed from running_ by the caller's sweep (finished sequences have no stream
// left to serve: `stream` is reset).
void Engine::finish(Seq& s, const std::string& reason, const std::string& error) {
  std::string tail;
  std::string why = reason;
  if (error.empty() && !s.stop.stopped()) {
    StopMatcher::Out out = match_stops(s, s.decoder->flush());
    tail = out.text;
    if (out.stopped) why = "stop";
    else tail += s.stop.flush();
  }
  if (error.empty()) ++metrics_.requests_finished_total;
  else ++metrics_.requests_failed_total;
  metrics_.e2e.observe(std::chrono::duration<double>(Clock::now() - s.arrival).count());
  s.stream->publish(tail, nullptr, true, why, error, s.prompt_len, s.generated, s.cached_tokens);
  release_kv(s);
  s.stream.reset();
}

void Engine::loop() {
  bool ok = true;
  while (ok) {
    const bool idle = running_.empty() && waiting_.empty();
    ok = take_incoming(idle);
    if (!ok) break;
    commit_weights();
    drop_cancelled();
    std::vector<Seq*> batch;
    std::vector<int> chunk;
    schedule(batch, chunk);
    if (!batch.empty()) run_step(batch, chunk);
    if (failed_.load()) break;
    std::erase_if(running_, [](const std::unique_ptr<Seq>& s) { return s->stream == nullptr; });
    update_gauges();
    // Tokens per second over a sliding 5 s window.
    const auto now = Clock::now();
    rate_window_.emplace_back(now, metrics_.generation_tokens_total.load());
    while (rate_window_.size() > 1 && now - rate_window_.front().first > std::chrono::seconds(5))
      rate_window_.pop_front();
    const double span = std::chrono::duration<double>(now - rate_window_.front().first).count();
    metrics_.generation_tokens_per_second =
        span > 0 ? static_cast<double>(rate_window_.back().second - rate_window_.front().second) / span : 0.0;
  }
  // Shutting down: whatever is left ends with an error, so no client waits forever.
  std::lock_guard<std::mutex> lock(wake_->mu);
  if (commit_) {
    commit_->done.set_value(std::nullopt);
    commit_.reset();
  }
  for (auto& s : incoming_) waiting_.push_back(std::move(s));
  incoming_.clear();
  const char* why = failed_.load() ? "the model runner failed" : "the server is shutting down";
  for (auto& s : running_)
    if (s->stream) finish(*s, "", why);
  for (auto& s : waiting_)
    if (s->stream) finish(*s, "", why);
  running_.clear();
  waiting_.clear();
  queued_ = 0;
  update_gauges();
}

}  // namespace moebius::server
