#include "formats/gptq.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/dtype.h"

namespace moebius::gptq {

namespace {

uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// The stored value replicated into every field of a word.
uint32_t replicate(uint32_t value, int bits) {
  uint32_t w = 0;
  for (int i = 0; i < 32 / bits; ++i) w |= value << (i * bits);
  return w;
}

const char* zero_format_name(ZeroFormat f) {
  return f == ZeroFormat::kV1MinusOne ? "GPTQ v1, stored as zero - 1" : "GPTQ v2 / auto_round, stored as is";
}

// The scale of one group: `stored` goes to the checkpoint (fp16 bits), `divisor` is what the
// reference quantizer divides by. [TAG_INT_RTN_FORMULA]
struct GroupScale {
  uint16_t stored = 0;
  float divisor = 0.0f;
};

GroupScale autoround_scale(float wmin, float wmax, int bits) {
  const float max_v = (wmax < -wmin) ? -wmin : -wmax;
  const float s = max_v / static_cast<float>(1 << (bits - 1));  // exact: a power of two
  uint16_t h = float_to_fp16_bits(s);
  static const uint16_t kThresh = float_to_fp16_bits(1e-5f);    // AutoRound's q_scale_thresh
  static const float kThreshF = fp16_bits_to_float(kThresh);
  const float hf = fp16_bits_to_float(h);
  if (hf < 0.0f) {
    if (hf > -kThreshF) h = static_cast<uint16_t>(kThresh | 0x8000u);
  } else if (hf < kThreshF) {  // also +-0: torch.where(scale < 0, ...) sends -0.0 to the min clamp
    h = kThresh;
  }
  return {h, fp16_bits_to_float(h)};
}

GroupScale gptq_scale(float wmin, float wmax, int bits) {
  float xmin = wmin, xmax = std::max(-wmin, wmax);
  if (xmin < 0.0f) xmin = -xmax;
  if (xmin == 0.0f && xmax == 0.0f) {
    xmin = -1.0f;
    xmax = 1.0f;
  }
  const float s = (xmax - xmin) / static_cast<float>((1 << bits) - 1);
  return {float_to_fp16_bits(s), s};
}

}  // namespace

uint32_t get_q(const uint8_t* qweight, int64_t n_cols, int64_t k, int64_t n, int bits) {
  const int p = pack_factor(bits);
  return get_field(load_u32(qweight + ((k / p) * n_cols + n) * 4), static_cast<int>(k % p), bits);
}

Result<QuantMatrix> quantize(const float* w, int64_t rows, int64_t cols, int bits, int group_size,
                             IntRtnScheme scheme) {
  MOEBIUS_ASSIGN_OR_RETURN(const WeightFormat format, int_format_for_bits(bits));
  if (rows <= 0 || cols <= 0) return Error::format("int{}: bad shape [{}, {}]", bits, rows, cols);
  const int p = pack_factor(bits);
  if (cols % p != 0)
    return Error::format("int{}: K = {} is not a multiple of {} (values per int32)", bits, cols, p);
  if (group_size != -1 && group_size <= 0)
    return Error::format("int{}: group size {} is neither -1 (per-channel) nor positive", bits, group_size);
  const int64_t g = (group_size == -1) ? cols : std::min<int64_t>(group_size, cols);
  const int64_t groups = (cols + g - 1) / g;
  for (int64_t i = 0; i < rows * cols; ++i)
    if (!std::isfinite(w[i])) return Error::format("int{}: weight [{}, {}] is not finite ({})", bits, i / cols, i % cols, w[i]);

  QuantMatrixStorage st;
  st.weight.assign(static_cast<size_t>((cols / p) * rows * 4), 0);  // qweight [K/P, N]
  st.scales.assign(static_cast<size_t>(groups * rows * 2), 0);      // scales [G, N]
  const float zero = static_cast<float>(symmetric_zero(bits));
  const float maxq = static_cast<float>((1 << bits) - 1);

#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < rows; ++n) {  // row n owns column n of qweight and scales: no races
    const float* wr = w + n * cols;
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int64_t k0 = gi * g, k1 = std::min(cols, k0 + g);
      float wmin = 0.0f, wmax = 0.0f;  // clamped to include 0, as both references do
      for (int64_t k = k0; k < k1; ++k) {
        wmin = std::min(wmin, wr[k]);
        wmax = std::max(wmax, wr[k]);
      }
      const GroupScale s = scheme == IntRtnScheme::kAutoRound ? autoround_scale(wmin, wmax, bits)
                                                              : gptq_scale(wmin, wmax, bits);
      std::memcpy(st.scales.data() + (gi * rows + n) * 2, &s.stored, 2);
      for (int64_t k = k0; k < k1; ++k) {
        float q = zero;
        if (s.divisor != 0.0f) q = std::clamp(std::nearbyint(wr[k] / s.divisor) + zero, 0.0f, maxq);
        uint8_t* word = st.weight.data() + ((k / p) * rows + n) * 4;
        uint32_t v = load_u32(word);
        v |= static_cast<uint32_t>(q) << ((k % p) * bits);
        std::memcpy(word, &v, 4);
      }
    }
  }
  for (int64_t i = 0; i < groups * rows; ++i)
    if (std::isinf(fp16_bits_to_float(load_u16(st.scales.data() + i * 2))))
      return Error::format("int{}: the scale of group {} of row {} overflows fp16", bits, i / rows, i % rows);
  return make_owning_matrix(format, rows, cols, static_cast<int>(g), std::move(st));
}

std::vector<int32_t> make_symmetric_qzeros(int bits, int64_t groups, int64_t n_cols, ZeroFormat f) {
  const int p = pack_factor(bits);
  MOEBIUS_ASSERT(n_cols % p == 0, "N = {} is not a multiple of {}", n_cols, p);
  const uint32_t word = replicate(stored_symmetric_zero(bits, f), bits);
  int32_t sword;
  std::memcpy(&sword, &word, 4);
  return std::vector<int32_t>(static_cast<size_t>(groups * (n_cols / p)), sword);
}

Status check_symmetric_qzeros(const TensorView& qzeros, int bits, ZeroFormat f, std::string_view tensor) {
  const int p = pack_factor(bits);
  const uint32_t want = stored_symmetric_zero(bits, f);
  const uint32_t want_word = replicate(want, bits);
  const auto* data = static_cast<const uint8_t*>(qzeros.data);
  const int64_t rows = qzeros.shape[0], words = qzeros.shape[1];
  for (int64_t gi = 0; gi < rows; ++gi) {
    for (int64_t j = 0; j < words; ++j) {
      const uint32_t word = load_u32(data + (gi * words + j) * 4);
      if (word == want_word) continue;
      for (int i = 0; i < p; ++i) {
        const uint32_t v = get_field(word, i, bits);
        if (v == want) continue;
        const ZeroFormat other = f == ZeroFormat::kV1MinusOne ? ZeroFormat::kV2Exact : ZeroFormat::kV1MinusOne;
        std::string hint;
        if (v == stored_symmetric_zero(bits, other))
          hint = fmt::format(" ({} is the symmetric value in the {} convention: check checkpoint_format / "
                             "packing_format in the quantization config)",
                             v, zero_format_name(other));
        return Error::format("group {}, column {}: stored zero point {}, but symmetric {}-bit weights store {} "
                             "({}); asymmetric quantization (sym=false) is not supported{}",
                             gi, j * p + i, v, bits, want, zero_format_name(f), hint)
            .in_tensor(std::string(tensor));
      }
    }
  }
  return Ok{};
}

Status check_trivial_g_idx(const TensorView& g_idx, int64_t k_dim, int group_size, std::string_view tensor) {
  if (g_idx.dtype != DType::kI32 && g_idx.dtype != DType::kI64)
    return Error::format("dtype is {}, expected I32 or I64", dtype_name(g_idx.dtype)).in_tensor(std::string(tensor));
  if (!(g_idx.shape == Shape{k_dim}))
    return Error::format("shape is {}, expected [{}]", g_idx.shape.str(), k_dim).in_tensor(std::string(tensor));
  const auto* data = static_cast<const uint8_t*>(g_idx.data);
  for (int64_t k = 0; k < k_dim; ++k) {
    int64_t v;
    if (g_idx.dtype == DType::kI32) {
      int32_t v32;
      std::memcpy(&v32, data + k * 4, 4);
      v = v32;
    } else {
      std::memcpy(&v, data + k * 8, 8);
    }
    if (v != k / group_size)
      return Error::format("g_idx[{}] = {}, expected {} (= k / group_size {}): act-order (desc_act) checkpoints "
                           "with a permuted g_idx are not supported",
                           k, v, k / group_size, group_size)
          .in_tensor(std::string(tensor));
  }
  return Ok{};
}

Result<QuantMatrix> from_checkpoint(const CheckpointTensors& t, const Layout& layout, std::string_view prefix,
                                    std::shared_ptr<const void> owner) {
  const std::string qwname = module_tensor_name(prefix, "qweight");
  const std::string qzname = module_tensor_name(prefix, "qzeros");
  const std::string scname = module_tensor_name(prefix, "scales");
  MOEBIUS_ASSIGN_OR_RETURN(const WeightFormat format, int_format_for_bits(layout.bits));
  const int bits = layout.bits, p = pack_factor(bits);

  for (const auto* v : {&t.qweight, &t.qzeros, &t.scales, t.g_idx ? &*t.g_idx : nullptr}) {
    if (v == nullptr) continue;
    if (v->where == MemoryKind::kDevice)
      return Error("tensor is in device memory; a host view is needed").in_tensor(std::string(prefix));
    if (v->data == nullptr && v->numel() > 0) return Error("tensor has no data").in_tensor(std::string(prefix));
  }
  if (t.qweight.dtype != DType::kI32 || t.qweight.shape.rank != 2)
    return Error::format("qweight must be I32 [K*{}/32, N], got {} {} (only pack_dtype int32 is supported)", bits,
                         dtype_name(t.qweight.dtype), t.qweight.shape.str())
        .in_tensor(qwname);
  const int64_t k = t.qweight.shape[0] * p, n = t.qweight.shape[1];
  if (k <= 0 || n <= 0) return Error::format("empty qweight {}", t.qweight.shape.str()).in_tensor(qwname);
  if (layout.group_size != -1 && layout.group_size <= 0)
    return Error::format("group size {} is neither -1 (per-channel) nor positive", layout.group_size)
        .in_tensor(scname);
  const int64_t g = layout.group_size == -1 ? k : std::min<int64_t>(layout.group_size, k);
  const int64_t groups = (k + g - 1) / g;

  if (t.scales.dtype != DType::kF16)
    return Error::format("dtype is {}, expected F16", dtype_name(t.scales.dtype)).in_tensor(scname);
  if (!(t.scales.shape == Shape{groups, n}))
    return Error::format("shape is {}, expected [{}, {}] for K = {}, N = {}, group size {}", t.scales.shape.str(),
                         groups, n, k, n, layout.group_size)
        .in_tensor(scname);
  if (n % p != 0)
    return Error::format("N = {} is not a multiple of {}, so qzeros cannot be packed along N", n, p).in_tensor(qzname);
  if (t.qzeros.dtype != DType::kI32)
    return Error::format("dtype is {}, expected I32", dtype_name(t.qzeros.dtype)).in_tensor(qzname);
  if (!(t.qzeros.shape == Shape{groups, n / p}))
    return Error::format("shape is {}, expected [{}, {}]", t.qzeros.shape.str(), groups, n / p).in_tensor(qzname);
  MOEBIUS_TRY(check_symmetric_qzeros(t.qzeros, bits, layout.zeros, qzname));
  if (t.g_idx.has_value()) MOEBIUS_TRY(check_trivial_g_idx(*t.g_idx, k, static_cast<int>(g), module_tensor_name(prefix, "g_idx")));

  QuantMatrix m;
  m.format = format;
  m.rows = n;
  m.cols = k;
  m.group_size = static_cast<int>(g);
  m.weight = {static_cast<const uint8_t*>(t.qweight.data), t.qweight.nbytes()};
  m.scales = {static_cast<const uint8_t*>(t.scales.data), t.scales.nbytes()};
  m.owner = std::move(owner);
  if (Status st = m.validate(); !st.ok()) return std::move(st).error().in_tensor(std::string(prefix));
  return m;
}

void dequantize_rows(const QuantMatrix& m, int64_t row_begin, int64_t row_end, float* out) {
  MOEBIUS_ASSERT(is_int_format(m.format) && 0 <= row_begin && row_begin <= row_end && row_end <= m.rows,
                 "rows [{}, {}) of a {} matrix with {} rows", row_begin, row_end, weight_format_name(m.format),
                 m.rows);
  const int bits = weight_format_bits(m.format), p = pack_factor(bits);
  const int64_t n_cols = m.rows, k_dim = m.cols, g = m.group_size;
  const float zero = static_cast<float>(symmetric_zero(bits));
#pragma omp parallel for schedule(static)
  for (int64_t r = row_begin; r < row_end; ++r) {
    float* o = out + r * k_dim;
    int64_t scale_group = -1;
    float scale = 0.0f;
    for (int64_t kw = 0; kw < k_dim / p; ++kw) {
      const uint32_t word = load_u32(m.weight.data() + (kw * n_cols + r) * 4);
      for (int i = 0; i < p; ++i) {
        const int64_t k = kw * p + i;
        if (k / g != scale_group) {  // decode each group's scale once
          scale_group = k / g;
          scale = fp16_bits_to_float(load_u16(m.scales.data() + (scale_group * n_cols + r) * 2));
        }
        o[k] = (static_cast<float>(get_field(word, i, bits)) - zero) * scale;
      }
    }
  }
}

}  // namespace moebius::gptq
