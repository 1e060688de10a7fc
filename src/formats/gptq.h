// Symmetric integer weights in the GPTQ checkpoint layout, as written by AutoGPTQ, GPTQModel and
// AutoRound (packing_format "auto_round:auto_gptq"). B = bits in {2, 4, 8}, P = 32 / B values per
// int32, g = group size (32, 64, 128, ... or K for per-channel, group_size -1 in configs),
// G = ceil(K / g). For a linear weight W [N, K] a checkpoint stores
//   <prefix>.qweight  I32 [K / P, N]  value k of column n in bits [(k % P) * B, +B) of word
//                                      [k / P, n], lowest bits first along K
//   <prefix>.qzeros   I32 [G, N / P]  zero point of (group, column n) in bits [(n % P) * B, +B) of
//                                      word [group, n / P], lowest bits first along N
//   <prefix>.scales   F16 [G, N]      may be negative (AutoRound full-range symmetric)
//   <prefix>.g_idx    I32 [K]         optional; group of input k
// and W[n, k] = (q[k, n] - z) * scales[g_idx[k], n] with q unsigned in [0, 2^B).
//
// Zero points. Symmetric quantization uses z = 2^(B-1) everywhere. What is STORED depends on the
// checkpoint convention:
//   ZeroFormat::kV1MinusOne  stored = z - 1 (GPTQ v1, the AutoGPTQ heritage: 0x77777777 for
//                            4 bits). Written by AutoGPTQ, by GPTQModel with checkpoint_format
//                            "gptq" (its default on save), and by AutoRound for packing_format
//                            "auto_round:auto_gptq" / "auto_round:gptq" (its choice for sym=True).
//   ZeroFormat::kV2Exact     stored = z. GPTQModel checkpoint_format "gptq_v2", and AutoRound's
//                            own packings "auto_round" and "auto_round:gptqmodel".
// Loading checks that every stored zero is the symmetric one; anything else is an asymmetric
// checkpoint and is refused with the group and column of the first offending entry.
//
// [TAG_INT_RTN_FORMULA] quantize() implements two reference round-to-nearest rules per group of
// g consecutive K values (rint = round half to even, as torch.round; all fp32):
//   kAutoRound (AutoRound "int_sym", full range, its RTN with iters=0):
//     wmin = min(min(w), 0); wmax = max(max(w), 0)
//     max_v = (wmax < -wmin) ? -wmin : -wmax          the scale is NEGATIVE when the positive side
//                                                      dominates, so the extreme maps to q = 0
//     s16   = fp16(max_v / 2^(B-1))                    division by a power of two: exact
//     s16   = s16 < 0 ? min(s16, -fp16(1e-5)) : max(s16, fp16(1e-5))   (q_scale_thresh)
//     q     = clamp(rint(w / float(s16)) + 2^(B-1), 0, 2^B - 1)
//     stored scale = s16
//   kGptq (GPTQ Quantizer with sym=True, the scale stored in fp16 by its packer):
//     xmin = min(min(w), 0); xmax = max(max(w), 0); xmax = max(-xmin, xmax)
//     if xmin < 0: xmin = -xmax;  if xmin == 0 and xmax == 0: xmin = -1, xmax = 1
//     s32   = (xmax - xmin) / (2^B - 1)                fp32 division
//     q     = clamp(rint(w / s32) + 2^(B-1), 0, 2^B - 1)
//     stored scale = fp16(s32)                          (RNE; q is computed with s32, like GPTQ)
//     (GPTQ's quirk is kept: a group with no negative value keeps xmin = 0 and clips at q = 15.)
// Dequantization is (q - 2^(B-1)) * float(scale): an exact product in fp32.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "formats/quant_matrix.h"

namespace moebius::gptq {

enum class ZeroFormat : uint8_t { kV1MinusOne, kV2Exact };

inline int pack_factor(int bits) { return 32 / bits; }
inline uint32_t symmetric_zero(int bits) { return 1u << (bits - 1); }
// The zero point as stored in qzeros for symmetric weights.
inline uint32_t stored_symmetric_zero(int bits, ZeroFormat f) {
  return f == ZeroFormat::kV1MinusOne ? symmetric_zero(bits) - 1 : symmetric_zero(bits);
}
// Field i (0 = lowest bits) of a packed word.
inline uint32_t get_field(uint32_t word, int i, int bits) {
  return (word >> (i * bits)) & ((1u << bits) - 1u);
}
// Quantized value q of (k, n) in a qweight [K / P, N] (read with memcpy: no alignment needed).
uint32_t get_q(const uint8_t* qweight, int64_t n_cols, int64_t k, int64_t n, int bits);

// Quantizes w [rows N, cols K] to an owning kInt2/kInt4/kInt8 matrix. group_size: > 0 and a
// multiple of P, or -1 for per-channel (one group over all K). Needs K % P == 0 and N % P == 0
// (the qzeros packing along N). The last group may be partial when K % group_size != 0, as in
// AutoRound/GPTQ (their padding with zeros changes neither amax nor any q).
Result<QuantMatrix> quantize(const float* w, int64_t rows, int64_t cols, int bits, int group_size,
                             IntRtnScheme scheme = IntRtnScheme::kAutoRound);

// qzeros [G, N / P] holding the symmetric zero point in convention `f`, for writing checkpoints.
std::vector<int32_t> make_symmetric_qzeros(int bits, int64_t groups, int64_t n_cols, ZeroFormat f);

// The tensors of one GPTQ linear layer, as read from a checkpoint.
struct CheckpointTensors {
  TensorView qweight;                 // I32 [K / P, N]
  TensorView qzeros;                  // I32 [G, N / P]
  TensorView scales;                  // F16 [G, N]
  std::optional<TensorView> g_idx;    // I32 or I64 [K]
};

// What the quantization config says about one layer (see quant_config.h).
struct Layout {
  int bits = 4;
  int group_size = 128;  // -1: per-channel
  ZeroFormat zeros = ZeroFormat::kV1MinusOne;
};

// Checks dtypes and shapes, validates qzeros (symmetric only) and g_idx (trivial only: desc_act
// checkpoints with a real permutation are refused), and returns a non-owning matrix over the
// qweight and scales bytes. `prefix` names the module in errors. Host-readable views only.
Result<QuantMatrix> from_checkpoint(const CheckpointTensors& t, const Layout& layout, std::string_view prefix,
                                    std::shared_ptr<const void> owner = {});

// The two value checks from_checkpoint() runs, exposed for tools and tests. `tensor` names the
// tensor in errors.
Status check_symmetric_qzeros(const TensorView& qzeros, int bits, ZeroFormat f, std::string_view tensor);
Status check_trivial_g_idx(const TensorView& g_idx, int64_t k_dim, int group_size, std::string_view tensor);

// dequantize_rows() for the int formats (quant_matrix.h dispatches here).
void dequantize_rows(const QuantMatrix& m, int64_t row_begin, int64_t row_end, float* out);

}  // namespace moebius::gptq
