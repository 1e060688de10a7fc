// Element types and bit-exact scalar conversions.
//
// All float -> narrow conversions round to nearest, ties to even, and treat overflow, NaN and
// saturation exactly as CUDA's headers do on the host and device, so the CPU reference and the
// kernels produce identical bits (tests/test_dtype_cuda_parity.cu checks this against
// cuda_bf16.h, cuda_fp16.h, cuda_fp8.h and cuda_fp4.h):
//   bf16  : __float2bfloat16      NaN -> 0x7FFF, overflow -> inf
//   fp16  : __float2half          NaN -> 0x7FFF, overflow -> inf
//   e4m3  : __nv_cvt_float_to_fp8(x, __NV_SATFINITE | __NV_NOSAT, __NV_E4M3)
//           satfinite: |x| > 448 -> +-448; NaN -> 0x7F; nosat: overflow -> NaN (0x7F/0xFF)
//   e2m1  : __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest), always saturating to +-6
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace moebius {

enum class DType : uint8_t {
  kBool,
  kU8,
  kI8,
  kU16,
  kI16,
  kU32,
  kI32,
  kU64,
  kI64,
  kF16,
  kBF16,
  kF32,
  kF64,
  kF8E4M3,  // e4m3fn: no infinities, one NaN pattern per sign (S.1111.111), max 448
  kF8E5M2,
};

// Bytes per element.
size_t dtype_size(DType t);
// Canonical safetensors spelling ("BF16", "F8_E4M3", ...).
std::string_view dtype_name(DType t);
// Parses a safetensors dtype string; nullopt for anything we do not know.
std::optional<DType> dtype_from_name(std::string_view name);

enum class Saturation : uint8_t { kSatFinite, kNoSat };

uint16_t float_to_bf16_bits(float x);
float bf16_bits_to_float(uint16_t bits);
// [TAG_FINITE_WEIGHTS] Index of the first NaN or infinity among n values, or -1: a checkpoint
// weight that is not finite poisons every logit it reaches, so loading refuses it, naming it.
int64_t first_non_finite(const float* v, int64_t n);
// The same for n bf16 values stored little-endian at any byte offset (safetensors data).
int64_t first_non_finite_bf16(const uint8_t* bytes, int64_t n);
uint16_t float_to_fp16_bits(float x);
float fp16_bits_to_float(uint16_t bits);
uint8_t float_to_e4m3_bits(float x, Saturation sat = Saturation::kSatFinite);
float e4m3_bits_to_float(uint8_t bits);
uint8_t float_to_e5m2_bits(float x, Saturation sat = Saturation::kSatFinite);
float e5m2_bits_to_float(uint8_t bits);
// e2m1 (fp4): 4 bits in the low nibble. Values {0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives.
uint8_t float_to_e2m1_bits(float x);
float e2m1_bits_to_float(uint8_t nibble);

// Storage types. Plain structs of bits so they are trivially copyable and have the size of the
// on-disk element; arithmetic goes through float.
struct bf16 {
  uint16_t bits = 0;
  bf16() = default;
  explicit bf16(float x) : bits(float_to_bf16_bits(x)) {}
  static bf16 from_bits(uint16_t b) { bf16 v; v.bits = b; return v; }
  explicit operator float() const { return bf16_bits_to_float(bits); }
};
struct fp16 {
  uint16_t bits = 0;
  fp16() = default;
  explicit fp16(float x) : bits(float_to_fp16_bits(x)) {}
  static fp16 from_bits(uint16_t b) { fp16 v; v.bits = b; return v; }
  explicit operator float() const { return fp16_bits_to_float(bits); }
};
struct e4m3 {
  uint8_t bits = 0;
  e4m3() = default;
  explicit e4m3(float x) : bits(float_to_e4m3_bits(x)) {}
  static e4m3 from_bits(uint8_t b) { e4m3 v; v.bits = b; return v; }
  explicit operator float() const { return e4m3_bits_to_float(bits); }
};
static_assert(sizeof(bf16) == 2 && sizeof(fp16) == 2 && sizeof(e4m3) == 1);

// Largest finite magnitudes, used by the quantizers.
inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE2M1Max = 6.0f;

}  // namespace moebius
