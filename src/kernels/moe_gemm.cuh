// Grouped expert GEMMs with in-kernel dequantization, for the fused MoE layer. Launchers only.
//
// Both GEMMs run over the "tiles" that launch_moe_align (moe_route.cuh) produces: each tile is
// block_m consecutive entries of padded_pair_ids, all routed to one expert (tile_expert[j]), with
// -1 marking padding. Activations are gathered through the pair ids: no permuted copy of x.
//
//   GEMM1 (gate_up): for tile j, expert e, padded position pos = j*block_m + r, pair p = ids[pos]:
//     g_i = W_gate[e][i] . x[p / top_k],  u_i = W_up[e][i] . x[p / top_k]
//     h[pos][i] = bf16(act(g_i, u_i))                              (SwiGLU fused in registers)
//   GEMM2 (down), same tiles:
//     kStore:  y[p][n] = W_down[e][n] . h[pos]                     fp32, unweighted; the combine
//              (moe_combine.cuh) applies the routed weights in fixed slot order: deterministic.
//     kAtomic: out[p / top_k][n] += bf16(w[p] * (W_down[e][n] . h[pos]))   opt-in, not
//              deterministic (bf16 atomics in arrival order).
//
// Weights are in the tile layout of src/moe/expert_layout.h ([TAG_EXPERT_TILE_LAYOUT]) and are
// reached through a per-expert pointer table ([TAG_EXPERT_PTR_TABLE]), so an expert may live in
// device memory or in mapped pinned host memory, and changing residency is a table write.
// [TAG_MOE_GRAPH_CAPACITY] Grids are sized from host capacities; tiles whose tile_expert is -1
// exit at once, so one captured graph serves every token count up to the capacity.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moebius::kernels {

// Mirrors moebius::moe::KernelFormat (kernels do not depend on moe/).
enum class MoeWeightFormat : uint8_t { kBF16, kNvFp4, kInt4, kInt2 };

// [TAG_EXPERT_PTR_TABLE] One expert's matrix: device or mapped-pinned addresses.
struct ExpertMatrixPtrs {
  const void* weight = nullptr;   // tile layout, 16-byte aligned
  const void* scales = nullptr;   // nvfp4: u5m3 scale-code tiles (8-byte aligned); int: fp16 tiles (4-byte aligned); bf16: null
  float global_scale[2] = {1.0f, 1.0f};  // NVFP4 scale_2 of tile rows 0-7 and 8-15
};

struct MoeGemmDims {
  int row_tiles = 0;   // rows_padded / 16 (GEMM1: 2 * ceil(I/8); GEMM2: ceil(H/16))
  int k = 0;           // logical K: activations are read for k < K only
  int chunks = 0;      // cols_padded / chunk_k
  int groups = 0;      // int formats: scale groups along K
  int group_size = 0;  // int formats: K elements per scale, a multiple of 16
  int n_out = 0;       // logical output columns written (GEMM1: I, GEMM2: H)
};

struct MoeTiles {
  const int32_t* padded_pair_ids = nullptr;  // [max_padded]  from launch_moe_align
  const int32_t* tile_expert = nullptr;      // [>= grid_tiles]
  int block_m = 8;      // tokens per tile: 8, 16, 32 or 64 (decode); 64 or 128 (moe_gemm_prefill.cuh)
  int grid_tiles = 0;   // tiles the grid covers (an upper bound on the live tile count)
  int top_k = 1;
  // Rows of a tile that can ever be live: min(block_m, capacity), since a token meets an expert at
  // most once. 0 means block_m. The decode GEMM stages only these rows of activations in shared
  // memory (capacity 1 decode: 1 row, not 8).
  int max_tile_rows = 0;
  // Decode kernel with one token tile (block_m 8): 16-row weight tiles per block
  // ([TAG_DECODE_ROW_TILES]); 0 = the launcher's heuristic. Ignored where the row-tile kernel does
  // not apply (larger token tiles, unstaged activations, a warp's K range over one load batch).
  int rows_per_block = 0;
  // [TAG_DECODE_SPLIT_K] Warps splitting K in the decode GEMM1 with one token tile: 0 or 4 (the
  // default), or kSplitKWarpsWide where moe_gemm_gate_up_split_k_applies (elsewhere it runs as 4).
  // 8 warps reduce their partials in another order than 4: close, not bit-identical.
  int split_k_warps = 0;
  // wgmma prefill kernel: two zeroed ints of device memory for its dynamic work-item schedule
  // (moe_gemm_wgmma.cu; the kernel leaves them zeroed again), or null for the static schedule.
  // One pair per launch in flight: launches that may overlap need their own pairs.
  int32_t* work_counter = nullptr;
};

enum class MoeActivation : uint8_t { kSiLU, kSiLUClamped, kGptOss };
struct MoeActivationParams {
  MoeActivation kind = MoeActivation::kSiLU;
  float limit = 7.0f;
  float alpha = 1.702f;
};

// kStore: GEMM2 stores each pair's fp32 row into y, the combine kernel sums them (deterministic).
// kAtomic: GEMM2 adds w * row into the bf16 output with atomics (opt-in, not deterministic).
// kStoreBf16 ([TAG_MOE_BF16_Y]): as kStore with y held in bf16 (half the bytes of the y round trip,
// which is ~11% of the layer at T = 4096); y points to bf16 storage. The wgmma GEMM2 only.
enum class MoeCombineMode : uint8_t { kStore, kAtomic, kStoreBf16 };

// [TAG_DECODE_INT2_DOWN_WARPS] Warps splitting K in the decode GEMM2 with one staged token tile:
// int2 at exactly 6 chunks of 128 k (Qwen3-30B-A3B's K = 768) with group 128 runs 6 warps of one
// chunk each on the row-tile kernel; everything else 4. With 4 warps the 6 chunks split 2, 2, 1, 1
// (a tile's critical path two chunks, half the block idle for one), and int2's GEMM2 ran the
// one-tile kernel with no next tile in flight: run Z43 (docs/PERF.md, an H100) measured that GEMM2
// at 29.0 / 47.0 / 73.3 us for T = 8 / 16 / 64 against 17.1 / 26.1 / 36.0 on six warps. The
// fused experts kernel (moe_fused_experts.cu) sums its GEMM2 partials in the same order.
// Qwen3-235B-A22B's K = 1536 (12 chunks) on six warps of two is on branch int2-down-twelve-chunks:
// measured faster (docs/PERF.md run Z45), its GPU tests not yet run.
inline constexpr int kInt2DownWarps = 6;
constexpr int decode_down_k_warps(MoeWeightFormat format, int chunks, int group_size) {
  return format == MoeWeightFormat::kInt2 && chunks == kInt2DownWarps && group_size == 128 ? kInt2DownWarps : 4;
}

// [TAG_DECODE_SPLIT_K] The wide split of the decode GEMM1: 8 warps of exactly 4 chunks each for
// nvfp4 and int4 (K = 2048, Qwen3-30B-A3B's hidden size: 32 chunks of 64 k) and 2 each for int2
// (16 chunks of 128 k), with one token tile and staged activations (checked at launch; otherwise
// the 4-warp kernels run).
inline constexpr int kSplitKWarpsWide = 8;
constexpr int split_k_chunks_per_warp(MoeWeightFormat format) { return format == MoeWeightFormat::kInt2 ? 2 : 4; }
bool moe_gemm_gate_up_split_k_applies(MoeWeightFormat format, int chunks);
// Blocks an SM each 8-warp GEMM1 instance is built for (its __launch_bounds__): int2 at group 128
// (two chunks a warp, 74-76 registers) fits 3; every other instance, the run-time-group ones
// included, 2.
constexpr int split_k_blocks_per_sm(MoeWeightFormat format, int group_size) {
  return format == MoeWeightFormat::kInt2 && group_size == 128 ? 3 : 2;
}
// The 8-warp GEMM1's default row tiles per block (1, 2, 4 or 8) when the tuner gave none: the
// fewest whose grid fits one wave of `blocks_per_sm` blocks on each of `sms` SMs (Qwen3-30B-A3B
// at T = 1: 96 row tiles x 9 grid tiles -> 4 a block, 216 blocks on 264 slots at 2 an SM on 132
// SMs). Not measured: the autotuner sweeps it.
constexpr int split_k_rows_for_one_wave(int row_tiles, int grid_tiles, int blocks_per_sm, int sms) {
  const int64_t wave = static_cast<int64_t>(blocks_per_sm) * sms;
  for (int rows = 1; rows < 8; rows *= 2)
    if (static_cast<int64_t>((row_tiles + rows - 1) / rows) * grid_tiles <= wave) return rows;
  return 8;
}
// Launches of the 8-warp GEMM1 since the process started (tests check that it ran, since its
// output differs from the 4-warp kernel's by summation order only).
int64_t moe_gemm_wide_split_launches();

// x: [T, x_stride] bf16 (16-byte aligned rows not required). h: [max_padded, h_stride] bf16.
void launch_moe_gemm_gate_up(MoeWeightFormat format, const ExpertMatrixPtrs* experts, const MoeGemmDims& dims,
                             const MoeTiles& tiles, const __nv_bfloat16* x, int x_stride,
                             const MoeActivationParams& act, __nv_bfloat16* h, int h_stride, cudaStream_t stream);

// kStore: y [capacity * top_k, y_stride] fp32, rows of live pairs written (columns < n_out).
// kAtomic: out [capacity, out_stride] bf16 accumulated into (the caller zeroes it first);
//          topk_weights [capacity * top_k] fp32.
void launch_moe_gemm_down(MoeWeightFormat format, const ExpertMatrixPtrs* experts, const MoeGemmDims& dims,
                          const MoeTiles& tiles, const __nv_bfloat16* h, int h_stride, MoeCombineMode mode,
                          float* y, int y_stride, const float* topk_weights, __nv_bfloat16* out, int out_stride,
                          cudaStream_t stream);

// Live tiles never exceed this for `capacity` tokens. Callers take the min with
// moe_align_max_tiles, the length of tile_expert, which is tighter for large block_m:
// sum_e ceil(c_e / m) <= sum_e (c_e / m + [c_e > 0]) <= T*k / m + min(E, T*k).
inline int64_t moe_gemm_grid_tiles(int64_t capacity, int top_k, int num_experts, int block_m) {
  const int64_t pairs = capacity * top_k;
  return pairs / block_m + (pairs < num_experts ? pairs : num_experts);
}

}  // namespace moebius::kernels
