// Expert offload on the CUDA runner [TAG_EXPERT_OFFLOAD] (docs/OFFLOAD.md), on the tiny fixture
// (tests/data/tiny-qwen3-moe: 3 layers, layer 1 dense, H=64, 16 experts top-4, V=512):
//  - the offloaded forward (cold experts in pinned mapped host memory, read zero-copy through the
//    expert address table) is BIT-identical to the all-resident one, prefill and graph decode,
//    every expert format, with 0 and 5 of 16 experts resident;
//  - decode graphs captured before a residency change (swap_experts: copies plus table writes)
//    replay after it and stay bit-identical;
//  - a routing profile places the hottest experts; a budget too small for the non-expert weights
//    is a clear error;
//  - the dynamic expert cache [TAG_EXPERT_CACHE] (lru and freq: routing read back one step late,
//    swaps enqueued between steps) keeps every logit bit-identical while it moves experts, in graph
//    replays, padded graph buckets, staged prefill and back-to-back enqueues; it really swaps.
#include "gpu/gpu_test_util.h"  // first: it makes fmt compile under nvcc

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/expert_dma.cuh"
#include "kernels/expert_prefetch.cuh"
#include "model/block_allocator.h"
#include "model/generate.h"
#include "model/sampler.h"
#include "model/qwen3_moe_cuda.h"
#include "model/step_batch.h"
#include "offload/expert_cache.h"
#include "offload/model_expert_cache.h"
#include "offload/routing_profile.h"
#include "test_util.h"
#include "tiny_fixture.h"

namespace moebius::model {
namespace {

std::string fixture_dir() { return testing::test_data_dir() + "/tiny-qwen3-moe"; }

Qwen3MoeCudaOptions options(std::optional<WeightFormat> experts, int max_resident = -1) {
  Qwen3MoeCudaOptions o;
  o.experts_format = experts;
  o.experts_group_size = 32;
  o.max_tokens = 32;
  o.max_seqs = 2;
  o.max_logit_rows = 32;
  o.max_context = 64;
  o.graph_batches = {1, 2};
  o.max_resident_experts = max_resident;
  return o;
}

std::unique_ptr<Qwen3MoeCuda> load(const Qwen3MoeCudaOptions& o) {
  auto m = Qwen3MoeCuda::load(fixture_dir(), o);
  EXPECT_TRUE(m.ok()) << m.error().what();
  return m.ok() ? std::move(m).value() : nullptr;
}

// Loading with `o` fails with an error naming `field`; returns the message for further checks.
std::string expect_refused(const Qwen3MoeCudaOptions& o, const char* field) {
  auto m = Qwen3MoeCuda::load(fixture_dir(), o);
  if (m.ok()) {
    ADD_FAILURE() << "loaded; expected an error naming " << field;
    return {};
  }
  const std::string e = m.error().what();
  EXPECT_NE(e.find(field), std::string::npos) << e;
  return e;
}

// A sequence on one runner: prefill `n` ids (all rows' logits), then single-token decode steps of
// the rest (graph replays after the first), returning every logit in order.
struct Seq {
  BlockAllocator blocks;
  std::vector<int32_t> table;
  int64_t pos = 0;
  explicit Seq(const Qwen3MoeCuda& m) : blocks(m.num_blocks()) {}
};

std::vector<float> prefill(Qwen3MoeCuda& m, Seq& s, const std::vector<int32_t>& ids) {
  EXPECT_TRUE(s.blocks.ensure(s.table, s.pos + static_cast<int64_t>(ids.size()), m.block_size()).ok());
  const SequenceStep step{ids, s.pos, s.table};
  auto b = m.make_batch(std::span<const SequenceStep>(&step, 1), /*all_logits=*/true);
  EXPECT_TRUE(b.ok());
  std::vector<float> logits(ids.size() * static_cast<size_t>(m.config().vocab_size));
  EXPECT_TRUE(m.forward(*b, logits.data()).ok());
  s.pos += static_cast<int64_t>(ids.size());
  return logits;
}

std::vector<float> decode(Qwen3MoeCuda& m, Seq& s, const std::vector<int32_t>& ids) {
  const size_t V = static_cast<size_t>(m.config().vocab_size);
  std::vector<float> out, step(V);
  for (int32_t id : ids) {
    EXPECT_TRUE(s.blocks.ensure(s.table, s.pos + 1, m.block_size()).ok());
    const SequenceStep q{std::span<const int32_t>(&id, 1), s.pos++, s.table};
    auto b = m.make_batch(std::span<const SequenceStep>(&q, 1));
    EXPECT_TRUE(b.ok());
    EXPECT_TRUE(m.forward(*b, step.data()).ok());
    out.insert(out.end(), step.begin(), step.end());
  }
  return out;
}

void expect_bit_identical(const char* what, const std::vector<float>& a, const std::vector<float>& b) {
  ASSERT_EQ(a.size(), b.size()) << what;
  size_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  EXPECT_EQ(diff, 0u) << what << ": " << diff << " of " << a.size() << " logits differ";
}

const std::vector<int32_t> kPrompt = {1, 17, 301, 5, 99, 42, 7, 7, 250, 3, 11, 400};
const std::vector<int32_t> kDecode = {9, 8, 7, 6, 5, 4, 3, 2};

TEST(OffloadCuda, OffloadedForwardIsBitIdenticalToAllResident) {
  MOEBIUS_REQUIRE_GPU();
  for (std::optional<WeightFormat> f : {std::optional<WeightFormat>{}, std::optional<WeightFormat>{WeightFormat::kNvFp4},
                                        std::optional<WeightFormat>{WeightFormat::kInt4},
                                        std::optional<WeightFormat>{WeightFormat::kInt2}}) {
    for (int resident : {0, 5}) {
      SCOPED_TRACE(::testing::Message() << (f ? weight_format_name(*f) : "as stored") << ", " << resident
                                        << " of 16 resident");
      auto all = load(options(f));
      auto off = load(options(f, resident));
      ASSERT_TRUE(all && off);
      EXPECT_FALSE(all->offloaded());
      EXPECT_TRUE(off->offloaded());
      EXPECT_EQ(off->memory_plan().resident_experts, 2 * resident);
      EXPECT_GT(off->memory_plan().experts_host, 0u);
      EXPECT_LT(off->memory_plan().experts, all->memory_plan().experts);
      Seq sa(*all), so(*off);
      expect_bit_identical("prefill", prefill(*all, sa, kPrompt), prefill(*off, so, kPrompt));
      const int64_t g0 = off->graph_steps();
      expect_bit_identical("decode", decode(*all, sa, kDecode), decode(*off, so, kDecode));
      EXPECT_EQ(off->graph_steps() - g0, static_cast<int64_t>(kDecode.size()) - 1);  // graphs ran
      // One more step with the routing captured (eager): with every expert cold it read 4 distinct
      // experts per MoE layer from host memory, 2 layers.
      // (Eager: the prefill attention kernel, so not compared bit for bit with the graph step.)
      off->set_routing_capture(true);
      (void)decode(*off, so, {1});
      off->set_routing_capture(false);
      const uint64_t cold = off->last_step_cold_bytes(1);
      if (resident == 0) {
        EXPECT_GT(cold, 0u);
        EXPECT_LE(cold, off->memory_plan().experts_host / 4);  // at most 8 of the 32 cold experts
      }
    }
  }
}

TEST(OffloadCuda, StagedPrefillIsBitIdenticalToAllResident) {
  MOEBIUS_REQUIRE_GPU();
  // [TAG_EXPERT_STAGING] Every eager bucket stages (double-buffered copies on the copy stream);
  // two prefill chunks in a row reuse the slots across steps, and a swap between them rewrites a
  // cold region the next copy must see.
  for (WeightFormat f : {WeightFormat::kNvFp4, WeightFormat::kInt2}) {
    SCOPED_TRACE(weight_format_name(f));
    auto all = load(options(f));
    Qwen3MoeCudaOptions o = options(f, 5);
    o.cold_path = "staged";
    auto off = load(o);
    ASSERT_TRUE(all && off);
    EXPECT_NE(off->memory_plan().cold_paths.find("32:staged"), std::string::npos) << off->memory_plan().cold_paths;
    Seq sa(*all), so(*off);
    expect_bit_identical("staged prefill", prefill(*all, sa, kPrompt), prefill(*off, so, kPrompt));
    int cold = -1, res = -1;
    for (int e = 0; e < 16; ++e) {
      if (cold < 0 && !off->expert_resident(2, e)) cold = e;
      if (res < 0 && off->expert_resident(2, e)) res = e;
    }
    ASSERT_TRUE(off->swap_experts(2, cold, res).ok());
    expect_bit_identical("staged prefill after a swap", prefill(*all, sa, kDecode), prefill(*off, so, kDecode));
    expect_bit_identical("decode (zero-copy)", decode(*all, sa, {1, 2, 3}), decode(*off, so, {1, 2, 3}));
  }
  Qwen3MoeCudaOptions bad = options(WeightFormat::kInt2, 5);
  bad.cold_path = "dma";
  expect_refused(bad, "--cold-path");
}

TEST(OffloadCuda, GraphsCapturedBeforeAResidencyChangeReplayAfterIt) {
  MOEBIUS_REQUIRE_GPU();
  auto all = load(options(WeightFormat::kInt2));
  auto off = load(options(WeightFormat::kInt2, 6));
  ASSERT_TRUE(all && off);
  Seq sa(*all), so(*off);
  expect_bit_identical("prefill", prefill(*all, sa, kPrompt), prefill(*off, so, kPrompt));
  // Capture the batch-1 decode graph, then change residency in both MoE layers (0 and 2).
  expect_bit_identical("decode before", decode(*all, sa, {9, 8, 7}), decode(*off, so, {9, 8, 7}));
  int swaps = 0;
  for (int layer : {0, 2}) {
    int cold = -1, res = -1;
    for (int e = 0; e < 16; ++e) {
      if (cold < 0 && !off->expert_resident(layer, e)) cold = e;
      if (res < 0 && off->expert_resident(layer, e)) res = e;
    }
    ASSERT_GE(cold, 0);
    ASSERT_GE(res, 0);
    ASSERT_TRUE(off->swap_experts(layer, cold, res).ok());
    EXPECT_TRUE(off->expert_resident(layer, cold));
    EXPECT_FALSE(off->expert_resident(layer, res));
    EXPECT_FALSE(off->swap_experts(layer, cold, res).ok());  // now on the wrong sides
    ++swaps;
  }
  EXPECT_FALSE(off->swap_experts(1, 0, 1).ok());  // layer 1 is dense
  const int64_t g0 = off->graph_steps();
  expect_bit_identical("decode after the swaps", decode(*all, sa, {6, 5, 4, 3}), decode(*off, so, {6, 5, 4, 3}));
  EXPECT_EQ(off->graph_steps() - g0, 4);  // every step replayed the graph captured before
  EXPECT_EQ(swaps, 2);
}

TEST(OffloadCuda, AProfilePlacesTheHottestExperts) {
  MOEBIUS_REQUIRE_GPU();
  offload::RoutingProfile p = offload::make_profile(16, 4);
  for (int layer : {0, 2}) {
    offload::LayerRouting r{layer, std::vector<uint64_t>(16, 1), std::vector<double>(16, 0.1)};
    for (int e : {3, 9, 14}) r.mass[static_cast<size_t>(e)] = 5.0 + e;
    p.layers.push_back(r);
  }
  const std::string path =
      (std::filesystem::temp_directory_path() / ("moebius_offload_profile_" + std::to_string(::getpid()) + ".json"))
          .string();
  ASSERT_TRUE(offload::write_profile(p, path).ok());
  Qwen3MoeCudaOptions o = options(WeightFormat::kInt4, 3);
  o.placement_file = path;
  auto m = load(o);
  ASSERT_TRUE(m);
  for (int layer : {0, 2})
    for (int e = 0; e < 16; ++e) EXPECT_EQ(m->expert_resident(layer, e), e == 3 || e == 9 || e == 14) << e;
  EXPECT_EQ(m->memory_plan().placement, path);
  std::filesystem::remove(path);
}

TEST(OffloadCuda, ABudgetTooSmallForTheNonExpertWeightsIsAClearError) {
  MOEBIUS_REQUIRE_GPU();
  Qwen3MoeCudaOptions o = options(WeightFormat::kInt4);
  o.gpu_memory_budget = "0.0001";  // 107 KB: less than the tiny model's embeddings and KV
  auto m = Qwen3MoeCuda::load(fixture_dir(), o);
  ASSERT_FALSE(m.ok());
  const std::string e = m.error().what();
  EXPECT_NE(e.find("--gpu-memory-budget"), std::string::npos) << e;
  EXPECT_NE(e.find("non-expert weights"), std::string::npos) << e;
  o.gpu_memory_budget = "lots";
  expect_refused(o, "--gpu-memory-budget");
  // A generous budget keeps every expert resident.
  o.gpu_memory_budget = "4";
  auto big = load(o);
  ASSERT_TRUE(big);
  EXPECT_FALSE(big->offloaded());
}

// ---- the dynamic expert cache [TAG_EXPERT_CACHE] -------------------------------------------------

constexpr int kMoeLayers = 2, kTopK = 4;  // the tiny fixture: MoE layers 0 and 2, top-4 of 16

Qwen3MoeCudaOptions cached(std::optional<WeightFormat> f, offload::CachePolicy p, int resident, int swaps = 2) {
  Qwen3MoeCudaOptions o = options(f, resident);
  o.expert_cache = offload::CacheOptions{p, 0.8, swaps};
  return o;
}

// [MoE layer][E] which experts are on the GPU now.
std::vector<std::vector<bool>> residency(const Qwen3MoeCuda& m) {
  std::vector<std::vector<bool>> r;
  for (int layer : {0, 2}) {
    r.emplace_back();
    for (int e = 0; e < 16; ++e) r.back().push_back(m.expert_resident(layer, e));
  }
  return r;
}

// What every cache run must show: the routing of each fed token arrived whole (k pairs per MoE
// layer, every id in range), nothing was dropped, the cache swapped, each layer kept its slot count.
void expect_cache_worked(const Qwen3MoeCuda& m, const offload::ModelCacheStats& s, int resident) {
  EXPECT_GT(s.steps, 0u);
  EXPECT_EQ(s.dropped_steps, 0u);
  EXPECT_EQ(s.ignored_ids, 0u);
  EXPECT_EQ(s.routed_pairs, s.tokens * kTopK * kMoeLayers);
  EXPECT_GT(s.resident_pairs, 0u);
  EXPECT_LT(s.resident_pairs, s.routed_pairs);
  ASSERT_GT(s.swaps, 0u);  // the cache moved experts: the bit-identity checked with it is not vacuous
  EXPECT_GT(s.swap_bytes, 0u);
  EXPECT_EQ(s.swap_bytes % s.swaps, 0u);  // the same bytes per swap (two experts' packed bytes)
  for (const std::vector<bool>& layer : residency(m))
    EXPECT_EQ(std::count(layer.begin(), layer.end(), true), resident);
}

TEST(OffloadCuda, DynamicCacheKeepsLogitsBitIdentical) {
  MOEBIUS_REQUIRE_GPU();
  // Two prefill chunks (eager) around graph decodes, teacher-forced, compared logit for logit with
  // the all-resident runner; then greedy generation, compared token for token.
  struct Case {
    offload::CachePolicy policy;
    WeightFormat format;
    const char* cold_path;
  };
  for (const Case& c : {Case{offload::CachePolicy::kLru, WeightFormat::kNvFp4, "auto"},
                        Case{offload::CachePolicy::kFreqDecay, WeightFormat::kInt2, "auto"},
                        Case{offload::CachePolicy::kLru, WeightFormat::kInt2, "staged"},
                        Case{offload::CachePolicy::kFreqDecay, WeightFormat::kInt4, "staged"}}) {
    SCOPED_TRACE(::testing::Message() << offload::cache_policy_name(c.policy) << ", " << weight_format_name(c.format)
                                      << ", cold path " << c.cold_path);
    auto all = load(options(c.format));
    Qwen3MoeCudaOptions o = cached(c.format, c.policy, 5);
    o.cold_path = c.cold_path;
    auto off = load(o);
    ASSERT_TRUE(all && off);
    ASSERT_TRUE(off->expert_cache_on());
    EXPECT_NE(off->memory_plan().expert_cache.find(offload::cache_policy_name(c.policy)), std::string::npos);
    EXPECT_GT(off->memory_plan().cache_host, 0u);
    const auto start = residency(*off);
    Seq sa(*all), so(*off);
    expect_bit_identical("prefill", prefill(*all, sa, kPrompt), prefill(*off, so, kPrompt));
    const std::vector<int32_t> ids = {9, 8, 7, 6, 5, 4, 3, 2, 1, 17, 301, 5, 99, 42, 7, 250};
    expect_bit_identical("decode", decode(*all, sa, ids), decode(*off, so, ids));
    expect_bit_identical("second prefill chunk", prefill(*all, sa, kDecode), prefill(*off, so, kDecode));
    expect_bit_identical("decode after it", decode(*all, sa, kDecode), decode(*off, so, kDecode));
    expect_cache_worked(*off, off->expert_cache_stats(), 5);
    EXPECT_NE(residency(*off), start);
    // While the cache owns the residency, a swap from outside is refused.
    int cold = -1, res = -1;
    for (int e = 0; e < 16; ++e) {
      if (cold < 0 && !off->expert_resident(0, e)) cold = e;
      if (res < 0 && off->expert_resident(0, e)) res = e;
    }
    const Status refused = off->swap_experts(0, cold, res);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.error().what().find("--expert-cache"), std::string::npos);

    // Greedy generation through model::generate (prefill, then graph decodes and sampling).
    auto greedy = [](Qwen3MoeCuda& m) {
      auto sampler = Sampler::create(SamplerParams{0.0f});
      EXPECT_TRUE(sampler.ok());
      auto r = generate(m, kPrompt, 24, *sampler, {}, nullptr);
      EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().what());
      return r.ok() ? std::move(r).value() : GenerateStats{};
    };
    const GenerateStats ga = greedy(*all), go = greedy(*off);
    EXPECT_EQ(ga.generated, go.generated);
    EXPECT_EQ(ga.logits_hash, go.logits_hash);
    EXPECT_EQ(go.generated.size(), 24u);
    EXPECT_FALSE(ga.expert_cache.has_value());
    ASSERT_TRUE(go.expert_cache.has_value());
    EXPECT_GT(go.expert_cache->steps, 0u);
    EXPECT_EQ(go.expert_cache->routed_pairs, go.expert_cache->tokens * kTopK * kMoeLayers);
  }
}

TEST(OffloadCuda, DynamicCacheSwapsBetweenGraphReplays) {
  MOEBIUS_REQUIRE_GPU();
  // Decode graphs captured at the first step replay while the cache swaps between them. A graph
  // bucket of 2 runs one sequence padded to 2 rows: only the live row's routing may reach the
  // cache (routed pairs = tokens * k per layer exactly).
  for (offload::CachePolicy p : {offload::CachePolicy::kLru, offload::CachePolicy::kFreqDecay}) {
    SCOPED_TRACE(offload::cache_policy_name(p));
    Qwen3MoeCudaOptions ao = options(WeightFormat::kInt4), co = cached(WeightFormat::kInt4, p, 6, 1);
    ao.graph_batches = co.graph_batches = {2};
    auto all = load(ao);
    auto off = load(co);
    ASSERT_TRUE(all && off);
    Seq sa(*all), so(*off);
    expect_bit_identical("prefill", prefill(*all, sa, kPrompt), prefill(*off, so, kPrompt));
    expect_bit_identical("decode (capture)", decode(*all, sa, {9}), decode(*off, so, {9}));
    const offload::ModelCacheStats before = off->expert_cache_stats();
    const int64_t g0 = off->graph_steps();
    const std::vector<int32_t> ids = {8, 7, 6, 5, 4, 3, 2, 1, 400, 11, 3, 250};
    expect_bit_identical("graph replays between swaps", decode(*all, sa, ids), decode(*off, so, ids));
    EXPECT_EQ(off->graph_steps() - g0, static_cast<int64_t>(ids.size()));  // every step a replay
    const offload::ModelCacheStats run = off->expert_cache_stats().since(before);
    EXPECT_GE(run.steps, ids.size() - 1);  // forward() synchronizes: one step of lag
    EXPECT_EQ(run.tokens, run.steps);      // one live row per step, not the bucket's two
    expect_cache_worked(*off, run, 6);
  }
}

TEST(OffloadCuda, DynamicCacheFeedsBackToBackSteps) {
  MOEBIUS_REQUIRE_GPU();
  // enqueue() back to back (bench generate's decode loop): the host runs one step ahead, so the
  // routing arrives two steps late through the second read-back slot; nothing is dropped and the
  // last step's logits match the all-resident runner's.
  auto all = load(options(WeightFormat::kInt2));
  auto off = load(cached(WeightFormat::kInt2, offload::CachePolicy::kLru, 4));
  ASSERT_TRUE(all && off);
  Seq sa(*all), so(*off);
  expect_bit_identical("prefill", prefill(*all, sa, kPrompt), prefill(*off, so, kPrompt));
  const std::vector<int32_t> ids = {9, 8, 7, 6, 5, 4, 3, 2, 1, 17, 301, 5, 99, 42};
  const offload::ModelCacheStats before = off->expert_cache_stats();
  auto back_to_back = [&](Qwen3MoeCuda& m, Seq& s) {
    EXPECT_TRUE(s.blocks.ensure(s.table, s.pos + static_cast<int64_t>(ids.size()), m.block_size()).ok());
    for (const int32_t& id : ids) {
      const SequenceStep q{std::span<const int32_t>(&id, 1), s.pos++, s.table};
      auto b = m.make_batch(std::span<const SequenceStep>(&q, 1));
      EXPECT_TRUE(b.ok());
      EXPECT_TRUE(m.enqueue(*b).ok());
    }
    std::vector<float> last(static_cast<size_t>(m.config().vocab_size));
    CUDA_CHECK(cudaMemcpyAsync(last.data(), m.logits_device(), last.size() * sizeof(float), cudaMemcpyDeviceToHost,
                               m.stream()));
    CUDA_CHECK(cudaStreamSynchronize(m.stream()));
    return last;
  };
  expect_bit_identical("the last of back-to-back steps", back_to_back(*all, sa), back_to_back(*off, so));
  const offload::ModelCacheStats run = off->expert_cache_stats().since(before);
  EXPECT_GE(run.steps, ids.size() - 2);
  expect_cache_worked(*off, run, 4);
  // And the steps after them, synchronized again, still agree.
  expect_bit_identical("decode after", decode(*all, sa, kDecode), decode(*off, so, kDecode));
}

TEST(OffloadCuda, DynamicCacheNeedsColdExpertsAndValidOptions) {
  MOEBIUS_REQUIRE_GPU();
  // Every expert resident (no budget; a generous one): the cache stays off and the plan says why.
  for (const char* budget : {"", "4"}) {
    Qwen3MoeCudaOptions o = options(WeightFormat::kInt4);
    o.gpu_memory_budget = budget;
    o.expert_cache = offload::CacheOptions{offload::CachePolicy::kLru, 0.9, 2};
    auto m = load(o);
    ASSERT_TRUE(m);
    EXPECT_FALSE(m->expert_cache_on());
    EXPECT_NE(m->memory_plan().expert_cache.find("every expert is resident"), std::string::npos)
        << m->memory_plan().expert_cache;
    EXPECT_NE(format_memory_plan(m->memory_plan()).find("expert cache"), std::string::npos);
    EXPECT_EQ(m->expert_cache_stats().steps, 0u);
  }
  // Options the flags would have refused, given to the runner directly: an error naming the flag.
  Qwen3MoeCudaOptions bad = cached(WeightFormat::kInt4, offload::CachePolicy::kFreqDecay, 5);
  bad.expert_cache->decay = 0.0;
  auto m = Qwen3MoeCuda::load(fixture_dir(), bad);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.error().what().find("--expert-cache"), std::string::npos) << m.error().what();
  EXPECT_NE(m.error().what().find("decay"), std::string::npos) << m.error().what();
}

// [TAG_EXPERT_PREFETCH] The next-layer prefetch (MoE layer 2 predicted after MoE layer 0, with the
// dense layer 1 between) against the same offloaded runner without it: every logit bit-identical
// in graph decode, in eager steps, and in a prefill that follows decode steps (the last owner's
// entries still point at the slots then); the prefetch really copies. (The offloaded runner is
// itself bit-identical to the all-resident one: OffloadedForwardIsBitIdenticalToAllResident.)
TEST(OffloadCuda, PrefetchKeepsLogitsBitIdentical) {
  MOEBIUS_REQUIRE_GPU();
  for (std::optional<WeightFormat> f : {std::optional<WeightFormat>{}, std::optional<WeightFormat>{WeightFormat::kNvFp4},
                                        std::optional<WeightFormat>{WeightFormat::kInt4},
                                        std::optional<WeightFormat>{WeightFormat::kInt2}}) {
    for (int resident : {0, 5}) {
      for (int slots : {2, 8}) {
        for (const bool down_only : {false, true}) {
          SCOPED_TRACE(::testing::Message() << (f ? weight_format_name(*f) : "as stored") << ", " << resident
                                            << " of 16 resident, " << slots << " slots"
                                            << (down_only ? ", down projections only" : ""));
          auto base = load(options(f, resident));
          Qwen3MoeCudaOptions o = options(f, resident);
          o.expert_prefetch = slots;
          // MOEBIUS_PREFETCH_PARTS is read at load: the copies of w2 alone, joined before GEMM2
          // (the default), or whole experts, joined before the layer.
          setenv("MOEBIUS_PREFETCH_PARTS", down_only ? "down" : "all", 1);
          auto pf = load(o);
          unsetenv("MOEBIUS_PREFETCH_PARTS");
          ASSERT_TRUE(base && pf);
          ASSERT_TRUE(pf->expert_prefetch_on()) << pf->memory_plan().expert_prefetch;
          EXPECT_FALSE(base->expert_prefetch_on());
          EXPECT_NE(format_memory_plan(pf->memory_plan()).find("expert prefetch"), std::string::npos);
          Seq sb(*base), sp(*pf);
          expect_bit_identical("prefill", prefill(*base, sb, kPrompt), prefill(*pf, sp, kPrompt));
          const int64_t g0 = pf->graph_steps();
          expect_bit_identical("decode", decode(*base, sb, kDecode), decode(*pf, sp, kDecode));
          EXPECT_EQ(pf->graph_steps() - g0, static_cast<int64_t>(kDecode.size()) - 1);  // graphs ran
          // Eager steps with the routing captured: the copies happened, and a hit is read from the
          // device, not counted again as a zero-copy read.
          base->set_routing_capture(true);
          pf->set_routing_capture(true);
          expect_bit_identical("eager decode", decode(*base, sb, {3}), decode(*pf, sp, {3}));
          const Qwen3MoeCuda::PrefetchCounts c = pf->last_step_prefetch(1);
          EXPECT_GT(c.copied, 0);
          EXPECT_LE(c.copied, slots);
          EXPECT_LE(c.hits, c.copied);
          EXPECT_LE(c.hits, c.routed_cold);
          EXPECT_GT(c.routed_cold, 0);
          const uint64_t cold_base = base->last_step_cold_bytes(1), cold_pf = pf->last_step_cold_bytes(1);
          EXPECT_GT(cold_pf, 0u);
          if (c.hits == c.copied) EXPECT_EQ(cold_pf, cold_base);  // every copy replaced one read
          if (c.hits < c.copied) EXPECT_GT(cold_pf, cold_base);   // a miss is bytes on top
          EXPECT_EQ(base->last_step_prefetch(1).copied, 0);
          base->set_routing_capture(false);
          pf->set_routing_capture(false);
          // A prefill after decode steps reads the slots the last prefetch left in the tables.
          expect_bit_identical("prefill after decode", prefill(*base, sb, kPrompt), prefill(*pf, sp, kPrompt));
          expect_bit_identical("decode again", decode(*base, sb, {1, 2}), decode(*pf, sp, {1, 2}));
          EXPECT_EQ(pf->memory_plan().expert_prefetch.find("down projection") != std::string::npos, down_only);
        }
      }
    }
  }
}

TEST(OffloadCuda, PrefetchNeedsColdExpertsAndValidOptions) {
  MOEBIUS_REQUIRE_GPU();
  {  // every expert resident: off, and the plan says why
    Qwen3MoeCudaOptions o = options(WeightFormat::kInt4);
    o.expert_prefetch = 2;
    auto m = load(o);
    ASSERT_TRUE(m);
    EXPECT_FALSE(m->expert_prefetch_on());
    EXPECT_NE(m->memory_plan().expert_prefetch.find("every expert is resident"), std::string::npos)
        << m->memory_plan().expert_prefetch;
  }
  Qwen3MoeCudaOptions too_many = options(WeightFormat::kInt4, 5);
  too_many.expert_prefetch = kernels::kExpertPrefetchMaxSlots + 1;
  expect_refused(too_many, "--expert-prefetch");
  Qwen3MoeCudaOptions both = cached(WeightFormat::kInt4, offload::CachePolicy::kLru, 5);
  both.expert_prefetch = 2;
  expect_refused(both, "--expert-prefetch");
}

// [TAG_EXPERT_ROUTED_DMA] The routed cold experts copied by the copy engines on the orders of the
// copier's host thread, in eager decode steps and graph replays alike: every result the same bits
// as all-resident, with fewer slots than top-k (the rest zero-copy) and with enough, alone and
// beside the down-only prefetch (whose copied w2 parts the choice leaves alone); and the copier
// served a post per MoE layer of each decode step.
TEST(OffloadCuda, RoutedDmaKeepsLogitsBitIdentical) {
  MOEBIUS_REQUIRE_GPU();
  for (std::optional<WeightFormat> f : {std::optional<WeightFormat>{}, std::optional<WeightFormat>{WeightFormat::kNvFp4},
                                        std::optional<WeightFormat>{WeightFormat::kInt4},
                                        std::optional<WeightFormat>{WeightFormat::kInt2}}) {
    for (int resident : {0, 5}) {
      for (int slots : {2, 8}) {
        for (int prefetch : {0, 2}) {
          SCOPED_TRACE(::testing::Message() << (f ? weight_format_name(*f) : "as stored") << ", " << resident
                                            << " of 16 resident, " << slots << " DMA slots, prefetch " << prefetch);
          auto base = load(options(f, resident));
          Qwen3MoeCudaOptions o = options(f, resident);
          o.expert_dma_slots = slots;
          o.expert_prefetch = prefetch;
          auto dma = load(o);
          ASSERT_TRUE(base && dma);
          EXPECT_NE(dma->memory_plan().expert_dma.find("host thread"), std::string::npos)
              << dma->memory_plan().expert_dma;
          EXPECT_NE(format_memory_plan(dma->memory_plan()).find("routed expert DMA"), std::string::npos);
          Seq sb(*base), sd(*dma);
          expect_bit_identical("prefill", prefill(*base, sb, kPrompt), prefill(*dma, sd, kPrompt));
          const int64_t g0 = dma->graph_steps();
          EXPECT_EQ(dma->expert_dma_posts(), 0);  // prefill steps read zero-copy or staged
          expect_bit_identical("decode", decode(*base, sb, kDecode), decode(*dma, sd, kDecode));
          EXPECT_EQ(dma->graph_steps() - g0, static_cast<int64_t>(kDecode.size()) - 1);  // graphs ran
          // A post per MoE layer and step that routed a cold expert: nearly all of them.
          int moe_layers = 0;
          for (int l = 0; l < dma->config().num_hidden_layers; ++l) moe_layers += dma->config().is_moe_layer(l) ? 1 : 0;
          const int64_t most = static_cast<int64_t>(kDecode.size()) * moe_layers;
          EXPECT_GT(dma->expert_dma_posts(), most / 2);
          EXPECT_LE(dma->expert_dma_posts(), most);
          EXPECT_GT(dma->expert_dma_bytes(), 0u);
          // The tables are home again after each layer: a prefill (zero-copy or staged) and more
          // graph steps still read the right bytes.
          expect_bit_identical("prefill after decode", prefill(*base, sb, kPrompt), prefill(*dma, sd, kPrompt));
          expect_bit_identical("decode again", decode(*base, sb, {1, 2}), decode(*dma, sd, {1, 2}));
        }
      }
    }
  }
}

TEST(OffloadCuda, RoutedDmaNeedsColdExpertsAndValidOptions) {
  MOEBIUS_REQUIRE_GPU();
  {  // every expert resident: off, and the plan says why
    Qwen3MoeCudaOptions o = options(WeightFormat::kInt4);
    o.expert_dma_slots = 4;
    auto m = load(o);
    ASSERT_TRUE(m);
    EXPECT_NE(m->memory_plan().expert_dma.find("every expert is resident"), std::string::npos)
        << m->memory_plan().expert_dma;
  }
  Qwen3MoeCudaOptions too_many = options(WeightFormat::kInt4, 5);
  too_many.expert_dma_slots = kernels::kExpertDmaMaxSlots + 1;
  expect_refused(too_many, "expert_dma_slots");
  Qwen3MoeCudaOptions both = cached(WeightFormat::kInt4, offload::CachePolicy::kLru, 5);
  both.expert_dma_slots = 2;
  expect_refused(both, "expert_dma_slots");
  {  // the copier fixed the cold homes at load: swap_experts is refused, and says why
    Qwen3MoeCudaOptions o = options(WeightFormat::kInt4, 5);
    o.expert_dma_slots = 2;
    auto m4 = load(o);
    ASSERT_TRUE(m4);
    int cold = -1, res = -1;
    for (int e = 0; e < 16; ++e) {
      if (cold < 0 && !m4->expert_resident(2, e)) cold = e;
      if (res < 0 && m4->expert_resident(2, e)) res = e;
    }
    const Status refused = m4->swap_experts(2, cold, res);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.error().what().find("routed-expert DMA"), std::string::npos) << refused.error().what();
  }
  setenv("MOEBIUS_EXPERT_DMA_SLOTS", "x", 1);  // -1 reads the environment, strictly
  auto m3 = Qwen3MoeCuda::load(fixture_dir(), options(WeightFormat::kInt4, 5));
  unsetenv("MOEBIUS_EXPERT_DMA_SLOTS");
  ASSERT_FALSE(m3.ok());
  EXPECT_NE(m3.error().what().find("MOEBIUS_EXPERT_DMA_SLOTS"), std::string::npos) << m3.error().what();
}

}  // namespace
}  // namespace moebius::model
