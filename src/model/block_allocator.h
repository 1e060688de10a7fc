// Physical KV-cache blocks for the paged caches ([TAG_KV_CACHE_LAYOUT]): a pool of block ids
// [0, num_blocks). A sequence owns a block table (logical block i -> physical block), grown with
// ensure() as it gets longer and handed back with release(). Host-only; the caches never allocate
// by themselves, so a scheduler can share one pool between many sequences.
//
// Prefix caching ([TAG_PREFIX_CACHE], on when constructed with prefix_caching): a block whose
// tokens are all computed can be published under the chain of token blocks that leads to it
// (hash(parent chain, its block_size tokens)). A new sequence then starts from match_prefix(),
// which hands it the published blocks of its longest whole-block prefix with a reference each, so
// those tokens are never computed again; any number of tables may hold a block. A released block
// that is published stays cached (its KV intact) until the pool needs it: ensure() takes free
// blocks first, then evicts cached ones least recently released first (a table's blocks are
// released deepest first, so a shared prefix outlives its tails). Lookups compare the block's
// tokens and its parent chain's hash exactly, and publish() refuses a block whose hash an unequal
// block already owns (the sequence then stops publishing: its chain hash is ambiguous from there),
// so a collision of block hashes cannot hand out wrong KV; only two different token chains with
// equal 64-bit parent hashes and equal next blocks could.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "core/error.h"

namespace moebius::model {

class BlockAllocator {
 public:
  BlockAllocator() = default;
  explicit BlockAllocator(int32_t num_blocks, bool prefix_caching = false);

  int32_t num_blocks() const { return static_cast<int32_t>(refs_.size()); }
  // Blocks ensure() can hand out: never used, or cached with no table holding them.
  int32_t num_free() const { return static_cast<int32_t>(free_.size() + evictable_.size()); }
  // Blocks some table holds.
  int32_t num_used() const { return num_blocks() - num_free(); }
  bool prefix_caching() const { return prefix_caching_; }
  int32_t num_cached() const { return static_cast<int32_t>(index_.size()); }  // published blocks

  // Grows `table` to ceil(tokens / block_size) blocks (never shrinks it). Errors, leaving `table`
  // unchanged, when the pool has too few free blocks.
  Status ensure(std::vector<int32_t>& table, int64_t tokens, int block_size);
  // Drops `table`'s reference on each of its blocks and clears it. A block no table holds goes
  // back to the pool (cached if published). Asserts that each block is held.
  void release(std::vector<int32_t>& table);

  // The chain hash of the empty prefix for weights version `version`: the `parent` of a
  // sequence's block 0. A new version starts new chains, so KV computed with older weights (by
  // sequences still running on it) is never matched by a sequence that starts on newer ones.
  static uint64_t root_chain(uint64_t version);
  // The chain hash of the block holding `tokens` (block_size of them) after chain `parent`.
  static uint64_t chain_hash(uint64_t parent, std::span<const int32_t> tokens);

  struct PrefixMatch {
    int64_t blocks = 0;             // appended to the table
    uint64_t chain = 0;             // the chain hash after them (`root` when none)
  };
  // Appends to `table` (empty) the published blocks holding the longest run of whole blocks of
  // `tokens` from its start after chain `root`, each with a new reference. Nothing without prefix
  // caching. `chains`, when given, holds the chain hashes of tokens' first blocks after `root`
  // (chain_hash applied block by block, as a caller that keeps them per sequence has them): the
  // walk then looks them up instead of hashing every token again. The blocks' tokens and parents
  // are compared exactly either way, so a wrong hash there only ends the match early.
  PrefixMatch match_prefix(uint64_t root, std::span<const int32_t> tokens, int block_size,
                           std::vector<int32_t>& table, std::span<const uint64_t> chains = {});
  // How many blocks match_prefix would hand out, without taking them.
  int64_t cached_prefix_blocks(uint64_t root, std::span<const int32_t> tokens, int block_size,
                               std::span<const uint64_t> chains = {}) const;
  // Publishes `block` (held by the caller's table, its block_size tokens computed) as `tokens`
  // after chain `parent`, and returns the block's chain hash. When an equal block is already
  // published the index keeps that one and `block` stays private (freed on release). nullopt when
  // the hash belongs to an unequal block (a collision): publish nothing more after this chain.
  // Without prefix caching it only computes the hash.
  std::optional<uint64_t> publish(int32_t block, uint64_t parent, std::span<const int32_t> tokens);
  // Tables holding `block` (a step may write only blocks held once).
  int32_t holders(int32_t block) const { return refs_[static_cast<size_t>(block)]; }
  // Forgets every published block (the weights changed, so their KV is stale): cached blocks go
  // back to the free list; held blocks stay with their tables, unpublished.
  void clear_prefix_cache();

 private:
  struct Published {
    uint64_t chain = 0;   // its own chain hash (the index key)
    uint64_t parent = 0;  // the parent chain's hash
    bool valid = false;
  };
  void unpublish(int32_t block);
  // Walks the published chain of `tokens`' whole blocks after `root`; calls visit(block, chain)
  // for each match, in order.
  template <typename Visit>
  void walk_prefix(uint64_t root, std::span<const int32_t> tokens, int block_size, std::span<const uint64_t> chains,
                   Visit&& visit) const;
  int32_t take_block();  // a free block, else the least recently released cached one

  bool prefix_caching_ = false;
  std::vector<int32_t> free_;   // popped from the back: lowest ids first
  std::vector<int32_t> refs_;   // [num_blocks]: tables holding the block
  // Prefix caching only.
  int block_size_ = 0;                                // fixed by the first publish
  std::vector<Published> published_;                  // [num_blocks]
  std::vector<int32_t> block_tokens_;                 // [num_blocks * block_size] of published blocks
  std::unordered_map<uint64_t, int32_t> index_;       // chain hash -> block
  std::list<int32_t> evictable_;                      // published, refs 0; front: evicted first
  std::vector<std::list<int32_t>::iterator> lru_pos_;  // [num_blocks], valid while in evictable_
};

}  // namespace moebius::model
