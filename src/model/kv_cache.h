// KV cache for the CPU backend: one sequence, paged in fixed-size blocks.
//
// Positions are grouped into blocks of `block_size` tokens. A block holds, for every layer, the
// keys and the values of its tokens:
//   block: [L][2 (k, v)][block_size][nkv * hd] fp32
// so one token's K (or V) for one layer is a contiguous [nkv, hd] row. Blocks are allocated on
// demand by reserve() and kept in a block table (logical block i -> physical block), which is the
// layout a paged CUDA cache uses as well; clear() returns them to a free list for reuse.
//
// Protocol for one forward step of T tokens starting at p0 = position():
//   reserve(p0 + T)              make room (an Error past max_tokens)
//   key(l, p) / value(l, p)      write rows p in [p0, p0 + T) for every layer, read rows [0, p]
//   advance(T)                   commit: position() becomes p0 + T
// A step that fails before advance() leaves position() unchanged (its rows are overwritten next time).
//
// Two kinds: a cache that owns its blocks (one sequence, blocks made on demand), and a view of a
// KvBlockPool through a block table a scheduler hands out (model::BlockAllocator), which is how
// the server's CPU runner shares one pool between sequences, and blocks between sequences with a
// common prefix ([TAG_PREFIX_CACHE]), as the paged CUDA cache does.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/error.h"

namespace moebius::model {

// Physical KV blocks addressed by a scheduler's block ids [0, num_blocks), each
// [L][2][block_size][nkv * hd] fp32 as above, allocated on first use and kept.
class KvBlockPool {
 public:
  KvBlockPool(int num_layers, int num_kv_heads, int head_dim, int block_size, int32_t num_blocks);
  int num_layers() const { return num_layers_; }
  int num_kv_heads() const { return num_kv_heads_; }
  int head_dim() const { return head_dim_; }
  int block_size() const { return block_size_; }
  int32_t num_blocks() const { return static_cast<int32_t>(blocks_.size()); }
  int64_t block_floats() const { return int64_t{num_layers_} * 2 * block_size_ * num_kv_heads_ * head_dim_; }
  int32_t allocated() const { return allocated_; }  // blocks touched so far
  // Block `id`, allocated (zeroed) on first use. Not thread-safe: a step reserves its blocks up
  // front, on one thread.
  float* block(int32_t id);

 private:
  int num_layers_, num_kv_heads_, head_dim_, block_size_;
  int32_t allocated_ = 0;
  std::vector<std::unique_ptr<float[]>> blocks_;  // [num_blocks], null until used
};

class KvCache {
 public:
  KvCache() = default;
  // max_tokens: hard cap on position(); block_size: tokens per block (> 0).
  KvCache(int num_layers, int num_kv_heads, int head_dim, int64_t max_tokens, int block_size = 16);
  // A view of `pool` through `table` (pool block ids, copied), already holding `position` tokens.
  // It holds at most min(max_tokens, table.size() * block_size) tokens; reserve() never takes a
  // block the table does not list, and clear() only resets the position (the blocks belong to
  // the scheduler).
  KvCache(KvBlockPool& pool, std::span<const int32_t> table, int64_t position, int64_t max_tokens);

  int num_layers() const { return num_layers_; }
  int num_kv_heads() const { return num_kv_heads_; }
  int head_dim() const { return head_dim_; }
  int block_size() const { return block_size_; }
  int64_t max_tokens() const { return max_tokens_; }
  int64_t position() const { return position_; }       // tokens committed so far
  int64_t num_blocks() const { return static_cast<int64_t>(table_.size()); }

  // Ensures rows [0, tokens) exist. Error when tokens > max_tokens().
  Status reserve(int64_t tokens);
  // Commits n rows written after position(); they must have been reserved.
  void advance(int64_t n);
  // Forgets every token; blocks are kept for reuse.
  void clear();

  // [nkv, hd] fp32 rows of layer `layer` at absolute position `pos` (< reserved tokens).
  float* key(int layer, int64_t pos) { return row(layer, 0, pos); }
  float* value(int layer, int64_t pos) { return row(layer, 1, pos); }
  const float* key(int layer, int64_t pos) const { return const_cast<KvCache*>(this)->row(layer, 0, pos); }
  const float* value(int layer, int64_t pos) const { return const_cast<KvCache*>(this)->row(layer, 1, pos); }

 private:
  float* row(int layer, int kv, int64_t pos);
  // Blocks whose rows may be read or written: a view's reserved prefix of its table, else the table.
  int64_t reserved_blocks() const { return pool_ != nullptr ? reserved_ : num_blocks(); }
  int64_t row_floats() const { return int64_t{num_kv_heads_} * head_dim_; }
  int64_t block_floats() const { return int64_t{num_layers_} * 2 * block_size_ * row_floats(); }

  int num_layers_ = 0;
  int num_kv_heads_ = 0;
  int head_dim_ = 0;
  int block_size_ = 16;
  int64_t max_tokens_ = 0;
  int64_t position_ = 0;
  KvBlockPool* pool_ = nullptr;                   // a view's pool; blocks_ and free_ stay empty
  int64_t reserved_ = 0;                          // a view's blocks made to exist so far
  std::vector<std::unique_ptr<float[]>> blocks_;  // physical blocks
  std::vector<int32_t> table_;                    // logical block -> index into blocks_
  std::vector<int32_t> free_;                     // physical blocks not in table_
};

}  // namespace moebius::model
