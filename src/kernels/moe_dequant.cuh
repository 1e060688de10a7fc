// Device helpers shared by the expert GEMM kernels (moe_gemm.cu, decode; moe_gemm_prefill.cu,
// prefill): their kernel arguments and epilogue kinds, the cp.async / ldmatrix / mma.sync
// wrappers, the in-register dequantization of one [TAG_EXPERT_TILE_LAYOUT] lane slice into A
// fragments, the nvfp4 block-scale pairs and the fused activations. Device code only; include it
// from .cu files, never from a launcher header.
//
// Dequantization to bf16 pairs (one pair per 32-bit register, see [TAG_EXPERT_TILE_LAYOUT]):
//   int4/int2: (w >> s) & 0x000F000F | 0x43004300 is bf16x2 (128 + q): subtract 128 + zero point,
//              exact small integers (int2 masks the codes of a byte in place and scales them
//              down in the same fma: [TAG_INT2_UNSHIFTED_DEQUANT]). The group scale multiplies the fp32 accumulator when the
//              group ends, so weights enter the mma exactly (decode and mma.sync prefill; the
//              wgmma prefill GEMM folds the scale into the weight: [TAG_INT_FOLDED_SCALE]).
//   nvfp4:     the e2m1 code's three magnitude bits go to bf16 bits 6..8 and the sign to bit 15
//              (a rotation and a mask per register, two for the fourth: moe::kNvFp4Rotation),
//              which is the e2m1 value times 2^-126 (a bf16 subnormal when the exponent bits are
//              0; bf16 mul and mma keep subnormals, checked by dev/cuda/probe_bf16_subnormal.cu).
//              It is multiplied by the block scale times 2^74, formed from the layout's u5m3 code
//              in two integer ops (nvfp4_step_scale; an exact product of 2 x 4 significant bits in
//              the normal range), and the accumulator by scale_2 * 2^52 at the end. The scale
//              pair {row g, row g+8} sits in one register; each half multiplies its row's
//              registers (HMUL2 with a .H0_H0 / .H1_H1 operand).
//              ~11 ALU-pipe instructions and 4 HMUL2 per 256 weights (SASS, docs/PERF.md run Z9d).
//              Moving the rotations and the scale's shift onto the FMA pipe as IMAD/IMAD.HI
//              made the wgmma GEMMs 6-15% slower (run Z10: two more instructions per step, and
//              these kernels follow their instruction count, not their busiest pipe).
//   bf16:      the words are the fragment.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "kernels/moe_gemm.cuh"

namespace moebius::kernels::moe_detail {

// What the kernel does with its sums: GEMM1 + activation, GEMM2 stored per pair, or GEMM2
// weighted into the output with bf16 atomics.
enum class Epilogue : uint8_t { kGateUp, kDownStore, kDownAtomic };

// The arguments of both expert GEMM kernel families (passed by value).
struct GemmKernelArgs {
  const ExpertMatrixPtrs* experts;
  MoeGemmDims dims;
  MoeTiles tiles;
  const __nv_bfloat16* act_in;  // GEMM1: x [T, stride]; GEMM2: h [padded, stride]
  int in_stride;
  MoeActivationParams act;
  __nv_bfloat16* h_out;  // GEMM1
  int h_stride;
  float* y;  // GEMM2 kStore
  int y_stride;
  const float* topk_weights;  // GEMM2 kAtomic
  __nv_bfloat16* out;
  int out_stride;
  // Decode kernel with activations staged in shared memory: rows staged per tile and the row
  // stride in elements (0 when the kernel reads them from global memory).
  int stage_rows;
  int stage_stride;
  // Int formats, decode kernel: byte offset in dynamic shared memory of the block's group scales
  // ([groups][16 rows] fp16, copied once per block instead of loaded at every group boundary).
  int group_scale_offset;
  // wgmma GEMM2 kDownStore: y holds bf16 rows (MoeCombineMode::kStoreBf16, [TAG_MOE_BF16_Y]).
  int y_bf16;
};

// K elements per 16-byte lane slice of a tile chunk; mirrors moe::chunk_k (expert_layout.h).
template <MoeWeightFormat F>
inline constexpr int kChunkK = F == MoeWeightFormat::kBF16 ? 16 : (F == MoeWeightFormat::kInt2 ? 128 : 64);
// mma k-steps (16 deep) per chunk.
template <MoeWeightFormat F>
inline constexpr int kSteps = kChunkK<F> / 16;
template <MoeWeightFormat F>
inline constexpr bool kIsInt = F == MoeWeightFormat::kInt4 || F == MoeWeightFormat::kInt2;

// 2^52: the nvfp4 block scales enter bf16 times 2^74 (moe::kNvFp4ScaleCodeExp2) and the
// subnormal code trick contributes 2^-126, so the accumulator is rescaled by scale_2 * 2^52.
inline constexpr float kNvFp4AccScale = 4503599627370496.0f;  // 2^52 = 2^(126 - 74)

__host__ __device__ __forceinline__ uint32_t bf16x2_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
__host__ __device__ __forceinline__ __nv_bfloat162 as_bf16x2(uint32_t v) {
  return *reinterpret_cast<__nv_bfloat162*>(&v);
}

// Shared-memory address of a generic pointer, for the asm below.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; bytes past src_bytes (0..16) are written as zeros and not
// read. .cg: stage in L2 only; the data is consumed from shared memory.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// 4-byte async copy global -> shared (.ca: cached in L1 too).
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 bf16 matrices: the B fragments (b0, b1) of two n8 token tiles for one k-step (prefill).
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// c += A * B, m16n8k16, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The nvfp4 block-scale pair of k-step S of a chunk for lane group g: sc holds the lane's 8 scale
// codes ([TAG_EXPERT_TILE_LAYOUT]); the result is bf16x2 {scale of row g, scale of row g+8} x 2^74.
// kMaskFirst: mask, then shift and add the exponent bias (the shifted codes occupy bits 4..11 of
// each half, so the add never carries and equals the OR): ptxas fuses an even step's shift and add
// into one LEA. Measured in run R7: the decode GEMMs 1.5% faster, the wgmma prefill 1.6% slower
// with it, so only the decode kernels ask for it.
template <int S, bool kMaskFirst = false>
__device__ __forceinline__ uint32_t nvfp4_step_scale(uint2 sc) {
  const uint32_t w = S < 2 ? sc.x : sc.y;
  if constexpr (kMaskFirst)
    return (S & 1) ? ((w & 0xFF00FF00u) >> 4) + 0x60006000u : ((w & 0x00FF00FFu) << 4) + 0x60006000u;
  const uint32_t v = (S & 1) ? (w >> 4) : (w << 4);
  return (v & 0x0FF00FF0u) | 0x60006000u;  // code on bits 4..11 of each half, exponent + 192
}

// A-fragment registers of k-step S of a chunk. nv_sc: the lane's nvfp4 block-scale codes for the
// chunk (ignored by the other formats).
template <MoeWeightFormat F, int S, bool kMaskFirstScale = false>
__device__ __forceinline__ void dequant_step(const uint4& w, uint2 nv_sc, uint32_t (&a)[4]) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  if constexpr (F == MoeWeightFormat::kBF16) {
#pragma unroll
    for (int j = 0; j < 4; ++j) a[j] = words[j];
  } else if constexpr (F == MoeWeightFormat::kInt4) {
    const __nv_bfloat162 bias = __floats2bfloat162_rn(136.0f, 136.0f);  // 128 + zero point 8
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t v = ((words[S] >> (4 * j)) & 0x000F000Fu) | 0x43004300u;
      a[j] = bf16x2_bits(__hsub2(as_bf16x2(v), bias));
    }
  } else if constexpr (F == MoeWeightFormat::kInt2) {
    // [TAG_INT2_UNSHIFTED_DEQUANT] Codes 0-2 of a byte (bits 2j, 2j + 1 of each half, j < 3) are
    // masked in place: bits 0..6 are bf16 mantissa bits under the exponent of 128 (ulp 1), so the
    // OR gives 128 + 4^j q with no shift, and one fma by 4^-j (a power of two) and -(128 4^-j + 2)
    // leaves q - 2. Every value is a small integer, so the fma is exact and the pair is the same
    // bits as (w >> 2j) & 3 | 128, minus 130. Code 3 (bits 6-7) reaches the exponent's bit 7, so it
    // is shifted down as before: two shifts per pair of k-steps (the high byte, its code 3) plus
    // one, not seven. int2 spends twice int4's dequantization per weight byte, in decode GEMMs
    // bound by instruction issue.
    constexpr int u = S & 1;
    const uint32_t word = u ? words[S >> 1] >> 8 : words[S >> 1];
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      const uint32_t v = (word & (0x00030003u << (2 * j))) | 0x43004300u;
      const float inv = 1.0f / static_cast<float>(1 << (2 * j));
      const __nv_bfloat162 scale = __floats2bfloat162_rn(inv, inv);
      const __nv_bfloat162 bias = __floats2bfloat162_rn(-(128.0f * inv + 2.0f), -(128.0f * inv + 2.0f));
      a[j] = bf16x2_bits(j == 0 ? __hadd2(as_bf16x2(v), bias) : __hfma2(as_bf16x2(v), scale, bias));
    }
    const uint32_t v3 = ((word >> 6) & 0x00030003u) | 0x43004300u;
    a[3] = bf16x2_bits(__hsub2(as_bf16x2(v3), __floats2bfloat162_rn(130.0f, 130.0f)));
  } else {  // kNvFp4: the bit layout is moe::kNvFp4Rotation (src/moe/expert_layout.h)
    const uint32_t wd = words[S];
    constexpr uint32_t kPair = 0x81C081C0u;  // bf16 bits 6..8 (magnitude) and 15 (sign), both halves
    const uint32_t c0 = wd & kPair;
    const uint32_t c1 = __funnelshift_l(wd, wd, 4) & kPair;
    const uint32_t c2 = __funnelshift_l(wd, wd, 10) & kPair;
    const uint32_t c3 = (__funnelshift_l(wd, wd, 6) & 0x80C080C0u) | (__funnelshift_l(wd, wd, 14) & 0x01000100u);
    const __nv_bfloat162 sc = as_bf16x2(nvfp4_step_scale<S, kMaskFirstScale>(nv_sc));
    const __nv_bfloat162 s_lo = __low2bfloat162(sc), s_hi = __high2bfloat162(sc);
    a[0] = bf16x2_bits(__hmul2(as_bf16x2(c0), s_lo));  // row g
    a[1] = bf16x2_bits(__hmul2(as_bf16x2(c1), s_hi));  // row g + 8
    a[2] = bf16x2_bits(__hmul2(as_bf16x2(c2), s_lo));
    a[3] = bf16x2_bits(__hmul2(as_bf16x2(c3), s_hi));
  }
}

// [TAG_INT_FOLDED_SCALE] The int formats in the wgmma prefill GEMM (moe_gemm_wgmma.cu): the group
// scale is multiplied into the weight before the tensor core, so every k-step accumulates into one
// fp32 set and the tile can be 128 tokens wide, as nvfp4's. (The exact alternative, a per-group
// accumulator set flushed as acc += grp * scale, needs twice the accumulator registers, which
// capped the int tiles at 64 tokens, and a wgmma drain (wait_group 0) at every group end: docs/PERF.md
// runs R5-R6.) The weight enters the mma as RN_bf16(q * s): the exact dequantized value rounded
// ONCE to bf16, i.e. what a bf16 copy of the dequantized checkpoint holds (relative error <= 2^-9,
// as Marlin-class kernels; the decode kernels keep the exact path).
// One rounding from two bf16 ops: s (fp16, 11 significant bits) = s_hi + s_lo with s_hi =
// RN_bf16(s) and s_lo = s - s_hi, a multiple of ulp_fp16(s) of magnitude <= ulp_bf16(s) / 2, so at
// most 3 significant bits: exact in bf16. |q| <= 8 has at most 3 significant bits, so q * s_lo (<= 6
// bits) is exact, and fma(q, s_hi, q * s_lo) rounds q * s_hi + q * s_lo = q * s once. Per register:
// the exact q pair (dequant_step), one HMUL2, one HFMA2. The host mirror is
// moe::folded_int_weight (expert_layout.h); tests/cuda_host/test_int_folded_scale.cu checks the
// split on the CPU for every finite fp16 scale and every q.
struct IntFoldedScale {
  uint32_t hi, lo;  // bf16x2 {s_hi, s_lo} of rows {g, g + 8}
};

__host__ __device__ __forceinline__ IntFoldedScale int_folded_scale(__half s_row_g, __half s_row_g8) {
  const float a = __half2float(s_row_g), b = __half2float(s_row_g8);
  const __nv_bfloat162 hi = __floats2bfloat162_rn(a, b);
  const float2 back = __bfloat1622float2(hi);
  const __nv_bfloat162 lo = __floats2bfloat162_rn(a - back.x, b - back.y);  // exact (above)
  return {bf16x2_bits(hi), bf16x2_bits(lo)};
}

// a: the exact integer pairs of one k-step (dequant_step), rows g (a[0], a[2]) and g + 8 (a[1],
// a[3]); becomes RN_bf16(q * s) per element.
__device__ __forceinline__ void fold_int_scale(uint32_t (&a)[4], IntFoldedScale sc) {
  const __nv_bfloat162 hi = as_bf16x2(sc.hi), lo = as_bf16x2(sc.lo);
  const __nv_bfloat162 hi_g = __low2bfloat162(hi), hi_g8 = __high2bfloat162(hi);
  const __nv_bfloat162 lo_g = __low2bfloat162(lo), lo_g8 = __high2bfloat162(lo);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const __nv_bfloat162 q = as_bf16x2(a[j]);
    const bool row_g = (j & 1) == 0;
    a[j] = bf16x2_bits(__hfma2(q, row_g ? hi_g : hi_g8, __hmul2(q, row_g ? lo_g : lo_g8)));
  }
}

// [TAG_INT_GROUP_STARTS] Where the int formats' scale groups begin among a warp's k-steps, as a
// bit mask over a window of up to 64 consecutive k-steps: the decode k-loops test a bit whose
// position is known at compile time (one predicate op) instead of computing k / group_size at
// every k-step. group_size is a run-time value, so each of those divisions was a div.s32 in the
// PTX, ~5 SASS instructions (IABS, IMAD.HI, compares, a select; the reciprocal formed once), plus a
// branch around the flush, in kernels bound by instruction issue: the int4 and int2 decode GEMMs
// got 30-36% faster at T = 8-64 without them (docs/PERF.md runs R1-R3). group_size is a multiple of 16 (check_dims), so
// a k-step lies inside one group and a group starts at the global k-steps that are multiples of
// group_size / 16. Host and device: tests/cuda_host/test_group_starts.cu checks it on the CPU
// against k / group_size.
struct GroupStarts {
  int group_steps;  // group_size / 16
  uint64_t period;  // bits 0, group_steps, 2 group_steps, ... below 64

  __host__ __device__ __forceinline__ explicit GroupStarts(int group_size) : group_steps(group_size / 16), period(0) {
    for (int b = 0; b < 64; b += group_steps) period |= 1ull << b;
  }
  // Bit j: global k-step first_step + j starts a group (one division per window, not per step).
  __host__ __device__ __forceinline__ uint64_t window(int first_step) const {
    const int r = first_step % group_steps;
    const int first = r == 0 ? 0 : group_steps - r;
    return first >= 64 ? 0ull : period << first;
  }
  // A warp's first window: its first k-step opens the group its sums start in (the caller's
  // current group), so no flush there.
  __host__ __device__ __forceinline__ uint64_t first_window(int first_step) const { return window(first_step) & ~1ull; }
  __host__ __device__ __forceinline__ int group_of(int step) const { return step / group_steps; }
  // Whether step j of the window opens a group. kGroupK > 0: the group size is known at compile
  // time. If the window starts on a group boundary as well (kAligned: a warp's first step), the
  // answer is a constant once the k-loop is unrolled, with no predicate and no branch around the
  // flush (the run-time form costs ~4 instructions a k-step: the bit test and the BSSY/BRA/BSYNC
  // around the flush). Otherwise, when groups are whole chunks (kGroupK % KC == 0), only a chunk's
  // first step can open one, so the bit is tested there alone.
  template <int kGroupK, int KC, bool kAligned>
  __host__ __device__ __forceinline__ bool opens(uint64_t window_bits, int j) const {
    const bool bit = ((window_bits >> j) & 1ull) != 0ull;
    if constexpr (kGroupK == 0) return bit;
    else if constexpr (kAligned) return j > 0 && (j * 16) % kGroupK == 0;
    else if constexpr (kGroupK % KC == 0) return (j * 16) % KC == 0 && bit;
    else return bit;
  }
};

// The group starts of format F's kernels: the int formats' from their group size; the others
// never read them, and a 1024-element "group" keeps the unused constructor to one iteration.
template <MoeWeightFormat F>
__device__ __forceinline__ GroupStarts group_starts_of(int group_size) {
  return GroupStarts(kIsInt<F> ? group_size : 1024);
}

// One warp's sums over its K range of a 16-row weight tile times one n8 token tile, as the decode
// kernels (moe_gemm.cu's row-tile kernel, moe_fused_experts.cu) keep them: two accumulator sets
// alternating by k-step (a single set is one dependent mma chain, ~30 cycles a link, that a few
// warps cannot hide), and for the int formats each scale group summed apart, its two row scales
// applied when the group ends (weights enter the mma as exact small integers).
template <MoeWeightFormat F>
struct RowTileSums {
  float acc[2][4];
  float grp[2][4];
  int current_group;
  const __half* tile_scales;  // int formats: the tile's [groups][16] fp16 scales
  int g;  // lane >> 2: rows g and g + 8

  // first_group: the scale group of the warp's first k-step (GroupStarts::group_of).
  __device__ __forceinline__ RowTileSums(const __half* scales, int first_group, int lane_group)
      : current_group(kIsInt<F> ? first_group : 0), tile_scales(scales), g(lane_group) {
#pragma unroll
    for (int st = 0; st < 2; ++st)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[st][i] = grp[st][i] = 0.0f;
  }

  __device__ __forceinline__ void flush_group() {
    const float s_lo = __half2float(tile_scales[current_group * 16 + g]);
    const float s_hi = __half2float(tile_scales[current_group * 16 + g + 8]);
#pragma unroll
    for (int st = 0; st < 2; ++st) {
      acc[st][0] += grp[st][0] * s_lo;
      acc[st][1] += grp[st][1] * s_lo;
      acc[st][2] += grp[st][2] * s_hi;
      acc[st][3] += grp[st][3] * s_hi;
#pragma unroll
      for (int i = 0; i < 4; ++i) grp[st][i] = 0.0f;
    }
  }

  // k-step S of chunk c (the lane's 16-byte slice w, its nvfp4 scale codes nv_sc) into set `set`,
  // against the B fragment rows at b_row (the lane's token row + 2t). starts_group: the step opens
  // a new scale group (int formats; bit S of the chunk's GroupStarts window).
  template <int S>
  __device__ __forceinline__ void step(const uint4& w, uint2 nv_sc, int c, int set, const __nv_bfloat16* b_row,
                                       bool starts_group) {
    uint32_t a[4];
    dequant_step<F, S>(w, nv_sc, a);
    const int k0 = c * kChunkK<F> + S * 16;
    if constexpr (kIsInt<F>) {
      if (starts_group) {
        flush_group();
        ++current_group;
      }
    }
    const uint32_t* q = reinterpret_cast<const uint32_t*>(b_row + k0);
    if constexpr (kIsInt<F>) mma_bf16(grp[set], a, q[0], q[4]);
    else mma_bf16(acc[set], a, q[0], q[4]);
  }

  // Every k-step of chunk c, the sets alternating from `first_set`; bit S of starts: step S opens
  // a scale group.
  __device__ __forceinline__ void chunk(const uint4& w, uint2 nv_sc, int c, int first_set, const __nv_bfloat16* b_row,
                                        uint32_t starts) {
    [&]<int... S>(std::integer_sequence<int, S...>) {
      (step<S>(w, nv_sc, c, (first_set + S) % 2, b_row, ((starts >> S) & 1u) != 0u), ...);
    }(std::make_integer_sequence<int, kSteps<F>>{});
  }

  // The warp's four sums (rows g, g + 8 x token columns 2t, 2t + 1): the open group applied, the
  // two sets added. `any` is whether the warp had chunks at all.
  // moe_gemm_rows_kernel keeps its own copy of these steps (compute_tile): built on this struct it
  // computed the same bits but its SASS changed, int4 GEMM1 7% slower and int2 5% faster at
  // T = 1-8 (docs/PERF.md run Q9), so it stays as measured until that difference is understood.
  __device__ __forceinline__ void finish(bool any, float (&out)[4]) {
    if constexpr (kIsInt<F>) {
      if (any) flush_group();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = acc[0][i] + acc[1][i];
  }
};

// The activation's division: v * rcp.approx(d) (2 SASS instructions) instead of the IEEE
// division (an FCHK-guarded Newton sequence of ~8 plus a slow-path branch). The GEMM1 epilogue runs
// it for every stored h element, and in the wgmma GEMM1 the epilogue is a large share of the
// consumer warps' issue slots while the tensor pipe waits (SASS of run L3). The result is stored
// as bf16 (8 mantissa bits), so the approximate reciprocal's ~2 ulp of fp32 rarely changes a
// stored bit; d >= 1 here, and d = inf (v < -88) gives -0 as the IEEE division does. For
// 2^126 < d < inf it gives 0 where the quotient is below 2^-119 in magnitude.
__device__ __forceinline__ float activation_div(float v, float d) { return __fdividef(v, d); }

__device__ __forceinline__ float silu(float v) { return activation_div(v, 1.0f + __expf(-v)); }

// The fused GEMM1 activation of gate g and up u (same formulas as cpu/moe_layer), for a kind
// known at compile time: a kernel whose epilogue stores many columns dispatches on act.kind once
// (with_activation_kind) instead of per element.
template <MoeActivation K>
__device__ __forceinline__ float activation_of(const MoeActivationParams& act, float g, float u) {
  if constexpr (K == MoeActivation::kSiLU) {
    return silu(g) * u;
  } else if constexpr (K == MoeActivation::kSiLUClamped) {
    return silu(fminf(g, act.limit)) * fminf(fmaxf(u, -act.limit), act.limit);
  } else {
    const float gc = fminf(g, act.limit), uc = fminf(fmaxf(u, -act.limit), act.limit);
    return activation_div((uc + 1.0f) * gc, 1.0f + __expf(-act.alpha * gc));
  }
}

// The same, dispatched at run time.
__device__ __forceinline__ float activation(const MoeActivationParams& act, float g, float u) {
  switch (act.kind) {
    case MoeActivation::kSiLU:
      return activation_of<MoeActivation::kSiLU>(act, g, u);
    case MoeActivation::kSiLUClamped:
      return activation_of<MoeActivation::kSiLUClamped>(act, g, u);
    case MoeActivation::kGptOss:
      return activation_of<MoeActivation::kGptOss>(act, g, u);
  }
  return 0.0f;
}

// Calls f(std::integral_constant<MoeActivation, kind>{}) for the run-time kind: one branch per
// call instead of one per stored element.
template <class F>
__device__ __forceinline__ void with_activation_kind(MoeActivation kind, F&& f) {
  switch (kind) {
    case MoeActivation::kSiLU:
      f(std::integral_constant<MoeActivation, MoeActivation::kSiLU>{});
      return;
    case MoeActivation::kSiLUClamped:
      f(std::integral_constant<MoeActivation, MoeActivation::kSiLUClamped>{});
      return;
    case MoeActivation::kGptOss:
      f(std::integral_constant<MoeActivation, MoeActivation::kGptOss>{});
      return;
  }
}

// The epilogue of one token column of a 16-row weight tile, shared by the three GEMM kernel
// families: lo / hi are tile rows g and g + 8 for
// the token at padded position pos (pair: its (token, slot) pair, < 0 for padding). Already scaled.
// kKnownAct: the GEMM1 activation kind is ACT (the caller dispatched once, with_activation_kind);
// otherwise args.act.kind is read per call.
template <Epilogue EPI, bool kKnownAct = false, MoeActivation ACT = MoeActivation::kSiLU>
__device__ __forceinline__ void store_output_column(const GemmKernelArgs& args, float lo, float hi, int pos, int pair,
                                                    int row_tile, int g) {
  const MoeGemmDims& d = args.dims;
  if (pair < 0) return;
  if constexpr (EPI == Epilogue::kGateUp) {
    const int i = row_tile * 8 + g;  // rows 0-7 gate, 8-15 up of intermediate row_tile*8 + g
    const float v = kKnownAct ? activation_of<ACT>(args.act, lo, hi) : activation(args.act, lo, hi);
    if (i < d.n_out) args.h_out[static_cast<int64_t>(pos) * args.h_stride + i] = __float2bfloat16(v);
  } else {
    const int n_lo = row_tile * 16 + g, n_hi = n_lo + 8;
    if constexpr (EPI == Epilogue::kDownStore) {
      float* yrow = args.y + static_cast<int64_t>(pair) * args.y_stride;
      if (n_lo < d.n_out) yrow[n_lo] = lo;
      if (n_hi < d.n_out) yrow[n_hi] = hi;
    } else {
      const float w = args.topk_weights[pair];
      __nv_bfloat16* orow = args.out + static_cast<int64_t>(pair / args.tiles.top_k) * args.out_stride;
      if (n_lo < d.n_out) atomicAdd(orow + n_lo, __float2bfloat16(w * lo));
      if (n_hi < d.n_out) atomicAdd(orow + n_hi, __float2bfloat16(w * hi));
    }
  }
}

}  // namespace moebius::kernels::moe_detail
