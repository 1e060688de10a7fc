// The paged KV cache as the CUDA kernels see it (layout only; rope.cuh writes it, attention.cuh
// reads it). [TAG_KV_CACHE_LAYOUT] marks every place that depends on this layout.
//
// Per layer, two pools (keys and values), each bf16:
//   k_cache, v_cache   [num_blocks, nkv, block_size, hd]   ("HND": head-major inside a block)
// A sequence's logical block i lives in physical block block_table[seq][i]:
//   block_table        [max_num_seqs, max_blocks_per_seq] int32; entries past a sequence's
//                      ceil(seq_len / block_size) blocks are never read (they may hold anything).
// A new token's K/V row goes to a physical slot = block * block_size + offset:
//   slot_mapping       [T] int32; slot < 0 means "do not write" (padding rows of a graph bucket).
//
// Why head-major inside a block (FlashInfer's HND rather than vLLM's NHD): an attention block works
// on ONE kv head, and with HND the (block, head) tile it reads is one contiguous run of
// block_size * hd * 2 bytes (4 KiB at 16 x 128), so its 16-byte cp.async loads cover whole 128-byte
// lines even when hd is small (hd 16: a 32-byte row per token would touch a 32-byte sector of a
// line per token in NHD). The cost is on the write side, which is one hd row per (token, head)
// either way. Pools of different layers may be one allocation or several; the kernels only take
// the two base pointers of the layer at hand.
#pragma once

#include <cstdint>

namespace moebius::kernels {

// Element offset of (physical block, kv head, offset in block) in a pool. [TAG_KV_CACHE_LAYOUT]
__host__ __device__ inline int64_t kv_cache_offset(int64_t block, int kv_head, int offset, int num_kv_heads,
                                                   int block_size, int head_dim) {
  return ((block * num_kv_heads + kv_head) * block_size + offset) * static_cast<int64_t>(head_dim);
}

// Elements of one pool (K or V of one layer).
__host__ __device__ inline int64_t kv_cache_pool_elems(int64_t num_blocks, int num_kv_heads, int block_size,
                                                       int head_dim) {
  return num_blocks * num_kv_heads * block_size * static_cast<int64_t>(head_dim);
}

}  // namespace moebius::kernels
