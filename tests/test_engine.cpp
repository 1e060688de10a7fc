// The continuous-batching engine (server/engine.h) on the CPU runner with the tiny Qwen3-MoE
// fixture: every request's tokens equal the one-sequence generate loop's, whatever else runs in
// the same steps (chunked prefill mixed with decode, preemption with recompute), cancel frees
// KV, the queue bound holds, stop strings cut the text.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "model/generate.h"
#include "server/engine.h"
#include "serve_test_util.h"
#include "test_util.h"
#include "tiny_fixture.h"
#include "fixture_copy.h"

namespace moebius::server {
namespace {

using namespace std::chrono_literals;

const tokenizer::BpeTokenizer& tiny_tokenizer() { return testing::tiny_serve_tokenizer(); }

// The one-sequence reference: model::generate, greedy unless `params` say otherwise, no eos.
std::vector<int32_t> reference_ids(const std::vector<int32_t>& prompt, int max_tokens,
                                   const model::SamplerParams& params = {.temperature = 0.0f}) {
  static model::Qwen3MoeCpu* m = [] {
    auto r = model::Qwen3MoeCpu::load(testing::tiny_fixture_dir());
    EXPECT_TRUE(r.ok()) << r.error().what();
    return new model::Qwen3MoeCpu(std::move(r).value());
  }();
  auto sampler = model::Sampler::create(params);
  EXPECT_TRUE(sampler.ok()) << sampler.error().what();
  sampler->observe_prompt(prompt);
  auto stats = model::generate(*m, prompt, max_tokens, *sampler, {}, nullptr);
  EXPECT_TRUE(stats.ok()) << stats.error().what();
  return stats->generated;
}

// The tiny fixture's CPU runner, for tests that wrap it in a runner of their own.
std::unique_ptr<StepRunner> tiny_runner(int max_seqs, int max_step_tokens, int32_t num_blocks = 0, int block_size = 16,
                                        int ep = 1) {
  RunnerOptions o;
  o.source.model_dir = testing::tiny_fixture_dir();
  o.max_seqs = max_seqs;
  o.max_step_tokens = max_step_tokens;
  o.num_blocks = num_blocks;
  o.block_size = block_size;
  o.ep = ep;
  auto runner = load_runner(o);
  EXPECT_TRUE(runner.ok()) << runner.error().what();
  return runner.ok() ? std::move(runner).value() : nullptr;
}

std::unique_ptr<Engine> make_engine(int max_seqs, int max_step_tokens, int32_t num_blocks = 0, int block_size = 16,
                                    int max_queue = 256, int ep = 1) {
  return std::make_unique<Engine>(tiny_runner(max_seqs, max_step_tokens, num_blocks, block_size, ep), &tiny_tokenizer(),
                                  EngineOptions{max_queue, {}});
}

EngineRequest greedy(const std::vector<int32_t>& prompt, int max_tokens) {
  EngineRequest r;
  r.prompt = prompt;
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0.0f;
  r.top_logprobs = 0;  // so the update carries the ids
  return r;
}

using testing::drain;

std::vector<int32_t> ids_of(const RequestUpdate& u) {
  std::vector<int32_t> ids;
  for (const GeneratedToken& t : u.tokens) ids.push_back(t.id);
  return ids;
}

std::vector<int32_t> prompt_for(int i) {
  std::vector<int32_t> p;
  for (int k = 0; k < 3 + (i * 7) % 17; ++k) p.push_back((i * 31 + k * 13) % 500 + 5);
  return p;
}

void wait_for_idle(Engine& e) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while ((e.metrics().running.load() > 0 || e.metrics().kv_blocks_used.load() > 0) &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(5ms);
}

// /metrics carries the dynamic expert cache's counts only when the runner has a cache; the hit
// ratio is resident / routed pairs.
TEST(EngineMetrics, ExpertCacheRenderedOnlyWhenOn) {
  EngineMetrics m;
  EXPECT_EQ(m.render().find("expert_cache"), std::string::npos);
  m.expert_cache_on = true;
  m.expert_cache_routed_pairs_total = 400;
  m.expert_cache_resident_pairs_total = 300;
  m.expert_cache_swaps_total = 7;
  m.expert_cache_swap_bytes_total = 7000;
  const std::string r = m.render();
  EXPECT_NE(r.find("moebius_expert_cache_routed_pairs_total 400\n"), std::string::npos) << r;
  EXPECT_NE(r.find("moebius_expert_cache_resident_pairs_total 300\n"), std::string::npos) << r;
  EXPECT_NE(r.find("moebius_expert_cache_hit_ratio 0.75\n"), std::string::npos) << r;
  EXPECT_NE(r.find("moebius_expert_cache_swaps_total 7\n"), std::string::npos) << r;
  EXPECT_NE(r.find("moebius_expert_cache_swap_bytes_total 7000\n"), std::string::npos) << r;
  EXPECT_NE(r.find("# TYPE moebius_expert_cache_hit_ratio gauge"), std::string::npos) << r;
}

// [TAG_SERVE_DP] The per-rank sequence counts of a data-parallel runner, only when it has ranks.
TEST(EngineMetrics, DpRankSequencesRenderedOnlyWhenSet) {
  EngineMetrics m;
  EXPECT_EQ(m.render().find("dp_rank_sequences"), std::string::npos);
  m.set_dp_rank_sequences({3, 0, 2});
  const std::string r = m.render();
  EXPECT_NE(r.find("# TYPE moebius_dp_rank_sequences gauge\n"), std::string::npos) << r;
  EXPECT_NE(r.find("moebius_dp_rank_sequences{rank=\"0\"} 3\n"), std::string::npos) << r;
  EXPECT_NE(r.find("moebius_dp_rank_sequences{rank=\"1\"} 0\n"), std::string::npos) << r;
  EXPECT_NE(r.find("moebius_dp_rank_sequences{rank=\"2\"} 2\n"), std::string::npos) << r;
}

TEST(Engine, OneRequestMatchesGenerate) {
  auto engine = make_engine(4, 64);
  const auto prompt = prompt_for(3);
  Submitted s = engine->submit(greedy(prompt, 12));
  ASSERT_TRUE(s.stream);
  RequestUpdate u = drain(*s.stream);
  EXPECT_EQ(u.error, "");
  EXPECT_EQ(u.finish_reason, "length");
  EXPECT_EQ(ids_of(u), reference_ids(prompt, 12));
  EXPECT_EQ(u.prompt_tokens, static_cast<int64_t>(prompt.size()));
  EXPECT_EQ(u.completion_tokens, 12);
  for (const GeneratedToken& t : u.tokens) EXPECT_LE(t.logprob, 0.0f);
}

// Submits `n` greedy requests at once (request i: prompt_for(i), first_len + i tokens), checks
// each against the one-sequence reference, then that the engine goes idle with no KV in use.
void expect_concurrent_requests_match_solo(Engine& engine, int n, int first_len) {
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < n; ++i) {
    Submitted s = engine.submit(greedy(prompt_for(i), first_len + i));
    ASSERT_TRUE(s.stream);
    streams.push_back(s.stream);
  }
  for (int i = 0; i < n; ++i) {
    RequestUpdate u = drain(*streams[static_cast<size_t>(i)]);
    EXPECT_EQ(ids_of(u), reference_ids(prompt_for(i), first_len + i)) << "request " << i;
  }
  wait_for_idle(engine);
  EXPECT_EQ(engine.metrics().kv_blocks_used.load(), 0);
}

// Chunked prefill (8-token budget) mixed with decodes, 3 sequences a step, 10 requests at once.
TEST(Engine, ConcurrentRequestsMatchSolo) {
  auto engine = make_engine(3, 8);
  expect_concurrent_requests_match_solo(*engine, 10, 4);
}

// [TAG_SERVE_DP] The same over `--ep 2` (data parallel): 2 sequences a step on each rank, the
// requests' tokens equal the solo ones, the ranks hand their sequences back, KV returns to zero.
TEST(Engine, DataParallelRequestsMatchSolo) {
  auto engine = make_engine(2, 8, 0, 16, 256, 2);
  EXPECT_EQ(engine->limits().max_seqs, 4);
  expect_concurrent_requests_match_solo(*engine, 8, 3);
  EXPECT_EQ(engine->metrics().dp_rank_sequences(), (std::vector<int>{0, 0}));
}

// A runner that fails its third step and then reports that it cannot step again: the engine
// fails that step's requests and every queued one, stops (alive() false: /health answers 503) and
// refuses new requests.
class FailingRunner final : public testing::ForwardingRunner {
 public:
  using ForwardingRunner::ForwardingRunner;
  std::string describe() const override { return "failing"; }
  Status step(std::span<const RunnerSeq> seqs, std::vector<float>& logits) override {
    if (++steps_ >= 3) {
      broken_ = true;
      return Error("the ranks stopped");
    }
    return ForwardingRunner::step(seqs, logits);
  }
  bool failed() const override { return broken_; }

 private:
  int steps_ = 0;
  bool broken_ = false;
};

TEST(Engine, AFailedRunnerStopsTheEngine) {
  auto inner = tiny_runner(1, 64);
  ASSERT_TRUE(inner);
  Engine engine(std::make_unique<FailingRunner>(std::move(inner)), &tiny_tokenizer(), EngineOptions{256, {}});
  Submitted a = engine.submit(greedy(prompt_for(1), 10));
  Submitted b = engine.submit(greedy(prompt_for(2), 10));  // waits behind a (one sequence a step)
  ASSERT_TRUE(a.stream && b.stream);
  RequestUpdate ua = drain(*a.stream), ub = drain(*b.stream);
  EXPECT_NE(ua.error.find("the model step failed: the ranks stopped"), std::string::npos) << ua.error;
  EXPECT_EQ(ub.error, "the model runner failed");
  EXPECT_FALSE(engine.alive());
  Submitted c = engine.submit(greedy(prompt_for(3), 2));
  EXPECT_FALSE(c.stream);
  EXPECT_EQ(c.error, "the engine is not running");
}

// A pool of 12 blocks of 4 tokens (48 tokens) for 6 requests of up to 40 tokens each: running
// sequences must be preempted and recomputed, and still give the solo tokens.
TEST(Engine, PreemptionRecomputesExactly) {
  auto engine = make_engine(6, 64, 12, 4);
  EXPECT_EQ(engine->max_context(), 48);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 6; ++i) streams.push_back(engine->submit(greedy(prompt_for(i), 20)).stream);
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(streams[static_cast<size_t>(i)]);
    RequestUpdate u = drain(*streams[static_cast<size_t>(i)]);
    EXPECT_EQ(ids_of(u), reference_ids(prompt_for(i), 20)) << "request " << i;
  }
  EXPECT_GT(engine->metrics().preemptions_total.load(), 0);
  wait_for_idle(*engine);
  EXPECT_EQ(engine->metrics().kv_blocks_used.load(), 0);
}

TEST(Engine, CancelFreesKv) {
  auto engine = make_engine(2, 64);
  Submitted s = engine->submit(greedy(prompt_for(1), 200));
  ASSERT_TRUE(s.stream);
  RequestUpdate u;
  while (u.tokens.empty()) s.stream->take(&u, 100ms);
  // The gauges are refreshed once per engine step, and the first token can arrive before the
  // step that publishes this sequence's blocks (seen on a loaded CI machine): wait for it.
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (engine->metrics().kv_blocks_used.load() == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  EXPECT_GT(engine->metrics().kv_blocks_used.load(), 0);
  s.stream->cancel();
  wait_for_idle(*engine);
  EXPECT_EQ(engine->metrics().kv_blocks_used.load(), 0);
  EXPECT_EQ(engine->metrics().running.load(), 0);
  EXPECT_EQ(engine->metrics().requests_cancelled_total.load(), 1);
  // The engine keeps serving.
  RequestUpdate v = drain(*engine->submit(greedy(prompt_for(2), 3)).stream);
  EXPECT_EQ(ids_of(v), reference_ids(prompt_for(2), 3));
}

TEST(Engine, BoundedQueue) {
  auto engine = make_engine(1, 64, 0, 16, 2);
  std::vector<Submitted> subs;
  for (int i = 0; i < 5; ++i) subs.push_back(engine->submit(greedy(prompt_for(i), 30)));
  // One may run; at most two wait; the rest are refused.
  int refused = 0;
  for (const Submitted& s : subs) refused += s.queue_full ? 1 : 0;
  EXPECT_GE(refused, 2);
  EXPECT_TRUE(subs.back().queue_full);
  EXPECT_GE(engine->metrics().requests_rejected_total.load(), 2);
  for (Submitted& s : subs)
    if (s.stream) {
      EXPECT_EQ(drain(*s.stream).finish_reason, "length");
    }
}

// An API request's n choices are queued together or not at all: a group the queue cannot take
// whole, or one with a bad request, leaves nothing queued; a group that fits runs every member.
TEST(Engine, GroupsAreQueuedWholeOrNotAtAll) {
  auto inner = tiny_runner(4, 64);
  ASSERT_TRUE(inner);
  auto gated = std::make_unique<testing::GatedRunner>(std::move(inner));
  testing::GatedRunner* gate = gated.get();
  Engine engine(std::move(gated), &tiny_tokenizer(), EngineOptions{4, {}});
  // A failed assertion below returns early: the gate must open before ~Engine joins its thread.
  struct OpenAtExit {
    testing::GatedRunner* gate;
    ~OpenAtExit() { gate->open(); }
  } open_at_exit{gate};
  // A request of its own holds the engine in its first step, so the queue below stays as filled.
  Submitted blocker = engine.submit(greedy(prompt_for(9), 2));
  ASSERT_TRUE(blocker.stream);
  gate->wait_entered();
  const auto group = [](std::vector<int> which) {
    std::vector<EngineRequest> g;
    for (int i : which) g.push_back(greedy(prompt_for(i), 3));
    return g;
  };
  SubmittedGroup three = engine.submit_group(group({1, 2, 3}));
  ASSERT_EQ(three.streams.size(), 3u);
  EXPECT_EQ(engine.metrics().queue_depth.load(), 3);
  SubmittedGroup two = engine.submit_group(group({4, 5}));  // 3 + 2 > 4
  EXPECT_TRUE(two.queue_full);
  EXPECT_TRUE(two.streams.empty());
  EXPECT_EQ(engine.metrics().requests_rejected_total.load(), 1);
  std::vector<EngineRequest> bad = group({4});
  bad.push_back(greedy({600}, 3));  // outside the vocabulary
  SubmittedGroup refused = engine.submit_group(std::move(bad));
  EXPECT_TRUE(refused.streams.empty());
  EXPECT_FALSE(refused.queue_full);
  EXPECT_NE(refused.error.find("600"), std::string::npos) << refused.error;
  EXPECT_TRUE(engine.submit_group({}).streams.empty());
  EXPECT_EQ(engine.metrics().queue_depth.load(), 3);
  SubmittedGroup one = engine.submit_group(group({4}));  // exactly fills the queue
  ASSERT_EQ(one.streams.size(), 1u);
  EXPECT_TRUE(engine.submit(greedy(prompt_for(5), 3)).queue_full);
  gate->open();
  drain(*blocker.stream);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(ids_of(drain(*three.streams[static_cast<size_t>(i)])), reference_ids(prompt_for(i + 1), 3));
  EXPECT_EQ(ids_of(drain(*one.streams[0])), reference_ids(prompt_for(4), 3));
}

TEST(Engine, RefusesWhatCannotFit) {
  auto engine = make_engine(2, 64);
  EXPECT_FALSE(engine->submit(greedy({}, 3)).stream);
  EXPECT_FALSE(engine->submit(greedy({1, 2}, 255)).stream);  // 257 > context 256
  EXPECT_FALSE(engine->submit(greedy({600}, 3)).stream);     // outside the vocabulary
  EngineRequest bad = greedy({1}, 2);
  bad.sampling.top_p = 0.0f;
  EXPECT_FALSE(engine->submit(bad).stream);
  EngineRequest bias = greedy({1}, 2);
  bias.sampling.logit_bias = {{3, 1.0f}, {600, -5.0f}};  // 600 is outside the vocabulary
  Submitted s = engine->submit(bias);
  EXPECT_FALSE(s.stream);
  EXPECT_NE(s.error.find("logit_bias"), std::string::npos) << s.error;
  bias.sampling.logit_bias = {{3, 1.0f}};
  bias.sampling.repetition_penalty = 0.0f;
  EXPECT_FALSE(engine->submit(bias).stream);
}

// The penalties see the prompt and every generated token through the engine's per-request
// sampler, as in the one-sequence loop, whatever else shares the steps (chunked prefill here).
TEST(Engine, PenaltiesAndLogitBiasMatchGenerate) {
  auto engine = make_engine(3, 8);
  model::SamplerParams p{.temperature = 0.8f, .seed = 11};
  const auto prompt = prompt_for(9);
  const std::vector<int32_t> plain = reference_ids(prompt, 24, p);
  p.repetition_penalty = 1.3f;
  p.presence_penalty = 0.4f;
  p.frequency_penalty = 0.3f;
  p.logit_bias = {{17, 2.5f}, {plain[0], -1.5f}};
  const std::vector<int32_t> want = reference_ids(prompt, 24, p);
  ASSERT_NE(want, plain) << "the penalties change nothing on this prompt: the test would not see them";
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 3; ++i) {  // the same request three times, plus a greedy one between
    EngineRequest r = greedy(prompt, 24);
    r.sampling = p;
    streams.push_back(engine->submit(r).stream);
    ASSERT_TRUE(streams.back());
    ASSERT_TRUE(engine->submit(greedy(prompt_for(i), 5)).stream);
  }
  for (auto& s : streams) EXPECT_EQ(ids_of(drain(*s)), want);
}

TEST(Engine, StopStringCutsText) {
  auto engine = make_engine(2, 64);
  const auto prompt = prompt_for(5);
  EngineRequest r = greedy(prompt, 40);
  r.top_logprobs = -1;
  const std::string full = drain(*engine->submit(r).stream).text;
  ASSERT_GE(full.size(), 6u) << "the fixture's greedy text is too short for this test";
  // A stop string from the middle of the text: the output is what precedes its first occurrence.
  const std::string stop = full.substr(full.size() / 2, 2);
  r.stop = {stop};
  RequestUpdate u = drain(*engine->submit(r).stream);
  EXPECT_EQ(u.text, full.substr(0, full.find(stop)));
  EXPECT_EQ(u.finish_reason, "stop");
}

TEST(Engine, SeededSamplingIsReproducible) {
  auto engine = make_engine(4, 64);
  EngineRequest r = greedy(prompt_for(4), 16);
  r.sampling.temperature = 1.0f;
  r.sampling.seed = 7;
  auto a = engine->submit(r).stream, b = engine->submit(r).stream;
  r.sampling.seed = 8;
  auto c = engine->submit(r).stream;
  const auto ia = ids_of(drain(*a)), ib = ids_of(drain(*b)), ic = ids_of(drain(*c));
  EXPECT_EQ(ia, ib);
  EXPECT_NE(ia, ic);
}

// The draws of a step run on the pool's threads: eight sampled requests (own seeds and filters,
// logprobs, min_tokens masking) running together give each its solo tokens and logprobs.
TEST(Engine, ConcurrentSampledRequestsMatchSolo) {
  auto engine = make_engine(8, 64);
  std::vector<EngineRequest> reqs;
  for (int i = 0; i < 8; ++i) {
    EngineRequest r = greedy(prompt_for(i), 10 + i);
    r.sampling.temperature = 0.5f + 0.2f * static_cast<float>(i);
    r.sampling.top_k = i % 3 == 0 ? 0 : 5 * i;
    r.sampling.top_p = i % 2 == 0 ? 1.0f : 0.9f;
    r.sampling.seed = 100 + static_cast<uint64_t>(i);
    r.top_logprobs = i % 4 == 1 ? 2 : -1;
    r.min_tokens = i % 4 == 2 ? 5 : 0;
    reqs.push_back(r);
  }
  std::vector<RequestUpdate> solo;
  for (const EngineRequest& r : reqs) solo.push_back(drain(*engine->submit(r).stream));
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const EngineRequest& r : reqs) streams.push_back(engine->submit(r).stream);
  for (size_t i = 0; i < reqs.size(); ++i) {
    RequestUpdate u = drain(*streams[i]);
    EXPECT_EQ(u.error, "") << i;
    EXPECT_EQ(ids_of(u), ids_of(solo[i])) << "request " << i;
    ASSERT_EQ(u.tokens.size(), solo[i].tokens.size()) << i;
    for (size_t t = 0; t < u.tokens.size(); ++t) {
      EXPECT_EQ(u.tokens[t].logprob, solo[i].tokens[t].logprob) << i << " " << t;
      EXPECT_EQ(u.tokens[t].top, solo[i].tokens[t].top) << i << " " << t;
    }
  }
}

// The CPU KV pool allocates blocks as sequences need them, so a pool larger than the host used to
// start and be OOM-killed under load (--kv-blocks 2e9: a 16 GB table of empty slots at once).
// An explicit --kv-blocks past the host's available memory is an error naming the flag.
TEST(Engine, AKvPoolPastHostMemoryIsRefused) {
  RunnerOptions o;
  o.source.model_dir = testing::tiny_fixture_dir();
  o.num_blocks = 2000000000;  // x 12 KiB a block (3 layers, 2 KV heads of 16, 16 tokens): 22 TiB
  auto runner = load_runner(o);
  ASSERT_FALSE(runner.ok());
  EXPECT_EQ(runner.error().field(), "--kv-blocks") << runner.error().what();
  EXPECT_NE(runner.error().what().find("available"), std::string::npos) << runner.error().what();
  o.num_blocks = 64;
  EXPECT_TRUE(load_runner(o).ok());
}

// The same with --ep: the ranks' pools (one per rank, all in this process) were not sized at all.
TEST(Engine, AnEpKvPoolPastHostMemoryIsRefused) {
  RunnerOptions o;
  o.source.model_dir = testing::tiny_fixture_dir();
  o.ep = 2;
  o.num_blocks = 1500000000;  // 2 pools x 1.5e9 blocks x 12 KiB
  auto runner = load_runner(o);
  ASSERT_FALSE(runner.ok());
  EXPECT_EQ(runner.error().field(), "--kv-blocks") << runner.error().what();
  EXPECT_NE(runner.error().what().find("2 pools"), std::string::npos) << runner.error().what();
  o.num_blocks = 64;
  EXPECT_TRUE(load_runner(o).ok());
}

// A refused request names the field at fault, so the API's 400 carries it as "param" (it was
// null for every engine refusal).
TEST(Engine, RefusalsNameTheRequestField) {
  RunnerOptions o;
  o.source.model_dir = testing::tiny_fixture_dir();
  auto runner = load_runner(o);
  ASSERT_TRUE(runner.ok());
  Engine engine(std::move(runner).value(), &tiny_tokenizer(), EngineOptions{8, {}});
  const auto refused = [&](EngineRequest r) {
    std::vector<EngineRequest> g;
    g.push_back(std::move(r));
    SubmittedGroup s = engine.submit_group(std::move(g));
    EXPECT_TRUE(s.streams.empty());
    EXPECT_FALSE(s.error.empty());
    return s.error_param;
  };
  EngineRequest min = greedy(prompt_for(6), 5);
  min.min_tokens = 9;
  EXPECT_EQ(refused(std::move(min)), "min_tokens");
  EngineRequest top_p = greedy(prompt_for(6), 5);
  top_p.sampling.top_p = 2.0f;
  EXPECT_EQ(refused(std::move(top_p)), "top_p");  // the sampler's --top-p, in the API's terms
  EngineRequest empty = greedy(prompt_for(6), 5);
  empty.prompt.clear();
  EXPECT_EQ(refused(std::move(empty)), "prompt");
  EngineRequest stop = greedy(prompt_for(6), 5);
  stop.stop_token_ids = {-1};
  EXPECT_EQ(refused(std::move(stop)), "stop_token_ids");
  // A good request still runs.
  EXPECT_FALSE(engine.submit_group([] {
                 std::vector<EngineRequest> g;
                 g.push_back(greedy(prompt_for(6), 2));
                 return g;
               }())
                   .streams.empty());
}

TEST(Engine, EosStops) {
  // The first greedy token is made an eos id: the request stops at once with no completion.
  const auto prompt = prompt_for(6);
  const int32_t first = reference_ids(prompt, 1)[0];
  RunnerOptions o;
  o.source.model_dir = testing::tiny_fixture_dir();
  auto runner = load_runner(o);
  ASSERT_TRUE(runner.ok());
  Engine engine(std::move(runner).value(), &tiny_tokenizer(), EngineOptions{8, {first}});
  RequestUpdate u = drain(*engine.submit(greedy(prompt, 5)).stream);
  EXPECT_EQ(u.finish_reason, "stop");
  EXPECT_EQ(u.completion_tokens, 0);
  EngineRequest ig = greedy(prompt, 5);
  ig.ignore_eos = true;
  EXPECT_EQ(drain(*engine.submit(ig).stream).completion_tokens, 5);
}

// The greedy tokens of the model in `dir` (generate's loop, one sequence), for a checkpoint the
// engine was switched to.
std::vector<int32_t> reference_ids_of(const std::string& dir, const std::vector<int32_t>& prompt, int max_tokens) {
  auto m = model::Qwen3MoeCpu::load(dir);
  EXPECT_TRUE(m.ok()) << m.error().what();
  auto sampler = model::Sampler::create(model::SamplerParams{.temperature = 0.0f});
  auto stats = model::generate(*m, prompt, max_tokens, *sampler, {}, nullptr);
  EXPECT_TRUE(stats.ok()) << stats.error().what();
  return stats->generated;
}

// POST /update_weights_from_disk's engine side: requests in flight when the weights change run on
// to their end; new requests follow the new weights exactly; refused checkpoints change nothing;
// the original checkpoint restores the original tokens and logprobs bit for bit.
TEST(Engine, UpdateWeightsBetweenSteps) {
  auto engine = make_engine(4, 16);
  const auto probe = prompt_for(7);
  const RequestUpdate original = drain(*engine->submit(greedy(probe, 12)).stream);
  ASSERT_EQ(ids_of(original), reference_ids(probe, 12));

  testing::FixtureTensors t = testing::tiny_fixture_tensors();
  testing::perturb_bf16(t, 11);
  const std::string altered = testing::write_fixture_copy("engine-altered", t);
  t = testing::tiny_fixture_tensors();
  t["lm_head.weight"].shape = Shape{256, 128};  // same bytes, wrong shape
  const std::string misshapen = testing::write_fixture_copy("engine-shape", t);

  // Long requests in flight (prompt + 200 tokens < the context of 256) while the update runs.
  std::vector<std::shared_ptr<RequestStream>> in_flight;
  for (int i = 0; i < 3; ++i) in_flight.push_back(engine->submit(greedy(prompt_for(i), 200)).stream);
  RequestUpdate first;
  while (first.tokens.empty()) in_flight[0]->take(&first, 100ms);
  const WeightUpdate u = engine->update_weights(altered);
  ASSERT_EQ(u.outcome, WeightUpdate::Outcome::kUpdated) << u.message;
  std::printf("  update: %s (%lld requests paused)\n", u.message.c_str(), static_cast<long long>(u.paused_requests));
  for (auto& s : in_flight) {
    ASSERT_TRUE(s);
    const RequestUpdate r = drain(*s);
    EXPECT_EQ(r.error, "");
    EXPECT_EQ(r.finish_reason, "length");
    EXPECT_EQ(r.completion_tokens, 200);
  }
  const std::vector<int32_t> want_altered = reference_ids_of(altered, probe, 12);
  EXPECT_NE(want_altered, ids_of(original));
  // The probe's first block was cached with the old weights: it is computed again.
  const RequestUpdate after = drain(*engine->submit(greedy(probe, 12)).stream);
  EXPECT_EQ(ids_of(after), want_altered);
  ASSERT_GE(probe.size(), 17u);
  EXPECT_EQ(after.cached_tokens, 0);

  // Refused: the old (here: the altered) weights keep serving.
  const WeightUpdate missing = engine->update_weights("/nonexistent/moebius-checkpoint");
  EXPECT_EQ(missing.outcome, WeightUpdate::Outcome::kRefused);
  EXPECT_NE(missing.message.find("does not exist"), std::string::npos) << missing.message;
  const WeightUpdate shape = engine->update_weights(misshapen);
  EXPECT_EQ(shape.outcome, WeightUpdate::Outcome::kRefused);
  EXPECT_NE(shape.message.find("lm_head.weight"), std::string::npos) << shape.message;
  const RequestUpdate again = drain(*engine->submit(greedy(probe, 12)).stream);
  EXPECT_EQ(ids_of(again), want_altered);
  EXPECT_EQ(again.cached_tokens, 16);  // cached under the altered weights, which still serve

  const WeightUpdate back = engine->update_weights(testing::tiny_fixture_dir());
  ASSERT_EQ(back.outcome, WeightUpdate::Outcome::kUpdated) << back.message;
  const RequestUpdate restored = drain(*engine->submit(greedy(probe, 12)).stream);
  ASSERT_EQ(restored.tokens.size(), original.tokens.size());
  for (size_t i = 0; i < restored.tokens.size(); ++i) {
    EXPECT_EQ(restored.tokens[i].id, original.tokens[i].id) << i;
    EXPECT_EQ(std::memcmp(&restored.tokens[i].logprob, &original.tokens[i].logprob, sizeof(float)), 0) << i;
  }
  EXPECT_EQ(engine->metrics().weight_updates_total.load(), 2);
  testing::remove_fixture_copies();
}

TEST(Engine, UpdateWeightsAfterStopChangesNothing) {
  auto engine = make_engine(2, 16);
  engine->stop();
  const WeightUpdate u = engine->update_weights(testing::tiny_fixture_dir());
  EXPECT_EQ(u.outcome, WeightUpdate::Outcome::kStopped) << u.message;
}

}  // namespace
}  // namespace moebius::server
