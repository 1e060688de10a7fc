// The dense skinny GEMM for decode; the launcher is declared in dense_gemv.cuh.
//
// Work split. A "tile" is 16 consecutive weight rows (output features) over the whole K; a block
// of 8 warps owns one tile at a time and splits its K: warp w takes the 32-wide k columns w, w + 8,
// w + 16, ... (an "item" is one such column of the tile: 16 rows x 32 k = 1 KB of weights). The
// 8 warps of a block therefore sweep a tile left to right together, 512 contiguous bytes of each
// row per round, which keeps DRAM pages open. The grid is persistent: min(tiles, resident blocks)
// blocks, block b taking tiles b, b + grid, ... (the lm_head's 9496 tiles are 36 per block on 264
// blocks; qkv's 320 tiles are 1 or 2; o's 128 tiles are one each). At the end of a tile the 8
// warps' partial sums meet in shared memory (double-buffered by tile parity, so one __syncthreads
// per tile) and 16 x M outputs are written. Fixed order: bit-reproducible.
//
// Math: mma.sync m16n8k16 (bf16 -> fp32) with the WEIGHTS as the A operand (16 rows) and the
// tokens as B (n8; two n8 tiles for M > 8), so a single token still uses 1/8 of the mma and no
// weight is ever converted to fp32 by hand. Lane (g = lane/4, t = lane%4) loads 16 bytes = k
// 8t..8t+7 of the item's rows g and g + 8 straight into A-fragment registers. That is a
// permutation of k inside the 32-wide column (mma k-slot 2t, 2t+1 | 2t+8, 2t+9 of the first k16
// step holds real k 8t..8t+3, the second step real k 8t+4..8t+7), harmless for a dot product as
// long as B uses the same one: the lane's B fragment is x[token g][8t .. 8t+7] of the same column,
// one 16-byte shared load. Per 1 KB of weights a warp issues 2 cp.async, 2 + 1 (M <= 8) or 2 + 2
// shared loads and 2 or 4 mma: far below the SM's issue rate at its 35 GB/s share of HBM.
//
// Memory pipeline. The weights go HBM -> shared memory by 16-byte cp.async.cg (L2 only; see
// cp_async16_stream for why without an evict-first hint). Each warp has a private ring of kRing
// items and each lane reads back only the 2 x 16 bytes it wrote itself, so there is no barrier in
// the steady state: cp.async.wait_group per item, and kRing - 1 items (7 KB per warp, 56 KB per
// block, ~112 KB per SM at two blocks) stay in flight: ~3x what Little's law asks for (35 GB/s per
// SM x ~1 us loaded latency) without holding a byte in registers. The ring is filled before
// pdl_wait(): the first 64 KB per block (17 MB over the grid, 80% of the qkv weight) are requested
// while the previous kernel (the RMSNorm) still runs.
//
// x [M, K] is staged once per block into shared memory after pdl_wait() (cp.async, every chunk in
// flight at once: one L2 round trip whatever M and K), zero-padded to the
// columns the warps walk, with 64 bytes of padding per row so the 8 lanes of a 16-byte shared-load
// phase (rows g, g+1 x 4 chunks) hit 8 distinct bank groups. Its cost is M * K * 2 bytes from L2
// per block (2.6% of the qkv weight bytes at M = 1 on 264 blocks; 100% of the o weight at M = 16
// on 132 blocks, which is why that configuration is the one to compare against cuBLAS).
//
// Shared memory per block: ring 8 warps x kRing x 1 KB = 64 KB, reduction 2 x 8 x 32 x 4 NT floats
// = 8 or 16 KB, x M x (Kp + 32) x 2 bytes (Kp: K rounded up to the 256-wide column rounds).
#include "kernels/dense_gemv.cuh"

#include <algorithm>
#include <mutex>
#include <type_traits>
#include <vector>

#include "kernels/cuda_check.h"
#include "kernels/device_info.h"
#include "kernels/mma.cuh"
#include "kernels/moe_combine_sum.cuh"
#include "kernels/pdl.cuh"

namespace moebius::kernels {
namespace {

constexpr int kWarps = 8;              // K slices of a tile (warps per block)
constexpr int kThreads = kWarps * 32;
constexpr int kRing = 8;               // items in flight per warp (power of two)
constexpr int kTileRows = 16;          // the mma's m16: weight rows per tile
constexpr int kColK = 32;              // k per item: a quad's 4 lanes x 8 bf16
constexpr int kItemBytes = 2 * 32 * 16;  // rows g and g+8 for 32 lanes
constexpr int kXPad = 32;              // bf16 of padding per staged x row (64 bytes)

// Columns of 32 k each warp walks per tile, and the padded K they cover.
inline int columns_per_warp(int K) { return ((K + kColK - 1) / kColK + kWarps - 1) / kWarps; }
inline int padded_k(int K) { return columns_per_warp(K) * kWarps * kColK; }

// DenseGemvRmsNorm without its combine source: the kernels' own copy, so that the instances
// without a folded combine keep the argument block (and, with nvcc 13.0, the register counts) they
// had before [TAG_MOE_DEFERRED_COMBINE] existed: 40 more bytes of it cost the copy instances up to
// 6 registers.
struct GemvNorm {
  const float* resid;
  const __nv_bfloat16* delta;
  const float* weight;
  float eps;
  float* resid_out;
};

struct GemvArgs {
  const __nv_bfloat16* x;  // [M, ldx]; unused with the RMSNorm prologue
  int64_t ldx;
  const __nv_bfloat16* w;  // [N, K]
  void* y;                 // [M, ldy] OutT
  int64_t ldy;
  int M, N, K;
  int tiles;  // ceil(N / 16)
  int cpw;    // columns_per_warp(K)
  GemvNorm norm;  // kRmsNorm* kernels only: x = bf16(RMSNorm(resid + delta) * weight)
};
// The kRmsNormCombine kernels' arguments: delta is formed from `combine` [TAG_MOE_DEFERRED_COMBINE].
struct GemvCombineArgs : GemvArgs {
  MoeCombineSource combine;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared, L2 only; src_bytes 0 zero-fills without reading. No L2::cache_hint
// (evict-first) operand: in the first GPU run of this kernel (H200, 2026-12-03) the refill inside
// the k-loop faulted with an illegal instruction on `cp.async.cg ... L2::cache_hint`
// (compute-sanitizer), although the same instruction had run in the ring fill before the loop.
// The weights take the default L2 policy until that is understood.
__device__ __forceinline__ void cp_async16_stream(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// 16 bytes global -> shared, L2 only, default policy (the activations, read by every block).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  const uint32_t a[4] = {a0, a1, a2, a3};
  mma_m16n8k16_bf16(c, a, b0, b1);
}
__device__ __forceinline__ void store_out(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_out(float* p, float v) { *p = v; }

__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
  const float4 lo = reinterpret_cast<const float4*>(p)[0], hi = reinterpret_cast<const float4*>(p)[1];
  v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
}
// v[i] += the i-th of 8 bf16 values in u (fp32 adds, as norm.cu's residual update).
__device__ __forceinline__ void add_bf16x8(const uint4& u, float (&v)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] += f.x;
    v[2 * i + 1] += f.y;
  }
}
// resid + delta of one 8-element chunk.
__device__ __forceinline__ void load_residual8(const GemvNorm& n, int64_t at, float (&v)[8]) {
  load8(n.resid + at, v);
  if (n.delta != nullptr) {
    const uint4 u = *reinterpret_cast<const uint4*>(n.delta + at);
    add_bf16x8(u, v);
  }
}

// [TAG_MOE_DEFERRED_COMBINE] Pass 1 of a norm whose delta is the previous MoE layer's combine:
// resid + delta for chunk q (8 columns) of row m, with delta formed by moe_combine_quad exactly as
// launch_moe_combine would have stored it (bf16, round to nearest), and kept in the staged row's
// chunk `stash`, where pass 2 (load_staged_residual8, the same thread) reads it back instead of
// combining again: the k rows are 32 * k bytes a chunk from L2, the stash 16 from shared memory.
// Rows past the live count get delta 0 and read no expert rows (their y and weights are whatever
// the workspace holds): their sum runs over 0 slots, +0.0, a trip count uniform over the block.
// (An `if (live)` around the loads made ptxas spill in the one-tile instance.)
__device__ __forceinline__ void combine_residual8(const GemvNorm& n, const MoeCombineSource& c, int64_t at, int m,
                                                  int col, bool live, __nv_bfloat16* stash, float (&v)[8]) {
  const int64_t row0 = static_cast<int64_t>(m) * c.top_k;
  const float* yt = c.y + row0 * c.y_stride + col;
  const float* wt = c.weights + row0;
  const int slots = live ? c.top_k : 0;
  // Both quads' loads are independent: with the helper inlined they are all in flight together.
  const float4 lo = moe_detail::moe_combine_quad</*kStreaming=*/false>(yt, c.y_stride, wt, slots);
  const float4 hi = moe_detail::moe_combine_quad</*kStreaming=*/false>(yt + 4, c.y_stride, wt, slots);
  load8(n.resid + at, v);
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
  h[0] = __floats2bfloat162_rn(lo.x, lo.y);
  h[1] = __floats2bfloat162_rn(lo.z, lo.w);
  h[2] = __floats2bfloat162_rn(hi.x, hi.y);
  h[3] = __floats2bfloat162_rn(hi.z, hi.w);
  *reinterpret_cast<uint4*>(stash) = u;
  add_bf16x8(u, v);
}
// Pass 2 of the same: resid + the bf16 delta that pass 1 stashed.
__device__ __forceinline__ void load_staged_residual8(const GemvNorm& n, int64_t at,
                                                      const __nv_bfloat16* stash, float (&v)[8]) {
  load8(n.resid + at, v);
  add_bf16x8(*reinterpret_cast<const uint4*>(stash), v);
}

// [TAG_GEMV_RMS_NORM] The activations of a kRmsNorm* launch: xs[m][k] = bf16(RMSNorm(resid + delta) *
// weight), formed in every block from the fp32 residual instead of read from a normalised copy
// that a separate RMSNorm kernel wrote (one kernel and one L2 round trip less per decode layer).
// Bit-identical to launch_add_rms_norm<float, float> followed by the plain GEMV: norm.cu gives
// thread t of its (up to) 256 threads the 8-element chunks t, t + 256, ... of a row, accumulates
// fmaf(v, v, ss) in that order, adds the lanes by a xor butterfly, then the warps' sums by a
// second butterfly over lanes < warps (zeros elsewhere), and forms (v * inv) * w. This block has
// the same 256 threads and does the same; where norm.cu runs fewer warps (H < 2048), the extra
// warps here contribute exact zeros, which leave every sum unchanged. Block 0 writes the updated
// residual resid + delta to resid_out (a different buffer: the other blocks still read resid).
// Two passes over the rows (the sums, one barrier, then the outputs), so any M fits in the
// registers; the second pass re-reads the rows from L1 (a folded combine's delta from the stash,
// [TAG_MOE_DEFERRED_COMBINE]).
// Static shared memory of the kRmsNorm* kernels (the per-warp partial sums below): the opt-in limit
// covers static + dynamic, so dense_gemv_supports keeps this much of it free.
constexpr size_t kNormStaticSmem = sizeof(float) * kDenseGemvMaxM * kWarps;

// Args: GemvArgs, or GemvCombineArgs when delta is the previous MoE layer's combine
// ([TAG_MOE_DEFERRED_COMBINE]); its own kernel (dense_gemv_combine_kernel), so the plain norm's
// keeps its registers (40 / 46 at NT 1 / 2 against 102 / 96 with the combine's 16 loads in flight,
// which bear on what can share an SM with it).
template <typename Args>
__device__ void stage_rms_norm_rows(const Args& a, __nv_bfloat16* xs, int xs_stride) {
  constexpr bool kFolded = std::is_same_v<Args, GemvCombineArgs>;
  __shared__ float s_part[kDenseGemvMaxM][kWarps];  // kNormStaticSmem
  const GemvNorm& n = a.norm;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int kq = a.K / 8;  // chunks per row
  int live_rows = 0;
  if constexpr (kFolded) live_rows = min(max(*a.combine.num_tokens, 0), a.combine.capacity);
  for (int m = 0; m < a.M; ++m) {
    float ss = 0.0f;
    for (int q = tid; q < kq; q += kThreads) {
      float v[8];
      const int64_t at = static_cast<int64_t>(m) * a.K + q * 8;
      if constexpr (kFolded)
        combine_residual8(n, a.combine, at, m, q * 8, m < live_rows, xs + m * xs_stride + q * 8, v);
      else load_residual8(n, at, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) ss = fmaf(v[i], v[i], ss);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) s_part[m][warp] = ss;
  }
  __syncthreads();
  const bool write_residual = blockIdx.x == 0 && n.resid_out != nullptr;
  for (int m = 0; m < a.M; ++m) {
    float total = lane < kWarps ? s_part[m][lane] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    const float inv = 1.0f / sqrtf(total / static_cast<float>(a.K) + n.eps);
    for (int q = tid; q < kq; q += kThreads) {
      const int64_t at = static_cast<int64_t>(m) * a.K + q * 8;
      float v[8];
      if constexpr (kFolded) load_staged_residual8(n, at, xs + m * xs_stride + q * 8, v);
      else load_residual8(n, at, v);
      if (write_residual) {
        reinterpret_cast<float4*>(n.resid_out + at)[0] = make_float4(v[0], v[1], v[2], v[3]);
        reinterpret_cast<float4*>(n.resid_out + at)[1] = make_float4(v[4], v[5], v[6], v[7]);
      }
      uint4 u;
      __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
      for (int i = 0; i < 4; ++i)
        h[i] = __floats2bfloat162_rn(v[2 * i] * inv * n.weight[q * 8 + 2 * i],
                                     v[2 * i + 1] * inv * n.weight[q * 8 + 2 * i + 1]);
      *reinterpret_cast<uint4*>(xs + m * xs_stride + q * 8) = u;
    }
  }
  // Zero past K: the warps' last columns may overhang it (the plain staging zero-fills them too).
  const int xq = xs_stride / 8 - kXPad / 8;
  for (int i = tid; i < a.M * (xq - kq); i += kThreads) {
    const int m = i / (xq - kq), q = kq + i % (xq - kq);
    *reinterpret_cast<uint4*>(xs + m * xs_stride + q * 8) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// How a launch forms its activations x [M, K] in shared memory: copied from x, or formed by
// stage_rms_norm_rows ([TAG_GEMV_RMS_NORM]) from the residual and a bf16 delta, or from the
// residual and the previous MoE layer's combine ([TAG_MOE_DEFERRED_COMBINE]).
enum class GemvInput { kCopy, kRmsNorm, kRmsNormCombine };

template <GemvInput kIn>
using GemvArgsOf = std::conditional_t<kIn == GemvInput::kRmsNormCombine, GemvCombineArgs, GemvArgs>;

// NT: n8 token tiles (1: M <= 8, 2: M <= 16). The body of the kernels below.
template <int NT, typename OutT, GemvInput kIn>
__device__ __forceinline__ void dense_gemv_body(const GemvArgsOf<kIn>& a) {
  extern __shared__ __align__(16) uint8_t smem[];
  constexpr int kRed = 32 * 4 * NT;  // floats one warp contributes per tile
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  uint8_t* ring = smem + warp * (kRing * kItemBytes);                           // [kRing][2][32] x 16 B
  float* red = reinterpret_cast<float*>(smem + kWarps * kRing * kItemBytes);   // [2][kWarps][kRed]
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem + kWarps * kRing * kItemBytes +
                                                       2 * kWarps * kRed * sizeof(float));  // [M][xs_stride]
  const int xs_stride = a.cpw * kWarps * kColK + kXPad;
  const int kchunks = a.K / 8;  // 16-byte chunks per weight row
  const int my_tiles = (a.tiles - static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) - 1) /
                       static_cast<int>(gridDim.x);
  const int items = my_tiles * a.cpw;
  const uint32_t ring_s = smem_addr(ring) + lane * 16;

  // Issue cursor: item `issued` of this warp is column (warp + is_col * kWarps) of tile is_tile.
  // Every call commits one group (empty past the last item) so that wait_group counts items.
  int issued = 0, is_tile = blockIdx.x, is_col = 0;
  auto issue = [&]() {
    if (issued < items) {
      const int q = (warp + is_col * kWarps) * 4 + t;  // this lane's 16-byte chunk along K
      const int r0 = is_tile * kTileRows + g;
      const bool kin = q < kchunks;
      const bool in0 = kin && r0 < a.N, in1 = kin && r0 + 8 < a.N;
      const __nv_bfloat16* s0 = in0 ? a.w + static_cast<int64_t>(r0) * a.K + q * 8 : a.w;
      const __nv_bfloat16* s1 = in1 ? a.w + static_cast<int64_t>(r0 + 8) * a.K + q * 8 : a.w;
      const uint32_t dst = ring_s + (issued & (kRing - 1)) * kItemBytes;
      cp_async16_stream(dst, s0, in0 ? 16 : 0);
      cp_async16_stream(dst + 32 * 16, s1, in1 ? 16 : 0);
      if (++is_col == a.cpw) {
        is_col = 0;
        is_tile += gridDim.x;
      }
    }
    cp_async_commit();
    ++issued;
  };

  // Weights do not depend on the previous kernel: fill the ring while it drains.
#pragma unroll 1
  for (int i = 0; i < kRing; ++i) issue();
  pdl_wait();  // x is the previous kernel's output; y may still be read by it
  pdl_launch_dependents();

  if constexpr (kIn != GemvInput::kCopy) {
    stage_rms_norm_rows(a, xs, xs_stride);
    // No copy group here: commit an empty one so the loop's wait counts stay as below.
    cp_async_commit();
  } else {  // Stage x [M, K] -> xs by cp.async (all in flight at once), zero past K: the warps' last
     // columns may overhang K. wait_group 0 also waits for the ring, issued earlier, which is
     // due by then anyway; later waits count this group as one more item (see the loop).
    const int xq = xs_stride / 8 - kXPad / 8;  // chunks per staged row
    const uint32_t xs_s = smem_addr(xs);
    for (int i = threadIdx.x; i < a.M * xq; i += kThreads) {
      const int m = i / xq, q = i - m * xq;
      const bool in = q < kchunks;
      cp_async16(xs_s + (m * xs_stride + q * 8) * 2, in ? a.x + m * a.ldx + q * 8 : a.x, in ? 16 : 0);
    }
    cp_async_commit();
    cp_async_wait<0>();
  }
  __syncthreads();

  // Lane's B rows: tokens g and g + 8 (absent tokens read as zero).
  const __nv_bfloat16* xb0 = xs + g * xs_stride + t * 8;
  const __nv_bfloat16* xb1 = xs + (g + 8) * xs_stride + t * 8;
  const bool has0 = g < a.M, has1 = NT == 2 && g + 8 < a.M;
  OutT* y = static_cast<OutT*>(a.y);

  float acc[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  int c_tile = blockIdx.x, c_col = 0, buf = 0;
#pragma unroll 1
  for (int it = 0; it < items; ++it) {
    // Item `it` has landed (this lane's own bytes). Groups: items 0..kRing-1, x, then item kRing + j
    // is group kRing + 1 + j, so "all but the newest kRing - 1" covers item `it` either way.
    cp_async_wait<kRing - 1>();
    const uint8_t* slot = ring + (it & (kRing - 1)) * kItemBytes + lane * 16;
    const uint4 lo = *reinterpret_cast<const uint4*>(slot);            // row g
    const uint4 hi = *reinterpret_cast<const uint4*>(slot + 32 * 16);  // row g + 8
    const int k0 = (warp + c_col * kWarps) * kColK;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const uint4 b0 = has0 ? *reinterpret_cast<const uint4*>(xb0 + k0) : zero;
    mma_bf16(acc[0], lo.x, hi.x, lo.y, hi.y, b0.x, b0.y);  // real k 8t .. 8t+3
    mma_bf16(acc[0], lo.z, hi.z, lo.w, hi.w, b0.z, b0.w);  // real k 8t+4 .. 8t+7
    if constexpr (NT == 2) {
      const uint4 b1 = has1 ? *reinterpret_cast<const uint4*>(xb1 + k0) : zero;
      mma_bf16(acc[1], lo.x, hi.x, lo.y, hi.y, b1.x, b1.y);
      mma_bf16(acc[1], lo.z, hi.z, lo.w, hi.w, b1.z, b1.w);
    }
    issue();  // refills the slot just read (its values are in registers, consumed by the mma)
    if (++c_col < a.cpw) continue;

    // End of a tile: sum the 8 warps' fragments in a fixed order and write 16 rows x M tokens.
    float* mine = red + (buf * kWarps + warp) * kRed + lane * 4 * NT;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      reinterpret_cast<float4*>(mine)[n] = make_float4(acc[n][0], acc[n][1], acc[n][2], acc[n][3]);
      acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    }
    __syncthreads();  // also orders this buffer's reads before its reuse two tiles later
    if (threadIdx.x < kRed) {
      const int e = threadIdx.x;
      const float* col = red + buf * kWarps * kRed + e;
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += col[w * kRed];
      // Fragment element e: lane ln = e / (4 NT), tile n, c-register c; c0,c1: row g', c2,c3: row
      // g'+8; c0,c2: token 2t', c1,c3: token 2t'+1 (of n8 tile n).
      const int ln = e / (4 * NT), i = e % (4 * NT), n = i / 4, c = i % 4;
      const int row = c_tile * kTileRows + (ln >> 2) + 8 * (c >> 1);
      const int tok = n * 8 + 2 * (ln & 3) + (c & 1);
      if (tok < a.M && row < a.N) store_out(y + tok * a.ldy + row, s);
    }
    c_col = 0;
    c_tile += gridDim.x;
    buf ^= 1;
  }
}

template <int NT, typename OutT, GemvInput kIn>
__global__ void __launch_bounds__(kThreads) dense_gemv_kernel(const GemvArgsOf<kIn> a) {
  dense_gemv_body<NT, OutT, kIn>(a);
}
// [TAG_MOE_DEFERRED_COMBINE] The folded combine's instances declare the 2 blocks per SM that shared
// memory allows anyway: left to its own heuristic, ptxas capped them at 80 registers and spilled
// (the combine keeps 16 float4 loads in flight); under this bound they take ~100 and spill nothing.
// A separate kernel, so the other instances keep the code they had.
template <int NT, typename OutT>
__global__ void __launch_bounds__(kThreads, 2) dense_gemv_combine_kernel(const GemvCombineArgs a) {
  dense_gemv_body<NT, OutT, GemvInput::kRmsNormCombine>(a);
}

// Resident blocks per SM for one instantiation at one shared-memory size, cached: the occupancy
// query is a driver call, and eager (non-graph) steps launch this kernel three times per layer.
struct OccupancyCache {
  std::mutex mu;
  struct Entry {
    const void* kernel;
    int device;
    size_t smem;
    int blocks;
  };
  std::vector<Entry> entries;
};

int blocks_per_sm(const void* kernel, size_t smem) {
  static OccupancyCache cache;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(cache.mu);
  for (const auto& e : cache.entries)
    if (e.kernel == kernel && e.device == device && e.smem == smem) return e.blocks;
  // Dynamic shared memory above 48 KB needs the opt-in; set it to the device's maximum (less the
  // kernel's static shared memory: the limit covers both) once per kernel and device (not a
  // stream operation: legal during graph capture).
  int optin = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attr{};
  CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  optin - static_cast<int>(attr.sharedSizeBytes)));
  int blocks = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, smem));
  MOEBIUS_LAUNCH_ASSERT(blocks > 0, "dense_gemv: the kernel does not fit on a multiprocessor");
  cache.entries.push_back({kernel, device, smem, blocks});
  return blocks;
}

}  // namespace

size_t dense_gemv_smem_bytes(int M, int K) {
  const int nt = M <= 8 ? 1 : 2;
  return static_cast<size_t>(kWarps) * kRing * kItemBytes + 2ull * kWarps * 32 * 4 * nt * sizeof(float) +
         static_cast<size_t>(M) * (padded_k(K) + kXPad) * sizeof(__nv_bfloat16);
}

bool dense_gemv_supports(int M, int K) {
  if (M < 1 || M > kDenseGemvMaxM || K <= 0 || K % 8 != 0) return false;
  int device = 0, optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  // Room for the kRmsNorm* kernels' static shared memory too, so one answer serves both launchers.
  return dense_gemv_smem_bytes(M, K) + kNormStaticSmem <= static_cast<size_t>(optin);
}

namespace {

// `a` carries the activations (x and ldx, or the norm); the rest is filled here.
template <GemvInput kIn, typename OutT>
void launch_gemv(GemvArgsOf<kIn> a, const __nv_bfloat16* w, int M, int N, int K, OutT* y, int64_t ldy,
                 cudaStream_t stream) {
  a.w = w;
  a.ldy = ldy;
  a.M = M;
  a.N = N;
  a.K = K;
  MOEBIUS_LAUNCH_ASSERT(M >= 0 && M <= kDenseGemvMaxM, "dense_gemv: M must be in [0, 16]");
  MOEBIUS_LAUNCH_ASSERT(N > 0 && K > 0 && K % 8 == 0, "dense_gemv: N > 0 and K > 0 a multiple of 8");
  MOEBIUS_LAUNCH_ASSERT(a.ldy >= N, "dense_gemv: ldy >= N");
  MOEBIUS_LAUNCH_ASSERT(reinterpret_cast<uintptr_t>(a.w) % 16 == 0, "dense_gemv: w must be 16-byte aligned");
  if (M == 0) return;
  MOEBIUS_LAUNCH_ASSERT(dense_gemv_supports(M, K), "dense_gemv: x does not fit in shared memory (use cuBLAS)");
  const size_t smem = dense_gemv_smem_bytes(M, K);
  const int64_t tiles = (static_cast<int64_t>(N) + kTileRows - 1) / kTileRows;
  MOEBIUS_LAUNCH_ASSERT(tiles < (int64_t{1} << 30), "dense_gemv: N too large");
  a.y = y;
  a.tiles = static_cast<int>(tiles);
  a.cpw = columns_per_warp(K);
  void (*kernel)(GemvArgsOf<kIn>) = nullptr;
  if constexpr (kIn == GemvInput::kRmsNormCombine)
    kernel = M <= 8 ? dense_gemv_combine_kernel<1, OutT> : dense_gemv_combine_kernel<2, OutT>;
  else
    kernel = M <= 8 ? dense_gemv_kernel<1, OutT, kIn> : dense_gemv_kernel<2, OutT, kIn>;
  const int64_t resident = static_cast<int64_t>(blocks_per_sm(reinterpret_cast<const void*>(kernel), smem)) * current_device_sm_count();
  const int grid = static_cast<int>(std::min<int64_t>(tiles, resident));
  launch_pdl(kernel, dim3(grid), dim3(kThreads), smem, stream, a);
}

}  // namespace

template <typename OutT>
void launch_dense_gemv(const __nv_bfloat16* x, int64_t ldx, const __nv_bfloat16* w, int M, int N, int K, OutT* y,
                       int64_t ldy, cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(ldx >= K && ldx % 8 == 0, "dense_gemv: ldx >= K, a multiple of 8");
  MOEBIUS_LAUNCH_ASSERT(reinterpret_cast<uintptr_t>(x) % 16 == 0, "dense_gemv: x must be 16-byte aligned");
  GemvArgs a{};
  a.x = x;
  a.ldx = ldx;
  launch_gemv<GemvInput::kCopy>(a, w, M, N, K, y, ldy, stream);
}

template <typename OutT>
void launch_dense_gemv_rms_norm(const DenseGemvRmsNorm& norm, const __nv_bfloat16* w, int M, int N, int K, OutT* y,
                                int64_t ldy, cudaStream_t stream) {
  auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  MOEBIUS_LAUNCH_ASSERT(norm.resid != nullptr && norm.weight != nullptr, "dense_gemv_rms_norm: resid and weight must be set");
  MOEBIUS_LAUNCH_ASSERT(aligned16(norm.resid) && aligned16(norm.delta) && aligned16(norm.resid_out),
                        "dense_gemv_rms_norm: resid, delta and resid_out must be 16-byte aligned");
  MOEBIUS_LAUNCH_ASSERT(norm.resid_out == nullptr || norm.resid_out != norm.resid,
                        "dense_gemv_rms_norm: resid_out must be another buffer (every block reads resid)");
  const MoeCombineSource& c = norm.combine;
  if (c.y != nullptr) {  // [TAG_MOE_DEFERRED_COMBINE]
    MOEBIUS_LAUNCH_ASSERT(norm.delta == nullptr, "dense_gemv_rms_norm: a folded combine replaces delta");
    MOEBIUS_LAUNCH_ASSERT(c.weights != nullptr && c.num_tokens != nullptr && c.top_k >= 1 && M <= c.capacity,
                          "dense_gemv_rms_norm: the combine needs weights, num_tokens, k >= 1 and M <= capacity");
    MOEBIUS_LAUNCH_ASSERT(aligned16(c.y) && c.y_stride % 4 == 0 && c.y_stride >= K,
                          "dense_gemv_rms_norm: combine y must be 16-byte aligned, y_stride >= K a multiple of 4");
  }
  const GemvNorm gn{norm.resid, norm.delta, norm.weight, norm.eps, norm.resid_out};
  if (c.y != nullptr) {
    GemvCombineArgs a{};
    a.norm = gn;
    a.combine = c;
    launch_gemv<GemvInput::kRmsNormCombine>(a, w, M, N, K, y, ldy, stream);
  } else {
    GemvArgs a{};
    a.norm = gn;
    launch_gemv<GemvInput::kRmsNorm>(a, w, M, N, K, y, ldy, stream);
  }
}

template void launch_dense_gemv<__nv_bfloat16>(const __nv_bfloat16*, int64_t, const __nv_bfloat16*, int, int, int,
                                               __nv_bfloat16*, int64_t, cudaStream_t);
template void launch_dense_gemv<float>(const __nv_bfloat16*, int64_t, const __nv_bfloat16*, int, int, int, float*,
                                       int64_t, cudaStream_t);
template void launch_dense_gemv_rms_norm<__nv_bfloat16>(const DenseGemvRmsNorm&, const __nv_bfloat16*, int, int, int,
                                                        __nv_bfloat16*, int64_t, cudaStream_t);
template void launch_dense_gemv_rms_norm<float>(const DenseGemvRmsNorm&, const __nv_bfloat16*, int, int, int, float*,
                                                int64_t, cudaStream_t);

}  // namespace moebius::kernels
