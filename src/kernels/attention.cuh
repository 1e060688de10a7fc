// Causal GQA attention over the paged KV cache (kv_cache.cuh), flash style: bf16 in, fp32 scores,
// online softmax and accumulation, bf16 out. Launchers only (kernels in attention.cu).
//
// Batches of sequences, vLLM/FlashInfer style. Sequence s has q_len = cu_seqlens_q[s+1] -
// cu_seqlens_q[s] new query tokens (rows cu_seqlens_q[s] .. of q and out) and a context of
// seq_lens[s] tokens INCLUDING the new ones (prefill: the rope kernel put them in the cache; decode
// puts its one new token there itself):
// the new tokens are at positions seq_lens[s] - q_len .. seq_lens[s] - 1, and a query at position
// p attends to cache positions [0, p]. Query head h reads KV head h / (nh / nkv). Scale
// 1/sqrt(hd). The CPU reference is cpu::attention_reference (src/cpu/attention.h).
//
// Two kernels:
//  - prefill: any q_len, including chunked prefill (a chunk appended to an existing context) and
//    q_len 1; a mixed batch of prefill chunks and decodes may go through it whole.
//  - decode: exactly one query token per sequence (row s of q), split-KV ("flash-decoding") so that
//    a few long sequences still fill the GPU, in ONE kernel: the splits of a (sequence, kv head)
//    merge in the shared memory of a thread-block cluster (AttentionDecodePlan::cluster_merge) or,
//    for plans with more splits than a cluster holds, the last split block to finish merges them
//    through a workspace (an atomic counter); a sequence short enough for one split is written
//    directly, with no merge.
// Prefill reads q and a cache that the rope kernel (rope.cuh) prepared; decode takes the new
// token's raw q/k/v and does that work itself (AttentionDecodeToken). Both are launched with
// programmatic dependent launch (pdl.cuh). Prefill reads nothing before the wait; decode reads the
// step inputs and the cache rows of earlier steps before it ([TAG_ATTN_DECODE_PREWAIT]).
//
// [TAG_ATTN_GRAPH_BUCKET] Nothing here syncs the host, and grids come from HOST maxima
// (max_num_seqs, max_q_len, the decode plan's max_context), while the live counts come from
// DEVICE memory (*num_seqs, cu_seqlens_q, seq_lens, block_table). A CUDA graph captured once per
// batch bucket replays for any live batch within those maxima: sequences >= *num_seqs (clamped to
// [0, max_num_seqs]) and query tiles past a sequence's q_len exit at once and write nothing.
// The host maxima are a contract for prefill: a q_len above max_q_len is not detected on the device
// (its extra rows are silently dropped). Decode takes any seq_len >= 1 (the plan's max_context only
// sizes its splits).
//
// Supported: head_dim 16 (the tiny test fixture), 64, 128 (Qwen3); nkv divides nh; the decode
// kernel needs nh / nkv <= 16 (Qwen3-30B-A3B: 8, Qwen3-235B-A22B: 16). Pointers are device
// pointers and must be 16-byte aligned, with q_stride a multiple of 8 elements (prefill); decode's
// token rows are read as bf16 pairs (4-byte aligned, even strides).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace moebius::kernels {

struct AttentionDims {
  int num_q_heads = 0;         // nh
  int num_kv_heads = 0;        // nkv
  int head_dim = 0;            // hd: 16, 64 or 128
  int block_size = 0;          // tokens per cache block (16 is usual)
  int max_blocks_per_seq = 0;  // the block table's row length
};

// Prefill / chunked prefill / mixed batches.
//   q             [T, q_stride] bf16: head h of query row i at q + i*q_stride + h*hd
//   cu_seqlens_q  [max_num_seqs + 1] int32: query rows of sequence s are [cu[s], cu[s+1])
//   seq_lens      [max_num_seqs] int32: context length of s, new tokens included (>= q_len)
//   num_seqs      [1] int32: live sequences
//   k_cache, v_cache  [num_blocks, nkv, block_size, hd] bf16 (this layer's pools)
//   block_table   [max_num_seqs, max_blocks_per_seq] int32
//   max_num_seqs  host: grid z; max_q_len host: >= every live q_len (grid x)
//   out           [T, nh, hd] bf16: rows [cu[s], cu[s+1]) of live sequences written, nothing else
void launch_attention_prefill(const __nv_bfloat16* q, int64_t q_stride, const int32_t* cu_seqlens_q,
                              const int32_t* seq_lens, const int32_t* num_seqs, const __nv_bfloat16* k_cache,
                              const __nv_bfloat16* v_cache, const int32_t* block_table, const AttentionDims& dims,
                              int max_num_seqs, int max_q_len, __nv_bfloat16* out, cudaStream_t stream);

// Split-KV plan for decode, fixed when a graph is captured: the grid has max_splits blocks per
// (sequence, kv head); each sequence uses attention_decode_split(seq_len, max_splits).splits of them,
// chosen on the device from its live length, and the others exit at once.
struct AttentionDecodePlan {
  int max_num_seqs = 0;
  int max_context = 0;  // the longest context the plan is sized for (more is correct, just fewer splits per key)
  int max_splits = 0;   // 1..256; 1 = never a merge, no workspace
  // [TAG_ATTN_CLUSTER_MERGE] The max_splits blocks of a (sequence, kv head) form one thread-block
  // cluster and merge through the leader's shared memory (no workspace round trip); needs
  // max_splits <= attention_decode_cluster_cap(dims). Otherwise the last split to finish merges
  // through the workspace.
  bool cluster_merge = false;
  // [TAG_ATTN_DECODE_STAGES] K/V ring stages per warp: 4 (199 KiB of shared memory at hd 128), or 2
  // (133 KiB) when the splits are short. A block of 133 KiB fits on an SM beside two blocks of the
  // qkv GEMV that precedes it, so it becomes resident and loads its first tiles while the GEMV
  // runs; 199 KiB waited for the GEMV's blocks to leave (docs/PERF.md, runs P5-P7).
  int stages = 4;
};

// The most splits one cluster merges: min(16, 128 / G), G = nh / nkv (16 at G = 8, 8 at G = 16).
int attention_decode_cluster_cap(const AttentionDims& dims);

// [TAG_ATTN_DECODE_SPLIT] How one sequence of ctx >= 1 keys is split, on the host and the device
// alike. Up to 256 keys (one block's pipeline: 4 warps x 4 stages x 16 keys) stay in one split: the
// block streams them as fast as several would, and the merge (a fence, an atomic and a round trip
// through L2) would cost more than it saves. Longer contexts take up to max_splits splits of at
// least 64 keys (one 16-key tile per warp), equal and a multiple of 16, so that every split holds
// keys. The merge reads splits 0 .. splits-1 in that order whatever order they finished in.
struct AttentionDecodeSplit {
  int splits;     // blocks of this (sequence, kv head) that hold keys
  int partition;  // keys per split (the last one may hold fewer)
};
__host__ __device__ inline AttentionDecodeSplit attention_decode_split(int ctx, int max_splits) {
  if (ctx <= 256 || max_splits <= 1) return AttentionDecodeSplit{1, ctx};
  int n = (ctx + 63) / 64;
  if (n > max_splits) n = max_splits;
  const int part = ((ctx + n - 1) / n + 15) / 16 * 16;
  return AttentionDecodeSplit{(ctx + part - 1) / part, part};
}

// Picks max_splits so that max_num_seqs * nkv * max_splits blocks fit one wave of `num_sms`
// multiprocessors (cudaDevAttrMultiProcessorCount; one decode block per SM fits in shared memory)
// and never more than max_context's splits. Then the cluster merge, with as many splits as let
// clusters of up to attention_decode_cluster_cap splits, one per (sequence, kv head), all fit the
// GPU at once (cudaOccupancyMaxActiveClusters on the current device), when a cost model says its
// cheaper merge outweighs its fewer, longer splits at max_context (attention.cu), taking 8 of them
// instead of more while that costs less than a non-portable cluster's placement
// ([TAG_ATTN_PORTABLE_CLUSTER]); else the workspace merge. MOEBIUS_ATTN_CLUSTER_MERGE=0 never picks
// the cluster merge. Two ring stages when a warp's share of a split at max_context is at most
// kDecodeShortSplitTiles 16-key tiles, else four; MOEBIUS_ATTN_DECODE_STAGES=2|4 forces one.
inline constexpr int kDecodeShortSplitTiles = 8;
AttentionDecodePlan plan_attention_decode(const AttentionDims& dims, int max_num_seqs, int max_context, int num_sms);

// The longest context for which plan_attention_decode(dims, max_num_seqs, context, num_sms) picks
// the cluster merge (0: never). A runner whose plan for its max_context merges through the
// workspace can keep a second decode graph planned at this context for steps whose sequences are
// all this short.
int attention_decode_cluster_context(const AttentionDims& dims, int max_num_seqs, int num_sms);

// [TAG_ATTN_PORTABLE_CLUSTER] The longest context for which that cluster plan takes clusters of 8
// (portable) where a longer context takes clusters of more (0: never; at most
// attention_decode_cluster_context). A runner can keep a third decode graph planned at it.
int attention_decode_portable_cluster_context(const AttentionDims& dims, int max_num_seqs, int num_sms);

// Split partials and merge counters: [max_num_seqs, nkv] int32 counters, then per (sequence, kv
// head, split) the G = nh / nkv rows' (max, sum) and fp32 partial outputs. 0 when max_splits == 1
// or the plan merges in clusters.
size_t attention_decode_workspace_bytes(const AttentionDims& dims, const AttentionDecodePlan& plan);

// Zeroes the workspace's counters (a memset on `stream`). Once, after allocating it: every decode
// launch leaves the counters at zero again (the merging block resets them), so graph replays need
// no memset. The partials need no initialisation. No-op when the plan needs no workspace.
void init_attention_decode_workspace(void* workspace, const AttentionDims& dims, const AttentionDecodePlan& plan,
                                     cudaStream_t stream);

// The new token of each decode sequence as the qkv projection left it, for the attention prologue
// folded into the decode kernel: rope.cuh's qk_norm_rope_kv at one token per sequence (QK-norm,
// RoPE neox at position seq_lens[s] - 1, the K/V row written into the cache at that position's
// slot of the block table), the same arithmetic and bits.
struct AttentionDecodeToken {
  const __nv_bfloat16* q = nullptr;  // [max_num_seqs, q_stride]: head h of sequence s at q + s*q_stride + h*hd
  int64_t q_stride = 0;
  const __nv_bfloat16* k = nullptr;  // [max_num_seqs, k_stride]: kv head at k + s*k_stride + kvh*hd
  int64_t k_stride = 0;
  const __nv_bfloat16* v = nullptr;  // [max_num_seqs, v_stride]   (q, k, v: slices of one qkv row)
  int64_t v_stride = 0;
  const float* q_norm = nullptr;     // [hd] fp32, or nullptr: no RMSNorm on q
  const float* k_norm = nullptr;     // [hd] fp32, or nullptr: no RMSNorm on k
  const float* inv_freq = nullptr;   // [hd / 2] fp32: cpu::rope_inv_freq(rope_theta, hd)
  float eps = 0.0f;                  // rms_norm_eps
};

// Decode: one new token per sequence, at position seq_lens[s] - 1; every other cache row of the
// sequence was written by an earlier step. The kernel normalises and rotates the token's q and k,
// writes its K/V rows into the cache (no separate rope kernel at decode), and attends.
//   token        the raw q/k/v rows and the norm/RoPE constants (above); q/k/v are not modified
//   seq_lens     [max_num_seqs] int32: live sequences need seq_lens[s] >= 1
//   num_seqs     [1] int32: live sequences
//   k_cache, v_cache  as for prefill; the live sequences' rows at seq_lens[s] - 1 are written
//   block_table  as for prefill; must hold a block for position seq_lens[s] - 1
//   workspace    attention_decode_workspace_bytes(...) bytes, 16-byte aligned, initialised once by
//                init_attention_decode_workspace (nullptr if 0 bytes). One launch at a time per
//                workspace (kernels of one stream: the next launch's writes come after its wait).
//   out          [max_num_seqs, nh, hd] bf16: rows of live sequences written, nothing else
// seq_lens, num_seqs, block_table, inv_freq and the cache rows before position seq_lens[s] - 1 are
// read BEFORE the PDL wait: no kernel of the same stream chain may write them
// ([TAG_ATTN_DECODE_PREWAIT]).
void launch_attention_decode(const AttentionDecodeToken& token, const int32_t* seq_lens, const int32_t* num_seqs,
                             __nv_bfloat16* k_cache, __nv_bfloat16* v_cache, const int32_t* block_table,
                             const AttentionDims& dims, const AttentionDecodePlan& plan, void* workspace,
                             __nv_bfloat16* out, cudaStream_t stream);

}  // namespace moebius::kernels
