// Weight updates on the CPU model (Qwen3MoeCpu::stage_reload / commit_reload, what `moebius serve`'s
// POST /update_weights_from_disk runs on the CPU backend) with edited copies of the tiny fixture
// (fixture_copy.h):
//  - a checkpoint with other values takes effect completely: the logits equal a fresh load of it
//    bit for bit (every tensor was taken), and the greedy tokens change;
//  - reloading the original restores the original logits bit for bit;
//  - a checkpoint that does not fit (wrong shape, missing tensor, wrong dtype, other config,
//    malformed config, truncated file, experts of another format, no such directory) is refused
//    with an error naming the problem, and the serving logits stay bit-identical.
// The engine and HTTP sides are in test_engine.cpp and tests/server/openai_client_test.mjs; the
// CUDA runner's in-place copy (graphs stay valid) in tests/gpu/test_qwen3_moe_reload.cu.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "fixture_copy.h"
#include "model/generate.h"
#include "model/qwen3_moe_cpu.h"
#include "model/sampler.h"

namespace moebius::model {
namespace {

namespace fs = std::filesystem;
using testing::FixtureTensors;

Qwen3MoeCpu load_or_die(const std::string& dir, const Qwen3MoeLoadOptions& opt = {}) {
  auto m = Qwen3MoeCpu::load(dir, opt);
  if (!m.ok()) {
    ADD_FAILURE() << m.error().what();
    std::abort();
  }
  return std::move(m).value();
}

// The logits of a 10-token prefill, every row [10, V].
std::vector<float> prefill_logits(const Qwen3MoeCpu& m) {
  const std::vector<int32_t> ids = {1, 17, 42, 99, 3, 250, 7, 511, 64, 8};
  KvCache cache = m.make_cache(32);
  std::vector<float> logits(ids.size() * static_cast<size_t>(m.config().vocab_size));
  const Status st = m.forward(ids.data(), static_cast<int>(ids.size()), cache, logits.data());
  EXPECT_TRUE(st.ok()) << st.error().what();
  return logits;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<int32_t> greedy_ids(const Qwen3MoeCpu& m) {
  auto sampler = Sampler::create(SamplerParams{.temperature = 0.0f});
  const std::vector<int32_t> prompt = {5, 6, 7, 8};
  auto stats = generate(m, prompt, 12, *sampler, {}, nullptr);
  EXPECT_TRUE(stats.ok()) << stats.error().what();
  return stats->generated;
}

std::string altered_checkpoint() {
  FixtureTensors t = testing::tiny_fixture_tensors();
  testing::perturb_bf16(t, 7);
  return testing::write_fixture_copy("update-altered", t);
}

TEST(WeightUpdateCpu, ANewCheckpointTakesEffectCompletelyAndTheOriginalRestoresBitExactly) {
  Qwen3MoeCpu m = load_or_die(testing::tiny_fixture_dir());
  const std::vector<float> before = prefill_logits(m);
  const std::vector<int32_t> greedy_before = greedy_ids(m);
  const std::string altered = altered_checkpoint();

  auto staged = m.stage_reload(altered);
  ASSERT_TRUE(staged.ok()) << staged.error().what();
  EXPECT_TRUE(same_bits(prefill_logits(m), before)) << "staging alone changed the serving model";
  m.commit_reload(std::move(staged).value());
  const std::vector<float> after = prefill_logits(m);
  EXPECT_FALSE(same_bits(after, before));
  EXPECT_TRUE(same_bits(after, prefill_logits(load_or_die(altered))))
      << "the reloaded model differs from a fresh load of the same checkpoint: some weight was not taken";
  EXPECT_NE(greedy_ids(m), greedy_before);

  auto back = m.stage_reload(testing::tiny_fixture_dir());
  ASSERT_TRUE(back.ok()) << back.error().what();
  m.commit_reload(std::move(back).value());
  EXPECT_TRUE(same_bits(prefill_logits(m), before));
  EXPECT_EQ(greedy_ids(m), greedy_before);
  testing::remove_fixture_copies();
}

// A reload uses the load options of the serving model: float experts of the new checkpoint are
// quantized online exactly as the serving ones were.
TEST(WeightUpdateCpu, AReloadQuantizesWithTheServingModelsOptions) {
  Qwen3MoeLoadOptions nvfp4;
  nvfp4.experts_format = WeightFormat::kNvFp4;
  Qwen3MoeCpu m = load_or_die(testing::tiny_fixture_dir(), nvfp4);
  const std::string altered = altered_checkpoint();
  auto staged = m.stage_reload(altered);
  ASSERT_TRUE(staged.ok()) << staged.error().what();
  m.commit_reload(std::move(staged).value());
  EXPECT_EQ(m.layers()[0].moe.experts[0].gate.format, WeightFormat::kNvFp4);
  EXPECT_TRUE(same_bits(prefill_logits(m), prefill_logits(load_or_die(altered, nvfp4))));
  testing::remove_fixture_copies();
}

struct BadCase {
  std::string name;
  std::function<std::string()> make;  // writes the checkpoint, returns its directory
  std::vector<std::string> mentions;  // the error names these
};

std::vector<BadCase> bad_cases() {
  using testing::tiny_fixture_tensors;
  using testing::write_fixture_copy;
  return {
      {"wrong shape",
       [] {
         FixtureTensors t = tiny_fixture_tensors();
         t["model.layers.2.mlp.experts.5.up_proj.weight"].shape = Shape{64, 32};  // [32, 64], same bytes
         return write_fixture_copy("update-shape", t);
       },
       {"model.layers.2.mlp.experts.5.up_proj.weight", "shape"}},
      {"missing tensor",
       [] {
         FixtureTensors t = tiny_fixture_tensors();
         t.erase("model.layers.2.self_attn.k_norm.weight");
         return write_fixture_copy("update-missing", t);
       },
       {"model.layers.2.self_attn.k_norm.weight", "missing"}},
      {"wrong dtype",
       [] {
         FixtureTensors t = tiny_fixture_tensors();
         t["model.norm.weight"].dtype = DType::kI16;  // same bytes
         return write_fixture_copy("update-dtype", t);
       },
       {"model.norm.weight", "I16"}},
      {"other geometry in config.json",
       [] {
         return write_fixture_copy("update-config", tiny_fixture_tensors(),
                                   testing::fixture_config_with("moe_intermediate_size", "48"));
       },
       {"moe_intermediate_size", "48", "32"}},
      {"other rope_theta in config.json",
       [] {
         return write_fixture_copy("update-rope", tiny_fixture_tensors(),
                                   testing::fixture_config_with("rope_theta", "10000.0"));
       },
       {"rope_theta"}},
      {"malformed config.json", [] { return write_fixture_copy("update-json", tiny_fixture_tensors(), "{\"vocab"); },
       {"config.json", "not valid JSON"}},
      {"truncated safetensors",
       [] {
         const std::string dir = write_fixture_copy("update-truncated", tiny_fixture_tensors());
         const fs::path f = fs::path(dir) / "model.safetensors";
         fs::resize_file(f, fs::file_size(f) - 1000);
         return dir;
       },
       {"model.safetensors"}},
      {"experts of another format", [] { return testing::write_nvfp4_fixture_copy("update-nvfp4"); },
       {"nvfp4", "bf16", "experts"}},
      {"no such directory", [] { return std::string("/nonexistent/moebius-checkpoint"); },
       {"/nonexistent/moebius-checkpoint"}},
  };
}

TEST(WeightUpdateCpu, ACheckpointThatDoesNotFitIsRefusedAndChangesNothing) {
  Qwen3MoeCpu m = load_or_die(testing::tiny_fixture_dir());
  const std::vector<float> before = prefill_logits(m);
  for (const BadCase& c : bad_cases()) {
    SCOPED_TRACE(c.name);
    auto staged = m.stage_reload(c.make());
    ASSERT_FALSE(staged.ok()) << "accepted";
    const std::string what = staged.error().what();
    std::printf("  %-30s %s\n", c.name.c_str(), what.c_str());
    for (const std::string& s : c.mentions) EXPECT_NE(what.find(s), std::string::npos) << "'" << s << "' in: " << what;
    EXPECT_TRUE(same_bits(prefill_logits(m), before)) << "a refused checkpoint changed the serving model";
  }
  testing::remove_fixture_copies();
}

}  // namespace
}  // namespace moebius::model
