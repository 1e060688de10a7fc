// The engine's prompt logprobs (EngineRequest::prompt_logprobs: completions' echo with logprobs,
// vLLM's prompt_logprobs) on the CPU runner with the tiny fixture: every prompt token's logprob,
// rank and top ids equal an independent log-softmax of the logits the model gives when the prompt
// is fed one token at a time, whatever the chunking, the other sequences of the step, the prefix
// cache (which such a request does not take from) or the data-parallel rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <vector>

#include "server/engine.h"
#include "serve_test_util.h"
#include "tiny_fixture.h"

namespace moebius::server {
namespace {

using namespace std::chrono_literals;

std::unique_ptr<StepRunner> runner(int max_seqs, int max_step_tokens, int ep = 1) {
  RunnerOptions o;
  o.source.model_dir = testing::tiny_fixture_dir();
  o.max_seqs = max_seqs;
  o.max_step_tokens = max_step_tokens;
  o.ep = ep;
  auto r = load_runner(o);
  EXPECT_TRUE(r.ok()) << r.error().what();
  return r.ok() ? std::move(r).value() : nullptr;
}

// The logits row of every prompt position, the prompt fed one token at a time: [P, V].
std::vector<float> one_token_at_a_time(const std::vector<int32_t>& prompt) {
  auto r = runner(1, 16);
  std::vector<float> rows, logits;
  const std::vector<int32_t> table = {0, 1, 2, 3};
  for (size_t i = 0; i < prompt.size(); ++i) {
    const RunnerSeq s{1, std::span<const int32_t>(prompt.data() + i, 1), static_cast<int64_t>(i), table, true};
    EXPECT_TRUE(r->step(std::span<const RunnerSeq>(&s, 1), logits).ok());
    rows.insert(rows.end(), logits.begin(), logits.end());
  }
  return rows;
}

struct Expected {
  double logprob;
  int64_t rank;
  std::vector<int32_t> top;
};

// An independent log-softmax (double throughout) of row i, scoring prompt[i + 1].
Expected expected(const std::vector<float>& rows, size_t V, size_t i, int32_t id, int k) {
  const float* l = rows.data() + i * V;
  double mx = -INFINITY, sum = 0.0;
  for (size_t v = 0; v < V; ++v) mx = std::max(mx, static_cast<double>(l[v]));
  for (size_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(l[v]) - mx);
  Expected e{static_cast<double>(l[id]) - mx - std::log(sum), 1, {}};
  for (size_t v = 0; v < V; ++v) e.rank += l[v] > l[id] ? 1 : 0;
  std::vector<int32_t> order(V);
  for (size_t v = 0; v < V; ++v) order[v] = static_cast<int32_t>(v);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
  e.top.assign(order.begin(), order.begin() + k);
  return e;
}

RequestUpdate drain(RequestStream& s) {
  RequestUpdate u = testing::drain(s);
  EXPECT_EQ(u.error, "");
  return u;
}

EngineRequest request(const std::vector<int32_t>& prompt, int prompt_logprobs) {
  EngineRequest r;
  r.prompt = prompt;
  r.max_tokens = 3;
  r.sampling.temperature = 0.0f;
  r.top_logprobs = 0;
  r.prompt_logprobs = prompt_logprobs;
  return r;
}

void expect_matches(const RequestUpdate& u, const std::vector<int32_t>& prompt, const std::vector<float>& rows, int k) {
  ASSERT_TRUE(u.prompt_logprobs_ready);
  ASSERT_EQ(u.prompt_logprobs.size(), prompt.size() - 1);
  const size_t V = rows.size() / prompt.size();
  for (size_t i = 0; i + 1 < prompt.size(); ++i) {
    const GeneratedToken& t = u.prompt_logprobs[i];
    const Expected e = expected(rows, V, i, prompt[i + 1], k);
    EXPECT_EQ(t.id, prompt[i + 1]) << "position " << i + 1;
    EXPECT_NEAR(t.logprob, e.logprob, 1e-5) << "position " << i + 1;
    EXPECT_EQ(t.rank, e.rank) << "position " << i + 1;
    ASSERT_EQ(t.top.size(), static_cast<size_t>(k));
    for (int j = 0; j < k; ++j) EXPECT_EQ(t.top[static_cast<size_t>(j)].first, e.top[static_cast<size_t>(j)]);
  }
}

std::vector<int32_t> long_prompt(int n, int seed) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back((seed * 37 + i * 53) % 500 + 3);
  return p;
}

// Chunks of 4 tokens (max_step_tokens) beside another request that wants none; the generated
// tokens are the same as without prompt logprobs.
TEST(EnginePromptLogprobs, EqualAnIndependentLogSoftmaxAcrossChunks) {
  const std::vector<int32_t> prompt = long_prompt(11, 1), other = long_prompt(6, 2);
  const std::vector<float> rows = one_token_at_a_time(prompt);
  Engine e(runner(2, 4), &testing::tiny_serve_tokenizer(), EngineOptions{});
  auto a = e.submit(request(prompt, 3)), b = e.submit(request(other, -1));
  ASSERT_TRUE(a.stream && b.stream);
  const RequestUpdate ua = drain(*a.stream), ub = drain(*b.stream);
  expect_matches(ua, prompt, rows, 3);
  EXPECT_FALSE(ub.prompt_logprobs_ready);
  Engine plain(runner(2, 4), &testing::tiny_serve_tokenizer(), EngineOptions{});
  auto c = plain.submit(request(prompt, -1));
  const RequestUpdate uc = drain(*c.stream);
  ASSERT_EQ(ua.tokens.size(), uc.tokens.size());
  for (size_t i = 0; i < ua.tokens.size(); ++i) EXPECT_EQ(ua.tokens[i].id, uc.tokens[i].id);
  // A one-token prompt has nothing to score: the delivery is an empty list.
  auto one = e.submit(request({7}, 2));
  const RequestUpdate u1 = drain(*one.stream);
  EXPECT_TRUE(u1.prompt_logprobs_ready);
  EXPECT_TRUE(u1.prompt_logprobs.empty());
}

// [TAG_PREFIX_CACHE] A request for prompt logprobs computes its whole prompt even when the cache
// holds its blocks (cached_tokens 0); requests after it still hit the cache.
TEST(EnginePromptLogprobs, TheWholePromptIsComputedDespiteThePrefixCache) {
  const std::vector<int32_t> prompt = long_prompt(40, 3);  // two whole 16-token blocks
  const std::vector<float> rows = one_token_at_a_time(prompt);
  Engine e(runner(2, 64), &testing::tiny_serve_tokenizer(), EngineOptions{});
  ASSERT_TRUE(e.prefix_caching());
  auto first = e.submit(request(prompt, -1));
  drain(*first.stream);
  auto scored = e.submit(request(prompt, 1));
  const RequestUpdate us = drain(*scored.stream);
  EXPECT_EQ(us.cached_tokens, 0);
  expect_matches(us, prompt, rows, 1);
  auto again = e.submit(request(prompt, -1));
  EXPECT_EQ(drain(*again.stream).cached_tokens, 32);
}

// [TAG_SERVE_DP] With --ep 2 the rows come from whichever rank holds the sequence: the same values.
TEST(EnginePromptLogprobs, DataParallelRanksGiveTheSameValues) {
  const std::vector<int32_t> p1 = long_prompt(9, 4), p2 = long_prompt(13, 5);
  const std::vector<float> r1 = one_token_at_a_time(p1), r2 = one_token_at_a_time(p2);
  Engine e(runner(2, 8, 2), &testing::tiny_serve_tokenizer(), EngineOptions{});
  auto a = e.submit(request(p1, 2)), b = e.submit(request(p2, 2));
  expect_matches(drain(*a.stream), p1, r1, 2);
  expect_matches(drain(*b.stream), p2, r2, 2);
}

}  // namespace
}  // namespace moebius::server
