#include "formats/quant_matrix.h"

#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "formats/gptq.h"
#include "formats/nvfp4.h"

namespace moebius {

std::string_view weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::kF32: return "f32";
    case WeightFormat::kBF16: return "bf16";
    case WeightFormat::kNvFp4: return "nvfp4";
    case WeightFormat::kInt2: return "int2";
    case WeightFormat::kInt4: return "int4";
    case WeightFormat::kInt8: return "int8";
  }
  return "?";
}

int weight_format_bits(WeightFormat f) {
  switch (f) {
    case WeightFormat::kF32: return 32;
    case WeightFormat::kBF16: return 16;
    case WeightFormat::kNvFp4: return 4;
    case WeightFormat::kInt2: return 2;
    case WeightFormat::kInt4: return 4;
    case WeightFormat::kInt8: return 8;
  }
  return 0;
}

bool is_int_format(WeightFormat f) {
  return f == WeightFormat::kInt2 || f == WeightFormat::kInt4 || f == WeightFormat::kInt8;
}

Result<WeightFormat> int_format_for_bits(int bits) {
  switch (bits) {
    case 2: return WeightFormat::kInt2;
    case 4: return WeightFormat::kInt4;
    case 8: return WeightFormat::kInt8;
    default: return Error::format("{}-bit integer weights are not supported (supported: 2, 4, 8)", bits);
  }
}

int64_t QuantMatrix::num_groups() const {
  if (group_size <= 0) return 0;
  return (cols + group_size - 1) / group_size;
}

float QuantMatrix::scale_2_for_row(int64_t row) const {
  MOEBIUS_ASSERT(!scale_2.empty() && row >= 0 && row < rows, "row {} of {}, {} segments", row, rows, scale_2.size());
  // Segments are few (one per concatenated tensor): a linear scan from the back is fastest.
  for (size_t i = scale_2.size(); i-- > 0;)
    if (scale_2[i].row_begin <= row) return scale_2[i].scale_2;
  return scale_2.front().scale_2;  // unreachable for a valid matrix (first segment starts at 0)
}

namespace {
// Index of the first e4m3 NaN (S.1111.111) in `s`, or s.size(): eight bytes per step (a byte whose
// low 7 bits are all ones), then the exact byte of the word that has one.
size_t first_nan_scale(std::span<const uint8_t> s) {
  constexpr uint64_t kLow7 = 0x7F7F7F7F7F7F7F7Full, kOnes = 0x0101010101010101ull, kHigh = 0x8080808080808080ull;
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    const uint64_t x = (w & kLow7) ^ kLow7;  // a zero byte where the low 7 bits were all ones
    if (((x - kOnes) & ~x & kHigh) != 0) break;
  }
  for (; i < s.size(); ++i)
    if ((s[i] & 0x7Fu) == 0x7Fu) return i;
  return s.size();
}
// Index (in halves) of the first fp16 Inf or NaN (exponent bits all ones) in `s`, or s.size() / 2:
// four halves per step, then the exact half of the word that has one. An Inf or NaN group scale
// turns its rows' outputs into NaN; GPTQ/AutoRound checkpoints have been seen with fp16 overflow.
size_t first_nonfinite_fp16(std::span<const uint8_t> s) {
  constexpr uint64_t kExp = 0x7C007C007C007C00ull, kOne = 0x0001000100010001ull, kHigh = 0x8000800080008000ull;
  const size_t n = s.size() / 2;
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    uint64_t w;
    std::memcpy(&w, s.data() + 2 * i, 8);
    const uint64_t x = (w & kExp) ^ kExp;  // a zero half where the exponent bits were all ones
    if (((x - kOne) & ~x & kHigh) != 0) break;
  }
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, s.data() + 2 * i, 2);
    if ((h & 0x7C00u) == 0x7C00u) return i;
  }
  return n;
}
}  // namespace

Status QuantMatrix::validate() const {
  const std::string_view name = weight_format_name(format);
  if (rows <= 0 || cols <= 0) return Error::format("{} matrix has bad shape [{}, {}]", name, rows, cols);
  auto expect_bytes = [&](std::span<const uint8_t> s, int64_t want, const char* what) -> Status {
    if (static_cast<int64_t>(s.size()) != want)
      return Error::format("{} [{}, {}] matrix: {} has {} bytes, expected {}", name, rows, cols, what, s.size(), want);
    if (want > 0 && s.data() == nullptr) return Error::format("{} matrix: {} has no data", name, what);
    return Ok{};
  };
  switch (format) {
    case WeightFormat::kF32:
    case WeightFormat::kBF16:
      MOEBIUS_TRY(expect_bytes(weight, rows * cols * (format == WeightFormat::kF32 ? 4 : 2), "weight"));
      if (!scales.empty() || !scale_2.empty()) return Error::format("{} matrix has scales", name);
      return Ok{};
    case WeightFormat::kNvFp4: {
      if (group_size != nvfp4::kBlockSize)
        return Error::format("nvfp4 matrix has group size {}, expected {}", group_size, nvfp4::kBlockSize);
      if (cols % nvfp4::kBlockSize != 0)
        return Error::format("nvfp4 matrix: K = {} is not a multiple of {}", cols, nvfp4::kBlockSize);
      MOEBIUS_TRY(expect_bytes(weight, rows * cols / 2, "weight"));
      MOEBIUS_TRY(expect_bytes(scales, rows * (cols / nvfp4::kBlockSize), "weight_scale"));
      // A NaN block scale (e4m3 0x7F / 0xFF) is a broken checkpoint, not a value to compute with:
      // it would turn its whole output row into NaN (and the CUDA tile layout has no code for it).
      // validate() runs at load and again when the experts are packed, over GBs of scales for a
      // 235B-class model, so the scan tests 8 bytes at a time and looks closer only on a hit.
      if (const size_t i = first_nan_scale(scales); i < scales.size())
        return Error::format("nvfp4 matrix: block scale [{}, {}] is NaN (0x{:02X})",
                             static_cast<int64_t>(i) / (cols / nvfp4::kBlockSize),
                             static_cast<int64_t>(i) % (cols / nvfp4::kBlockSize), scales[i]);
      if (scale_2.empty() || scale_2.front().row_begin != 0)
        return Error("nvfp4 matrix: scale_2 segments must start at row 0");
      for (size_t i = 0; i < scale_2.size(); ++i) {
        const ScaleSegment& s = scale_2[i];
        if (i > 0 && s.row_begin <= scale_2[i - 1].row_begin)
          return Error::format("nvfp4 matrix: scale_2 segment {} starts at row {}, not after row {}", i, s.row_begin,
                               scale_2[i - 1].row_begin);
        if (s.row_begin >= rows)
          return Error::format("nvfp4 matrix: scale_2 segment {} starts at row {} of {}", i, s.row_begin, rows);
        if (!std::isfinite(s.scale_2) || s.scale_2 < 0.0f)
          return Error::format("nvfp4 matrix: scale_2 of segment {} is {}", i, s.scale_2);
      }
      return Ok{};
    }
    case WeightFormat::kInt2:
    case WeightFormat::kInt4:
    case WeightFormat::kInt8: {
      const int bits = weight_format_bits(format);
      const int p = 32 / bits;
      if (cols % p != 0) return Error::format("{} matrix: K = {} is not a multiple of {}", name, cols, p);
      if (group_size <= 0 || group_size > cols)
        return Error::format("{} matrix: group size {} is not in [1, K = {}]", name, group_size, cols);
      if (!scale_2.empty()) return Error::format("{} matrix has NVFP4 scale_2 segments", name);
      MOEBIUS_TRY(expect_bytes(weight, (cols / p) * rows * 4, "qweight"));
      MOEBIUS_TRY(expect_bytes(scales, num_groups() * rows * 2, "scales"));
      if (const size_t i = first_nonfinite_fp16(scales); i < scales.size() / 2) {
        uint16_t h;
        std::memcpy(&h, scales.data() + 2 * i, 2);
        return Error::format("{} matrix: group scale [{}, {}] is not finite (fp16 0x{:04X})", name,
                             static_cast<int64_t>(i) / rows, static_cast<int64_t>(i) % rows, h);
      }
      return Ok{};
    }
  }
  return Error::format("unknown weight format {}", static_cast<int>(format));
}

QuantMatrix make_owning_matrix(WeightFormat format, int64_t rows, int64_t cols, int group_size,
                               QuantMatrixStorage storage, std::vector<ScaleSegment> scale_2) {
  auto owned = std::make_shared<QuantMatrixStorage>(std::move(storage));
  QuantMatrix m;
  m.format = format;
  m.rows = rows;
  m.cols = cols;
  m.group_size = group_size;
  m.weight = {owned->weight.data(), owned->weight.size()};
  m.scales = {owned->scales.data(), owned->scales.size()};
  m.scale_2 = std::move(scale_2);
  m.owner = std::move(owned);
  return m;
}

void dequantize_rows(const QuantMatrix& m, int64_t row_begin, int64_t row_end, float* out) {
  MOEBIUS_ASSERT(0 <= row_begin && row_begin <= row_end && row_end <= m.rows, "rows [{}, {}) of {}", row_begin,
                 row_end, m.rows);
  switch (m.format) {
    case WeightFormat::kF32:
      std::memcpy(out + row_begin * m.cols, m.weight.data() + row_begin * m.cols * 4,
                  static_cast<size_t>((row_end - row_begin) * m.cols) * sizeof(float));
      return;
    case WeightFormat::kBF16: {
      const int64_t k = m.cols;
#pragma omp parallel for schedule(static)
      for (int64_t r = row_begin; r < row_end; ++r) {
        for (int64_t c = 0; c < k; ++c) {
          uint16_t b;
          std::memcpy(&b, m.weight.data() + (r * k + c) * 2, 2);
          out[r * k + c] = bf16_bits_to_float(b);
        }
      }
      return;
    }
    case WeightFormat::kNvFp4:
      nvfp4::dequantize_rows(m, row_begin, row_end, out);
      return;
    case WeightFormat::kInt2:
    case WeightFormat::kInt4:
    case WeightFormat::kInt8:
      gptq::dequantize_rows(m, row_begin, row_end, out);
      return;
  }
  MOEBIUS_ASSERT(false, "unknown weight format {}", static_cast<int>(m.format));
}

Result<QuantMatrix> quantize(WeightFormat format, const float* w, int64_t rows, int64_t cols, int group_size,
                             const QuantizeOptions& options) {
  if (rows <= 0 || cols <= 0) return Error::format("cannot quantize a [{}, {}] matrix", rows, cols);
  if (format == WeightFormat::kF32 || format == WeightFormat::kBF16) {  // the others check as they quantize
    if (const int64_t i = first_non_finite(w, rows * cols); i >= 0)
      return Error::format("{}: weight [{}, {}] is not finite ({})", weight_format_name(format), i / cols, i % cols, w[i]);
  }
  switch (format) {
    case WeightFormat::kF32: {
      QuantMatrixStorage st;
      st.weight.resize(static_cast<size_t>(rows * cols) * 4);
      std::memcpy(st.weight.data(), w, st.weight.size());
      return make_owning_matrix(format, rows, cols, 0, std::move(st));
    }
    case WeightFormat::kBF16: {
      QuantMatrixStorage st;
      st.weight.resize(static_cast<size_t>(rows * cols) * 2);
      for (int64_t i = 0; i < rows * cols; ++i) {
        const uint16_t b = float_to_bf16_bits(w[i]);
        std::memcpy(st.weight.data() + i * 2, &b, 2);
      }
      return make_owning_matrix(format, rows, cols, 0, std::move(st));
    }
    case WeightFormat::kNvFp4: {
      if (group_size != 0 && group_size != nvfp4::kBlockSize)
        return Error::format("NVFP4 has group size {}, not {}", nvfp4::kBlockSize, group_size);
      std::optional<float> s2;
      if (options.nvfp4_scale_2 > 0.0f) s2 = options.nvfp4_scale_2;
      return nvfp4::quantize(w, rows, cols, s2);
    }
    case WeightFormat::kInt2:
    case WeightFormat::kInt4:
    case WeightFormat::kInt8:
      return gptq::quantize(w, rows, cols, weight_format_bits(format), group_size, options.int_scheme);
  }
  return Error::format("unknown weight format {}", static_cast<int>(format));
}

std::string module_tensor_name(std::string_view prefix, std::string_view suffix) {
  std::string s(prefix);
  if (!s.empty()) s += '.';
  s += suffix;
  return s;
}

size_t weight_bytes(const QuantMatrix& m) {
  return m.weight.size() + m.scales.size() + m.scale_2.size() * sizeof(float);
}

Result<QuantMatrix> concat_rows(std::span<const QuantMatrix> parts) {
  if (parts.empty()) return Error("concat_rows: no matrices");
  const QuantMatrix& first = parts.front();
  int64_t total_rows = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const QuantMatrix& p = parts[i];
    MOEBIUS_TRY(p.validate());
    if (p.format != first.format || p.cols != first.cols || p.group_size != first.group_size)
      return Error::format("concat_rows: part {} is {} [{}, {}] g={}, part 0 is {} [{}, {}] g={}", i,
                           weight_format_name(p.format), p.rows, p.cols, p.group_size,
                           weight_format_name(first.format), first.rows, first.cols, first.group_size);
    total_rows += p.rows;
  }

  QuantMatrixStorage st;
  std::vector<ScaleSegment> segments;
  if (!is_int_format(first.format)) {
    // Row-major formats: rows (and NVFP4's per-row scales) simply follow each other.
    int64_t row0 = 0;
    for (const QuantMatrix& p : parts) {
      st.weight.insert(st.weight.end(), p.weight.begin(), p.weight.end());
      st.scales.insert(st.scales.end(), p.scales.begin(), p.scales.end());
      for (const ScaleSegment& s : p.scale_2) segments.push_back({row0 + s.row_begin, s.scale_2});
      row0 += p.rows;
    }
  } else {
    // qweight [K/P, N] and scales [G, N] are K-major: every word row / group row gets each
    // part's N columns in turn.
    const int64_t word_rows = first.cols / (32 / weight_format_bits(first.format));
    const int64_t groups = first.num_groups();
    for (int64_t i = 0; i < word_rows; ++i)
      for (const QuantMatrix& p : parts) {
        const auto* src = p.weight.data() + i * p.rows * 4;
        st.weight.insert(st.weight.end(), src, src + p.rows * 4);
      }
    for (int64_t g = 0; g < groups; ++g)
      for (const QuantMatrix& p : parts) {
        const auto* src = p.scales.data() + g * p.rows * 2;
        st.scales.insert(st.scales.end(), src, src + p.rows * 2);
      }
  }
  return make_owning_matrix(first.format, total_rows, first.cols, first.group_size, std::move(st),
                            std::move(segments));
}

}  // namespace moebius
