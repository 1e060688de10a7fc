// Physical KV-cache blocks for the paged CUDA cache ([TAG_KV_CACHE_LAYOUT]): a free list over
// block ids [0, num_blocks). A sequence owns a block table (logical block i -> physical block),
// grown with ensure() as it gets longer and handed back with release(). Host-only; the device
// cache (Qwen3MoeCuda) never allocates by itself, so a scheduler can share one pool between
// many sequences.
#pragma once

#include <cstdint>
#include <vector>

#include "core/error.h"

namespace moebius::model {

class BlockAllocator {
 public:
  BlockAllocator() = default;
  explicit BlockAllocator(int32_t num_blocks);

  int32_t num_blocks() const { return static_cast<int32_t>(owned_.size()); }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }

  // Grows `table` to ceil(tokens / block_size) blocks (never shrinks it). Errors, leaving `table`
  // unchanged, when the pool has too few free blocks.
  Status ensure(std::vector<int32_t>& table, int64_t tokens, int block_size);
  // Returns every block of `table` to the pool and clears it. Asserts that each block is owned.
  void release(std::vector<int32_t>& table);

 private:
  std::vector<int32_t> free_;   // popped from the back: lowest ids first
  std::vector<uint8_t> owned_;  // [num_blocks]: 1 while some table holds the block
};

}  // namespace moebius::model
