// Reference-counted scratch blocks shared by key: layers whose workspaces have the same layout run
// one after another on one stream, so they can use the same memory. A block lives while any holder
// keeps its handle and is freed with the last one; the pool itself only remembers (weakly) which
// blocks are alive, so it may go before or after the blocks. [TAG_MOE_WORKSPACE_POOL]
//
// Templated over the allocator so the counting is testable without a GPU:
//   struct Allocator {
//     Result<void*> allocate(size_t bytes);   // the block, ready to use (e.g. zeroed)
//     void deallocate(void* p, size_t bytes) noexcept;
//   };
// Allocators are copied into every block (a device allocator is stateless; a test's holds a
// pointer to its counters).
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "core/error.h"

namespace moebius {

template <typename Allocator>
class WorkspacePool {
 public:
  // One allocation. Stable address for its whole life.
  class Block {
   public:
    Block(void* data, size_t bytes, Allocator alloc) : data_(data), bytes_(bytes), alloc_(std::move(alloc)) {}
    ~Block() { alloc_.deallocate(data_, bytes_); }
    Block(const Block&) = delete;
    Block& operator=(const Block&) = delete;
    void* data() const { return data_; }
    size_t bytes() const { return bytes_; }

   private:
    void* data_;
    size_t bytes_;
    Allocator alloc_;
  };
  using Handle = std::shared_ptr<const Block>;

  explicit WorkspacePool(Allocator alloc = Allocator()) : alloc_(std::move(alloc)) {}
  WorkspacePool(const WorkspacePool&) = delete;
  WorkspacePool& operator=(const WorkspacePool&) = delete;

  // The live block of `key`, or a new one of `bytes`. Every caller of one key must describe the
  // same layout, so the same key with other bytes is our bug (asserted).
  Result<Handle> acquire(const std::string& key, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    prune();
    if (auto it = blocks_.find(key); it != blocks_.end()) {
      if (Handle h = it->second.lock()) {
        MOEBIUS_ASSERT(h->bytes() == bytes, "workspace '{}' asked with {} bytes, holds {}", key, bytes, h->bytes());
        return h;
      }
    }
    MOEBIUS_ASSIGN_OR_RETURN(void* p, alloc_.allocate(bytes));
    Handle h = std::make_shared<const Block>(p, bytes, alloc_);
    blocks_[key] = h;
    return h;
  }

  // Holders of `key`'s block; 0 when none is alive.
  long use_count(const std::string& key) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(key);
    return it == blocks_.end() ? 0 : it->second.use_count();
  }
  // Handles alive now over every block (a block per layout, a handle per layer).
  long holders() const {
    std::lock_guard<std::mutex> lock(mu_);
    long n = 0;
    for (const auto& [k, w] : blocks_) n += w.use_count();
    return n;
  }
  // Blocks alive now, and their bytes.
  size_t live_blocks() const {
    std::lock_guard<std::mutex> lock(mu_);
    size_t n = 0;
    for (const auto& [k, w] : blocks_) n += w.expired() ? 0 : 1;
    return n;
  }
  size_t live_bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    size_t n = 0;
    for (const auto& [k, w] : blocks_)
      if (Handle h = w.lock()) n += h->bytes();
    return n;
  }

 private:
  void prune() {
    for (auto it = blocks_.begin(); it != blocks_.end();) it = it->second.expired() ? blocks_.erase(it) : std::next(it);
  }

  Allocator alloc_;
  mutable std::mutex mu_;
  std::map<std::string, std::weak_ptr<const Block>> blocks_;
};

}  // namespace moebius
