#include "model/kv_cache.h"

#include <algorithm>

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

KvBlockPool::KvBlockPool(int num_layers, int num_kv_heads, int head_dim, int block_size, int32_t num_blocks)
    : num_layers_(num_layers), num_kv_heads_(num_kv_heads), head_dim_(head_dim), block_size_(block_size) {
  MOEBIUS_ASSERT(num_layers > 0 && num_kv_heads > 0 && head_dim > 0 && block_size > 0 && num_blocks >= 0,
                 "KvBlockPool(L={}, nkv={}, hd={}, block={}, blocks={})", num_layers, num_kv_heads, head_dim,
                 block_size, num_blocks);
  blocks_.resize(static_cast<size_t>(num_blocks));
}

float* KvBlockPool::block(int32_t id) {
  MOEBIUS_ASSERT(id >= 0 && id < num_blocks(), "KV pool block {} of {}", id, num_blocks());
  std::unique_ptr<float[]>& b = blocks_[static_cast<size_t>(id)];
  if (!b) {
    b = std::make_unique<float[]>(static_cast<size_t>(block_floats()));  // zeroed, as KvCache's own
    ++allocated_;
  }
  return b.get();
}

KvCache::KvCache(KvBlockPool& pool, std::span<const int32_t> table, int64_t position, int64_t max_tokens)
    : num_layers_(pool.num_layers()),
      num_kv_heads_(pool.num_kv_heads()),
      head_dim_(pool.head_dim()),
      block_size_(pool.block_size()),
      max_tokens_(std::min<int64_t>(max_tokens, static_cast<int64_t>(table.size()) * pool.block_size())),
      position_(position),
      pool_(&pool),
      table_(table.begin(), table.end()) {
  MOEBIUS_ASSERT(position >= 0 && position <= max_tokens_, "KV view at {} of {} tokens", position, max_tokens_);
}

Status KvCache::reserve(int64_t tokens) {
  if (tokens > max_tokens_)
    return Error::format("KV cache holds at most {} tokens, {} requested", max_tokens_, tokens);
  const int64_t need = (tokens + block_size_ - 1) / block_size_;
  if (pool_ != nullptr) {  // the table covers max_tokens_: make its blocks exist
    for (int64_t b = 0; b < need; ++b) pool_->block(table_[static_cast<size_t>(b)]);
    reserved_ = std::max(reserved_, need);
    return Ok{};
  }
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
  MOEBIUS_ASSERT(n >= 0 && position_ + n <= reserved_blocks() * block_size_, "advance({}) at {} past reserved {}", n,
                 position_, reserved_blocks() * block_size_);
  position_ += n;
}

void KvCache::clear() {
  if (pool_ != nullptr) {
    position_ = 0;
    return;
  }
  // Return blocks in reverse so the next reserve() takes them in the original order.
  for (auto it = table_.rbegin(); it != table_.rend(); ++it) free_.push_back(*it);
  table_.clear();
  position_ = 0;
}

float* KvCache::row(int layer, int kv, int64_t pos) {
  MOEBIUS_ASSERT(layer >= 0 && layer < num_layers_ && pos >= 0 && pos < reserved_blocks() * block_size_,
                 "KV row layer {} pos {} (reserved {})", layer, pos, reserved_blocks() * block_size_);
  const int32_t id = table_[static_cast<size_t>(pos / block_size_)];
  float* block = pool_ != nullptr ? pool_->block(id) : blocks_[static_cast<size_t>(id)].get();
  const int64_t slot = pos % block_size_;
  return block + ((int64_t{layer} * 2 + kv) * block_size_ + slot) * row_floats();
}

}  // namespace moebius::model
