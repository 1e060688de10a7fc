// NVFP4 weights in the NVIDIA ModelOpt checkpoint layout (hf_quant_config.json quant_algo
// "NVFP4"). For a linear weight W [N, K], K a multiple of 16, a checkpoint stores
//   <prefix>.weight          U8      [N, K/2]   two e2m1 codes per byte: element 2j in the low
//                                               nibble, element 2j+1 in the high nibble
//   <prefix>.weight_scale    F8_E4M3 [N, K/16]  one block scale per 16 consecutive K elements
//   <prefix>.weight_scale_2  F32     [] or [1]  global scale = amax(|W|) / (6 * 448)
//   <prefix>.input_scale     F32     [] or [1]  activation scale; W4A16 reads and ignores it
// and W[n, k] = e2m1(code) * e4m3(weight_scale[n, k/16]) * weight_scale_2.
//
// [TAG_NVFP4_SCALE_FORMULA] The quantizer follows ModelOpt's NVFP4QTensor (dynamic path) op by
// op, in fp32, with IEEE division (never a multiply by a reciprocal):
//   scale_2  = amax / 2688.0f                      (2688 = 6 * 448, exact)
//   s        = block_amax / (6.0f * scale_2)       fp32 multiply, then fp32 divide
//   s        = (s == 0) ? 1.0f : s                 ModelOpt: all-zero block -> scale 1.0
//   s        = max(s, 2^-9)                        ModelOpt: clamp at the e4m3 subnormal minimum
//   s_e4m3   = e4m3(s)                             RNE, saturating (s <= ~448 anyway)
//   code     = e2m1(w / (float(s_e4m3) * scale_2)) fp32 multiply, fp32 divide, RNE, saturate at 6;
//                                                  the sign bit is set only for w/denom < 0,
//                                                  so -0.0 gives code 0 (as ModelOpt's w < 0)
//   dequant  = (e2m1(code) * float(s_e4m3)) * scale_2
//            The first product is exact (2 x 4 significant bits), so this is the exact product
//            rounded once; ModelOpt's e2m1 * (s * scale_2) can differ from it in the last bit.
// amax == 0 (ModelOpt would produce NaN from 0/0): scale_2 = 0, every block scale 1.0 (0x38),
// every code 0; it dequantizes to exact zeros.
// Note: torch on CUDA divides by a Python scalar as a multiply by its fp32 reciprocal, so
// ModelOpt run on a GPU may store a weight_scale_2 one ulp away from amax / 2688.0f. Loading is
// unaffected (we use the stored value); only our own quantizer is pinned to the division.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>

#include "core/error.h"
#include "core/tensor.h"
#include "formats/quant_matrix.h"

namespace moebius::nvfp4 {

inline constexpr int kBlockSize = 16;
inline constexpr float kMinBlockScale = 0x1p-9f;  // smallest positive e4m3 (subnormal)
inline constexpr float kGlobalDivisor = 6.0f * 448.0f;
inline constexpr uint8_t kZeroBlockScaleBits = 0x38;  // e4m3 1.0

// amax / 2688.0f; 0 for amax 0.
float global_scale(float amax);
// e4m3 bits of the block scale for a block with max |w| = block_amax. scale_2 == 0 (amax 0)
// gives 1.0.
uint8_t block_scale_bits(float block_amax, float scale_2);
// e2m1 code (low nibble) of w in a block with scale bits `scale_bits`.
uint8_t quantize_value(float w, uint8_t scale_bits, float scale_2);
float dequantize_value(uint8_t code, uint8_t scale_bits, float scale_2);

// Nibble k of a packed row [K/2].
inline uint8_t get_code(const uint8_t* packed_row, int64_t k) {
  return static_cast<uint8_t>((packed_row[k >> 1] >> ((k & 1) * 4)) & 0xF);
}
inline void set_code(uint8_t* packed_row, int64_t k, uint8_t code) {
  const int shift = static_cast<int>(k & 1) * 4;
  uint8_t& b = packed_row[k >> 1];
  b = static_cast<uint8_t>((b & ~(0xF << shift)) | ((code & 0xF) << shift));
}

// Quantizes w [rows, cols] (cols % 16 == 0). scale_2: the global scale to use (e.g. one shared
// by several shards); when absent, global_scale(amax(|w|)). An explicit scale_2 must be finite
// and > 0, or exactly 0 only when w is all zeros.
Result<QuantMatrix> quantize(const float* w, int64_t rows, int64_t cols, std::optional<float> scale_2 = {});

// The tensors of one NVFP4 linear layer, as read from a checkpoint.
struct CheckpointTensors {
  TensorView weight;                       // U8 [N, K/2]
  TensorView weight_scale;                 // F8_E4M3 [N, K/16]
  TensorView weight_scale_2;               // F32 [] or [1]
  std::optional<TensorView> input_scale;   // F32 [] or [1]; checked, unused by W4A16
};

// Checks dtypes, shapes and the global scale (finite, >= 0) and returns a non-owning matrix
// over the views' bytes. `prefix` is the module name ("model.layers.0.mlp.experts.3.up_proj")
// used to name tensors in errors. `owner`, if given, is stored in the matrix to keep the bytes
// alive. Host-readable views only (not kDevice).
Result<QuantMatrix> from_checkpoint(const CheckpointTensors& t, std::string_view prefix,
                                    std::shared_ptr<const void> owner = {});

// dequantize_rows() for kNvFp4 (quant_matrix.h dispatches here).
void dequantize_rows(const QuantMatrix& m, int64_t row_begin, int64_t row_end, float* out);

}  // namespace moebius::nvfp4
