#include "core/dtype.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"

namespace moebius {

namespace {

struct DTypeInfo {
  DType type;
  std::string_view name;
  size_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::kBool, "BOOL", 1},       {DType::kU8, "U8", 1},     {DType::kI8, "I8", 1},
    {DType::kU16, "U16", 2},         {DType::kI16, "I16", 2},   {DType::kU32, "U32", 4},
    {DType::kI32, "I32", 4},         {DType::kU64, "U64", 8},   {DType::kI64, "I64", 8},
    {DType::kF16, "F16", 2},         {DType::kBF16, "BF16", 2}, {DType::kF32, "F32", 4},
    {DType::kF64, "F64", 8},         {DType::kF8E4M3, "F8_E4M3", 1},
    {DType::kF8E5M2, "F8_E5M2", 1},
};

const DTypeInfo& info(DType t) {
  for (const auto& i : kDTypes)
    if (i.type == t) return i;
  MOEBIUS_ASSERT(false, "unknown DType {}", static_cast<int>(t));
  return kDTypes[0];
}

// A small binary float format: `man_bits` stored mantissa bits, `bias`, the largest finite
// magnitude, and whether overflow can produce an infinity (fp16, e5m2) or not (e4m3fn, e2m1).
struct MiniFloat {
  int exp_bits;
  int man_bits;
  int bias;
  float max_finite;
  bool has_inf;
};

constexpr MiniFloat kFp16{5, 10, 15, 65504.0f, true};
constexpr MiniFloat kE4M3{4, 3, 7, 448.0f, false};
constexpr MiniFloat kE5M2{5, 2, 15, 57344.0f, true};
constexpr MiniFloat kE2M1{2, 1, 1, 6.0f, false};

// Rounds |x| (finite, non-negative) to the nearest representable magnitude of `f`, ties to
// even, ignoring the upper range limit. Exact: scaling by powers of two is exact in float, and
// rint() rounds half to even in the default rounding mode.
float round_to_format(float ax, const MiniFloat& f) {
  if (ax == 0.0f) return 0.0f;
  const int emin = 1 - f.bias;  // exponent of the smallest normal
  int e;
  std::frexp(ax, &e);  // ax = m * 2^e with m in [0.5, 1)  =>  floor(log2(ax)) = e - 1
  int exp = e - 1;
  if (exp < emin) exp = emin;  // subnormal range shares the quantum of the smallest binade
  const int quantum_exp = exp - f.man_bits;
  // ldexp keeps the value exact; the quotient is < 2^(man_bits+1) so it is an exact float.
  const float q = std::rint(std::ldexp(ax, -quantum_exp));
  return std::ldexp(q, quantum_exp);
}

// Encodes a magnitude that is exactly representable (or the format's max) into bits, no sign.
uint32_t encode_magnitude(float v, const MiniFloat& f) {
  if (v == 0.0f) return 0;
  const int emin = 1 - f.bias;
  int e;
  std::frexp(v, &e);
  const int exp = e - 1;
  if (exp < emin) {  // subnormal: exponent field 0, mantissa = v / 2^(emin - man_bits)
    return static_cast<uint32_t>(std::ldexp(v, f.man_bits - emin));
  }
  const uint32_t mant = static_cast<uint32_t>(std::ldexp(v, f.man_bits - exp)) - (1u << f.man_bits);
  return (static_cast<uint32_t>(exp + f.bias) << f.man_bits) | mant;
}

float decode(uint32_t bits, const MiniFloat& f) {
  const int total = 1 + f.exp_bits + f.man_bits;
  const bool neg = (bits >> (total - 1)) & 1u;
  const uint32_t exp_field = (bits >> f.man_bits) & ((1u << f.exp_bits) - 1);
  const uint32_t mant = bits & ((1u << f.man_bits) - 1);
  float v;
  if (exp_field == 0) {
    v = std::ldexp(static_cast<float>(mant), 1 - f.bias - f.man_bits);
  } else {
    v = std::ldexp(static_cast<float>(mant + (1u << f.man_bits)),
                   static_cast<int>(exp_field) - f.bias - f.man_bits);
  }
  return neg ? -v : v;
}

uint32_t float_bits(float x) { return std::bit_cast<uint32_t>(x); }

}  // namespace

size_t dtype_size(DType t) { return info(t).size; }
std::string_view dtype_name(DType t) { return info(t).name; }
std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& i : kDTypes)
    if (i.name == name) return i.type;
  return std::nullopt;
}

// ---- bf16: the top 16 bits of a float, rounded to nearest even. NaN -> 0x7FFF like CUDA.
uint16_t float_to_bf16_bits(float x) {
  uint32_t u = float_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
  u += 0x7FFFu + ((u >> 16) & 1u);  // overflow of a large finite value carries into inf: correct RNE
  return static_cast<uint16_t>(u >> 16);
}
float bf16_bits_to_float(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

namespace {

// Index of the first i < n with special(i), or -1. special is OR-ed over blocks of values without
// a branch per value (the loop vectorizes), and only a block with a hit is walked again.
template <typename Special>
int64_t first_special(int64_t n, Special special) {
  constexpr int64_t kBlock = 1024;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    bool hit = false;
    for (int64_t i = b; i < e; ++i) hit |= special(i);
    if (!hit) continue;
    for (int64_t i = b; i < e; ++i)
      if (special(i)) return i;
  }
  return -1;
}

}  // namespace

int64_t first_non_finite(const float* v, int64_t n) {
  // An all-ones exponent is NaN or infinity.
  constexpr uint32_t kExp = 0x7F800000u;
  return first_special(n, [v](int64_t i) { return (std::bit_cast<uint32_t>(v[i]) & kExp) == kExp; });
}

int64_t first_non_finite_bf16(const uint8_t* bytes, int64_t n) {
  // Little-endian bf16: the exponent is bits 14..7, i.e. the high byte's low 7 bits and the low
  // byte's top bit. Read byte by byte: safetensors offsets need not be aligned.
  return first_special(n, [bytes](int64_t i) { return (bytes[2 * i + 1] & 0x7F) == 0x7F && (bytes[2 * i] & 0x80) != 0; });
}

// ---- fp16 (IEEE binary16). NaN -> 0x7FFF like CUDA's __float2half.
uint16_t float_to_fp16_bits(float x) {
  const uint32_t u = float_bits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
  if ((u & 0x7FFFFFFFu) == 0x7F800000u) return sign | 0x7C00;
  const float r = round_to_format(std::fabs(x), kFp16);
  if (r > kFp16.max_finite) return sign | 0x7C00;
  return sign | static_cast<uint16_t>(encode_magnitude(r, kFp16));
}
namespace {
float fp16_decode_slow(uint16_t bits) {
  if ((bits & 0x7C00) == 0x7C00) {
    if (bits & 0x03FF) return std::numeric_limits<float>::quiet_NaN();
    return (bits & 0x8000) ? -INFINITY : INFINITY;
  }
  return decode(bits, kFp16);
}
}  // namespace

// ---- fp8 e4m3fn: no infinities; S.1111.111 is NaN; max 448.
uint8_t float_to_e4m3_bits(float x, Saturation sat) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7F;  // NaN (CUDA drops the sign)
  if ((u & 0x7FFFFFFFu) == 0x7F800000u) return sat == Saturation::kSatFinite ? (sign | 0x7E) : (sign | 0x7F);
  const float r = round_to_format(std::fabs(x), kE4M3);
  if (r > kE4M3.max_finite) return sat == Saturation::kSatFinite ? (sign | 0x7E) : (sign | 0x7F);
  return sign | static_cast<uint8_t>(encode_magnitude(r, kE4M3));
}
namespace {
float e4m3_decode_slow(uint8_t bits) {
  if ((bits & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  return decode(bits, kE4M3);
}
}  // namespace

// ---- fp8 e5m2: IEEE-like, with infinities.
uint8_t float_to_e5m2_bits(float x, Saturation sat) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7F;
  if ((u & 0x7FFFFFFFu) == 0x7F800000u) return sat == Saturation::kSatFinite ? (sign | 0x7B) : (sign | 0x7C);
  const float r = round_to_format(std::fabs(x), kE5M2);
  if (r > kE5M2.max_finite) return sat == Saturation::kSatFinite ? (sign | 0x7B) : (sign | 0x7C);
  return sign | static_cast<uint8_t>(encode_magnitude(r, kE5M2));
}
float e5m2_bits_to_float(uint8_t bits) {
  if ((bits & 0x7C) == 0x7C) {
    if (bits & 0x03) return std::numeric_limits<float>::quiet_NaN();
    return (bits & 0x80) ? -INFINITY : INFINITY;
  }
  return decode(bits, kE5M2);
}

// ---- fp4 e2m1: always saturating to +-6; no NaN or infinity encodings.
uint8_t float_to_e2m1_bits(float x) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 28) & 0x8u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7;  // NaN -> +max, as cuda_fp4.h does
  if ((u & 0x7FFFFFFFu) == 0x7F800000u) return sign | 0x7;
  const float r = round_to_format(std::fabs(x), kE2M1);
  if (r > kE2M1.max_finite) return sign | 0x7;
  return sign | static_cast<uint8_t>(encode_magnitude(r, kE2M1));
}
// Decoding sits in the inner loop of every CPU dequantization, so it is a table lookup; the
// tables are filled once from the exact decoders above.
namespace {
struct DecodeTables {
  float fp16[65536];
  float e4m3[256];
  float e2m1[16];
  DecodeTables() {
    for (uint32_t b = 0; b < 65536; ++b) fp16[b] = fp16_decode_slow(static_cast<uint16_t>(b));
    for (uint32_t b = 0; b < 256; ++b) e4m3[b] = e4m3_decode_slow(static_cast<uint8_t>(b));
    for (uint32_t b = 0; b < 16; ++b) e2m1[b] = decode(b, kE2M1);
  }
};
const DecodeTables& tables() {
  static const DecodeTables t;
  return t;
}
}  // namespace

float fp16_bits_to_float(uint16_t bits) { return tables().fp16[bits]; }
float e4m3_bits_to_float(uint8_t bits) { return tables().e4m3[bits]; }
float e2m1_bits_to_float(uint8_t nibble) { return tables().e2m1[nibble & 0xF]; }

}  // namespace moebius
