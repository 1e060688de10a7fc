// Flash-style attention kernels over the paged KV cache; launchers declared in attention.cuh.
//
// Shared machinery (both kernels):
//  - Query rows are (token, head-in-group) pairs of ONE kv head: row r of a sequence's tile is
//    token r / G, query head kvh * G + r % G (G = nh / nkv). A K/V tile in shared memory then
//    serves all G heads that read it (FlashInfer's GQA packing), G times fewer K/V bytes per
//    query than one block per query head, and decode gets G real rows into each m16 mma tile.
//  - mma.sync m16n8k16 bf16 -> fp32 (HMMA; wgmma would need warpgroup-wide 64-row tiles and TMA
//    descriptors per cache block, left for later). A warp owns 16 query rows: S = Q K^T with Q
//    fragments held in registers for the whole key loop, the online softmax in the log2 domain on
//    the S accumulator fragments (rows g and g+8 of the lane, reduced over the quad with two
//    shuffles), then P (the same registers repacked to bf16 A fragments, no shared memory) times V.
//  - K/V tiles come from the cache with 16-byte cp.async.cg (L2 only: each tile is used once per
//    block; other blocks of the same kv head find it in L2), zero-filled past the valid keys so a
//    masked P of 0 never meets garbage (0 * NaN = NaN). Rows are hd bf16 = hd/8 16-byte chunks;
//    chunk c of row r is stored at chunk c ^ f(r) (XOR swizzle) so that the 8 row addresses of an
//    ldmatrix phase fall in 8 distinct bank groups for every hd (16, 64, 128).
//  - Q K^T B fragments via ldmatrix.x4 (K rows are keys, contiguous in d: the "col" B layout);
//    P V B fragments via ldmatrix.x4.trans (V rows are keys, the mma wants k = key pairs).
//
// Prefill kernel: block = 4 warps = 64 query rows of one (sequence, kv head); key tiles of 64,
// double-buffered (the next tile's cp.async is in flight during the current tile's math).
// Grid (ceil(max_q_len * G / 64), nkv, max_num_seqs); tile x is taken in reverse so the blocks with
// the most keys (last rows of the causal triangle) start first. Only tiles that cross the causal
// diagonal (or the end of the context) evaluate the mask. Shared memory: Q 64 x hd + 2 stages x
// (K + V) 64 x hd, bf16 = 80 KiB at hd 128.
//
// Decode kernel: block = 4 warps for one (split, kv head, sequence); the G <= 16 query heads of
// the token fill one m16 tile (rows >= G are zero and never written). The warps take the split's
// 16-key tiles round-robin, each with its own 4-stage cp.async ring (three tiles in flight per
// warp: decode is a stream of K/V bytes, and bytes in flight are what hide HBM latency), and merge
// their (max, sum, acc) states through shared memory at the end. A 16-key tile is one whole
// cache block at block_size 16: one contiguous 4 KiB run per K or V in the HND layout.
// Shared memory: Q 16 x hd + 4 warps x 4 stages x (K + V) 16 x hd bf16 = 132 KiB at hd 128, plus
// the cluster merge's partials (65 KiB), so one block per SM, and the plan sizes the grid to one
// wave. [TAG_ATTN_DECODE_STAGES] Plans with short splits take 2 stages (133 KiB in all): such a
// block fits beside the two 77 KiB blocks per SM of the qkv GEMV before it, so it is resident and
// its first K/V tiles are loading before the GEMV ends; a 199 KiB block waited for the SM to empty.
// The CUPTI timeline of a decode step put attention at 13.6 us a layer at 1k context against 6.7
// in a chain of attention kernels (docs/PERF.md, runs P5-P6).
//  - Splits per sequence come from its LIVE length (attention_decode_split, [TAG_ATTN_DECODE_SPLIT]):
//    up to 256 keys one split, written straight to bf16 (no workspace, no counter); longer, up to
//    the plan's max_splits equal splits of >= 64 keys. Blocks past a sequence's splits exit.
//  - [TAG_ATTN_CLUSTER_MERGE] When the plan says so (plan.cluster_merge: at most 16 splits,
//    128 / G, every (sequence, kv head)'s cluster resident at once, and a context short enough that
//    fewer splits cost less than the merge saves), the splits of a (sequence, kv head) are one
//    thread-block cluster: each writes its partial (fp32 o, max, sum per row) straight into the
//    leader's shared memory (DSMEM stores into a 65 KiB region past the ring), one cluster barrier
//    (release / acquire), and the leader merges from shared memory in split order. The workspace
//    merge below costs a fence, an atomic and three dependent L2 round trips, ~4 us at 1k context;
//    the cluster merge ~1.3 (run O4: 1k context 9.1 -> 6.4-6.7 us). Pulling the partials from the
//    others' shared memory instead (two barriers, 132 KiB blocks) measured slower (run O6). A block
//    without keys exits at once; the cluster barrier waits only for threads that have not exited.
//  - Otherwise the merge is in the same kernel (FlashDecoding's second kernel folded in with the CUDA
//    samples' threadFenceReduction pattern): a split writes fp32 (o, max, sum) per row to
//    the workspace, fences, and counts itself in with one atomic per (sequence, kv head); the block
//    that brings the count to the number of splits merges all of them in split order (the result's
//    bits do not depend on which block came last) and resets the counter to zero, so CUDA-graph
//    replays need no memset. The old separate merge kernel cost a launch and, worse, walked the
//    splits one dependent L2 load at a time (run E: 4.8 us at ~256 context); here the merge loads
//    16 splits' float4s per thread at once.
//  - The attention prologue of the new token is folded in (no rope kernel at decode): after the
//    PDL wait each block normalises (QK-norm) and rotates (RoPE) its G q heads straight from the
//    qkv GEMV's output into the Q tile, and the warp whose tile holds the newest key (in the last
//    split) does the same for that k head, writes the K and V rows into the cache for later steps
//    and stores them into its ring stage from registers (the tile loads skip that row). rope.cu's
//    arithmetic, operation for operation, so the bits should match the prefill path's rope kernel
//    (unless nvcc contracts the two copies into FMAs differently).
//  - Before the PDL wait ([TAG_ATTN_DECODE_PREWAIT]) the block reads the step inputs, builds the
//    RoPE cos/sin table of the position (double sincos, as rope.cu) and requests its first three
//    tiles per warp, all but the newest key's row, so the K/V stream starts under the qkv GEMV.
//
// The prefill kernel triggers its dependents after its wait, the decode kernel before it
// ([TAG_PDL_EARLY_TRIGGER]): still safe, since a dependent's own wait covers this kernel's
// completion whenever the trigger came, and it lets the o projection's GEMV launch and stream its
// weights (8 MB of the 16.8 before its wait) while attention runs. Deadlock-free: a kernel only
// launches once every block of its predecessor is resident.
#include "kernels/attention.cuh"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "kernels/cuda_check.h"
#include "kernels/kv_cache.cuh"
#include "kernels/pdl.cuh"
#include "kernels/rope_pair.cuh"

namespace moebius::kernels {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;

constexpr int kPrefillBM = kWarps * 16;  // query rows per block
constexpr int kPrefillBN = 64;           // keys per tile
constexpr int kDecodeBN = 16;            // keys per tile (per warp)
constexpr int kDecodeStages = 4;
constexpr int kDecodeMaxGroup = 16;      // query heads per kv head that fit one m16 tile
constexpr int kDecodeMaxSplits = 256;    // splits per (sequence, kv head): the merge's weights in smem
// [TAG_ATTN_CLUSTER_MERGE] Up to this many splits of a (sequence, kv head) run as one thread-block
// cluster (16: the non-portable maximum on sm_90) and merge through the leader's shared memory,
// whose partial region holds kDecodeClusterRows rows of hd fp32: a cluster takes at most
// kDecodeClusterRows / G splits (Qwen3-30B-A3B, G = 8: 16; Qwen3-235B-A22B, G = 16: 8).
constexpr int kDecodeMaxCluster = 16;
constexpr int kDecodeClusterRows = 128;

// ------------------------------------------------------------------------------------------------
// PTX wrappers
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared; src_bytes 0 zero-fills the destination without reading src.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo: the lower column
  return *reinterpret_cast<uint32_t*>(&v);
}

// ------------------------------------------------------------------------------------------------
// Shared-memory tiles: [rows][HD] bf16, 16-byte chunks XOR-swizzled
// ------------------------------------------------------------------------------------------------

// Byte offset of chunk c of row r. With C = HD/8 chunks a row, the 8 rows an ldmatrix phase reads
// at one logical chunk land in distinct 16-byte bank groups: C >= 8 XORs the low 3 bits with
// r % 8; C < 8 (hd 16: 32-byte rows, 4 rows per 128 bytes) XORs with (r / (8/C)) % C.
template <int HD>
__device__ __forceinline__ uint32_t tile_offset(int r, int c) {
  constexpr int C = HD / 8;
  int pc;
  if constexpr (C >= 8) pc = c ^ (r & 7);
  else pc = c ^ ((r / (8 / C)) % C);
  return static_cast<uint32_t>((r * C + pc) * 16);
}

// ROWS keys [key0, key0 + ROWS) of kv head kvh into a swizzled tile, by NT threads (tid in
// [0, NT)); keys >= kv_end are zero-filled; the row of key skip_key is left untouched (decode loads
// it later, after the PDL wait). [TAG_KV_CACHE_LAYOUT]
template <int HD, int ROWS, int NT>
__device__ __forceinline__ void load_kv_tile(uint32_t dst, const __nv_bfloat16* __restrict__ pool,
                                             const int32_t* __restrict__ table_row, int kvh, int key0, int kv_end,
                                             int nkv, int block_size, int tid, int skip_key = -1) {
  constexpr int C = HD / 8;
#pragma unroll
  for (int idx = tid; idx < ROWS * C; idx += NT) {
    const int r = idx / C, c = idx % C, key = key0 + r;
    if (key == skip_key) continue;
    const __nv_bfloat16* src = pool;
    int bytes = 0;
    if (key < kv_end) {
      const int block = table_row[key / block_size];
      src = pool + kv_cache_offset(block, kvh, key % block_size, nkv, block_size, HD) + c * 8;
      bytes = 16;
    }
    cp_async16(dst + tile_offset<HD>(r, c), src, bytes);
  }
}

// K and V rows of one tile at once: the same destination and zero fill as load_kv_tile, with the
// row's element offset in the pools from row_offset(key, r), once for both (before the chunk).
template <int HD, int ROWS, int NT, typename RowOffset>
__device__ __forceinline__ void load_kv_rows(uint32_t k_dst, uint32_t v_dst, const __nv_bfloat16* __restrict__ k_pool,
                                             const __nv_bfloat16* __restrict__ v_pool, int key0, int kv_end, int tid,
                                             int skip_key, RowOffset row_offset) {
  constexpr int C = HD / 8;
  static_assert(NT % C == 0 && (ROWS * C) % NT == 0, "whole rows per pass, whole passes per tile");
  const int c = tid % C, r0 = tid / C;
#pragma unroll
  for (int i = 0; i < ROWS * C / NT; ++i) {
    const int r = r0 + (NT / C) * i, key = key0 + r;
    if (key == skip_key) continue;
    const bool live = key < kv_end;
    const int64_t off = live ? row_offset(key, r) + c * 8 : 0;
    const uint32_t at = tile_offset<HD>(r, c);
    cp_async16(k_dst + at, k_pool + off, live ? 16 : 0);
    cp_async16(v_dst + at, v_pool + off, live ? 16 : 0);
  }
}

// [TAG_ATTN_KV_ONE_BLOCK] load_kv_tile for K and V at once when the tile's ROWS keys sit in ONE
// cache block (block_size % ROWS == 0 and key0 % ROWS == 0; the caller checks): one block-table
// read and one offset serve every row of both pools, rows hd elements apart. The general path
// computes a signed division, a table read and a 64-bit offset per 16-byte chunk: ncu of the
// decode kernel (run O1) counted ~1.5k warp instructions per 16-key tile, most of them this
// addressing, against ~300 for the tile's math. Same copies, same destinations, same zero fill.
template <int HD, int ROWS, int NT>
__device__ __forceinline__ void load_kv_tile_pair_one_block(uint32_t k_dst, uint32_t v_dst,
                                                            const __nv_bfloat16* __restrict__ k_pool,
                                                            const __nv_bfloat16* __restrict__ v_pool,
                                                            const int32_t* __restrict__ table_row, int kvh, int key0,
                                                            int kv_end, int nkv, int block_size, int tid,
                                                            int skip_key = -1) {
  int64_t base = 0;
  if (key0 < kv_end) base = kv_cache_offset(table_row[key0 / block_size], kvh, key0 % block_size, nkv, block_size, HD);
  load_kv_rows<HD, ROWS, NT>(k_dst, v_dst, k_pool, v_pool, key0, kv_end, tid, skip_key,
                             [base](int, int r) { return base + static_cast<int64_t>(r) * HD; });
}

// K and V tiles at once for a power-of-two block_size (1 << block_shift) whose tiles may span
// several cache blocks (prefill's 64-key tiles at block_size 16): the block and the slot of a key
// are a shift and a mask, one table read per row serves both pools. [TAG_ATTN_KV_ONE_BLOCK]
template <int HD, int ROWS, int NT>
__device__ __forceinline__ void load_kv_tile_pair_pow2(uint32_t k_dst, uint32_t v_dst,
                                                       const __nv_bfloat16* __restrict__ k_pool,
                                                       const __nv_bfloat16* __restrict__ v_pool,
                                                       const int32_t* __restrict__ table_row, int kvh, int key0,
                                                       int kv_end, int nkv, int block_shift, int tid,
                                                       int skip_key = -1) {
  const int block_size = 1 << block_shift;
  load_kv_rows<HD, ROWS, NT>(k_dst, v_dst, k_pool, v_pool, key0, kv_end, tid, skip_key, [&](int key, int) {
    return kv_cache_offset(table_row[key >> block_shift], kvh, key & (block_size - 1), nkv, block_size, HD);
  });
}

// log2(block_size) when it is a power of two, else -1.
__device__ __forceinline__ int pow2_shift(int block_size) {
  return (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1;
}

// A fragments of Q (16 rows of the tile starting at row0) for every k-step of hd.
template <int HD>
__device__ __forceinline__ void load_q_frags(uint32_t (&qa)[HD / 16][4], uint32_t q_tile, int row0, int lane) {
  const int mat = lane >> 3;
  const int r = row0 + (lane & 7) + ((mat & 1) << 3);
#pragma unroll
  for (int ks = 0; ks < HD / 16; ++ks) ldmatrix_x4(qa[ks], q_tile + tile_offset<HD>(r, 2 * ks + (mat >> 1)));
}

// Online-softmax state of a warp's 16 rows; the lane holds rows g = lane/4 and g + 8.
template <int HD>
struct WarpState {
  float o[HD / 8][4];  // accumulator fragments: d-tile j covers dims 8j .. 8j+7
  float m[2];          // running max (log2 domain, quad-uniform)
  float l[2];          // running sum, this lane's columns only (the quad is summed at the end)

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;
  }
};

// One key tile of BN keys (tile rows 0 .. BN-1 = keys key0 ..) for the warp's 16 rows. lim[h]: the
// last key row g + 8h may see; applied only when `mask`. scale_log2 = log2(e) / sqrt(hd).
template <int HD, int BN>
__device__ __forceinline__ void attend_tile(WarpState<HD>& st, const uint32_t (&qa)[HD / 16][4], uint32_t k_tile,
                                            uint32_t v_tile, int key0, const int (&lim)[2], bool mask,
                                            float scale_log2, int lane) {
  const int mat = lane >> 3, t = lane & 3;
  // S = Q K^T: [16, BN]
  float s[BN / 8][4];
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < HD / 16; ++ks)
#pragma unroll
    for (int np = 0; np < BN / 16; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, k_tile + tile_offset<HD>(np * 16 + (lane & 7) + ((mat >> 1) << 3), 2 * ks + (mat & 1)));
      mma_bf16(s[2 * np], qa[ks], b[0], b[1]);
      mma_bf16(s[2 * np + 1], qa[ks], b[2], b[3]);
    }
  // Scale into the log2 domain, mask, and update the running max.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = s[j][2 * h + e] * scale_log2;
        if (mask && key0 + j * 8 + 2 * t + e > lim[h]) v = -INFINITY;
        s[j][2 * h + e] = v;
        mx = fmaxf(mx, v);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(st.m[h], mx);
    const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing visible yet: no NaN
    const float alpha = exp2f(st.m[h] - m_use);
    st.m[h] = m_new;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = exp2f(s[j][2 * h + e] - m_use);
        s[j][2 * h + e] = p;
        sum += p;
      }
    st.l[h] = st.l[h] * alpha + sum;
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) {
      st.o[j][2 * h] *= alpha;
      st.o[j][2 * h + 1] *= alpha;
    }
  }
  // O += P V: P's accumulator fragments are the A fragments of the next mma, repacked to bf16.
#pragma unroll
  for (int ks = 0; ks < BN / 16; ++ks) {
    const uint32_t a[4] = {pack_bf16(s[2 * ks][0], s[2 * ks][1]), pack_bf16(s[2 * ks][2], s[2 * ks][3]),
                           pack_bf16(s[2 * ks + 1][0], s[2 * ks + 1][1]), pack_bf16(s[2 * ks + 1][2], s[2 * ks + 1][3])};
#pragma unroll
    for (int dp = 0; dp < HD / 16; ++dp) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, v_tile + tile_offset<HD>(ks * 16 + (lane & 7) + ((mat & 1) << 3), 2 * dp + (mat >> 1)));
      mma_bf16(st.o[2 * dp], a, b[0], b[1]);
      mma_bf16(st.o[2 * dp + 1], a, b[2], b[3]);
    }
  }
}

// Sums the lane-partial l over the quad.
template <int HD>
__device__ __forceinline__ void finish_sums(WarpState<HD>& st) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    st.l[h] += __shfl_xor_sync(0xffffffffu, st.l[h], 1);
    st.l[h] += __shfl_xor_sync(0xffffffffu, st.l[h], 2);
  }
}

__device__ __forceinline__ int live_seqs(const int32_t* num_seqs, int max_num_seqs) {
  const int n = *num_seqs;
  return n < 0 ? 0 : (n > max_num_seqs ? max_num_seqs : n);
}

// ------------------------------------------------------------------------------------------------
// Prefill
// ------------------------------------------------------------------------------------------------

struct PrefillArgs {
  const __nv_bfloat16* q;  // [T, q_stride]
  int64_t q_stride;
  const int32_t* cu_seqlens_q;  // [max_num_seqs + 1]
  const int32_t* seq_lens;      // [max_num_seqs]
  const int32_t* num_seqs;      // [1]
  const __nv_bfloat16* k_cache;  // [num_blocks, nkv, block_size, hd]
  const __nv_bfloat16* v_cache;
  const int32_t* block_table;  // [max_num_seqs, max_blocks_per_seq]
  AttentionDims dims;
  int max_num_seqs;
  float scale_log2;
  __nv_bfloat16* out;  // [T, nh, hd]
};

template <int HD>
constexpr int prefill_smem_bytes() {
  return (kPrefillBM + 2 * 2 * kPrefillBN) * HD * 2;
}

template <int HD>
__global__ void __launch_bounds__(kThreads) attention_prefill_kernel(const PrefillArgs args) {
  constexpr int kTileBytes = kPrefillBN * HD * 2;
  extern __shared__ __align__(128) uint8_t smem[];
  const int s = blockIdx.z, kvh = blockIdx.y;
  const int tile = gridDim.x - 1 - blockIdx.x;  // heaviest (last) row tiles first
  pdl_wait();  // q and the new K/V rows come from the rope kernel
  pdl_launch_dependents();
  if (s >= live_seqs(args.num_seqs, args.max_num_seqs)) return;
  const AttentionDims& d = args.dims;
  const int G = d.num_q_heads / d.num_kv_heads;
  const int q_start = args.cu_seqlens_q[s];
  const int q_len = args.cu_seqlens_q[s + 1] - q_start;
  const int rows = q_len * G;
  const int row0 = tile * kPrefillBM;
  if (row0 >= rows) return;
  const int ctx0 = args.seq_lens[s] - q_len;  // position of the first new token
  const int last_row = min(row0 + kPrefillBM, rows) - 1;
  const int kv_end = ctx0 + last_row / G + 1;   // keys this block needs: [0, kv_end)
  const int mask_from = ctx0 + row0 / G;        // keys <= this are visible to every row
  const int n_tiles = (kv_end + kPrefillBN - 1) / kPrefillBN;
  const int32_t* table_row = args.block_table + static_cast<int64_t>(s) * d.max_blocks_per_seq;

  const uint32_t q_tile = smem_addr(smem);
  const uint32_t kv_base = q_tile + kPrefillBM * HD * 2;  // stage i: K at +2i*kTileBytes, V after it
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  // Q rows (token r / G, head kvh * G + r % G), zero past the sequence's rows.
  {
    constexpr int C = HD / 8;
    for (int idx = tid; idx < kPrefillBM * C; idx += kThreads) {
      const int r = idx / C, c = idx % C, pr = row0 + r;
      const __nv_bfloat16* src = args.q;
      int bytes = 0;
      if (pr < rows) {
        src = args.q + (q_start + pr / G) * args.q_stride + static_cast<int64_t>(kvh * G + pr % G) * HD + c * 8;
        bytes = 16;
      }
      cp_async16(q_tile + tile_offset<HD>(r, c), src, bytes);
    }
  }
  const bool one_block = d.block_size % kPrefillBN == 0;  // tiles start at multiples of kPrefillBN
  const int block_shift = pow2_shift(d.block_size);
  auto load_stage = [&](int it) {
    const uint32_t k_dst = kv_base + (it & 1) * 2 * kTileBytes;
    if (one_block) {  // [TAG_ATTN_KV_ONE_BLOCK]
      load_kv_tile_pair_one_block<HD, kPrefillBN, kThreads>(k_dst, k_dst + kTileBytes, args.k_cache, args.v_cache,
                                                            table_row, kvh, it * kPrefillBN, kv_end, d.num_kv_heads,
                                                            d.block_size, tid);
      return;
    }
    if (block_shift >= 0) {
      load_kv_tile_pair_pow2<HD, kPrefillBN, kThreads>(k_dst, k_dst + kTileBytes, args.k_cache, args.v_cache,
                                                       table_row, kvh, it * kPrefillBN, kv_end, d.num_kv_heads,
                                                       block_shift, tid);
      return;
    }
    load_kv_tile<HD, kPrefillBN, kThreads>(k_dst, args.k_cache, table_row, kvh, it * kPrefillBN, kv_end,
                                           d.num_kv_heads, d.block_size, tid);
    load_kv_tile<HD, kPrefillBN, kThreads>(k_dst + kTileBytes, args.v_cache, table_row, kvh, it * kPrefillBN,
                                           kv_end, d.num_kv_heads, d.block_size, tid);
  };
  load_stage(0);
  cp_async_commit();

  const int g = lane >> 2;
  int lim[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int pr = row0 + warp * 16 + g + 8 * h;
    lim[h] = pr < rows ? ctx0 + pr / G : -1;
  }
  WarpState<HD> st;
  st.init();
  uint32_t qa[HD / 16][4];
  for (int it = 0; it < n_tiles; ++it) {
    if (it + 1 < n_tiles) load_stage(it + 1);
    cp_async_commit();  // possibly empty: keeps the group count uniform
    cp_async_wait<1>();
    __syncthreads();
    if (it == 0) load_q_frags<HD>(qa, q_tile, warp * 16, lane);
    const uint32_t k_tile = kv_base + (it & 1) * 2 * kTileBytes;
    const int key0 = it * kPrefillBN;
    attend_tile<HD, kPrefillBN>(st, qa, k_tile, k_tile + kTileBytes, key0, lim, key0 + kPrefillBN - 1 > mask_from,
                                args.scale_log2, lane);
    __syncthreads();  // the stage is overwritten by the next iteration's loads
  }
  finish_sums(st);

  // out[row] = o / l, bf16 pairs.
  const int t = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int pr = row0 + warp * 16 + g + 8 * h;
    if (pr >= rows) continue;
    const float inv = st.l[h] > 0.0f ? 1.0f / st.l[h] : 0.0f;
    __nv_bfloat16* o = args.out + (static_cast<int64_t>(q_start + pr / G) * d.num_q_heads + kvh * G + pr % G) * HD;
#pragma unroll
    for (int j = 0; j < HD / 8; ++j)
      *reinterpret_cast<uint32_t*>(o + j * 8 + 2 * t) = pack_bf16(st.o[j][2 * h] * inv, st.o[j][2 * h + 1] * inv);
  }
}

// ------------------------------------------------------------------------------------------------
// Decode
// ------------------------------------------------------------------------------------------------

// Workspace layout ([TAG_ATTN_DECODE_WORKSPACE], also in attention_decode_workspace_bytes): counters
// [max_num_seqs * nkv] int32, then (max, sum) float2 [slots, G], then fp32 partial outputs
// [slots, G, hd], slots = max_num_seqs * nkv * max_splits in (sequence, kv head, split) order, each
// region 256-byte aligned.
struct DecodeWorkspace {
  size_t counter_bytes, ml_bytes, o_bytes;
};
inline size_t align256(size_t n) { return (n + 255) / 256 * 256; }
DecodeWorkspace decode_workspace_layout(const AttentionDims& d, const AttentionDecodePlan& p) {
  const size_t G = static_cast<size_t>(d.num_q_heads / d.num_kv_heads);
  const size_t slots = static_cast<size_t>(p.max_num_seqs) * d.num_kv_heads * p.max_splits;
  return DecodeWorkspace{align256(static_cast<size_t>(p.max_num_seqs) * d.num_kv_heads * 4), align256(slots * G * 8),
                         align256(slots * G * d.head_dim * 4)};
}

struct DecodeArgs {
  AttentionDecodeToken token;  // raw q/k/v of the new token, norm weights, inv_freq, eps
  const int32_t* seq_lens;     // [max_num_seqs]
  const int32_t* num_seqs;     // [1]
  __nv_bfloat16* k_cache;      // [num_blocks, nkv, block_size, hd]: the newest row written here
  __nv_bfloat16* v_cache;
  const int32_t* block_table;  // [max_num_seqs, max_blocks_per_seq]
  AttentionDims dims;
  int max_num_seqs;
  int max_splits;
  float scale_log2;
  bool cluster_merge;  // [TAG_ATTN_CLUSTER_MERGE]: the grid's x dimension is one cluster (max_splits blocks)
  int* counters;  // [max_num_seqs, nkv]: splits of the (sequence, kv head) finished so far; 0 between launches
  float2* ws_ml;  // [max_num_seqs, nkv, max_splits, G]: (max in the log2 domain, sum) of a split's rows
  float* ws_o;    // [max_num_seqs, nkv, max_splits, G, hd]: a split's output, not yet divided by its sum
  __nv_bfloat16* out;  // [max_num_seqs, nh, hd]
};

// Shared memory: Q tile 16 x hd bf16, then the warps' K/V rings. After the key loop the rings are
// reused: the 4 warps' fp32 states [4][16][hd], later the merge's per-split weights [2][16][256].
template <int HD, int ST = kDecodeStages>
constexpr int decode_smem_bytes() {
  constexpr int rings = kWarps * ST * 2 * kDecodeBN * HD * 2;  // 128 KiB at hd 128, 4 stages
  constexpr int states = kWarps * 16 * HD * 4;
  constexpr int merge = 2 * 16 * kDecodeMaxSplits * 4;  // 32 KiB
  // Then the cluster merge's region ([TAG_ATTN_CLUSTER_MERGE]): partial outputs [rows][HD] fp32 and
  // their (max, sum) [rows] float2, written by every split of the cluster into the leader's copy.
  // Its own region, not the ring: a split that finishes early must not write over the ring of a
  // leader that is still streaming keys.
  constexpr int partials = kDecodeClusterRows * HD * 4 + kDecodeClusterRows * 8;  // 65 KiB at hd 128
  return 16 * HD * 2 + std::max(rings, std::max(states, merge)) + partials;
}
template <int HD, int ST = kDecodeStages>
constexpr int decode_partials_offset() {
  return decode_smem_bytes<HD, ST>() - (kDecodeClusterRows * HD * 4 + kDecodeClusterRows * 8);
}
// Splits one cluster can merge for G query heads per kv head.
inline int decode_cluster_cap(int G) { return std::min(kDecodeMaxCluster, kDecodeClusterRows / G); }

__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// Shared-memory address of the same variable in block `rank` of the cluster (DSMEM).
__device__ __forceinline__ uint32_t cluster_map(uint32_t local, int rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
__device__ __forceinline__ void st_cluster_f32(uint32_t addr, float v) {
  asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory");
}
__device__ __forceinline__ void st_cluster_f32x2(uint32_t addr, float a, float b) {
  asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(a), "f"(b) : "memory");
}

// One head row of the new token through QK-norm and RoPE, by one warp, in rope.cu's arithmetic
// (same operations in the same order, so the bits of the prefill path's rope kernel): lane l holds
// the pairs (2l, 2l+1) and (hd/2 + 2l, hd/2 + 2l + 1); lanes with 2l >= hd/2 hold nothing (hd <=
// 128). Split in two so that a warp issues all its rows' loads before the first math waits on one.
struct RowPairs {
  float2 a, b;  // (x[i], x[i+1]), (x[hd/2+i], x[hd/2+i+1]), i = 2 * lane
};
template <int HD>
__device__ __forceinline__ bool lane_holds_pairs(int lane) {
  static_assert(HD <= 128, "one pair of pairs per lane");
  return 2 * lane < HD / 2;
}
template <int HD>
__device__ __forceinline__ RowPairs load_row_pairs(const __nv_bfloat16* __restrict__ src, int lane) {
  RowPairs p{make_float2(0.0f, 0.0f), make_float2(0.0f, 0.0f)};
  if (lane_holds_pairs<HD>(lane)) {
    p.a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(src + 2 * lane));
    p.b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(src + HD / 2 + 2 * lane));
  }
  return p;
}
// The lane's norm weights (w[i], w[i+1], w[hd/2+i], w[hd/2+i+1]); w == nullptr: none.
template <int HD>
__device__ __forceinline__ float4 load_norm_pairs(const float* __restrict__ w, int lane) {
  if (w == nullptr || !lane_holds_pairs<HD>(lane)) return make_float4(1.0f, 1.0f, 1.0f, 1.0f);
  const int i = 2 * lane;
  return make_float4(w[i], w[i + 1], w[HD / 2 + i], w[HD / 2 + i + 1]);
}
// norm: RMSNorm with weights w (all lanes of the warp must call: a shuffle sum); rotate: RoPE with
// the position's table. Returns the pairs packed as bf16x2 (lo: first half, hi: second).
template <int HD>
__device__ __forceinline__ void finish_row(RowPairs p, bool norm, float4 w, bool rotate, float eps,
                                           const float* s_cos, const float* s_sin, int lane, uint32_t& lo,
                                           uint32_t& hi) {
  float ss = 0.0f;
  ss += p.a.x * p.a.x + p.a.y * p.a.y + p.b.x * p.b.x + p.b.y * p.b.y;  // zero on lanes without pairs
  float inv = 1.0f;
  if (norm) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    inv = 1.0f / sqrtf(ss / static_cast<float>(HD) + eps);
  }
  lo = hi = 0;
  if (!lane_holds_pairs<HD>(lane)) return;
  const int i = 2 * lane;
  float2 x = p.a, y = p.b;
  rope_detail::norm_rope_pair(x, y, norm, inv, w, rotate, s_cos, s_sin, i);  // rope.cu's arithmetic
  lo = pack_bf16(x.x, x.y);
  hi = pack_bf16(y.x, y.y);
}

// Stores a row held as finish_row's (lo, hi) into row r of a swizzled [*][HD] tile.
template <int HD>
__device__ __forceinline__ void store_tile_row(uint32_t tile, int r, int lane, uint32_t lo, uint32_t hi) {
  constexpr int half = HD / 2;
  const int i = 2 * lane;
  if (i >= half) return;
  const uint32_t at_lo = tile + tile_offset<HD>(r, i / 8) + (i % 8) * 2;
  const uint32_t at_hi = tile + tile_offset<HD>(r, (half + i) / 8) + ((half + i) % 8) * 2;
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at_lo), "r"(lo));
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at_hi), "r"(hi));
}

template <int HD, int ST>
__global__ void __launch_bounds__(kThreads) attention_decode_kernel(const DecodeArgs args) {
  constexpr int kTileBytes = kDecodeBN * HD * 2;
  constexpr int kWarpBytes = ST * 2 * kTileBytes;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ float s_m[kWarps][16], s_l[kWarps][16];
  __shared__ float s_cos[HD / 2], s_sin[HD / 2];
  __shared__ int s_last;
  const int split = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z;
  // Trigger before the wait ([TAG_PDL_EARLY_TRIGGER]): the o projection's GEMV after this kernel
  // touches nothing but its weights before its own wait, and it streams them into shared memory
  // while attention still runs.
  pdl_launch_dependents();
  // [TAG_ATTN_DECODE_PREWAIT] Before the wait this block reads only what no kernel of the step
  // writes: num_seqs, seq_lens and the block table (uploaded before the step's first kernel),
  // inv_freq (a constant), and the cache rows of positions < seq_len - 1 (written by earlier
  // steps; position seq_len - 1 is this step's token, whose K/V row THIS kernel computes and
  // writes, into a block no other sequence reads). So the RoPE table and the first K/V tiles are
  // under way while the qkv GEMV still runs; the new token's q/k/v are read after the wait.
  if (s >= live_seqs(args.num_seqs, args.max_num_seqs)) {
    // Blocks without work exit before the wait, but one block always waits, so that this kernel's
    // completion still implies its predecessor's when no sequence is live (pdl.cuh: completion is
    // transitive only through a wait). With a live sequence its split 0 waits.
    if (s == 0 && split == 0 && kvh == 0) pdl_wait();
    return;
  }
  const AttentionDims& d = args.dims;
  const AttentionDecodeToken& tok = args.token;
  const int G = d.num_q_heads / d.num_kv_heads;
  const int ctx = args.seq_lens[s];
  const AttentionDecodeSplit sp = attention_decode_split(ctx, args.max_splits);
  if (split >= sp.splits) return;  // [TAG_ATTN_DECODE_SPLIT] the merge reads exactly splits 0 .. sp.splits-1
  // [TAG_ATTN_CLUSTER_MERGE] Phase 0 of the cluster barrier: its wait, before the first store into
  // the leader's shared memory, guarantees that every block of the cluster has started. Blocks
  // that exit above (no keys) never arrive; the barrier waits only for threads that have not exited.
  const bool in_cluster = args.cluster_merge && sp.splits > 1;
  if (in_cluster) cluster_arrive_relaxed();
  const int k_begin = split * sp.partition;
  const int k_end = min(ctx, k_begin + sp.partition);
  const int newest = ctx - 1;  // the new token's position and key
  const int n_tiles = (k_end - k_begin + kDecodeBN - 1) / kDecodeBN;
  const int32_t* table_row = args.block_table + static_cast<int64_t>(s) * d.max_blocks_per_seq;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  const uint32_t q_tile = smem_addr(smem);
  const uint32_t warp_base = q_tile + 16 * HD * 2 + warp * kWarpBytes;
  // Warp w takes tiles w, w + 4, ...; its i-th tile sits in stage i % ST. Every load
  // skips the newest key's row: it is computed here and stored into its stage from registers.
  const int my_tiles = n_tiles > warp ? (n_tiles - warp + kWarps - 1) / kWarps : 0;
  // k_begin is 0 or a multiple of the partition, itself a multiple of kDecodeBN, so every tile
  // starts at a multiple of kDecodeBN.
  const bool one_block = d.block_size % kDecodeBN == 0;
  const int block_shift = pow2_shift(d.block_size);
  auto load_stage = [&](int i) {
    const uint32_t dst = warp_base + (i % ST) * 2 * kTileBytes;
    const int key0 = k_begin + (warp + i * kWarps) * kDecodeBN;
    if (one_block) {  // [TAG_ATTN_KV_ONE_BLOCK]
      load_kv_tile_pair_one_block<HD, kDecodeBN, 32>(dst, dst + kTileBytes, args.k_cache, args.v_cache, table_row, kvh,
                                                     key0, k_end, d.num_kv_heads, d.block_size, lane, newest);
      return;
    }
    if (block_shift >= 0) {
      load_kv_tile_pair_pow2<HD, kDecodeBN, 32>(dst, dst + kTileBytes, args.k_cache, args.v_cache, table_row, kvh, key0,
                                                k_end, d.num_kv_heads, block_shift, lane, newest);
      return;
    }
    load_kv_tile<HD, kDecodeBN, 32>(dst, args.k_cache, table_row, kvh, key0, k_end, d.num_kv_heads, d.block_size,
                                    lane, newest);
    load_kv_tile<HD, kDecodeBN, 32>(dst + kTileBytes, args.v_cache, table_row, kvh, key0, k_end, d.num_kv_heads,
                                    d.block_size, lane, newest);
  };
  // Prologue before the wait: the warp's first three tiles, then the RoPE table of the position
  // (cos/sin in double, rounded to fp32, as rope.cu and the CPU reference form them).
#pragma unroll
  for (int i = 0; i < ST - 1; ++i) {
    if (i < my_tiles) load_stage(i);
    cp_async_commit();
  }
  for (int i = tid; i < HD / 2; i += kThreads) {
    const float angle = static_cast<float>(newest) * tok.inv_freq[i];  // fp32 product, like the reference
    double sn, cs;
    sincos(static_cast<double>(angle), &sn, &cs);
    s_cos[i] = static_cast<float>(cs);
    s_sin[i] = static_cast<float>(sn);
  }
  // Where the newest key sits, if this split holds it (the last split does): tile, warp, stage.
  const bool has_newest = newest >= k_begin && newest < k_end;
  const int new_tile = (newest - k_begin) / kDecodeBN;
  const int new_i = new_tile / kWarps, new_r = (newest - k_begin) % kDecodeBN;
  const bool owns_newest = has_newest && new_tile % kWarps == warp;
  // Norm weights are constants: in registers before the wait too.
  const float4 wq = load_norm_pairs<HD>(tok.q_norm, lane);
  const float4 wk = load_norm_pairs<HD>(tok.k_norm, lane);
  __syncthreads();  // the RoPE table

  pdl_wait();  // the new token's q/k/v come from the qkv GEMV

  // Warp w takes q heads kvh * G + r for r = w, w + 4, w + 8, w + 12 (< G; rows G .. 15 of the m16
  // tile are zero) and, if it owns the newest key, the k and v rows: every load first, one L2
  // round trip, then the math.
  constexpr int kRowsPerWarp = 16 / kWarps;
  RowPairs qp[kRowsPerWarp], kp{}, vp{};
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int r = warp + kWarps * j;
    qp[j] = RowPairs{make_float2(0.0f, 0.0f), make_float2(0.0f, 0.0f)};
    if (r < G) qp[j] = load_row_pairs<HD>(tok.q + s * tok.q_stride + static_cast<int64_t>(kvh * G + r) * HD, lane);
  }
  if (owns_newest) {
    kp = load_row_pairs<HD>(tok.k + s * tok.k_stride + static_cast<int64_t>(kvh) * HD, lane);
    vp = load_row_pairs<HD>(tok.v + s * tok.v_stride + static_cast<int64_t>(kvh) * HD, lane);
  }
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int r = warp + kWarps * j;
    uint32_t lo = 0, hi = 0;
    if (r < G) finish_row<HD>(qp[j], tok.q_norm != nullptr, wq, true, tok.eps, s_cos, s_sin, lane, lo, hi);
    store_tile_row<HD>(q_tile, r, lane, lo, hi);
  }
  // The newest K/V row: the owning warp of the split that holds it writes it to the cache for
  // later steps and keeps it in registers for its ring stage.
  uint32_t k_lo = 0, k_hi = 0, v_lo = 0, v_hi = 0;
  if (owns_newest) {
    finish_row<HD>(kp, tok.k_norm != nullptr, wk, true, tok.eps, s_cos, s_sin, lane, k_lo, k_hi);
    finish_row<HD>(vp, false, wk, false, tok.eps, s_cos, s_sin, lane, v_lo, v_hi);
    if (lane_holds_pairs<HD>(lane)) {  // [TAG_KV_CACHE_LAYOUT]
      const int i = 2 * lane;
      const int64_t off = kv_cache_offset(table_row[newest / d.block_size], kvh, newest % d.block_size,
                                          d.num_kv_heads, d.block_size, HD);
      *reinterpret_cast<uint32_t*>(args.k_cache + off + i) = k_lo;
      *reinterpret_cast<uint32_t*>(args.k_cache + off + HD / 2 + i) = k_hi;
      *reinterpret_cast<uint32_t*>(args.v_cache + off + i) = v_lo;
      *reinterpret_cast<uint32_t*>(args.v_cache + off + HD / 2 + i) = v_hi;
    }
    if (new_i < ST - 1) {  // a prologue stage: store it now
      const uint32_t stage = warp_base + new_i * 2 * kTileBytes;
      store_tile_row<HD>(stage, new_r, lane, k_lo, k_hi);
      store_tile_row<HD>(stage + kTileBytes, new_r, lane, v_lo, v_hi);
    }
  }
  // The prologue tiles (requested before the wait, mostly landed by now), then the block barrier
  // for Q.
  cp_async_wait<0>();
  __syncthreads();
  uint32_t qa[HD / 16][4];
  load_q_frags<HD>(qa, q_tile, 0, lane);

  WarpState<HD> st;
  st.init();
  const int lim[2] = {k_end - 1, k_end - 1};
  for (int i = 0; i < my_tiles; ++i) {
    if (i + ST - 1 < my_tiles) {
      const int j = i + ST - 1;
      load_stage(j);
      if (owns_newest && j == new_i) {  // the newest row into its stage, from registers
        const uint32_t stage = warp_base + (j % ST) * 2 * kTileBytes;
        store_tile_row<HD>(stage, new_r, lane, k_lo, k_hi);
        store_tile_row<HD>(stage + kTileBytes, new_r, lane, v_lo, v_hi);
      }
    }
    cp_async_commit();
    cp_async_wait<ST - 1>();
    __syncwarp();
    const uint32_t k_tile = warp_base + (i % ST) * 2 * kTileBytes;
    const int key0 = k_begin + (warp + i * kWarps) * kDecodeBN;
    attend_tile<HD, kDecodeBN>(st, qa, k_tile, k_tile + kTileBytes, key0, lim, key0 + kDecodeBN > k_end,
                               args.scale_log2, lane);
    __syncwarp();  // every lane is done with the stage before it is refilled
  }
  cp_async_wait<0>();
  finish_sums(st);

  // Merge the 4 warps: their states go to shared memory (over the K/V rings, now unused).
  __syncthreads();
  float* s_o = reinterpret_cast<float*>(smem + 16 * HD * 2);  // [kWarps][16][HD]
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    if (t == 0) {
      s_m[warp][r] = st.m[h];
      s_l[warp][r] = st.l[h];
    }
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) {
      s_o[(warp * 16 + r) * HD + j * 8 + 2 * t] = st.o[j][2 * h];
      s_o[(warp * 16 + r) * HD + j * 8 + 2 * t + 1] = st.o[j][2 * h + 1];
    }
  }
  __syncthreads();
  const bool direct = sp.splits == 1;
  const int64_t pair = static_cast<int64_t>(s) * d.num_kv_heads + kvh;  // (sequence, kv head)
  const int64_t slot0 = pair * args.max_splits;                          // its split 0
  // [TAG_ATTN_CLUSTER_MERGE] The leader's partial region (rank 0 = split 0: the cluster spans the
  // grid's x dimension): row (split, r) of the outputs and its (max, sum).
  const uint32_t part_local = smem_addr(smem + decode_partials_offset<HD, ST>());
  const uint32_t ml_local = part_local + kDecodeClusterRows * HD * 4;
  uint32_t part_leader = 0, ml_leader = 0;
  if (in_cluster) {
    cluster_wait_acquire();  // phase 0: the leader has started
    part_leader = cluster_map(part_local, 0);
    ml_leader = cluster_map(ml_local, 0);
  }
  for (int idx = tid; idx < G * HD; idx += kThreads) {
    const int r = idx / HD, c = idx % HD;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, s_m[w][r]);
    float L = 0.0f, O = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = s_m[w][r] == -INFINITY ? 0.0f : exp2f(s_m[w][r] - M);  // a warp without tiles
      L += s_l[w][r] * f;
      O += s_o[(w * 16 + r) * HD + c] * f;
    }
    if (direct) {
      args.out[(static_cast<int64_t>(s) * d.num_q_heads + kvh * G + r) * HD + c] = __float2bfloat16(O / L);
    } else if (in_cluster) {
      const int row = split * G + r;
      st_cluster_f32(part_leader + static_cast<uint32_t>(row * HD + c) * 4, O);
      if (c == 0) st_cluster_f32x2(ml_leader + static_cast<uint32_t>(row) * 8, M, L);
    } else {
      const int64_t row = (slot0 + split) * G + r;
      args.ws_o[row * HD + c] = O;
      if (c == 0) args.ws_ml[row] = make_float2(M, L);
    }
  }
  if (direct) return;
  if (in_cluster) {
    // Phase 1: the partials are in the leader's shared memory (release / acquire). The other
    // splits leave: nobody reads their shared memory.
    cluster_arrive_release();
    if (split != 0) return;
    cluster_wait_acquire();
    // The merge, in split order 0 .. n-1 from shared memory: out = (sum_i e_i o_i) / (sum_i e_i l_i),
    // e_i = 2^(m_i - M). Bit-reproducible (a fixed order per element).
    const int n = sp.splits;
    const float* part = reinterpret_cast<const float*>(smem + decode_partials_offset<HD, ST>());
    const float2* ml = reinterpret_cast<const float2*>(part + kDecodeClusterRows * HD);
    for (int p = tid; p < G * (HD / 4); p += kThreads) {
      const int r = p / (HD / 4), c4 = p % (HD / 4);
      float M = -INFINITY;
      for (int i = 0; i < n; ++i) M = fmaxf(M, ml[i * G + r].x);
      float L = 0.0f;
      float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      for (int i = 0; i < n; ++i) {
        const float2 mli = ml[i * G + r];
        const float e = mli.x == -INFINITY ? 0.0f : exp2f(mli.x - M);
        const float4 v = reinterpret_cast<const float4*>(part + (i * G + r) * HD)[c4];
        L = fmaf(mli.y, e, L);
        acc.x = fmaf(e, v.x, acc.x);
        acc.y = fmaf(e, v.y, acc.y);
        acc.z = fmaf(e, v.z, acc.z);
        acc.w = fmaf(e, v.w, acc.w);
      }
      const float inv = 1.0f / L;
      uint2 packed;
      packed.x = pack_bf16(acc.x * inv, acc.y * inv);
      packed.y = pack_bf16(acc.z * inv, acc.w * inv);
      *reinterpret_cast<uint2*>(args.out + (static_cast<int64_t>(s) * d.num_q_heads + kvh * G + r) * HD + c4 * 4) =
          packed;
    }
    return;
  }

  // Arrival: every thread fences its partial writes (device scope) before the barrier, then one
  // atomic. The block that brings the count to sp.splits saw every other split's fence-ordered
  // writes, merges, and resets the counter for the next launch (graph replays need no memset).
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    const int done = atomicAdd(args.counters + pair, 1) + 1;
    s_last = done == sp.splits;
    if (done == sp.splits) args.counters[pair] = 0;  // every split has arrived: nobody else touches it now
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();  // acquire side: the partials below are read after the count was seen

  // The merge, in split order 0 .. n-1 whatever order the splits finished in: bit-reproducible.
  // Partials come through L2 (__ldcg: the L1 of this SM never held them, but be explicit).
  const int n = sp.splits;
  float* s_wm = reinterpret_cast<float*>(smem + 16 * HD * 2);  // [16][kDecodeMaxSplits]: max, then weight
  float* s_wl = s_wm + 16 * kDecodeMaxSplits;                   // [16][kDecodeMaxSplits]: sums
  for (int idx = tid; idx < n * G; idx += kThreads) {
    const int i = idx / G, r = idx % G;
    const float2 ml = __ldcg(args.ws_ml + (slot0 + i) * G + r);
    s_wm[r * kDecodeMaxSplits + i] = ml.x;
    s_wl[r * kDecodeMaxSplits + i] = ml.y;
  }
  __syncthreads();
  // Row r's weights w_i = 2^(m_i - M) / L by one warp: lane-strided partial max and sum, then xor
  // butterflies (every lane ends with the same bits: each step adds the same two values).
  for (int r = warp; r < G; r += kWarps) {
    float* wm = s_wm + r * kDecodeMaxSplits;
    const float* wl = s_wl + r * kDecodeMaxSplits;
    float M = -INFINITY;
    for (int i = lane; i < n; i += 32) M = fmaxf(M, wm[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    float L = 0.0f;
    for (int i = lane; i < n; i += 32) L += wl[i] * exp2f(wm[i] - M);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
    const float inv = 1.0f / L;
    for (int i = lane; i < n; i += 32) wm[i] = exp2f(wm[i] - M) * inv;
  }
  __syncthreads();
  // out = sum_i w_i o_i, 4 dims per thread and step; 16 splits' float4 loads in flight per batch
  // (L2 latency, not bandwidth, bounds this tail: Qwen3-30B-A3B merges 16 splits x 8 heads x
  // 512 B = 64 KB per block at 1k context, 33 splits = 135 KB at 10k: 2 and 6 round trips).
  constexpr int kBatch = 16;
  const int64_t split_stride = static_cast<int64_t>(G) * (HD / 4);  // float4s per split
  for (int p = tid; p < G * (HD / 4); p += kThreads) {
    const int r = p / (HD / 4), c4 = p % (HD / 4);
    const float4* src = reinterpret_cast<const float4*>(args.ws_o) + slot0 * split_stride + p;
    const float* w = s_wm + r * kDecodeMaxSplits;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int i0 = 0; i0 < n; i0 += kBatch) {
      float4 v[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        v[j] = i0 + j < n ? __ldcg(src + (i0 + j) * split_stride) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (i0 + j < n) {
          const float wj = w[i0 + j];
          acc.x = fmaf(wj, v[j].x, acc.x);
          acc.y = fmaf(wj, v[j].y, acc.y);
          acc.z = fmaf(wj, v[j].z, acc.z);
          acc.w = fmaf(wj, v[j].w, acc.w);
        }
      }
    }
    uint2 packed;
    packed.x = pack_bf16(acc.x, acc.y);
    packed.y = pack_bf16(acc.z, acc.w);
    *reinterpret_cast<uint2*>(args.out + (static_cast<int64_t>(s) * d.num_q_heads + kvh * G + r) * HD + c4 * 4) =
        packed;
  }
}

// ------------------------------------------------------------------------------------------------
// Launch helpers
// ------------------------------------------------------------------------------------------------

void check_common(const AttentionDims& d, const void* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                  const void* out) {
  MOEBIUS_LAUNCH_ASSERT(d.head_dim == 16 || d.head_dim == 64 || d.head_dim == 128, "attention: hd must be 16, 64 or 128");
  MOEBIUS_LAUNCH_ASSERT(d.num_kv_heads > 0 && d.num_q_heads > 0 && d.num_q_heads % d.num_kv_heads == 0,
                        "attention: nkv must divide nh");
  MOEBIUS_LAUNCH_ASSERT(d.block_size > 0 && d.max_blocks_per_seq > 0, "attention: bad block_size / block table");
  MOEBIUS_LAUNCH_ASSERT(q_stride % 8 == 0 && q_stride >= static_cast<int64_t>(d.num_q_heads) * d.head_dim,
                        "attention: q_stride must be a multiple of 8 and >= nh * hd");
  for (const void* p : {q, k_cache, v_cache, out})
    MOEBIUS_LAUNCH_ASSERT(reinterpret_cast<uintptr_t>(p) % 16 == 0, "attention: pointers must be 16-byte aligned");
}

template <typename Kernel>
void set_smem(Kernel kernel, int bytes) {
  // Once per instantiation would do; the call is cheap and not a stream operation, so it is legal
  // during graph capture.
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

template <int HD>
void launch_prefill_hd(const PrefillArgs& a, int max_q_len, cudaStream_t stream) {
  const int G = a.dims.num_q_heads / a.dims.num_kv_heads;
  const int64_t tiles = (static_cast<int64_t>(max_q_len) * G + kPrefillBM - 1) / kPrefillBM;
  MOEBIUS_LAUNCH_ASSERT(tiles < (int64_t{1} << 31), "attention prefill: too many query rows");
  constexpr int smem = prefill_smem_bytes<HD>();
  set_smem(attention_prefill_kernel<HD>, smem);
  const dim3 grid(static_cast<unsigned>(tiles), a.dims.num_kv_heads, a.max_num_seqs);
  launch_pdl(attention_prefill_kernel<HD>, grid, dim3(kThreads), smem, stream, a);
}

// MOEBIUS_ATTN_DECODE_STAGES=2|4 overrides the plan's ring stages (A/B runs); 0: the plan decides.
int forced_decode_stages() {
  static const int st = [] {
    const char* e = std::getenv("MOEBIUS_ATTN_DECODE_STAGES");
    if (e == nullptr) return 0;
    return e[0] == '2' ? 2 : e[0] == '4' ? 4 : 0;
  }();
  return st;
}

// MOEBIUS_ATTN_DECODE_MAX_SPLITS=n (1..256) caps every decode plan at n splits per (sequence, kv
// head), on clusters whenever they are all resident at once, whatever the cost model says: a
// model-level sweep of the split count (`bench attention --max-splits` sweeps the kernel alone;
// in the model, run P5 found the kernel's resources mattered beside the qkv GEMV's blocks). 0 or
// unset: the planner's choice.
int forced_decode_max_splits() {
  static const int n = [] {
    const char* e = std::getenv("MOEBIUS_ATTN_DECODE_MAX_SPLITS");
    if (e == nullptr) return 0;
    const int v = std::atoi(e);
    return v >= 1 && v <= kDecodeMaxSplits ? v : 0;
  }();
  return n;
}

template <int HD, int ST>
void launch_decode_hd_st(const DecodeArgs& a, cudaStream_t stream) {
  constexpr int smem = decode_smem_bytes<HD, ST>();
  set_smem(attention_decode_kernel<HD, ST>, smem);
  const dim3 grid(a.max_splits, a.dims.num_kv_heads, a.max_num_seqs);
  if (a.cluster_merge) {  // [TAG_ATTN_CLUSTER_MERGE] one cluster per (sequence, kv head)
    if (a.max_splits > 8)
      CUDA_CHECK(cudaFuncSetAttribute(attention_decode_kernel<HD, ST>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    launch_pdl_cluster(attention_decode_kernel<HD, ST>, grid, dim3(kThreads), smem, a.max_splits, stream, a);
    return;
  }
  launch_pdl(attention_decode_kernel<HD, ST>, grid, dim3(kThreads), smem, stream, a);
}
template <int HD>
void launch_decode_hd(const DecodeArgs& a, int stages, cudaStream_t stream) {
  if (stages == 2) launch_decode_hd_st<HD, 2>(a, stream);
  else launch_decode_hd_st<HD, kDecodeStages>(a, stream);
}

// Clusters of `cluster` decode blocks that can be resident at once on the current device, with the
// larger (4-stage) blocks: a cluster that fits with them fits with 2-stage blocks too.
template <int HD>
int decode_max_active_clusters_hd(int cluster) {
  constexpr int smem = decode_smem_bytes<HD, kDecodeStages>();
  set_smem(attention_decode_kernel<HD, kDecodeStages>, smem);
  if (cluster > 8)
    CUDA_CHECK(cudaFuncSetAttribute(attention_decode_kernel<HD, kDecodeStages>,
                                    cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(cluster, 1, 1);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[1] = {cluster_x_attribute(cluster)};
  config.attrs = attr;
  config.numAttrs = 1;
  int n = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, attention_decode_kernel<HD, kDecodeStages>, &config));
  return n;
}
int decode_max_active_clusters(const AttentionDims& d, int cluster) {
  switch (d.head_dim) {
    case 16: return decode_max_active_clusters_hd<16>(cluster);
    case 64: return decode_max_active_clusters_hd<64>(cluster);
    default: return decode_max_active_clusters_hd<128>(cluster);
  }
}

}  // namespace

void launch_attention_prefill(const __nv_bfloat16* q, int64_t q_stride, const int32_t* cu_seqlens_q,
                              const int32_t* seq_lens, const int32_t* num_seqs, const __nv_bfloat16* k_cache,
                              const __nv_bfloat16* v_cache, const int32_t* block_table, const AttentionDims& dims,
                              int max_num_seqs, int max_q_len, __nv_bfloat16* out, cudaStream_t stream) {
  check_common(dims, q, q_stride, k_cache, v_cache, out);
  MOEBIUS_LAUNCH_ASSERT(max_num_seqs >= 0 && max_num_seqs <= 65535 && max_q_len >= 0,
                        "attention prefill: max_num_seqs must be in [0, 65535]");
  if (max_num_seqs == 0 || max_q_len == 0) return;
  const PrefillArgs a{q,       q_stride, cu_seqlens_q, seq_lens,     num_seqs,
                      k_cache, v_cache,  block_table,  dims,         max_num_seqs,
                      kLog2e / std::sqrt(static_cast<float>(dims.head_dim)), out};
  switch (dims.head_dim) {
    case 16: launch_prefill_hd<16>(a, max_q_len, stream); break;
    case 64: launch_prefill_hd<64>(a, max_q_len, stream); break;
    default: launch_prefill_hd<128>(a, max_q_len, stream); break;
  }
}

namespace {

bool cluster_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("MOEBIUS_ATTN_CLUSTER_MERGE");
    return e == nullptr || e[0] != '0';
  }();
  return on;
}

// The most splits (<= cap and <= wave) whose clusters, one per (sequence, kv head), are all
// resident at once; 1 when even pairs do not fit. GPCs of 14-18 SMs leave holes: run O4 measured a
// second wave of clusters at 1.4-2x the time.
int decode_cluster_splits(const AttentionDims& dims, int max_num_seqs, int wave) {
  const int64_t clusters = static_cast<int64_t>(max_num_seqs) * dims.num_kv_heads;
  int c = std::min(wave, attention_decode_cluster_cap(dims));
  while (c > 1 && decode_max_active_clusters(dims, c) < clusters) --c;
  return c;
}

// [TAG_ATTN_CLUSTER_MERGE] The cost model (runs O4-O5, H200, Qwen3-30B-A3B, batches 1-16): one split
// block streams ~73 keys per us (its per-tile chain, not HBM, bounds it: ~14 us per 1024 keys), and
// the cluster merge costs ~2.7 us less than the workspace merge. The cluster plan has fewer splits
// (c <= 16 against the wave's w), so it pays while the longer splits cost less than that:
// (keys per split at c - keys per split at w) / 73 < 2.7. Batch 1: up to ~6k keys; batch 2: ~4k.
constexpr double kDecodeUsPerSplitKey = 14.0 / 1024.0;
constexpr double kClusterMergeSavingUs = 2.7;
bool cluster_merge_pays(int context, int c, int w) {
  const AttentionDecodeSplit at_c = attention_decode_split(context, c), at_w = attention_decode_split(context, w);
  return (at_c.partition - at_w.partition) * kDecodeUsPerSplitKey < kClusterMergeSavingUs;
}

// [TAG_ATTN_PORTABLE_CLUSTER] A cluster of more than 8 blocks (the non-portable sizes, up to 16 on
// sm_90) is placed only on a GPC whose SMs are all free at once. Alone, in a chain of attention
// kernels, 16 splits won (run O4); inside the model, where the qkv GEMV's blocks still hold SMs when
// attention launches, 8 splits beat 16 at 1k context by 0.9-1.0 us a layer (runs V1b, W1: decode
// 416.7-418.1 against 409.0-410.2 tok/s; 4 splits lost, 393.3) and lost at 2k by 1.6 us (W1: 388.0
// against 400.2). Fitted to those two points, a split streams ~0.037 us a key inside the model
// (against 0.0137 alone) and the wider cluster pays ~3.3 us for its placement: the cluster drops
// to 8 blocks while its longer splits cost less than that (contexts up to ~1.4k at batch 1).
constexpr int kPortableClusterSplits = 8;
constexpr double kInModelUsPerSplitKey = 0.037;
constexpr double kNonPortableClusterUs = 3.3;
// MOEBIUS_ATTN_PORTABLE_CLUSTER=0 turns the rule off (the widest resident cluster, as before it).
bool portable_cluster_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("MOEBIUS_ATTN_PORTABLE_CLUSTER");
    return e == nullptr || e[0] != '0';
  }();
  return on;
}
bool portable_cluster_pays(int context, int c) {
  if (c <= kPortableClusterSplits || !portable_cluster_enabled()) return false;
  const AttentionDecodeSplit at_p = attention_decode_split(context, kPortableClusterSplits),
                             at_c = attention_decode_split(context, c);
  return (at_p.partition - at_c.partition) * kInModelUsPerSplitKey < kNonPortableClusterUs;
}

}  // namespace

AttentionDecodePlan plan_attention_decode(const AttentionDims& dims, int max_num_seqs, int max_context, int num_sms) {
  MOEBIUS_LAUNCH_ASSERT(max_num_seqs > 0 && max_context > 0 && num_sms > 0 && dims.num_kv_heads > 0,
                        "plan_attention_decode: bad sizes");
  // One wave: a decode block takes 132 KiB of shared memory at hd 128, so one per SM, and a second
  // wave of splits would only double the merge's partials. The longest context's split count
  // (attention_decode_split) bounds it from above.
  const int64_t base = static_cast<int64_t>(max_num_seqs) * dims.num_kv_heads;
  const int64_t wave = std::max<int64_t>(1, num_sms / base);  // rounded down: no partial second wave
  const int64_t by_context = attention_decode_split(max_context, kDecodeMaxSplits).splits;
  AttentionDecodePlan p;
  p.max_num_seqs = max_num_seqs;
  p.max_context = max_context;
  p.max_splits = static_cast<int>(std::min(wave, by_context));
  if (const int forced = forced_decode_max_splits(); forced > 0) {
    p.max_splits = std::min(p.max_splits, forced);
    p.cluster_merge = cluster_enabled() && p.max_splits > 1 && base <= 65535 &&
                      p.max_splits <= attention_decode_cluster_cap(dims) &&
                      decode_cluster_splits(dims, max_num_seqs, p.max_splits) == p.max_splits;
  } else if (cluster_enabled() && p.max_splits > 1 && base <= 65535) {
    const int c = decode_cluster_splits(dims, max_num_seqs, p.max_splits);
    if (c > 1 && cluster_merge_pays(max_context, c, p.max_splits)) {
      p.max_splits = portable_cluster_pays(max_context, c) ? kPortableClusterSplits : c;
      p.cluster_merge = true;
    }
  }
  // [TAG_ATTN_DECODE_STAGES] A warp's tiles of the longest split: few, and the ring need not be
  // deep (its first stage loads before pdl_wait anyway); many, and 3 tiles in flight per warp are
  // what hide HBM latency (batch 64 at 10k streams at 80% of HBM with 4 stages).
  const int warp_tiles = (attention_decode_split(max_context, p.max_splits).partition / kDecodeBN + kWarps - 1) / kWarps;
  p.stages = forced_decode_stages() != 0 ? forced_decode_stages() : warp_tiles <= kDecodeShortSplitTiles ? 2 : kDecodeStages;
  return p;
}

int attention_decode_cluster_context(const AttentionDims& dims, int max_num_seqs, int num_sms) {
  MOEBIUS_LAUNCH_ASSERT(max_num_seqs > 0 && num_sms > 0 && dims.num_kv_heads > 0, "attention_decode_cluster_context: bad sizes");
  const int64_t base = static_cast<int64_t>(max_num_seqs) * dims.num_kv_heads;
  if (!cluster_enabled() || base > 65535) return 0;
  const int wave = static_cast<int>(std::min<int64_t>(kDecodeMaxSplits, std::max<int64_t>(1, num_sms / base)));
  const int c = decode_cluster_splits(dims, max_num_seqs, wave);
  if (c <= 1) return 0;
  // The model's cost grows with the context (every split count is monotone in it): walk up in
  // 16-key steps to the last context the cluster plan still wins, 1 << 20 at most.
  int ctx = 0;
  while (ctx < (1 << 20) &&
         cluster_merge_pays(ctx + 16, c, static_cast<int>(std::min<int64_t>(wave, attention_decode_split(ctx + 16, kDecodeMaxSplits).splits))))
    ctx += 16;
  return ctx;
}

int attention_decode_portable_cluster_context(const AttentionDims& dims, int max_num_seqs, int num_sms) {
  MOEBIUS_LAUNCH_ASSERT(max_num_seqs > 0 && num_sms > 0 && dims.num_kv_heads > 0,
                        "attention_decode_portable_cluster_context: bad sizes");
  const int64_t base = static_cast<int64_t>(max_num_seqs) * dims.num_kv_heads;
  if (!cluster_enabled() || base > 65535) return 0;
  const int wave = static_cast<int>(std::min<int64_t>(kDecodeMaxSplits, std::max<int64_t>(1, num_sms / base)));
  const int c = decode_cluster_splits(dims, max_num_seqs, wave);
  if (c <= kPortableClusterSplits) return 0;
  // Both conditions only turn false as the context grows: walk up in 16-key steps.
  const int cluster_ctx = attention_decode_cluster_context(dims, max_num_seqs, num_sms);
  int ctx = 0;
  while (ctx + 16 <= cluster_ctx && portable_cluster_pays(ctx + 16, c)) ctx += 16;
  return ctx;
}

int attention_decode_cluster_cap(const AttentionDims& dims) {
  MOEBIUS_LAUNCH_ASSERT(dims.num_kv_heads > 0 && dims.num_q_heads % dims.num_kv_heads == 0, "attention: nkv must divide nh");
  return decode_cluster_cap(dims.num_q_heads / dims.num_kv_heads);
}

size_t attention_decode_workspace_bytes(const AttentionDims& dims, const AttentionDecodePlan& plan) {
  if (plan.max_splits <= 1 || plan.cluster_merge) return 0;
  const DecodeWorkspace w = decode_workspace_layout(dims, plan);
  return w.counter_bytes + w.ml_bytes + w.o_bytes;
}

void init_attention_decode_workspace(void* workspace, const AttentionDims& dims, const AttentionDecodePlan& plan,
                                     cudaStream_t stream) {
  if (plan.max_splits <= 1 || plan.cluster_merge) return;
  MOEBIUS_LAUNCH_ASSERT(workspace != nullptr, "attention decode: a split plan needs a workspace");
  CUDA_CHECK(cudaMemsetAsync(workspace, 0, decode_workspace_layout(dims, plan).counter_bytes, stream));
}

void launch_attention_decode(const AttentionDecodeToken& token, const int32_t* seq_lens, const int32_t* num_seqs,
                             __nv_bfloat16* k_cache, __nv_bfloat16* v_cache, const int32_t* block_table,
                             const AttentionDims& dims, const AttentionDecodePlan& plan, void* workspace,
                             __nv_bfloat16* out, cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(dims.head_dim == 16 || dims.head_dim == 64 || dims.head_dim == 128,
                        "attention: hd must be 16, 64 or 128");
  MOEBIUS_LAUNCH_ASSERT(dims.num_kv_heads > 0 && dims.num_q_heads > 0 && dims.num_q_heads % dims.num_kv_heads == 0,
                        "attention: nkv must divide nh");
  MOEBIUS_LAUNCH_ASSERT(dims.block_size > 0 && dims.max_blocks_per_seq > 0, "attention: bad block_size / block table");
  MOEBIUS_LAUNCH_ASSERT(token.q != nullptr && token.k != nullptr && token.v != nullptr && token.inv_freq != nullptr,
                        "attention decode: q, k, v and inv_freq are required");
  MOEBIUS_LAUNCH_ASSERT(token.q_stride >= static_cast<int64_t>(dims.num_q_heads) * dims.head_dim &&
                            token.k_stride >= static_cast<int64_t>(dims.num_kv_heads) * dims.head_dim &&
                            token.v_stride >= static_cast<int64_t>(dims.num_kv_heads) * dims.head_dim &&
                            token.q_stride % 2 == 0 && token.k_stride % 2 == 0 && token.v_stride % 2 == 0,
                        "attention decode: q/k/v strides must be even and cover the heads");
  for (const void* p : {static_cast<const void*>(token.q), static_cast<const void*>(token.k),
                        static_cast<const void*>(token.v)})
    MOEBIUS_LAUNCH_ASSERT(reinterpret_cast<uintptr_t>(p) % 4 == 0, "attention decode: q/k/v must be 4-byte aligned");
  for (const void* p : {static_cast<const void*>(k_cache), static_cast<const void*>(v_cache),
                        static_cast<const void*>(out)})
    MOEBIUS_LAUNCH_ASSERT(reinterpret_cast<uintptr_t>(p) % 16 == 0, "attention: pointers must be 16-byte aligned");
  MOEBIUS_LAUNCH_ASSERT(dims.num_q_heads / dims.num_kv_heads <= kDecodeMaxGroup,
                        "attention decode: at most 16 query heads per kv head");
  MOEBIUS_LAUNCH_ASSERT(plan.max_num_seqs > 0 && plan.max_num_seqs <= 65535 && plan.max_splits >= 1 &&
                            plan.max_splits <= kDecodeMaxSplits,
                        "attention decode: bad plan (use plan_attention_decode)");
  MOEBIUS_LAUNCH_ASSERT(plan.stages == 2 || plan.stages == kDecodeStages, "attention decode: plan.stages must be 2 or 4");
  MOEBIUS_LAUNCH_ASSERT(!plan.cluster_merge || plan.max_splits <= attention_decode_cluster_cap(dims),
                        "attention decode: a cluster-merge plan has at most attention_decode_cluster_cap splits");
  MOEBIUS_LAUNCH_ASSERT(plan.max_splits == 1 || plan.cluster_merge ||
                            (workspace != nullptr && reinterpret_cast<uintptr_t>(workspace) % 16 == 0),
                        "attention decode: a split plan needs a 16-byte aligned workspace");
  DecodeArgs a{};
  a.token = token;
  a.seq_lens = seq_lens;
  a.num_seqs = num_seqs;
  a.k_cache = k_cache;
  a.v_cache = v_cache;
  a.block_table = block_table;
  a.dims = dims;
  a.max_num_seqs = plan.max_num_seqs;
  a.max_splits = plan.max_splits;
  a.scale_log2 = kLog2e / std::sqrt(static_cast<float>(dims.head_dim));
  a.out = out;
  a.cluster_merge = plan.cluster_merge && plan.max_splits > 1;  // [TAG_ATTN_CLUSTER_MERGE]
  if (plan.max_splits > 1 && !a.cluster_merge) {  // [TAG_ATTN_DECODE_WORKSPACE]
    const DecodeWorkspace w = decode_workspace_layout(dims, plan);
    auto* base = static_cast<uint8_t*>(workspace);
    a.counters = reinterpret_cast<int*>(base);
    a.ws_ml = reinterpret_cast<float2*>(base + w.counter_bytes);
    a.ws_o = reinterpret_cast<float*>(base + w.counter_bytes + w.ml_bytes);
  }
  switch (dims.head_dim) {
    case 16: launch_decode_hd<16>(a, plan.stages, stream); break;
    case 64: launch_decode_hd<64>(a, plan.stages, stream); break;
    default: launch_decode_hd<128>(a, plan.stages, stream); break;
  }
}

}  // namespace moebius::kernels
