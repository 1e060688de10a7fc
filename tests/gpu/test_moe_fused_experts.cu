// The fused decode experts (kernels/moe_fused_experts.cuh: GEMM1, GEMM2 and the combine in one
// persistent kernel) against the three separate kernels it replaces, bit for bit, and against the
// CPU oracle, on fresh random inputs with poisoned outputs: every format it runs, the Qwen3-30B-A3B
// widths and odd ones, 1 to 8 tokens at full and partial capacity, skewed routing (all tokens on
// one expert, every token on the same k experts, empty experts), repeated launches (the kernel
// must leave its counters zeroed) and one CUDA graph replayed for every token count.
#include "gpu/gpu_test_util.h"  // first: see the fmt note there

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/moe_layer.h"
#include "gpu/moe_layer_test_util.h"
#include "kernels/moe_fused_experts.cuh"
#include "kernels/moe_route.cuh"
#include "moe/moe_layer_cuda.h"

namespace moebius::moe {
namespace {

using namespace moe_test;

bool device_is_sm90() {
  int dev = 0, major = 0;
  return cudaGetDevice(&dev) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9;
}

// The same layer twice: fused experts (which must be what the layer runs on sm_90) and separate.
struct Pair {
  std::unique_ptr<MoeLayerCuda> fused, separate;
};
Pair make_pair_of_layers(const cpu::MoeLayerReference& L, int capacity) {
  MoeCudaOptions opt;
  opt.capacity = capacity;
  opt.gemm_path = MoeGemmPath::kDecode;
  opt.fuse_experts = true;
  Pair p;
  auto f = MoeLayerCuda::create(L, opt);
  EXPECT_TRUE(f.ok()) << f.error().what();
  opt.fuse_experts = false;
  auto s = MoeLayerCuda::create(L, opt);
  EXPECT_TRUE(s.ok()) << s.error().what();
  if (f.ok()) p.fused = std::move(*f);
  if (s.ok()) p.separate = std::move(*s);
  return p;
}

std::string label(WeightFormat f, const Geometry& g, int cap, int64_t T) {
  return std::string(weight_format_name(f)) + " H=" + std::to_string(g.H) + " I=" + std::to_string(g.I) +
         " E=" + std::to_string(g.E) + " k=" + std::to_string(g.k) + " cap=" + std::to_string(cap) +
         " T=" + std::to_string(T);
}

void expect_same_bits(const LayerRun& a, const LayerRun& b, const std::string& what) {
  ASSERT_EQ(a.out.size(), b.out.size()) << what;
  EXPECT_EQ(0, std::memcmp(a.out.data(), b.out.data(), a.out.size() * 2)) << what << ": fused differs from separate";
}

TEST(MoeFusedExpertsGpu, BitIdenticalToSeparateKernelsAndMatchesOracle) {
  MOEBIUS_REQUIRE_GPU();
  if (!device_is_sm90()) GTEST_SKIP() << "the fused experts kernel needs sm_90";
  struct Case {
    Geometry g;
    bool oracle;  // the double-precision oracle over 128 experts at H = 2048 costs a minute
    bool int2;    // int2 needs H and I to be multiples of 16
  };
  // Qwen3-30B-A3B (GEMM2 items of two experts); odd widths (H = 336: 21 GEMM2 output row tiles over
  // the blocks, I = 208: 26 GEMM1 row tiles per expert); H = 136, not a multiple of 16 (a partial
  // last output row tile, int4 only); few experts (tiles shared by tokens).
  // I = 1536 is Qwen3-235B-A22B's (the int2 GEMM2 at 12 chunks: six K ranges of two).
  for (const Case& c : {Case{{2048, 768, 128, 8}, false, true}, Case{{1024, 1536, 16, 4}, true, true},
                        Case{{336, 208, 16, 4}, true, true}, Case{{136, 64, 8, 2}, true, false},
                        Case{{128, 64, 8, 2}, true, true}}) {
    for (WeightFormat f : {WeightFormat::kNvFp4, WeightFormat::kInt4, WeightFormat::kInt2}) {
      if ((f == WeightFormat::kInt2 && !c.int2) || (f == WeightFormat::kNvFp4 && c.g.H % 16 != 0)) continue;
      const int group = f == WeightFormat::kNvFp4 ? 16 : (c.g.H >= 1024 ? 128 : 16);
      const cpu::MoeLayerReference L = make_layer(f, c.g, group, 71);
      for (int cap : c.g.H >= 2048 ? std::vector<int>{1, 4} : std::vector<int>{1, 3, 8}) {
        Pair p = make_pair_of_layers(L, cap);
        ASSERT_TRUE(p.fused && p.separate);
        ASSERT_TRUE(p.fused->fused_experts()) << label(f, c.g, cap, cap) << ": the layer did not take the fused kernel";
        ASSERT_FALSE(p.separate->fused_experts());
        const std::vector<int64_t> counts = cap == 1 ? std::vector<int64_t>{1}
                                            : cap == 3 ? std::vector<int64_t>{1, 2, 3}
                                                       : std::vector<int64_t>{1, cap / 2 + 1, cap};
        for (int64_t T : counts) {
          const auto x = random_x(T, c.g.H, 300 + T + cap);
          const std::string what = label(f, c.g, cap, T);
          const LayerRun a = run_gpu(*p.fused, x, T), b = run_gpu(*p.separate, x, T);
          ASSERT_EQ(a.ids, b.ids) << what;
          expect_same_bits(a, b, what);
          if (c.oracle) expect_matches_oracle(L, x, T, a.ids, a.weights, a.out, what);
          // Launched again on other tokens: had the first launch left its counters set, this one
          // would pass its grid-wide wait at once and stage the first launch's h.
          const auto x2 = random_x(T, c.g.H, 900 + T + cap);
          const LayerRun a2 = run_gpu(*p.fused, x2, T), b2 = run_gpu(*p.separate, x2, T);
          expect_same_bits(a2, b2, what + " (second launch, other tokens)");
        }
      }
    }
  }
}

// Skewed routing through forward_routed: every token on expert 3 plus distinct others; every token
// on the same k experts (k full tiles, the rest empty); only even experts used; one token.
TEST(MoeFusedExpertsGpu, SkewedAndEmptyExperts) {
  MOEBIUS_REQUIRE_GPU();
  if (!device_is_sm90()) GTEST_SKIP() << "the fused experts kernel needs sm_90";
  const Geometry g{512, 256, 64, 8};
  for (WeightFormat f : {WeightFormat::kNvFp4, WeightFormat::kInt4, WeightFormat::kInt2}) {
    const cpu::MoeLayerReference L = make_layer(f, g, f == WeightFormat::kNvFp4 ? 16 : 128, 13);
    Pair p = make_pair_of_layers(L, 8);
    ASSERT_TRUE(p.fused && p.separate && p.fused->fused_experts());
    for (int pattern = 0; pattern < 3; ++pattern) {
      for (int64_t T : {8, 5, 1}) {
        const auto x = random_x(T, g.H, 90 + T + pattern);
        std::vector<int32_t> ids(static_cast<size_t>(T * g.k));
        std::vector<float> w(ids.size());
        std::mt19937 rng(static_cast<uint32_t>(pattern * 10 + T));
        for (int64_t t = 0; t < T; ++t)
          for (int j = 0; j < g.k; ++j) {
            ids[t * g.k + j] = pattern == 0   ? (j == 0 ? 3 : (3 + j * 7 + static_cast<int>(t)) % g.E)
                               : pattern == 1 ? j
                                              : static_cast<int32_t>((2 * (t + j * 5)) % g.E);
            w[t * g.k + j] = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
          }
        const std::string what = label(f, g, 8, T) + " pattern " + std::to_string(pattern);
        const LayerRun a = run_gpu(*p.fused, x, T, ids.data(), w.data());
        const LayerRun b = run_gpu(*p.separate, x, T, ids.data(), w.data());
        expect_same_bits(a, b, what);
        expect_matches_oracle(L, x, T, ids, w, a.out, what);
      }
    }
  }
}

// [TAG_MOE_GRAPH_CAPACITY] One capture at capacity 4 (the most Qwen3-30B-A3B nvfp4 fits) replayed
// for 4, 1, 0, 3 and 2 tokens: each replay equals the separate kernels' forward of the same
// tokens, rows past T stay poisoned.
TEST(MoeFusedExpertsGpu, OneGraphServesEveryTokenCount) {
  MOEBIUS_REQUIRE_GPU();
  if (!device_is_sm90()) GTEST_SKIP() << "the fused experts kernel needs sm_90";
  const Geometry g{2048, 768, 128, 8};
  const cpu::MoeLayerReference L = make_layer(WeightFormat::kNvFp4, g, 16, 29);
  const int cap = 4;
  Pair p = make_pair_of_layers(L, cap);
  ASSERT_TRUE(p.fused && p.separate && p.fused->fused_experts());
  const auto x = random_x(cap, g.H, 5);
  replay_one_graph_per_token_count(*p.fused, x, {4, 1, 0, 3, 2}, [&](int32_t T, const std::vector<uint16_t>& live) {
    if (T == 0) return;
    const std::vector<uint16_t> xs(x.begin(), x.begin() + static_cast<int64_t>(T) * g.H);
    const LayerRun ref = run_gpu(*p.separate, xs, T);
    EXPECT_EQ(0, std::memcmp(live.data(), ref.out.data(), live.size() * 2)) << "graph replay T=" << T;
  });
}

// Asked for, the kernel runs where it applies; elsewhere the layer keeps the separate kernels: bf16
// experts, capacity above 8, the atomic combine; and it is off by default.
TEST(MoeFusedExpertsGpu, LayerFallsBackWhereTheKernelDoesNotApply) {
  MOEBIUS_REQUIRE_GPU();
  const Geometry g{256, 128, 16, 4};
  auto fused_for = [&](WeightFormat f, int cap, bool atomic, bool ask = true) {
    const cpu::MoeLayerReference L = make_layer(f, g, 16, 3);
    MoeCudaOptions opt;
    opt.capacity = cap;
    opt.gemm_path = MoeGemmPath::kDecode;
    if (ask) opt.fuse_experts = true;
    if (atomic) opt.combine = kernels::MoeCombineMode::kAtomic;
    auto layer = MoeLayerCuda::create(L, opt);
    EXPECT_TRUE(layer.ok());
    return layer.ok() && (*layer)->fused_experts();
  };
  EXPECT_EQ(fused_for(WeightFormat::kNvFp4, 8, false), device_is_sm90());
  EXPECT_FALSE(fused_for(WeightFormat::kBF16, 8, false));
  EXPECT_FALSE(fused_for(WeightFormat::kNvFp4, 9, false));
  EXPECT_FALSE(fused_for(WeightFormat::kInt4, 4, true));
  EXPECT_FALSE(fused_for(WeightFormat::kNvFp4, 8, false, /*ask=*/false));
  // The shared-memory plan: Qwen3-30B-A3B nvfp4 (GEMM1 96 row tiles x 32 chunks of K = 2048, GEMM2
  // 128 x 12 of K = 768) fits capacity 4, not 8 (x, h and y of 64 pairs leave under four slots).
  const kernels::MoeGemmDims d13{96, 2048, 32, 0, 0, 768}, d2{128, 768, 12, 0, 0, 2048};
  const auto tiles = [](int cap) { return static_cast<int>(kernels::moe_align_max_tiles(cap, 8, 128, 8)); };
  EXPECT_EQ(kernels::moe_fused_experts_supported(kernels::MoeWeightFormat::kNvFp4, d13, d2, 4, 8, 8, 128, tiles(4)),
            device_is_sm90());
  EXPECT_FALSE(kernels::moe_fused_experts_supported(kernels::MoeWeightFormat::kNvFp4, d13, d2, 8, 8, 8, 128, tiles(8)));
}

}  // namespace
}  // namespace moebius::moe
