// The MoE autotuner, the shared workspace pool and the per-bucket layer sets on the GPU
// (src/tune/moe_autotuner.h, src/tune/moe_layer_set.h, src/moe/moe_workspace_pool.h):
//  - tuning stores a winner per bucket; a new tuner over the same cache directory tunes nothing;
//  - a candidate whose output disagrees with the heuristic's cannot win;
//  - layers given one pool share one workspace, counted 2 -> 1 -> 0 as they go, and a layer's
//    output does not depend on what another layer left in the shared workspace;
//  - a factory's per-bucket layers (tuned, pooled) match the CPU oracle;
//  - the CUDA model with autotuning on writes the cache and matches the untuned model.
#include "gpu/gpu_test_util.h"  // first: it makes fmt compile under nvcc

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "cpu/moe_experts.h"
#include "cpu/moe_layer.h"
#include "formats/quant_matrix.h"
#include "model/block_allocator.h"
#include "model/qwen3_moe_cuda.h"
#include "moe/moe_layer_cuda.h"
#include "test_util.h"
#include "tune/capacity_buckets.h"
#include "tune/moe_autotuner.h"
#include "tune/moe_layer_set.h"

namespace moebius::tune {
namespace {

namespace fs = std::filesystem;
using testing::CudaStream;
using testing::DeviceBuffer;

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "moebius-gpu-tune-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data()) ? tmpl : "";
    EXPECT_FALSE(path_.empty());
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A small geometry with Qwen3-30B-A3B's structure (E=128, k=8 there; H=2048, I=768).
const cpu::MoeShape kShape{256, 128, 16, 4};

std::unique_ptr<moe::MoeLayerCuda> dummy_seed(moe::KernelFormat f, uint64_t seed = 3) {
  moe::MoeCudaOptions o;
  o.capacity = 1;
  auto l = moe::MoeLayerCuda::create_dummy(kShape, f, 128, o, seed);
  EXPECT_TRUE(l.ok()) << l.error().what();
  return l.ok() ? std::move(l).value() : nullptr;
}

MoeAutotunerOptions quick(const std::string& dir) {
  MoeAutotunerOptions o;
  o.cache_dir = dir;
  o.target_ms = 0.5;  // short samples: this checks the mechanism, not the timings
  o.samples = 2;
  return o;
}

void expect_sane(const MoeTuneResult& r) {
  SCOPED_TRACE(r.key.str());
  ASSERT_FALSE(r.runs.empty());
  EXPECT_TRUE(r.runs.front().heuristic);
  EXPECT_EQ(r.runs.front().config, r.choice.heuristic);
  bool found = false;
  for (const MoeCandidateRun& run : r.runs) {
    std::printf("  %-44s %-22s %9.2f us  nmse %.2e %s\n", r.key.str().c_str(), run.config.str().c_str(), run.us,
                run.nmse, run.note.c_str());
    if (run.config == r.choice.winner) {
      found = true;
      EXPECT_TRUE(run.valid);
      EXPECT_DOUBLE_EQ(run.us, r.choice.winner_us);
    }
    // Every configuration the kernels run is a correct one: all pass the check on these inputs.
    EXPECT_TRUE(run.valid) << run.config.str() << ": " << run.note;
  }
  EXPECT_TRUE(found) << "the winner " << r.choice.winner.str() << " is not among the runs";
  EXPECT_LE(r.choice.winner_us, r.choice.heuristic_us);
  EXPECT_GT(r.choice.heuristic_us, 0.0);
}

TEST(MoeAutotune, WarmRestartTunesNothing) {
  MOEBIUS_REQUIRE_GPU();
  TempDir tmp;
  auto seed = dummy_seed(moe::KernelFormat::kNvFp4);
  ASSERT_TRUE(seed);
  auto buckets = CapacityBuckets::make(8, 1, 64);  // 1, 2, 4, 8, 64
  ASSERT_TRUE(buckets.ok());
  const auto combine = kernels::MoeCombineMode::kStore;

  std::vector<MoeTuneChoice> first;
  {
    auto tuner = MoeAutotuner::create(quick(tmp.path()));
    ASSERT_TRUE(tuner.ok()) << tuner.error().what();
    for (int b : buckets->sizes()) {
      auto r = (*tuner)->tune(*seed, b, combine);
      ASSERT_TRUE(r.ok()) << r.error().what();
      EXPECT_FALSE(r->from_cache);
      expect_sane(*r);
      first.push_back(r->choice);
    }
    EXPECT_EQ((*tuner)->tuning_runs(), static_cast<int64_t>(buckets->size()));
    EXPECT_GT((*tuner)->candidates_timed(), (*tuner)->tuning_runs());
    // Asking again in the same process is a memory hit.
    auto again = (*tuner)->tune(*seed, 4, combine);
    ASSERT_TRUE(again.ok());
    EXPECT_TRUE(again->from_cache);
    EXPECT_EQ((*tuner)->tuning_runs(), static_cast<int64_t>(buckets->size()));
    EXPECT_TRUE(fs::exists((*tuner)->cache().path()));
    std::printf("cache file %s\n", (*tuner)->cache().path().c_str());
  }
  // A new tuner (a restarted process) over the same directory: zero tuning runs, same choices.
  auto warm = MoeAutotuner::create(quick(tmp.path()));
  ASSERT_TRUE(warm.ok());
  for (size_t i = 0; i < buckets->size(); ++i) {
    auto r = (*warm)->tune(*seed, buckets->sizes()[i], combine);
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE(r->from_cache);
    EXPECT_TRUE(r->runs.empty());
    EXPECT_EQ(r->choice.winner, first[i].winner);
    EXPECT_EQ(r->choice.heuristic, first[i].heuristic);
  }
  EXPECT_EQ((*warm)->tuning_runs(), 0);
  EXPECT_EQ((*warm)->candidates_timed(), 0);
  // Another combine mode or format is another key: that one tunes.
  auto r = (*warm)->tune(*seed, 1, kernels::MoeCombineMode::kAtomic);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->from_cache);
  EXPECT_EQ((*warm)->tuning_runs(), 1);
}

TEST(MoeAutotune, ACandidateThatDisagreesWithTheReferenceCannotWin) {
  MOEBIUS_REQUIRE_GPU();
  TempDir tmp;
  auto seed = dummy_seed(moe::KernelFormat::kInt4);
  ASSERT_TRUE(seed);
  MoeAutotunerOptions o = quick(tmp.path());
  o.persist = false;
  o.max_nmse = -1.0;  // no output can pass: only the reference itself may win
  o.min_gain = -1e9;  // and any candidate would win on time alone
  auto tuner = MoeAutotuner::create(o);
  ASSERT_TRUE(tuner.ok());
  for (int b : {1, 64}) {
    auto r = (*tuner)->tune(*seed, b, kernels::MoeCombineMode::kStore);
    ASSERT_TRUE(r.ok()) << r.error().what();
    EXPECT_EQ(r->choice.winner, r->choice.heuristic);
    ASSERT_GT(r->runs.size(), 1u);
    for (size_t i = 1; i < r->runs.size(); ++i) {
      EXPECT_FALSE(r->runs[i].valid) << r->runs[i].config.str();
      EXPECT_NE(r->runs[i].note.find("rejected"), std::string::npos);
    }
  }
  EXPECT_FALSE(fs::exists(cache_file_path(tmp.path(), (*tuner)->device().uuid)));  // persist = false
}

// ---- the workspace pool on real layers ----------------------------------------------------------

std::vector<uint16_t> forward_bits(moe::MoeLayerCuda& layer, const DeviceBuffer<__nv_bfloat16>& x, int T) {
  CudaStream s;
  DeviceBuffer<__nv_bfloat16> out(static_cast<size_t>(layer.capacity()) * layer.shape().hidden);
  DeviceBuffer<int32_t> n(1);
  CUDA_CHECK(cudaMemcpy(n.data(), &T, 4, cudaMemcpyHostToDevice));
  out.poison(0xFF, s);
  layer.forward(x.data(), n.data(), out.data(), s);
  s.sync();
  std::vector<uint16_t> bits(static_cast<size_t>(T) * layer.shape().hidden);
  CUDA_CHECK(cudaMemcpy(bits.data(), out.data(), bits.size() * 2, cudaMemcpyDeviceToHost));
  return bits;
}

DeviceBuffer<__nv_bfloat16> random_input(int T, int64_t H, uint32_t seed) {
  std::vector<uint16_t> x(static_cast<size_t>(T * H));
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (auto& v : x) v = float_to_bf16_bits(d(rng));
  DeviceBuffer<__nv_bfloat16> dx(x.size());
  dx.upload(x);
  return dx;
}

TEST(MoeWorkspacePoolGpu, LayersShareOneWorkspaceCountedTwoOneZero) {
  MOEBIUS_REQUIRE_GPU();
  auto pool = std::make_shared<moe::MoeWorkspacePool>();
  moe::MoeCudaOptions o;
  o.capacity = 64;
  o.workspace_pool = pool;
  // Two "model layers" of one geometry (different weights) and one layer of another capacity.
  auto a = moe::MoeLayerCuda::create_dummy(kShape, moe::KernelFormat::kNvFp4, 0, o, 1);
  auto b = moe::MoeLayerCuda::create_dummy(kShape, moe::KernelFormat::kNvFp4, 0, o, 2);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ((*a)->topk_ids(), (*b)->topk_ids());  // one workspace
  EXPECT_EQ(pool->live_blocks(), 1u);
  EXPECT_EQ(pool->live_bytes(), (*a)->workspace_bytes());
  moe::MoeCudaOptions big = o;
  big.capacity = 512;
  auto c = (*a)->share_weights(big);
  ASSERT_TRUE(c.ok());
  EXPECT_NE((*c)->topk_ids(), (*a)->topk_ids());
  EXPECT_EQ(pool->live_blocks(), 2u);
  EXPECT_EQ(pool->holders(), 3);
  (*c).reset();
  EXPECT_EQ(pool->live_blocks(), 1u);

  // A layer's output does not depend on what the other left in the shared workspace (store mode
  // is bit-identical run to run).
  const auto x = random_input(64, kShape.hidden, 5);
  const auto a1 = forward_bits(**a, x, 64);
  const auto b1 = forward_bits(**b, x, 64);
  (void)forward_bits(**a, x, 37);  // a smaller live count in between
  const auto b2 = forward_bits(**b, x, 64);
  const auto a2 = forward_bits(**a, x, 64);
  EXPECT_NE(a1, b1);
  EXPECT_EQ(a1, a2);
  EXPECT_EQ(b1, b2);

  // 2 -> 1 -> 0 holders as the layers go; the block is freed with the last one.
  EXPECT_EQ(pool->holders(), 2);
  (*a).reset();
  EXPECT_EQ(pool->holders(), 1);
  EXPECT_EQ(pool->live_blocks(), 1u);
  (*b).reset();
  EXPECT_EQ(pool->holders(), 0);
  EXPECT_EQ(pool->live_blocks(), 0u);
  EXPECT_EQ(pool->live_bytes(), 0u);
}

// ---- per-bucket layer sets ----------------------------------------------------------------------

float round_bf16(float v) { return bf16_bits_to_float(float_to_bf16_bits(v)); }

cpu::MoeLayerReference make_reference(uint64_t seed) {
  std::mt19937_64 rng(seed);
  cpu::MoeLayerReference L;
  L.shape = kShape;
  L.router.num_experts = kShape.num_experts;
  L.router.top_k = kShape.top_k;
  L.router_weight.resize(static_cast<size_t>(kShape.num_experts * kShape.hidden));
  std::normal_distribution<float> rd(0.0f, 1.0f / std::sqrt(static_cast<float>(kShape.hidden)));
  for (auto& v : L.router_weight) v = round_bf16(rd(rng));
  auto mat = [&](int64_t rows, int64_t cols) {
    std::normal_distribution<float> d(0.0f, 1.0f / std::sqrt(static_cast<float>(cols)));
    std::vector<float> w(static_cast<size_t>(rows * cols));
    for (auto& v : w) v = d(rng);
    auto m = quantize(WeightFormat::kNvFp4, w.data(), rows, cols, 16);
    EXPECT_TRUE(m.ok());
    return std::move(m).value();
  };
  for (int e = 0; e < kShape.num_experts; ++e)
    L.experts.push_back({mat(kShape.intermediate, kShape.hidden), mat(kShape.intermediate, kShape.hidden),
                         mat(kShape.hidden, kShape.intermediate)});
  return L;
}

TEST(MoeLayerSetGpu, TunedPooledBucketLayersMatchTheCpuOracle) {
  MOEBIUS_REQUIRE_GPU();
  TempDir tmp;
  MoeLayerFactoryOptions fo;
  fo.max_decode_batch = 4;
  fo.prefill_chunk = 48;  // buckets 1, 2, 4, 48 (48 tuned as 64)
  fo.autotune = true;
  fo.tuner = quick(tmp.path());
  auto f = MoeLayerFactory::create(fo);
  ASSERT_TRUE(f.ok()) << f.error().what();
  const auto ref0 = make_reference(11), ref1 = make_reference(12);
  auto s0 = (*f)->make(ref0);
  ASSERT_TRUE(s0.ok()) << s0.error().what();
  const int64_t runs_after_first = (*f)->tuner()->tuning_runs();
  EXPECT_EQ(runs_after_first, 4);
  auto s1 = (*f)->make(ref1);  // a second model layer of the same geometry: no tuning
  ASSERT_TRUE(s1.ok());
  EXPECT_EQ((*f)->tuner()->tuning_runs(), runs_after_first);
  ASSERT_EQ(s0->size(), 4u);
  EXPECT_EQ((*f)->pool().live_blocks(), 4u);  // one workspace per bucket, shared by both sets
  for (size_t i = 0; i < s0->size(); ++i) {
    EXPECT_EQ(s0->layer(i).capacity(), (*f)->buckets().sizes()[i]);
    EXPECT_EQ(s0->layer(i).topk_ids(), s1->layer(i).topk_ids());
    const moe::MoeCudaOptions& o = (*f)->bucket_options()[i];
    std::printf("bucket %d: %s bm=%d fused=%d\n", s0->layer(i).capacity(), moe::moe_gemm_path_name(s0->layer(i).gemm_path()),
                s0->layer(i).block_m(), s0->layer(i).fused_routing());
    EXPECT_EQ(o.capacity, s0->layer(i).capacity());
  }
  EXPECT_EQ(&s0->for_tokens(3), &s0->layer(2));
  EXPECT_EQ(&s0->for_tokens(5), &s0->layer(3));
  EXPECT_FALSE(s0->find(49).ok());

  // Every bucket's layer against the CPU oracle on its own routing, for a few token counts.
  for (int T : {1, 3, 17, 48}) {
    moe::MoeLayerCuda& L = s0->for_tokens(T);
    const auto x = random_input(T, kShape.hidden, 100 + T);
    const auto out = forward_bits(L, x, T);
    std::vector<int32_t> ids(static_cast<size_t>(T) * kShape.top_k);
    std::vector<float> w(ids.size());
    CUDA_CHECK(cudaMemcpy(ids.data(), L.topk_ids(), 4 * ids.size(), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(w.data(), L.topk_weights(), 4 * w.size(), cudaMemcpyDeviceToHost));
    std::vector<uint16_t> xh(static_cast<size_t>(T) * kShape.hidden);
    CUDA_CHECK(cudaMemcpy(xh.data(), x.data(), xh.size() * 2, cudaMemcpyDeviceToHost));
    std::vector<float> xf(xh.size()), got(out.size()), want(out.size());
    for (size_t i = 0; i < xh.size(); ++i) xf[i] = bf16_bits_to_float(xh[i]);
    for (size_t i = 0; i < out.size(); ++i) got[i] = bf16_bits_to_float(out[i]);
    ASSERT_TRUE(cpu::moe_experts_reference(kShape, ref0.experts, ref0.options, xf.data(), T, ids.data(), w.data(),
                                           want.data())
                    .ok());
    const double e = testing::nmse(got.data(), want.data(), got.size());
    std::printf("  T=%d on bucket %d (%s bm=%d): nmse %.2e\n", T, L.capacity(), moe::moe_gemm_path_name(L.gemm_path()),
                L.block_m(), e);
    EXPECT_LT(e, 5e-5) << "T=" << T;  // tests/gpu/test_moe_layer.cu kNmseBound
  }
  // A second factory over the same cache (a restart): the sets come without any tuning run.
  auto g = MoeLayerFactory::create(fo);
  ASSERT_TRUE(g.ok());
  auto s2 = (*g)->make(ref0);
  ASSERT_TRUE(s2.ok());
  EXPECT_EQ((*g)->tuner()->tuning_runs(), 0);
  for (size_t i = 0; i < s2->size(); ++i) {
    EXPECT_EQ(s2->layer(i).gemm_path(), s0->layer(i).gemm_path());
    EXPECT_EQ(s2->layer(i).block_m(), s0->layer(i).block_m());
    EXPECT_EQ(s2->layer(i).fused_routing(), s0->layer(i).fused_routing());
  }
}

// ---- the model ----------------------------------------------------------------------------------

TEST(Qwen3MoeCudaAutotune, ModelWithAutotuningWritesTheCacheAndMatchesTheHeuristicModel) {
  MOEBIUS_REQUIRE_GPU();
  TempDir tmp;
  const std::string dir = testing::test_data_dir() + "/tiny-qwen3-moe";
  auto logits_of = [&](bool autotune) {
    model::Qwen3MoeCudaOptions o;
    o.experts_format = WeightFormat::kNvFp4;
    o.max_tokens = 32;
    o.max_seqs = 2;
    o.max_logit_rows = 32;
    o.max_context = 64;
    o.graph_batches = {1, 2};
    o.autotune = autotune;
    o.tune_cache_dir = tmp.path();
    auto m = model::Qwen3MoeCuda::load(dir, o);
    EXPECT_TRUE(m.ok()) << m.error().what();
    std::vector<float> all;
    if (!m.ok()) return all;
    model::BlockAllocator blocks((*m)->num_blocks());
    std::vector<int32_t> table;
    EXPECT_TRUE(blocks.ensure(table, 20, (*m)->block_size()).ok());
    const std::vector<int32_t> ids = {1, 5, 9, 200, 7, 3, 11, 42, 8, 100, 4, 6};
    const size_t V = static_cast<size_t>((*m)->config().vocab_size);
    std::vector<float> lg(V);
    const model::SequenceStep pre{ids, 0, table};
    auto b = (*m)->make_batch(std::span<const model::SequenceStep>(&pre, 1));
    EXPECT_TRUE(b.ok());
    EXPECT_TRUE((*m)->forward(*b, lg.data()).ok());
    all.insert(all.end(), lg.begin(), lg.end());
    for (int s = 0; s < 3; ++s) {  // decode steps: the batch-1 graph
      const int32_t id = 17 + s;
      const model::SequenceStep d{std::span<const int32_t>(&id, 1), 12 + s, table};
      auto db = (*m)->make_batch(std::span<const model::SequenceStep>(&d, 1));
      EXPECT_TRUE(db.ok());
      EXPECT_TRUE((*m)->forward(*db, lg.data()).ok());
      all.insert(all.end(), lg.begin(), lg.end());
    }
    return all;
  };
  const std::vector<float> plain = logits_of(false);
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(tmp.path())) files += e.path().extension() == ".json";
  EXPECT_EQ(files, 0u);
  const std::vector<float> tuned = logits_of(true);
  ASSERT_EQ(plain.size(), tuned.size());
  ASSERT_FALSE(plain.empty());
  for (float v : tuned) ASSERT_TRUE(std::isfinite(v));
  const double e = testing::nmse(tuned.data(), plain.data(), plain.size());
  std::printf("tuned vs heuristic model logits: nmse %.2e\n", e);
  EXPECT_LT(e, 1e-3);  // test_qwen3_moe_cuda.cu's kMaxNmse; paths differ in bf16 rounding only
  files = 0;
  for (const auto& f : fs::directory_iterator(tmp.path())) files += f.path().extension() == ".json";
  EXPECT_EQ(files, 1u) << "one cache file for this GPU";
}

}  // namespace
}  // namespace moebius::tune
