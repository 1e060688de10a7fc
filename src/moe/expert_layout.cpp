#include "moe/expert_layout.h"

#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "core/dtype.h"
#include "formats/gptq.h"
#include "formats/nvfp4.h"

namespace moebius::moe {

namespace {

// Where fragment value a[i] (i = 0..7) of lane (g, t) sits in a 16 x 16 k-step, as (row, k).
struct RowK {
  int row;
  int k;
};
constexpr RowK fragment_position(int i, int g, int t) {
  const int row = g + ((i >> 1) & 1) * 8;          // a2, a3, a6, a7 are row g + 8
  const int k = 2 * t + (i & 1) + (i >> 2) * 8;    // a4..a7 are k + 8
  return {row, k};
}

// Raw stored values of one logical source row, whatever the checkpoint format.
struct SourceRow {
  const QuantMatrix* m = nullptr;  // nullptr: a padding row
  int64_t row = 0;
};

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Byte offset, within a lane group's 8 scale bytes of a chunk, of tile row g + 8 * half, block b
// ([TAG_EXPERT_TILE_LAYOUT]: [g b0, g b1, g+8 b0, g+8 b1, g b2, g b3, g+8 b2, g+8 b3]).
constexpr int nvfp4_scale_byte(int g, int half, int b) { return g * 8 + (b >> 1) * 4 + half * 2 + (b & 1); }

// The packed code of (source row, k) for the kernel: bf16 bits, e2m1 code, or unsigned int q.
// Padding (no row, or k past K) packs to the value that dequantizes to 0.
uint32_t stored_code(KernelFormat f, const SourceRow& src, int64_t k) {
  const QuantMatrix* m = src.m;
  const bool pad = m == nullptr || k >= m->cols;
  switch (f) {
    case KernelFormat::kBF16:
      return pad ? 0u : load_u16(m->weight.data() + (src.row * m->cols + k) * 2);
    case KernelFormat::kNvFp4: {
      if (pad) return 0u;
      uint32_t code = nvfp4::get_code(m->weight.data() + src.row * (m->cols / 2), k);
      // The tile layout keeps |block scale| ([TAG_EXPERT_TILE_LAYOUT]): the scale's sign moves
      // onto the codes, and a zero scale zeroes their magnitudes (the products stay bit-identical).
      const uint8_t scale = m->scales[static_cast<size_t>(src.row * (m->cols / 16) + k / 16)];
      if ((scale & 0x80u) != 0) code ^= 0x8u;
      if ((scale & 0x7Fu) == 0) code &= 0x8u;
      return code;
    }
    case KernelFormat::kInt4:
      return pad ? 8u : gptq::get_q(m->weight.data(), m->rows, k, src.row, 4);
    case KernelFormat::kInt2:
      return pad ? 2u : gptq::get_q(m->weight.data(), m->rows, k, src.row, 2);
  }
  return 0;
}

Status check_supported(const QuantMatrix& m, KernelFormat f) {
  MOEBIUS_TRY(m.validate());  // includes NaN nvfp4 block scales, which the tile layout cannot code
  if (f == KernelFormat::kInt4 || f == KernelFormat::kInt2) {
    if (m.group_size % 16 != 0)
      return Error::format("group size {} is not a multiple of 16, which the CUDA kernels need", m.group_size);
  }
  return Ok{};
}

// Packs a matrix whose packed row R comes from source_row(R).
template <typename RowFn>
PackedMatrix pack_rows(KernelFormat f, int64_t rows, int64_t cols, int group_size, RowFn source_row) {
  PackedMatrix p = packed_shape(f, rows, cols, group_size);
  const int kc = chunk_k(f);
  const int64_t tiles = p.row_tiles(), chunks = p.chunks();
  p.weight.assign(static_cast<size_t>(tiles * chunks * kTileBytes), 0);
  const int steps = kc / 16;

#pragma omp parallel for schedule(static)
  for (int64_t tile = 0; tile < tiles; ++tile) {
    SourceRow src[kTileRows];
    for (int r = 0; r < kTileRows; ++r) src[r] = source_row(tile * kTileRows + r);
    for (int64_t c = 0; c < chunks; ++c) {
      uint8_t* chunk = p.weight.data() + (tile * chunks + c) * kTileBytes;
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane >> 2, t = lane & 3;
        uint32_t words[4] = {0, 0, 0, 0};
        for (int s = 0; s < steps; ++s) {
          for (int i = 0; i < 8; ++i) {
            const RowK pos = fragment_position(i, g, t);
            const int64_t k = c * kc + s * 16 + pos.k;
            const uint32_t v = stored_code(f, src[pos.row], k);
            const int j = i >> 1, hi = i & 1;  // bf16x2 register j, half hi
            switch (f) {
              case KernelFormat::kBF16:
                words[j] |= v << (16 * hi);
                break;
              case KernelFormat::kNvFp4:
                for (int b = 0; b < 4; ++b) words[s] |= ((v >> b) & 1u) << nvfp4_code_bit(j, hi, b);
                break;
              case KernelFormat::kInt4:
                words[s] |= v << (4 * (j + 4 * hi));
                break;
              case KernelFormat::kInt2: {
                const int u = s & 1;
                words[s >> 1] |= v << (2 * (4 * u + j + 8 * hi));
                break;
              }
            }
          }
        }
        std::memcpy(chunk + lane * 16, words, 16);
      }
    }
  }

  if (f == KernelFormat::kNvFp4) {
    // [tile][chunk][g][8 B] in nvfp4_scale_byte order; padding scale 0 (codes are 0).
    p.scales.assign(static_cast<size_t>(tiles * chunks * 64), 0);
    for (int64_t tile = 0; tile < tiles; ++tile) {
      for (int r = 0; r < kTileRows; ++r) {
        const SourceRow s = source_row(tile * kTileRows + r);
        if (s.m == nullptr) continue;
        const int64_t blocks = s.m->cols / 16;
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t c = b / 4;
          const int g = r & 7, half = r >> 3;
          p.scales[static_cast<size_t>((tile * chunks + c) * 64 + nvfp4_scale_byte(g, half, static_cast<int>(b % 4)))] =
              nvfp4_scale_code(s.m->scales[static_cast<size_t>(s.row * blocks + b)]);
        }
      }
    }
  } else if (p.group_size > 0) {
    // [tile][group][16 rows] fp16; padding scale 0.
    const int64_t groups = p.groups();
    p.scales.assign(static_cast<size_t>(tiles * groups * kTileRows * 2), 0);
    for (int64_t tile = 0; tile < tiles; ++tile) {
      for (int r = 0; r < kTileRows; ++r) {
        const SourceRow s = source_row(tile * kTileRows + r);
        if (s.m == nullptr) continue;
        const int64_t src_groups = s.m->num_groups();
        for (int64_t q = 0; q < src_groups; ++q)
          std::memcpy(p.scales.data() + ((tile * groups + q) * kTileRows + r) * 2,
                      s.m->scales.data() + (q * s.m->rows + s.row) * 2, 2);
      }
    }
  }
  return p;
}

}  // namespace

uint8_t nvfp4_scale_code(uint8_t e4m3_bits) {
  const int exp = (e4m3_bits >> 3) & 0xF, man = e4m3_bits & 7;
  if (exp == 0 && man == 0) return 0;
  if (exp != 0) return static_cast<uint8_t>(((exp - 7 + 9) << 3) | man);  // 2^(exp-7) (1 + man/8)
  // Subnormal: man/8 * 2^-6, normalised (man has at most 3 significant bits).
  int e = -9, v = man;  // man * 2^-9
  while (v >= 2) {
    v >>= 1;
    ++e;
  }
  const int frac = (man << (3 - (e + 9))) & 7;  // the bits below the leading one, as eighths
  return static_cast<uint8_t>(((e + 9) << 3) | frac);
}

float nvfp4_scale_code_value(uint8_t code) {
  return std::ldexp(1.0f + static_cast<float>(code & 7) / 8.0f, (code >> 3) - 9);
}

PackedMatrix packed_shape(KernelFormat format, int64_t rows, int64_t cols, int group_size) {
  PackedMatrix p;
  p.format = format;
  p.rows = rows;
  p.cols = cols;
  p.rows_padded = (rows + kTileRows - 1) / kTileRows * kTileRows;
  const int kc = chunk_k(format);
  p.cols_padded = (cols + kc - 1) / kc * kc;
  p.group_size = (format == KernelFormat::kInt4 || format == KernelFormat::kInt2) ? group_size : 0;
  return p;
}

size_t packed_weight_bytes(const PackedMatrix& p) {
  return static_cast<size_t>(p.row_tiles() * p.chunks() * kTileBytes);
}

size_t packed_scale_bytes(const PackedMatrix& p) {
  switch (p.format) {
    case KernelFormat::kNvFp4: return static_cast<size_t>(p.row_tiles() * p.chunks() * 64);
    case KernelFormat::kInt4:
    case KernelFormat::kInt2: return static_cast<size_t>(p.row_tiles() * p.groups() * kTileRows * 2);
    case KernelFormat::kBF16: return 0;
  }
  return 0;
}

const char* kernel_format_name(KernelFormat f) {
  switch (f) {
    case KernelFormat::kBF16: return "bf16";
    case KernelFormat::kNvFp4: return "nvfp4";
    case KernelFormat::kInt4: return "int4";
    case KernelFormat::kInt2: return "int2";
  }
  return "?";
}

Result<KernelFormat> kernel_format_for(WeightFormat f) {
  switch (f) {
    case WeightFormat::kBF16: return KernelFormat::kBF16;
    case WeightFormat::kNvFp4: return KernelFormat::kNvFp4;
    case WeightFormat::kInt4: return KernelFormat::kInt4;
    case WeightFormat::kInt2: return KernelFormat::kInt2;
    default: break;
  }
  return Error::format("the CUDA expert kernels run bf16, nvfp4, int4 and int2 experts, not {}",
                       weight_format_name(f));
}

Result<PackedMatrix> pack_matrix(const QuantMatrix& m) {
  MOEBIUS_ASSIGN_OR_RETURN(KernelFormat f, kernel_format_for(m.format));
  MOEBIUS_TRY(check_supported(m, f));
  if (f == KernelFormat::kNvFp4 && m.scale_2.size() != 1)
    return Error("an NVFP4 matrix with several global scales cannot be packed as one matrix");
  PackedMatrix p = pack_rows(f, m.rows, m.cols, m.group_size, [&m](int64_t r) {
    return r < m.rows ? SourceRow{&m, r} : SourceRow{};
  });
  if (f == KernelFormat::kNvFp4) p.global_scale[0] = p.global_scale[1] = m.scale_2_for_row(0);
  return p;
}

Result<PackedMatrix> pack_gate_up(const QuantMatrix& gate, const QuantMatrix& up) {
  MOEBIUS_ASSIGN_OR_RETURN(KernelFormat f, kernel_format_for(gate.format));
  MOEBIUS_TRY(check_supported(gate, f));
  MOEBIUS_TRY(check_supported(up, f));
  if (up.format != gate.format || up.rows != gate.rows || up.cols != gate.cols || up.group_size != gate.group_size)
    return Error::format("gate_proj is {} [{}, {}] g={}, up_proj is {} [{}, {}] g={}; they must match",
                         weight_format_name(gate.format), gate.rows, gate.cols, gate.group_size,
                         weight_format_name(up.format), up.rows, up.cols, up.group_size);
  if (f == KernelFormat::kNvFp4 && (gate.scale_2.size() != 1 || up.scale_2.size() != 1))
    return Error("NVFP4 gate_proj and up_proj must each have one global scale");
  const int64_t I = gate.rows, I8 = (I + 7) / 8 * 8;
  PackedMatrix p = pack_rows(f, 2 * I8, gate.cols, gate.group_size, [&](int64_t r) {
    const int64_t tile = r / kTileRows, local = r % kTileRows;
    const int64_t i = tile * 8 + (local & 7);
    if (i >= I) return SourceRow{};
    return SourceRow{local < 8 ? &gate : &up, i};
  });
  if (f == KernelFormat::kNvFp4) {
    p.global_scale[0] = gate.scale_2_for_row(0);
    p.global_scale[1] = up.scale_2_for_row(0);
  }
  return p;
}

Result<PackedMoeLayer> pack_moe_layer(const cpu::MoeLayerReference& layer) {
  MOEBIUS_TRY(layer.validate());
  PackedMoeLayer p;
  p.shape = layer.shape;
  MOEBIUS_ASSIGN_OR_RETURN(p.format, kernel_format_for(layer.experts[0].gate.format));
  const int E = layer.shape.num_experts;
  p.w13.resize(static_cast<size_t>(E));
  p.w2.resize(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) {
    const cpu::ExpertWeights& ex = layer.experts[static_cast<size_t>(e)];
    auto a = pack_gate_up(ex.gate, ex.up);
    if (!a.ok()) return std::move(a).error().with_context(fmt::format("expert {} gate/up", e));
    auto b = pack_matrix(ex.down);
    if (!b.ok()) return std::move(b).error().with_context(fmt::format("expert {} down", e));
    const PackedMatrix& a0 = e > 0 ? p.w13[0] : *a;
    const PackedMatrix& b0 = e > 0 ? p.w2[0] : *b;
    if (a->format != p.format || b->format != p.format || a->weight.size() != a0.weight.size() ||
        a->scales.size() != a0.scales.size() || a->group_size != a0.group_size ||
        b->weight.size() != b0.weight.size() || b->scales.size() != b0.scales.size() ||
        b->group_size != b0.group_size)
      return Error::format("expert {} has a different format or shape from expert 0", e);
    p.w13[static_cast<size_t>(e)] = std::move(a).value();
    p.w2[static_cast<size_t>(e)] = std::move(b).value();
  }
  p.router.resize(layer.router_weight.size());
  for (size_t i = 0; i < p.router.size(); ++i) p.router[i] = float_to_bf16_bits(layer.router_weight[i]);
  p.routing = layer.router;
  p.activation = layer.options.activation;
  return p;
}

void unpack_to_float(const PackedMatrix& p, float* out) {
  const int kc = chunk_k(p.format), steps = kc / 16;
  const int64_t chunks = p.chunks(), groups = p.groups();
  for (int64_t tile = 0; tile < p.row_tiles(); ++tile) {
    for (int64_t c = 0; c < chunks; ++c) {
      const uint8_t* chunk = p.weight.data() + (tile * chunks + c) * kTileBytes;
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane >> 2, t = lane & 3;
        uint32_t words[4];
        std::memcpy(words, chunk + lane * 16, 16);
        for (int s = 0; s < steps; ++s) {
          for (int i = 0; i < 8; ++i) {
            const RowK pos = fragment_position(i, g, t);
            const int64_t row = tile * kTileRows + pos.row;
            const int64_t k = c * kc + s * 16 + pos.k;
            const int j = i >> 1, hi = i & 1;
            float v = 0.0f;
            switch (p.format) {
              case KernelFormat::kBF16:
                v = bf16_bits_to_float(static_cast<uint16_t>(words[j] >> (16 * hi)));
                break;
              case KernelFormat::kNvFp4: {
                uint8_t code = 0;
                for (int b = 0; b < 4; ++b) code |= ((words[s] >> nvfp4_code_bit(j, hi, b)) & 1u) << b;
                const uint8_t sc = p.scales[static_cast<size_t>((tile * chunks + c) * 64 +
                                                                nvfp4_scale_byte(pos.row & 7, pos.row >> 3, s))];
                v = (e2m1_bits_to_float(code) * nvfp4_scale_code_value(sc)) * p.global_scale[pos.row >> 3];
                break;
              }
              case KernelFormat::kInt4:
              case KernelFormat::kInt2: {
                const bool is4 = p.format == KernelFormat::kInt4;
                const uint32_t q = is4 ? (words[s] >> (4 * (j + 4 * hi))) & 0xF
                                       : (words[s >> 1] >> (2 * (4 * (s & 1) + j + 8 * hi))) & 0x3;
                const int64_t grp = k / p.group_size;
                const float scale = fp16_bits_to_float(
                    load_u16(p.scales.data() + ((tile * groups + grp) * kTileRows + pos.row) * 2));
                v = (static_cast<float>(q) - (is4 ? 8.0f : 2.0f)) * scale;
                break;
              }
            }
            out[row * p.cols_padded + k] = v;
          }
        }
      }
    }
  }
}

float folded_int_weight(float exact) { return bf16_bits_to_float(float_to_bf16_bits(exact)); }

}  // namespace moebius::moe
