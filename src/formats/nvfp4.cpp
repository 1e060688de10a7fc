#include "formats/nvfp4.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/dtype.h"

namespace moebius::nvfp4 {

namespace {

// A scalar F32 tensor: shape [] or [1] (ModelOpt has written both).
Result<float> read_scalar_f32(const TensorView& v, const std::string& name) {
  if (v.dtype != DType::kF32)
    return Error::format("dtype is {}, expected F32", dtype_name(v.dtype)).in_tensor(name);
  if (!(v.shape.rank == 0 || (v.shape.rank == 1 && v.shape[0] == 1)))
    return Error::format("shape is {}, expected [] or [1]", v.shape.str()).in_tensor(name);
  if (v.data == nullptr) return Error("tensor has no data").in_tensor(name);
  if (v.where == MemoryKind::kDevice) return Error("tensor is in device memory; a host view is needed").in_tensor(name);
  float x;
  std::memcpy(&x, v.data, sizeof(float));
  return x;
}

Status check_view(const TensorView& v, DType dtype, const Shape& shape, const std::string& name) {
  if (v.dtype != dtype)
    return Error::format("dtype is {}, expected {}", dtype_name(v.dtype), dtype_name(dtype)).in_tensor(name);
  if (!(v.shape == shape))
    return Error::format("shape is {}, expected {}", v.shape.str(), shape.str()).in_tensor(name);
  if (v.data == nullptr && v.numel() > 0) return Error("tensor has no data").in_tensor(name);
  if (v.where == MemoryKind::kDevice) return Error("tensor is in device memory; a host view is needed").in_tensor(name);
  return Ok{};
}

}  // namespace

float global_scale(float amax) { return amax / kGlobalDivisor; }

uint8_t block_scale_bits(float block_amax, float scale_2) {
  if (scale_2 == 0.0f) return kZeroBlockScaleBits;  // all-zero tensor: no 0/0 (see header)
  float s = block_amax / (6.0f * scale_2);           // [TAG_NVFP4_SCALE_FORMULA]
  if (s == 0.0f) s = 1.0f;
  s = std::max(s, kMinBlockScale);
  return float_to_e4m3_bits(s, Saturation::kSatFinite);
}

uint8_t quantize_value(float w, uint8_t scale_bits, float scale_2) {
  const float denom = e4m3_bits_to_float(scale_bits) * scale_2;  // [TAG_NVFP4_SCALE_FORMULA]
  if (denom == 0.0f) return 0;                                   // amax == 0: every w is 0
  const float x = w / denom;
  if (x == 0.0f) return 0;  // -0.0 too: ModelOpt sets the sign bit only for x < 0
  return float_to_e2m1_bits(x);
}

float dequantize_value(uint8_t code, uint8_t scale_bits, float scale_2) {
  return (e2m1_bits_to_float(code) * e4m3_bits_to_float(scale_bits)) * scale_2;
}

Result<QuantMatrix> quantize(const float* w, int64_t rows, int64_t cols, std::optional<float> scale_2) {
  if (rows <= 0 || cols <= 0) return Error::format("NVFP4: bad shape [{}, {}]", rows, cols);
  if (cols % kBlockSize != 0)
    return Error::format("NVFP4: K = {} is not a multiple of the block size {}", cols, kBlockSize);

  // amax over the whole tensor; also rejects non-finite weights (they would poison every scale).
  float amax = 0.0f;
  for (int64_t i = 0; i < rows * cols; ++i) {
    if (!std::isfinite(w[i]))
      return Error::format("NVFP4: weight [{}, {}] is not finite ({})", i / cols, i % cols, w[i]);
    amax = std::max(amax, std::fabs(w[i]));
  }
  float s2;
  if (scale_2.has_value()) {
    s2 = *scale_2;
    if (!std::isfinite(s2) || s2 < 0.0f || (s2 == 0.0f && amax != 0.0f))
      return Error::format("NVFP4: scale_2 = {} is not usable for weights with amax {}", s2, amax);
  } else {
    s2 = global_scale(amax);
  }

  QuantMatrixStorage st;
  const int64_t blocks = cols / kBlockSize;
  st.weight.assign(static_cast<size_t>(rows * cols / 2), 0);  // [N, K/2]
  st.scales.assign(static_cast<size_t>(rows * blocks), 0);    // [N, K/16]
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* wr = w + r * cols;
    uint8_t* packed = st.weight.data() + r * (cols / 2);
    for (int64_t b = 0; b < blocks; ++b) {
      const float* wb = wr + b * kBlockSize;
      float bamax = 0.0f;
      for (int i = 0; i < kBlockSize; ++i) bamax = std::max(bamax, std::fabs(wb[i]));
      const uint8_t sb = block_scale_bits(bamax, s2);
      st.scales[static_cast<size_t>(r * blocks + b)] = sb;
      for (int i = 0; i < kBlockSize; ++i) set_code(packed, b * kBlockSize + i, quantize_value(wb[i], sb, s2));
    }
  }
  return make_owning_matrix(WeightFormat::kNvFp4, rows, cols, kBlockSize, std::move(st), {{0, s2}});
}

Result<QuantMatrix> from_checkpoint(const CheckpointTensors& t, std::string_view prefix,
                                    std::shared_ptr<const void> owner) {
  const std::string wname = module_tensor_name(prefix, "weight");
  const std::string sname = module_tensor_name(prefix, "weight_scale");
  const std::string s2name = module_tensor_name(prefix, "weight_scale_2");
  if (t.weight.dtype != DType::kU8 || t.weight.shape.rank != 2)
    return Error::format("NVFP4 weight must be U8 [N, K/2], got {} {}", dtype_name(t.weight.dtype),
                         t.weight.shape.str())
        .in_tensor(wname);
  const int64_t n = t.weight.shape[0];
  const int64_t k = t.weight.shape[1] * 2;
  if (n <= 0 || k <= 0 || k % kBlockSize != 0)
    return Error::format("NVFP4 weight {} gives K = {}, which is not a positive multiple of {}",
                         t.weight.shape.str(), k, kBlockSize)
        .in_tensor(wname);
  MOEBIUS_TRY(check_view(t.weight, DType::kU8, Shape{n, k / 2}, wname));
  MOEBIUS_TRY(check_view(t.weight_scale, DType::kF8E4M3, Shape{n, k / kBlockSize}, sname));
  MOEBIUS_ASSIGN_OR_RETURN(const float s2, read_scalar_f32(t.weight_scale_2, s2name));
  if (!std::isfinite(s2) || s2 < 0.0f)
    return Error::format("global scale is {}, expected a finite value >= 0", s2).in_tensor(s2name);
  if (t.input_scale.has_value()) {
    const std::string iname = module_tensor_name(prefix, "input_scale");
    MOEBIUS_ASSIGN_OR_RETURN(const float is, read_scalar_f32(*t.input_scale, iname));
    if (!std::isfinite(is)) return Error::format("input scale is {}", is).in_tensor(iname);
  }

  QuantMatrix m;
  m.format = WeightFormat::kNvFp4;
  m.rows = n;
  m.cols = k;
  m.group_size = kBlockSize;
  m.weight = {static_cast<const uint8_t*>(t.weight.data), t.weight.nbytes()};
  m.scales = {static_cast<const uint8_t*>(t.weight_scale.data), t.weight_scale.nbytes()};
  m.scale_2 = {{0, s2}};
  m.owner = std::move(owner);
  // validate() also refuses NaN block scales (S.1111.111), which would silently turn 16 weights
  // into NaN; the scan reads 1/8 of the bytes of the weight itself, which the loader reads anyway.
  if (Status v = m.validate(); !v.ok()) return std::move(v).error().in_tensor(sname);
  return m;
}

void dequantize_rows(const QuantMatrix& m, int64_t row_begin, int64_t row_end, float* out) {
  MOEBIUS_ASSERT(m.format == WeightFormat::kNvFp4 && 0 <= row_begin && row_begin <= row_end && row_end <= m.rows,
                 "rows [{}, {}) of a {} matrix with {} rows", row_begin, row_end, weight_format_name(m.format),
                 m.rows);
  const int64_t k = m.cols, blocks = k / kBlockSize;
#pragma omp parallel for schedule(static)
  for (int64_t r = row_begin; r < row_end; ++r) {
    const float s2 = m.scale_2_for_row(r);
    const uint8_t* packed = m.weight.data() + r * (k / 2);
    const uint8_t* sc = m.scales.data() + r * blocks;
    float* o = out + r * k;
    // Same arithmetic as dequantize_value(), with the block scale decoded once per block: this
    // loop is the inner loop of the CPU reference MoE layer.
    for (int64_t b = 0; b < blocks; ++b) {
      const float block_scale = e4m3_bits_to_float(sc[b]);
      for (int64_t c = b * kBlockSize; c < (b + 1) * kBlockSize; ++c)
        o[c] = (e2m1_bits_to_float(get_code(packed, c)) * block_scale) * s2;
    }
  }
}

}  // namespace moebius::nvfp4
