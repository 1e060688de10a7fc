// The fused decode experts: GEMM1 + activation, GEMM2 and the combine in one persistent kernel.
//
// Shapes (Qwen3-30B-A3B, nvfp4, T = 1): 8 live tiles (one per routed expert, block_m 8).
//   GEMM1: 96 row tiles of 16 weight rows (gate/up interleaved by 8) x K = 2048 per tile: 18 KiB
//          of weights and block scales each, 768 row tiles in all.
//   GEMM2: 128 row tiles (the output columns, 16 each) x K = 768: 6.75 KiB each, 1024 in all.
//
// Grid: one block per SM (launch_bounds(544, 1); the plan takes most of the shared memory), all
// resident at once, 16 consumer warps in four teams of four plus one producer warp.
//
// Work: GEMM1's row tiles of all live tiles form one list (tile-major, cut into gridDim.x
// contiguous ranges). GEMM2 is split by OUTPUT columns: block b owns output row tiles
// [RT2 b / G, RT2 (b + 1) / G) of every live tile, so the combine of its columns needs no other
// block. Ring items: a GEMM1 row tile (18 KiB), or one GEMM2 output row tile of two experts.
//
// Producer (one lane): requests every item's weights and scales from the copy engine
// (cp.async.bulk, evict-first in L2) into a ring of up to 16 slots, GEMM2's as well as GEMM1's, as
// soon as a slot is free: GEMM2's weights land while GEMM1 computes.
//
// Consumers: team j takes the block's items j, j + 4, ... Per 16-row tile each warp of the team
// multiplies its quarter of the K chunks (dequantized from the slot into mma A fragments, tokens
// as the B operand from shared memory), the four partial sums meet in shared memory in warp
// order and warps 0 and 1 finish one token column each: exactly moe_gemm.cu's arithmetic, so the
// results are bit-identical to the separate kernels. (The int2 GEMM2 at 6 chunks: warps 0 and 1
// also take the separate kernel's warps 4 and 5, six partials, [TAG_DECODE_INT2_DOWN_WARPS].)
//   1. x of the live tokens staged once; GEMM1 stores h per PAIR (row t * k + s, bf16); each
//      team adds its item count to one counter (release) after its last GEMM1 item.
//   2. The only grid-wide wait: thread 0 spins until the counter holds every GEMM1 item
//      (acquire), then the block stages h of all pairs from L2 (cp.async.cg).
//   3. GEMM2 items write y per pair into shared memory; the block combines its columns in slot
//      order as moe_combine does and stores out.
// Each block then counts itself in a second word; the last one zeroes both for the next launch.
//
// Deadlock freedom: every block is resident (one per SM; the dependent kernel cannot launch
// before every block has triggered it, i.e. started); each block's GEMM1 items come before its
// GEMM2 items in both the ring and the teams' order, so no GEMM1 item waits on a GEMM2 one. Every
// spin (the grid-wide count, the ring's barriers) traps after kSpinTimeoutNs, so a broken
// invariant fails loudly instead of hanging.
//
// The ring has a multiple of four slots, so item s + slots belongs to the team that consumed item
// s: a team waiting on a slot's full barrier has always seen its previous phase complete, which
// the parity wait needs (with 7 slots another team could reach item s + 7 while item s was still
// landing, and the parity of the phase before would have let it through).
//
// Why it is not the default (docs/PERF.md runs Q2-Q8): the phase stamps put ~1.5 us of HBM latency
// before the first slot fills, the stream of all weights at ~3.4 TB/s (no faster than the separate
// kernels achieve), ~1.5 us for h through L2 between the grid-wide wait and GEMM2, and at 2-4
// tokens the dequantizing mma loop of 16 warps behind the stream; the separate kernels hide their
// boundaries under PDL well enough that the sum comes out ahead.
#include "kernels/moe_fused_experts.cuh"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/cuda_check.h"
#include "kernels/device_info.h"
#include "kernels/mbarrier.cuh"
#include "kernels/moe_dequant.cuh"
#include "kernels/pdl.cuh"

namespace moebius::kernels {

namespace {

using namespace moe_detail;

constexpr int kTeams = 4;
constexpr int kTeamWarps = 4;
constexpr int kTeamThreads = kTeamWarps * 32;
constexpr int kConsumerWarps = kTeams * kTeamWarps;
constexpr int kConsumerThreads = kConsumerWarps * 32;
constexpr int kProducerWarp = kConsumerWarps;
constexpr int kThreads = kConsumerThreads + 32;
constexpr int kTileRows = 8;  // block_m: token columns of one mma n8 tile
constexpr int kMaxSlots = 16;
constexpr int kConsumerBarrier = 1 + kTeams;  // named barrier of all consumer warps (0: __syncthreads)
constexpr uint64_t kSpinTimeoutNs = 2000000000ull;
// One team's double-buffered partial sums: one per warp splitting K, up to kInt2DownWarps (the
// int2 GEMM2's six partials, [TAG_DECODE_INT2_DOWN_WARPS]).
constexpr int kMaxKWarps = kInt2DownWarps > kTeamWarps ? kInt2DownWarps : kTeamWarps;
constexpr int kPartialFloats = 2 * kMaxKWarps * 32 * 4;

// Shared-memory plan and work split, computed on the host (make_plan).
struct FusedPlan {
  int slots = 0;
  uint32_t slot_bytes = 0;
  uint32_t rt_weight_bytes[2] = {};  // one 16-row tile's weights: GEMM1, GEMM2
  uint32_t rt_scale_bytes[2] = {};   // and its scales (nvfp4 codes or int group scales)
  int gemm1_rt_per_item = 0;         // GEMM1 row tiles per ring item
  int gemm1_items_per_tile = 0;
  int gemm2_tiles_per_item = 0;      // GEMM2: one output row tile of this many live tiles per item
  int pieces_per_block = 0;          // GEMM2 output row tiles a block owns, at most
  int x_stride = 0;                  // staged x rows, elements: padded K1 + 8 (rows 4 banks apart)
  int h_stride = 0;                  // staged h rows (one per pair), elements: padded K2 + 8
  int y_stride = 0;                  // staged y rows (one per pair), floats: pieces_per_block * 16
  uint32_t off_x = 0, off_h = 0, off_y = 0, off_partial = 0, off_table = 0, off_tile_expert = 0, off_pair = 0;
  uint32_t off_ring = 0, off_bars = 0;
  uint32_t total = 0;
};

// Phase stamps ([TAG_FUSED_EXPERTS_STAMPS]): with MOEBIUS_FUSED_EXPERTS_STAMPS set, the launcher
// passes a buffer and the kernel records %globaltimer per block at these points; the process
// prints min / median / max over the blocks of the last launch at exit (a measuring aid for the
// GPU machine, which has no Nsight Systems; off otherwise, one predicated branch per point).
enum Stamp : int {
  kStampEntry,
  kStampWaited,      // after pdl_wait
  kStampTable,       // expert tables, tile experts and pair ids in shared memory
  kStampIssued,      // producer: every item requested
  kStampFirstData,   // thread 0: its team's first slot full
  kStampGemm1Done,   // thread 0: the block's GEMM1 items done (consumer barrier)
  kStampHReady,      // thread 0: every block's GEMM1 counted
  kStampStaged,      // thread 0: h rows staged
  kStampGemm2Done,   // thread 0: the block's GEMM2 items done (consumer barrier)
  kStampExit,        // thread 0: combine written
  kStampCount
};

struct FusedKernelArgs {
  GemmKernelArgs gemm[2];  // GEMM1 (kGateUp) and GEMM2 (kDownStore): dims, tables, epilogue targets
  const int32_t* num_tiles;
  int max_tiles;
  int num_experts;  // entries of each expert table
  const int32_t* num_tokens;
  int capacity;
  const __nv_bfloat16* x;
  int x_stride;
  const float* topk_weights;
  __nv_bfloat16* out;
  int out_stride;
  uint32_t* sync;  // [0] GEMM1 items done (all blocks), [1] blocks past their last use of [0]
  uint64_t* stamps;  // [gridDim.x][kStampCount] or null
  FusedPlan plan;
};

__device__ __forceinline__ void stamp(const FusedKernelArgs& a, Stamp which) {
  if (a.stamps != nullptr) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    a.stamps[blockIdx.x * kStampCount + which] = t;
  }
}

// One item of a block's list. GEMM1: row tiles [rt0, rt0 + n) of live tile `tile`. GEMM2: output
// row tile `rt0` of live tiles [tile, tile + n).
struct Item {
  int gemm, tile, rt0, n;
};

// A block's work (scalars, not arrays: a run-time index would put them in local memory): GEMM1
// items [first1, first1 + count1) of the tile-major list, then GEMM2 items: output row tiles
// [piece0, piece0 + pieces) times groups of tiles, piece-major.
struct BlockWork {
  int first1, count1, piece0, pieces, groups;
  __device__ int count2() const { return pieces * groups; }
  __device__ Item item(const FusedKernelArgs& a, int s) const {
    const FusedPlan& pl = a.plan;
    Item it;
    if (s < count1) {
      const int gi = first1 + s;
      it.gemm = 0;
      it.tile = gi / pl.gemm1_items_per_tile;
      it.rt0 = (gi % pl.gemm1_items_per_tile) * pl.gemm1_rt_per_item;
      it.n = min(pl.gemm1_rt_per_item, a.gemm[0].dims.row_tiles - it.rt0);
    } else {
      const int j = s - count1;
      it.gemm = 1;
      it.rt0 = piece0 + j / groups;
      it.tile = (j % groups) * pl.gemm2_tiles_per_item;
      it.n = -1;  // the caller clamps to the live tile count
    }
    return it;
  }
};

__device__ __forceinline__ void team_barrier(int team) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(1 + team), "n"(kTeamThreads) : "memory");
}
__device__ __forceinline__ void consumer_barrier() {
  asm volatile("bar.sync %0, %1;\n" ::"n"(kConsumerBarrier), "n"(kConsumerThreads) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Adds n with release semantics at gpu scope: the stores this thread observed (its team's, through
// the barrier before it) are visible to whoever acquires the new count.
__device__ __forceinline__ void red_release_gpu(uint32_t* p, uint32_t n) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(p), "r"(n) : "memory");
}
// Adds n with acquire-release semantics and returns the old value.
__device__ __forceinline__ uint32_t atom_acq_rel_gpu(uint32_t* p, uint32_t n) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(n) : "memory");
  return old;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;\n" : "=l"(t));
  return t;
}

// Spins until ready() holds, backing off between polls of global memory (kSleep); traps after
// kSpinTimeoutNs (a broken residency invariant: fail, do not hang).
template <bool kSleep, class Ready>
__device__ __forceinline__ void spin_until(Ready&& ready) {
  if (ready()) return;
  const uint64_t t0 = global_timer_ns();
  while (!ready()) {
    if constexpr (kSleep) __nanosleep(64);
    if (global_timer_ns() - t0 > kSpinTimeoutNs) __trap();
  }
}

// One thread: until *counter >= target, with acquire semantics.
__device__ void wait_for_count(const uint32_t* counter, uint32_t target) {
  spin_until<true>([&] { return ld_acquire_gpu(counter) >= target; });
}

// mbar_wait with the same bound (try_wait already suspends the thread for a while).
__device__ __forceinline__ void mbar_wait_bounded(uint32_t bar, uint32_t parity) {
  spin_until<false>([&] { return mbar_try_wait(bar, parity); });
}

// The partial sums of K range v of kw (the separate kernels' warp v of kw splitting K: 4, or 6
// for the int2 GEMM2, [TAG_DECODE_INT2_DOWN_WARPS]) of one 16-row weight tile (the tile's weights
// at ws, its scales at ss, in shared memory) against the 8 token columns whose B rows start at
// b_row (+ 2t): RowTileSums's arithmetic as in moe_gemm_rows_kernel, reading the slot instead of
// registers.
template <MoeWeightFormat F>
__device__ __forceinline__ void row_tile_partial(const MoeGemmDims& d, const uint4* ws, const unsigned char* ss,
                                                 const __nv_bfloat16* b_row, int v, int kw, int lane, float (&sum)[4]) {
  static_assert(kSteps<F> % 2 == 0, "the accumulator set alternates by k-step parity");
  const int g = lane >> 2;
  const int c_begin = (d.chunks * v) / kw, c_end = (d.chunks * (v + 1)) / kw;
  const GroupStarts starts = group_starts_of<F>(d.group_size);
  RowTileSums<F> sums(reinterpret_cast<const __half*>(ss), kIsInt<F> ? starts.group_of(c_begin * kSteps<F>) : 0, g);
  // Chunks in batches of kBatch: the batch's weight and scale loads from shared memory all go out
  // before its first dequantization (one shared-memory latency per batch, not per chunk).
  // 17 warps leave 96 registers a thread (5 warps on one of the four register-file quarters):
  // batches of 8 spilled for nvfp4 (its scale codes are 2 more registers a chunk) and int2.
  constexpr int kBatch = F == MoeWeightFormat::kInt4 ? 8 : 4;
  static_assert(kBatch * kSteps<F> <= 64, "a batch's k-steps fit one GroupStarts window");
  for (int c0 = c_begin; c0 < c_end; c0 += kBatch) {
    // [TAG_INT_GROUP_STARTS] bit j: the batch's k-step j opens a scale group.
    const uint64_t group_starts = !kIsInt<F> ? 0ull :
        c0 == c_begin ? starts.first_window(c0 * kSteps<F>) : starts.window(c0 * kSteps<F>);
    uint4 wv[kBatch];
    uint2 sv[kBatch];
#pragma unroll
    for (int p = 0; p < kBatch; ++p) {
      if (c0 + p < c_end) {
        wv[p] = ws[(c0 + p) * 32 + lane];
        if constexpr (F == MoeWeightFormat::kNvFp4) sv[p] = reinterpret_cast<const uint2*>(ss)[(c0 + p) * 8 + g];
      }
    }
#pragma unroll
    for (int p = 0; p < kBatch; ++p) {
      if (c0 + p >= c_end) break;
      sums.chunk(wv[p], F == MoeWeightFormat::kNvFp4 ? sv[p] : make_uint2(0u, 0u), c0 + p, 0, b_row,
                 static_cast<uint32_t>(group_starts >> (p * kSteps<F>)));
    }
  }
  sums.finish(c_end > c_begin, sum);
}

template <MoeWeightFormat F>
__global__ void __launch_bounds__(kThreads, 1) moe_fused_experts_kernel(const __grid_constant__ FusedKernelArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int KC = kChunkK<F>;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint32_t s_finished;
  const FusedPlan& pl = a.plan;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint32_t bars = smem_u32(smem + pl.off_bars);
  auto full_bar = [&](int slot) { return bars + 8u * static_cast<uint32_t>(slot); };
  auto empty_bar = [&](int slot) { return bars + 8u * static_cast<uint32_t>(pl.slots + slot); };
  if (threadIdx.x == 0) {
    if (a.stamps != nullptr)  // a phase a block does not reach reads 0
      for (int i = 0; i < kStampCount; ++i) a.stamps[blockIdx.x * kStampCount + i] = 0;
    stamp(a, kStampEntry);
    for (int s = 0; s < pl.slots; ++s) {
      mbar_init(full_bar(s), 1);            // the producer's expect_tx arrival (+ the copy bytes)
      mbar_init(empty_bar(s), kTeamWarps);  // one arrival per warp of the consuming team
    }
    mbar_fence_init();
  }
  pdl_wait();  // the routing (tiles, pair ids, weights) and x come from the kernels before
  if (threadIdx.x == 0) stamp(a, kStampWaited);
  // [TAG_PDL_EARLY_TRIGGER] The next kernel may be scheduled now: at the decode shapes it cannot
  // fit beside this one's blocks (shared memory), so it mostly takes SMs whose block has finished;
  // and it cannot launch before every block of this grid has started, which the spin below needs.
  pdl_launch_dependents();

  // One round trip of independent loads: the counts, every tile's expert and pair ids, and both
  // expert address tables whole (E x 48 bytes). Going from tile to expert to address took two
  // dependent trips, 1.8 us between pdl_wait and the first copy request (run Q4's stamps).
  ExpertMatrixPtrs* s_table = reinterpret_cast<ExpertMatrixPtrs*>(smem + pl.off_table);  // [gemm][E]
  int* s_tile_expert = reinterpret_cast<int*>(smem + pl.off_tile_expert);                 // [max_tiles]
  int* s_pair = reinterpret_cast<int*>(smem + pl.off_pair);                               // [max_tiles * 8]
  const int T = min(max(*a.num_tokens, 0), a.capacity);
  const int L = min(max(*a.num_tiles, 0), a.max_tiles);
  {
    // 4-byte cp.async copies, all in flight at once (plain load-store loops took one round trip
    // per iteration: 1.9 us in run Q7's stamps).
    static_assert(sizeof(ExpertMatrixPtrs) % 4 == 0, "the table is copied as 4-byte words");
    const int words = static_cast<int>(sizeof(ExpertMatrixPtrs) / 4) * a.num_experts;
    const char* src13 = reinterpret_cast<const char*>(a.gemm[0].experts);
    const char* src2 = reinterpret_cast<const char*>(a.gemm[1].experts);
    const uint32_t table = smem_u32(s_table);
    for (int i = threadIdx.x; i < 2 * words; i += kThreads)
      cp_async4(table + 4u * i, i < words ? src13 + 4 * i : src2 + 4 * (i - words));
    for (int i = threadIdx.x; i < a.max_tiles; i += kThreads)
      cp_async4(smem_u32(s_tile_expert + i), a.gemm[0].tiles.tile_expert + i);
    for (int i = threadIdx.x; i < a.max_tiles * kTileRows; i += kThreads)
      cp_async4(smem_u32(s_pair + i), a.gemm[0].tiles.padded_pair_ids + i);
    cp_async_commit();
    cp_async_wait<0>();
  }
  const int G = static_cast<int>(gridDim.x), b = static_cast<int>(blockIdx.x);
  const int RT2 = a.gemm[1].dims.row_tiles;
  const int64_t n1 = static_cast<int64_t>(L) * pl.gemm1_items_per_tile;
  BlockWork w;
  w.first1 = static_cast<int>(n1 * b / G);
  w.count1 = static_cast<int>(n1 * (b + 1) / G) - w.first1;
  w.piece0 = static_cast<int>(static_cast<int64_t>(RT2) * b / G);
  w.pieces = static_cast<int>(static_cast<int64_t>(RT2) * (b + 1) / G) - w.piece0;
  w.groups = (L + pl.gemm2_tiles_per_item - 1) / pl.gemm2_tiles_per_item;
  const int m = w.count1 + w.count2();
  auto tile_matrix = [&](int gemm, int tile) -> const ExpertMatrixPtrs& {
    return s_table[gemm * a.num_experts + s_tile_expert[tile]];
  };
  __syncthreads();  // barriers initialised, tables in place
  if (threadIdx.x == 0) stamp(a, kStampTable);

  if (warp == kProducerWarp) {
    // Every item's weights and scales are requested as soon as a ring slot is free, GEMM2's with
    // GEMM1's: GEMM2's then land while GEMM1 computes and the grid waits for its last items.
    if (lane == 0) {
      const uint64_t policy = l2_evict_first_policy();
      const uint32_t ring = smem_u32(smem + pl.off_ring);
      for (int s = 0; s < m; ++s) {
        const Item it = w.item(a, s);
        const int slot = s % pl.slots;
        if (s >= pl.slots) mbar_wait_bounded(empty_bar(slot), ((s / pl.slots) - 1) & 1);
        const uint32_t dst = ring + static_cast<uint32_t>(slot) * pl.slot_bytes;
        const uint32_t rt_w = pl.rt_weight_bytes[it.gemm], rt_s = pl.rt_scale_bytes[it.gemm];
        if (it.gemm == 0) {  // row tiles [rt0, rt0 + n) of one expert: contiguous, two copies
          const ExpertMatrixPtrs& p = tile_matrix(0, it.tile);
          const uint32_t wb = static_cast<uint32_t>(it.n) * rt_w, sb = static_cast<uint32_t>(it.n) * rt_s;
          mbar_arrive_expect_tx(full_bar(slot), wb + sb);
          bulk_copy_g2s(dst, static_cast<const char*>(p.weight) + static_cast<int64_t>(it.rt0) * rt_w, wb, full_bar(slot),
                        policy);
          bulk_copy_g2s(dst + wb, static_cast<const char*>(p.scales) + static_cast<int64_t>(it.rt0) * rt_s, sb,
                        full_bar(slot), policy);
        } else {  // row tile rt0 of up to n experts: a sub-slot of weights then scales each
          const int n = min(pl.gemm2_tiles_per_item, L - it.tile);
          mbar_arrive_expect_tx(full_bar(slot), static_cast<uint32_t>(n) * (rt_w + rt_s));
          for (int i = 0; i < n; ++i) {
            const ExpertMatrixPtrs& p = tile_matrix(1, it.tile + i);
            const uint32_t sub = dst + static_cast<uint32_t>(i) * (rt_w + rt_s);
            bulk_copy_g2s(sub, static_cast<const char*>(p.weight) + static_cast<int64_t>(it.rt0) * rt_w, rt_w,
                          full_bar(slot), policy);
            bulk_copy_g2s(sub + rt_w, static_cast<const char*>(p.scales) + static_cast<int64_t>(it.rt0) * rt_s, rt_s,
                          full_bar(slot), policy);
          }
        }
      }
      stamp(a, kStampIssued);
    }
  } else {
    const int team = warp / kTeamWarps, tw = warp % kTeamWarps;
    const int g = lane >> 2, t = lane & 3;
    const int top_k = a.gemm[0].tiles.top_k;
    float* partial = reinterpret_cast<float*>(smem + pl.off_partial) + team * kPartialFloats;
    int buf = 0;

    // The 16-row tiles of one item from its ring slot: per tile the team's four (or six) partial sums meet
    // in shared memory and warps 0 and 1 finish one token column each (store(lo, hi, r, column)).
    auto run_item = [&](int s, int tiles, auto&& b_row_of, auto&& tile_bytes, auto&& store) {
      const int slot = s % pl.slots;
      mbar_wait_bounded(full_bar(slot), (s / pl.slots) & 1);
      if (s < kTeams && threadIdx.x == 0) stamp(a, kStampFirstData);
      const unsigned char* slot_ptr = smem + pl.off_ring + static_cast<uint32_t>(slot) * pl.slot_bytes;
      for (int r = 0; r < tiles; ++r) {
        const unsigned char* ws;
        const unsigned char* ss;
        tile_bytes(slot_ptr, r, ws, ss);
        const MoeGemmDims& d = a.gemm[s < w.count1 ? 0 : 1].dims;
        const int kw = s < w.count1 ? kTeamWarps : decode_down_k_warps(F, d.chunks, d.group_size);
        float* pb = partial + buf * (kMaxKWarps * 32 * 4);
        for (int v = tw; v < kw; v += kTeamWarps) {  // the separate kernel's warps v, v + 4
          float sum[4];
          row_tile_partial<F>(d, reinterpret_cast<const uint4*>(ws), ss, b_row_of(r), v, kw, lane, sum);
          reinterpret_cast<float4*>(pb)[v * 32 + lane] = make_float4(sum[0], sum[1], sum[2], sum[3]);
        }
        if (r == tiles - 1) {  // this warp is done with the slot
          __syncwarp();
          if (lane == 0) mbar_arrive(empty_bar(slot));
        }
        // Warps 0 and 1 read buffer `buf` of the tile before last ahead of the previous barrier,
        // which every warp passed before these writes: one barrier per tile.
        team_barrier(team);
        if (tw < 2) {
          float lo = 0.0f, hi = 0.0f;
#pragma unroll
          for (int v = 0; v < kw; ++v) {
            lo += pb[(v * 32 + lane) * 4 + tw];
            hi += pb[(v * 32 + lane) * 4 + 2 + tw];
          }
          store(lo, hi, r, 2 * t + tw);
        }
        buf ^= 1;
      }
    };

    // ---- GEMM1: x rows of the live tokens staged once; h stored per PAIR (row p = t * k + s),
    // so GEMM2's staging below is one contiguous copy.
    __nv_bfloat16* s_x = reinterpret_cast<__nv_bfloat16*>(smem + pl.off_x);
    {
      const int K1 = a.gemm[0].dims.k;
      const int pieces = a.gemm[0].dims.chunks * (KC / 8);  // 16-byte pieces per padded row
      for (int i = threadIdx.x; i < T * pieces; i += kConsumerThreads) {
        const int r = i / pieces, k = (i % pieces) * 8;
        const int bytes = max(0, min(16, 2 * (K1 - k)));
        const __nv_bfloat16* src = a.x + static_cast<int64_t>(r) * a.x_stride + k;
        cp_async16(smem_u32(s_x + r * pl.x_stride + k), bytes > 0 ? static_cast<const void*>(src) : a.x, bytes);
      }
      cp_async_commit();
      cp_async_wait<0>();
      consumer_barrier();
    }
    int done1 = 0;
    for (int s = team; s < w.count1; s += kTeams, ++done1) {
      const Item it = w.item(a, s);
      const int pos0 = it.tile * kTileRows;
      const int pair_g = s_pair[pos0 + g];
      const __nv_bfloat16* b_row = s_x + (pair_g >= 0 ? pair_g / top_k : 0) * pl.x_stride + 2 * t;  // padding: token 0
      const ExpertMatrixPtrs& ptrs = tile_matrix(0, it.tile);
      const float gs_lo = F == MoeWeightFormat::kNvFp4 ? ptrs.global_scale[0] * kNvFp4AccScale : 1.0f;
      const float gs_hi = F == MoeWeightFormat::kNvFp4 ? ptrs.global_scale[1] * kNvFp4AccScale : 1.0f;
      run_item(
          s, it.n, [&](int) { return b_row; },
          [&](const unsigned char* slot_ptr, int r, const unsigned char*& ws, const unsigned char*& ss) {
            ws = slot_ptr + r * pl.rt_weight_bytes[0];
            ss = slot_ptr + it.n * pl.rt_weight_bytes[0] + r * pl.rt_scale_bytes[0];
          },
          [&](float lo, float hi, int r, int col) {
            const int pair = s_pair[pos0 + col];
            store_output_column<Epilogue::kGateUp>(a.gemm[0], lo * gs_lo, hi * gs_hi, pair, pair, it.rt0 + r, g);
          });
    }
    // The team's GEMM1 items, counted once: a release-add after the team's last store.
    team_barrier(team);
    if (tw == 0 && lane == 0 && done1 > 0) red_release_gpu(a.sync, static_cast<uint32_t>(done1));
    consumer_barrier();
    if (threadIdx.x == 0) stamp(a, kStampGemm1Done);

    // ---- Every block's GEMM1 done (the only grid-wide wait), then this block's count in [1],
    // whose last arrival resets both words for the next launch (its result is needed at the end
    // only, so the atomic's round trip overlaps the staging and GEMM2).
    const int pairs = T * top_k;
    if (threadIdx.x == 0) {
      if (w.count2() > 0) wait_for_count(a.sync, static_cast<uint32_t>(n1));
      stamp(a, kStampHReady);
      s_finished = atom_acq_rel_gpu(a.sync + 1, 1u);
    }
    consumer_barrier();
    __nv_bfloat16* s_h = reinterpret_cast<__nv_bfloat16*>(smem + pl.off_h);
    float* s_y = reinterpret_cast<float*>(smem + pl.off_y);
    if (w.count2() > 0) {
      const int K2 = a.gemm[1].dims.k;
      const int pieces = a.gemm[1].dims.chunks * (KC / 8);
      for (int i = threadIdx.x; i < pairs * pieces; i += kConsumerThreads) {  // other SMs wrote h: via L2
        const int r = i / pieces, k = (i % pieces) * 8;
        const int bytes = max(0, min(16, 2 * (K2 - k)));
        const __nv_bfloat16* src = a.gemm[0].h_out + static_cast<int64_t>(r) * a.gemm[0].h_stride + k;
        cp_async16(smem_u32(s_h + r * pl.h_stride + k), bytes > 0 ? static_cast<const void*>(src) : a.x, bytes);
      }
      cp_async_commit();
      cp_async_wait<0>();
    }
    consumer_barrier();
    if (threadIdx.x == 0) stamp(a, kStampStaged);

    // ---- GEMM2: output row tile rt0 of a group of live tiles per item; y per pair into shared memory.
    for (int s = w.count1 + ((team - w.count1 % kTeams) + kTeams) % kTeams; s < m; s += kTeams) {
      const Item it = w.item(a, s);
      const int n = min(pl.gemm2_tiles_per_item, L - it.tile);
      const int local = it.rt0 - w.piece0;
      const uint32_t sub = pl.rt_weight_bytes[1] + pl.rt_scale_bytes[1];
      run_item(
          s, n,
          [&](int r) {
            const int pair = s_pair[(it.tile + r) * kTileRows + g];
            return s_h + (pair >= 0 ? pair : 0) * pl.h_stride + 2 * t;  // padding columns read pair 0
          },
          [&](const unsigned char* slot_ptr, int r, const unsigned char*& ws, const unsigned char*& ss) {
            ws = slot_ptr + r * sub;
            ss = ws + pl.rt_weight_bytes[1];
          },
          [&](float lo, float hi, int r, int col) {
            const int pair = s_pair[(it.tile + r) * kTileRows + col];
            if (pair < 0) return;
            const ExpertMatrixPtrs& ptrs = tile_matrix(1, it.tile + r);
            const float gs_lo = F == MoeWeightFormat::kNvFp4 ? ptrs.global_scale[0] * kNvFp4AccScale : 1.0f;
            const float gs_hi = F == MoeWeightFormat::kNvFp4 ? ptrs.global_scale[1] * kNvFp4AccScale : 1.0f;
            float* yrow = s_y + pair * pl.y_stride + local * 16;
            yrow[g] = lo * gs_lo;
            yrow[g + 8] = hi * gs_hi;
          });
    }
    consumer_barrier();
    if (threadIdx.x == 0) stamp(a, kStampGemm2Done);

    // ---- The combine of this block's output columns, in slot order as moe_combine does.
    const int H = a.gemm[1].dims.n_out;
    const int ncols = w.pieces * 16;
    for (int i = threadIdx.x; i < T * ncols; i += kConsumerThreads) {
      const int tok = i / ncols, c = i % ncols, col = w.piece0 * 16 + c;
      if (col >= H) continue;
      float acc = 0.0f;
      for (int j = 0; j < top_k; ++j) {
        const int p = tok * top_k + j;
        acc += a.topk_weights[p] * s_y[p * pl.y_stride + c];
      }
      a.out[static_cast<int64_t>(tok) * a.out_stride + col] = __float2bfloat16(acc);
    }
    if (threadIdx.x == 0) {
      stamp(a, kStampExit);
      if (s_finished == static_cast<uint32_t>(G - 1)) {  // every block is past its last use of [0]
        a.sync[0] = 0;
        a.sync[1] = 0;
      }
    }
  }
#endif
}

int host_chunk_k(MoeWeightFormat f) {
  return f == MoeWeightFormat::kBF16 ? 16 : (f == MoeWeightFormat::kInt2 ? 128 : 64);
}

uint32_t round_up(uint32_t v, uint32_t m) { return (v + m - 1) / m * m; }

// The shared-memory plan for these shapes within `smem_limit` bytes and the work split over
// `blocks` blocks, or false when fewer than one ring slot per team fit (Qwen3-30B-A3B nvfp4:
// capacity 4 leaves room for 6 slots of 18 KiB, so 4; capacity 8 for only 3).
bool make_plan(MoeWeightFormat f, const MoeGemmDims& d13, const MoeGemmDims& d2, int capacity, int top_k,
               int num_experts, int max_tiles, int blocks, int smem_limit, FusedPlan& pl) {
  if (f == MoeWeightFormat::kBF16 || capacity < 1 || capacity > kFusedExpertsMaxTokens || max_tiles < 1 ||
      num_experts < 1 || top_k < 1 || blocks < 1)
    return false;
  const int kc = host_chunk_k(f);
  const MoeGemmDims* dims[2] = {&d13, &d2};
  uint32_t item_max = 0;
  for (int g = 0; g < 2; ++g) {
    const MoeGemmDims& d = *dims[g];
    if (d.row_tiles < 1 || d.chunks < 1) return false;
    pl.rt_weight_bytes[g] = static_cast<uint32_t>(d.chunks) * 512u;
    pl.rt_scale_bytes[g] = f == MoeWeightFormat::kNvFp4 ? static_cast<uint32_t>(d.chunks) * 64u
                                                          : static_cast<uint32_t>(d.groups) * 32u;
    if (pl.rt_scale_bytes[g] == 0) return false;
    item_max = std::max(item_max, pl.rt_weight_bytes[g] + pl.rt_scale_bytes[g]);
  }
  pl.slot_bytes = round_up(item_max, 128);
  const uint32_t rt1 = pl.rt_weight_bytes[0] + pl.rt_scale_bytes[0], rt2 = pl.rt_weight_bytes[1] + pl.rt_scale_bytes[1];
  pl.gemm1_rt_per_item = std::max(1, std::min(d13.row_tiles, static_cast<int>(pl.slot_bytes / rt1)));
  pl.gemm1_items_per_tile = (d13.row_tiles + pl.gemm1_rt_per_item - 1) / pl.gemm1_rt_per_item;
  pl.gemm2_tiles_per_item = std::max(1, static_cast<int>(pl.slot_bytes / rt2));
  pl.pieces_per_block = (d2.row_tiles + blocks - 1) / blocks;
  const int pairs = capacity * top_k;
  pl.x_stride = d13.chunks * kc + 8;
  pl.h_stride = d2.chunks * kc + 8;
  pl.y_stride = pl.pieces_per_block * 16;
  uint64_t off = 0;
  auto take = [&](uint32_t& at, uint64_t bytes) {
    at = static_cast<uint32_t>(off);
    off += (bytes + 127) / 128 * 128;
  };
  take(pl.off_x, static_cast<uint64_t>(capacity) * pl.x_stride * 2);
  take(pl.off_h, static_cast<uint64_t>(pairs) * pl.h_stride * 2);
  take(pl.off_y, static_cast<uint64_t>(pairs) * pl.y_stride * 4);
  take(pl.off_partial, static_cast<uint64_t>(kTeams) * kPartialFloats * 4);
  take(pl.off_table, static_cast<uint64_t>(num_experts) * 2 * sizeof(ExpertMatrixPtrs));
  take(pl.off_tile_expert, static_cast<uint64_t>(max_tiles) * sizeof(int));
  take(pl.off_pair, static_cast<uint64_t>(max_tiles) * kTileRows * sizeof(int));
  const int64_t room = static_cast<int64_t>(smem_limit) - static_cast<int64_t>(off) - 2 * kMaxSlots * 8 - 1024;
  pl.slots = static_cast<int>(std::min<int64_t>(kMaxSlots, room > 0 ? room / pl.slot_bytes : 0));  // 1 KiB: static
  pl.slots -= pl.slots % kTeams;  // item s + slots is then the same team's as item s (the kernel's header)
  if (pl.slots < kTeams) return false;
  take(pl.off_ring, static_cast<uint64_t>(pl.slots) * pl.slot_bytes);
  take(pl.off_bars, 2ull * static_cast<uint64_t>(pl.slots) * 8);
  pl.total = static_cast<uint32_t>(off);
  return true;
}

// [TAG_FUSED_EXPERTS_STAMPS] The stamp buffer of this process (MOEBIUS_FUSED_EXPERTS_STAMPS set):
// allocated at the first launch, printed at exit for the last launch.
struct StampBuffer {
  uint64_t* device = nullptr;
  int blocks = 0;
};
StampBuffer& stamp_buffer() {
  static StampBuffer b;
  return b;
}

void print_stamps() {
  const StampBuffer& b = stamp_buffer();
  std::vector<uint64_t> h(static_cast<size_t>(b.blocks) * kStampCount);
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpy(h.data(), b.device, h.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost) != cudaSuccess)
    return;
  static const char* const kNames[kStampCount] = {"entry",        "after pdl_wait", "tables",     "all issued",
                                                  "first data",   "gemm1 done",     "h ready",    "h staged",
                                                  "gemm2 done",   "combined"};
  uint64_t t0 = ~0ull;
  for (int blk = 0; blk < b.blocks; ++blk)
    if (h[blk * kStampCount] != 0) t0 = std::min(t0, h[blk * kStampCount]);
  std::fprintf(stderr, "fused experts stamps (us from the first block's entry; last launch, %d blocks)\n", b.blocks);
  std::fprintf(stderr, "  %-22s %8s %8s %8s %6s\n", "phase", "min", "median", "max", "blocks");
  for (int i = 0; i < kStampCount; ++i) {
    std::vector<double> v;
    for (int blk = 0; blk < b.blocks; ++blk)
      if (h[blk * kStampCount + i] != 0) v.push_back(1e-3 * static_cast<double>(h[blk * kStampCount + i] - t0));
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    std::fprintf(stderr, "  %-22s %8.2f %8.2f %8.2f %6zu\n", kNames[i], v.front(), v[v.size() / 2], v.back(), v.size());
  }
}

uint64_t* stamps_for_launch(int blocks) {
  static const bool on = std::getenv("MOEBIUS_FUSED_EXPERTS_STAMPS") != nullptr;
  if (!on) return nullptr;
  StampBuffer& b = stamp_buffer();
  if (b.device == nullptr) {
    // The first launch may be inside a stream capture, where a plain cudaMalloc is refused.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    CUDA_CHECK(cudaMalloc(&b.device, sizeof(uint64_t) * kStampCount * static_cast<size_t>(blocks)));
    CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    b.blocks = blocks;
    std::atexit(print_stamps);
  }
  return blocks <= b.blocks ? b.device : nullptr;
}

template <MoeWeightFormat F>
void launch_for_format(const FusedKernelArgs& args, cudaStream_t stream) {
  // Above 48 KiB a block needs the opt-in; not a stream operation, so legal during capture (set at
  // every launch, as the other launchers do).
  CUDA_CHECK(cudaFuncSetAttribute(moe_fused_experts_kernel<F>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(args.plan.total)));
  const int blocks = current_device_sm_count();
  FusedKernelArgs k = args;
  k.stamps = stamps_for_launch(blocks);
  launch_pdl(moe_fused_experts_kernel<F>, dim3(blocks), dim3(kThreads), args.plan.total, stream, k);
}

}  // namespace


bool moe_fused_experts_supported(MoeWeightFormat format, const MoeGemmDims& dims13, const MoeGemmDims& dims2,
                                 int capacity, int block_m, int top_k, int num_experts, int max_tiles) {
  if (block_m != kTileRows || current_device_cc_major() < 9) return false;
  FusedPlan pl;
  return make_plan(format, dims13, dims2, capacity, top_k, num_experts, max_tiles, current_device_sm_count(),
                   current_device_smem_optin(), pl);
}

void launch_moe_fused_experts(const MoeFusedExpertsArgs& a, cudaStream_t stream) {
  FusedKernelArgs k{};
  const bool planned =
      make_plan(a.format, a.dims13, a.dims2, a.capacity, a.top_k, a.num_experts, a.max_tiles, current_device_sm_count(),
                current_device_smem_optin(), k.plan);
  MOEBIUS_LAUNCH_ASSERT(planned, "moe_fused_experts: shapes not supported (check moe_fused_experts_supported)");
  MOEBIUS_LAUNCH_ASSERT(a.x_stride % 8 == 0 && reinterpret_cast<uintptr_t>(a.x) % 16 == 0 && a.h_stride % 8 == 0,
                        "moe_fused_experts: x and h rows must be 16-byte aligned");
  for (int g = 0; g < 2; ++g) {
    GemmKernelArgs& ga = k.gemm[g];
    ga.experts = g == 0 ? a.experts13 : a.experts2;
    ga.dims = g == 0 ? a.dims13 : a.dims2;
    ga.tiles.padded_pair_ids = a.padded_pair_ids;
    ga.tiles.tile_expert = a.tile_expert;
    ga.tiles.block_m = kTileRows;
    ga.tiles.grid_tiles = a.max_tiles;
    ga.tiles.top_k = a.top_k;
    ga.act = a.act;
    ga.h_out = a.h;
    ga.h_stride = a.h_stride;
  }
  k.gemm[0].act_in = a.x;
  k.gemm[0].in_stride = a.x_stride;
  k.gemm[1].act_in = a.h;
  k.gemm[1].in_stride = a.h_stride;
  k.num_tiles = a.num_tiles;
  k.max_tiles = a.max_tiles;
  k.num_experts = a.num_experts;
  k.num_tokens = a.num_tokens;
  k.capacity = a.capacity;
  k.x = a.x;
  k.x_stride = a.x_stride;
  k.topk_weights = a.topk_weights;
  k.out = a.out;
  k.out_stride = a.out_stride;
  k.sync = a.sync;
  switch (a.format) {
    case MoeWeightFormat::kNvFp4: launch_for_format<MoeWeightFormat::kNvFp4>(k, stream); break;
    case MoeWeightFormat::kInt4: launch_for_format<MoeWeightFormat::kInt4>(k, stream); break;
    case MoeWeightFormat::kInt2: launch_for_format<MoeWeightFormat::kInt2>(k, stream); break;
    case MoeWeightFormat::kBF16: MOEBIUS_LAUNCH_ASSERT(false, "moe_fused_experts: bf16 experts are not supported");
  }
}

}  // namespace moebius::kernels
