// [TAG_INT_FOLDED_SCALE] The split of an int format's fp16 group scale that lets the wgmma prefill
// GEMM fold it into the weight with one rounding (int_folded_scale, kernels/moe_dequant.cuh), on
// the CPU for every finite fp16 scale and every integer code q of int4 (-8..7) and int2 (-2..1):
//   s_hi = RN_bf16(s) and s_hi + s_lo == s exactly (s_lo is exact in bf16);
//   q * s_lo is exact in bf16, so the device's HMUL2 does not round;
//   RN_bf16(q * s_hi + q * s_lo), what the device's HFMA2 returns (one rounding of the exact
//   sum), equals RN_bf16(q * s), the host mirror moe::folded_int_weight the GPU tests compare with.
// The HFMA2 itself runs only on the device (tests/gpu/test_moe_wgmma.cu checks every output of the
// kernel against the mirror); here its exact sum is formed in fp32, where q * s has at most 15
// significant bits and is exact.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "kernels/moe_dequant.cuh"

namespace moebius::kernels::moe_detail {
namespace {

float bf16_round(float x) { return bf16_bits_to_float(float_to_bf16_bits(x)); }

TEST(IntFoldedScale, OneRoundingForEveryFiniteFp16ScaleAndCode) {
  int checked = 0;
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    if ((bits & 0x7C00u) == 0x7C00u) continue;  // inf and NaN
    __half_raw raw;
    raw.x = static_cast<unsigned short>(bits);
    const __half h(raw);
    const float s = __half2float(h);
    // Row g gets this scale, row g + 8 its negation: both halves of the pair are checked.
    const IntFoldedScale f = int_folded_scale(h, __float2half(-s));
    const float2 hi = __bfloat1622float2(as_bf16x2(f.hi)), lo = __bfloat1622float2(as_bf16x2(f.lo));
    ASSERT_EQ(hi.x, bf16_round(s)) << "fp16 bits " << bits;
    ASSERT_EQ(hi.x + lo.x, s) << "fp16 bits " << bits << ": s_hi + s_lo is not s";
    ASSERT_EQ(hi.y + lo.y, -s) << "fp16 bits " << bits << " (row g + 8)";
    for (int q = -8; q <= 7; ++q) {
      const float t = static_cast<float>(q) * lo.x;
      ASSERT_EQ(bf16_round(t), t) << "q " << q << " * s_lo rounds (fp16 bits " << bits << ")";
      const float folded = bf16_round(static_cast<float>(q) * hi.x + t);
      ASSERT_EQ(folded, bf16_round(static_cast<float>(q) * s)) << "q " << q << ", fp16 bits " << bits;
      ++checked;
    }
  }
  EXPECT_EQ(checked, (0x10000 - 2 * 1024) * 16);
}

// The split is not the trivial one: some scales need a non-zero low part, and the fold differs
// from rounding the scale first (the double rounding the split avoids) for some codes.
TEST(IntFoldedScale, SplitMattersForSomeScales) {
  int nonzero_lo = 0, double_rounding_differs = 0;
  for (uint32_t bits = 0x3C00u; bits < 0x4000u; ++bits) {  // [1, 2)
    __half_raw raw;
    raw.x = static_cast<unsigned short>(bits);
    const __half h(raw);
    const float s = __half2float(h);
    const IntFoldedScale f = int_folded_scale(h, h);
    const float lo = __bfloat1622float2(as_bf16x2(f.lo)).x;
    nonzero_lo += lo != 0.0f;
    for (int q = -8; q <= 7; ++q)
      double_rounding_differs += bf16_round(q * bf16_round(s)) != bf16_round(q * s);
  }
  EXPECT_GT(nonzero_lo, 800);  // 7 of 8 fp16 values in a binade are not bf16 values
  EXPECT_GT(double_rounding_differs, 0);
}

}  // namespace
}  // namespace moebius::kernels::moe_detail
