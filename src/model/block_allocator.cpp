#include "model/block_allocator.h"

#include <algorithm>

namespace moebius::model {

namespace {

// splitmix64's finalizer: every input bit reaches every output bit.
uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

BlockAllocator::BlockAllocator(int32_t num_blocks, bool prefix_caching) : prefix_caching_(prefix_caching) {
  MOEBIUS_ASSERT(num_blocks >= 0, "BlockAllocator({})", num_blocks);
  refs_.assign(static_cast<size_t>(num_blocks), 0);
  free_.reserve(static_cast<size_t>(num_blocks));
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
  if (prefix_caching_) {
    published_.assign(static_cast<size_t>(num_blocks), Published{});
    lru_pos_.assign(static_cast<size_t>(num_blocks), evictable_.end());
  }
}

uint64_t BlockAllocator::root_chain(uint64_t version) { return mix64(version ^ 0x6d6f656269757321ull); }

uint64_t BlockAllocator::chain_hash(uint64_t parent, std::span<const int32_t> tokens) {
  uint64_t h = mix64(parent ^ 0x9e3779b97f4a7c15ull);
  for (int32_t t : tokens) h = mix64(h ^ static_cast<uint32_t>(t));
  return mix64(h ^ tokens.size());
}

int32_t BlockAllocator::take_block() {
  if (!free_.empty()) {
    const int32_t b = free_.back();
    free_.pop_back();
    return b;
  }
  MOEBIUS_ASSERT(!evictable_.empty(), "take_block with no free block");
  const int32_t b = evictable_.front();
  evictable_.pop_front();
  lru_pos_[static_cast<size_t>(b)] = evictable_.end();
  unpublish(b);
  return b;
}

void BlockAllocator::unpublish(int32_t block) {
  Published& p = published_[static_cast<size_t>(block)];
  if (!p.valid) return;
  auto it = index_.find(p.chain);
  MOEBIUS_ASSERT(it != index_.end() && it->second == block, "published block {} missing from the index", block);
  index_.erase(it);
  p = Published{};
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
    const int32_t b = take_block();
    refs_[static_cast<size_t>(b)] = 1;
    table.push_back(b);
  }
  return Ok{};
}

void BlockAllocator::release(std::vector<int32_t>& table) {
  // In reverse: without prefix caching the next ensure() hands the same blocks out in the same
  // order; with it, a table's deepest blocks are evicted before the prefix they extend.
  for (auto it = table.rbegin(); it != table.rend(); ++it) {
    const int32_t b = *it;
    MOEBIUS_ASSERT(b >= 0 && b < num_blocks() && refs_[static_cast<size_t>(b)] > 0, "release of block {}", b);
    if (--refs_[static_cast<size_t>(b)] > 0) continue;
    if (prefix_caching_ && published_[static_cast<size_t>(b)].valid) {
      lru_pos_[static_cast<size_t>(b)] = evictable_.insert(evictable_.end(), b);
    } else {
      free_.push_back(b);
    }
  }
  table.clear();
}

template <typename Visit>
void BlockAllocator::walk_prefix(uint64_t root, std::span<const int32_t> tokens, int block_size,
                                 std::span<const uint64_t> chains, Visit&& visit) const {
  if (!prefix_caching_ || index_.empty() || block_size != block_size_) return;
  const size_t bs = static_cast<size_t>(block_size);
  uint64_t chain = root;
  for (size_t i = 0; (i + 1) * bs <= tokens.size(); ++i) {
    const std::span<const int32_t> block_tokens = tokens.subspan(i * bs, bs);
    const uint64_t h = i < chains.size() ? chains[i] : chain_hash(chain, block_tokens);
    auto it = index_.find(h);
    if (it == index_.end()) return;
    const int32_t b = it->second;
    const Published& p = published_[static_cast<size_t>(b)];
    if (p.parent != chain ||
        !std::equal(block_tokens.begin(), block_tokens.end(), block_tokens_.begin() + static_cast<int64_t>(b) * block_size))
      return;
    visit(b, h);
    chain = h;
  }
}

BlockAllocator::PrefixMatch BlockAllocator::match_prefix(uint64_t root, std::span<const int32_t> tokens,
                                                         int block_size, std::vector<int32_t>& table,
                                                         std::span<const uint64_t> chains) {
  MOEBIUS_ASSERT(table.empty() && block_size > 0, "match_prefix on a table of {} blocks", table.size());
  PrefixMatch m;
  m.chain = root;
  walk_prefix(root, tokens, block_size, chains, [&](int32_t b, uint64_t chain) {
    if (refs_[static_cast<size_t>(b)]++ == 0) {  // cached, held by no table: no longer evictable
      evictable_.erase(lru_pos_[static_cast<size_t>(b)]);
      lru_pos_[static_cast<size_t>(b)] = evictable_.end();
    }
    table.push_back(b);
    m.chain = chain;
    ++m.blocks;
  });
  return m;
}

int64_t BlockAllocator::cached_prefix_blocks(uint64_t root, std::span<const int32_t> tokens, int block_size,
                                             std::span<const uint64_t> chains) const {
  MOEBIUS_ASSERT(block_size > 0, "cached_prefix_blocks with block size {}", block_size);
  int64_t n = 0;
  walk_prefix(root, tokens, block_size, chains, [&](int32_t, uint64_t) { ++n; });
  return n;
}

std::optional<uint64_t> BlockAllocator::publish(int32_t block, uint64_t parent, std::span<const int32_t> tokens) {
  const uint64_t h = chain_hash(parent, tokens);
  if (!prefix_caching_) return h;
  MOEBIUS_ASSERT(block >= 0 && block < num_blocks() && refs_[static_cast<size_t>(block)] > 0,
                 "publish of block {}, which no table holds", block);
  if (block_size_ == 0) {
    block_size_ = static_cast<int>(tokens.size());
    block_tokens_.assign(refs_.size() * tokens.size(), 0);
  }
  MOEBIUS_ASSERT(static_cast<int>(tokens.size()) == block_size_, "publish of {} tokens, blocks hold {}", tokens.size(),
                 block_size_);
  Published& p = published_[static_cast<size_t>(block)];
  if (p.valid) return h;  // already published (a block's tokens never change while held)
  if (auto it = index_.find(h); it != index_.end()) {
    const int32_t other = it->second;
    const bool equal = published_[static_cast<size_t>(other)].parent == parent &&
                       std::equal(tokens.begin(), tokens.end(), block_tokens_.begin() + static_cast<int64_t>(other) * block_size_);
    if (!equal) return std::nullopt;  // a hash collision: this chain's hashes are ambiguous from here
    return h;                         // an equal block is published: this one stays private
  }
  p = Published{h, parent, true};
  index_.emplace(h, block);
  std::copy(tokens.begin(), tokens.end(), block_tokens_.begin() + static_cast<int64_t>(block) * block_size_);
  return h;
}

void BlockAllocator::clear_prefix_cache() {
  if (!prefix_caching_) return;
  for (int32_t b : evictable_) {
    lru_pos_[static_cast<size_t>(b)] = evictable_.end();
    free_.push_back(b);
  }
  evictable_.clear();
  for (Published& p : published_) p = Published{};
  index_.clear();
  // Lowest ids first again, as after construction.
  std::sort(free_.begin(), free_.end(), std::greater<int32_t>());
}

}  // namespace moebius::model
