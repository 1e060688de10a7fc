// Weight updates on the CUDA runner (Qwen3MoeCuda::stage_weights / commit_weights, what `moebius
// serve --backend cuda` runs for POST /update_weights_from_disk) with edited copies of the tiny
// fixture (fixture_copy.h). The point of copying into the existing buffers is that the decode
// graphs captured before the update stay valid, so every check here runs a workload whose decode
// steps replay graphs captured BEFORE the update:
//  - after an update to other weights, the runner's logits equal a freshly loaded runner's on the
//    same checkpoint bit for bit (same kernels, same inputs; any weight left behind, or a graph
//    reading a stale address, would show), and differ from before;
//  - staging alone, and a refused checkpoint, change nothing (bit for bit);
//  - reloading the original restores the original logits bit for bit;
//  - a dummy-weight runner (create_dummy) that loads a checkpoint becomes that model.
#include "gpu/gpu_test_util.h"  // first: it makes fmt compile under nvcc

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "fixture_copy.h"
#include "model/block_allocator.h"
#include "model/qwen3_moe_cuda.h"
#include "model/step_batch.h"
#include "test_util.h"
#include "tiny_fixture.h"

namespace moebius::model {
namespace {

Qwen3MoeCudaOptions tiny_options(std::optional<WeightFormat> experts) {
  Qwen3MoeCudaOptions o;
  o.experts_format = experts;
  o.experts_group_size = 32;
  o.max_tokens = 32;
  o.max_seqs = 2;
  o.max_logit_rows = 32;
  o.max_context = 64;
  o.graph_batches = {1, 2};
  return o;
}

std::unique_ptr<Qwen3MoeCuda> load_cuda(const std::string& dir, const Qwen3MoeCudaOptions& o) {
  auto m = Qwen3MoeCuda::load(dir, o);
  EXPECT_TRUE(m.ok()) << m.error().what();
  return m.ok() ? std::move(m).value() : nullptr;
}

// A fixed workload: a 10-token prefill (eager), then 6 single-token decode steps (graph batch 1:
// on a runner's first run the first decode runs eagerly and captures, the others replay). The
// logits of the prefill's last row and of every decode step.
std::vector<float> run(Qwen3MoeCuda& m) {
  const size_t V = static_cast<size_t>(m.config().vocab_size);
  const std::vector<int32_t> ids = {1, 17, 42, 99, 3, 250, 7, 511, 64, 8, 300, 12, 77, 5, 401, 9};
  BlockAllocator blocks(m.num_blocks());
  std::vector<int32_t> table;
  EXPECT_TRUE(blocks.ensure(table, 16, m.block_size()).ok());
  std::vector<float> out, step(V);
  const SequenceStep pre{std::span<const int32_t>(ids.data(), 10), 0, table};
  auto b = m.make_batch(std::span<const SequenceStep>(&pre, 1));
  EXPECT_TRUE(b.ok());
  EXPECT_TRUE(m.forward(*b, step.data()).ok());
  out.insert(out.end(), step.begin(), step.end());
  for (int i = 10; i < 16; ++i) {
    const SequenceStep s{std::span<const int32_t>(ids.data() + i, 1), i, table};
    auto d = m.make_batch(std::span<const SequenceStep>(&s, 1));
    EXPECT_TRUE(d.ok());
    EXPECT_TRUE(m.forward(*d, step.data()).ok());
    out.insert(out.end(), step.begin(), step.end());
  }
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float m = 0.0f;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

// One update cycle on a runner with `experts` (nullopt: the checkpoint's bf16).
void check_update_cycle(std::optional<WeightFormat> experts) {
  const Qwen3MoeCudaOptions o = tiny_options(experts);
  std::unique_ptr<Qwen3MoeCuda> m = load_cuda(testing::tiny_fixture_dir(), o);
  ASSERT_TRUE(m);
  const std::vector<float> before = run(*m);
  ASSERT_EQ(m->graph_steps(), 5);  // the first decode captured the batch-1 graph

  testing::FixtureTensors t = testing::tiny_fixture_tensors();
  testing::perturb_bf16(t, 7);
  const std::string altered = testing::write_fixture_copy("gpu-altered", t);
  auto staged = m->stage_weights(altered);
  ASSERT_TRUE(staged.ok()) << staged.error().what();
  std::printf("staged %.2f MB of weights\n", static_cast<double>((*staged)->host_bytes()) / 1e6);
  EXPECT_TRUE(same_bits(run(*m), before)) << "staging alone changed the runner";
  m->commit_weights(**staged);
  const int64_t graphs = m->graph_steps();
  const std::vector<float> after = run(*m);
  EXPECT_EQ(m->graph_steps() - graphs, 6) << "decode steps after the update must replay the graph captured before it";
  std::unique_ptr<Qwen3MoeCuda> fresh = load_cuda(altered, o);
  ASSERT_TRUE(fresh);
  const std::vector<float> want = run(*fresh);
  std::printf("updated vs fresh load: max |dlogit| %.3g; updated vs before: %.3g\n", max_abs_diff(after, want),
              max_abs_diff(after, before));
  EXPECT_TRUE(same_bits(after, want)) << "the updated runner differs from a fresh load of the same checkpoint";
  EXPECT_FALSE(same_bits(after, before));

  // Refused checkpoints change nothing.
  t = testing::tiny_fixture_tensors();
  t["model.layers.2.mlp.experts.5.up_proj.weight"].shape = Shape{64, 32};
  const std::string misshapen = testing::write_fixture_copy("gpu-shape", t);
  for (const std::string& bad : {misshapen, std::string("/nonexistent/moebius-checkpoint")}) {
    auto r = m->stage_weights(bad);
    ASSERT_FALSE(r.ok()) << bad;
    std::printf("refused: %s\n", r.error().what().c_str());
  }
  EXPECT_TRUE(same_bits(run(*m), after));

  auto back = m->stage_weights(testing::tiny_fixture_dir());
  ASSERT_TRUE(back.ok()) << back.error().what();
  m->commit_weights(**back);
  EXPECT_TRUE(same_bits(run(*m), before)) << "the original checkpoint must restore the original logits exactly";
  testing::remove_fixture_copies();
}

TEST(Qwen3MoeCudaReload, Bf16ExpertsUpdateInPlaceAndRestoreBitExactly) {
  MOEBIUS_REQUIRE_GPU();
  check_update_cycle(std::nullopt);
}

TEST(Qwen3MoeCudaReload, Nvfp4ExpertsUpdateInPlaceAndRestoreBitExactly) {
  MOEBIUS_REQUIRE_GPU();
  check_update_cycle(WeightFormat::kNvFp4);
}

TEST(Qwen3MoeCudaReload, ExpertsOfAnotherFormatAreRefused) {
  MOEBIUS_REQUIRE_GPU();
  std::unique_ptr<Qwen3MoeCuda> m = load_cuda(testing::tiny_fixture_dir(), tiny_options(std::nullopt));
  ASSERT_TRUE(m);
  const std::vector<float> before = run(*m);
  auto r = m->stage_weights(testing::write_nvfp4_fixture_copy("gpu-nvfp4"));
  ASSERT_FALSE(r.ok());
  std::printf("refused: %s\n", r.error().what().c_str());
  EXPECT_NE(r.error().what().find("nvfp4"), std::string::npos);
  EXPECT_TRUE(same_bits(run(*m), before));
  testing::remove_fixture_copies();
}

// What `moebius serve --load-format dummy` followed by an update does: the dummy runner becomes
// the checkpoint's model, bit for bit as if it had been loaded.
TEST(Qwen3MoeCudaReload, ADummyRunnerTakesACheckpoint) {
  MOEBIUS_REQUIRE_GPU();
  const Qwen3MoeCudaOptions o = tiny_options(WeightFormat::kNvFp4);
  auto config = load_qwen3_moe_config(testing::tiny_fixture_dir());
  ASSERT_TRUE(config.ok()) << config.error().what();
  auto dummy = Qwen3MoeCuda::create_dummy(*config, moe::KernelFormat::kNvFp4, o);
  ASSERT_TRUE(dummy.ok()) << dummy.error().what();
  Qwen3MoeCuda& m = **dummy;
  const std::vector<float> random = run(m);
  auto staged = m.stage_weights(testing::tiny_fixture_dir());
  ASSERT_TRUE(staged.ok()) << staged.error().what();
  m.commit_weights(**staged);
  std::unique_ptr<Qwen3MoeCuda> loaded = load_cuda(testing::tiny_fixture_dir(), o);
  ASSERT_TRUE(loaded);
  const std::vector<float> got = run(m), want = run(*loaded);
  std::printf("dummy after update vs loaded: max |dlogit| %.3g\n", max_abs_diff(got, want));
  EXPECT_TRUE(same_bits(got, want));
  EXPECT_FALSE(same_bits(got, random));
}

}  // namespace
}  // namespace moebius::model
