// The layout the CUDA expert GEMMs read, and the repack from checkpoint layouts into it.
//
// [TAG_EXPERT_TILE_LAYOUT] The expert GEMM kernels (src/kernels/moe_gemm.cu) run mma.sync
// m16n8k16 with the WEIGHTS as the A operand (16 output rows x 16 k) and the tokens as the B
// operand (16 k x 8 tokens): "swap AB", so a decode step with one token per expert wastes 7/8 of
// an n8 tile instead of 15/16 of an m16 tile. Weights are repacked once at load so that one warp
// streams a 16-row tile with one coalesced 16-byte load per lane per chunk of K, and each lane's
// 16 bytes are exactly its A-fragment values for the chunk's k-steps:
//
//   weight  [rows_padded / 16][cols_padded / KC][32 lanes][16 B]    (512 B per tile chunk)
//
//   lane l = 4g + t holds, for each k-step s of the chunk (k0 = 16 s), the fragment
//     a0 = W[g][k0+2t]   a1 = W[g][k0+2t+1]   a2 = W[g+8][k0+2t]   a3 = W[g+8][k0+2t+1]
//     a4 = W[g][k0+2t+8] a5 = W[g][k0+2t+9]   a6 = W[g+8][k0+2t+8] a7 = W[g+8][k0+2t+9]
//   (rows relative to the tile), packed per format so the kernel turns them into bf16x2 pairs
//   (a0,a1) (a2,a3) (a4,a5) (a6,a7) with a shift, a mask and an or (lop3):
//     kBF16  KC = 16:  one k-step; words = (a1:a0) (a3:a2) (a5:a4) (a7:a6), low half first.
//     kInt4  KC = 64:  word s = k-step s; nibble j holds a(2j) and nibble j+4 holds a(2j+1), so
//                      (w >> 4j) & 0x000F000F | 0x43004300 is bf16x2 (128 + q_lo, 128 + q_hi).
//                      q is the unsigned GPTQ value; the symmetric zero point is 8.
//     kNvFp4 KC = 64:  word s = k-step s, but the four bits of each e2m1 code (m, e0, e1, sign) are
//                      scattered so that each register is a rotation and a mask of the word
//                      (nvfp4_code_bit): the magnitude must land on bf16 bits 6..8 and the sign
//                      on bit 15 of each half. Registers 0-2 are the word rotated left by 0, 4
//                      and 10 and masked; register 3 takes the remaining bits through rotations
//                      6 and 14 (four rotations of one 4-bit pattern cannot tile 16 bits, so one
//                      register needs two). 9 integer ops per word (was 11 with plain shifts).
//     kInt2  KC = 128: word i holds k-steps 2i and 2i+1; crumb 4u+j holds a(2j) and crumb
//                      8+4u+j holds a(2j+1) of step 2i+u, so (w >> 2(4u+j)) & 0x00030003 works
//                      like int4. Zero point 2.
//
//   scales, per format:
//     kNvFp4  [rows_padded / 16][cols_padded / 64][8 g][8 B]: block scales as u5m3 codes
//             (nvfp4_scale_code), in the order [g b0, g b1, g+8 b0, g+8 b1, g b2, g b3, g+8 b2,
//             g+8 b3] (row g or g+8, block b of the chunk). One 8-byte load per lane; k-step s's
//             pair (rows g, g+8) is bytes (s & 1) and 2 + (s & 1) of word s / 2, so
//             ((word << 4 or >> 4) & 0x0FF00FF0) | 0x60006000 is the bf16x2 {scale_g, scale_g+8}
//             times 2^74 in two integer ops: no table, no shared memory.
//             The code holds |scale|: a negative block scale flips the sign bits of its 16
//             e2m1 codes instead, and a zero scale clears their magnitude bits (code 0 then
//             reads as 2^-9), which gives the same products bit for bit. NaN scales are refused.
//     kIntB   [rows_padded / 16][groups][16 rows] fp16: the group scale of each tile row.
//     kBF16   none.
//   global_scale[2]: NVFP4 weight_scale_2 of tile rows 0-7 and 8-15 (gate and up for the fused
//   GEMM1, see pack_gate_up); 1 for other formats.
//
// Padding: rows to a multiple of 16 and K to a multiple of KC, with weights that dequantize to
// exactly 0 (int: q = zero point; nvfp4: code 0; bf16: 0). The kernels never read activations past
// the logical K, so padded columns contribute 0.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/error.h"
#include "cpu/moe_layer.h"
#include "formats/quant_matrix.h"

namespace moebius::moe {

enum class KernelFormat : uint8_t { kBF16, kNvFp4, kInt4, kInt2 };

inline constexpr int kTileRows = 16;
inline constexpr int kTileBytes = 512;  // 32 lanes x 16 B

// kNvFp4: the left rotation that register j (fragment values a(2j) in the low half, a(2j+1) at
// +16) of the kernel's dequantization (kernels/moe_dequant.cuh, dequant_step) applies to the word
// for e2m1 code bit b (0: mantissa, 1: exponent bit 0, 2: exponent bit 1, 3: sign):
//   j = 0: w & 0x81C081C0            j = 1: rotl(w, 4) & 0x81C081C0    j = 2: rotl(w, 10) & 0x81C081C0
//   j = 3: (rotl(w, 6) & 0x80C080C0) | (rotl(w, 14) & 0x01000100)
// which puts the magnitude on bf16 bits 6..8 and the sign on bit 15 of each half.
inline constexpr int kNvFp4Rotation[4][4] = {{0, 0, 0, 0}, {4, 4, 4, 4}, {10, 10, 10, 10}, {6, 6, 14, 6}};
// The bf16 bit, within a half, that code bit b lands on.
inline constexpr int kNvFp4TargetBit[4] = {6, 7, 8, 15};
// Where code bit b of register j, half `hi`, is stored in the 32-bit word: the bit the rotation
// brings to the target (rotations cross the halves, so the high half's bits may sit in the low one).
constexpr int nvfp4_code_bit(int j, int hi, int b) {
  return (kNvFp4TargetBit[b] + 16 * hi - kNvFp4Rotation[j][b] + 32) % 32;
}
// The tile layout's block-scale code for an e4m3 magnitude (the sign bit is ignored): a positive
// value 2^e (1 + m/8), e in [-9, 8] (e4m3 subnormals included: at most 3 significant bits), is
// ((e + 9) << 3) | m; zero is 0. Inverse: nvfp4_scale_code_value.
uint8_t nvfp4_scale_code(uint8_t e4m3_bits);
float nvfp4_scale_code_value(uint8_t code);
// The bf16 bits that the kernel forms from a code ((code << 4) | 0x6000): the value times 2^74.
inline constexpr uint16_t kNvFp4ScaleCodeBf16Or = 0x6000;
inline constexpr int kNvFp4ScaleCodeExp2 = 74;

// K elements per 16-byte lane chunk.
constexpr int chunk_k(KernelFormat f) {
  return f == KernelFormat::kBF16 ? 16 : f == KernelFormat::kInt2 ? 128 : 64;
}
const char* kernel_format_name(KernelFormat f);
// The kernel format for a QuantMatrix format; int8 and fp32 have no CUDA kernel.
Result<KernelFormat> kernel_format_for(WeightFormat f);

struct PackedMatrix {
  KernelFormat format = KernelFormat::kBF16;
  int64_t rows = 0, cols = 0;                // logical N (for gate_up: 2 * I rounded up to 8), K
  int64_t rows_padded = 0, cols_padded = 0;  // multiples of 16 and chunk_k(format)
  int group_size = 0;                        // kInt*: K elements per scale (a multiple of 16)
  std::vector<uint8_t> weight;               // see [TAG_EXPERT_TILE_LAYOUT]
  std::vector<uint8_t> scales;
  float global_scale[2] = {1.0f, 1.0f};

  int64_t row_tiles() const { return rows_padded / kTileRows; }
  int64_t chunks() const { return cols_padded / chunk_k(format); }
  int64_t groups() const { return group_size > 0 ? (cols_padded + group_size - 1) / group_size : 0; }
};

// The shape of a packed matrix (rows, cols, padding, group size) with no bytes: used to size
// device buffers for dummy weights. weight/scales stay empty.
PackedMatrix packed_shape(KernelFormat format, int64_t rows, int64_t cols, int group_size);
// Bytes of the packed weights and scales, from the shape alone.
size_t packed_weight_bytes(const PackedMatrix& p);
size_t packed_scale_bytes(const PackedMatrix& p);

// Packs one matrix (the down projection [H, I]).
Result<PackedMatrix> pack_matrix(const QuantMatrix& m);

// Packs the fused GEMM1 weight from gate [I, H] and up [I, H]: tile j holds gate rows 8j..8j+7 in
// its rows 0-7 and up rows 8j..8j+7 in rows 8-15, so one mma accumulator holds gate and up of the
// same intermediate index and SwiGLU runs in registers. I is padded to a multiple of 8; `rows`
// becomes 2 * ceil(I / 8) * 8. Gate and up must share format, shape and group size.
Result<PackedMatrix> pack_gate_up(const QuantMatrix& gate, const QuantMatrix& up);

// A whole MoE layer's weights in the device layout, on the host: every expert packed (GEMM1 fused
// gate/up, GEMM2 down), the router in bf16, and the routing and activation settings. Made and
// checked without a GPU. MoeLayerCuda::create uploads one into fresh buffers;
// MoeLayerCuda::update_weights copies one over a layer's existing buffers (a weight update), so
// the two share every step but the allocation.
struct PackedMoeLayer {
  cpu::MoeShape shape;
  KernelFormat format = KernelFormat::kBF16;
  std::vector<PackedMatrix> w13;  // [E] pack_gate_up(gate, up)
  std::vector<PackedMatrix> w2;   // [E] pack_matrix(down)
  std::vector<uint16_t> router;   // [E, H] bf16 bits of the router weight, row-major
  cpu::RouterConfig routing;      // scoring, renormalization, groups, correction bias
  cpu::ActivationConfig activation;
};

// Packs `layer` (validated first). Every expert must pack to the same format and sizes as expert
// 0; the error names the expert otherwise.
Result<PackedMoeLayer> pack_moe_layer(const cpu::MoeLayerReference& layer);

// The dequantized values of a packed matrix as fp32 [rows_padded, cols_padded], computed from the
// packed bytes with exactly the arithmetic of dequantize_rows(). Tests use it to check the repack.
void unpack_to_float(const PackedMatrix& p, float* out);

// [TAG_INT_FOLDED_SCALE] The weight the wgmma prefill GEMM multiplies for an int format: the exact
// dequantized value q * s (unpack_to_float's, exact in fp32) rounded once to bf16, nearest even.
// The device side is fold_int_scale (kernels/moe_dequant.cuh); tests use this to build the
// reference of that kernel.
float folded_int_weight(float exact);

}  // namespace moebius::moe
