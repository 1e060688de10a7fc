// Grouped expert GEMMs for prefill: block-tiled mma.sync m16n8k16 over a multi-stage cp.async
// pipeline, with the weights dequantized in registers (kernels/moe_dequant.cuh).
//
// Shapes (Qwen3-30B-A3B at T = 4096: H=2048, I=768, E=128, k=8, ~256 tokens per expert):
//   GEMM1: rows = 2*I = 1536 (96 row tiles, gate/up interleaved by 8), K = H = 2048
//   GEMM2: rows = H = 2048 (128 row tiles), K = I = 768
//
// Block tile: 256 weight rows (16 row tiles) x BN tokens (BN = block_m = 64 or 128), all of K.
// 8 warps, each owns 2 row tiles (32 rows) x all BN tokens: per k-step (16 deep) a warp
// dequantizes 2 A fragments and loads BN/16 ldmatrix.x4 B fragments, then issues 2 * BN/8 mma
// (16 at BN = 64, 32 at BN = 128). Why this split:
//   - Every weight row tile belongs to exactly one warp, so each fragment is dequantized ONCE
//     per block (no redundant dequant across warps, which is what costs int2/nvfp4 issue slots),
//     and each dequantized fragment feeds BN/8 mma.
//   - Every B fragment (ldmatrix.x4 = two n8 tiles) feeds 2 row tiles x 2 = 4 mma. Shared-memory
//     traffic per k-step and warp: BN * 32 B of B + 2 x (512 / steps-per-chunk) B of A, about
//     144 B per mma at BN = 64 (the SM's 128 B/clk covers ~0.9 mma/clk, above what mma.sync
//     sustains on Hopper, so shared memory is not the limit).
//   - L2 -> SM bytes per flop: a block reads 256 x K weights and BN x K activations for
//     2 x 256 x BN x K flops: 256 flops per weight byte at BN = 64 in nvfp4/int4 (the L2 does
//     not limit), but only 64 per byte in bf16, which is why bf16 uses BN = 128 when the
//     expected tokens per expert allow it (moe_layer_cuda.cpp).
//   - 256 rows divides 2*I and H of every Qwen3/DeepSeek MoE (1536, 2048, 3072, 4096, 7168);
//     smaller matrices leave warps idle past row_tiles (they still help stage data).
// Pipeline: one stage = 64 k (int2: 128, one chunk) of the block's 16 weight tiles (8 KiB; bf16
// 32 KiB), the nvfp4 block scales (1 KiB) and the BN gathered activation rows (BN x 128 B, or
// 256 B for int2). Stages: as many as fit in 192 KiB, at most 6 (bf16: 4, the others 6), so
// 5 stages of loads (320 k) are in flight while one is computed; one __syncthreads per stage.
// Activation rows are gathered straight from x (GEMM1: row pair / top_k) or h (GEMM2: row =
// padded position) with 16-byte cp.async; pair id -1 and k >= K are zero-filled by the copy
// itself (src-size < 16), so padded tokens and padded K columns meet zeros. Shared rows are
// XOR-swizzled in 16-byte units (piece ^ (row & 7)) so the 8 row addresses of each ldmatrix
// phase fall in 8 distinct bank groups (rows are 128 or 256 B: unswizzled, an 8-way conflict).
// Weight chunks are copied verbatim: lane l's 16 bytes sit at l*16 of each 512-byte chunk, so
// the ld.shared.v4 of a warp is conflict-free and already the A fragment layout.
// Dequant and scales: as the decode kernel (moe_dequant.cuh): int4/int2 exact integers with the
// fp16 group scale applied to a per-group fp32 accumulator at each group end (exact; costs a
// second accumulator set, so int formats run at BN = 64 only); nvfp4 block scale in bf16, global
// scale on the final accumulator; bf16 as is.
// Odd shapes: K need not be a multiple of 8 (partial 16-byte copies zero-fill past K). Activation
// rows that are not 16-byte aligned (x_stride % 8 != 0, GEMM1 only) are gathered with 2-byte
// loads and stored to shared memory synchronously (kAlignedB = false): slower, same results. GEMM2
// reads the layer's own h, whose stride is a multiple of 16 elements.
// Determinism: each output element is one thread's fixed-order sum over K; no split-K, no
// atomics in kStore mode: bit-identical reruns.
// Resources (nvcc 13.0, -O3, sm_90a, -Xptxas -v; 0 bytes stack frame, 0 spill stores or loads in
// every instance; 1 barrier), registers per thread, one block of 256 threads per SM:
//   BN = 64:  bf16 155, nvfp4 140, int4 192-194, int2 196-198 (the int formats carry the second
//             accumulator set: 64 + 64 fp32 per thread)
//   BN = 128: bf16 241, nvfp4 216-220 (128 fp32 accumulators per thread)
// Shared memory per block (dynamic, stages x stage bytes): bf16 BN=64 4 x 40 KiB, BN=128 4 x 48 KiB;
// nvfp4 6 x 17 KiB (BN=128: 6 x 25 KiB); int4 6 x 16 KiB; int2 6 x 24 KiB; plus <= 2 KiB static.
// PTX per unrolled stage (nvcc -ptx): 64 mma + 16 ldmatrix.x4 at BN = 64 (int2's 128-k stage:
// 128 + 32; BN = 128: 128 + 32), i.e. each ldmatrix.x4 feeds 4 mma. The SASS mix (HMMA density
// against SHF/LOP3/HMUL2 of the dequant) has not been inspected: this machine has no cuobjdump;
// docs/MOE_KERNELS.md gives the command. Estimate for nvfp4 at BN = 64, per warp and k-step:
// 16 HMMA against ~45 other instructions (2 SHF + 1 LOP3 + 1 HMUL2 per A register, 4 LDSM,
// block-scale lookups), which leaves issue slots to spare at mma.sync's Hopper rate.
#include "kernels/moe_gemm_prefill.cuh"

#include <utility>

#include "kernels/cuda_check.h"
#include "kernels/pdl.cuh"
#include "kernels/moe_dequant.cuh"

namespace moebius::kernels {

namespace {

using namespace moe_detail;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kWarpRowTiles = 2;                         // m16 tiles per warp
constexpr int kBlockRowTiles = kWarps * kWarpRowTiles;   // 16 tiles = 256 weight rows
constexpr int kChunkBytes = 512;                         // one tile chunk: 32 lanes x 16 B

// K per pipeline stage: a whole number of chunks, and at least 64 so a stage amortizes its
// barrier over 4+ k-steps.
template <MoeWeightFormat F>
constexpr int kStageK = kChunkK<F> > 64 ? kChunkK<F> : 64;
template <MoeWeightFormat F>
constexpr int kStageChunks = kStageK<F> / kChunkK<F>;
template <MoeWeightFormat F>
constexpr int kStageSteps = kStageK<F> / 16;

template <MoeWeightFormat F, int BN>
struct StageLayout {
  static constexpr int kWeights = kBlockRowTiles * kStageChunks<F> * kChunkBytes;        // [16][chunks][512 B]
  static constexpr int kScales = F == MoeWeightFormat::kNvFp4 ? kBlockRowTiles * 64 : 0;  // [16][8 g][8 B]
  static constexpr int kActs = BN * kStageK<F> * 2;                                       // [BN][stage K] bf16
  static constexpr int kBytes = kWeights + kScales + kActs;
  static constexpr int kStages = (192 * 1024) / kBytes < 6 ? (192 * 1024) / kBytes : 6;
  static constexpr int kTotal = kStages * kBytes;
  static_assert(kStages >= 3, "the pipeline needs at least 3 stages");
  static_assert(kWeights % 128 == 0 && kScales % 128 == 0, "16-byte alignment of the stage parts");
};

template <MoeWeightFormat F, int BN, Epilogue EPI, bool kAlignedB>
__global__ void __launch_bounds__(kThreads, 1) moe_gemm_prefill_kernel(const GemmKernelArgs args) {
  using L = StageLayout<F, BN>;
  constexpr int KS = kStageK<F>;
  constexpr int kRowBytes = KS * 2;          // one activation row of a stage
  constexpr int kRowPieces = KS / 8;         // its 16-byte pieces
  constexpr int NT = BN / 8;                 // n8 token tiles per warp (all of the block's tokens)
  constexpr int kActPieces = BN * kRowPieces / kThreads;
  constexpr int kWeightPieces = kBlockRowTiles * kStageChunks<F> * 32 / kThreads;
  constexpr bool kInt = kIsInt<F>;
  static_assert(kThreads % kRowPieces == 0 && (BN * kRowPieces) % kThreads == 0, "activation copy split");
  static_assert((kBlockRowTiles * kStageChunks<F> * 32) % kThreads == 0, "weight copy split");

  pdl_wait();  // tile_expert / pair ids (align) and the activations (previous stage); pdl.cuh
  pdl_launch_dependents();
  const int tile = blockIdx.y;
  const int expert = args.tiles.tile_expert[tile];
  if (expert < 0) return;  // [TAG_MOE_GRAPH_CAPACITY] past the live tiles

  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int32_t pair_ids[BN];
  __shared__ const __nv_bfloat16* act_rows[BN];  // gathered row of each token slot, or null

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const MoeGemmDims& d = args.dims;
  const int row_tile0 = blockIdx.x * kBlockRowTiles;

  for (int r = tid; r < BN; r += kThreads) {
    const int pos = tile * BN + r;
    const int pair = args.tiles.padded_pair_ids[pos];
    pair_ids[r] = pair;
    const int64_t row = EPI == Epilogue::kGateUp ? pair / args.tiles.top_k : pos;
    act_rows[r] = pair < 0 ? nullptr : args.act_in + row * static_cast<int64_t>(args.in_stride);
  }
  __syncthreads();

  const ExpertMatrixPtrs ptrs = args.experts[expert];
  const uint8_t* wglobal = static_cast<const uint8_t*>(ptrs.weight);
  const int num_stages_k = (d.chunks + kStageChunks<F> - 1) / kStageChunks<F>;
  const int act_piece = tid % kRowPieces;  // the same piece column for all of this thread's rows

  // Enqueue the copies of k-stage ks into ring slot `slot`.
  auto issue_stage = [&](int ks, int slot) {
    uint8_t* base = smem + slot * L::kBytes;
    // Weights: tile-major, the stage's chunks of a tile are contiguous in global memory.
#pragma unroll
    for (int i = 0; i < kWeightPieces; ++i) {
      const int p = tid + i * kThreads;  // lane of the piece = tid % 32
      const int tl = p / (kStageChunks<F> * 32), c = (p / 32) % kStageChunks<F>;
      const int rt = row_tile0 + tl, chunk = ks * kStageChunks<F> + c;
      const bool ok = rt < d.row_tiles && chunk < d.chunks;
      const uint8_t* src = wglobal + ((static_cast<int64_t>(rt) * d.chunks + chunk) * 32 + lane) * 16;
      cp_async16(smem_u32(base + p * 16), ok ? src : wglobal, ok ? 16 : 0);
    }
    if constexpr (F == MoeWeightFormat::kNvFp4) {  // one chunk per stage: 64 B per tile
      if (tid < kBlockRowTiles * 4) {
        const int rt = row_tile0 + tid / 4;
        const bool ok = rt < d.row_tiles;
        const uint8_t* src = static_cast<const uint8_t*>(ptrs.scales) +
                             (static_cast<int64_t>(rt) * d.chunks + ks) * 64 + (tid % 4) * 16;
        cp_async16(smem_u32(base + L::kWeights + tid * 16), ok ? src : wglobal, ok ? 16 : 0);
      }
    }
    // Activations: row r of the stage holds k in [ks*KS, ks*KS + KS), piece q at (q ^ (r & 7)).
    uint8_t* acts = base + L::kWeights + L::kScales;
    const int k = ks * KS + act_piece * 8;
#pragma unroll
    for (int i = 0; i < kActPieces; ++i) {
      const int r = (tid + i * kThreads) / kRowPieces;
      const __nv_bfloat16* row = act_rows[r];
      uint8_t* dst = acts + r * kRowBytes + ((act_piece ^ (r & 7)) * 16);
      if constexpr (kAlignedB) {
        const int bytes = row == nullptr ? 0 : max(0, min(16, 2 * (d.k - k)));
        cp_async16(smem_u32(dst), bytes > 0 ? static_cast<const void*>(row + k) : wglobal, bytes);
      } else {
        // Unaligned rows: 2-byte loads, stored synchronously. The slot is not read before the
        // __syncthreads that precedes its compute, like the async path.
        uint32_t v[4] = {0, 0, 0, 0};
        if (row != nullptr) {
          const uint16_t* r16 = reinterpret_cast<const uint16_t*>(row);
#pragma unroll
          for (int e = 0; e < 8; ++e)
            if (k + e < d.k) v[e >> 1] |= static_cast<uint32_t>(__ldg(r16 + k + e)) << (16 * (e & 1));
        }
        *reinterpret_cast<uint4*>(dst) = make_uint4(v[0], v[1], v[2], v[3]);
      }
    }
  };

  // This warp's row tiles.
  int my_rt[kWarpRowTiles];
  bool my_ok[kWarpRowTiles];
#pragma unroll
  for (int m = 0; m < kWarpRowTiles; ++m) {
    my_rt[m] = row_tile0 + warp * kWarpRowTiles + m;
    my_ok[m] = my_rt[m] < d.row_tiles;
  }

  float acc[kWarpRowTiles][NT][4];
  float grp[kWarpRowTiles][NT][4];  // int formats: the current group's unscaled sums (else unused)
#pragma unroll
  for (int m = 0; m < kWarpRowTiles; ++m)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][n][i] = 0.0f;
  if constexpr (kInt) {
#pragma unroll
    for (int m = 0; m < kWarpRowTiles; ++m)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) grp[m][n][i] = 0.0f;
  }

  // Int formats: the fp16 group scales of rows g and g+8 of each tile, for the current group,
  // loaded one group ahead of the flush that uses them.
  float sc_lo[kWarpRowTiles] = {}, sc_hi[kWarpRowTiles] = {};
  int group = 0, group_steps_left = 0;
  const int group_steps = kInt ? d.group_size / 16 : 1;
  auto load_group_scales = [&](int q) {
#pragma unroll
    for (int m = 0; m < kWarpRowTiles; ++m) {
      if (my_ok[m] && q < d.groups) {
        const __half* s = static_cast<const __half*>(ptrs.scales) + (static_cast<int64_t>(my_rt[m]) * d.groups + q) * 16;
        sc_lo[m] = __half2float(__ldg(s + g));
        sc_hi[m] = __half2float(__ldg(s + g + 8));
      }
    }
  };
  auto flush_group = [&]() {
#pragma unroll
    for (int m = 0; m < kWarpRowTiles; ++m)
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        acc[m][n][0] += grp[m][n][0] * sc_lo[m];
        acc[m][n][1] += grp[m][n][1] * sc_lo[m];
        acc[m][n][2] += grp[m][n][2] * sc_hi[m];
        acc[m][n][3] += grp[m][n][3] * sc_hi[m];
#pragma unroll
        for (int i = 0; i < 4; ++i) grp[m][n][i] = 0.0f;
      }
  };
  if constexpr (kInt) {
    group_steps_left = group_steps;
    load_group_scales(0);
  }

  // ldmatrix.x4 row address of this lane: matrices (tokens 0-7, k 0-7), (0-7, 8-15), (8-15, 0-7),
  // (8-15, 8-15) of a 16-token pair of n8 tiles; lanes 8q..8q+7 give matrix q's rows.
  const int lm_row = (lane & 7) + ((lane >> 4) << 3);
  const int lm_khalf = (lane >> 3) & 1;
  const int lm_swz = lane & 7;  // == lm_row & 7: every 16-token block starts at a multiple of 8

  auto compute_stage = [&](int slot) {
    const uint8_t* base = smem + slot * L::kBytes;
    const uint32_t acts = smem_u32(base + L::kWeights + L::kScales) + lm_row * kRowBytes;
    uint4 w[kWarpRowTiles];
    uint2 nv_sc[kWarpRowTiles];
    auto do_step = [&](auto step_tag) {
      constexpr int s = decltype(step_tag)::value;
      constexpr int c = s / kSteps<F>, S = s % kSteps<F>;
      if constexpr (S == 0) {
#pragma unroll
        for (int m = 0; m < kWarpRowTiles; ++m) {
          const int tl = warp * kWarpRowTiles + m;
          w[m] = *reinterpret_cast<const uint4*>(base + (tl * kStageChunks<F> + c) * kChunkBytes + lane * 16);
          if constexpr (F == MoeWeightFormat::kNvFp4)
            nv_sc[m] = *reinterpret_cast<const uint2*>(base + L::kWeights + tl * 64 + g * 8);
        }
      }
      uint32_t a[kWarpRowTiles][4];
#pragma unroll
      for (int m = 0; m < kWarpRowTiles; ++m) {
        dequant_step<F, S>(w[m], F == MoeWeightFormat::kNvFp4 ? nv_sc[m] : make_uint2(0, 0), a[m]);
      }
      const uint32_t b_addr = acts + (((2 * s + lm_khalf) ^ lm_swz) * 16);
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t b0, b1, b2, b3;
        ldmatrix_x4(b_addr + np * 16 * kRowBytes, b0, b1, b2, b3);
#pragma unroll
        for (int m = 0; m < kWarpRowTiles; ++m) {
          if constexpr (kInt) {
            mma_bf16(grp[m][2 * np], a[m], b0, b1);
            mma_bf16(grp[m][2 * np + 1], a[m], b2, b3);
          } else {
            mma_bf16(acc[m][2 * np], a[m], b0, b1);
            mma_bf16(acc[m][2 * np + 1], a[m], b2, b3);
          }
        }
      }
      if constexpr (kInt) {
        if (--group_steps_left == 0) {  // the group ends with this k-step (block-uniform)
          flush_group();
          ++group;
          group_steps_left = group_steps;
          load_group_scales(group);
        }
      }
    };
    [&]<int... s>(std::integer_sequence<int, s...>) {
      (do_step(std::integral_constant<int, s>{}), ...);
    }(std::make_integer_sequence<int, kStageSteps<F>>{});
  };

  // The multi-stage pipeline: kStages - 1 stages in flight ahead of the one being computed.
#pragma unroll
  for (int s = 0; s < L::kStages - 1; ++s) {
    if (s < num_stages_k) issue_stage(s, s);
    cp_async_commit();  // empty groups keep the wait count uniform
  }
  int slot = 0;
  for (int ks = 0; ks < num_stages_k; ++ks) {
    cp_async_wait<L::kStages - 2>();  // stage ks has landed (this thread's copies)
    __syncthreads();                  // ... everyone's, and slot (ks - 1) is free again
    const int next = ks + L::kStages - 1;
    if (next < num_stages_k) issue_stage(next, next % L::kStages);
    cp_async_commit();
    compute_stage(slot);
    slot = slot + 1 == L::kStages ? 0 : slot + 1;
  }
  if constexpr (kInt) {
    if (group_steps_left != group_steps) flush_group();  // K ended inside a group
  }

  // Epilogue: acc[m][n] = {row g, tokens 2t, 2t+1; row g+8, tokens 2t, 2t+1} of tile my_rt[m],
  // n8 token tile n.
  const float gs_lo = F == MoeWeightFormat::kNvFp4 ? ptrs.global_scale[0] * kNvFp4AccScale : 1.0f;
  const float gs_hi = F == MoeWeightFormat::kNvFp4 ? ptrs.global_scale[1] * kNvFp4AccScale : 1.0f;
#pragma unroll
  for (int m = 0; m < kWarpRowTiles; ++m) {
    if (!my_ok[m]) continue;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int r = n * 8 + 2 * t + j;
        const int pair = pair_ids[r];
        store_output_column<EPI>(args, acc[m][n][j] * gs_lo, acc[m][n][2 + j] * gs_hi, tile * BN + r, pair, my_rt[m], g);
      }
    }
  }
}

template <MoeWeightFormat F, int BN, Epilogue EPI, bool kAlignedB>
void launch_kernel(const GemmKernelArgs& args, cudaStream_t stream) {
  using L = StageLayout<F, BN>;
  auto* kernel = &moe_gemm_prefill_kernel<F, BN, EPI, kAlignedB>;
  // Above 48 KiB a block needs the opt-in; this is not a stream operation, so it is legal while
  // a stream is being captured.
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kTotal));
  const dim3 grid((args.dims.row_tiles + kBlockRowTiles - 1) / kBlockRowTiles, args.tiles.grid_tiles);
  launch_pdl(kernel, grid, dim3(kThreads), L::kTotal, stream, args);
}

// The instantiated configurations: BN = 64 for every format; BN = 128 for the formats without
// the int group accumulators (bf16 needs it for L2 intensity, nvfp4 may use it); unaligned
// activation rows for GEMM1 only (x is the caller's; h is the layer's, always aligned).
template <Epilogue EPI, bool kAlignedB>
void launch_aligned(MoeWeightFormat format, const GemmKernelArgs& args, cudaStream_t stream) {
  const int bm = args.tiles.block_m;
  MOEBIUS_LAUNCH_ASSERT(moe_gemm_prefill_supports(format, bm),
                        "prefill GEMM: block_m must be 64, or 128 for bf16 and nvfp4");
  switch (format) {
    case MoeWeightFormat::kBF16:
      if (bm == 128) return launch_kernel<MoeWeightFormat::kBF16, 128, EPI, kAlignedB>(args, stream);
      return launch_kernel<MoeWeightFormat::kBF16, 64, EPI, kAlignedB>(args, stream);
    case MoeWeightFormat::kNvFp4:
      if (bm == 128) return launch_kernel<MoeWeightFormat::kNvFp4, 128, EPI, kAlignedB>(args, stream);
      return launch_kernel<MoeWeightFormat::kNvFp4, 64, EPI, kAlignedB>(args, stream);
    case MoeWeightFormat::kInt4:
      return launch_kernel<MoeWeightFormat::kInt4, 64, EPI, kAlignedB>(args, stream);
    case MoeWeightFormat::kInt2:
      return launch_kernel<MoeWeightFormat::kInt2, 64, EPI, kAlignedB>(args, stream);
  }
}

void check_dims(MoeWeightFormat format, const MoeGemmDims& d, const MoeTiles& tiles) {
  MOEBIUS_LAUNCH_ASSERT(d.row_tiles >= 0 && d.k > 0 && d.chunks > 0 && d.n_out > 0, "bad GEMM dims");
  MOEBIUS_LAUNCH_ASSERT(tiles.top_k >= 1 && tiles.grid_tiles <= 65535, "grid_tiles must fit grid.y");
  if (format == MoeWeightFormat::kInt4 || format == MoeWeightFormat::kInt2)
    MOEBIUS_LAUNCH_ASSERT(d.group_size > 0 && d.group_size % 16 == 0 && d.groups > 0,
                          "int formats need a group size that is a multiple of 16");
}

bool rows_aligned(const void* p, int stride) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0 && stride % 8 == 0;
}

}  // namespace

void launch_moe_gemm_prefill_gate_up(MoeWeightFormat format, const ExpertMatrixPtrs* experts,
                                     const MoeGemmDims& dims, const MoeTiles& tiles, const __nv_bfloat16* x,
                                     int x_stride, const MoeActivationParams& act, __nv_bfloat16* h, int h_stride,
                                     cudaStream_t stream) {
  check_dims(format, dims, tiles);
  if (tiles.grid_tiles == 0 || dims.row_tiles == 0) return;
  GemmKernelArgs a{};
  a.experts = experts;
  a.dims = dims;
  a.tiles = tiles;
  a.act_in = x;
  a.in_stride = x_stride;
  a.act = act;
  a.h_out = h;
  a.h_stride = h_stride;
  if (rows_aligned(x, x_stride)) launch_aligned<Epilogue::kGateUp, true>(format, a, stream);
  else launch_aligned<Epilogue::kGateUp, false>(format, a, stream);
}

void launch_moe_gemm_prefill_down(MoeWeightFormat format, const ExpertMatrixPtrs* experts, const MoeGemmDims& dims,
                                  const MoeTiles& tiles, const __nv_bfloat16* h, int h_stride, MoeCombineMode mode,
                                  float* y, int y_stride, const float* topk_weights, __nv_bfloat16* out,
                                  int out_stride, cudaStream_t stream) {
  check_dims(format, dims, tiles);
  MOEBIUS_LAUNCH_ASSERT(rows_aligned(h, h_stride), "prefill GEMM2: h rows must be 16-byte aligned");
  if (tiles.grid_tiles == 0 || dims.row_tiles == 0) return;
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
  MOEBIUS_LAUNCH_ASSERT(mode != MoeCombineMode::kStoreBf16, "bf16 y rows: the wgmma GEMM2 only");
  if (mode == MoeCombineMode::kStore) launch_aligned<Epilogue::kDownStore, true>(format, a, stream);
  else launch_aligned<Epilogue::kDownAtomic, true>(format, a, stream);
}

}  // namespace moebius::kernels
