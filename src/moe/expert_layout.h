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
//                      scattered so that registers 0-2 need one shift and one mask each
//                      (kNvFp4CodeBits): the magnitude must land on bf16 bits 6..8 and the sign
//                      on bit 15 of each half, and three of the four registers can be stored at
//                      left shifts 0, 3 and 6 of that pattern; the fourth uses the remaining
//                      bits {10, 11, 13, 14} and three shifts. 11 integer ops per word instead of
//                      16 for contiguous nibbles (no 4 shifts of the pattern tile 16 bits).
//     kInt2  KC = 128: word i holds k-steps 2i and 2i+1; crumb 4u+j holds a(2j) and crumb
//                      8+4u+j holds a(2j+1) of step 2i+u, so (w >> 2(4u+j)) & 0x00030003 works
//                      like int4. Zero point 2.
//
//   scales, per format:
//     kNvFp4  [rows_padded / 16][cols_padded / 64][8 g][8 B]: e4m3 block scales; byte s is row g
//             block s of the chunk, byte 4+s is row g+8 block s. One 8-byte load per lane.
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

// kNvFp4: bit position, within each 16-bit half of a k-step's word, of e2m1 code bit b (0: mantissa,
// 1: exponent bit 0, 2: exponent bit 1, 3: sign) of register j (fragment values a(2j) in the low
// half, a(2j+1) at +16). The kernel (kernels/moe_dequant.cuh, dequant_step) extracts register j as
//   j = 0: w & 0x81C081C0          j = 1: (w << 3) & 0x81C081C0      j = 2: (w << 6) & 0x81C081C0
//   j = 3: ((w >> 4) & 0x00C000C0) | ((w >> 5) & 0x01000100) | ((w << 1) & 0x80008000)
// which puts the magnitude on bf16 bits 6..8 and the sign on bit 15 of each half.
inline constexpr int kNvFp4CodeBits[4][4] = {{6, 7, 8, 15}, {3, 4, 5, 12}, {0, 1, 2, 9}, {10, 11, 13, 14}};

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
  std::vector<uint16_t> router;   // [E, H] bf16 bits of the router weight (the GEMV reads these)
  PackedMatrix router_tiles;      // the same in the bf16 tile layout (the tensor-core router GEMM)
  cpu::RouterConfig routing;      // scoring, renormalization, groups, correction bias
  cpu::ActivationConfig activation;
};

// The router weight [E, H] (bf16 bits) in the bf16 tile layout, as one "expert" of E rows.
PackedMatrix pack_router(std::span<const uint16_t> bits, int64_t num_experts, int64_t hidden);

// Packs `layer` (validated first). Every expert must pack to the same format and sizes as expert
// 0; the error names the expert otherwise.
Result<PackedMoeLayer> pack_moe_layer(const cpu::MoeLayerReference& layer);

// The dequantized values of a packed matrix as fp32 [rows_padded, cols_padded], computed from the
// packed bytes with exactly the arithmetic of dequantize_rows(). Tests use it to check the repack.
void unpack_to_float(const PackedMatrix& p, float* out);

}  // namespace moebius::moe
