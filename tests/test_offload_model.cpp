// Expert offload through the CPU model on the tiny fixture: `profile-experts` (library and binary),
// placement from its profile, and the CPU analogue of offloaded experts (cold experts copied to a
// separate host store) giving logits bit-identical to the all-resident model.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "model/profile_experts.h"
#include "model/qwen3_moe_cpu.h"
#include "offload/placement.h"
#include "offload/routing_profile.h"
#include "test_util.h"
#include "tiny_fixture.h"

namespace moebius::model {
namespace {

const std::string kDir = testing::tiny_fixture_dir();

std::vector<std::vector<int32_t>> prompts() {
  return {{1, 17, 301, 5, 99, 42}, {7, 7, 7, 8, 9}, {300, 200, 100, 50, 25, 12, 6, 3, 1}};
}

TEST(ProfileExperts, CountsEveryRoutedPairOfEveryMoeLayer) {
  auto m = Qwen3MoeCpu::load(kDir);
  ASSERT_TRUE(m.ok()) << m.error().what();
  auto p = profile_experts(*m, prompts());
  ASSERT_TRUE(p.ok()) << p.error().what();
  const int k = m->config().num_experts_per_tok;
  EXPECT_EQ(p->tokens, 20u);
  ASSERT_EQ(p->layers.size(), 2u);  // layer 1 is dense (mlp_only_layers)
  EXPECT_EQ(p->layers[0].layer, 0);
  EXPECT_EQ(p->layers[1].layer, 2);
  for (const offload::LayerRouting& l : p->layers) {
    uint64_t pairs = 0;
    double mass = 0;
    for (size_t e = 0; e < l.counts.size(); ++e) {
      pairs += l.counts[e];
      mass += l.mass[e];
      EXPECT_EQ(l.counts[e] == 0, l.mass[e] == 0.0);
    }
    EXPECT_EQ(pairs, 20u * static_cast<uint64_t>(k));
    EXPECT_NEAR(mass, 20.0, 1e-4);  // norm_topk_prob: each token's weights sum to 1
  }
  // The observer is removed afterwards, and profiling is deterministic.
  auto q = profile_experts(*m, prompts());
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->layers[1].counts, p->layers[1].counts);
  EXPECT_EQ(q->layers[1].mass, p->layers[1].mass);
  // Too long a prompt is refused with its index.
  std::vector<std::vector<int32_t>> bad = {std::vector<int32_t>(300, 1)};
  auto r = profile_experts(*m, bad);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().what().find("prompt 0"), std::string::npos);
}

std::vector<float> prefill_logits(const Qwen3MoeCpu& m, const std::vector<int32_t>& ids) {
  KvCache cache = m.make_cache(64);
  std::vector<float> logits(ids.size() * static_cast<size_t>(m.config().vocab_size));
  EXPECT_TRUE(m.forward(ids.data(), static_cast<int>(ids.size()), cache, logits.data()).ok());
  // And three decode steps continuing it.
  std::vector<float> step(static_cast<size_t>(m.config().vocab_size));
  for (int32_t id : {3, 4, 5}) {
    EXPECT_TRUE(m.forward(&id, 1, cache, step.data()).ok());
    logits.insert(logits.end(), step.begin(), step.end());
  }
  return logits;
}

TEST(CpuOffload, ColdExpertsInASeparateStoreAreBitIdentical) {
  for (const char* fmt : {"", "int2", "nvfp4"}) {
    SCOPED_TRACE(fmt);
    Qwen3MoeLoadOptions lo;
    if (std::string(fmt) == "int2") lo.experts_format = WeightFormat::kInt2;
    if (std::string(fmt) == "nvfp4") lo.experts_format = WeightFormat::kNvFp4;
    auto ref = Qwen3MoeCpu::load(kDir, lo);
    auto off = Qwen3MoeCpu::load(kDir, lo);
    ASSERT_TRUE(ref.ok() && off.ok());
    auto prof = profile_experts(*off, prompts());
    ASSERT_TRUE(prof.ok());
    // 5 of 16 experts resident per layer, the hottest by mass.
    auto place = offload::place_hottest(*prof, {0, 2}, 16, {5, 5}, "profile");
    ASSERT_TRUE(place.ok()) << place.error().what();
    std::vector<const uint8_t*> before;
    for (int e = 0; e < 16; ++e) before.push_back(off->layers()[2].moe.experts[static_cast<size_t>(e)].down.weight.data());
    auto bytes = off->move_cold_experts(place->layers, place->resident);
    ASSERT_TRUE(bytes.ok()) << bytes.error().what();
    EXPECT_GT(*bytes, 0u);
    // Cold experts now point into the store; resident ones did not move.
    for (int e = 0; e < 16; ++e)
      EXPECT_EQ(off->layers()[2].moe.experts[static_cast<size_t>(e)].down.weight.data() == before[static_cast<size_t>(e)],
                place->is_resident(1, e))
          << "expert " << e;
    for (const auto& ids : prompts()) {
      const std::vector<float> a = prefill_logits(*ref, ids), b = prefill_logits(*off, ids);
      ASSERT_EQ(a.size(), b.size());
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
    }
  }
}

TEST(CpuOffload, AMismatchedPlacementIsAnError) {
  auto m = Qwen3MoeCpu::load(kDir);
  ASSERT_TRUE(m.ok());
  EXPECT_FALSE(m->move_cold_experts({0, 1}, {std::vector<uint8_t>(16, 1), std::vector<uint8_t>(16, 1)}).ok());
  EXPECT_FALSE(m->move_cold_experts({0, 2}, {std::vector<uint8_t>(15, 1), std::vector<uint8_t>(16, 1)}).ok());
  EXPECT_FALSE(m->move_cold_experts({0}, {std::vector<uint8_t>(16, 1), std::vector<uint8_t>(16, 1)}).ok());
}

// ---- the real binary -------------------------------------------------------------------------

using testing::CliRun;
CliRun run_moebius(const std::string& args) { return testing::run_shell(std::string(MOEBIUS_BIN) + " " + args); }

TEST(ProfileExpertsCli, WritesAProfileThatPlacementReads) {
  if (!std::filesystem::exists(MOEBIUS_BIN)) GTEST_SKIP() << MOEBIUS_BIN << " not built";
  const auto tmp = std::filesystem::temp_directory_path();
  const std::string tag = std::to_string(::getpid());
  const std::string prompts_ids = (tmp / ("moebius_prompts_ids_" + tag + ".txt")).string();
  const std::string prompts_text = (tmp / ("moebius_prompts_text_" + tag + ".txt")).string();
  const std::string out = (tmp / ("moebius_profile_" + tag + ".json")).string();
  std::ofstream(prompts_ids) << "1,17,301,5,99,42\n\n7, 7, 7, 8, 9\n";
  std::ofstream(prompts_text) << "hello world\nthe quick brown fox\n";
  CliRun r = run_moebius("profile-experts --model " + kDir + " --prompts " + prompts_ids +
                         " --prompt-format ids --out " + out);
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("profiled 2 prompts, 11 tokens, 2 MoE layers x 16 experts"), std::string::npos) << r.out;
  auto p = offload::read_profile(out);
  ASSERT_TRUE(p.ok()) << p.error().what();
  EXPECT_EQ(p->tokens, 11u);
  EXPECT_TRUE(offload::place_hottest(*p, {0, 2}, 16, {4, 4}, out).ok());
  // The cache policies replayed on the prompts' routing.
  r = run_moebius("profile-experts --model " + kDir + " --prompts " + prompts_ids + " --prompt-format ids --out " + out +
                  " --simulate-cache 4");
  ASSERT_EQ(r.status, 0) << r.out;
  for (const char* row : {"static uniform", "static hottest (in-sample)", "lru", "freq (decay)"})
    EXPECT_NE(r.out.find(row), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("4 of 16 experts per layer resident, 11 tokens"), std::string::npos) << r.out;
  r = run_moebius("profile-experts --model " + kDir + " --prompts " + prompts_ids + " --prompt-format ids --out " + out +
                  " --simulate-cache 17");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("--simulate-cache"), std::string::npos) << r.out;
  // Text prompts through the fixture's tokenizer.
  r = run_moebius("profile-experts --model " + kDir + " --tokenizer " + testing::test_data_dir() +
                  "/tiny-serve --prompts " + prompts_text + " --out " + out);
  EXPECT_EQ(r.status, 0) << r.out;
  // Errors: exit 2 naming the file, the line or the flag.
  r = run_moebius("profile-experts --model " + kDir + " --prompts /nonexistent/prompts.txt");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("/nonexistent/prompts.txt"), std::string::npos) << r.out;
  std::ofstream(prompts_ids) << "1,2,x\n";
  r = run_moebius("profile-experts --model " + kDir + " --prompts " + prompts_ids + " --prompt-format ids");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("line 1"), std::string::npos) << r.out;
  std::ofstream(prompts_ids) << "1,2,600\n";
  r = run_moebius("profile-experts --model " + kDir + " --prompts " + prompts_ids + " --prompt-format ids");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("600"), std::string::npos) << r.out;
  r = run_moebius("profile-experts --model " + kDir + " --prompts " + prompts_text);  // no tokenizer.json in DIR
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("--tokenizer"), std::string::npos) << r.out;
  // Offload flags need the CUDA backend: a clear error on the CPU one.
  r = run_moebius("generate --model " + kDir + " --prompt-ids 1,2,3 --max-tokens 1 --gpu-memory-budget 2");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("expert offload needs --backend cuda"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--gpu-memory-budget"), std::string::npos) << r.out;
  for (const std::string& f : {prompts_ids, prompts_text, out}) std::filesystem::remove(f);
}

TEST(ExpertCacheCli, BadFlagsAreRefusedBeforeLoading) {
  if (!std::filesystem::exists(MOEBIUS_BIN)) GTEST_SKIP() << MOEBIUS_BIN << " not built";
  // generate and serve check --expert-cache, --expert-cache-decay and --expert-cache-swaps before
  // the model loads (so on machines without a GPU too): exit 2, naming the flag.
  const std::string gen = "generate --model " + kDir + " --prompt-ids 1,2,3 --max-tokens 1 ";
  const std::string serve = "serve --model " + kDir + " --tokenizer " + testing::test_data_dir() + "/tiny-serve --port 0 ";
  struct Bad {
    std::string args, needle;
  };
  const std::vector<Bad> bad = {
      // The CPU backend has no offload.
      {gen + "--expert-cache lru", "'--expert-cache': expert offload needs --backend cuda"},
      {serve + "--expert-cache freq", "'--expert-cache': expert offload needs --backend cuda"},
      // Nothing cold without a budget.
      {gen + "--backend cuda --expert-cache lru", "needs expert offload (--gpu-memory-budget)"},
      {serve + "--backend cuda --expert-cache freq", "needs expert offload (--gpu-memory-budget)"},
      // Values.
      {gen + "--backend cuda --gpu-memory-budget 2 --expert-cache lfu", "'--expert-cache': 'lfu': expected off, lru or freq"},
      {gen + "--backend cuda --gpu-memory-budget 2 --expert-cache freq --expert-cache-decay 0",
       "'--expert-cache-decay': must be in (0, 1]"},
      {gen + "--backend cuda --gpu-memory-budget 2 --expert-cache freq --expert-cache-decay 1.5",
       "'--expert-cache-decay': must be in (0, 1]"},
      {gen + "--backend cuda --gpu-memory-budget 2 --expert-cache lru --expert-cache-swaps -1",
       "'--expert-cache-swaps': must be >= 0"},
      {gen + "--backend cuda --gpu-memory-budget 2 --expert-cache lru --expert-cache-swaps two",
       "Could not convert: --expert-cache-swaps"},
      {serve + "--backend cuda --gpu-memory-budget 2 --expert-cache lru --expert-cache-decay -1",
       "'--expert-cache-decay': must be in (0, 1]"},
      // [TAG_EXPERT_PREFETCH] The prefetch is an offload flag too, with its range checked first.
      {gen + "--expert-prefetch 2", "'--expert-prefetch': expert offload needs --backend cuda"},
      {serve + "--expert-prefetch 1", "'--expert-prefetch': expert offload needs --backend cuda"},
      {gen + "--backend cuda --gpu-memory-budget 2 --expert-prefetch 9", "--expert-prefetch"},
      {gen + "--backend cuda --gpu-memory-budget 2 --expert-prefetch -1", "--expert-prefetch"},
      // [TAG_EXPERT_ROUTED_DMA] Likewise the routed-expert copies.
      {gen + "--expert-dma 8", "'--expert-dma': expert offload needs --backend cuda"},
      {serve + "--expert-dma 2", "'--expert-dma': expert offload needs --backend cuda"},
      {gen + "--backend cuda --gpu-memory-budget 2 --expert-dma 17", "--expert-dma"},
      {gen + "--backend cuda --gpu-memory-budget 2 --expert-dma -1", "--expert-dma"},
  };
  for (const Bad& b : bad) {
    // A serve that wrongly accepted its flags would serve forever: bounded.
    const CliRun r = testing::run_shell("timeout 120 " + std::string(MOEBIUS_BIN) + " " + b.args);
    EXPECT_NE(r.status, 0) << b.args << "\n" << r.out;
    EXPECT_NE(r.out.find(b.needle), std::string::npos) << b.args << "\n" << r.out;
  }
  // The default (off) and its settings need nothing: the CPU run goes through.
  const CliRun ok = run_moebius(gen + "--expert-cache off --expert-cache-swaps 0 --expert-cache-decay 1");
  EXPECT_EQ(ok.status, 0) << ok.out;
}

}  // namespace
}  // namespace moebius::model
