// Grouped expert GEMMs for prefill on Hopper: wgmma.mma_async (sm_90a) with the weights as the A
// operand, dequantized in registers, and the gathered tokens as the B operand in shared memory.
//
// Why wgmma: mma.sync caps Hopper at about two thirds of its dense bf16 peak (the mma.sync prefill
// kernel, moe_gemm_prefill.cu, reaches ~185-200 TFLOP/s of 791). wgmma issues one 64 x N x 16
// product per warpgroup instruction, asynchronously, and reads B straight from shared memory, so
// the issue slots stay free for the dequantization.
//
// Shapes (Qwen3-30B-A3B at T = 4096: H=2048, I=768, E=128, k=8, ~256 tokens per expert):
//   GEMM1: rows = 2*I = 1536 (96 row tiles, gate/up interleaved by 8), K = H = 2048
//   GEMM2: rows = H = 2048 (128 row tiles), K = I = 768
//
// "Swap AB" as the other expert GEMMs: D[weight rows, tokens] = W[rows, K] * X[tokens, K]^T.
//   A = weights, 64 rows x 16 k per wgmma, from REGISTERS. The register fragment of a warp's 16
//       rows in wgmma .m64nNk16 (PTX ISA, "Register Fragments", matrix A: warp w of the warpgroup
//       holds rows 16w..16w+15, lane 4g+t holds (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..),
//       (g+8, 2t+8..)) is the mma.sync m16n8k16 A fragment, so the [TAG_EXPERT_TILE_LAYOUT] lane
//       slices and dequant_step() (moe_dequant.cuh) feed it unchanged: a warp's 16-row tile is one
//       expert-layout row tile.
//   B = tokens, N x 16 k, K-major, from SHARED MEMORY through a matrix descriptor, 128-byte
//       swizzle (below). N = block_m (64 or 128), or 64 for a 128-token tile whose live rows all
//       sit in its first half (the last, partial tile of an expert: padding costs half as much).
//   D = fp32 accumulators, N/2 per thread and m64: thread (warp w, lane 4g+t) holds rows 16w+g and
//       16w+g+8, columns 8j+2t and 8j+2t+1 for j < N/8: exactly the mma.sync accumulator layout
//       per n8 block, so the epilogue is the mma.sync prefill kernel's.
//
// Work item: 256 weight rows x block_m tokens (one tile), all of K. Persistent grid: one block of
// 384 threads per SM (2 consumer warpgroups + 1 producer warpgroup) walks work items
// blockIdx.x, + gridDim.x, ... of tiles x row blocks (row block fastest, so the SMs share a few
// tiles' activations and experts' weights in L2; dead tiles skipped). The producer runs ahead
// across items: the next item's first stages load during the current item's last stages and
// epilogue, so neither the pipeline fill nor the epilogue's stores leave the ring idle.
// setmaxnreg moves registers from the producer (104 per thread) to the consumers (200): a block of
// 12 warps starts at 168 each, because the register file is split between the 4 SM
// sub-partitions and each holds 3 of the 12 warps.
//   Consumer warpgroup c (warps 4c..4c+3) owns two m64 row groups, rows 128c..128c+127 of the
//   block: per 16-deep k-step it dequantizes 2 A fragments per thread (each weight exactly once
//   per block) and issues 2 wgmma (m64nNk16) on the same B. Why 256 rows: L2 -> SM traffic per
//   flop is (256 * K * weight bytes + N * K * 2) / (2 * 256 * N * K); for nvfp4 at N = 128 that
//   is 1 byte per ~160 flops, which keeps the L2 well below its bandwidth at the tensor peak;
//   and 256 divides 2*I and H of every Qwen3/DeepSeek MoE.
//   The producer warpgroup only copies: weight chunks (verbatim, 16 B per lane: the lane
//   slices), nvfp4 block scales, and the activation rows gathered through padded_pair_ids, all
//   with 16-byte cp.async from sources held in registers for a whole item (pair -1 and k >= K
//   zero-filled by the copy, src-size < 16). TMA cannot gather rows, and its bulk copies of the
//   512-byte tile slices measured slower (PERF.md run L2).
// Pipeline: S stages in a shared-memory ring (S = 4 for bf16 at N = 128, up to 8), each one
// k-slice of 64 (int2: 128, one chunk) of the weights, scales and activations. Two mbarriers
// per stage: full (128 arrivals: each producer thread's cp.async.mbarrier.arrive.noinc, which
// fires when that thread's copies have landed) and empty (8 arrivals: one per consumer warp once
// the wgmma that read the stage are complete). Consumers: wait full, fence.proxy.async (the copies
// are generic-proxy writes, wgmma reads through the async proxy), then per k-step: dequantize
// into the A double buffer, wgmma.fence, 2 wgmma, commit, wait_group 1. The wait keeps one
// wgmma group in flight while the next step dequantizes, and guarantees the group that read the
// other A buffer has finished before it is rewritten; it also means the previous stage is fully
// consumed after the first step of a stage, where the empty barrier is released (an item's last
// stage: after its final wait_group 0, before the epilogue). Per-tile metadata (pair ids, row
// pointers, N) is double-buffered by item between producer and consumers, with its own pair of
// mbarriers.
// Shared memory per stage: [activations: 64-k panels of BN rows x 128 B][weights: 16 tiles x
// chunks x 512 B][nvfp4 scales: 16 x 64 B], rounded up to 1 KiB; the ring base is 1 KiB aligned.
// Activation panels are the wgmma K-major 128-byte-swizzle layout: token row r at r * 128 B,
// its 16-byte piece q (k 8q..8q+7 of the panel) stored at piece q ^ (r & 7); 8-row groups are
// 1024 B apart (descriptor stride byte offset 1024; leading byte offset unused for swizzled
// K-major), and k-step s of a panel starts at +32 s bytes (the hardware applies the XOR on the
// address bits, which is why every panel starts on a 1 KiB boundary: matrix base offset 0).
// Dequant and scales (moe_dequant.cuh): nvfp4 block scale folded into the bf16 weight (x 2^74,
// exact), global scale x 2^52 on the final sums; int4/int2 the fp16 group scale folded into the
// weight too, RN_bf16(q * s) rounded once ([TAG_INT_FOLDED_SCALE]; unlike the decode and mma.sync
// kernels, which keep the exact integers and scale a per-group accumulator: that set doubled the
// accumulator registers, which held the int formats at block_m 64, and drained the wgmma pipe at
// every group end); bf16 as is. So every format runs one accumulator set at block_m 64 or 128.
// Determinism: each output element is one thread's accumulator over K in a fixed order (the
// hardware's fixed reduction order inside a wgmma); no split-K, no atomics in kStore mode.
// Resources (nvcc 13.0, sm_90a, -Xptxas -v): see docs/MOE_KERNELS.md (registers per instance, no
// spills, no stack).
#include "kernels/moe_gemm_wgmma.cuh"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <utility>

#include "kernels/cuda_check.h"
#include "kernels/device_info.h"
#include "kernels/mbarrier.cuh"
#include "kernels/moe_dequant.cuh"
#include "kernels/pdl.cuh"

// The device code is compiled only in the sm_90a device pass (wgmma needs the "a" feature set);
// other device passes of a multi-architecture build get a stub that traps, which the launchers
// never reach (moe_gemm_wgmma_available()).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOEBIUS_WGMMA_DEVICE 1
#endif

namespace moebius::kernels {

namespace {

using namespace moe_detail;

constexpr int kConsumerWarps = 8;                     // 2 warpgroups
constexpr int kProducerThreads = 128;                 // 1 warpgroup
constexpr int kThreads = kConsumerWarps * 32 + kProducerThreads;
// setmaxnreg: the register file is split per SM sub-partition (16K registers, warps assigned
// round-robin), so 12 warps get 168 registers each at launch; the producer warpgroup gives most
// of its back and the consumers take them: 104 + 2 x 200 = 504 <= 3 x 168. (Bracketed with ptxas
// -v: the consumers fit in 184 without spills or wgmma serialization; the producer keeps its
// activation row pointers in registers for a whole item, 8 x 64 bits, and spills at 96 in the
// instances with 8 rows per thread.)
constexpr int kProducerRegs = 104;
constexpr int kConsumerRegs = 200;
static_assert(kProducerRegs + 2 * kConsumerRegs <= 3 * 168 && kConsumerRegs % 8 == 0 && kProducerRegs % 8 == 0,
              "setmaxnreg counts must fit the launch allocation and be multiples of 8");
constexpr int kMF = 2;                                // m64 row groups per consumer warpgroup
constexpr int kBlockRowTiles = 2 * kMF * 4;           // 16 row tiles = 256 weight rows
constexpr int kChunkBytes = 512;
constexpr int kMaxStages = 8;

// K per stage: one 64-k panel of activations (int2: a 128-k chunk, two panels).
template <MoeWeightFormat F>
constexpr int kStageK = kChunkK<F> > 64 ? kChunkK<F> : 64;

template <MoeWeightFormat F, int BN>
struct WgLayout {
  static constexpr int KS = kStageK<F>;
  static constexpr int kChunks = KS / kChunkK<F>;      // weight chunks per stage
  static constexpr int kSteps = KS / 16;               // wgmma k-steps per stage
  static constexpr int kPanels = KS / 64;              // 64-k activation panels per stage
  static constexpr int kRowPieces = KS / 8;            // 16-byte pieces per activation row
  static constexpr int kActs = kPanels * BN * 128;     // [panel][BN rows][128 B]
  static constexpr int kWeights = kBlockRowTiles * kChunks * kChunkBytes;  // [16 tiles][chunks][512 B]
  static constexpr int kScales = F == MoeWeightFormat::kNvFp4 ? kBlockRowTiles * 64 : 0;
  static constexpr int kBytes = (kActs + kWeights + kScales + 1023) / 1024 * 1024;
  static constexpr int kStages = (200 * 1024) / kBytes < kMaxStages ? (200 * 1024) / kBytes : kMaxStages;
  static constexpr int kTotal = kStages * kBytes + 1024;  // + slack to align the ring to 1 KiB
  static_assert(kStages >= 3, "the pipeline needs at least 3 stages");
  static_assert(kActs % 1024 == 0, "activation panels must keep 1 KiB alignment");
  static_assert(kSteps % 2 == 0, "the A double buffer alternates by step parity");
  static_assert(kProducerThreads % kRowPieces == 0, "activation copy split");
};

#ifdef MOEBIUS_WGMMA_DEVICE

// ---- proxy fence and wgmma wrappers (PTX ISA 8.x, sm_90a); the mbarriers are kernels/mbarrier.cuh --

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Orders generic-proxy shared-memory writes (the cp.async copies) before async-proxy reads
// (wgmma's B operand).
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Pins a register value at this point of the instruction stream for the compiler: it may not move
// the register's writes below, or its reads above, this point. Needed around wgmma because the
// compiler does not know the asynchronous instruction reads A and reads/writes D after it issues.
__device__ __forceinline__ void fence_reg(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
__device__ __forceinline__ void fence_reg(float& r) { asm volatile("" : "+f"(r)::"memory"); }
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) fence_reg(r[i]);
}

// Shared-memory matrix descriptor of a K-major operand in the 128-byte swizzle layout: start
// address (bits 0-13, >> 4), leading byte offset (16-29; unused by swizzled K-major layouts,
// set to 1), stride byte offset (32-45) = 1024 B between 8-row groups, base offset 0 (49-51; the
// pattern starts on a 1 KiB boundary), swizzle mode 1 = 128 B (62-63).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t smem_addr) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

// d[32] += A[64 x 16] (registers) * B[16 x 64] (shared memory, descriptor); scale_d = 0: d = A * B.
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], const uint32_t (&a)[4], uint64_t desc, int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d)
      : "memory");
}

// d[64] += A[64 x 16] (registers) * B[16 x 128] (shared memory, descriptor); scale_d = 0: d = A * B.
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], const uint32_t (&a)[4], uint64_t desc,
                                                 int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "
      "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d)
      : "memory");
}

template <int N>
__device__ __forceinline__ void wgmma_bf16(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc, int scale_d) {
  if constexpr (N == 64) wgmma_m64n64k16(d, a, desc, scale_d);
  else wgmma_m64n128k16(d, a, desc, scale_d);
}

// ---- work items and per-tile metadata ---------------------------------------------------------

// The persistent schedule walks work items of grid_tiles x row blocks, row block fastest (the
// blocks running at one time share a few tiles' activations and experts' weights in L2). Items
// of tiles whose tile_expert is -1 are skipped [TAG_MOE_GRAPH_CAPACITY].
//   Static (tiles.work_counter null): block b takes items b, b + gridDim.x, ...
//   Dynamic (tiles.work_counter set): block b takes item b first, then whatever the next
//     atomicAdd on work_counter[0] hands out (+ gridDim.x). Items differ in cost (a tile with no
//     live token in its second half runs at N = 64) and the static split leaves the SMs that drew
//     more or heavier items running alone at the end (PERF.md run L1: 13% of the SM cycles idle in
//     GEMM1 at T = 4096). The counter resets itself: each block's producer, after its last fetch,
//     counts itself in work_counter[1], and the block that completes the count zeroes both, so the
//     next launch (stream-ordered, or after pdl_wait) starts from 0 without a memset node.
// Only the producer fetches; it publishes each item in the tile metadata, so the consumers walk
// the same sequence. Results do not depend on which block computes an item (each output element is
// one item's), so both schedules are bit-identical.
struct WorkItem {
  int tile, row_tile0, expert;
};

// What the producer learns of a tile and the consumers need, double-buffered by item parity:
// filled by the producer after meta_empty, published by meta_full (128 arrivals), released by the
// consumers after their epilogue (meta_empty, 8 arrivals). valid = 0 ends the block's work.
template <int BN>
struct TileMeta {
  int32_t pair_ids[BN];
  const __nv_bfloat16* act_rows[BN];  // gathered row of each token slot, or null
  int half;                           // 1: N = BN / 2 (no live token in the tile's second half)
  int valid;
  WorkItem item;
};

// The producer's item source (one thread, producer thread 0, uses it).
struct ItemCursor {
  int* counter;  // tiles.work_counter, or null for the static schedule
  int next;      // the item after the current one: static w + gridDim.x, or a fetched index
  __device__ int fetch(int w) const {
    return counter != nullptr ? static_cast<int>(gridDim.x) + atomicAdd(counter, 1) : w + static_cast<int>(gridDim.x);
  }
  // The next live item from `next` on, or an index >= items; then prefetches the one after it.
  __device__ int advance(const GemmKernelArgs& args, int items, int row_blocks, WorkItem& item) {
    int w = next;
    for (; w < items; w = fetch(w)) {
      item.tile = w / row_blocks;
      item.row_tile0 = (w % row_blocks) * kBlockRowTiles;
      item.expert = args.tiles.tile_expert[item.tile];
      if (item.expert >= 0) break;
    }
    if (w < items) next = fetch(w);  // an atomic's latency overlaps this item's copies
    return w;
  }
  // After the last fetch: count this block done; the last block resets the counter.
  __device__ void finish() const {
    if (counter == nullptr) return;
    __threadfence();
    if (atomicAdd(counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
      counter[0] = 0;
      counter[1] = 0;
    }
  }
};

// Barrier of the 128 producer threads (named barrier 1; barrier 0 is __syncthreads').
__device__ __forceinline__ void producer_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kProducerThreads) : "memory");
}

// OR of `v` over the 128 producer threads (named barrier 1; barrier 0 is __syncthreads').
__device__ __forceinline__ bool producer_any(bool v) {
  uint32_t r;
  asm volatile(
      "{\n"
      ".reg .pred p, q;\n"
      "setp.ne.u32 q, %1, 0;\n"
      "bar.red.or.pred p, 1, %2, q;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(r)
      : "r"(static_cast<uint32_t>(v)), "n"(kProducerThreads)
      : "memory");
  return r != 0;
}

// ---- producer warpgroup ------------------------------------------------------------------------

// For each of the block's work items: the tile's metadata, then every k-stage of the item's
// weights, scales and gathered activations (the first BN or BN / 2 token rows: the consumers read
// no others) into the ring, whose position carries over from item to item, so the next item's
// first stages load during the current item's last stages and epilogue.
//
// The producer's issue rate bounds the whole kernel (PERF.md run L1: ~550 warp instructions per
// producer warp and stage when every 16-byte copy recomputed its addresses and re-read its row
// pointer from shared memory, against the 1024 tensor cycles of a stage at the peak; run L2: TMA
// bulk copies of the 512-byte tile slices were slower still, the per-lane bulk copies serialize
// through the uniform datapath and the copy unit). So everything stays 16-byte cp.async, and the
// sources are fixed per thread for a whole item and held in registers, advanced by a constant
// per stage:
//   weights: warp pw copies lane slice `lane` of the chunks of row tiles pw, pw + 4, pw + 8,
//     pw + 12 (a tile's chunks of one stage are contiguous: [TAG_EXPERT_TILE_LAYOUT]);
//   nvfp4 scales: thread p < 64 copies 16-byte piece p % 4 of tile p / 4's 64-byte scale chunk;
//   activations: thread p copies piece q = p % pieces of rows r0 + i * rows_per_pass,
//     r0 = p / pieces; the swizzled piece q ^ (r & 7) is the same for all of a thread's rows
//     (rows_per_pass is a multiple of 8).
// Pair -1 rows, row tiles past the matrix and chunks past K are zero-filled by the copy
// (src-size 0), so stale shared memory (possibly NaN bits) never enters a product.
template <MoeWeightFormat F, int BN, Epilogue EPI>
__device__ __forceinline__ void produce(const GemmKernelArgs& args, uint8_t* ring, TileMeta<BN>* meta, uint32_t full0,
                                        uint32_t empty0, uint32_t meta_full0, uint32_t meta_empty0, int row_blocks,
                                        int n_stages) {
  using L = WgLayout<F, BN>;
  const int p = threadIdx.x - kConsumerWarps * 32;  // 0..127
  const int lane = p & 31, pw = p >> 5;
  const MoeGemmDims& d = args.dims;
  constexpr int kRowsPerPass = kProducerThreads / L::kRowPieces;
  constexpr int kMyRows = BN / kRowsPerPass;  // activation rows per thread and stage (at most)
  static_assert(kRowsPerPass % 8 == 0, "a thread's rows must share their swizzle phase");
  constexpr int kTileBytes = L::kChunks * kChunkBytes;  // one row tile's weights per stage
  constexpr bool kScales = F == MoeWeightFormat::kNvFp4;
  const int q = p % L::kRowPieces;  // this thread's piece column of every row it copies
  const int r0 = p / L::kRowPieces;
  // Offset of this thread's first row's piece inside a stage: panel q / 8, row r0, piece swizzled.
  const uint32_t act_off = (q / 8) * (BN * 128) + r0 * 128 + (((q % 8) ^ (r0 & 7)) * 16);
  int slot = 0, g = 0;  // ring position and stages issued, over all items
  uint32_t phase = 0;
  int it = 0;
  const int items = args.tiles.grid_tiles * row_blocks;
  ItemCursor cursor{args.tiles.work_counter, static_cast<int>(blockIdx.x)};
  for (;; ++it) {
    const int b = it & 1;
    TileMeta<BN>& m = meta[b];
    if (it >= 2) mbar_wait(meta_empty0 + 8 * b, ((it >> 1) + 1) & 1);  // item it - 2 is done with it
    if (p == 0) {
      m.valid = cursor.advance(args, items, row_blocks, m.item) < items;
      if (!m.valid) cursor.finish();
    }
    producer_sync();  // the item, for every producer thread
    if (!m.valid) {
      mbar_arrive(meta_full0 + 8 * b);  // the consumers' end
      break;
    }
    const WorkItem item = m.item;
    const ExpertMatrixPtrs ptrs = args.experts[item.expert];  // loads beside the pair ids
    bool upper = false;
    if (p < BN) {
      const int pos = item.tile * BN + p;
      const int pair = args.tiles.padded_pair_ids[pos];
      m.pair_ids[p] = pair;
      const int64_t row = EPI == Epilogue::kGateUp ? pair / args.tiles.top_k : pos;
      m.act_rows[p] = pair < 0 ? nullptr : args.act_in + row * static_cast<int64_t>(args.in_stride);
      upper = p >= BN / 2 && pair >= 0;
    }
    // The barrier also orders every producer thread's act_rows writes before the reads below.
    const bool any_upper = producer_any(upper);
    const bool half = BN == 128 && !any_upper;
    if (p == 0) m.half = half;
    mbar_arrive(meta_full0 + 8 * b);

    // This thread's activation rows for the item: source of its piece at k = 0, and which rows
    // are live (pair -1 rows are zero-filled; the source is then any valid address).
    const int rows = half ? BN / 2 : BN;
    const char* src_row[kMyRows];
    uint32_t live = 0;
#pragma unroll
    for (int i = 0; i < kMyRows; ++i) {
      const int r = r0 + i * kRowsPerPass;
      const __nv_bfloat16* row = r < rows ? m.act_rows[r] : nullptr;
      live |= (row != nullptr ? 1u : 0u) << i;
      src_row[i] = reinterpret_cast<const char*>(row != nullptr ? row : args.act_in) + q * 16;
    }

    const uint8_t* wglobal = static_cast<const uint8_t*>(ptrs.weight);
    // This thread's weight slices: tile pw + 4j, lane slice `lane`, chunk 0 of the stage.
    constexpr int kMyTiles = kBlockRowTiles / 4;
    const char* src_w[kMyTiles];
    uint32_t tile_ok = 0;
#pragma unroll
    for (int j = 0; j < kMyTiles; ++j) {
      const int rt = item.row_tile0 + pw + 4 * j;
      tile_ok |= (rt < d.row_tiles ? 1u : 0u) << j;
      src_w[j] = reinterpret_cast<const char*>(wglobal) +
                 ((static_cast<int64_t>(rt < d.row_tiles ? rt : 0) * d.chunks) * 32 + lane) * 16;
    }
    // nvfp4: piece p % 4 of tile p / 4's scale chunk (threads p < 64).
    const bool scale_thread = kScales && p < kBlockRowTiles * 4 && item.row_tile0 + p / 4 < d.row_tiles;
    const char* src_s = static_cast<const char*>(kScales ? ptrs.scales : ptrs.weight) +
                        (scale_thread ? (static_cast<int64_t>(item.row_tile0 + p / 4) * d.chunks * 64 + (p % 4) * 16) : 0);

    for (int ks = 0; ks < n_stages; ++ks, ++g) {
      // Slot reuse: wait until the consumers released the stage that last used it.
      if (g >= L::kStages) mbar_wait(empty0 + 8 * slot, phase ^ 1);
      const uint32_t base_s = smem_u32(ring + slot * L::kBytes);
      const uint32_t full = full0 + 8 * slot;
      // Weights: [16 tiles][chunks][512 B] in the stage; chunk c of the stage exists if
      // ks * chunks_per_stage + c < chunks (only bf16's last stage can fall short).
      const int64_t w_off = static_cast<int64_t>(ks) * kTileBytes;
#pragma unroll
      for (int j = 0; j < kMyTiles; ++j) {
#pragma unroll
        for (int c = 0; c < L::kChunks; ++c) {
          const bool ok = ((tile_ok >> j) & 1) && ks * L::kChunks + c < d.chunks;
          cp_async16(base_s + L::kActs + (((pw + 4 * j) * L::kChunks + c) * 32 + lane) * 16,
                     src_w[j] + (ok ? w_off + c * kChunkBytes : 0), ok ? 16 : 0);
        }
      }
      if constexpr (kScales) {  // [16 tiles][64 B]: the stage's one chunk
        if (p < kBlockRowTiles * 4)
          cp_async16(base_s + L::kActs + L::kWeights + p * 16, src_s + (scale_thread ? ks * 64 : 0), scale_thread ? 16 : 0);
      }
      // Activations: k = ks * KS + 8q .. +7 of each of this thread's rows.
      const int k = ks * L::KS + q * 8;
      const int k_bytes = max(0, min(16, 2 * (d.k - k)));
      const int64_t k_off = static_cast<int64_t>(ks) * L::KS * 2;
#pragma unroll
      for (int i = 0; i < kMyRows; ++i) {
        if (r0 + i * kRowsPerPass < rows) {
          const int bytes = (live >> i) & 1 ? k_bytes : 0;
          cp_async16(base_s + act_off + i * kRowsPerPass * 128, src_row[i] + (bytes > 0 ? k_off : 0), bytes);
        }
      }
      cp_async_mbar_arrive_noinc(full);
      if (++slot == L::kStages) {
        slot = 0;
        phase ^= 1;
      }
    }
  }
  cp_async_wait_all();  // nothing of this warpgroup stays in flight when it exits
}

// ---- consumer warpgroups -----------------------------------------------------------------------

// The mainloop and epilogue of one work item for wgmma width N (BN, or BN / 2 when only the first
// half of the tile's rows are live). slot / phase: the ring position, carried from item to item.
template <MoeWeightFormat F, int BN, int N, Epilogue EPI>
__device__ __forceinline__ void consume_item(const GemmKernelArgs& args, const ExpertMatrixPtrs& ptrs,
                                             const uint8_t* ring, const int32_t* pair_ids,
                                             uint32_t full0, uint32_t empty0, int tile, int row_tile0, int n_stages,
                                             int& slot, uint32_t& phase) {
  using L = WgLayout<F, BN>;
  constexpr bool kInt = kIsInt<F>;
  constexpr int ND = N / 2;  // accumulators per thread and m64
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;
  const MoeGemmDims& d = args.dims;

  // This warp's 16-row tile in each of its warpgroup's two m64 row groups.
  int tl[kMF], my_rt[kMF];
  bool my_ok[kMF];
#pragma unroll
  for (int mf = 0; mf < kMF; ++mf) {
    tl[mf] = (wg * kMF + mf) * 4 + wq;
    my_rt[mf] = row_tile0 + tl[mf];
    my_ok[mf] = my_rt[mf] < d.row_tiles;
  }

  float acc[kMF][ND];
#pragma unroll
  for (int mf = 0; mf < kMF; ++mf) {
#pragma unroll
    for (int i = 0; i < ND; ++i) acc[mf][i] = 0.0f;
  }

  // Int formats ([TAG_INT_FOLDED_SCALE]): the group scales of rows g and g+8 of each tile are
  // folded into the weights, RN_bf16(q * s). `folded` is the current group's split pair; the next
  // group's fp16 values are loaded a group ahead, so the switch at a group end finds them landed.
  IntFoldedScale folded[kMF] = {};
  __half next_lo[kMF], next_hi[kMF];
  int group = 0, gstep = 0;
  const int group_steps = kInt ? d.group_size / 16 : 1;
  auto load_group_scales = [&](int q) {
#pragma unroll
    for (int mf = 0; mf < kMF; ++mf) {
      next_lo[mf] = next_hi[mf] = __float2half(0.0f);
      if (my_ok[mf] && q < d.groups) {
        const __half* s =
            static_cast<const __half*>(ptrs.scales) + (static_cast<int64_t>(my_rt[mf]) * d.groups + q) * 16;
        next_lo[mf] = __ldg(s + g);
        next_hi[mf] = __ldg(s + g + 8);
      }
    }
  };
  auto start_group = [&]() {
#pragma unroll
    for (int mf = 0; mf < kMF; ++mf) folded[mf] = int_folded_scale(next_lo[mf], next_hi[mf]);
    load_group_scales(group + 1);
  };
  if constexpr (kInt) {
    load_group_scales(0);
    start_group();
  }

#pragma unroll
  for (int mf = 0; mf < kMF; ++mf) fence_regs(acc[mf]);

  uint32_t a[2][kMF][4];  // A fragments, double-buffered by k-step parity
  uint4 w[kMF];
  uint2 nv_sc[kMF];
  int prev_slot = 0;
  for (int ks = 0; ks < n_stages; ++ks) {
    mbar_wait(full0 + 8 * slot, phase);
    __syncwarp();
    fence_proxy_async_smem();
    const uint8_t* base = ring + slot * L::kBytes;
    const uint32_t acts = smem_u32(base);

    auto do_step = [&](auto step_tag) {
      constexpr int s = decltype(step_tag)::value;
      constexpr int c = s / kSteps<F>, S = s % kSteps<F>, buf = s & 1;
      if constexpr (S == 0) {
#pragma unroll
        for (int mf = 0; mf < kMF; ++mf) {
          w[mf] = *reinterpret_cast<const uint4*>(base + L::kActs + (tl[mf] * L::kChunks + c) * kChunkBytes + lane * 16);
          if constexpr (F == MoeWeightFormat::kNvFp4)
            nv_sc[mf] = *reinterpret_cast<const uint2*>(base + L::kActs + L::kWeights + tl[mf] * 64 + g * 8);
        }
      }
#pragma unroll
      for (int mf = 0; mf < kMF; ++mf) {
        dequant_step<F, S>(w[mf], F == MoeWeightFormat::kNvFp4 ? nv_sc[mf] : make_uint2(0, 0), a[buf][mf]);
        if constexpr (kInt) fold_int_scale(a[buf][mf], folded[mf]);
#pragma unroll
        for (int j = 0; j < 4; ++j) fence_reg(a[buf][mf][j]);
      }
      // k-step s: panel s / 4, bytes 32 (s % 4) into each 128-byte row.
      const uint64_t desc = sw128_desc(acts + (s / 4) * (BN * 128) + (s % 4) * 32);
      wgmma_fence();
#pragma unroll
      for (int mf = 0; mf < kMF; ++mf) wgmma_bf16<N>(acc[mf], a[buf][mf], desc, 1);
      wgmma_commit();
      wgmma_wait<1>();
#pragma unroll
      for (int mf = 0; mf < kMF; ++mf) fence_regs(acc[mf]);
      if constexpr (s == 0) {
        // Every wgmma of the item's previous stage has completed (only this step's group may be
        // pending): release its slot to the producer.
        if (ks > 0 && lane == 0) mbar_arrive(empty0 + 8 * prev_slot);
        __syncwarp();
      }
      if constexpr (kInt) {
        if (++gstep == group_steps) {  // the group ends with this k-step (block-uniform)
          gstep = 0;
          ++group;
          start_group();
        }
      }
    };
    [&]<int... s>(std::integer_sequence<int, s...>) {
      (do_step(std::integral_constant<int, s>{}), ...);
    }(std::make_integer_sequence<int, L::kSteps>{});

    prev_slot = slot;
    if (++slot == L::kStages) {
      slot = 0;
      phase ^= 1;
    }
  }
  wgmma_wait<0>();
#pragma unroll
  for (int mf = 0; mf < kMF; ++mf) fence_regs(acc[mf]);
  // The item's last stage is consumed: release it now, so the producer refills it with the next
  // item's data during this epilogue.
  if (lane == 0) mbar_arrive(empty0 + 8 * prev_slot);
  __syncwarp();

  // Epilogue: acc[mf][4j + {0,1}] = row g, tokens 8j+2t, 8j+2t+1; acc[mf][4j + {2,3}] = row g+8,
  // same tokens; rows of tile my_rt[mf].
  const float gs_lo = F == MoeWeightFormat::kNvFp4 ? ptrs.global_scale[0] * kNvFp4AccScale : 1.0f;
  const float gs_hi = F == MoeWeightFormat::kNvFp4 ? ptrs.global_scale[1] * kNvFp4AccScale : 1.0f;
  // GEMM1: the activation kind is dispatched once per item, not per element (its switch was ~5 of
  // the ~30 instructions of each of a thread's 64 stored columns at N = 128, SASS of run L3).
  auto store_all = [&](auto act_tag) {
    constexpr MoeActivation kAct = decltype(act_tag)::value;
#pragma unroll
    for (int mf = 0; mf < kMF; ++mf) {
      if (!my_ok[mf]) continue;
#pragma unroll
      for (int j = 0; j < N / 8; ++j) {
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const int r = j * 8 + 2 * t + jj;
          const int pair = pair_ids[r];
          store_output_column<EPI, true, kAct>(args, acc[mf][4 * j + jj] * gs_lo, acc[mf][4 * j + 2 + jj] * gs_hi,
                                               tile * BN + r, pair, my_rt[mf], g);
        }
      }
    }
  };
  // [TAG_MOE_BF16_Y] bf16 y rows: one 2-byte store per value cost GEMM2 more than the fp32 stores
  // it replaced (PERF.md run Z5: nvfp4 T = 4096 253 -> 286 us), so lanes g and g ^ 1 (lane ^ 4)
  // trade one value per row half: the even-g lane then holds columns g, g + 1 of token 8j + 2t,
  // the odd-g lane the same two columns of token 8j + 2t + 1, and each stores bf16 pairs (4 bytes,
  // half the store instructions). Shuffles before any early-out: every lane takes part.
  auto store_y_bf16 = [&]() {
    const bool odd = (g & 1) != 0;
    const int col = (g & ~1);
#pragma unroll
    for (int mf = 0; mf < kMF; ++mf) {
      if (!my_ok[mf]) continue;  // warp-uniform
      const int n_lo = my_rt[mf] * 16 + col, n_hi = n_lo + 8;
#pragma unroll
      for (int j = 0; j < N / 8; ++j) {
        // Own values: token jj = 0 in acc[4j], [4j + 2] (rows g, g + 8), jj = 1 in acc[4j + 1], [4j + 3].
        const float send_lo = (odd ? acc[mf][4 * j] : acc[mf][4 * j + 1]) * gs_lo;
        const float send_hi = (odd ? acc[mf][4 * j + 2] : acc[mf][4 * j + 3]) * gs_hi;
        const float got_lo = __shfl_xor_sync(0xffffffffu, send_lo, 4);
        const float got_hi = __shfl_xor_sync(0xffffffffu, send_hi, 4);
        const float own_lo = (odd ? acc[mf][4 * j + 1] : acc[mf][4 * j]) * gs_lo;
        const float own_hi = (odd ? acc[mf][4 * j + 3] : acc[mf][4 * j + 2]) * gs_hi;
        const int r = j * 8 + 2 * t + (odd ? 1 : 0);
        const int pair = pair_ids[r];
        if (pair < 0) continue;
        __nv_bfloat16* yrow = reinterpret_cast<__nv_bfloat16*>(args.y) + static_cast<int64_t>(pair) * args.y_stride;
        // Column order in the pair: the even column first.
        const __nv_bfloat162 lo2 = odd ? __floats2bfloat162_rn(got_lo, own_lo) : __floats2bfloat162_rn(own_lo, got_lo);
        const __nv_bfloat162 hi2 = odd ? __floats2bfloat162_rn(got_hi, own_hi) : __floats2bfloat162_rn(own_hi, got_hi);
        if (n_lo < d.n_out) *reinterpret_cast<__nv_bfloat162*>(yrow + n_lo) = lo2;
        if (n_hi < d.n_out) *reinterpret_cast<__nv_bfloat162*>(yrow + n_hi) = hi2;
      }
    }
  };
  using NoAct = std::integral_constant<MoeActivation, MoeActivation::kSiLU>;  // GEMM2 has no activation
  if constexpr (EPI == Epilogue::kGateUp) {
    with_activation_kind(args.act.kind, store_all);
  } else if constexpr (EPI == Epilogue::kDownStore) {
    if (args.y_bf16) store_y_bf16();  // block-uniform
    else store_all(NoAct{});
  } else {
    store_all(NoAct{});
  }
}

#endif  // MOEBIUS_WGMMA_DEVICE

template <MoeWeightFormat F, int BN, Epilogue EPI>
__global__ void __launch_bounds__(kThreads, 1) moe_gemm_wgmma_kernel(const GemmKernelArgs args) {
#ifdef MOEBIUS_WGMMA_DEVICE
  using L = WgLayout<F, BN>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ TileMeta<BN> meta[2];
  __shared__ __align__(8) uint64_t full_bar[L::kStages];
  __shared__ __align__(8) uint64_t empty_bar[L::kStages];
  __shared__ __align__(8) uint64_t meta_full_bar[2];
  __shared__ __align__(8) uint64_t meta_empty_bar[2];

  const int tid = threadIdx.x;
  pdl_wait();  // tile_expert / pair ids (align) and the activations (previous stage); pdl.cuh
  pdl_launch_dependents();
  const uint32_t full0 = smem_u32(&full_bar[0]), empty0 = smem_u32(&empty_bar[0]);
  const uint32_t meta_full0 = smem_u32(&meta_full_bar[0]), meta_empty0 = smem_u32(&meta_empty_bar[0]);
  if (tid == 0) {
    for (int s = 0; s < L::kStages; ++s) {
      mbar_init(full0 + 8 * s, kProducerThreads);  // one cp.async arrival per producer thread
      mbar_init(empty0 + 8 * s, kConsumerWarps);   // one arrival per consumer warp
    }
    for (int b = 0; b < 2; ++b) {
      mbar_init(meta_full0 + 8 * b, kProducerThreads);
      mbar_init(meta_empty0 + 8 * b, kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();  // the barriers

  uint8_t* ring = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  const int row_blocks = (args.dims.row_tiles + kBlockRowTiles - 1) / kBlockRowTiles;
  const int n_stages = (args.dims.chunks + L::kChunks - 1) / L::kChunks;

  if (tid >= kConsumerWarps * 32) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    produce<F, BN, EPI>(args, ring, meta, full0, empty0, meta_full0, meta_empty0, row_blocks, n_stages);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
  const int lane = tid & 31;
  int slot = 0;
  uint32_t phase = 0;
  for (int it = 0;; ++it) {
    const int b = it & 1;
    mbar_wait(meta_full0 + 8 * b, (it >> 1) & 1);
    __syncwarp();
    const TileMeta<BN>& m = meta[b];
    if (!m.valid) break;  // block-uniform: the producer has no more items
    const WorkItem item = m.item;
    const ExpertMatrixPtrs ptrs = args.experts[item.expert];
    bool done = false;
    if constexpr (BN == 128) {
      if (m.half) {  // block-uniform
        consume_item<F, BN, 64, EPI>(args, ptrs, ring, m.pair_ids, full0, empty0, item.tile,
                                     item.row_tile0, n_stages, slot, phase);
        done = true;
      }
    }
    if (!done)
      consume_item<F, BN, BN, EPI>(args, ptrs, ring, m.pair_ids, full0, empty0, item.tile, item.row_tile0,
                                   n_stages, slot, phase);
    __syncwarp();
    if (lane == 0) mbar_arrive(meta_empty0 + 8 * b);  // this warp's epilogue read the metadata
  }
#else
  // Not an sm_90a device pass: never launched (moe_gemm_wgmma_available() is false there).
  (void)args;
  __trap();
#endif
}

std::atomic<int> g_grid_cap{0};  // moe_gemm_wgmma_set_grid_cap


// MOEBIUS_WGMMA_STATIC_SCHEDULE=1 (any value but "" and "0") ignores MoeTiles::work_counter: the
// static schedule, for comparing the two on one binary.
bool static_schedule_forced() {
  static const bool forced = [] {
    const char* v = std::getenv("MOEBIUS_WGMMA_STATIC_SCHEDULE");
    return v != nullptr && v[0] != '\0' && !(v[0] == '0' && v[1] == '\0');
  }();
  return forced;
}

template <MoeWeightFormat F, int BN, Epilogue EPI>
void launch_kernel(GemmKernelArgs args, cudaStream_t stream) {
  using L = WgLayout<F, BN>;
  if (static_schedule_forced()) args.tiles.work_counter = nullptr;
  auto* kernel = &moe_gemm_wgmma_kernel<F, BN, EPI>;
  // Above 48 KiB a block needs the opt-in; not a stream operation, so legal during capture.
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kTotal));
  // Persistent: one block per SM (its shared memory and registers allow no second), each walking
  // its share of the work items; fewer blocks when there are fewer items.
  const int64_t items = static_cast<int64_t>(args.tiles.grid_tiles) *
                        ((args.dims.row_tiles + kBlockRowTiles - 1) / kBlockRowTiles);
  const int cap = g_grid_cap.load(std::memory_order_relaxed);
  const int blocks = static_cast<int>(std::min<int64_t>(items, cap > 0 ? cap : current_device_sm_count()));
  launch_pdl(kernel, dim3(blocks), dim3(kThreads), L::kTotal, stream, args);
}

// The instantiated configurations: 64- and 128-token tiles for every format (the mma.sync prefill
// kernel has 128 for bf16 and nvfp4 only: its int formats keep the exact group accumulator set).
// The wide tile halves the activation bytes and the dequantization per flop; bf16 needs it for L2
// intensity (its weights are 4x the bytes per flop of nvfp4).
template <Epilogue EPI>
void launch_format(MoeWeightFormat format, const GemmKernelArgs& args, cudaStream_t stream) {
  const int bm = args.tiles.block_m;
  MOEBIUS_LAUNCH_ASSERT(moe_gemm_wgmma_compiled(), "wgmma GEMM: this build has no sm_90a kernels (MOEBIUS_CUDA_ARCHS)");
  MOEBIUS_LAUNCH_ASSERT(moe_gemm_wgmma_supports(format, bm), "wgmma GEMM: block_m must be 64 or 128");
  switch (format) {
    case MoeWeightFormat::kBF16:
      if (bm == 128) return launch_kernel<MoeWeightFormat::kBF16, 128, EPI>(args, stream);
      return launch_kernel<MoeWeightFormat::kBF16, 64, EPI>(args, stream);
    case MoeWeightFormat::kNvFp4:
      if (bm == 128) return launch_kernel<MoeWeightFormat::kNvFp4, 128, EPI>(args, stream);
      return launch_kernel<MoeWeightFormat::kNvFp4, 64, EPI>(args, stream);
    case MoeWeightFormat::kInt4:
      if (bm == 128) return launch_kernel<MoeWeightFormat::kInt4, 128, EPI>(args, stream);
      return launch_kernel<MoeWeightFormat::kInt4, 64, EPI>(args, stream);
    case MoeWeightFormat::kInt2:
      if (bm == 128) return launch_kernel<MoeWeightFormat::kInt2, 128, EPI>(args, stream);
      return launch_kernel<MoeWeightFormat::kInt2, 64, EPI>(args, stream);
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

bool moe_gemm_wgmma_compiled() {
#ifdef MOEBIUS_HAS_WGMMA
  return true;
#else
  return false;
#endif
}

void moe_gemm_wgmma_set_grid_cap(int blocks) { g_grid_cap.store(blocks > 0 ? blocks : 0, std::memory_order_relaxed); }

bool moe_gemm_wgmma_available() {
  if (!moe_gemm_wgmma_compiled()) return false;
  // MOEBIUS_DISABLE_WGMMA=1 (any value but "" and "0") takes the mma.sync prefill kernels instead:
  // for comparisons, and a way out on a driver or GPU where the wgmma path misbehaves.
  if (const char* v = std::getenv("MOEBIUS_DISABLE_WGMMA"); v != nullptr && v[0] != '\0' && !(v[0] == '0' && v[1] == '\0'))
    return false;
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return major == 9 && minor == 0;  // sm_90a code runs on compute capability 9.0 only
}

void launch_moe_gemm_wgmma_gate_up(MoeWeightFormat format, const ExpertMatrixPtrs* experts, const MoeGemmDims& dims,
                                   const MoeTiles& tiles, const __nv_bfloat16* x, int x_stride,
                                   const MoeActivationParams& act, __nv_bfloat16* h, int h_stride,
                                   cudaStream_t stream) {
  check_dims(format, dims, tiles);
  MOEBIUS_LAUNCH_ASSERT(moe_gemm_wgmma_rows_aligned(x, x_stride),
                        "wgmma GEMM1: x rows must be 16-byte aligned (use launch_moe_gemm_prefill_gate_up)");
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
  launch_format<Epilogue::kGateUp>(format, a, stream);
}

void launch_moe_gemm_wgmma_down(MoeWeightFormat format, const ExpertMatrixPtrs* experts, const MoeGemmDims& dims,
                                const MoeTiles& tiles, const __nv_bfloat16* h, int h_stride, MoeCombineMode mode,
                                float* y, int y_stride, const float* topk_weights, __nv_bfloat16* out,
                                int out_stride, cudaStream_t stream) {
  check_dims(format, dims, tiles);
  MOEBIUS_LAUNCH_ASSERT(moe_gemm_wgmma_rows_aligned(h, h_stride), "wgmma GEMM2: h rows must be 16-byte aligned");
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
  a.y_bf16 = mode == MoeCombineMode::kStoreBf16 ? 1 : 0;
  // The bf16 pair stores ([TAG_MOE_BF16_Y]): 4-byte aligned pairs of adjacent columns.
  MOEBIUS_LAUNCH_ASSERT(!a.y_bf16 || (reinterpret_cast<uintptr_t>(y) % 4 == 0 && y_stride % 2 == 0 && dims.n_out % 2 == 0),
                        "wgmma GEMM2, bf16 y: y 4-byte aligned, y_stride and the output width even");
  if (mode != MoeCombineMode::kAtomic) launch_format<Epilogue::kDownStore>(format, a, stream);
  else launch_format<Epilogue::kDownAtomic>(format, a, stream);
}

}  // namespace moebius::kernels
