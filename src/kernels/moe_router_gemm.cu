// The MoE router as a tensor-core GEMM (launchers in moe_router_gemm.cuh):
//
//   logits [T, E] fp32 = x [T, H] bf16 . W [E, H]^T bf16, fp32 accumulation.
//
// Shapes: Qwen3-30B-A3B / Qwen3-235B-A22B: H = 2048 / 4096, E = 128; DeepSeek-V3: H = 7168, E = 256.
// At Qwen3-30B-A3B and T = 4096 that is 2 * T * E * H = 2.1 GFLOP, ~3 us at the bf16 peak; the
// CUDA-core router (moe_route.cu, one warp per expert x 8 tokens) re-reads x from L2 for every
// expert (2 GB at T = 4096), and the old detour through the prefill expert GEMM ran one 256-row
// block per 64 tokens with half its warps idle (36.8 us at T = 1024 and at T = 4096, H200).
//
// Why a GEMM of its own: E is small (128-256 rows of W) and T is large, so the only reuse worth
// having is W across tokens and x across experts, inside one block:
//   - A block owns BE experts (W rows, the mma A operand, m16 tiles) x BT tokens (x rows, the B
//     operand, n8 tiles) and walks ALL of K, so each logit is one thread's fixed-order sum (no
//     split-K, no atomics: deterministic). gridDim = (ceil(capacity / BT), ceil(E / BE)); blocks
//     whose first token is >= T exit after pdl_wait ([TAG_MOE_GRAPH_CAPACITY]).
//   - L2 -> SM bytes: every block reads BE + BT rows of H bf16, so the whole grid reads
//     2*T*E*H * (1/BT + 1/BE) bytes (W once per token tile, x once per expert tile). At T = 4096,
//     E = 128: 84 MB with 128 x 32 tiles, 50 MB with 128 x 64; the H200's L2 serves ~7-10 TB/s
//     (not measured here), so the tile is a trade between L2 bytes and filling the 132 SMs.
//   - Warps: kWarpsE x kWarpsT, each owning kWM m16 tiles (16*kWM experts) x kWN n8 tiles
//     (8*kWN tokens). Per k-step (16 deep) a warp loads kWM A fragments and kWN/2 B fragment pairs
//     with ldmatrix.x4 (512 B each) and issues kWM * kWN mma; shared memory feeds 128 B/clk per SM
//     and Hopper's mma.sync m16n8k16 wants ~2 clk each, so bytes per mma set the ceiling:
//     128 x 64 (32x32 warp tiles) 256 B, 128 x 32 (32x16) 384 B, 128 x 16 and 64 x 16 (16x16) 512 B.
//   - The instantiated tiles (RouterGemmTile): 128 x 64, 128 x 32, 128 x 16 (8 warps) and 64 x 16
//     (4 warps: twice the blocks of 128 x 16 and half the W bytes per block, for x read twice; for
//     small T and for E <= 64). router_gemm_pick_tile takes the largest 128-expert tile whose grid
//     fills 3/4 of the SMs, else 64 x 16: on the H200 (132 SMs) at E = 128, T = 256 -> 64 x 16,
//     32 blocks; T = 1024 -> 64 x 16, 128 blocks; T = 4096 -> 128 x 32, 128 blocks; T = 8192 ->
//     128 x 64, 128 blocks. That rule is NOT measured yet: dev/cuda/probe_router_gemm.cu times
//     every tile and the CUDA-core GEMV at T = 64, 256, 1024, 4096 so it can be replaced by numbers.
// Pipeline: K in stages of 64 (128-byte rows: one L2 line per row and stage), a ring of kStages
// slots (as many as fit in 96 KiB, 3 to 6, so two blocks can share an SM) filled by 16-byte
// cp.async.cg (L2 only: the data is consumed from shared memory), kStages - 1 stages in flight
// while one is computed, one __syncthreads per stage. Each slot is [BE W rows][BT x rows] of
// 128 B; piece q (16 B, 8 k) of row r sits at (q ^ (r & 7)) * 16, so the 8 row addresses of each
// ldmatrix phase (8 consecutive rows, one logical piece) hit 8 distinct bank groups (unswizzled
// 128-byte rows would be an 8-way conflict).
// Zero-fill: a copy whose W row is >= E, whose token is >= T, or whose k is >= H reads nothing
// and writes 16 zero bytes (src-size 0; H % 8 == 0, so a piece is all in or all out). So padded
// rows and columns meet zeros on both sides and no garbage or NaN (x's padding columns, rows past
// T) ever enters a product.
// PDL (pdl.cuh): W is a weight no kernel writes, so the first kStages - 1 stages of W are issued
// BEFORE pdl_wait, under the previous kernel's tail; x and num_tokens are read after it. A block
// that then finds itself past T drains those copies (cp.async.wait_group 0) and exits; when T is
// far below the capacity that wastes (kStages - 1) * BE * 128 B of L2 reads per dead block.
// Resources (registers, shared memory): the table at launch_tile below.
#include "kernels/moe_router_gemm.cuh"

#include <cstdint>

#include "kernels/cuda_check.h"
#include "kernels/device_info.h"
#include "kernels/moe_dequant.cuh"
#include "kernels/pdl.cuh"

namespace moebius::kernels {

namespace {

using moe_detail::cp_async16;
using moe_detail::cp_async_commit;
using moe_detail::cp_async_wait;
using moe_detail::ldmatrix_x4;
using moe_detail::mma_bf16;
using moe_detail::smem_u32;

constexpr int kStageK = 64;                      // k per pipeline stage
constexpr int kRowBytes = kStageK * 2;           // one W or x row of a stage: 128 B
constexpr int kRowPieces = kRowBytes / 16;       // its 16-byte cp.async pieces
constexpr int kStageSmemBudget = 96 * 1024;      // ring bytes: two blocks fit in an SM's 228 KiB

constexpr int clamp_int(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

template <int kWarpsE_, int kWarpsT_, int kWM_, int kWN_>
struct Tile {
  static constexpr int kWarpsE = kWarpsE_, kWarpsT = kWarpsT_;  // warp grid: experts x tokens
  static constexpr int kWM = kWM_, kWN = kWN_;                  // m16 and n8 tiles per warp
  static constexpr int kThreads = kWarpsE * kWarpsT * 32;
  static constexpr int kWarpExperts = 16 * kWM, kWarpTokens = 8 * kWN;
  static constexpr int kExperts = kWarpsE * kWarpExperts;  // BE
  static constexpr int kTokens = kWarpsT * kWarpTokens;    // BT
  static constexpr int kStageBytes = (kExperts + kTokens) * kRowBytes;
  static constexpr int kStages = clamp_int(kStageSmemBudget / kStageBytes, 3, 6);
  static constexpr int kSmem = kStages * kStageBytes;
  static_assert(kWN % 2 == 0, "B fragments come two n8 tiles per ldmatrix.x4");
  static_assert((kExperts * kRowPieces) % kThreads == 0, "W copy split");
};

using Tile128x64 = Tile<4, 2, 2, 4>;  // 8 warps of 32 experts x 32 tokens
using Tile128x32 = Tile<4, 2, 2, 2>;  // 8 warps of 32 x 16
using Tile128x16 = Tile<8, 1, 1, 2>;  // 8 warps of 16 x 16
using Tile64x16 = Tile<4, 1, 1, 2>;   // 4 warps of 16 x 16

// [TAG_MOE_GRAPH_CAPACITY] The live token count, clamped so a bad count never indexes past the
// [capacity, ...] buffers.
__device__ __forceinline__ int live_token_count(const int32_t* num_tokens, int capacity) {
  const int t = *num_tokens;
  return t < 0 ? 0 : (t > capacity ? capacity : t);
}

template <class L>
__global__ void __launch_bounds__(L::kThreads)
    moe_router_gemm_kernel(const __nv_bfloat16* __restrict__ x, int x_stride,  // [capacity, x_stride]
                           const __nv_bfloat16* __restrict__ w,                // [E, H]
                           const int32_t* __restrict__ num_tokens, int capacity, int hidden, int num_experts,
                           float* __restrict__ logits) {                       // [capacity, E]
  constexpr int BE = L::kExperts, BT = L::kTokens, S = L::kStages, NT = L::kThreads;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int t0 = blockIdx.x * BT, e0 = blockIdx.y * BE;
  const int num_k_stages = (hidden + kStageK - 1) / kStageK;
  const uint32_t ring = smem_u32(smem);

  // Copies of stage ks into ring slot `slot`: W rows [e0, e0 + BE), then x rows [t0, t0 + BT).
  // A warp's 32 pieces are 4 whole 128-byte rows: one L2 line each.
  auto issue_w = [&](int ks, int slot) {
    const uint32_t base = ring + slot * L::kStageBytes;
#pragma unroll
    for (int i = 0; i < BE * kRowPieces / NT; ++i) {
      const int p = tid + i * NT, r = p / kRowPieces, q = p % kRowPieces;
      const int e = e0 + r, k = ks * kStageK + q * 8;
      const bool ok = e < num_experts && k < hidden;
      cp_async16(base + r * kRowBytes + ((q ^ (r & 7)) << 4), ok ? w + static_cast<int64_t>(e) * hidden + k : w,
                 ok ? 16 : 0);
    }
  };
  auto issue_x = [&](int ks, int slot, int T) {
    const uint32_t base = ring + slot * L::kStageBytes + BE * kRowBytes;
#pragma unroll
    for (int i = 0; i < (BT * kRowPieces + NT - 1) / NT; ++i) {
      const int p = tid + i * NT, r = p / kRowPieces, q = p % kRowPieces;
      if ((BT * kRowPieces) % NT != 0 && r >= BT) break;  // 128 x 16: half the threads copy x
      const int t = t0 + r, k = ks * kStageK + q * 8;
      const bool ok = t < T && k < hidden;
      cp_async16(base + r * kRowBytes + ((q ^ (r & 7)) << 4), ok ? x + static_cast<int64_t>(t) * x_stride + k : x,
                 ok ? 16 : 0);
    }
  };

  // The first S - 1 stages of W before pdl_wait (weights: nothing upstream writes them), as one
  // cp.async group older than every x group, so the waits below cover it.
#pragma unroll
  for (int s = 0; s < S - 1; ++s)
    if (s < num_k_stages) issue_w(s, s);
  cp_async_commit();

  pdl_wait();  // x and num_tokens come from earlier kernels (pdl.cuh)
  pdl_launch_dependents();
  const int T = live_token_count(num_tokens, capacity);
  if (t0 >= T) {  // [TAG_MOE_GRAPH_CAPACITY] past the live tokens: write nothing
    cp_async_wait<0>();  // let the W copies land before the block's shared memory is released
    return;
  }
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < num_k_stages) issue_x(s, s, T);
    cp_async_commit();  // empty groups keep the wait count uniform
  }

  // This warp's tile; a warp with no live expert or token only helps copy (warp-uniform).
  const int warp_e = warp % L::kWarpsE, warp_t = warp / L::kWarpsE;
  const int we0 = warp_e * L::kWarpExperts, wt0 = warp_t * L::kWarpTokens;
  const bool active = e0 + we0 < num_experts && t0 + wt0 < T;

  float acc[L::kWM][L::kWN][4];
#pragma unroll
  for (int m = 0; m < L::kWM; ++m)
#pragma unroll
    for (int n = 0; n < L::kWN; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][n][i] = 0.0f;

  // ldmatrix.x4 row addresses; lanes 8q..8q+7 address matrix q's 8 rows, and every row group
  // starts at a multiple of 8, so the swizzle key (row & 7) is lane & 7.
  //   A (W, 16 experts x 16 k): matrices (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15)
  //     = mma a0..a3.
  //   B (x, 16 tokens x 16 k): (tokens 0-7, k 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15)
  //     = b0, b1 of n8 tile 0, then of n8 tile 1 (x rows are B's columns: mma .col).
  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_khalf = lane >> 4;
  const int b_row = (lane & 7) + ((lane >> 4) << 3), b_khalf = (lane >> 3) & 1;
  const int swz = lane & 7;

  auto compute_stage = [&](int slot) {
    const uint32_t wbase = ring + slot * L::kStageBytes + (we0 + a_row) * kRowBytes;
    const uint32_t xbase = ring + slot * L::kStageBytes + (BE + wt0 + b_row) * kRowBytes;
#pragma unroll
    for (int s = 0; s < kStageK / 16; ++s) {
      uint32_t a[L::kWM][4];
#pragma unroll
      for (int m = 0; m < L::kWM; ++m)
        ldmatrix_x4(wbase + m * 16 * kRowBytes + (((2 * s + a_khalf) ^ swz) << 4), a[m][0], a[m][1], a[m][2],
                    a[m][3]);
#pragma unroll
      for (int np = 0; np < L::kWN / 2; ++np) {
        uint32_t b0, b1, b2, b3;
        ldmatrix_x4(xbase + np * 16 * kRowBytes + (((2 * s + b_khalf) ^ swz) << 4), b0, b1, b2, b3);
#pragma unroll
        for (int m = 0; m < L::kWM; ++m) {
          mma_bf16(acc[m][2 * np], a[m], b0, b1);
          mma_bf16(acc[m][2 * np + 1], a[m], b2, b3);
        }
      }
    }
  };

  // The ring: stage ks lives in slot ks % S; S - 1 stages in flight ahead of the one computed.
  int slot = 0;
  for (int ks = 0; ks < num_k_stages; ++ks) {
    cp_async_wait<S - 2>();  // stage ks has landed (this thread's copies) ...
    __syncthreads();         // ... and everyone's; slot (ks - 1) % S is free again
    const int next = ks + S - 1;
    if (next < num_k_stages) {
      const int next_slot = next % S;
      issue_w(next, next_slot);
      issue_x(next, next_slot, T);
    }
    cp_async_commit();
    if (active) compute_stage(slot);
    slot = slot + 1 == S ? 0 : slot + 1;
  }
  if (!active) return;

  // acc[m][n] = {expert g, tokens 2t, 2t+1; expert g+8, tokens 2t, 2t+1} of m16 tile m and n8
  // tile n. Each store instruction writes 8 consecutive experts (32 B, one sector) of 4 tokens.
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int m = 0; m < L::kWM; ++m)
#pragma unroll
    for (int n = 0; n < L::kWN; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int e = e0 + we0 + m * 16 + g + (i >> 1) * 8;
        const int t = t0 + wt0 + n * 8 + 2 * tq + (i & 1);
        if (e < num_experts && t < T) logits[static_cast<int64_t>(t) * num_experts + e] = acc[m][n][i];
      }
}

template <class L>
int64_t grid_blocks(int capacity, int num_experts) {
  return static_cast<int64_t>((capacity + L::kTokens - 1) / L::kTokens) *
         ((num_experts + L::kExperts - 1) / L::kExperts);
}

// Resources per tile (nvcc 13.0, -O3, sm_90a, -Xptxas -v; 0 bytes stack frame, 0 spill stores or
// loads, 1 barrier in each), and per 64-k stage in the PTX:
//   tile      threads  registers  shared memory (stages x bytes)  per stage: mma, ldmatrix.x4
//   128 x 64  256      94         4 x 24 KiB = 96 KiB             32, 16
//   128 x 32  256      72         4 x 20 KiB = 80 KiB             16, 12
//   128 x 16  256      64         5 x 18 KiB = 90 KiB              8,  8
//    64 x 16  128      64         6 x 10 KiB = 60 KiB              8,  8
// Two blocks of any tile fit an SM (registers and shared memory).
template <class L>
void launch_tile(const __nv_bfloat16* x, int x_stride, const __nv_bfloat16* w, const int32_t* num_tokens,
                 int capacity, int hidden, int num_experts, float* logits, cudaStream_t stream) {
  auto* kernel = &moe_router_gemm_kernel<L>;
  // Above 48 KiB a block needs the opt-in; not a stream operation, so legal during capture.
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kSmem));
  const dim3 grid((capacity + L::kTokens - 1) / L::kTokens, (num_experts + L::kExperts - 1) / L::kExperts);
  launch_pdl(kernel, grid, dim3(L::kThreads), L::kSmem, stream, x, x_stride, w, num_tokens, capacity, hidden,
             num_experts, logits);
}

}  // namespace

const char* router_gemm_tile_name(RouterGemmTile tile) {
  switch (tile) {
    case RouterGemmTile::kAuto: return "auto";
    case RouterGemmTile::k128x64: return "128x64";
    case RouterGemmTile::k128x32: return "128x32";
    case RouterGemmTile::k128x16: return "128x16";
    case RouterGemmTile::k64x16: return "64x16";
  }
  return "?";
}

RouterGemmTile router_gemm_pick_tile(int capacity, int num_experts) {
  // E <= 64: a 128-expert tile would leave half its warps idle.
  if (num_experts <= 64) return RouterGemmTile::k64x16;
  // The fewest L2 bytes per logit (largest tile) whose grid still fills 3/4 of the SMs; with
  // fewer tokens, 64 x 16, the most blocks. Unmeasured (see the header).
  const int64_t fill = current_device_sm_count() * 3 / 4;
  if (grid_blocks<Tile128x64>(capacity, num_experts) >= fill) return RouterGemmTile::k128x64;
  if (grid_blocks<Tile128x32>(capacity, num_experts) >= fill) return RouterGemmTile::k128x32;
  if (grid_blocks<Tile128x16>(capacity, num_experts) >= fill) return RouterGemmTile::k128x16;
  return RouterGemmTile::k64x16;
}

bool moe_router_gemm_supported(const void* x, int x_stride, int hidden, int num_experts) {
  return reinterpret_cast<uintptr_t>(x) % 16 == 0 && x_stride % 8 == 0 && x_stride >= hidden && hidden >= 8 &&
         hidden % 8 == 0 && num_experts >= 1 && num_experts <= 64 * 65535;
}

void launch_moe_router_gemm(const __nv_bfloat16* x, int x_stride, const __nv_bfloat16* router_weight,
                            const int32_t* num_tokens, int capacity, int hidden, int num_experts, float* logits,
                            cudaStream_t stream, RouterGemmTile tile) {
  MOEBIUS_LAUNCH_ASSERT(moe_router_gemm_supported(x, x_stride, hidden, num_experts),
                        "router GEMM: x rows and W rows must be 16-byte aligned (x_stride, hidden % 8), E >= 1");
  MOEBIUS_LAUNCH_ASSERT(reinterpret_cast<uintptr_t>(router_weight) % 16 == 0, "router GEMM: W must be 16-byte aligned");
  MOEBIUS_LAUNCH_ASSERT(capacity >= 0 && num_tokens != nullptr && logits != nullptr, "router GEMM: bad arguments");
  if (capacity == 0) return;
  if (tile == RouterGemmTile::kAuto) tile = router_gemm_pick_tile(capacity, num_experts);
  switch (tile) {
    case RouterGemmTile::k128x64:
      return launch_tile<Tile128x64>(x, x_stride, router_weight, num_tokens, capacity, hidden, num_experts, logits,
                                     stream);
    case RouterGemmTile::k128x32:
      return launch_tile<Tile128x32>(x, x_stride, router_weight, num_tokens, capacity, hidden, num_experts, logits,
                                     stream);
    case RouterGemmTile::k128x16:
      return launch_tile<Tile128x16>(x, x_stride, router_weight, num_tokens, capacity, hidden, num_experts, logits,
                                     stream);
    case RouterGemmTile::kAuto:
    case RouterGemmTile::k64x16:
      return launch_tile<Tile64x16>(x, x_stride, router_weight, num_tokens, capacity, hidden, num_experts, logits,
                                    stream);
  }
}

}  // namespace moebius::kernels
