// The CUDA MoE layer (router, routing, GEMM1 + SwiGLU, GEMM2, combine) against the CPU reference
// (src/cpu/moe_layer.h) on fresh random inputs, for every expert format, in the style of
// llama.cpp's test-backend-ops: poisoned outputs, normalised MSE with a per-format bound.
#include "gpu/gpu_test_util.h"  // first: see the fmt note there

#include <cmath>
#include <cstring>
#include <random>
#include <string>

#include "core/dtype.h"
#include "cpu/moe_layer.h"
#include "gpu/moe_layer_test_util.h"
#include "moe/moe_layer_cuda.h"

namespace moebius::moe {
namespace {

using namespace moe_test;

// Both expert GEMM paths are checked at every size: the decode kernel (moe_gemm.cuh) and the
// prefill kernel (moe_gemm_prefill.cuh), forced, whatever the automatic choice would be.
// (The wgmma prefill kernels have their own tests: test_moe_wgmma.cu.)
constexpr MoeGemmPath kPaths[] = {MoeGemmPath::kDecode, MoeGemmPath::kPrefill};

struct LayerCase {
  const char* name;
  WeightFormat format;
  int group;
  Geometry g;
  std::vector<int64_t> tokens;
};

class MoeLayerGpu : public ::testing::TestWithParam<LayerCase> {};

TEST_P(MoeLayerGpu, MatchesCpuReference) {
  MOEBIUS_REQUIRE_GPU();
  const auto& c = GetParam();
  const cpu::MoeLayerReference L = make_layer(c.format, c.g, c.group, 17);
  for (int64_t T : c.tokens) {
    const auto x = random_x(T, c.g.H, 100 + T);
    std::vector<int32_t> first_ids;
    std::vector<float> ref;
    for (MoeGemmPath path : kPaths) {
      MoeCudaOptions opt;
      opt.capacity = static_cast<int>(T);
      opt.gemm_path = path;
      auto layer = MoeLayerCuda::create(L, opt);
      ASSERT_TRUE(layer.ok()) << layer.error().what();
      ASSERT_EQ((*layer)->gemm_path(), path);
      const LayerRun r = run_gpu(**layer, x, T);
      if (first_ids.empty()) {
        // Routing: the GPU router (bf16 weights, fp32 sums) against the CPU router on the same
        // logits up to summation order; near-ties may flip, so demand 99% of ids, then check the
        // experts on the GPU's own routing, which isolates the GEMMs from the router.
        std::vector<float> logits(static_cast<size_t>(T * c.g.E));
        const auto xf = to_float(x);
        cpu::router_logits_reference(L.router_weight.data(), xf.data(), T, c.g.H, c.g.E, logits.data());
        std::vector<int32_t> ids(r.ids.size());
        std::vector<float> w(r.ids.size());
        ASSERT_TRUE(cpu::route_reference(L.router, logits.data(), T, ids.data(), w.data()).ok());
        size_t same = 0;
        for (size_t i = 0; i < ids.size(); ++i) same += ids[i] == r.ids[i];
        EXPECT_GE(same, ids.size() * 99 / 100) << "router ids agree on " << same << " of " << ids.size();
        first_ids = r.ids;
        ref = oracle_out(L, x, T, r.ids, r.weights);
      } else {
        // The router does not depend on the GEMM path: same ids, so the same oracle output.
        ASSERT_EQ(first_ids, r.ids);
      }
      expect_close_to(ref, r.out, std::string(c.name) + " T=" + std::to_string(T) + " " + path_label(**layer));
    }
  }
}

// Qwen3-30B-A3B is H=2048, I=768, E=128, k=8; these keep its E and k with smaller H and I so the
// double-precision oracle stays fast.
INSTANTIATE_TEST_SUITE_P(
    MoeLayer, MoeLayerGpu,
    ::testing::Values(
        LayerCase{"bf16_E128_k8", WeightFormat::kBF16, 0, {256, 128, 128, 8}, {1, 2, 3, 8, 16, 64, 256, 1000, 4096}},
        LayerCase{"nvfp4_E128_k8", WeightFormat::kNvFp4, 16, {256, 128, 128, 8}, {1, 2, 3, 8, 16, 64, 256, 1000, 4096}},
        LayerCase{"int4_E128_k8", WeightFormat::kInt4, 128, {256, 128, 128, 8}, {1, 2, 3, 8, 16, 64, 256, 1000, 4096}},
        LayerCase{"int2_E128_k8", WeightFormat::kInt2, 128, {256, 128, 128, 8}, {1, 2, 3, 8, 16, 64, 256, 1000, 4096}},
        LayerCase{"nvfp4_E8_k2", WeightFormat::kNvFp4, 16, {128, 64, 8, 2}, {1, 3, 16, 64, 256, 1000, 4096}},
        LayerCase{"bf16_E8_k2", WeightFormat::kBF16, 0, {128, 64, 8, 2}, {1, 3, 64, 256, 1000, 4096}},
        LayerCase{"int4_E8_k2", WeightFormat::kInt4, 64, {128, 64, 8, 2}, {1, 3, 64, 256, 1000, 4096}},
        LayerCase{"int2_E8_k2", WeightFormat::kInt2, 64, {128, 64, 8, 2}, {1, 3, 64, 256, 1000, 4096}},
        LayerCase{"int4_E64_k2", WeightFormat::kInt4, 128, {256, 256, 64, 2}, {3, 256}},
        LayerCase{"int2_E256_k8", WeightFormat::kInt2, 128, {256, 128, 256, 8}, {1, 64, 1000}},
        LayerCase{"bf16_odd_H129_I67", WeightFormat::kBF16, 0, {129, 67, 16, 4}, {1, 5, 100}},
        LayerCase{"nvfp4_H144_I80", WeightFormat::kNvFp4, 16, {144, 80, 16, 4}, {1, 7, 300}},
        LayerCase{"int4_g32", WeightFormat::kInt4, 32, {128, 96, 16, 2}, {1, 33}},
        // Odd int shapes (int4 needs H, I % 8, int2 % 16): groups that straddle the prefill
        // kernel's 64-k stages and a partial last group (K=200, g=48), padded K chunks (int2
        // K=176 in 256), g=16 (a group every k-step).
        LayerCase{"int4_H200_I80_g48", WeightFormat::kInt4, 48, {200, 80, 8, 2}, {1, 5, 300}},
        LayerCase{"int2_H176_I48_g32", WeightFormat::kInt2, 32, {176, 48, 8, 2}, {1, 5, 300}},
        LayerCase{"int2_g16", WeightFormat::kInt2, 16, {128, 64, 16, 4}, {7, 500}},
        // K = 2048 with 64-token tiles: the decode GEMM1's activation stage would exceed its
        // shared-memory cap, so it reads B from global memory (every smaller case stages it).
        LayerCase{"nvfp4_H2048_unstaged", WeightFormat::kNvFp4, 16, {2048, 64, 16, 2}, {1, 600}},
        LayerCase{"int4_H2048_unstaged", WeightFormat::kInt4, 128, {2048, 64, 16, 2}, {600}}),
    [](const auto& info) { return std::string(info.param.name); });

// Skewed routing through forward_routed, on both GEMM paths: every token to expert 3 (plus its
// other slots to one more expert); half the experts empty; every token to the same k experts
// (300 tokens on each of 4 experts, 60 empty).
TEST(MoeLayerGpuRouted, SkewedAndEmptyExperts) {
  MOEBIUS_REQUIRE_GPU();
  const Geometry g{256, 128, 64, 4};
  for (WeightFormat f : {WeightFormat::kNvFp4, WeightFormat::kInt4, WeightFormat::kInt2, WeightFormat::kBF16}) {
    const cpu::MoeLayerReference L = make_layer(f, g, 128, 5);
    const int64_t T = 300;
    const auto x = random_x(T, g.H, 9);
    for (int pattern = 0; pattern < 3; ++pattern) {
      std::vector<int32_t> ids(static_cast<size_t>(T * g.k));
      std::vector<float> w(ids.size());
      std::mt19937 rng(pattern);
      for (int64_t t = 0; t < T; ++t)
        for (int j = 0; j < g.k; ++j) {
          // pattern 0: slot 0 always expert 3, the rest distinct others; 1: even experts only;
          // 2: slot j always expert j
          ids[t * g.k + j] = pattern == 0   ? (j == 0 ? 3 : (3 + j * 7 + static_cast<int>(t)) % g.E)
                             : pattern == 1 ? static_cast<int32_t>((2 * (t + j * 5)) % g.E)
                                            : j;
          w[t * g.k + j] = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
        }
      const std::vector<float> ref = oracle_out(L, x, T, ids, w);
      const char* name = pattern == 0 ? " hot expert 3" : pattern == 1 ? " odd experts empty" : " all on experts 0-3";
      for (MoeGemmPath path : kPaths) {
        MoeCudaOptions opt;
        opt.capacity = static_cast<int>(T);
        opt.gemm_path = path;
        auto layer = MoeLayerCuda::create(L, opt);
        ASSERT_TRUE(layer.ok()) << layer.error().what();
        const LayerRun r = run_gpu(**layer, x, T, ids.data(), w.data());
        expect_close_to(ref, r.out, std::string(weight_format_name(f)) + name + " " + path_label(**layer));
      }
    }
  }
}

TEST(MoeLayerGpuDeterminism, StoreModeIsBitIdenticalAndAtomicModeIsClose) {
  MOEBIUS_REQUIRE_GPU();
  const Geometry g{512, 256, 128, 8};
  const cpu::MoeLayerReference L = make_layer(WeightFormat::kNvFp4, g, 16, 3);
  for (int64_t T : {200, 1000}) {
    const auto x = random_x(T, g.H, 4);
    for (MoeGemmPath path : kPaths) {
      MoeCudaOptions opt;
      opt.capacity = static_cast<int>(T);
      opt.gemm_path = path;
      auto layer = MoeLayerCuda::create(L, opt);
      ASSERT_TRUE(layer.ok());
      const LayerRun a = run_gpu(**layer, x, T), b = run_gpu(**layer, x, T);
      const std::string label = path_label(**layer) + " T=" + std::to_string(T);
      EXPECT_EQ(0, std::memcmp(a.out.data(), b.out.data(), a.out.size() * 2))
          << "store mode must be bit-identical (" << label << ")";
      opt.combine = kernels::MoeCombineMode::kAtomic;
      auto atomic = MoeLayerCuda::create(L, opt);
      ASSERT_TRUE(atomic.ok());
      const LayerRun c = run_gpu(**atomic, x, T);
      expect_matches_oracle(L, x, T, a.ids, a.weights, c.out, "nvfp4 atomic combine " + label);
    }
  }
}

// [TAG_DECODE_ROW_TILES] The decode GEMMs with several 16-row weight tiles per block are
// bit-identical to one tile per block, for every rows-per-block value, every format (the int
// formats' GEMM1 and int2 only when forced), odd shapes (a row-tile count that R does not divide)
// and the oracle still holds; values outside {0, 1, 2, 4, 8} are refused.
// [TAG_INT_GROUP_STARTS] Group 128 takes the row-tile instances with compile-time group starts
// where the chunks per warp are exact: H = 2048 runs int4 GEMM1 P = 8 and int2 GEMM1 P = 4 (whole
// groups per warp), I = 768 int4 GEMM2 P = 3 (warp ranges starting mid-group); H = 1024 runs int4
// GEMM1 P = 4, against the oracle too.
TEST(MoeLayerGpuDecodeRows, EveryRowsPerBlockIsBitIdentical) {
  MOEBIUS_REQUIRE_GPU();
  // Qwen3-30B-A3B: H=2048, I=768, E=128, k=8; Qwen3-235B-A22B's I = 1536 (the int2 GEMM2 at 12
  // chunks, six warps of two, [TAG_DECODE_INT2_DOWN_WARPS]); and odd widths: I = 208 is 52 GEMM1
  // row tiles, H = 336 is 21 GEMM2 row tiles (neither divisible by 8), int groups of 16.
  for (const Geometry& g : {Geometry{2048, 768, 128, 8}, Geometry{1024, 768, 16, 4}, Geometry{1024, 1536, 16, 4},
                            Geometry{336, 208, 16, 4}}) {
    for (WeightFormat f : {WeightFormat::kNvFp4, WeightFormat::kInt4, WeightFormat::kInt2}) {
      const int group = f == WeightFormat::kNvFp4 ? 16 : (g.H >= 1024 ? 128 : 16);
      const cpu::MoeLayerReference L = make_layer(f, g, group, 41);
      for (int64_t T : {1, 8, 64}) {
        const auto x = random_x(T, g.H, 50 + T);
        MoeCudaOptions opt;
        opt.capacity = static_cast<int>(T);
        opt.gemm_path = MoeGemmPath::kDecode;
        opt.block_m = 8;
        opt.decode_rows_per_block = 1;
        auto one = MoeLayerCuda::create(L, opt);
        ASSERT_TRUE(one.ok()) << one.error().what();
        const LayerRun ref = run_gpu(**one, x, T);
        const std::string label = std::string(weight_format_name(f)) + " H=" + std::to_string(g.H) +
                                  " T=" + std::to_string(T);
        // The CPU oracle over all 128 experts at H = 2048 costs a minute; the small geometry checks
        // it, the Qwen3 widths check bit-identity only.
        if (g.H != 2048) expect_matches_oracle(L, x, T, ref.ids, ref.weights, ref.out, label + " rows=1");
        for (int rows : {0, 2, 4, 8}) {
          opt.decode_rows_per_block = rows;
          auto layer = MoeLayerCuda::create(L, opt);
          ASSERT_TRUE(layer.ok()) << layer.error().what();
          const LayerRun r = run_gpu(**layer, x, T);
          EXPECT_EQ(0, std::memcmp(ref.out.data(), r.out.data(), ref.out.size() * 2))
              << label << " rows=" << rows << " differs from one row tile per block";
        }
      }
    }
  }
  const cpu::MoeLayerReference L = make_layer(WeightFormat::kNvFp4, Geometry{256, 128, 16, 4}, 16, 42);
  for (int bad : {-1, 3, 16}) {
    MoeCudaOptions opt;
    opt.decode_rows_per_block = bad;
    EXPECT_FALSE(MoeLayerCuda::create(L, opt).ok()) << "rows per block " << bad;
  }
}

// The separate routing's top-k and align in one kernel (MoeCudaOptions::fuse_topk_align, capacities
// up to kTopKAlignMaxTokens): the layer runs the kTopKAlign stage in place of kTopK and kAlign
// exactly where the rule says, and its ids, weights and output are the two kernels' bits (and the
// oracle's, on a geometry small enough to run it).
TEST(MoeLayerGpuRouting, TopKAlignKernelMatchesTheTwoKernels) {
  MOEBIUS_REQUIRE_GPU();
  for (const Geometry& g : {Geometry{2048, 768, 128, 8}, Geometry{256, 128, 16, 4}}) {
    const cpu::MoeLayerReference L = make_layer(WeightFormat::kNvFp4, g, 16, 43);
    for (int64_t T : {1, 3, 5, 8, 9, 16}) {
      const auto x = random_x(T, g.H, 60 + T);
      const std::string label = "H=" + std::to_string(g.H) + " T=" + std::to_string(T);
      MoeCudaOptions opt;
      opt.capacity = static_cast<int>(T);
      opt.fuse_routing = false;
      opt.fuse_topk_align = false;
      auto two = MoeLayerCuda::create(L, opt);
      ASSERT_TRUE(two.ok()) << two.error().what();
      EXPECT_FALSE((*two)->uses_stage(MoeStage::kTopKAlign)) << label;
      EXPECT_TRUE((*two)->uses_stage(MoeStage::kTopK) && (*two)->uses_stage(MoeStage::kAlign)) << label;
      const LayerRun ref = run_gpu(**two, x, T);
      opt.fuse_topk_align = true;
      auto one = MoeLayerCuda::create(L, opt);
      ASSERT_TRUE(one.ok()) << one.error().what();
      const bool fused = T <= kTopKAlignMaxTokens;
      EXPECT_EQ(fused, (*one)->uses_stage(MoeStage::kTopKAlign)) << label;
      EXPECT_EQ(!fused, (*one)->uses_stage(MoeStage::kTopK)) << label;
      EXPECT_EQ(!fused, (*one)->uses_stage(MoeStage::kAlign)) << label;
      const LayerRun r = run_gpu(**one, x, T);
      EXPECT_EQ(ref.ids, r.ids) << label;
      EXPECT_EQ(0, std::memcmp(ref.weights.data(), r.weights.data(), ref.weights.size() * 4)) << label;
      EXPECT_EQ(0, std::memcmp(ref.out.data(), r.out.data(), ref.out.size() * 2)) << label;
      if (g.H != 2048) expect_matches_oracle(L, x, T, r.ids, r.weights, r.out, label + " top-k + align");
    }
  }
}

// [TAG_DECODE_SPLIT_K] The decode GEMM1 with 8 warps splitting K (MoeCudaOptions::decode_split_k_warps
// = 8) where it applies (every quantized format at K = 2048, one token tile): against the oracle
// for every rows-per-block value, token counts 1-64 and both int group instances (128:
// compile-time group starts; 32: found at run time), bit-identical run to run, and close to the
// 4-warp kernel at the Qwen3-30B-A3B geometry. Elsewhere the layer resolves it to 4 (and runs the
// 4-warp kernels); values other than 0, 4 and 8 are refused.
TEST(MoeLayerGpuDecodeSplitK, EightWarpsMatchTheOracle) {
  MOEBIUS_REQUIRE_GPU();
  struct Case {
    WeightFormat f;
    int group;
  };
  for (const Case& c : {Case{WeightFormat::kNvFp4, 16}, Case{WeightFormat::kInt4, 128}, Case{WeightFormat::kInt4, 32},
                        Case{WeightFormat::kInt2, 128}, Case{WeightFormat::kInt2, 32}}) {
    // K = 2048: 32 chunks of 64 k, 4 per warp (int2: 16 of 128, 2 per warp); a small E keeps the
    // oracle quick.
    const Geometry g{2048, 256, 16, 4};
    const cpu::MoeLayerReference L = make_layer(c.f, g, c.group, 43);
    for (int64_t T : {1, 2, 3, 8, 64}) {
      const auto x = random_x(T, g.H, 70 + T);
      for (int rows : {0, 1, 2, 4, 8}) {
        MoeCudaOptions opt;
        opt.capacity = static_cast<int>(T);
        opt.gemm_path = MoeGemmPath::kDecode;
        opt.block_m = 8;
        opt.decode_rows_per_block = rows;
        opt.decode_split_k_warps = 8;
        auto layer = MoeLayerCuda::create(L, opt);
        ASSERT_TRUE(layer.ok()) << layer.error().what();
        ASSERT_EQ((*layer)->decode_split_k_warps(), 8);
        const std::string label = fmt::format("{} g={} T={} rows={} warps=8", weight_format_name(c.f), c.group, T, rows);
        const int64_t launches = kernels::moe_gemm_wide_split_launches();
        const LayerRun a = run_gpu(**layer, x, T), b = run_gpu(**layer, x, T);
        EXPECT_EQ(kernels::moe_gemm_wide_split_launches(), launches + 2) << label << ": the 8-warp GEMM1 did not run";
        EXPECT_EQ(0, std::memcmp(a.out.data(), b.out.data(), a.out.size() * 2)) << label << ": not bit-identical run to run";
        expect_matches_oracle(L, x, T, a.ids, a.weights, a.out, label);
      }
    }
  }
  {
    // The Qwen3-30B-A3B geometry: 8 warps against 4 on the same routing (the oracle over 128
    // experts at H = 2048 costs a minute; the small geometry above checks it).
    const Geometry g{2048, 768, 128, 8};
    for (WeightFormat f : {WeightFormat::kNvFp4, WeightFormat::kInt2}) {
      const cpu::MoeLayerReference L = make_layer(f, g, f == WeightFormat::kNvFp4 ? 16 : 128, 44);
      for (int64_t T : {1, 8}) {
        const auto x = random_x(T, g.H, 90 + T);
        MoeCudaOptions opt;
        opt.capacity = static_cast<int>(T);
        opt.gemm_path = MoeGemmPath::kDecode;
        opt.block_m = 8;
        auto four = MoeLayerCuda::create(L, opt);
        opt.decode_split_k_warps = 8;
        auto eight = MoeLayerCuda::create(L, opt);
        ASSERT_TRUE(four.ok() && eight.ok());
        ASSERT_EQ((*four)->decode_split_k_warps(), 4);
        ASSERT_EQ((*eight)->decode_split_k_warps(), 8);
        const int64_t launches = kernels::moe_gemm_wide_split_launches();
        const LayerRun r4 = run_gpu(**four, x, T);
        EXPECT_EQ(kernels::moe_gemm_wide_split_launches(), launches);
        const LayerRun r8 = run_gpu(**eight, x, T);
        EXPECT_EQ(kernels::moe_gemm_wide_split_launches(), launches + 1);
        ASSERT_EQ(r4.ids, r8.ids);
        expect_close_to(to_float(r4.out), r8.out,
                        fmt::format("qwen3-30b {} T={} warps=8 vs 4", weight_format_name(f), T));
      }
    }
  }
  // Where it does not apply the layer runs (and reports) 4 warps.
  const Geometry small{256, 128, 16, 4};
  for (WeightFormat f : {WeightFormat::kInt2, WeightFormat::kBF16, WeightFormat::kNvFp4}) {
    const cpu::MoeLayerReference L = make_layer(f, f == WeightFormat::kBF16 ? Geometry{2048, 128, 16, 4} : small,
                                                f == WeightFormat::kNvFp4 ? 16 : 32, 45);
    MoeCudaOptions opt;
    opt.gemm_path = MoeGemmPath::kDecode;
    opt.decode_split_k_warps = 8;
    auto layer = MoeLayerCuda::create(L, opt);
    ASSERT_TRUE(layer.ok()) << layer.error().what();
    EXPECT_EQ((*layer)->decode_split_k_warps(), 4) << weight_format_name(f);
    const int64_t launches = kernels::moe_gemm_wide_split_launches();
    run_gpu(**layer, random_x(1, L.shape.hidden, 5), 1);
    EXPECT_EQ(kernels::moe_gemm_wide_split_launches(), launches) << weight_format_name(f);
  }
  const cpu::MoeLayerReference L = make_layer(WeightFormat::kNvFp4, Geometry{2048, 128, 16, 4}, 16, 46);
  {
    MoeCudaOptions opt;
    opt.capacity = 256;
    opt.block_m = 32;  // more than one token tile
    opt.gemm_path = MoeGemmPath::kDecode;
    opt.decode_split_k_warps = 8;
    auto layer = MoeLayerCuda::create(L, opt);
    ASSERT_TRUE(layer.ok()) << layer.error().what();
    EXPECT_EQ((*layer)->decode_split_k_warps(), 4);
  }
  for (int bad : {-1, 2, 16}) {
    MoeCudaOptions opt;
    opt.decode_split_k_warps = bad;
    EXPECT_FALSE(MoeLayerCuda::create(L, opt).ok()) << "split-K warps " << bad;
  }
}

// The automatic choice takes the prefill kernels for many tokens per expert (wgmma where the
// build and the device have it), with 128-token tiles for bf16 (and every format on wgmma);
// explicit 128-token tiles on the mma.sync prefill kernel also run nvfp4, and are refused for the
// int formats.
TEST(MoeLayerGpuPath, AutoChoiceAndPrefillTiles128) {
  MOEBIUS_REQUIRE_GPU();
  const Geometry g{256, 128, 128, 8};
  for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kNvFp4, WeightFormat::kInt4}) {
    const cpu::MoeLayerReference L = make_layer(f, g, 128, 21);
    MoeCudaOptions opt;
    opt.capacity = 4096;  // 256 tokens per expert
    auto big = MoeLayerCuda::create(L, opt);
    ASSERT_TRUE(big.ok());
    EXPECT_EQ((*big)->gemm_path(), auto_prefill_path());
    const bool tiles128 = f == WeightFormat::kBF16 || auto_prefill_path() == MoeGemmPath::kPrefillWgmma;
    EXPECT_EQ((*big)->block_m(), tiles128 ? 128 : 64);
    opt.capacity = 64;  // 4 tokens per expert
    auto small = MoeLayerCuda::create(L, opt);
    ASSERT_TRUE(small.ok());
    EXPECT_EQ((*small)->gemm_path(), MoeGemmPath::kDecode);
    opt.capacity = 700;
    opt.block_m = 128;
    opt.gemm_path = MoeGemmPath::kPrefill;
    auto wide = MoeLayerCuda::create(L, opt);
    if (f == WeightFormat::kInt4) {
      EXPECT_FALSE(wide.ok());
      continue;
    }
    ASSERT_TRUE(wide.ok()) << wide.error().what();
    for (int64_t T : {700, 129, 1}) {
      const auto x = random_x(T, g.H, 30 + T);
      const LayerRun r = run_gpu(**wide, x, T);
      expect_matches_oracle(L, x, T, r.ids, r.weights, r.out,
                            std::string(weight_format_name(f)) + " T=" + std::to_string(T) + " " + path_label(**wide));
    }
  }
}

TEST(MoeLayerGpuGraph, OneCaptureServesEveryTokenCount) {
  MOEBIUS_REQUIRE_GPU();
  const Geometry g{256, 128, 128, 8};
  const cpu::MoeLayerReference L = make_layer(WeightFormat::kInt4, g, 128, 8);
  struct GraphCase {
    MoeGemmPath path;
    int cap;
    std::vector<int32_t> tokens;
  };
  // capacity 1024 is 64 tokens per expert: kAuto takes the prefill kernels there (wgmma where
  // available).
  for (const GraphCase& gc : {GraphCase{MoeGemmPath::kDecode, 256, {1, 77, 256, 5}},
                              GraphCase{MoeGemmPath::kPrefill, 256, {1, 77, 256, 5}},
                              GraphCase{MoeGemmPath::kAuto, 1024, {1024, 3, 500, 64}}}) {
    const int cap = gc.cap;
    MoeCudaOptions opt;
    opt.capacity = cap;
    opt.gemm_path = gc.path;
    auto layer = MoeLayerCuda::create(L, opt);
    ASSERT_TRUE(layer.ok());
    if (gc.path == MoeGemmPath::kAuto) EXPECT_EQ((*layer)->gemm_path(), auto_prefill_path());
    const auto x = random_x(cap, g.H, 12);
    replay_one_graph_per_token_count(**layer, x, gc.tokens, [&](int32_t T, const std::vector<uint16_t>& live) {
      expect_last_forward_matches_oracle(L, **layer, x, T, live,
                                         "graph replay T=" + std::to_string(T) + " " + path_label(**layer));
    });
  }
}

}  // namespace
}  // namespace moebius::moe
