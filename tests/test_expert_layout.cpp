// The repack into the CUDA tile layout ([TAG_EXPERT_TILE_LAYOUT]) must be lossless: unpacking the
// packed bytes gives exactly the checkpoint's dequantized values, and padding is exactly zero.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "core/dtype.h"
#include "moe/expert_layout.h"

namespace moebius::moe {
namespace {

QuantMatrix random_matrix(WeightFormat f, int64_t rows, int64_t cols, int group, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 0.5f);
  std::vector<float> w(static_cast<size_t>(rows * cols));
  for (auto& v : w) v = d(rng);
  auto m = quantize(f, w.data(), rows, cols, group);
  EXPECT_TRUE(m.ok()) << m.error().what();
  return std::move(m).value();
}

struct LayoutCase {
  const char* name;
  WeightFormat format;
  int64_t rows, cols;
  int group;
};

class ExpertLayoutRoundTrip : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(ExpertLayoutRoundTrip, PackMatrixIsLossless) {
  const auto& c = GetParam();
  QuantMatrix m = random_matrix(c.format, c.rows, c.cols, c.group, 11);
  auto p = pack_matrix(m);
  ASSERT_TRUE(p.ok()) << p.error().what();
  EXPECT_EQ(p->rows_padded % 16, 0);
  EXPECT_EQ(p->cols_padded % chunk_k(p->format), 0);
  std::vector<float> ref(static_cast<size_t>(c.rows * c.cols)), got(static_cast<size_t>(p->rows_padded * p->cols_padded), -1.0f);
  dequantize_rows(m, 0, c.rows, ref.data());
  unpack_to_float(*p, got.data());
  for (int64_t r = 0; r < p->rows_padded; ++r)
    for (int64_t k = 0; k < p->cols_padded; ++k) {
      const float want = (r < c.rows && k < c.cols) ? ref[r * c.cols + k] : 0.0f;
      ASSERT_EQ(got[r * p->cols_padded + k], want) << c.name << " row " << r << " k " << k;
    }
}

TEST_P(ExpertLayoutRoundTrip, PackGateUpInterleavesByEightRows) {
  const auto& c = GetParam();
  QuantMatrix gate = random_matrix(c.format, c.rows, c.cols, c.group, 21);
  QuantMatrix up = random_matrix(c.format, c.rows, c.cols, c.group, 22);
  auto p = pack_gate_up(gate, up);
  ASSERT_TRUE(p.ok()) << p.error().what();
  const int64_t I8 = (c.rows + 7) / 8 * 8;
  EXPECT_EQ(p->rows, 2 * I8);
  std::vector<float> g(static_cast<size_t>(c.rows * c.cols)), u(g.size());
  dequantize_rows(gate, 0, c.rows, g.data());
  dequantize_rows(up, 0, c.rows, u.data());
  std::vector<float> got(static_cast<size_t>(p->rows_padded * p->cols_padded));
  unpack_to_float(*p, got.data());
  for (int64_t r = 0; r < p->rows_padded; ++r) {
    const int64_t i = (r / 16) * 8 + (r % 8);
    const bool is_up = (r % 16) >= 8;
    for (int64_t k = 0; k < p->cols_padded; ++k) {
      float want = 0.0f;
      if (i < c.rows && k < c.cols) want = (is_up ? u : g)[i * c.cols + k];
      ASSERT_EQ(got[r * p->cols_padded + k], want) << c.name << " row " << r << " k " << k;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    ExpertLayout, ExpertLayoutRoundTrip,
    ::testing::Values(LayoutCase{"bf16", WeightFormat::kBF16, 48, 64, 0},
                      LayoutCase{"bf16_odd", WeightFormat::kBF16, 13, 29, 0},
                      LayoutCase{"nvfp4", WeightFormat::kNvFp4, 32, 128, 16},
                      LayoutCase{"nvfp4_odd_rows_k48", WeightFormat::kNvFp4, 21, 48, 16},
                      LayoutCase{"int4_g128", WeightFormat::kInt4, 40, 256, 128},
                      LayoutCase{"int4_g32", WeightFormat::kInt4, 16, 96, 32},
                      LayoutCase{"int4_perchannel", WeightFormat::kInt4, 24, 192, -1},
                      LayoutCase{"int2_g128", WeightFormat::kInt2, 33, 384, 128},
                      LayoutCase{"int2_g64", WeightFormat::kInt2, 16, 192, 64}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(ExpertLayout, RefusesWhatTheKernelsCannotRun) {
  QuantMatrix i8 = random_matrix(WeightFormat::kInt8, 16, 64, 32, 1);
  EXPECT_THAT(pack_matrix(i8).error().what(), ::testing::HasSubstr("int8"));
  QuantMatrix a = random_matrix(WeightFormat::kInt4, 16, 128, 128, 1);
  QuantMatrix b = random_matrix(WeightFormat::kInt4, 16, 128, 64, 2);
  EXPECT_THAT(pack_gate_up(a, b).error().what(), ::testing::HasSubstr("must match"));
}

// A MoE layer of 4 experts, H = 64, I = 32, in `f`.
cpu::MoeLayerReference random_layer(WeightFormat f, int group) {
  cpu::MoeLayerReference L;
  L.shape = cpu::MoeShape{64, 32, 4, 2};
  L.router.num_experts = 4;
  L.router.top_k = 2;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> d(0.0f, 0.5f);
  L.router_weight.resize(4 * 64);
  for (auto& v : L.router_weight) v = d(rng);
  for (int e = 0; e < 4; ++e)
    L.experts.push_back({random_matrix(f, 32, 64, group, 100 + 3 * e), random_matrix(f, 32, 64, group, 101 + 3 * e),
                         random_matrix(f, 64, 32, group, 102 + 3 * e)});
  return L;
}

// pack_moe_layer is what MoeLayerCuda uploads at creation and on a weight update: exactly the
// per-expert packs, the router in bf16 and in the tile layout.
TEST(ExpertLayout, PackMoeLayerPacksEveryExpertAndTheRouter) {
  const cpu::MoeLayerReference L = random_layer(WeightFormat::kNvFp4, 16);
  auto p = pack_moe_layer(L);
  ASSERT_TRUE(p.ok()) << p.error().what();
  EXPECT_EQ(p->format, KernelFormat::kNvFp4);
  ASSERT_EQ(p->w13.size(), 4u);
  ASSERT_EQ(p->w2.size(), 4u);
  for (int e = 0; e < 4; ++e) {
    const auto& x = L.experts[static_cast<size_t>(e)];
    auto a = pack_gate_up(x.gate, x.up);
    auto b = pack_matrix(x.down);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(p->w13[static_cast<size_t>(e)].weight, a->weight) << e;
    EXPECT_EQ(p->w13[static_cast<size_t>(e)].scales, a->scales) << e;
    EXPECT_EQ(p->w13[static_cast<size_t>(e)].global_scale[1], a->global_scale[1]) << e;
    EXPECT_EQ(p->w2[static_cast<size_t>(e)].weight, b->weight) << e;
    EXPECT_EQ(p->w2[static_cast<size_t>(e)].scales, b->scales) << e;
  }
  ASSERT_EQ(p->router.size(), L.router_weight.size());
  for (size_t i = 0; i < p->router.size(); ++i) ASSERT_EQ(p->router[i], float_to_bf16_bits(L.router_weight[i]));
  std::vector<float> tiles(static_cast<size_t>(p->router_tiles.rows_padded * p->router_tiles.cols_padded));
  unpack_to_float(p->router_tiles, tiles.data());
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t k = 0; k < 64; ++k)
      ASSERT_EQ(tiles[static_cast<size_t>(r * p->router_tiles.cols_padded + k)],
                bf16_bits_to_float(p->router[static_cast<size_t>(r * 64 + k)]));
}

TEST(ExpertLayout, PackMoeLayerRefusesExpertsOfMixedFormats) {
  cpu::MoeLayerReference L = random_layer(WeightFormat::kInt4, 32);
  L.experts[2].down = random_matrix(WeightFormat::kInt4, 64, 32, 16, 9);  // another group size
  auto p = pack_moe_layer(L);
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(p.error().what(), ::testing::HasSubstr("expert 2"));
}

}  // namespace
}  // namespace moebius::moe
