// Expert offload host logic (src/offload): routing profiles (round trip, strict parsing), placement
// (hottest by mass, uniform), the dynamic cache policies (LRU, frequency with decay), the memory
// budget planner and the zero-copy / staging cost model.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "offload/cost_model.h"
#include "offload/expert_cache.h"
#include "offload/memory_budget.h"
#include "offload/model_expert_cache.h"
#include "offload/placement.h"
#include "offload/routing_profile.h"

namespace moebius::offload {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// ---- routing profiles ---------------------------------------------------------------------------

RoutingProfile small_profile() {
  RoutingProfile p = make_profile(4, 2);
  const int32_t ids0[] = {0, 1, 0, 2, 3, 0};  // 3 tokens, k = 2
  const float w0[] = {0.75f, 0.25f, 0.5f, 0.5f, 0.9f, 0.1f};
  p.add(1, ids0, w0, 3);
  const int32_t ids1[] = {2, 3, 2, 1, 2, 0};
  p.add(3, ids1, w0, 3);
  return p;
}

TEST(RoutingProfile, CountsAndMassPerLayerAndExpert) {
  const RoutingProfile p = small_profile();
  EXPECT_EQ(p.tokens, 3u);
  ASSERT_EQ(p.layers.size(), 2u);
  EXPECT_EQ(p.layers[0].layer, 1);
  EXPECT_THAT(p.layers[0].counts, ElementsAre(3, 1, 1, 1));
  EXPECT_DOUBLE_EQ(p.layers[0].mass[0], 0.75 + 0.5 + static_cast<double>(0.1f));
  EXPECT_THAT(p.layers[1].counts, ElementsAre(1, 1, 3, 1));
  EXPECT_EQ(p.find(2), nullptr);
  EXPECT_TRUE(p.validate().ok());
}

TEST(RoutingProfile, JsonRoundTripIsExact) {
  const RoutingProfile p = small_profile();
  auto q = profile_from_json(profile_to_json(p), "p.json");
  ASSERT_TRUE(q.ok()) << q.error().what();
  EXPECT_EQ(q->num_experts, 4);
  EXPECT_EQ(q->top_k, 2);
  EXPECT_EQ(q->tokens, 3u);
  ASSERT_EQ(q->layers.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(q->layers[i].counts, p.layers[i].counts);
    EXPECT_EQ(q->layers[i].mass, p.layers[i].mass);  // doubles round-trip exactly through the JSON
  }
  const std::string path = (std::filesystem::temp_directory_path() / "moebius_test_profile.json").string();
  ASSERT_TRUE(write_profile(p, path).ok());
  auto r = read_profile(path);
  ASSERT_TRUE(r.ok()) << r.error().what();
  EXPECT_EQ(r->layers[1].mass, p.layers[1].mass);
  std::filesystem::remove(path);
}

std::string err(const std::string& text) {
  auto r = profile_from_json(text, "prof.json");
  return r.ok() ? std::string("OK") : r.error().what();
}

TEST(RoutingProfile, StrictParsingNamesTheFileAndField) {
  const std::string head = R"({"format":"moebius-routing-profile","version":1,"num_experts":2,"top_k":1,"tokens":5,)";
  EXPECT_EQ(err(head + R"("layers":[{"layer":0,"counts":[1,2],"mass":[0.5,1]}]})"), "OK");
  EXPECT_THAT(err("{"), HasSubstr("prof.json"));
  EXPECT_THAT(err("[]"), HasSubstr("not an object"));
  EXPECT_THAT(err(head + R"("layers":[], "extra": 1})"), HasSubstr("extra"));
  EXPECT_THAT(err(R"({"format":"other","version":1})"), HasSubstr("format"));
  EXPECT_THAT(err(head + R"("layers":[{"layer":0,"counts":[1],"mass":[0.5,1]}]})"), HasSubstr("layers[0].counts"));
  EXPECT_THAT(err(head + R"("layers":[{"layer":0,"counts":[1,-2],"mass":[0.5,1]}]})"),
              HasSubstr("layers[0].counts[1]"));
  EXPECT_THAT(err(head + R"("layers":[{"layer":0,"counts":[1,2],"mass":[0.5,-1]}]})"), HasSubstr("layers[0].mass"));
  EXPECT_THAT(err(head + R"("layers":[{"layer":0,"counts":[1,2],"mass":[0.5,"x"]}]})"), HasSubstr("mass[1]"));
  EXPECT_THAT(err(head + R"("layers":[{"layer":2,"counts":[1,2],"mass":[0,0]},{"layer":2,"counts":[1,2],"mass":[0,0]}]})"),
              HasSubstr("ascending"));
  EXPECT_THAT(err(head + R"("layers":[{"layer":0,"counts":[1,2]}]})"), HasSubstr("layers[0]"));
  EXPECT_THAT(err(R"({"format":"moebius-routing-profile","version":1,"num_experts":100000,"top_k":1,"tokens":0,"layers":[]})"),
              HasSubstr("num_experts"));
  EXPECT_THAT(err(R"({"format":"moebius-routing-profile","version":1,"num_experts":0,"top_k":1,"tokens":0,"layers":[]})"),
              HasSubstr("num_experts"));
  EXPECT_THAT(err(R"({"format":"moebius-routing-profile","version":1,"num_experts":4,"top_k":5,"tokens":0,"layers":[]})"),
              HasSubstr("top_k"));
  EXPECT_THAT(err(R"({"format":"moebius-routing-profile","version":2,"num_experts":2,"top_k":1,"tokens":0,"layers":[]})"),
              HasSubstr("version"));
  EXPECT_THAT(err(std::string(kMaxProfileBytes + 1, ' ')), HasSubstr("at most"));
  EXPECT_THAT(err(head + R"("layers":)" + std::string(100000, '[') + std::string(100000, ']') + "}"),
              HasSubstr("nests deeper"));  // [TAG_JSON_DEPTH]
  auto missing = read_profile("/nonexistent/moebius/profile.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.error().what(), HasSubstr("/nonexistent/moebius/profile.json"));
}

// ---- placement ----------------------------------------------------------------------------------

TEST(Placement, PerLayerCountsSpreadTheTotal) {
  EXPECT_THAT(per_layer_counts(10, 4, 8), ElementsAre(3, 3, 2, 2));
  EXPECT_THAT(per_layer_counts(0, 3, 8), ElementsAre(0, 0, 0));
  EXPECT_THAT(per_layer_counts(100, 2, 8), ElementsAre(8, 8));  // capped at E
  EXPECT_THAT(per_layer_counts(-5, 2, 8), ElementsAre(0, 0));
}

TEST(Placement, UniformSpreadsTheIds) {
  const Placement p = place_uniform({0, 2}, 8, {4, 8});
  EXPECT_THAT(p.resident[0], ElementsAre(1, 0, 1, 0, 1, 0, 1, 0));
  EXPECT_EQ(p.resident_count(1), 8);
  EXPECT_EQ(p.total_resident(), 12);
  EXPECT_FALSE(p.from_profile);
  // Any count gives exactly that many distinct experts.
  for (int n = 0; n <= 128; ++n) EXPECT_EQ(place_uniform({0}, 128, {n}).resident_count(0), n);
}

TEST(Placement, HottestByMassThenCountsThenId) {
  RoutingProfile prof = make_profile(5, 1);
  prof.layers.push_back({0, {1, 9, 5, 5, 0}, {0.1, 3.0, 2.0, 2.0, 0.0}});
  prof.layers.push_back({4, {0, 0, 7, 3, 0}, {0.0, 0.0, 1.0, 1.0, 0.0}});
  auto p = place_hottest(prof, {0, 4}, 5, {2, 1}, "prof.json");
  ASSERT_TRUE(p.ok()) << p.error().what();
  EXPECT_THAT(p->resident[0], ElementsAre(0, 1, 1, 0, 0));  // mass 3.0, then 2.0 (id 2 before 3)
  EXPECT_THAT(p->resident[1], ElementsAre(0, 0, 1, 0, 0));  // equal mass: more counts wins
  EXPECT_TRUE(p->from_profile);
  EXPECT_NEAR(p->resident_mass_fraction(prof), (5.0 + 1.0) / (7.1 + 2.0), 1e-12);
  // A profile of another model is refused with the layer or field named.
  auto bad = place_hottest(prof, {0, 1}, 5, {1, 1}, "prof.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.error().what(), HasSubstr("MoE layer 1"));
  auto bad_e = place_hottest(prof, {0}, 6, {1}, "prof.json");
  ASSERT_FALSE(bad_e.ok());
  EXPECT_THAT(bad_e.error().what(), HasSubstr("num_experts"));
}

TEST(Placement, HottestServesMoreMassThanUniformOnSkewedRouting) {
  // Zipf-like routing over 64 experts, 16 resident.
  RoutingProfile prof = make_profile(64, 1);
  LayerRouting l{0, std::vector<uint64_t>(64), std::vector<double>(64)};
  for (int e = 0; e < 64; ++e) {
    const int id = (e * 37) % 64;  // hot experts scattered over the ids
    l.mass[static_cast<size_t>(id)] = 1.0 / (e + 1);
    l.counts[static_cast<size_t>(id)] = static_cast<uint64_t>(1000 / (e + 1));
  }
  prof.layers.push_back(l);
  auto hot = place_hottest(prof, {0}, 64, {16}, "p");
  ASSERT_TRUE(hot.ok());
  const Placement uni = place_uniform({0}, 64, {16});
  EXPECT_GT(hot->resident_mass_fraction(prof), uni.resident_mass_fraction(prof) + 0.2);
}

// ---- the dynamic cache --------------------------------------------------------------------------

std::vector<uint8_t> mask(int E, std::vector<int> on) {
  std::vector<uint8_t> m(static_cast<size_t>(E), 0);
  for (int e : on) m[static_cast<size_t>(e)] = 1;
  return m;
}

TEST(ExpertCache, StaticNeverSwaps) {
  auto c = ExpertCache::create(mask(4, {0, 1}), {CachePolicy::kStatic});
  ASSERT_TRUE(c.ok());
  const int32_t a[] = {2, 3, 2};
  EXPECT_TRUE(c->step(a).empty());
  EXPECT_EQ(c->misses(), 2u);  // distinct experts per forward
  EXPECT_EQ(c->hits(), 0u);
  EXPECT_TRUE(c->resident(0));
}

TEST(ExpertCache, LruEvictsTheLeastRecentlyUsed) {
  auto c = ExpertCache::create(mask(6, {0, 1, 2}), {CachePolicy::kLru, 0.9, 8});
  ASSERT_TRUE(c.ok());
  const int32_t s1[] = {0, 1};
  EXPECT_TRUE(c->step(s1).empty());  // hits; 2 is now the least recently used
  const int32_t s2[] = {1, 4};
  auto sw = c->step(s2);
  ASSERT_EQ(sw.size(), 1u);
  EXPECT_EQ(sw[0].admit, 4);
  EXPECT_EQ(sw[0].evict, 2);
  EXPECT_EQ(sw[0].slot, 2);
  EXPECT_TRUE(c->resident(4));
  EXPECT_FALSE(c->resident(2));
  EXPECT_EQ(c->expert_in_slot(2), 4);
  // Experts routed in this forward are never the victim: 0 was used longest ago.
  const int32_t s3[] = {1, 4, 5};
  sw = c->step(s3);
  ASSERT_EQ(sw.size(), 1u);
  EXPECT_EQ(sw[0].evict, 0);
  EXPECT_EQ(c->hits(), 5u);
  EXPECT_EQ(c->misses(), 2u);
}

TEST(ExpertCache, FreqWithDecayKeepsTheSteadyExpertAgainstAOneOff) {
  auto c = ExpertCache::create(mask(4, {0}), {CachePolicy::kFreqDecay, 0.9, 4});
  ASSERT_TRUE(c.ok());
  const int32_t hot[] = {0};
  for (int i = 0; i < 10; ++i) (void)c->step(hot);
  const int32_t once[] = {3};
  EXPECT_TRUE(c->step(once).empty());  // 3's score 1 < 0's decayed ~6
  EXPECT_TRUE(c->resident(0));
  // A new steady expert wins once 0 stops being routed and its score decays below.
  int swaps = 0;
  for (int i = 0; i < 40 && c->resident(0); ++i) swaps += static_cast<int>(c->step(once).size());
  EXPECT_EQ(swaps, 1);
  EXPECT_TRUE(c->resident(3));
}

TEST(ExpertCache, SwapsPerStepAreBounded) {
  auto c = ExpertCache::create(mask(16, {0, 1, 2, 3, 4, 5, 6, 7}), {CachePolicy::kLru, 0.9, 2});
  ASSERT_TRUE(c.ok());
  const int32_t cold[] = {8, 9, 10, 11, 12};
  EXPECT_EQ(c->step(cold).size(), 2u);
  // Slots and experts stay a bijection.
  int resident = 0;
  for (int e = 0; e < 16; ++e)
    if (c->resident(e)) {
      ++resident;
      EXPECT_EQ(c->expert_in_slot(c->slot_of(e)), e);
    }
  EXPECT_EQ(resident, 8);
}

TEST(ExpertCache, BadOptionsAreErrors) {
  EXPECT_FALSE(ExpertCache::create(mask(4, {0}), {CachePolicy::kFreqDecay, 0.0, 1}).ok());
  EXPECT_FALSE(ExpertCache::create(mask(4, {0}), {CachePolicy::kLru, 0.9, -1}).ok());
  EXPECT_FALSE(ExpertCache::create({}, {}).ok());
  EXPECT_EQ(*parse_cache_policy("lru", "--expert-cache"), CachePolicy::kLru);
  auto bad = parse_cache_policy("lfu", "--expert-cache");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.error().what(), HasSubstr("--expert-cache"));
}

TEST(ExpertCache, ZeroSwapsPerStepOnlyCounts) {
  // `--expert-cache-swaps 0`: the placement never changes, hits and misses are still counted.
  for (CachePolicy p : {CachePolicy::kLru, CachePolicy::kFreqDecay}) {
    auto c = ExpertCache::create(mask(4, {0, 1}), {p, 0.9, 0});
    ASSERT_TRUE(c.ok());
    const int32_t a[] = {2, 3, 0};
    for (int i = 0; i < 5; ++i) EXPECT_TRUE(c->step(a).empty());
    EXPECT_TRUE(c->resident(0) && c->resident(1) && !c->resident(2) && !c->resident(3));
    EXPECT_EQ(c->hits(), 5u);
    EXPECT_EQ(c->misses(), 10u);
    EXPECT_EQ(c->swaps(), 0u);
  }
}

TEST(ExpertCacheFlags, ParseEveryValueAndNameTheFlag) {
  ExpertCacheFlags f;
  auto off = parse_expert_cache_flags(f, /*offloading=*/false);  // the default: off, no offload needed
  ASSERT_TRUE(off.ok());
  EXPECT_FALSE(off->has_value());
  f.policy = "lru";
  f.max_swaps = 3;
  auto lru = parse_expert_cache_flags(f, true);
  ASSERT_TRUE(lru.ok() && lru->has_value());
  EXPECT_EQ((*lru)->policy, CachePolicy::kLru);
  EXPECT_EQ((*lru)->max_swaps_per_step, 3);
  f.policy = "freq";
  f.decay = 0.5;
  auto fq = parse_expert_cache_flags(f, true);
  ASSERT_TRUE(fq.ok() && fq->has_value());
  EXPECT_EQ((*fq)->policy, CachePolicy::kFreqDecay);
  EXPECT_EQ((*fq)->decay, 0.5);
  f.max_swaps = 0;  // observe only
  EXPECT_TRUE(parse_expert_cache_flags(f, true).ok());
  f.decay = 1.0;  // no decay: plain frequency
  EXPECT_TRUE(parse_expert_cache_flags(f, true).ok());

  auto fails = [](ExpertCacheFlags g, bool offloading, const std::string& field) {
    auto r = parse_expert_cache_flags(g, offloading);
    ASSERT_FALSE(r.ok()) << field;
    EXPECT_THAT(r.error().what(), HasSubstr(field));
  };
  for (const char* bad : {"static", "lfu", "LRU", ""}) {
    ExpertCacheFlags g;
    g.policy = bad;
    fails(g, true, "--expert-cache");
  }
  for (double bad : {0.0, -0.5, 1.5, std::nan("")}) {
    ExpertCacheFlags g;
    g.decay = bad;
    fails(g, true, "--expert-cache-decay");  // checked even while the cache is off
  }
  ExpertCacheFlags g;
  g.max_swaps = -1;
  fails(g, true, "--expert-cache-swaps");
  // A cache with nothing cold: the error says what is missing.
  g = ExpertCacheFlags{};
  g.policy = "freq";
  fails(g, false, "--gpu-memory-budget");
  fails(g, false, "--expert-cache");
}

// Two MoE layers of 4 experts, k = 2.
std::vector<std::vector<uint8_t>> two_layers() { return {mask(4, {0, 1}), mask(4, {2, 3})}; }

TEST(ModelExpertCache, FeedsEachLayerItsOwnRowsAndCountsPairs) {
  auto m = ModelExpertCache::create(two_layers(), {CachePolicy::kLru, 0.9, 2}, 1000);
  ASSERT_TRUE(m.ok()) << m.error().what();
  EXPECT_EQ(m->num_layers(), 2);
  EXPECT_EQ(m->num_experts(), 4);
  std::vector<uint8_t> ran(8);
  m->snapshot(ran);
  EXPECT_THAT(ran, ElementsAre(1, 1, 0, 0, 0, 0, 1, 1));
  // Stride 6 (3 rows of capacity), 2 live rows: the third row of each layer is stale and unread.
  const std::vector<int32_t> ids = {0, 2, 0, 1, /*stale*/ 3, 3,  // layer 0
                                    2, 3, 3, 0, /*stale*/ 1, 1};  // layer 1
  const auto swaps = m->feed(ids, 6, 2, 2, ran);
  const ModelCacheStats& s = m->stats();
  EXPECT_EQ(s.steps, 1u);
  EXPECT_EQ(s.tokens, 2u);
  EXPECT_EQ(s.routed_pairs, 8u);
  EXPECT_EQ(s.resident_pairs, 6u);  // layer 0: 0, 0, 1 of 0, 2, 0, 1; layer 1: 2, 3, 3 of 2, 3, 3, 0
  EXPECT_DOUBLE_EQ(s.hit_rate(), 0.75);
  // LRU admits each layer's miss; the victims are the residents not routed in this step: none in
  // either layer (both resident experts were routed), so nothing moves yet.
  EXPECT_TRUE(swaps.empty());
  // Next step: layer 0 routes 2 and 0 (1 is now the LRU victim), layer 1 routes 1 and 2.
  const std::vector<int32_t> ids2 = {2, 0, 9, 9, 9, 9, 1, 2, 9, 9, 9, 9};
  m->snapshot(ran);
  const auto sw2 = m->feed(ids2, 6, 1, 2, ran);
  ASSERT_EQ(sw2.size(), 2u);
  EXPECT_EQ(sw2[0].layer, 0);
  EXPECT_EQ(sw2[0].admit, 2);
  EXPECT_EQ(sw2[0].evict, 1);
  EXPECT_EQ(sw2[1].layer, 1);
  EXPECT_EQ(sw2[1].admit, 1);
  EXPECT_EQ(sw2[1].evict, 3);
  EXPECT_TRUE(m->resident(0, 2) && !m->resident(0, 1) && m->resident(1, 1) && !m->resident(1, 3));
  EXPECT_EQ(m->stats().swaps, 2u);
  EXPECT_EQ(m->stats().swap_bytes, 2000u);
  EXPECT_EQ(m->stats().ignored_ids, 0u);  // the 9s are past the live rows
}

TEST(ModelExpertCache, HitsCountAgainstTheResidencyTheStepRanWith) {
  // The runner feeds a step after later swaps may already be enqueued: the step's hits are those
  // of the snapshot it ran with, not of the cache's state at feed time.
  auto m = ModelExpertCache::create({mask(4, {0})}, {CachePolicy::kLru, 0.9, 1}, 1);
  ASSERT_TRUE(m.ok());
  std::vector<uint8_t> before(4), after(4);
  m->snapshot(before);
  const int32_t a[] = {1};
  ASSERT_EQ(m->feed(a, 1, 1, 1, before).size(), 1u);  // 1 takes 0's slot
  m->snapshot(after);
  EXPECT_THAT(after, ElementsAre(0, 1, 0, 0));
  // A step enqueued before that swap routed 0: it ran with 0 resident.
  const int32_t b[] = {0};
  (void)m->feed(b, 1, 1, 1, before);
  EXPECT_EQ(m->stats().resident_pairs, 1u);
  EXPECT_EQ(m->stats().routed_pairs, 2u);
  // Ids outside [0, E) are counted and skipped, never fed to a layer's cache.
  const int32_t c[] = {-1, 4};
  EXPECT_TRUE(m->feed(c, 2, 2, 1, after).empty());
  EXPECT_EQ(m->stats().ignored_ids, 2u);
  EXPECT_EQ(m->stats().routed_pairs, 2u);
  m->drop();
  const ModelCacheStats run = m->stats().since(ModelCacheStats{});
  EXPECT_EQ(run.dropped_steps, 1u);
  EXPECT_EQ(run.steps, 3u);
  const ModelCacheStats none = m->stats().since(m->stats());
  EXPECT_EQ(none.steps, 0u);
  EXPECT_EQ(none.hit_rate(), 0.0);
}

TEST(ModelExpertCache, BadLayersAreErrors) {
  EXPECT_FALSE(ModelExpertCache::create({}, {CachePolicy::kLru}, 1).ok());
  auto r = ModelExpertCache::create({mask(4, {0}), mask(5, {0})}, {CachePolicy::kLru}, 1);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.error().what(), HasSubstr("MoE layer 1"));
  auto d = ModelExpertCache::create({mask(4, {0})}, {CachePolicy::kFreqDecay, 2.0, 1}, 1);
  ASSERT_FALSE(d.ok());
  EXPECT_THAT(d.error().what(), HasSubstr("decay"));
}

TEST(ExpertCache, BothPoliciesBeatStaticOnADriftingHotSet) {
  // 64 experts, 16 slots; each forward routes 8 experts, 6 of them from a hot set of 12 that moves
  // every 200 forwards, 2 uniformly at random.
  std::mt19937 rng(7);
  std::vector<std::vector<int32_t>> trace;
  for (int t = 0; t < 2000; ++t) {
    const int base = (t / 200) * 12 % 64;
    std::vector<int32_t> s;
    for (int i = 0; i < 6; ++i) s.push_back((base + static_cast<int>(rng() % 12)) % 64);
    for (int i = 0; i < 2; ++i) s.push_back(static_cast<int32_t>(rng() % 64));
    trace.push_back(s);
  }
  const auto start = place_uniform({0}, 64, {16}).resident[0];
  const double st = *simulate_hit_rate(start, {CachePolicy::kStatic}, trace);
  const double lru = *simulate_hit_rate(start, {CachePolicy::kLru, 0.9, 4}, trace);
  const double fq = *simulate_hit_rate(start, {CachePolicy::kFreqDecay, 0.9, 4}, trace);
  EXPECT_GT(lru, st + 0.2);
  EXPECT_GT(fq, st + 0.2);
}

// ---- memory budget ------------------------------------------------------------------------------

TEST(MemoryBudget, ParsesGibOrAuto) {
  EXPECT_EQ(parse_gpu_memory_budget("24")->bytes, 24 * kGiB);
  EXPECT_EQ(parse_gpu_memory_budget("0.5")->bytes, kGiB / 2);
  EXPECT_TRUE(parse_gpu_memory_budget("auto")->is_auto);
  for (const char* bad : {"", "-1", "0", "24GB", "nan", "inf", "1e9"}) {
    auto r = parse_gpu_memory_budget(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_THAT(r.error().what(), HasSubstr("--gpu-memory-budget"));
  }
  EXPECT_EQ(auto_budget_bytes(100 * kGiB), 95 * kGiB);
  EXPECT_EQ(auto_budget_bytes(10 * kGiB), 9 * kGiB);
  EXPECT_EQ(auto_budget_bytes(kGiB / 2), 0u);
}

TEST(MemoryBudget, ExpertsGetWhatIsLeft) {
  BudgetRequest r;
  r.budget = 24 * kGiB;
  r.non_expert_weights = 16 * kGiB;
  r.kv_cache = 2 * kGiB;
  r.workspace = kGiB;
  r.staging = kGiB;
  r.expert_bytes = 64ull << 20;  // 64 MiB
  r.num_moe_layers = 4;
  r.num_experts = 32;
  auto p = plan_budget(r);
  ASSERT_TRUE(p.ok()) << p.error().what();
  EXPECT_EQ(p->fixed, 20 * kGiB);
  EXPECT_EQ(p->resident_total, 64);  // 4 GiB / 64 MiB
  EXPECT_EQ(p->cold_total, 64);
  EXPECT_EQ(p->pinned_bytes, 64 * (64ull << 20));
  EXPECT_THAT(p->per_layer, ElementsAre(16, 16, 16, 16));
  EXPECT_FALSE(p->all_resident());
  EXPECT_THAT(format_budget_plan(r, *p), HasSubstr("64 of 128 resident"));
  r.budget = 100 * kGiB;
  EXPECT_TRUE(plan_budget(r)->all_resident());
}

TEST(MemoryBudget, TooSmallForTheNonExpertWeightsIsAClearError) {
  BudgetRequest r;
  r.budget = 8 * kGiB;
  r.non_expert_weights = 16 * kGiB;
  r.kv_cache = 2 * kGiB;
  r.expert_bytes = 1;
  r.num_moe_layers = 1;
  r.num_experts = 1;
  auto p = plan_budget(r);
  ASSERT_FALSE(p.ok());
  const std::string m = p.error().what();
  EXPECT_THAT(m, HasSubstr("--gpu-memory-budget"));
  EXPECT_THAT(m, HasSubstr("8.00 GiB"));
  EXPECT_THAT(m, HasSubstr("non-expert weights 16.00 GiB"));
  EXPECT_THAT(m, HasSubstr("18.00 GiB"));
}

TEST(MemoryBudget, PinnedMemoryMustFitTheHost) {
  EXPECT_TRUE(check_host_memory(10 * kGiB, 100 * kGiB).ok());
  auto st = check_host_memory(62 * kGiB, 64 * kGiB);
  ASSERT_FALSE(st.ok());
  EXPECT_THAT(st.error().what(), HasSubstr("62.00 GiB"));
  EXPECT_GT(host_available_bytes(), 0u);  // Linux
}

// ---- cost model ---------------------------------------------------------------------------------

TEST(CostModel, DecodeReadsZeroCopyPrefillStages) {
  // Qwen3-235B-A22B int2: E = 128, k = 8, ~5 MiB per expert, 115 of 128 experts cold.
  ColdLayerShape s;
  s.top_k = 8;
  s.num_experts = 128;
  s.cold_experts = 115;
  s.expert_bytes = 5ull << 20;
  s.tokens = 1;
  s.block_m = 8;
  ColdCost d = cold_path_cost(s);
  EXPECT_NEAR(d.touched_cold, 115.0 * 8 / 128, 1e-9);  // exact at T = 1
  EXPECT_EQ(d.choice, ColdPath::kZeroCopy);
  EXPECT_LT(d.zero_copy_bytes, d.staged_bytes / 10);
  s.tokens = 2048;
  s.block_m = 64;
  s.hidden_compute_us = 2000;
  ColdCost p = cold_path_cost(s);
  EXPECT_NEAR(p.touched_cold, 115.0, 1e-6);
  EXPECT_EQ(p.choice, ColdPath::kStaged);
  EXPECT_GT(p.zero_copy_bytes, 2 * p.staged_bytes);  // 128 tokens per expert: 2 tiles each
  // No cold experts: nothing to move.
  s.cold_experts = 0;
  EXPECT_EQ(cold_path_cost(s).zero_copy_bytes, 0.0);
}

}  // namespace
}  // namespace moebius::offload
