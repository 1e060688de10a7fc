// Symmetric GPTQ / AutoRound int2/int4/int8: packing, both RTN rules, checkpoint checks, and the
// format-agnostic QuantMatrix plumbing (f32/bf16 pass-through, validate, concat).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "test_util.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "formats/gptq.h"
#include "formats/quant_matrix.h"

namespace moebius {
namespace {

using ::testing::HasSubstr;

using testing::random_normal;

std::vector<float> dequant_all(const QuantMatrix& m) {
  std::vector<float> out(static_cast<size_t>(m.rows * m.cols), -12345.0f);
  dequantize_rows(m, 0, m.rows, out.data());
  return out;
}

uint32_t word_at(const QuantMatrix& m, int64_t i) {
  uint32_t w;
  std::memcpy(&w, m.weight.data() + i * 4, 4);
  return w;
}
uint16_t scale_at(const QuantMatrix& m, int64_t i) {
  uint16_t s;
  std::memcpy(&s, m.scales.data() + i * 2, 2);
  return s;
}

// ---- packing and the AutoRound rule, by hand ------------------------------------------------

TEST(GptqPack, Int4KnownAnswerLowBitsFirstAlongK) {
  // wmin = -8, wmax = 7 < 8: max_v = 8, scale = 8 / 8 = 1, q = rint(w) + 8.
  const float w[8] = {-8, -4, -1, 0, 1, 2, 3, 7};
  auto m = gptq::quantize(w, 1, 8, 4, -1);
  ASSERT_TRUE(m.ok()) << m.error().what();
  EXPECT_EQ(m->group_size, 8);
  EXPECT_EQ(word_at(*m, 0), 0xFBA98740u);  // q = 0,4,7,8,9,10,11,15 from the low nibble up
  EXPECT_EQ(scale_at(*m, 0), 0x3C00);      // fp16 1.0
  const std::vector<float> d = dequant_all(*m);
  EXPECT_EQ(d, std::vector<float>(w, w + 8));
}

TEST(GptqPack, Int4TiesRoundHalfToEven) {
  const float w[8] = {-8, 0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 7};
  auto m = gptq::quantize(w, 1, 8, 4, -1);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(word_at(*m, 0), 0xF668AA80u);  // q = 0,8,10,10,8,6,6,15
}

TEST(GptqPack, Int2AndInt8KnownAnswers) {
  // 2 bits: max_v = 2, scale = 2 / 2 = 1, q = w + 2, 16 values per word.
  const float w2[16] = {-2, -1, 0, 1, 1, 0, -1, -2, 0, 0, 0, 0, 1, 1, 1, 1};
  auto m2 = gptq::quantize(w2, 1, 16, 2, -1);
  ASSERT_TRUE(m2.ok());
  EXPECT_EQ(word_at(*m2, 0), 0xFFAA1BE4u);
  // 8 bits: max_v = 128, scale = 1, q = w + 128, 4 values per word.
  const float w8[4] = {-128, -1, 0, 127};
  auto m8 = gptq::quantize(w8, 1, 4, 8, -1);
  ASSERT_TRUE(m8.ok());
  EXPECT_EQ(word_at(*m8, 0), 0xFF807F00u);
  EXPECT_EQ(dequant_all(*m8), std::vector<float>(w8, w8 + 4));
}

TEST(GptqPack, QweightIsKMajorAcrossColumns) {
  // Two output rows n = 0, 1 and K = 16 at 4 bits: qweight [2, 2]; word [kw, n].
  std::vector<float> w(2 * 16);
  for (int k = 0; k < 16; ++k) {
    w[k] = (k == 0) ? -8.0f : static_cast<float>(k % 8) - 1.0f;  // row 0
    w[16 + k] = (k == 0) ? -8.0f : 0.0f;                       // row 1
  }
  auto m = gptq::quantize(w.data(), 2, 16, 4, -1);
  ASSERT_TRUE(m.ok());
  for (int k = 0; k < 16; ++k) {
    EXPECT_EQ(gptq::get_q(m->weight.data(), 2, k, 0, 4), static_cast<uint32_t>(w[k] + 8)) << k;
    EXPECT_EQ(gptq::get_q(m->weight.data(), 2, k, 1, 4), static_cast<uint32_t>(w[16 + k] + 8)) << k;
  }
  EXPECT_EQ(word_at(*m, 1), 0x88888880u);  // [kw 0, n 1]
  EXPECT_EQ(word_at(*m, 3), 0x88888888u);  // [kw 1, n 1]
}

TEST(GptqQuantize, NegativeScaleWhenThePositiveSideDominates) {
  // wmin = -7, wmax = 8: max_v = -8, scale = -1, q = rint(w / -1) + 8; the +8 extreme maps to q 0.
  const float w[8] = {8, 4, 1, 0, -1, -2, -3, -7};
  auto m = gptq::quantize(w, 1, 8, 4, -1);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(scale_at(*m, 0), 0xBC00);  // fp16 -1.0
  EXPECT_EQ(word_at(*m, 0), 0xFBA98740u);
  EXPECT_EQ(dequant_all(*m), std::vector<float>(w, w + 8));
}

TEST(GptqQuantize, ZeroAndTinyGroupsUseTheScaleThreshold) {
  // AutoRound clamps |scale| to fp16(1e-5) = 168 * 2^-24 (0x00A8); a zero group gets +1e-5.
  std::vector<float> w(2 * 8, 0.0f);
  for (int k = 0; k < 8; ++k) w[8 + k] = -1e-7f * static_cast<float>(k);
  auto m = gptq::quantize(w.data(), 2, 8, 4, -1);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(scale_at(*m, 0), 0x00A8);
  EXPECT_EQ(scale_at(*m, 1), 0x00A8);
  EXPECT_EQ(word_at(*m, 0), 0x88888888u);
  // row 1: |w| / 1.00136e-5 <= 0.07, so every q is the zero point 8
  for (int k = 0; k < 8; ++k) EXPECT_EQ(gptq::get_q(m->weight.data(), 2, k, 1, 4), 8u) << k;
  for (float x : dequant_all(*m)) EXPECT_EQ(x, 0.0f);
}

// ---- the GPTQ rule -----------------------------------------------------------------------------

TEST(GptqQuantize, GptqSchemeKnownAnswer) {
  // xmax = 7.5, xmin = -7.5: scale = 15 / 15 = 1, zero 8; q = clamp(rint(w) + 8, 0, 15).
  const float w[8] = {-7.5f, -7, 0.5f, 1.5f, 3, 6.5f, 7, 7.5f};
  auto m = gptq::quantize(w, 1, 8, 4, -1, IntRtnScheme::kGptq);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(scale_at(*m, 0), 0x3C00);
  const uint32_t q[8] = {0, 1, 8, 10, 11, 14, 15, 15};  // -8, -7, 0, 2, 3, 6, 7, 8 -> clamp 15
  for (int k = 0; k < 8; ++k) EXPECT_EQ(gptq::get_q(m->weight.data(), 1, k, 0, 4), q[k]) << k;
}

TEST(GptqQuantize, GptqSchemeKeepsItsAllPositiveQuirkAndZeroGroupRule) {
  // No negative value: xmin stays 0, scale = 7 / 15, and values above 7 steps clip at q = 15.
  const float w[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  auto m = gptq::quantize(w, 1, 8, 4, -1, IntRtnScheme::kGptq);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(scale_at(*m, 0), float_to_fp16_bits(7.0f / 15.0f));
  const uint32_t q[8] = {8, 10, 12, 14, 15, 15, 15, 15};
  for (int k = 0; k < 8; ++k) EXPECT_EQ(gptq::get_q(m->weight.data(), 1, k, 0, 4), q[k]) << k;
  const float z[8] = {};
  auto mz = gptq::quantize(z, 1, 8, 4, -1, IntRtnScheme::kGptq);
  ASSERT_TRUE(mz.ok());
  EXPECT_EQ(scale_at(*mz, 0), float_to_fp16_bits(2.0f / 15.0f));  // xmin -1, xmax 1
  EXPECT_EQ(word_at(*mz, 0), 0x88888888u);
}

// ---- every bit width, group size and rule: nearest level and error bound ------------------------

struct Combo {
  int bits;
  int group;
  IntRtnScheme scheme;
};

class GptqRoundTrip : public ::testing::TestWithParam<Combo> {};

TEST_P(GptqRoundTrip, NearestLevelAndBoundedError) {
  const Combo c = GetParam();
  const int64_t n = 32, k = 256;
  std::vector<float> w = random_normal(n * k, 100 + c.bits * 7 + c.group, 0.03f);
  for (int64_t i = 0; i < k; ++i) w[3 * k + i] = std::fabs(w[3 * k + i]);  // all-positive row
  auto m = gptq::quantize(w.data(), n, k, c.bits, c.group, c.scheme);
  ASSERT_TRUE(m.ok()) << m.error().what();
  ASSERT_TRUE(m->validate().ok());
  const int64_t g = c.group == -1 ? k : c.group;
  EXPECT_EQ(m->group_size, g);
  EXPECT_EQ(m->num_groups(), k / g);
  EXPECT_EQ(weight_bytes(*m), static_cast<size_t>(n * k * c.bits / 8 + (k / g) * n * 2));
  const std::vector<float> d = dequant_all(*m);
  const int z = 1 << (c.bits - 1), maxq = (1 << c.bits) - 1;
  int negative_scales = 0;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t kk = 0; kk < k; ++kk) {
      const uint16_t sb = scale_at(*m, (kk / g) * n + r);
      const float s = fp16_bits_to_float(sb);
      negative_scales += (kk % g == 0) && s < 0;
      const int q = static_cast<int>(gptq::get_q(m->weight.data(), n, kk, r, c.bits));
      const float x = w[r * k + kk] / s;
      const float e = d[r * k + kk];
      EXPECT_EQ(e, static_cast<float>(q - z) * s);
      // (kGptq divides by the fp32 scale, not the stored fp16 one: allow for that difference.)
      if (q > 0 && q < maxq) {
        EXPECT_LE(std::fabs(x - static_cast<float>(q - z)), 0.5f + std::fabs(x) * 1e-3f + 1e-4f) << r << "," << kk;
      }
      // Clipping costs at most one step (AutoRound's opposite extreme) for a full-range group.
      if (r != 3 || c.scheme == IntRtnScheme::kAutoRound) {
        EXPECT_LE(std::fabs(e - w[r * k + kk]), std::fabs(s) * 1.002f) << r << "," << kk;
      }
    }
  }
  if (c.scheme == IntRtnScheme::kAutoRound) {
    EXPECT_GT(negative_scales, 0);  // e.g. the all-positive row
  } else {
    EXPECT_EQ(negative_scales, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Gptq, GptqRoundTrip,
                         ::testing::Values(Combo{2, 32, IntRtnScheme::kAutoRound}, Combo{2, 64, IntRtnScheme::kAutoRound},
                                           Combo{2, 128, IntRtnScheme::kAutoRound}, Combo{2, -1, IntRtnScheme::kAutoRound},
                                           Combo{4, 32, IntRtnScheme::kAutoRound}, Combo{4, 64, IntRtnScheme::kAutoRound},
                                           Combo{4, 128, IntRtnScheme::kAutoRound}, Combo{4, -1, IntRtnScheme::kAutoRound},
                                           Combo{8, 32, IntRtnScheme::kAutoRound}, Combo{8, 64, IntRtnScheme::kAutoRound},
                                           Combo{8, 128, IntRtnScheme::kAutoRound}, Combo{8, -1, IntRtnScheme::kAutoRound},
                                           Combo{2, 128, IntRtnScheme::kGptq}, Combo{4, 32, IntRtnScheme::kGptq},
                                           Combo{4, 128, IntRtnScheme::kGptq}, Combo{8, -1, IntRtnScheme::kGptq}));

TEST(GptqQuantize, PartialLastGroupAndRefusals) {
  std::vector<float> w = random_normal(8 * 96, 4);
  auto m = gptq::quantize(w.data(), 8, 96, 4, 64);
  ASSERT_TRUE(m.ok()) << m.error().what();
  EXPECT_EQ(m->num_groups(), 2);
  auto r = gptq::quantize(w.data(), 8, 96, 3, 32);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.error().what(), HasSubstr("3-bit"));
  r = gptq::quantize(w.data(), 8, 40, 2, 32);  // K = 40 is not a multiple of 16 values per word
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.error().what(), HasSubstr("not a multiple of 16"));
  r = gptq::quantize(w.data(), 8, 96, 4, 0);
  ASSERT_FALSE(r.ok());
  w[5] = INFINITY;
  r = gptq::quantize(w.data(), 8, 96, 4, 32);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.error().what(), HasSubstr("[0, 5] is not finite"));
}

// ---- checkpoint loading ------------------------------------------------------------------------

struct GptqCkpt {
  std::vector<uint8_t> qweight, scales;
  std::vector<int32_t> qzeros, g_idx;
  int64_t n = 0, k = 0, groups = 0;
  int bits = 4;
  gptq::CheckpointTensors views() {
    const int p = 32 / bits;
    gptq::CheckpointTensors t;
    t.qweight = {qweight.data(), DType::kI32, Shape{k / p, n}};
    t.qzeros = {qzeros.data(), DType::kI32, Shape{groups, n / p}};
    t.scales = {scales.data(), DType::kF16, Shape{groups, n}};
    if (!g_idx.empty()) t.g_idx = TensorView{g_idx.data(), DType::kI32, Shape{k}};
    return t;
  }
};

GptqCkpt make_gptq_ckpt(int bits, int group, gptq::ZeroFormat zf, int64_t n = 32, int64_t k = 256) {
  std::vector<float> w = random_normal(n * k, 9);
  auto m = gptq::quantize(w.data(), n, k, bits, group);
  MOEBIUS_ASSERT(m.ok());
  GptqCkpt c;
  c.bits = bits;
  c.n = n;
  c.k = k;
  c.groups = m->num_groups();
  c.qweight.assign(m->weight.begin(), m->weight.end());
  c.scales.assign(m->scales.begin(), m->scales.end());
  if (n % (32 / bits) == 0) c.qzeros = gptq::make_symmetric_qzeros(bits, c.groups, n, zf);
  return c;
}

TEST(GptqCheckpoint, LoadsV1AndV2ZeroConventions) {
  for (int bits : {2, 4, 8}) {
    for (auto zf : {gptq::ZeroFormat::kV1MinusOne, gptq::ZeroFormat::kV2Exact}) {
      GptqCkpt c = make_gptq_ckpt(bits, 64, zf);
      auto m = gptq::from_checkpoint(c.views(), {bits, 64, zf}, "model.layers.0.mlp.down_proj");
      ASSERT_TRUE(m.ok()) << m.error().what();
      EXPECT_EQ(m->rows, 32);
      EXPECT_EQ(m->cols, 256);
      EXPECT_EQ(m->weight.data(), c.qweight.data());
    }
  }
  // The v1 stored words, by hand.
  EXPECT_EQ(gptq::make_symmetric_qzeros(4, 1, 8, gptq::ZeroFormat::kV1MinusOne)[0], 0x77777777);
  EXPECT_EQ(static_cast<uint32_t>(gptq::make_symmetric_qzeros(8, 1, 4, gptq::ZeroFormat::kV1MinusOne)[0]),
            0x7F7F7F7Fu);
  EXPECT_EQ(gptq::make_symmetric_qzeros(2, 1, 16, gptq::ZeroFormat::kV1MinusOne)[0], 0x55555555);
  EXPECT_EQ(static_cast<uint32_t>(gptq::make_symmetric_qzeros(4, 1, 8, gptq::ZeroFormat::kV2Exact)[0]), 0x88888888u);
}

TEST(GptqCheckpoint, PerChannelGroupSize) {
  GptqCkpt c = make_gptq_ckpt(4, -1, gptq::ZeroFormat::kV1MinusOne);
  EXPECT_EQ(c.groups, 1);
  auto m = gptq::from_checkpoint(c.views(), {4, -1, gptq::ZeroFormat::kV1MinusOne}, "x");
  ASSERT_TRUE(m.ok()) << m.error().what();
  EXPECT_EQ(m->group_size, 256);
}

TEST(GptqCheckpoint, RefusesAsymmetricZerosNamingGroupAndColumn) {
  GptqCkpt c = make_gptq_ckpt(4, 64, gptq::ZeroFormat::kV1MinusOne);
  // group 2, column 13: word [2, 13 / 8 = 1], field 5
  uint32_t w = 0x77777777u;
  w = (w & ~(0xFu << 20)) | (5u << 20);
  std::memcpy(&c.qzeros[2 * 4 + 1], &w, 4);
  auto r = gptq::from_checkpoint(c.views(), {4, 64, gptq::ZeroFormat::kV1MinusOne}, "model.layers.1.mlp.up_proj");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.error().what(), HasSubstr("tensor 'model.layers.1.mlp.up_proj.qzeros'"));
  EXPECT_THAT(r.error().what(), HasSubstr("group 2, column 13: stored zero point 5"));
  EXPECT_THAT(r.error().what(), HasSubstr("asymmetric"));
}

// An Inf or NaN fp16 group scale (fp16 overflow in the quantizer that wrote the checkpoint) would
// turn its rows' outputs into NaN: refused at load, naming the module and the [group, column].
TEST(GptqCheckpoint, RefusesNonFiniteScales) {
  for (uint16_t bad : {uint16_t{0x7C00}, uint16_t{0xFC00}, uint16_t{0x7E00}}) {
    GptqCkpt c = make_gptq_ckpt(4, 64, gptq::ZeroFormat::kV1MinusOne);
    std::memcpy(c.scales.data() + (2 * c.n + 13) * 2, &bad, 2);  // group 2, column 13
    auto r = gptq::from_checkpoint(c.views(), {4, 64, gptq::ZeroFormat::kV1MinusOne}, "model.layers.1.mlp.up_proj");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_THAT(r.error().what(), HasSubstr("model.layers.1.mlp.up_proj"));
    EXPECT_THAT(r.error().what(), HasSubstr("group scale [2, 13] is not finite"));
  }
}

TEST(GptqCheckpoint, WrongZeroConventionGetsAHint) {
  GptqCkpt c = make_gptq_ckpt(4, 64, gptq::ZeroFormat::kV2Exact);
  auto r = gptq::from_checkpoint(c.views(), {4, 64, gptq::ZeroFormat::kV1MinusOne}, "m");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.error().what(), HasSubstr("group 0, column 0: stored zero point 8"));
  EXPECT_THAT(r.error().what(), HasSubstr("checkpoint_format / packing_format"));
}

TEST(GptqCheckpoint, TrivialGIdxAcceptedPermutedRefused) {
  GptqCkpt c = make_gptq_ckpt(4, 128, gptq::ZeroFormat::kV1MinusOne);
  c.g_idx.resize(256);
  for (int k = 0; k < 256; ++k) c.g_idx[k] = k / 128;
  auto m = gptq::from_checkpoint(c.views(), {4, 128, gptq::ZeroFormat::kV1MinusOne}, "m");
  ASSERT_TRUE(m.ok()) << m.error().what();
  std::vector<int64_t> g64(256);
  for (int k = 0; k < 256; ++k) g64[k] = k / 128;
  EXPECT_TRUE(gptq::check_trivial_g_idx({g64.data(), DType::kI64, Shape{256}}, 256, 128, "g").ok());

  std::swap(c.g_idx[3], c.g_idx[200]);  // act-order permutation
  auto r = gptq::from_checkpoint(c.views(), {4, 128, gptq::ZeroFormat::kV1MinusOne}, "m");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.error().what(), HasSubstr("tensor 'm.g_idx': g_idx[3] = 1, expected 0"));
  EXPECT_THAT(r.error().what(), HasSubstr("desc_act"));
}

TEST(GptqCheckpoint, RefusesBadDtypesAndShapes) {
  const gptq::Layout l{4, 64, gptq::ZeroFormat::kV1MinusOne};
  {
    GptqCkpt c = make_gptq_ckpt(4, 64, gptq::ZeroFormat::kV1MinusOne);
    auto t = c.views();
    t.scales.dtype = DType::kBF16;
    auto r = gptq::from_checkpoint(t, l, "m");
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.error().what(), HasSubstr("tensor 'm.scales': dtype is BF16, expected F16"));
  }
  {
    GptqCkpt c = make_gptq_ckpt(4, 64, gptq::ZeroFormat::kV1MinusOne);
    auto t = c.views();
    t.qweight.dtype = DType::kU32;
    auto r = gptq::from_checkpoint(t, l, "m");
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.error().what(), HasSubstr("pack_dtype int32"));
  }
  {
    GptqCkpt c = make_gptq_ckpt(4, 64, gptq::ZeroFormat::kV1MinusOne);
    auto r = gptq::from_checkpoint(c.views(), {4, 128, gptq::ZeroFormat::kV1MinusOne}, "m");  // wrong group size
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.error().what(), HasSubstr("expected [2, 32]"));
  }
  {
    GptqCkpt c = make_gptq_ckpt(4, 64, gptq::ZeroFormat::kV1MinusOne, 12, 64);  // N = 12: qzeros can't pack
    c.qzeros.assign(4, 0x77777777);
    auto t = c.views();
    t.qzeros.shape = Shape{1, 1};
    auto r = gptq::from_checkpoint(t, l, "m");
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.error().what(), HasSubstr("N = 12 is not a multiple of 8"));
  }
  {
    GptqCkpt c = make_gptq_ckpt(4, 64, gptq::ZeroFormat::kV1MinusOne);
    auto r = gptq::from_checkpoint(c.views(), {3, 64, gptq::ZeroFormat::kV1MinusOne}, "m");
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.error().what(), HasSubstr("3-bit"));
  }
}

// ---- QuantMatrix plumbing ----------------------------------------------------------------------

TEST(GptqMatrix, ConcatRowsInterleavesKMajorColumns) {
  std::vector<float> a = random_normal(16 * 128, 21), b = random_normal(8 * 128, 22);
  auto ma = quantize(WeightFormat::kInt4, a.data(), 16, 128, 32);
  auto mb = quantize(WeightFormat::kInt4, b.data(), 8, 128, 32);
  ASSERT_TRUE(ma.ok() && mb.ok());
  const QuantMatrix parts[2] = {*ma, *mb};
  auto mab = concat_rows(parts);
  ASSERT_TRUE(mab.ok()) << mab.error().what();
  ASSERT_TRUE(mab->validate().ok());
  EXPECT_EQ(mab->rows, 24);
  std::vector<float> da = dequant_all(*ma), db = dequant_all(*mb);
  da.insert(da.end(), db.begin(), db.end());
  EXPECT_EQ(dequant_all(*mab), da);
  // Mismatched parts are refused.
  auto mc = quantize(WeightFormat::kInt4, a.data(), 16, 128, 64);
  ASSERT_TRUE(mc.ok());
  const QuantMatrix bad[2] = {*ma, *mc};
  EXPECT_FALSE(concat_rows(bad).ok());
}

TEST(GptqMatrix, PlainFormatsPassThroughAndValidate) {
  std::vector<float> w = random_normal(4 * 8, 23);
  auto f = quantize(WeightFormat::kF32, w.data(), 4, 8, 0);
  auto b = quantize(WeightFormat::kBF16, w.data(), 4, 8, 0);
  ASSERT_TRUE(f.ok() && b.ok());
  EXPECT_EQ(dequant_all(*f), w);
  const std::vector<float> db = dequant_all(*b);
  for (size_t i = 0; i < w.size(); ++i) EXPECT_EQ(db[i], bf16_bits_to_float(float_to_bf16_bits(w[i])));
  EXPECT_EQ(weight_bytes(*f), 4u * 8 * 4);
  EXPECT_EQ(weight_bytes(*b), 4u * 8 * 2);

  QuantMatrix bad = *f;
  bad.weight = bad.weight.subspan(0, 16);
  EXPECT_THAT(bad.validate().error().what(), HasSubstr("weight has 16 bytes, expected 128"));
  auto i4 = quantize(WeightFormat::kInt4, w.data(), 4, 8, 8);
  ASSERT_TRUE(i4.ok());
  QuantMatrix bad2 = *i4;
  bad2.group_size = 16;
  EXPECT_FALSE(bad2.validate().ok());
  EXPECT_EQ(weight_format_name(WeightFormat::kInt2), "int2");
  EXPECT_FALSE(int_format_for_bits(3).ok());
}

}  // namespace
}  // namespace moebius
