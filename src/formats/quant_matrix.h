// One linear weight W [N out, K in] in memory, in any of the formats moebius runs: plain fp32 /
// bf16, NVFP4 (ModelOpt layout) or symmetric int2/int4/int8 (GPTQ / AutoRound layout). This is
// the single description the CPU reference MoE layer and the CUDA kernels consume; the format
// modules (nvfp4.h, gptq.h) create it from a checkpoint or by quantizing fp32 weights.
//
// The packed bytes are kept exactly in the CHECKPOINT layout, so a checkpoint can be used in
// place from its mmap (see docs/FORMATS.md for the authoritative description):
//
//   format   weight                                       scales
//   kF32     float [N, K]                                 -
//   kBF16    bf16  [N, K]                                 -
//   kNvFp4   u8    [N, K/2]  e2m1 codes, element 2j in    e4m3 [N, K/16] one per 16 K-elements,
//                  the low nibble, 2j+1 in the high one   plus fp32 scale_2 per row range
//   kIntB    i32   [K*B/32, N] (GPTQ "qweight"): value    fp16 [ceil(K/g), N] (GPTQ "scales"),
//                  k of column n at bit (k % (32/B))*B    may be negative; zero point is the
//                  of word [k / (32/B), n]                implicit symmetric 2^(B-1)
//
// The symmetric zero point is not stored: loading checks every qzeros entry against it and
// refuses anything else (gptq.h), so "q - 2^(B-1)" is all a kernel needs.
//
// [TAG_NVFP4_SCALE2_SEGMENTS] NVFP4 carries one fp32 global scale ("weight_scale_2") per
// checkpoint tensor. MoE gate and up projections are separate tensors with separate scale_2, and
// the fused gate+up GEMM concatenates them along N, so a QuantMatrix holds a short list of
// (row_begin, scale_2) segments instead of one scalar: row r uses the last segment whose
// row_begin <= r. A matrix loaded from one tensor has exactly one segment {0, scale_2}.
// concat_rows() appends segments; kernels that fuse gate+up must honour them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace moebius {

enum class WeightFormat : uint8_t { kF32, kBF16, kNvFp4, kInt2, kInt4, kInt8 };

std::string_view weight_format_name(WeightFormat f);  // "f32", "bf16", "nvfp4", "int2", "int4", "int8"
int weight_format_bits(WeightFormat f);               // bits per weight element: 32, 16, 4, 2, 4, 8
bool is_int_format(WeightFormat f);                   // kInt2, kInt4, kInt8
// kInt2/kInt4/kInt8 for bits 2/4/8; an error for anything else.
Result<WeightFormat> int_format_for_bits(int bits);

// NVFP4 per-tensor global scale for rows [row_begin, next segment's row_begin).
struct ScaleSegment {
  int64_t row_begin = 0;
  float scale_2 = 0.0f;
};

struct QuantMatrix {
  WeightFormat format = WeightFormat::kF32;
  int64_t rows = 0;  // N, output features
  int64_t cols = 0;  // K, input features
  // K elements that share one scale: 16 for NVFP4; 32/64/128 or K (per-channel, GPTQ's
  // group_size -1) for int formats; 0 for kF32/kBF16.
  int group_size = 0;

  // Packed bytes in the checkpoint layout above. Non-owning: they point into `owner` (matrices
  // made by quantize()/concat_rows()) or into memory the creator keeps alive (an mmap'd
  // checkpoint; pass the checkpoint as `owner` if it is shared). Reads go through memcpy, so no
  // alignment is required here; kernels that need it must check.
  std::span<const uint8_t> weight;
  std::span<const uint8_t> scales;
  std::vector<ScaleSegment> scale_2;  // kNvFp4 only, see [TAG_NVFP4_SCALE2_SEGMENTS]
  std::shared_ptr<const void> owner;  // keeps `weight`/`scales` alive; may be null

  // Consistency of format, dims, group size, byte sizes and segments. Cheap: looks at no
  // weight or scale values.
  Status validate() const;

  int64_t num_groups() const;                 // scale groups along K (K / group_size, rounded up)
  float scale_2_for_row(int64_t row) const;   // kNvFp4 only
};

// Owning storage for matrices built in memory (quantize(), concat_rows(), tests). Build the
// vectors first, then call finish(): it moves the storage into a shared owner and points the
// matrix's spans at it.
struct QuantMatrixStorage {
  std::vector<uint8_t> weight;
  std::vector<uint8_t> scales;
};
QuantMatrix make_owning_matrix(WeightFormat format, int64_t rows, int64_t cols, int group_size,
                               QuantMatrixStorage storage, std::vector<ScaleSegment> scale_2 = {});

// Writes rows [row_begin, row_end) of the dequantized matrix to out [rows, cols] (row r at
// out + r * cols; the other rows are left untouched). `m` must be valid (validate()); the row
// range is asserted. Deterministic; OpenMP splits the rows.
void dequantize_rows(const QuantMatrix& m, int64_t row_begin, int64_t row_end, float* out);

// The round-to-nearest rule that picks symmetric int scales (formulas in gptq.h and FORMATS.md).
enum class IntRtnScheme : uint8_t {
  kAutoRound,  // AutoRound "int_sym" full range: signed scale = max_v / 2^(B-1), all 2^B levels
  kGptq,       // GPTQ Quantizer(sym=True): scale = 2 * amax / (2^B - 1), zero 2^(B-1)
};

struct QuantizeOptions {
  IntRtnScheme int_scheme = IntRtnScheme::kAutoRound;
  // NVFP4: use this global scale instead of amax / (6 * 448) of `w` (e.g. one shared by gate and
  // up). Zero or negative means "compute it".
  float nvfp4_scale_2 = 0.0f;
};

// Quantizes w [rows, cols] (fp32, row-major) into an owning matrix. group_size: 16 (or 0) for
// kNvFp4; 32/64/128/... or -1 (per-channel) for int formats; ignored for kF32/kBF16. Errors for
// shapes the format cannot hold and for non-finite weights.
Result<QuantMatrix> quantize(WeightFormat format, const float* w, int64_t rows, int64_t cols, int group_size,
                             const QuantizeOptions& options = {});

// "<prefix>.<suffix>", or just the suffix when the prefix is empty: checkpoint tensor names of a
// module ("model.layers.0.mlp.experts.3.down_proj" + "qweight").
std::string module_tensor_name(std::string_view prefix, std::string_view suffix);

// Bytes a kernel reads for this matrix: packed weights + scales (+ 4 bytes per NVFP4 segment).
// GPTQ qzeros and g_idx are not counted: they are validated at load and never read again.
size_t weight_bytes(const QuantMatrix& m);

// Stacks matrices of one format, cols and group size along N (e.g. gate on top of up for a fused
// gate+up GEMM) into a new owning matrix. NVFP4 keeps each part's scale_2 segments.
Result<QuantMatrix> concat_rows(std::span<const QuantMatrix> parts);

}  // namespace moebius
