// NVFP4 (ModelOpt layout): packing, the scale formula, edge cases and checkpoint loading.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "test_util.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "formats/nvfp4.h"
#include "formats/quant_matrix.h"

namespace moebius {
namespace {

using ::testing::HasSubstr;

constexpr float kE2M1Grid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

using testing::random_normal;

std::vector<float> dequant_all(const QuantMatrix& m) {
  std::vector<float> out(static_cast<size_t>(m.rows * m.cols), -12345.0f);
  dequantize_rows(m, 0, m.rows, out.data());
  return out;
}

// Hand-computed case. amax = 2688 = 6 * 448 makes scale_2 exactly 1, so every block scale is
// block_amax / 6 and every scaled value below is exact.
//   row 0, block 0: the e2m1 grid times 448 (scale 448 = 0x7E), including -0.0
//   row 0, block 1: all zero -> scale 1.0 (0x38), codes 0
//   row 1, block 0: +-1e-6 -> scale 1e-6/6 clamps to 2^-9 (0x01); codes 0 and 8 (-0)
//   row 1, block 1: the round-half-even boundaries times 8 (scale 8 = 0x50)
struct HandCase {
  std::vector<float> w = std::vector<float>(64, 0.0f);
  HandCase() {
    const float grid[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
    for (int i = 0; i < 16; ++i) w[i] = grid[i] * 448.0f;
    w[32] = 1e-6f;
    w[33] = -1e-6f;
    const float ties[16] = {2, 6, 10, 14, 20, 28, 40, 48, -2, -6, -10, -14, -20, -28, -40, -48};
    for (int i = 0; i < 16; ++i) w[48 + i] = ties[i];
  }
};

TEST(Nvfp4Pack, NibbleOrderLowNibbleFirst) {
  uint8_t row[2] = {0, 0};
  nvfp4::set_code(row, 0, 0x3);
  nvfp4::set_code(row, 1, 0xA);
  nvfp4::set_code(row, 2, 0xF);
  EXPECT_EQ(row[0], 0xA3);  // element 0 low, element 1 high
  EXPECT_EQ(row[1], 0x0F);
  EXPECT_EQ(nvfp4::get_code(row, 0), 0x3);
  EXPECT_EQ(nvfp4::get_code(row, 1), 0xA);
  EXPECT_EQ(nvfp4::get_code(row, 2), 0xF);
  nvfp4::set_code(row, 1, 0x1);  // overwrite keeps the neighbour
  EXPECT_EQ(row[0], 0x13);
}

TEST(Nvfp4Quantize, HandComputedKnownAnswer) {
  HandCase h;
  auto m = nvfp4::quantize(h.w.data(), 2, 32);
  ASSERT_TRUE(m.ok()) << m.error().what();
  ASSERT_EQ(m->scale_2.size(), 1u);
  EXPECT_EQ(m->scale_2[0].scale_2, 1.0f);
  const std::vector<uint8_t> scales(m->scales.begin(), m->scales.end());
  EXPECT_EQ(scales, (std::vector<uint8_t>{0x7E, 0x38, 0x01, 0x50}));
  const std::vector<uint8_t> weight(m->weight.begin(), m->weight.end());
  const std::vector<uint8_t> expect = {
      0x10, 0x32, 0x54, 0x76, 0x90, 0xBA, 0xDC, 0xFE,  // row 0 block 0: codes 0..7, 0(-0), 9..15
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // row 0 block 1: zero block
      0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // row 1 block 0: +1e-6 -> 0, -1e-6 -> 8
      0x20, 0x42, 0x64, 0x76, 0xA8, 0xCA, 0xEC, 0xFE,  // row 1 block 1: ties go to even codes
  };
  EXPECT_EQ(weight, expect);

  const std::vector<float> d = dequant_all(*m);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(d[i], h.w[i]) << i;  // the grid round-trips exactly
  for (int i = 16; i < 48; ++i) EXPECT_EQ(d[i], 0.0f) << i;
  const float ties_back[16] = {0, 8, 8, 16, 16, 32, 32, 48, 0, -8, -8, -16, -16, -32, -32, -48};
  for (int i = 0; i < 16; ++i) EXPECT_EQ(d[48 + i], ties_back[i]) << i;
  EXPECT_TRUE(std::signbit(d[32 + 1])) << "code 8 dequantizes to -0.0";
}

TEST(Nvfp4Quantize, ScaleFormulaUsesFp32Division) {
  // [TAG_NVFP4_SCALE_FORMULA]: amax / 2688.0f, not amax * (1 / 2688.0f). The two differ for some
  // inputs, which is why the choice is pinned.
  int differ = 0;
  for (float amax : random_normal(2000, 7, 3.0f)) {
    amax = std::fabs(amax);
    EXPECT_EQ(std::bit_cast<uint32_t>(nvfp4::global_scale(amax)), std::bit_cast<uint32_t>(amax / 2688.0f));
    differ += (amax / 2688.0f) != (amax * (1.0f / 2688.0f));
  }
  EXPECT_GT(differ, 0);
  // block scale: block_amax / (6 * scale_2), then e4m3
  const float s2 = nvfp4::global_scale(3.7f);
  EXPECT_EQ(nvfp4::block_scale_bits(1.3f, s2), float_to_e4m3_bits(1.3f / (6.0f * s2)));
}

TEST(Nvfp4Quantize, ZeroBlockScaleIsOneAndTinyBlocksClampTo2PowMinus9) {
  EXPECT_EQ(nvfp4::block_scale_bits(0.0f, 0.01f), 0x38);       // 1.0
  EXPECT_EQ(nvfp4::block_scale_bits(1e-9f, 0.01f), 0x01);      // 2^-9, the smallest subnormal
  EXPECT_EQ(e4m3_bits_to_float(0x01), 0x1p-9f);
  // Just above the clamp the scale is the rounded quotient itself.
  EXPECT_EQ(nvfp4::block_scale_bits(6.0f * 0.01f * 0x1p-8f, 0.01f), float_to_e4m3_bits(0x1p-8f));
}

TEST(Nvfp4Quantize, AllZeroTensorGivesZerosWithoutNaN) {
  std::vector<float> w(4 * 32, 0.0f);
  w[5] = -0.0f;
  auto m = nvfp4::quantize(w.data(), 4, 32);
  ASSERT_TRUE(m.ok()) << m.error().what();
  EXPECT_EQ(m->scale_2[0].scale_2, 0.0f);
  for (uint8_t s : m->scales) EXPECT_EQ(s, 0x38);
  for (uint8_t b : m->weight) EXPECT_EQ(b, 0x00);
  for (float x : dequant_all(*m)) EXPECT_EQ(x, 0.0f);
  ASSERT_TRUE(m->validate().ok());
}

TEST(Nvfp4Quantize, RoundTripPicksANearestGridPointAndBoundsTheError) {
  const int64_t n = 48, k = 256;
  std::vector<float> w = random_normal(n * k, 11, 0.02f);
  w[77] = 0.5f;  // an outlier: most blocks then use small scales
  auto m = nvfp4::quantize(w.data(), n, k);
  ASSERT_TRUE(m.ok()) << m.error().what();
  const float s2 = m->scale_2[0].scale_2;
  const std::vector<float> d = dequant_all(*m);
  double err2 = 0, ref2 = 0;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      const uint8_t sb = m->scales[static_cast<size_t>(r * (k / 16) + c / 16)];
      const float denom = e4m3_bits_to_float(sb) * s2;
      const float x = w[r * k + c] / denom;
      const uint8_t code = nvfp4::get_code(m->weight.data() + r * (k / 2), c);
      // No grid point is strictly nearer to x than the chosen one (with saturation at 6).
      const float chosen = std::fabs(x - e2m1_bits_to_float(code));
      for (float g : kE2M1Grid) {
        EXPECT_LE(chosen, std::fabs(std::fabs(x) - g)) << r << "," << c;
      }
      EXPECT_EQ(code & 0x8, x < 0 ? 0x8 : 0x0);
      EXPECT_LE(std::fabs(d[r * k + c] - w[r * k + c]), denom * 1.0f + 1e-12f);
      err2 += std::pow(d[r * k + c] - w[r * k + c], 2);
      ref2 += std::pow(w[r * k + c], 2);
    }
  }
  EXPECT_LT(std::sqrt(err2 / ref2), 0.12);  // NVFP4 on Gaussian data: ~8-10% relative RMS
}

TEST(Nvfp4Quantize, RefusesBadShapesAndNonFiniteWeights) {
  std::vector<float> w(2 * 24, 0.1f);
  auto r = nvfp4::quantize(w.data(), 2, 24);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.error().what(), HasSubstr("multiple of the block size 16"));
  std::vector<float> w2(32, 0.1f);
  w2[17] = NAN;
  r = nvfp4::quantize(w2.data(), 1, 32);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.error().what(), HasSubstr("[0, 17] is not finite"));
  r = nvfp4::quantize(w.data(), 1, 16, 0.0f);  // scale_2 0 for nonzero weights
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.error().what(), HasSubstr("scale_2"));
}

TEST(Nvfp4Matrix, SharedScale2AndConcatKeepPerRowScale2) {
  const int64_t i_dim = 16, h = 64;
  std::vector<float> gate = random_normal(i_dim * h, 1, 0.02f), up = random_normal(i_dim * h, 2, 0.5f);
  auto g = nvfp4::quantize(gate.data(), i_dim, h);
  auto u = nvfp4::quantize(up.data(), i_dim, h);
  ASSERT_TRUE(g.ok() && u.ok());
  ASSERT_NE(g->scale_2[0].scale_2, u->scale_2[0].scale_2);
  const QuantMatrix parts[2] = {*g, *u};
  auto gu = concat_rows(parts);
  ASSERT_TRUE(gu.ok()) << gu.error().what();
  ASSERT_TRUE(gu->validate().ok());
  ASSERT_EQ(gu->scale_2.size(), 2u);
  EXPECT_EQ(gu->scale_2[1].row_begin, i_dim);
  EXPECT_EQ(gu->scale_2_for_row(i_dim - 1), g->scale_2[0].scale_2);
  EXPECT_EQ(gu->scale_2_for_row(i_dim), u->scale_2[0].scale_2);
  std::vector<float> dg = dequant_all(*g), du = dequant_all(*u), dgu = dequant_all(*gu);
  dg.insert(dg.end(), du.begin(), du.end());
  EXPECT_EQ(dgu, dg);
  EXPECT_EQ(weight_bytes(*gu), weight_bytes(*g) + weight_bytes(*u));
  EXPECT_EQ(weight_bytes(*g), static_cast<size_t>(i_dim * h / 2 + i_dim * h / 16 + 4));

  // A shared scale_2 (the max of both) through the generic entry point.
  QuantizeOptions opt;
  opt.nvfp4_scale_2 = std::max(g->scale_2[0].scale_2, u->scale_2[0].scale_2);
  auto g2 = quantize(WeightFormat::kNvFp4, gate.data(), i_dim, h, 16, opt);
  ASSERT_TRUE(g2.ok());
  EXPECT_EQ(g2->scale_2[0].scale_2, opt.nvfp4_scale_2);
}

TEST(Nvfp4Matrix, DequantizeRowsWritesOnlyTheRange) {
  std::vector<float> w = random_normal(8 * 32, 3);
  auto m = nvfp4::quantize(w.data(), 8, 32);
  ASSERT_TRUE(m.ok());
  const std::vector<float> all = dequant_all(*m);
  std::vector<float> part(8 * 32, 7.0f);
  dequantize_rows(*m, 2, 5, part.data());
  for (int64_t i = 0; i < 8 * 32; ++i) EXPECT_EQ(part[i], (i >= 64 && i < 160) ? all[i] : 7.0f) << i;
}

// ---- checkpoint loading ------------------------------------------------------------------------

struct Ckpt {
  std::vector<uint8_t> weight, scales;
  float s2 = 0.0f, input_scale = 1.0f;
  int64_t n = 0, k = 0;
  nvfp4::CheckpointTensors views(bool scalar_shape = true) {
    nvfp4::CheckpointTensors t;
    t.weight = {weight.data(), DType::kU8, Shape{n, k / 2}};
    t.weight_scale = {scales.data(), DType::kF8E4M3, Shape{n, k / 16}};
    t.weight_scale_2 = {&s2, DType::kF32, scalar_shape ? Shape{} : Shape{1}};
    t.input_scale = TensorView{&input_scale, DType::kF32, Shape{}};
    return t;
  }
};

Ckpt make_ckpt(int64_t n, int64_t k) {
  std::vector<float> w = random_normal(n * k, 5);
  auto m = nvfp4::quantize(w.data(), n, k);
  MOEBIUS_ASSERT(m.ok());
  Ckpt c;
  c.weight.assign(m->weight.begin(), m->weight.end());
  c.scales.assign(m->scales.begin(), m->scales.end());
  c.s2 = m->scale_2[0].scale_2;
  c.n = n;
  c.k = k;
  return c;
}

TEST(Nvfp4Checkpoint, LoadsModelOptTensorsInPlace) {
  Ckpt c = make_ckpt(8, 64);
  for (bool scalar : {true, false}) {
    auto m = nvfp4::from_checkpoint(c.views(scalar), "model.layers.0.mlp.experts.1.up_proj");
    ASSERT_TRUE(m.ok()) << m.error().what();
    EXPECT_EQ(m->rows, 8);
    EXPECT_EQ(m->cols, 64);
    EXPECT_EQ(m->weight.data(), c.weight.data());  // no copy
    EXPECT_EQ(m->scale_2[0].scale_2, c.s2);
  }
}

TEST(Nvfp4Checkpoint, RefusesBadTensorsNamingThem) {
  const std::string p = "model.layers.0.mlp.experts.1.up_proj";
  {
    Ckpt c = make_ckpt(8, 64);
    auto t = c.views();
    t.weight_scale.dtype = DType::kU8;
    auto r = nvfp4::from_checkpoint(t, p);
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.error().what(), HasSubstr("tensor '" + p + ".weight_scale': dtype is U8, expected F8_E4M3"));
  }
  {
    Ckpt c = make_ckpt(8, 64);
    auto t = c.views();
    t.weight_scale.shape = Shape{8, 3};
    auto r = nvfp4::from_checkpoint(t, p);
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.error().what(), HasSubstr("shape is [8, 3], expected [8, 4]"));
  }
  {
    Ckpt c = make_ckpt(8, 64);
    c.scales[13] = 0xFF;
    auto r = nvfp4::from_checkpoint(c.views(), p);
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.error().what(), HasSubstr("block scale [3, 1] is NaN"));
  }
  {
    Ckpt c = make_ckpt(8, 64);
    c.s2 = -1.0f;
    auto r = nvfp4::from_checkpoint(c.views(), p);
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.error().what(), HasSubstr(p + ".weight_scale_2"));
  }
  {
    Ckpt c = make_ckpt(8, 64);
    auto t = c.views();
    t.weight_scale_2.shape = Shape{2};
    auto r = nvfp4::from_checkpoint(t, p);
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.error().what(), HasSubstr("expected [] or [1]"));
  }
  {
    Ckpt c = make_ckpt(8, 64);
    auto t = c.views();
    t.input_scale->dtype = DType::kBF16;
    auto r = nvfp4::from_checkpoint(t, p);
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.error().what(), HasSubstr(p + ".input_scale"));
  }
  {
    Ckpt c = make_ckpt(8, 64);
    auto t = c.views();
    t.weight.shape = Shape{8, 4};  // K = 8
    t.weight_scale.shape = Shape{8, 0};
    auto r = nvfp4::from_checkpoint(t, p);
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.error().what(), HasSubstr("not a positive multiple of 16"));
  }
}

}  // namespace
}  // namespace moebius
