#include "model/kv_cache.h"

namespace moebius::model {

KvCache::KvCache(int num_layers, int num_kv_heads, int head_dim, int64_t max_tokens, int block_size)
    : num_layers_(num_layers),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      block_size_(block_size),
      max_tokens_(max_tokens) {
  MOEBIUS_ASSERT(num_layers > 0 && num_kv_heads > 0 && head_dim > 0 && block_size > 0 && max_tokens >= 0,
                 "KvCache(L={}, nkv={}, hd={}, max={}, block={})", num_layers, num_kv_heads, head_dim, max_tokens,
                 block_size);
}

Status KvCache::reserve(int64_t tokens) {
  if (tokens > max_tokens_)
    return Error::format("KV cache holds at most {} tokens, {} requested", max_tokens_, tokens);
  const int64_t need = (tokens + block_size_ - 1) / block_size_;
  while (num_blocks() < need) {
    if (free_.empty()) {
      // Zeroed so that a bug reading an unwritten row gives zeros, not garbage.
      blocks_.push_back(std::make_unique<float[]>(static_cast<size_t>(block_floats())));
      free_.push_back(static_cast<int32_t>(blocks_.size() - 1));
    }
    table_.push_back(free_.back());
    free_.pop_back();
  }
  return Ok{};
}

void KvCache::advance(int64_t n) {
  MOEBIUS_ASSERT(n >= 0 && position_ + n <= num_blocks() * block_size_, "advance({}) at {} past reserved {}", n,
                 position_, num_blocks() * block_size_);
  position_ += n;
}

void KvCache::clear() {
  // Return blocks in reverse so the next reserve() takes them in the original order.
  for (auto it = table_.rbegin(); it != table_.rend(); ++it) free_.push_back(*it);
  table_.clear();
  position_ = 0;
}

float* KvCache::row(int layer, int kv, int64_t pos) {
  MOEBIUS_ASSERT(layer >= 0 && layer < num_layers_ && pos >= 0 && pos < num_blocks() * block_size_,
                 "KV row layer {} pos {} (reserved {})", layer, pos, num_blocks() * block_size_);
  float* block = blocks_[static_cast<size_t>(table_[static_cast<size_t>(pos / block_size_)])].get();
  const int64_t slot = pos % block_size_;
  return block + ((int64_t{layer} * 2 + kv) * block_size_ + slot) * row_floats();
}

}  // namespace moebius::model
