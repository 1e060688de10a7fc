// Causal GQA attention over the paged KV cache (kv_cache.cuh), flash style: bf16 in, fp32 scores,
// online softmax and accumulation, bf16 out. Launchers only (kernels in attention.cu).
//
// Batches of sequences, vLLM/FlashInfer style. Sequence s has q_len = cu_seqlens_q[s+1] -
// cu_seqlens_q[s] new query tokens (rows cu_seqlens_q[s] .. of q and out) and a context of
// seq_lens[s] tokens already in the cache INCLUDING the new ones (the rope kernel wrote them):
// the new tokens are at positions seq_lens[s] - q_len .. seq_lens[s] - 1, and a query at position
// p attends to cache positions [0, p]. Query head h reads KV head h / (nh / nkv). Scale
// 1/sqrt(hd). The CPU reference is cpu::attention_reference (src/cpu/attention.h).
//
// Two kernels:
//  - prefill: any q_len, including chunked prefill (a chunk appended to an existing context) and
//    q_len 1; a mixed batch of prefill chunks and decodes may go through it whole.
//  - decode: exactly one query token per sequence (row s of q), split-KV ("flash-decoding") so that
//    a few long sequences still fill the GPU; a second small kernel merges the splits of the
//    sequences longer than one split (shorter ones are written by the first kernel).
// Both are launched with programmatic dependent launch (pdl.cuh) and read nothing before the wait.
//
// [TAG_ATTN_GRAPH_BUCKET] Nothing here syncs the host, and grids come from HOST maxima
// (max_num_seqs, max_q_len, the decode plan's max_context), while the live counts come from
// DEVICE memory (*num_seqs, cu_seqlens_q, seq_lens, block_table). A CUDA graph captured once per
// batch bucket replays for any live batch within those maxima: sequences >= *num_seqs (clamped to
// [0, max_num_seqs]) and query tiles past a sequence's q_len exit at once and write nothing.
// The host maxima are a contract: a q_len above max_q_len or a seq_len above the plan's max_context
// is not detected on the device (its extra rows / keys are silently dropped).
//
// Supported: head_dim 16 (the tiny test fixture), 64, 128 (Qwen3); nkv divides nh; the decode
// kernel needs nh / nkv <= 16 (Qwen3-30B-A3B: 8, Qwen3-235B-A22B: 16). Pointers are device
// pointers and must be 16-byte aligned, with q_stride a multiple of 8 elements.
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

// Split-KV plan for decode, fixed when a graph is captured. Each block covers `partition`
// consecutive keys of one (sequence, kv head); a sequence of length n uses ceil(n / partition)
// of the num_splits splits, and the merge reads exactly those.
struct AttentionDecodePlan {
  int max_num_seqs = 0;
  int max_context = 0;  // >= every live seq_len
  int partition = 0;    // keys per split, a multiple of 16
  int num_splits = 0;   // ceil(max_context / partition); 1 = no merge kernel, no workspace
};

// Picks the partition so that max_num_seqs * nkv * num_splits blocks cover about two waves of
// `num_sms` multiprocessors (cudaDevAttrMultiProcessorCount).
AttentionDecodePlan plan_attention_decode(const AttentionDims& dims, int max_num_seqs, int max_context, int num_sms);

// fp32 partial outputs, maxima and sums of every split: [max_num_seqs, nh, num_splits, hd + 2].
// 0 when num_splits == 1.
size_t attention_decode_workspace_bytes(const AttentionDims& dims, const AttentionDecodePlan& plan);

// Decode: one query token per sequence, at position seq_lens[s] - 1.
//   q            [max_num_seqs, q_stride] bf16: sequence s's heads at q + s*q_stride + h*hd
//   seq_lens     [max_num_seqs] int32: live sequences need 1 <= seq_lens[s] <= plan.max_context
//   num_seqs     [1] int32: live sequences
//   k_cache, v_cache, block_table: as for prefill
//   workspace    attention_decode_workspace_bytes(...) bytes, 16-byte aligned (nullptr if 0)
//   out          [max_num_seqs, nh, hd] bf16: rows of live sequences written, nothing else
void launch_attention_decode(const __nv_bfloat16* q, int64_t q_stride, const int32_t* seq_lens,
                             const int32_t* num_seqs, const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,
                             const int32_t* block_table, const AttentionDims& dims, const AttentionDecodePlan& plan,
                             void* workspace, __nv_bfloat16* out, cudaStream_t stream);

}  // namespace moebius::kernels
