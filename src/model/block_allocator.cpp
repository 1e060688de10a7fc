#include "model/block_allocator.h"

namespace moebius::model {

BlockAllocator::BlockAllocator(int32_t num_blocks) {
  MOEBIUS_ASSERT(num_blocks >= 0, "BlockAllocator({})", num_blocks);
  owned_.assign(static_cast<size_t>(num_blocks), 0);
  free_.reserve(static_cast<size_t>(num_blocks));
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

Status BlockAllocator::ensure(std::vector<int32_t>& table, int64_t tokens, int block_size) {
  MOEBIUS_ASSERT(block_size > 0 && tokens >= 0, "ensure({}, {})", tokens, block_size);
  const int64_t need = (tokens + block_size - 1) / block_size;
  const int64_t more = need - static_cast<int64_t>(table.size());
  if (more <= 0) return Ok{};
  if (more > num_free())
    return Error::format("the KV cache is full: {} tokens need {} more blocks of {}, {} of {} are free", tokens, more,
                         block_size, num_free(), num_blocks());
  for (int64_t i = 0; i < more; ++i) {
    const int32_t b = free_.back();
    free_.pop_back();
    owned_[static_cast<size_t>(b)] = 1;
    table.push_back(b);
  }
  return Ok{};
}

void BlockAllocator::release(std::vector<int32_t>& table) {
  // In reverse, so that the next ensure() hands the same blocks out in the same order.
  for (auto it = table.rbegin(); it != table.rend(); ++it) {
    const int32_t b = *it;
    MOEBIUS_ASSERT(b >= 0 && b < num_blocks() && owned_[static_cast<size_t>(b)] == 1, "release of block {}", b);
    owned_[static_cast<size_t>(b)] = 0;
    free_.push_back(b);
  }
  table.clear();
}

}  // namespace moebius::model
