// Prefix caching ([TAG_PREFIX_CACHE]): the block allocator's published blocks (match, publish,
// eviction order, duplicates, weight versions), a random stress against a model of the blocks'
// contents, the CPU KV cache's pool views, and the engine: requests that reuse cached blocks give
// exactly the tokens of the one-sequence loop that computes everything, under eviction and
// preemption too.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "model/block_allocator.h"
#include "model/generate.h"
#include "model/kv_cache.h"
#include "server/engine.h"
#include "serve_test_util.h"
#include "test_util.h"
#include "tiny_fixture.h"

namespace moebius::model {
namespace {

std::vector<int32_t> iota_tokens(int n, int32_t first) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = first + i;
  return v;
}

// Publishes the whole blocks of `table` holding tokens[0, computed).
uint64_t publish_all(BlockAllocator& a, const std::vector<int32_t>& table, const std::vector<int32_t>& tokens,
                     int64_t computed, int bs, uint64_t root) {
  uint64_t chain = root;
  for (int64_t b = 0; b < computed / bs; ++b)
    chain = *a.publish(table[static_cast<size_t>(b)], chain,
                       std::span<const int32_t>(tokens).subspan(static_cast<size_t>(b * bs), static_cast<size_t>(bs)));
  return chain;
}

TEST(PrefixCache, MatchesPublishedWholeBlocksOnly) {
  constexpr int bs = 4;
  BlockAllocator a(10, true);
  const uint64_t root = BlockAllocator::root_chain(0);
  const std::vector<int32_t> t = iota_tokens(14, 100);
  std::vector<int32_t> ta;
  ASSERT_TRUE(a.ensure(ta, 14, bs).ok());  // 4 blocks; the last holds 2 tokens
  publish_all(a, ta, t, 14, bs, root);     // blocks 0-2
  EXPECT_EQ(a.num_cached(), 3);
  std::vector<int32_t> tb;
  auto m = a.match_prefix(root, std::span<const int32_t>(t).first(11), bs, tb);
  EXPECT_EQ(m.blocks, 2);  // 11 tokens hold 2 whole blocks
  EXPECT_EQ(tb, (std::vector<int32_t>{ta[0], ta[1]}));
  EXPECT_EQ(a.num_used(), 4);  // shared, not copied
  a.release(tb);
  m = a.match_prefix(root, t, bs, tb);
  EXPECT_EQ(m.blocks, 3);
  // The chain hash after the match is the one a continuation publishes under.
  EXPECT_EQ(m.chain, publish_all(a, ta, t, 12, bs, root));
  a.release(tb);
  // A different token in block 1 stops the match after block 0; another weights version or
  // another block size matches nothing.
  std::vector<int32_t> u = t;
  u[5] = 7;
  EXPECT_EQ(a.match_prefix(root, u, bs, tb).blocks, 1);
  a.release(tb);
  EXPECT_EQ(a.match_prefix(BlockAllocator::root_chain(1), t, bs, tb).blocks, 0);
  EXPECT_EQ(a.match_prefix(root, t, 2, tb).blocks, 0);
  EXPECT_TRUE(tb.empty());
  // Without prefix caching nothing is ever matched.
  BlockAllocator off(10);
  std::vector<int32_t> to;
  ASSERT_TRUE(off.ensure(to, 12, bs).ok());
  publish_all(off, to, t, 12, bs, root);
  std::vector<int32_t> tm;
  EXPECT_EQ(off.match_prefix(root, t, bs, tm).blocks, 0);
  EXPECT_EQ(off.num_cached(), 0);
}

TEST(PrefixCache, ReleasedBlocksStayCachedUntilThePoolNeedsThem) {
  constexpr int bs = 2;
  BlockAllocator a(6, true);
  const uint64_t root = BlockAllocator::root_chain(0);
  const std::vector<int32_t> t = iota_tokens(8, 1);
  std::vector<int32_t> ta;
  ASSERT_TRUE(a.ensure(ta, 8, bs).ok());  // blocks 0-3
  publish_all(a, ta, t, 8, bs, root);
  a.release(ta);
  EXPECT_EQ(a.num_free(), 6);  // cached blocks count as free
  EXPECT_EQ(a.num_used(), 0);
  EXPECT_EQ(a.num_cached(), 4);
  // Fresh blocks come from the never-used ones first: the cache survives.
  std::vector<int32_t> other;
  ASSERT_TRUE(a.ensure(other, 4, bs).ok());
  EXPECT_EQ(other, (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(a.num_cached(), 4);
  // Then the least recently released, deepest first: block 3 (tokens 7, 8), then 2.
  ASSERT_TRUE(a.ensure(other, 8, bs).ok());
  EXPECT_EQ(other, (std::vector<int32_t>{4, 5, 3, 2}));
  EXPECT_EQ(a.num_cached(), 2);
  std::vector<int32_t> tb;
  EXPECT_EQ(a.match_prefix(root, t, bs, tb).blocks, 2);
  EXPECT_EQ(tb, (std::vector<int32_t>{0, 1}));
  // Held blocks are never evicted: the pool is now full.
  EXPECT_EQ(a.num_free(), 0);
  EXPECT_FALSE(a.ensure(other, 10, bs).ok());
  EXPECT_EQ(a.num_cached(), 2);
  a.release(other);
  a.release(tb);
  // Weights changed: nothing matches, and every block is plainly free.
  a.clear_prefix_cache();
  EXPECT_EQ(a.num_cached(), 0);
  EXPECT_EQ(a.num_free(), 6);
  EXPECT_EQ(a.match_prefix(root, t, bs, tb).blocks, 0);
  ASSERT_TRUE(a.ensure(tb, 12, bs).ok());
  EXPECT_EQ(tb, (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));  // lowest ids first, as new
}

TEST(PrefixCache, AnEqualBlockPublishedTwiceKeepsTheFirst) {
  constexpr int bs = 4;
  BlockAllocator a(8, true);
  const uint64_t root = BlockAllocator::root_chain(0);
  const std::vector<int32_t> t = iota_tokens(8, 50);
  std::vector<int32_t> ta, tb;
  ASSERT_TRUE(a.ensure(ta, 8, bs).ok());
  ASSERT_TRUE(a.ensure(tb, 8, bs).ok());  // computed the same prompt in the same step
  const uint64_t ha = publish_all(a, ta, t, 8, bs, root), hb = publish_all(a, tb, t, 8, bs, root);
  EXPECT_EQ(ha, hb);
  EXPECT_EQ(a.num_cached(), 2);
  a.release(tb);  // its duplicates are plain free blocks
  EXPECT_EQ(a.num_cached(), 2);
  std::vector<int32_t> tc;
  EXPECT_EQ(a.match_prefix(root, t, bs, tc).blocks, 2);
  EXPECT_EQ(tc, ta);
}

// Random admissions, publishes and releases over prompts that share prefixes, with a model of
// what each block holds: whatever match_prefix hands out must hold exactly the tokens asked for,
// and the counts must always add up.
TEST(PrefixCache, RandomStressNeverHandsOutWrongBlocks) {
  constexpr int bs = 4, kBlocks = 40;
  std::mt19937 rng(12345);
  BlockAllocator a(kBlocks, true);
  std::vector<std::vector<int32_t>> content(kBlocks);  // the tokens written to each block
  struct Live {
    std::vector<int32_t> tokens, table;
    int64_t computed = 0;
    uint64_t chain = 0;
    int64_t chained = 0;
  };
  std::vector<Live> live;
  uint64_t version = 0;
  const std::vector<std::vector<int32_t>> stems = {iota_tokens(24, 0), iota_tokens(24, 1000), iota_tokens(9, 0)};
  int64_t hits = 0;
  for (int op = 0; op < 20000; ++op) {
    const int kind = static_cast<int>(rng() % 10);
    if (kind < 4 && live.size() < 8) {  // admit: a stem, maybe cut, plus a random tail
      Live s;
      const auto& stem = stems[rng() % stems.size()];
      s.tokens.assign(stem.begin(), stem.begin() + static_cast<std::ptrdiff_t>(rng() % (stem.size() + 1)));
      for (int i = 0, n = static_cast<int>(rng() % 10) + 1; i < n; ++i) s.tokens.push_back(static_cast<int32_t>(rng() % 3));
      const uint64_t root = BlockAllocator::root_chain(version);
      const auto lookup = std::span<const int32_t>(s.tokens).first(s.tokens.size() - 1);
      // The engine's walks pass the sequence's memoized chain hashes: the same answer as hashing.
      std::vector<uint64_t> chains;
      for (size_t b = 0; (b + 1) * bs <= s.tokens.size(); ++b)
        chains.push_back(BlockAllocator::chain_hash(b == 0 ? root : chains.back(),
                                                    std::span<const int32_t>(s.tokens).subspan(b * bs, bs)));
      const int64_t cached = a.cached_prefix_blocks(root, lookup, bs);
      ASSERT_EQ(a.cached_prefix_blocks(root, lookup, bs, chains), cached) << "op " << op;
      std::vector<uint64_t> wrong = chains;  // a bad memo only ends the match early
      if (!wrong.empty()) wrong[rng() % wrong.size()] ^= 1;
      ASSERT_LE(a.cached_prefix_blocks(root, lookup, bs, wrong), cached) << "op " << op;
      const auto m = op % 2 ? a.match_prefix(root, lookup, bs, s.table, chains) : a.match_prefix(root, lookup, bs, s.table);
      ASSERT_EQ(m.blocks, cached) << "op " << op;
      for (int64_t b = 0; b < m.blocks; ++b) {
        const auto want = std::vector<int32_t>(s.tokens.begin() + b * bs, s.tokens.begin() + (b + 1) * bs);
        ASSERT_EQ(content[static_cast<size_t>(s.table[static_cast<size_t>(b)])], want) << "op " << op;
      }
      hits += m.blocks;
      s.computed = m.blocks * bs;
      s.chain = m.chain;
      s.chained = m.blocks;
      if (!a.ensure(s.table, static_cast<int64_t>(s.tokens.size()), bs).ok()) {
        a.release(s.table);
        continue;
      }
      live.push_back(std::move(s));
    } else if (kind < 8 && !live.empty()) {  // compute some tokens of one, write them, publish
      Live& s = live[rng() % live.size()];
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(rng() % 7) + 1,
                                          static_cast<int64_t>(s.tokens.size()) - s.computed);
      for (int64_t p = s.computed; p < s.computed + n; ++p) {
        auto& c = content[static_cast<size_t>(s.table[static_cast<size_t>(p / bs)])];
        if (p % bs == 0) c.clear();
        ASSERT_EQ(static_cast<int64_t>(c.size()), p % bs);
        c.push_back(s.tokens[static_cast<size_t>(p)]);
      }
      s.computed += n;
      for (; s.chained < s.computed / bs; ++s.chained)
        s.chain = *a.publish(s.table[static_cast<size_t>(s.chained)], s.chain,
                            std::span<const int32_t>(s.tokens).subspan(static_cast<size_t>(s.chained * bs), bs));
    } else if (kind < 9 && !live.empty()) {  // finish (or preempt) one
      const size_t i = rng() % live.size();
      a.release(live[i].table);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (op % 997 == 0) {  // weights update
      ++version;
      a.clear_prefix_cache();
    }
    int32_t held = 0;
    std::set<int32_t> distinct;
    for (const Live& s : live)
      for (int32_t b : s.table) distinct.insert(b);
    held = static_cast<int32_t>(distinct.size());
    ASSERT_EQ(a.num_used(), held) << "op " << op;
    ASSERT_EQ(a.num_free() + a.num_used(), kBlocks);
    ASSERT_LE(a.num_cached(), kBlocks);
  }
  EXPECT_GT(hits, 1000) << "the stress never exercised a cache hit";
}

TEST(KvCacheView, ViewsShareThePoolsBlocks) {
  KvBlockPool pool(2, 1, 4, 2, 6);  // L=2, nkv=1, hd=4, 2 tokens per block, 6 blocks
  const std::vector<int32_t> ta = {3, 1}, tb = {3, 5};  // block 3 shared
  KvCache a(pool, ta, 0, 100);
  EXPECT_EQ(a.max_tokens(), 4);  // capped by its table
  ASSERT_TRUE(a.reserve(3).ok());
  EXPECT_EQ(pool.allocated(), 2);
  for (int64_t p = 0; p < 3; ++p) a.key(1, p)[0] = static_cast<float>(10 + p);
  a.advance(3);
  EXPECT_FALSE(a.reserve(5).ok());  // past its table
  KvCache b(pool, tb, 2, 100);      // continues after the shared block
  ASSERT_TRUE(b.reserve(4).ok());
  EXPECT_EQ(b.key(1, 0)[0], 10.0f);
  EXPECT_EQ(b.key(1, 1)[0], 11.0f);
  b.key(1, 2)[0] = 99.0f;  // its own block 5
  EXPECT_EQ(a.key(1, 2)[0], 12.0f);
  b.clear();  // only the position: the pool keeps the rows
  EXPECT_EQ(b.position(), 0);
  EXPECT_EQ(a.key(1, 0)[0], 10.0f);
}

}  // namespace
}  // namespace moebius::model

namespace moebius::server {
namespace {

using namespace std::chrono_literals;

using testing::tiny_serve_tokenizer;

// What the one-sequence loop generates (greedy, no eos), computing every token.
std::vector<int32_t> reference(const std::vector<int32_t>& prompt, int max_tokens) {
  static model::Qwen3MoeCpu* m = [] {
    auto r = model::Qwen3MoeCpu::load(testing::tiny_fixture_dir());
    EXPECT_TRUE(r.ok()) << r.error().what();
    return new model::Qwen3MoeCpu(std::move(r).value());
  }();
  auto sampler = model::Sampler::create(model::SamplerParams{.temperature = 0.0f});
  auto stats = model::generate(*m, prompt, max_tokens, *sampler, {}, nullptr);
  EXPECT_TRUE(stats.ok()) << stats.error().what();
  return stats->generated;
}

// Forwards to the CPU runner and records where the engine put each sequence of each step.
class RecordingRunner final : public testing::ForwardingRunner {
 public:
  using ForwardingRunner::ForwardingRunner;
  Status step(std::span<const RunnerSeq> seqs, std::vector<float>& logits) override {
    std::vector<int> per_pool(static_cast<size_t>(limits().kv_pools), 0);
    for (const RunnerSeq& s : seqs) {
      ++per_pool[static_cast<size_t>(s.pool)];
      pools_of[s.id].insert(s.pool);
      used_pools.insert(s.pool);
    }
    for (int n : per_pool) most_in_a_pool = std::max(most_in_a_pool, n);
    return ForwardingRunner::step(seqs, logits);
  }

  // Written by the engine thread; read by the test once the requests are done.
  std::map<int64_t, std::set<int>> pools_of;
  std::set<int> used_pools;
  int most_in_a_pool = 0;
};

// ep > 1: data parallel over `ep` ranks, each with `num_blocks` blocks and `max_seqs` sequences.
std::unique_ptr<Engine> engine(int max_seqs, int max_step_tokens, int32_t num_blocks, bool prefix_caching = true,
                               int ep = 1, RecordingRunner** recorder = nullptr) {
  RunnerOptions o;
  o.source.model_dir = testing::tiny_fixture_dir();
  o.max_seqs = max_seqs;
  o.max_step_tokens = max_step_tokens;
  o.num_blocks = num_blocks;
  o.block_size = 16;
  o.ep = ep;
  auto runner = load_runner(o);
  EXPECT_TRUE(runner.ok()) << runner.error().what();
  auto rec = std::make_unique<RecordingRunner>(std::move(runner).value());
  if (recorder != nullptr) *recorder = rec.get();
  EngineOptions eo;
  eo.prefix_caching = prefix_caching;
  return std::make_unique<Engine>(std::move(rec), &tiny_serve_tokenizer(), eo);
}

struct Done {
  std::vector<int32_t> ids;
  int64_t cached = 0;
  std::string error;
};

std::shared_ptr<RequestStream> submit(Engine& e, const std::vector<int32_t>& prompt, int max_tokens) {
  EngineRequest r;
  r.prompt = prompt;
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0.0f;
  r.top_logprobs = 0;
  Submitted s = e.submit(r);
  EXPECT_TRUE(s.stream) << s.error;
  return s.stream;
}

Done drain(RequestStream& s) {
  RequestUpdate u;
  const auto deadline = std::chrono::steady_clock::now() + 120s;
  while (!u.finished && std::chrono::steady_clock::now() < deadline) s.take(&u, 100ms);
  EXPECT_TRUE(u.finished);
  Done d;
  for (const GeneratedToken& t : u.tokens) d.ids.push_back(t.id);
  d.cached = u.cached_tokens;
  d.error = u.error;
  return d;
}

Done run(Engine& e, const std::vector<int32_t>& prompt, int max_tokens) {
  return drain(*submit(e, prompt, max_tokens));
}

// The gauges are refreshed on the engine's next iteration after the last request ends.
void wait_until_no_kv_in_use(Engine& e) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (e.metrics().kv_blocks_used.load() > 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(5ms);
  EXPECT_EQ(e.metrics().kv_blocks_used.load(), 0);
}

std::vector<int32_t> tokens_from(int n, int seed) {
  std::vector<int32_t> v;
  for (int i = 0; i < n; ++i) v.push_back((seed * 37 + i * 11) % 500 + 3);
  return v;
}

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(EnginePrefixCache, ASharedPromptIsReusedAndGivesTheSameTokens) {
  auto e = engine(4, 64, 64);
  ASSERT_TRUE(e->prefix_caching());
  const std::vector<int32_t> system = tokens_from(40, 1);  // 2 whole blocks of 16, and 8 more
  const auto p1 = concat(system, tokens_from(5, 2)), p2 = concat(system, tokens_from(9, 3));
  const Done a = run(*e, p1, 6);
  EXPECT_EQ(a.error, "");
  EXPECT_EQ(a.cached, 0);
  EXPECT_EQ(a.ids, reference(p1, 6));
  const Done b = run(*e, p2, 6);
  EXPECT_EQ(b.cached, 32);  // blocks 0 and 1; block 2 differs (tokens 40.. differ)
  EXPECT_EQ(b.ids, reference(p2, 6));
  // The same prompt again: every whole block but the one holding the last token.
  const Done c = run(*e, p1, 6);
  EXPECT_EQ(c.cached, 32);
  EXPECT_EQ(c.ids, a.ids);
  const auto p3 = tokens_from(48, 1);  // exactly 3 blocks, the first two the system prompt's
  const Done d = run(*e, p3, 4);
  EXPECT_EQ(d.cached, 32);  // block 2 holds the last token: computed again
  EXPECT_EQ(d.ids, reference(p3, 4));
  EXPECT_EQ(e->metrics().prefix_cache_hits_total.load(), 96);
  wait_until_no_kv_in_use(*e);  // cached blocks are not in use
  EXPECT_GT(e->metrics().kv_blocks_cached.load(), 0);
}

// A second turn: the prompt is the first turn's prompt and answer plus more. The answer's KV was
// computed in decode steps (all but the last token, which was never fed back) and is reused.
TEST(EnginePrefixCache, TheNextTurnReusesTheAnswer) {
  auto e = engine(2, 64, 32);
  const auto p1 = tokens_from(20, 4);
  const Done a = run(*e, p1, 20);
  ASSERT_EQ(a.ids.size(), 20u);
  const auto p2 = concat(concat(p1, a.ids), tokens_from(7, 5));  // 47 tokens
  const Done b = run(*e, p2, 5);
  EXPECT_EQ(b.cached, 32);  // tokens [0, 39) were computed: blocks 0 and 1
  EXPECT_EQ(b.ids, reference(p2, 5));
}

// [TAG_PREFIX_CACHE_INFLIGHT] Requests with one prompt that reach the engine together (n choices,
// or one system prompt arriving at once): the first computes the prefix, the others wait for its
// blocks instead of computing them too, and every one still gets the one-sequence loop's tokens.
TEST(EnginePrefixCache, RequestsArrivingTogetherWaitForTheFirstsPrefix) {
  for (const int ep : {1, 2}) {
    SCOPED_TRACE(ep);
    RunnerOptions o;
    o.source.model_dir = testing::tiny_fixture_dir();
    o.max_seqs = 4;
    o.max_step_tokens = 256;  // one step could compute all four prompts
    o.num_blocks = 64;
    o.block_size = 16;
    o.ep = ep;
    auto inner = load_runner(o);
    ASSERT_TRUE(inner.ok()) << inner.error().what();
    auto gated = std::make_unique<testing::GatedRunner>(std::move(inner).value());
    testing::GatedRunner* gate = gated.get();
    Engine e(std::move(gated), &tiny_serve_tokenizer(), EngineOptions{});
    // A request of its own holds the engine in its first step while the four arrive.
    auto blocker = submit(e, tokens_from(5, 7), 1);
    gate->wait_entered();
    const auto system = tokens_from(70, 8);
    const std::vector<std::vector<int32_t>> prompts = {system, system, concat(system, tokens_from(5, 9)), system};
    std::vector<std::shared_ptr<RequestStream>> streams;
    for (const auto& p : prompts) streams.push_back(submit(e, p, 5));
    gate->open();
    drain(*blocker);
    std::vector<Done> done;
    for (auto& s : streams) done.push_back(drain(*s));
    int64_t cached = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      SCOPED_TRACE(i);
      EXPECT_EQ(done[i].error, "");
      EXPECT_EQ(done[i].ids, reference(prompts[i], 5));
      cached += done[i].cached;
    }
    // The three that waited found the 4 whole blocks of the 70 tokens (64; the fifth block holds
    // the last token of the equal prompts, and the longer prompt's fifth differs from it).
    EXPECT_EQ(done[0].cached, 0);
    EXPECT_EQ(cached, 3 * 64);
    EXPECT_GT(e.metrics().prefix_cache_waits_total.load(), 0);
    e.stop();
  }
}

TEST(EnginePrefixCache, OffComputesEverything) {
  auto e = engine(2, 64, 32, false);
  EXPECT_FALSE(e->prefix_caching());
  const auto p = tokens_from(40, 6);
  run(*e, p, 3);
  const Done b = run(*e, p, 3);
  EXPECT_EQ(b.cached, 0);
  EXPECT_EQ(e->metrics().prefix_cache_hits_total.load(), 0);
  EXPECT_EQ(e->metrics().kv_blocks_cached.load(), 0);
}

// Many concurrent requests over a few shared prefixes in a pool too small for them all: cached
// blocks are evicted, sequences are preempted and recomputed (finding their own blocks again),
// and every request still gets exactly the one-sequence loop's tokens. With --ep 2 each of the two
// data-parallel ranks has such a pool, and preemption frees blocks on the rank that needs them.
class EnginePrefixCacheEp : public ::testing::TestWithParam<int> {};

TEST_P(EnginePrefixCacheEp, UnderEvictionAndPreemptionEveryRequestMatchesTheReference) {
  const int ep = GetParam();
  RecordingRunner* rec = nullptr;
  auto e = engine(4, 24, 10, true, ep, &rec);  // 10 blocks of 16 tokens a rank; 24 tokens a step
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 12; ++i) {
    const auto stem = tokens_from(16 + 16 * (i % 3), 10 + i % 3);
    prompts.push_back(concat(stem, tokens_from(3 + i, 20 + i)));
  }
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& p : prompts) streams.push_back(submit(*e, p, 24));
  for (size_t i = 0; i < prompts.size(); ++i) {
    const Done d = drain(*streams[i]);
    EXPECT_EQ(d.error, "") << "request " << i;
    EXPECT_EQ(d.ids, reference(prompts[i], 24)) << "request " << i;
  }
  EXPECT_GT(e->metrics().prefix_cache_hits_total.load(), 0);
  EXPECT_GT(e->metrics().preemptions_total.load(), 0) << "the pool never ran short: the test would not see eviction";
  wait_until_no_kv_in_use(*e);
  EXPECT_EQ(static_cast<int>(rec->used_pools.size()), ep);
  EXPECT_LE(rec->most_in_a_pool, 4);  // --max-running per rank
}

INSTANTIATE_TEST_SUITE_P(Ranks, EnginePrefixCacheEp, ::testing::Values(1, 2));

// Random requests of block-boundary prompt lengths (1, 15, 16, 17, ... 48) over shared stems, in
// pools of 8 blocks, some cancelled while queued or running: every request that completes gets the
// one-sequence loop's tokens, none finds its whole prompt cached, and no KV stays in use.
TEST_P(EnginePrefixCacheEp, RandomRequestsWithCancelsMatchTheReference) {
  const int ep = GetParam();
  auto e = engine(3, 20, 8, true, ep);
  std::mt19937 rng(77 + ep);
  const int lens[] = {1, 5, 15, 16, 17, 31, 32, 33, 47, 48};
  std::vector<std::vector<int32_t>> prompts;
  std::vector<int> max_tokens;
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 36; ++i) {
    auto p = tokens_from(lens[rng() % 10], 50 + static_cast<int>(rng() % 3));
    if (rng() % 2) p = concat(p, tokens_from(static_cast<int>(rng() % 12) + 1, 90 + i));
    const int room = 128 - static_cast<int>(p.size());  // 8 blocks of 16
    max_tokens.push_back(1 + static_cast<int>(rng() % std::min(room, 40)));
    prompts.push_back(p);
    streams.push_back(submit(*e, p, max_tokens.back()));
    if (i % 5 == 4) std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 20));
    if (i % 7 == 3) streams.back()->cancel();
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (i % 7 == 3) continue;
    const Done d = drain(*streams[i]);
    EXPECT_EQ(d.error, "") << "request " << i;
    EXPECT_EQ(d.ids, reference(prompts[i], max_tokens[i])) << "request " << i << ", " << prompts[i].size() << " tokens";
    EXPECT_LT(d.cached, static_cast<int64_t>(prompts[i].size()));
  }
  wait_until_no_kv_in_use(*e);
  EXPECT_GT(e->metrics().prefix_cache_hits_total.load(), 0);
}

// A runner whose sequence cap does not divide over its pools: the remainder goes to the first
// pools (7 over 4: 2, 2, 2, 1), so every slot can be used and no pool exceeds its share.
class CappedRunner final : public testing::ForwardingRunner {
 public:
  CappedRunner(std::unique_ptr<StepRunner> inner, int max_seqs)
      : ForwardingRunner(std::move(inner)), limits_(ForwardingRunner::limits()) {
    limits_.max_seqs = max_seqs;
  }
  const RunnerLimits& limits() const override { return limits_; }
  Status step(std::span<const RunnerSeq> seqs, std::vector<float>& logits) override {
    std::vector<int> per(static_cast<size_t>(limits_.kv_pools), 0);
    for (const RunnerSeq& s : seqs) ++per[static_cast<size_t>(s.pool)];
    for (size_t p = 0; p < per.size(); ++p) most_in_pool[p] = std::max(most_in_pool[p], per[p]);
    most_in_step = std::max(most_in_step, static_cast<int>(seqs.size()));
    return ForwardingRunner::step(seqs, logits);
  }
  std::vector<int> most_in_pool = std::vector<int>(4, 0);
  int most_in_step = 0;

 private:
  RunnerLimits limits_;
};

TEST(EnginePrefixCache, ASequenceCapThatDoesNotDivideIsSpreadOverThePools) {
  RunnerOptions o;
  o.source.model_dir = testing::tiny_fixture_dir();
  o.max_seqs = 2;
  o.max_step_tokens = 64;
  o.num_blocks = 16;
  o.ep = 4;
  auto runner = load_runner(o);
  ASSERT_TRUE(runner.ok()) << runner.error().what();
  auto capped = std::make_unique<CappedRunner>(std::move(runner).value(), 7);
  CappedRunner* c = capped.get();
  Engine e(std::move(capped), &tiny_serve_tokenizer(), EngineOptions{});
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 10; ++i) {
    prompts.push_back(tokens_from(3 + i, 60 + i));
    streams.push_back(submit(e, prompts.back(), 24));
  }
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(drain(*streams[i]).ids, reference(prompts[i], 24)) << i;
  EXPECT_EQ(c->most_in_pool, (std::vector<int>{2, 2, 2, 1}));
  EXPECT_EQ(c->most_in_step, 7);
}

// [TAG_SERVE_DP] Cache-aware placement: a request whose prompt shares a cached prefix goes to the
// rank holding it, although the other rank runs fewer sequences; without a shared prefix the
// emptier rank wins.
TEST(EnginePrefixCache, DataParallelPlacementFollowsTheCachedPrefix) {
  RecordingRunner* rec = nullptr;
  auto e = engine(4, 256, 32, true, 2, &rec);
  const std::vector<int32_t> system = tokens_from(40, 7);
  const Done a = run(*e, concat(system, tokens_from(3, 8)), 4);  // on rank 0: both idle, the lowest
  EXPECT_EQ(a.cached, 0);
  // In one schedule: d (unrelated) ties and takes rank 0; c shares the system prompt, which rank 0
  // holds: rank 0 although it now runs d; f (unrelated) takes the emptier rank 1.
  const auto d_prompt = tokens_from(30, 9), c_prompt = concat(system, tokens_from(5, 10)), f_prompt = tokens_from(20, 11);
  auto d = submit(*e, d_prompt, 6);
  auto c = submit(*e, c_prompt, 6);
  auto f = submit(*e, f_prompt, 6);
  const Done dd = drain(*d), cd = drain(*c), fd = drain(*f);
  EXPECT_EQ(cd.cached, 32);
  EXPECT_EQ(dd.ids, reference(d_prompt, 6));
  EXPECT_EQ(cd.ids, reference(c_prompt, 6));
  EXPECT_EQ(fd.ids, reference(f_prompt, 6));
  EXPECT_EQ(rec->pools_of.at(0), std::set<int>{0});  // request ids in submission order
  EXPECT_EQ(rec->pools_of.at(1), std::set<int>{0});
  EXPECT_EQ(rec->pools_of.at(2), std::set<int>{0});
  EXPECT_EQ(rec->pools_of.at(3), std::set<int>{1});
}

}  // namespace
}  // namespace moebius::server
