// Grouped expert GEMMs, "swap AB" mma.sync m16n8k16 with in-register dequantization.
//
// Block = 4 warps on ONE 16-row weight tile and one token tile (block_m tokens); the warps split
// K into four contiguous ranges and their partial sums meet in shared memory, summed in warp
// order so results are bit-identical run to run. grid = (row tiles, token tiles).
//
// Why this shape: decode reads each expert's weights once for one or a few tokens, so the kernel
// must stream weights at HBM speed. Each lane issues one 16-byte evict-first load per 512-byte
// tile chunk (the layout in src/moe/expert_layout.h puts a lane's whole A fragment for the
// chunk's k-steps in those 16 bytes), and four chunks are in flight per lane before any math.
// The weights are the mma A operand (16 rows), tokens the B operand (8 per n-tile), so one token
// per expert wastes 7/8 of an n8 tile rather than 15/16 of an m16 tile; larger token tiles reuse
// each dequantized fragment for block_m / 8 mma.
//
// Activations: when the tile's live rows (min(block_m, capacity)) of padded K fit 72 KB, the block
// stages them in shared memory with cp.async (issued after the first weight loads, so the two
// latencies overlap) and the k-loop reads B fragments there. Reading them from global memory in
// the k-loop, as the first version did, put an L1/L2 round trip in front of every mma (ncu:
// GEMM1 at T=1 spent most of its 17 cycles per issue waiting on L1TEX; docs/PERF.md). Larger
// tiles (32-64 tokens at K = 2048) keep the global-memory path.
//
// Several row tiles per block (moe_gemm_rows_kernel, [TAG_DECODE_ROW_TILES]): with one token tile
// and a warp's K range in one batch of loads, a block can walk R consecutive row tiles of its
// expert with one prologue, the next tile's weights in flight during the current tile's math. It
// is bit-identical to the one-tile kernel and chosen from the grid size (decode_rows_per_block).
//
// Dequantization (shared with the prefill kernel) is described in kernels/moe_dequant.cuh.
#include "kernels/moe_gemm.cuh"

#include <atomic>
#include <cstdlib>

#include "kernels/cuda_check.h"
#include "kernels/device_info.h"
#include "kernels/moe_dequant.cuh"
#include "kernels/pdl.cuh"

namespace moebius::kernels {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

using namespace moe_detail;

// Weights are read exactly once per token tile: stream them past L1 with an evict-first hint so
// they do not push activations (re-read by every row tile) out of L2.
__device__ __forceinline__ uint4 load_weights(const uint4* p) { return __ldcs(p); }

// The B fragment (two bf16 pairs) of one token row at k0: columns k0+2t, +1 and k0+2t+8, +9.
// Columns >= K read as 0, so padded weight columns meet zeros.
template <bool kOddK>
__device__ __forceinline__ void load_b(const __nv_bfloat16* row, int k0, int t, int K, uint32_t& b0, uint32_t& b1) {
  const int c0 = k0 + 2 * t, c1 = c0 + 8;
  if (row == nullptr) {
    b0 = b1 = 0;
    return;
  }
  if constexpr (!kOddK) {  // even K and even stride: 4-byte aligned pairs
    b0 = c0 < K ? __ldg(reinterpret_cast<const uint32_t*>(row + c0)) : 0u;
    b1 = c1 < K ? __ldg(reinterpret_cast<const uint32_t*>(row + c1)) : 0u;
  } else {
    const uint16_t* r = reinterpret_cast<const uint16_t*>(row);
    auto ld = [&](int c) -> uint32_t { return c < K ? static_cast<uint32_t>(__ldg(r + c)) : 0u; };
    b0 = ld(c0) | (ld(c0 + 1) << 16);
    b1 = ld(c1) | (ld(c1 + 1) << 16);
  }
}

// Stage a tile's live activation rows (row sources in s_row_src, nullptr for padding), K padded
// with zeros to the weights' padded columns, so the k-loop reads its B fragments from shared
// memory (one round trip for the whole tile instead of one L1/L2 round trip per k-step, which ncu
// showed on the critical path). stage_stride = padded K + 8 elements: the 8 rows of a B fragment
// load land 4 banks apart. Commits one cp.async group; the caller waits and syncs.
template <int KC, int W = kWarps>
__device__ __forceinline__ void stage_activations(const GemmKernelArgs& args, const __nv_bfloat16* const* s_row_src,
                                                  __nv_bfloat16* s_act, int warp, int lane) {
  const MoeGemmDims& d = args.dims;
  const int pieces = d.chunks * (KC / 8);  // 16-byte pieces per padded row
  for (int r = warp; r < args.stage_rows; r += W) {
    const __nv_bfloat16* src = s_row_src[r];
    const uint32_t dst = smem_u32(s_act + static_cast<int64_t>(r) * args.stage_stride);
    for (int p = lane; p < pieces; p += 32) {
      const int k = p * 8;
      const int bytes = src == nullptr ? 0 : max(0, min(16, 2 * (d.k - k)));
      cp_async16(dst + p * 16, bytes > 0 ? static_cast<const void*>(src + k) : static_cast<const void*>(args.act_in), bytes);
    }
  }
  cp_async_commit();
}

// The epilogue of one n8 token tile of a 16-row weight tile: c[0], c[1] are tile row g, tokens 2t
// and 2t+1 (padded positions pos0 + 2t, +1); c[2], c[3] tile row g + 8. Already scaled.
template <Epilogue EPI>
__device__ __forceinline__ void store_outputs(const GemmKernelArgs& args, const float (&c)[4], int pos0, int row_tile,
                                              int g, int t) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int pos = pos0 + 2 * t + j;
    store_output_column<EPI>(args, c[j], c[2 + j], pos, args.tiles.padded_pair_ids[pos], row_tile, g);
  }
}

// Blocks per SM with one token tile (decode), so the usual decode grids run in one wave on 132 SMs:
// Qwen3-30B-A3B at T = 1 has 96 row tiles x 8 experts = 768 GEMM1 blocks (6 per SM) and 128 x 8
// = 1024 GEMM2 blocks (8 per SM). The register caps this implies (85 and 64) hold without spills
// (ptxas -v); GEMM2 prefetches 4 chunks instead of 8 to fit (its K = 768 is 3 chunks per warp).
template <int NT, Epilogue EPI>
inline constexpr int kMinBlocksPerSm = NT != 1 ? 1 : (EPI == Epilogue::kGateUp ? 6 : 8);

// kGroupK: 128 when the int formats' group size is 128 (staged single-token-tile instances only):
// a group then starts only at a chunk's first k-step, so only those steps test their bit
// ([TAG_INT_GROUP_STARTS]); 0: every step tests it.
template <MoeWeightFormat F, int NT, Epilogue EPI, bool kOddK, bool kStageB, int kGroupK = 0>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm<NT, EPI>) moe_gemm_kernel(const GemmKernelArgs args) {
  constexpr int KC = kChunkK<F>;
  constexpr bool kIsIntF = kIsInt<F>;
  static_assert(kGroupK == 0 || (kIsIntF && kGroupK % KC == 0), "a compile-time group size of whole chunks");
  const int tile = blockIdx.y;
  const int row_tile = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const MoeGemmDims& d = args.dims;

  __shared__ float partial[kWarps][NT][32][4];
  __shared__ const __nv_bfloat16* s_row_src[kStageB ? NT * 8 : 1];
  extern __shared__ __align__(16) unsigned char s_dyn[];
  // kStageB: [stage_rows][stage_stride] activations; then, int formats: the group scales.
  __nv_bfloat16* s_act = reinterpret_cast<__nv_bfloat16*>(s_dyn);
  const __half* s_group_scales = reinterpret_cast<const __half*>(s_dyn + args.group_scale_offset);
  // This warp's contiguous chunk range.
  const int c_begin = (d.chunks * warp) / kWarps, c_end = (d.chunks * (warp + 1)) / kWarps;

  // 16-byte weight loads in flight per lane before the first use. With B read from global memory
  // in the k-loop, 8 for NT <= 2 was measured slower than 4 at every batch size (docs/PERF.md,
  // 2026-12-02). With B staged, one token tile takes 8: a Qwen3-30B-A3B GEMM1 warp's whole K
  // range (8 chunks) is then one memory round trip instead of two.
  constexpr int kPrefetch = (kStageB && NT == 1 && EPI == Epilogue::kGateUp) ? 8 : 4;
  uint4 wv[kPrefetch];
  uint2 sv[kPrefetch];
  ExpertMatrixPtrs ptrs;
  const uint4* wbase = nullptr;
  auto load_batch = [&](int c0) {
#pragma unroll
    for (int p = 0; p < kPrefetch; ++p) {
      if (c0 + p < c_end) {
        wv[p] = load_weights(wbase + static_cast<int64_t>(c0 + p) * 32);
        if constexpr (F == MoeWeightFormat::kNvFp4)
          sv[p] = __ldg(static_cast<const uint2*>(ptrs.scales) + (static_cast<int64_t>(row_tile) * d.chunks + c0 + p) * 8 + g);
      }
    }
  };
  // The tile's expert and its first weights. GEMM2 (kDown*) issues them BEFORE pdl_wait: its
  // tiles come from the routing two kernels back (GEMM1 runs between), which had completed before
  // any GEMM1 block passed its own pdl_wait and so before this grid could launch (the PDL
  // protocol in kernels/pdl.cuh), and weights never change during a forward (bytes copied into
  // device slots for the layer, by the prefetch or the routed DMA, reach GEMM2 through a full
  // event dependency, MoeLayerCuda::wait_before_down, not a programmatic one). The weight reads
  // then overlap GEMM1's tail instead of following it (at decode sizes GEMM1 is compute-bound and
  // GEMM2's first round trip to HBM was on the critical path). GEMM1's tiles come from the kernel
  // right before it, so it reads them after the wait.
  constexpr bool kWeightsBeforeWait = EPI != Epilogue::kGateUp;
  auto start_tile = [&]() -> bool {
    const int expert = args.tiles.tile_expert[tile];
    if (expert < 0) return false;  // [TAG_MOE_GRAPH_CAPACITY] past the live tiles (uniform over the block)
    ptrs = args.experts[expert];
    wbase = static_cast<const uint4*>(ptrs.weight) + static_cast<int64_t>(row_tile) * d.chunks * 32 + lane;
    // The first weights go out before the activations are staged, so the two latencies overlap.
    load_batch(c_begin);
    if constexpr (kIsIntF) {
      // The tile's group scales, [groups][16] fp16 contiguous, into shared memory: loading them at
      // each group boundary put a dependent global load inside the k-loop (int4 GEMM1 at T = 1
      // ran 1.7x nvfp4's time on fewer bytes; docs/PERF.md).
      const char* src = static_cast<const char*>(ptrs.scales) + static_cast<int64_t>(row_tile) * d.groups * 32;
      const uint32_t dst = smem_u32(s_dyn + args.group_scale_offset);
      for (int off = threadIdx.x * 4; off < d.groups * 32; off += kThreads * 4) cp_async4(dst + off, src + off);
      cp_async_commit();
    }
    return true;
  };
  if constexpr (kWeightsBeforeWait) {
    if (!start_tile()) return;
    pdl_wait();  // h (GEMM1) and the pair ids
    pdl_launch_dependents();
  } else {
    pdl_wait();  // tile_expert / pair ids (align) and the activations (previous stage)
    pdl_launch_dependents();
    if (!start_tile()) return;
  }

  // The activation row behind padded position pos of this tile (nullptr for padding).
  const int bm = args.tiles.block_m;
  auto act_row = [&](int pos) -> const __nv_bfloat16* {
    const int pair = args.tiles.padded_pair_ids[pos];
    const int64_t row = EPI == Epilogue::kGateUp ? pair / args.tiles.top_k : pos;
    return pair < 0 ? nullptr : args.act_in + row * static_cast<int64_t>(args.in_stride);
  };
  // Global-memory B path: the token rows this lane feeds into the B operand (token g of each n8 tile).
  const __nv_bfloat16* b_rows[kStageB ? 1 : NT];
  if constexpr (!kStageB) {
#pragma unroll
    for (int tt = 0; tt < NT; ++tt) b_rows[tt] = act_row(tile * bm + tt * 8 + g);
  } else {
    if (threadIdx.x < args.stage_rows) s_row_src[threadIdx.x] = act_row(tile * bm + threadIdx.x);
  }

  if constexpr (kStageB) {
    __syncthreads();  // s_row_src
    stage_activations<KC>(args, s_row_src, s_act, warp, lane);
    cp_async_wait<0>();
    __syncthreads();
  } else if constexpr (kIsIntF) {
    cp_async_wait<0>();  // the group scales
    __syncthreads();
  }

  // kSets independent accumulator sets, k-step s into set s % kSets, summed in a fixed order at
  // the end: with one token tile a warp's 32 mma otherwise form one dependent chain through the
  // accumulators (mma.sync latency ~30 cycles each), which the few warps of a decode block cannot
  // hide. Larger token tiles already give each k-step NT independent mma.
  constexpr int kSets = NT == 1 ? 2 : 1;
  float acc[kSets][NT][4];
  float grp[kSets][NT][4];  // int formats: the current scale group's unscaled sums
#pragma unroll
  for (int st = 0; st < kSets; ++st)
#pragma unroll
    for (int tt = 0; tt < NT; ++tt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[st][tt][i] = grp[st][tt][i] = 0.0f;

  auto flush_group = [&](int group) {
    const __half* sc = s_group_scales + group * 16;
    const float s_lo = __half2float(sc[g]), s_hi = __half2float(sc[g + 8]);
#pragma unroll
    for (int st = 0; st < kSets; ++st)
#pragma unroll
      for (int tt = 0; tt < NT; ++tt) {
        acc[st][tt][0] += grp[st][tt][0] * s_lo;
        acc[st][tt][1] += grp[st][tt][1] * s_lo;
        acc[st][tt][2] += grp[st][tt][2] * s_hi;
        acc[st][tt][3] += grp[st][tt][3] * s_hi;
#pragma unroll
        for (int i = 0; i < 4; ++i) grp[st][tt][i] = 0.0f;
      }
  };

  // Staged B: the shared-memory row of each token tile this lane reads. Rows past stage_rows
  // (tile positions no token can occupy, always padding) read row 0 instead of branching per
  // k-step: an mma output column depends only on its own B column, and the epilogue drops the
  // padding columns.
  int b_smem_row[kStageB ? NT : 1];
  if constexpr (kStageB) {
#pragma unroll
    for (int tt = 0; tt < NT; ++tt) {
      const int r = tt * 8 + g;
      b_smem_row[tt] = (r < args.stage_rows ? r : 0) * args.stage_stride + 2 * t;
    }
  }

  // [TAG_INT_GROUP_STARTS] the scale groups' first k-steps, a window per batch of chunks.
  static_assert(kPrefetch * kSteps<F> <= 64, "a batch's k-steps fit one GroupStarts window");
  const GroupStarts group_starts = group_starts_of<F>(d.group_size);
  int current_group = kIsIntF ? group_starts.group_of(c_begin * kSteps<F>) : 0;
  for (int c0 = c_begin; c0 < c_end; c0 += kPrefetch) {
    if (c0 != c_begin) load_batch(c0);
    const uint64_t starts = !kIsIntF ? 0ull :
        c0 == c_begin ? group_starts.first_window(c0 * kSteps<F>) : group_starts.window(c0 * kSteps<F>);
#pragma unroll
    for (int p = 0; p < kPrefetch; ++p) {
      const int c = c0 + p;
      if (c >= c_end) break;
      const uint2 nv_sc = F == MoeWeightFormat::kNvFp4 ? sv[p] : make_uint2(0, 0);
      auto do_step = [&](auto step_tag) {
        constexpr int S = decltype(step_tag)::value;
        // The k-step's position in the (fully unrolled) batch picks its set: a constant after
        // unrolling, so acc[set] stays in registers.
        const int set = (p * kSteps<F> + S) % kSets;
        uint32_t a[4];
        dequant_step<F, S, true>(wv[p], nv_sc, a);
        const int k0 = c * KC + S * 16;
        if constexpr (kIsIntF) {
          if (group_starts.opens<kGroupK, KC, false>(starts, p * kSteps<F> + S)) {
            flush_group(current_group);
            ++current_group;
          }
        }
#pragma unroll
        for (int tt = 0; tt < NT; ++tt) {
          uint32_t b0 = 0, b1 = 0;
          if constexpr (kStageB) {
            const uint32_t* q = reinterpret_cast<const uint32_t*>(s_act + b_smem_row[tt] + k0);
            b0 = q[0];
            b1 = q[4];
          } else {
            load_b<kOddK>(b_rows[tt], k0, t, d.k, b0, b1);
          }
          if constexpr (kIsIntF) mma_bf16(grp[set][tt], a, b0, b1);
          else mma_bf16(acc[set][tt], a, b0, b1);
        }
      };
      [&]<int... S>(std::integer_sequence<int, S...>) {
        (do_step(std::integral_constant<int, S>{}), ...);
      }(std::make_integer_sequence<int, kSteps<F>>{});
    }
  }
  if constexpr (kIsIntF) {
    if (c_end > c_begin) flush_group(current_group);
  }
  if constexpr (kSets == 2) {
#pragma unroll
    for (int tt = 0; tt < NT; ++tt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[0][tt][i] += acc[1][tt][i];
  }

  // Deterministic split-K reduction: every warp parks its sums, warp 0 adds them in warp order.
#pragma unroll
  for (int tt = 0; tt < NT; ++tt)
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][tt][lane][i] = acc[0][tt][i];
  __syncthreads();
  if (warp != 0) return;
  const float gs_lo = F == MoeWeightFormat::kNvFp4 ? ptrs.global_scale[0] * kNvFp4AccScale : 1.0f;
  const float gs_hi = F == MoeWeightFormat::kNvFp4 ? ptrs.global_scale[1] * kNvFp4AccScale : 1.0f;
#pragma unroll
  for (int tt = 0; tt < NT; ++tt) {
    float c[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += partial[w][tt][lane][i];
      c[i] = s * (i < 2 ? gs_lo : gs_hi);
    }
    store_outputs<EPI>(args, c, tile * bm + tt * 8, row_tile, g, t);
  }
}

// [TAG_DECODE_GEMM2_OCCUPANCY] The GEMM2 row-tile kernel with 3 chunks a warp (K = 768:
// Qwen3-30B-A3B; the kDownStore epilogue) at 8 blocks per SM (a 64-register cap) instead of 5 (87
// registers), for nvfp4 (ptxas -v: 4 bytes of spill) and the int formats' group-128 instances (no
// spill; the run-time-group instances would spill 24-68 bytes and keep 5 blocks). Its warps hold
// 48 bytes of weights a lane in flight, and ncu at T = 64 (docs/PERF.md run T9) found it waiting
// on them (long_sb 37%, 54% of the HBM rate), so more resident warps put more bytes in flight. Measured (run T10, nvfp4 layer us): T = 8 64.0 -> 63.2, 16 88.1
// -> 85.8, 64 126.8 -> 123.8, 128 168.8 -> 166.0; but T = 1 19.4 -> 21.0 (its 8 token tiles
// gain nothing and the wider GEMM2 crowds GEMM1 under PDL). So from 64 token tiles (8 tokens at
// k = 8) on. MOEBIUS_DECODE_GEMM2_MIN_BLOCKS=3 (any value but 8) keeps the 5-block instance, for
// comparisons.
bool gemm2_wide_occupancy(int grid_tiles) {
  static const bool forced_off = [] {
    const char* v = std::getenv("MOEBIUS_DECODE_GEMM2_MIN_BLOCKS");
    return v != nullptr && v[0] != '\0' && std::atoi(v) != 8;
  }();
  return !forced_off && grid_tiles >= 64;
}

// Row tiles per block for one token tile ([TAG_DECODE_ROW_TILES]). moe_gemm_kernel gives every
// block one 16-row weight tile: at T = 8-64 the grid is 5k-15k short blocks whose fixed costs
// (the dependent chain tile_expert -> expert pointers -> first weights, activation
// staging, reduction) leave the SM's memory pipe idle between them (GEMM1 at T = 8 read 45% of the
// HBM rate; docs/PERF.md run I4). This kernel walks `rows_per_block` consecutive row tiles of one
// expert (contiguous weights) with ONE prologue, and keeps the next row tile's weights in flight
// while it multiplies the current one (two register sets, ping-pong), so each warp streams
// continuously. Only one token tile (block_m 8), activations staged, and a warp's chunk range
// within one batch (P chunks): then a k-step's accumulator set and the reduction order are those
// of moe_gemm_kernel, so the two kernels' outputs are bit-identical.
//
// kExact: every warp has exactly P chunks (chunks == 4 P; Qwen3-30B-A3B: GEMM1 8, GEMM2 3), so
// the chunk guards, their branches and the address arithmetic fold away: the decode GEMM is
// bound by the issue of its instruction stream (docs/PERF.md run K1: ~6.8 cycles per instruction
// per warp at 3-4 warps per scheduler), and GEMM2's 12 mma per warp and row tile carried ~19
// instructions of overhead each. The per-tile epilogue is split over warps 0 and 1 (one token
// column each) and the tile's pair ids are read once per block: warp 0 alone, with a global
// load of the pair ids in every tile, was the slowest warp of each tile.
//
// kGroupK: the int formats' group size when it is 128 (exact instances), so the group flushes
// sit at compile-time k-steps where every warp's P chunks are whole groups (Qwen3-30B-A3B's int4
// and int2 GEMM1), and are tested at chunk starts only otherwise (int4 GEMM2, 3 chunks a warp);
// 0: found at run time from a GroupStarts window ([TAG_INT_GROUP_STARTS]).
//
// W: warps splitting K ([TAG_DECODE_SPLIT_K]): 4, or 8 for GEMM1 where each of 8 warps has exactly
// P = 4 chunks (2 for int2; MoeTiles::split_k_warps), or 6 for the int2 GEMM2 at 6 chunks
// ([TAG_DECODE_INT2_DOWN_WARPS]). At T = 1 GEMM1 is bound by its warps' issue latency at
// 3 warps per scheduler (docs/PERF.md runs U6, U8: 0.35 instructions a cycle, DRAM 31%); 8 warps
// of half the K range each put 4 warps on a scheduler at 2 blocks per SM, with half the dependent
// instruction chain per warp and the same bytes per row tile in flight. Another reduction order
// (8 partials), so not bit-identical to W = 4; run to run it is.
template <MoeWeightFormat F, Epilogue EPI, int P, bool kExact, int kGroupK = 0, int kMinBlocks = 3, int W = kWarps>
__global__ void __launch_bounds__(W * 32, kMinBlocks) moe_gemm_rows_kernel(const GemmKernelArgs args, int rows_per_block) {
  constexpr int kBlockSize = W * 32;
  constexpr int KC = kChunkK<F>;
  constexpr bool kIsIntF = kIsInt<F>;
  static_assert(kGroupK == 0 || (kIsIntF && kExact && kGroupK % 16 == 0), "a compile-time group size: exact int instances");
  // Warp ranges start on group boundaries. (The divisor is never 0: nvcc warns on the % even behind kGroupK > 0.)
  constexpr bool kAlignedGroups = kGroupK > 0 && (P * KC) % (kGroupK > 0 ? kGroupK : 1) == 0;
  constexpr int kSets = 2;
  const int tile = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const MoeGemmDims& d = args.dims;
  const int rt_begin = blockIdx.x * rows_per_block;
  const int rt_end = min(rt_begin + rows_per_block, d.row_tiles);

  __shared__ float partial[2][W][32][4];  // double-buffered by row-tile parity: one sync per tile
  __shared__ const __nv_bfloat16* s_row_src[8];
  __shared__ int s_pair[8];
  extern __shared__ __align__(16) unsigned char s_dyn[];
  __nv_bfloat16* s_act = reinterpret_cast<__nv_bfloat16*>(s_dyn);
  // Int formats: the group scales of all this block's row tiles, [tiles][groups][16] fp16 (the
  // tile layout stores consecutive row tiles' scales contiguously).
  const __half* s_group_scales = reinterpret_cast<const __half*>(s_dyn + args.group_scale_offset);
  const int c_begin = kExact ? warp * P : (d.chunks * warp) / W;
  const int c_end = kExact ? c_begin + P : (d.chunks * (warp + 1)) / W;
  ExpertMatrixPtrs ptrs;
  uint4 wa[P], wb[P];
  uint2 sa[P], sb[P];
  auto load_tile = [&](uint4 (&wv)[P], uint2 (&sv)[P], int rt) {
    const uint4* wbase = static_cast<const uint4*>(ptrs.weight) + static_cast<int64_t>(rt) * d.chunks * 32 + lane;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int c = c_begin + p;
      if (kExact || c < c_end) {
        wv[p] = load_weights(wbase + static_cast<int64_t>(c) * 32);
        if constexpr (F == MoeWeightFormat::kNvFp4)
          sv[p] = __ldg(static_cast<const uint2*>(ptrs.scales) + (static_cast<int64_t>(rt) * d.chunks + c) * 8 + g);
      }
    }
  };
  constexpr bool kWeightsBeforeWait = EPI != Epilogue::kGateUp;  // as in moe_gemm_kernel
  auto start = [&]() -> bool {
    const int expert = args.tiles.tile_expert[tile];
    if (expert < 0) return false;  // [TAG_MOE_GRAPH_CAPACITY]
    ptrs = args.experts[expert];
    load_tile(wa, sa, rt_begin);
    if constexpr (kIsIntF) {
      const int bytes = (rt_end - rt_begin) * d.groups * 32;
      const char* src = static_cast<const char*>(ptrs.scales) + static_cast<int64_t>(rt_begin) * d.groups * 32;
      const uint32_t dst = smem_u32(s_dyn + args.group_scale_offset);
      for (int off = threadIdx.x * 4; off < bytes; off += kBlockSize * 4) cp_async4(dst + off, src + off);
      cp_async_commit();
    }
    return true;
  };
  if constexpr (kWeightsBeforeWait) {
    if (!start()) return;
    pdl_wait();
    pdl_launch_dependents();
  } else {
    pdl_wait();
    pdl_launch_dependents();
    if (!start()) return;
  }

  const int bm = args.tiles.block_m;
  if (threadIdx.x < 8) {
    const int pos = tile * bm + threadIdx.x;
    const int pair = args.tiles.padded_pair_ids[pos];
    s_pair[threadIdx.x] = pair;
    const int64_t row = EPI == Epilogue::kGateUp ? pair / args.tiles.top_k : pos;
    if (threadIdx.x < args.stage_rows)
      s_row_src[threadIdx.x] = pair < 0 ? nullptr : args.act_in + row * static_cast<int64_t>(args.in_stride);
  }
  __syncthreads();  // s_row_src, s_pair
  stage_activations<KC, W>(args, s_row_src, s_act, warp, lane);
  cp_async_wait<0>();  // the activations (and the int group scales)
  __syncthreads();
  const int r = g < args.stage_rows ? g : 0;  // padding rows read row 0 (see moe_gemm_kernel)
  const __nv_bfloat16* b_row = s_act + r * args.stage_stride + 2 * t;
  const float gs_lo = F == MoeWeightFormat::kNvFp4 ? ptrs.global_scale[0] * kNvFp4AccScale : 1.0f;
  const float gs_hi = F == MoeWeightFormat::kNvFp4 ? ptrs.global_scale[1] * kNvFp4AccScale : 1.0f;
  const int my_pair = s_pair[2 * t + (warp & 1)];  // the token column this warp stores (warps 0, 1)
  // [TAG_INT_GROUP_STARTS] Every row tile covers the same K range per warp: one window for all.
  static_assert(P * kSteps<F> <= 64, "a warp's k-steps fit one GroupStarts window");
  const GroupStarts group_starts = group_starts_of<F>(d.group_size);
  const uint64_t starts = kIsIntF ? group_starts.first_window(c_begin * kSteps<F>) : 0ull;
  const int first_group = kIsIntF ? group_starts.group_of(c_begin * kSteps<F>) : 0;

  // One row tile from the registers wv/sv: this warp's partial sums into partial[buf], then the
  // block meets once and warp 0 reduces in warp order and stores.
  auto compute_tile = [&](const uint4 (&wv)[P], const uint2 (&sv)[P], int rt, int buf) {
    float acc[kSets][4], grp[kSets][4];
#pragma unroll
    for (int st = 0; st < kSets; ++st)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[st][i] = grp[st][i] = 0.0f;
    const __half* tile_scales = s_group_scales + (rt - rt_begin) * d.groups * 16;
    int current_group = first_group;
    auto flush_group = [&](int group) {
      const float s_lo = __half2float(tile_scales[group * 16 + g]), s_hi = __half2float(tile_scales[group * 16 + g + 8]);
#pragma unroll
      for (int st = 0; st < kSets; ++st) {
        acc[st][0] += grp[st][0] * s_lo;
        acc[st][1] += grp[st][1] * s_lo;
        acc[st][2] += grp[st][2] * s_hi;
        acc[st][3] += grp[st][3] * s_hi;
#pragma unroll
        for (int i = 0; i < 4; ++i) grp[st][i] = 0.0f;
      }
    };
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int c = c_begin + p;
      if (!kExact && c >= c_end) break;
      const uint2 nv_sc = F == MoeWeightFormat::kNvFp4 ? sv[p] : make_uint2(0, 0);
      auto do_step = [&](auto step_tag) {
        constexpr int S = decltype(step_tag)::value;
        const int set = (p * kSteps<F> + S) % kSets;
        uint32_t a[4];
        dequant_step<F, S, true>(wv[p], nv_sc, a);
        const int k0 = c * KC + S * 16;
        if constexpr (kIsIntF) {
          if (group_starts.opens<kGroupK, KC, kAlignedGroups>(starts, p * kSteps<F> + S)) {
            flush_group(current_group);
            ++current_group;
          }
        }
        const uint32_t* q = reinterpret_cast<const uint32_t*>(b_row + k0);
        if constexpr (kIsIntF) mma_bf16(grp[set], a, q[0], q[4]);
        else mma_bf16(acc[set], a, q[0], q[4]);
      };
      [&]<int... S>(std::integer_sequence<int, S...>) {
        (do_step(std::integral_constant<int, S>{}), ...);
      }(std::make_integer_sequence<int, kSteps<F>>{});
    }
    if constexpr (kIsIntF) {
      if (kExact || c_end > c_begin) flush_group(current_group);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[buf][warp][lane][i] = acc[0][i] + acc[1][i];
    // Warp 0 read this buffer for tile rt - 2 before the sync of tile rt - 1, which every warp
    // passed before these writes: one barrier per tile suffices.
    __syncthreads();
    if (warp < 2) {  // warp j stores token column 2t + j (rows g and g + 8), summed in warp order
      const int j = warp;
      float lo = 0.0f, hi = 0.0f;
#pragma unroll
      for (int w = 0; w < W; ++w) {
        lo += partial[buf][w][lane][j];
        hi += partial[buf][w][lane][2 + j];
      }
      store_output_column<EPI>(args, lo * gs_lo, hi * gs_hi, tile * bm + 2 * t + j, my_pair, rt, g);
    }
  };

  // Ping-pong over the block's row tiles: tile rt + 1's loads go out before tile rt's math.
  for (int rt = rt_begin; rt < rt_end; rt += 2) {
    if (rt + 1 < rt_end) load_tile(wb, sb, rt + 1);
    compute_tile(wa, sa, rt, 0);
    if (rt + 1 >= rt_end) break;
    if (rt + 2 < rt_end) load_tile(wa, sa, rt + 2);
    compute_tile(wb, sb, rt + 1, 1);
  }
}

// Largest activation stage in shared memory: three blocks still fit an SM (228 KB), enough to keep
// the weight loads of 12 warps in flight; a 235B-class GEMM1 (K = 4096, 8 rows) just fits. Larger
// stages (token tiles of 32-64 at K = 2048) read B from global memory instead.
constexpr int kMaxStageBytes = 72 * 1024;

// Row tiles per block of the decode kernel ([TAG_DECODE_ROW_TILES]), from the one-tile grid's
// block count. Measured on the H200 (docs/PERF.md run J1, Qwen3-30B-A3B, rows per block 1/2/4/8
// swept at T = 1-128): nvfp4 GEMM1 and both formats' GEMM2 are fastest at 2 up to ~2 waves of the
// one-tile kernel (T = 1: gemm1 9.97 -> 9.07 us, gemm2 5.04 -> 4.55), 4 up to ~16k blocks
// (T = 8-16) and 8 above (T = 64: gemm1 116 -> 101, gemm2 70 -> 51). The int GEMM1 lost with the
// first row-tile kernel, but since its exact-chunk instances (run K3) the int4 and int2 GEMM1 win
// with the same table: run K4's sweep, whose staging change (reverted) slowed both kernels, had
// int4 gemm1 at T = 1 / 64 on 2 / 8 row tiles at 10.7 / 131 us against 12.7 / 147 for the one-tile
// kernel in run K3 without it (int2: 10.4 / 127 against 11.6 / 146), and run K5 measures the
// switch. The int2 GEMM2 keeps 1 on four warps (K = 768 is 1-2 of its 128-wide chunks per warp:
// 7.1 us at T = 1 on one row tile, 9.5 on two); at exactly 6 chunks it runs six warps and takes
// this table ([TAG_DECODE_INT2_DOWN_WARPS]).
// MOEBIUS_DECODE_ROWS_PER_BLOCK overrides it (an experiment knob for `bench moe`); a layer's
// MoeTiles::rows_per_block (the autotuner's choice) overrides both.
int forced_rows_per_block() {
  static const int forced = [] {
    const char* v = std::getenv("MOEBIUS_DECODE_ROWS_PER_BLOCK");
    return v != nullptr ? std::atoi(v) : 0;
  }();
  return forced;
}

int decode_rows_per_block(bool one_row_tile, int row_tiles, int grid_tiles) {
  if (forced_rows_per_block() > 0) return forced_rows_per_block();
  if (one_row_tile) return 1;
  const int sms = current_device_sm_count();
  const int64_t blocks = static_cast<int64_t>(row_tiles) * grid_tiles;
  const int64_t wave = 6LL * sms;  // the one-tile kernel's resident blocks (kMinBlocksPerSm)
  return blocks <= 2 * wave ? 2 : blocks <= 16 * 1024 ? 4 : 8;
}

std::atomic<int64_t> g_wide_split_launches{0};

// Row tiles per block for the 8-warp GEMM1 ([TAG_DECODE_SPLIT_K]) when the tuner gave none
// (split_k_rows_for_one_wave on this device's SMs). MOEBIUS_DECODE_ROWS_PER_BLOCK overrides it as
// it does decode_rows_per_block.
int split_k_rows_per_block(int row_tiles, int grid_tiles, int blocks_per_sm) {
  if (forced_rows_per_block() > 0) return forced_rows_per_block();
  return split_k_rows_for_one_wave(row_tiles, grid_tiles, blocks_per_sm, current_device_sm_count());
}

template <MoeWeightFormat F, Epilogue EPI>
void launch_for_format(GemmKernelArgs args, bool odd_k, cudaStream_t stream) {
  const dim3 grid(args.dims.row_tiles, args.tiles.grid_tiles);
  const int nt = args.tiles.block_m / 8;
  const int max_rows = args.tiles.max_tile_rows > 0 ? std::min(args.tiles.max_tile_rows, args.tiles.block_m)
                                                     : args.tiles.block_m;
  const int64_t stride = static_cast<int64_t>(args.dims.chunks) * kChunkK<F> + 8;
  const int64_t stage_bytes = max_rows * stride * 2;
  const bool aligned = args.in_stride % 8 == 0 && reinterpret_cast<uintptr_t>(args.act_in) % 16 == 0;
  const bool stage = aligned && stage_bytes <= kMaxStageBytes;
  args.stage_rows = stage ? max_rows : 0;
  args.stage_stride = stage ? static_cast<int>(stride) : 0;
  // Dynamic shared memory: the activation stage, then (int formats) the block's group scales.
  const int64_t act_bytes = stage ? (stage_bytes + 15) / 16 * 16 : 0;
  const int64_t scale_bytes = kIsInt<F> ? static_cast<int64_t>(args.dims.groups) * 32 : 0;
  args.group_scale_offset = static_cast<int>(act_bytes);
  const size_t dyn_bytes = static_cast<size_t>(act_bytes + scale_bytes);
  MOEBIUS_LAUNCH_ASSERT(dyn_bytes <= 200 * 1024, "group scales of one row tile exceed shared memory");
  // The row-tile kernels ([TAG_DECODE_ROW_TILES]): W warps, `rows` row tiles per block (the
  // tuner's choice where it made one, else `fallback`); dynamic shared memory is the activation
  // stage plus the group scales of every row tile of the block.
  auto rows_or = [&](int fallback) { return args.tiles.rows_per_block > 0 ? args.tiles.rows_per_block : fallback; };
  auto go_row_tiles = [&](auto kernel, int warps, int rows) {
    const size_t smem = static_cast<size_t>(act_bytes + scale_bytes * rows);
    MOEBIUS_LAUNCH_ASSERT(smem <= 200 * 1024, "group scales of a block's row tiles exceed shared memory");
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    const dim3 rows_grid((args.dims.row_tiles + rows - 1) / rows, args.tiles.grid_tiles);
    launch_pdl(kernel, rows_grid, dim3(warps * 32), smem, stream, args, rows);
  };
  // [TAG_DECODE_SPLIT_K] GEMM1 with 8 warps splitting K, when asked for and where it applies.
  // int2 (2 chunks a warp) fits 3 blocks an SM: run Z44 (docs/PERF.md, an H100; then behind an
  // environment knob) measured it at T = 1 8.2 -> 7.2 us against 4 warps, but 1.4-2.6 us slower at
  // T = 8-64, so the tuner picks it per token bucket.
  if constexpr (EPI == Epilogue::kGateUp && F != MoeWeightFormat::kBF16) {
    if (nt == 1 && stage && args.tiles.split_k_warps == kSplitKWarpsWide &&
        moe_gemm_gate_up_split_k_applies(F, args.dims.chunks)) {
      constexpr int P = split_k_chunks_per_warp(F);
      // Each instance's default rows per block fill the wave of its own blocks an SM
      // (split_k_blocks_per_sm, also its launch bound).
      auto go_split = [&](auto kernel, int blocks_per_sm) {
        go_row_tiles(kernel, kSplitKWarpsWide,
                     rows_or(split_k_rows_per_block(args.dims.row_tiles, args.tiles.grid_tiles, blocks_per_sm)));
        g_wide_split_launches.fetch_add(1, std::memory_order_relaxed);
      };
      if constexpr (kIsInt<F>) {
        constexpr int kBlocks = split_k_blocks_per_sm(F, 128);
        if (args.dims.group_size == 128)
          return go_split(moe_gemm_rows_kernel<F, EPI, P, true, 128, kBlocks, kSplitKWarpsWide>, kBlocks);
      }
      constexpr int kBlocks = split_k_blocks_per_sm(F, 0);  // the run-time-group instance
      return go_split(moe_gemm_rows_kernel<F, EPI, P, true, 0, kBlocks, kSplitKWarpsWide>, kBlocks);
    }
  }
  if constexpr (F == MoeWeightFormat::kInt2 && EPI != Epilogue::kGateUp) {
    // [TAG_DECODE_INT2_DOWN_WARPS] six warps of one chunk each, every rows-per-block value.
    if (nt == 1 && stage && decode_down_k_warps(F, args.dims.chunks, args.dims.group_size) == kInt2DownWarps) {
      const int rows = rows_or(decode_rows_per_block(false, args.dims.row_tiles, args.tiles.grid_tiles));
      // 6 blocks of 192 threads per SM: ptxas (sm_90a) 48 (atomic) / 56 (store) registers, no spill.
      return go_row_tiles(moe_gemm_rows_kernel<F, EPI, 1, true, 128, 6, kInt2DownWarps>, kInt2DownWarps, rows);
    }
  }
  // [TAG_DECODE_ROW_TILES] Several row tiles per block when the one-tile grid is many waves.
  constexpr int kRowsP = EPI == Epilogue::kGateUp ? 8 : 4;
  const int rows_per_block = rows_or(decode_rows_per_block(F == MoeWeightFormat::kInt2 && EPI != Epilogue::kGateUp,
                                                           args.dims.row_tiles, args.tiles.grid_tiles));
  if (nt == 1 && stage && rows_per_block > 1 && (args.dims.chunks + kWarps - 1) / kWarps <= kRowsP) {
    auto go_rows = [&](auto kernel) { go_row_tiles(kernel, kWarps, rows_per_block); };
    // Exact chunk counts per warp: Qwen3-30B-A3B's GEMM1 (K = 2048: 8; int2 4) and GEMM2 (K = 768: 3).
    // G: the compile-time group size (128, the usual GPTQ/AutoRound export, for the int formats)
    // or 0 (found at run time).
    const bool even = args.dims.chunks % kWarps == 0;
    const int per_warp = args.dims.chunks / kWarps;
    auto go_exact = [&](auto group_k) {
      constexpr int G = decltype(group_k)::value;
      if (!even) return false;
      if (per_warp == kRowsP) go_rows(moe_gemm_rows_kernel<F, EPI, kRowsP, true, G>);
      else if (EPI == Epilogue::kDownStore && per_warp == 3 && (F == MoeWeightFormat::kNvFp4 || G == 128)) {
        // The 8-block instances that fit 64 registers without spilling more than 8 bytes.
        if (gemm2_wide_occupancy(args.tiles.grid_tiles)) go_rows(moe_gemm_rows_kernel<F, EPI, 3, true, G, 8>);
        else go_rows(moe_gemm_rows_kernel<F, EPI, 3, true, G>);
      } else if (EPI != Epilogue::kGateUp && per_warp == 3) go_rows(moe_gemm_rows_kernel<F, EPI, 3, true, G>);
      else if (EPI == Epilogue::kGateUp && per_warp == 4) go_rows(moe_gemm_rows_kernel<F, EPI, 4, true, G>);
      else return false;
      return true;
    };
    bool launched = false;
    if constexpr (kIsInt<F>) launched = args.dims.group_size == 128 && go_exact(std::integral_constant<int, 128>{});
    if (!launched && !go_exact(std::integral_constant<int, 0>{})) go_rows(moe_gemm_rows_kernel<F, EPI, kRowsP, false>);
    return;
  }
  auto go = [&](auto kernel, size_t smem) {
    // Static plus dynamic shared memory above 48 KB needs the opt-in; set it for every staged
    // launch (the static arrays grow with the token tile).
    if (smem > 0) CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    launch_pdl(kernel, grid, dim3(kThreads), smem, stream, args);
  };
  // Group 128 with one staged token tile: the int2 GEMM2 at other than 6 chunks (one row tile per block) and K ranges
  // longer than the row-tile kernel's (Qwen3-235B-A22B's int4 GEMM1, K = 4096).
  if constexpr (kIsInt<F> && 128 % kChunkK<F> == 0) {
    if (nt == 1 && stage && args.dims.group_size == 128) return go(moe_gemm_kernel<F, 1, EPI, false, true, 128>, dyn_bytes);
  }
#define MOEBIUS_MOE_GEMM_CASE(NT_)                                                              \
  if (nt == NT_) {                                                                              \
    if (stage) go(moe_gemm_kernel<F, NT_, EPI, false, true>, dyn_bytes);                       \
    else if (odd_k) go(moe_gemm_kernel<F, NT_, EPI, true, false>, dyn_bytes);                  \
    else go(moe_gemm_kernel<F, NT_, EPI, false, false>, dyn_bytes);                            \
    return;                                                                                     \
  }
  // Token tiles per block: 8 tokens for decode, up to 64 to reuse each dequantized fragment.
  MOEBIUS_MOE_GEMM_CASE(1)
  MOEBIUS_MOE_GEMM_CASE(2)
  MOEBIUS_MOE_GEMM_CASE(4)
  MOEBIUS_MOE_GEMM_CASE(8)
#undef MOEBIUS_MOE_GEMM_CASE
  MOEBIUS_LAUNCH_ASSERT(false, "block_m must be 8, 16, 32 or 64");
}

template <Epilogue EPI>
void launch(MoeWeightFormat format, const GemmKernelArgs& args, bool odd_k, cudaStream_t stream) {
  if (args.tiles.grid_tiles == 0 || args.dims.row_tiles == 0) return;
  switch (format) {
    case MoeWeightFormat::kBF16: return launch_for_format<MoeWeightFormat::kBF16, EPI>(args, odd_k, stream);
    case MoeWeightFormat::kNvFp4: return launch_for_format<MoeWeightFormat::kNvFp4, EPI>(args, odd_k, stream);
    case MoeWeightFormat::kInt4: return launch_for_format<MoeWeightFormat::kInt4, EPI>(args, odd_k, stream);
    case MoeWeightFormat::kInt2: return launch_for_format<MoeWeightFormat::kInt2, EPI>(args, odd_k, stream);
  }
}

void check_dims(MoeWeightFormat format, const MoeGemmDims& d, const MoeTiles& tiles) {
  MOEBIUS_LAUNCH_ASSERT(d.row_tiles >= 0 && d.k > 0 && d.chunks > 0 && d.n_out > 0, "bad GEMM dims");
  MOEBIUS_LAUNCH_ASSERT(tiles.top_k >= 1 && tiles.grid_tiles <= 65535, "grid_tiles must fit grid.y");
  if (format == MoeWeightFormat::kInt4 || format == MoeWeightFormat::kInt2)
    MOEBIUS_LAUNCH_ASSERT(d.group_size > 0 && d.group_size % 16 == 0 && d.groups > 0,
                          "int formats need a group size that is a multiple of 16");
}

}  // namespace

int64_t moe_gemm_wide_split_launches() { return g_wide_split_launches.load(std::memory_order_relaxed); }

bool moe_gemm_gate_up_split_k_applies(MoeWeightFormat format, int chunks) {
  return format != MoeWeightFormat::kBF16 && chunks == kSplitKWarpsWide * split_k_chunks_per_warp(format);
}

void launch_moe_gemm_gate_up(MoeWeightFormat format, const ExpertMatrixPtrs* experts, const MoeGemmDims& dims,
                             const MoeTiles& tiles, const __nv_bfloat16* x, int x_stride,
                             const MoeActivationParams& act, __nv_bfloat16* h, int h_stride, cudaStream_t stream) {
  check_dims(format, dims, tiles);
  GemmKernelArgs a{};
  a.experts = experts;
  a.dims = dims;
  a.tiles = tiles;
  a.act_in = x;
  a.in_stride = x_stride;
  a.act = act;
  a.h_out = h;
  a.h_stride = h_stride;
  launch<Epilogue::kGateUp>(format, a, (dims.k & 1) || (x_stride & 1), stream);
}

void launch_moe_gemm_down(MoeWeightFormat format, const ExpertMatrixPtrs* experts, const MoeGemmDims& dims,
                          const MoeTiles& tiles, const __nv_bfloat16* h, int h_stride, MoeCombineMode mode,
                          float* y, int y_stride, const float* topk_weights, __nv_bfloat16* out, int out_stride,
                          cudaStream_t stream) {
  check_dims(format, dims, tiles);
  GemmKernelArgs a{};
  a.experts = experts;
  a.dims = dims;
  a.tiles = tiles;
  a.act_in = h;
  a.in_stride = h_stride;
  a.y = y;
  a.y_stride = y_stride;
  a.topk_weights = topk_weights;
  a.out = out;
  a.out_stride = out_stride;
  const bool odd = (dims.k & 1) || (h_stride & 1);
  MOEBIUS_LAUNCH_ASSERT(mode != MoeCombineMode::kStoreBf16, "bf16 y rows: the wgmma GEMM2 only");
  if (mode == MoeCombineMode::kStore) launch<Epilogue::kDownStore>(format, a, odd, stream);
  else launch<Epilogue::kDownAtomic>(format, a, odd, stream);
}

}  // namespace moebius::kernels
