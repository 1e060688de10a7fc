// Owning memory: read-only mmap'd files, aligned host buffers, pinned host buffers and device
// buffers. Pinned and device buffers exist only in CUDA builds (MOEBIUS_HAS_CUDA); without CUDA
// their allocate() returns an error that says so.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "core/error.h"

namespace moebius {

// The small side files a model directory and the engine's state hold (config.json,
// generation_config.json, quantization configs, tokenizer_config.json, routing profiles, the tuning
// cache) are JSON of at most kilobytes; 64 MiB is far above any real one.
inline constexpr uint64_t kMaxSmallFileBytes = 64ull << 20;

// The whole of a small file, read only when it is a regular file of at most max_bytes: a FIFO
// would block the reader, /dev/zero never ends, and a multi-GB file given by mistake (a shard
// passed as --model) would be read whole, so each is an error naming the file instead. Opened
// non-blocking, so a FIFO is refused rather than waited on.
Result<std::string> read_small_file(const std::string& path, uint64_t max_bytes = kMaxSmallFileBytes);

// A whole file mapped read-only (MAP_PRIVATE). Checkpoints are read in place, never copied.
class MappedFile {
 public:
  MappedFile() = default;
  ~MappedFile();
  MappedFile(MappedFile&& o) noexcept;
  MappedFile& operator=(MappedFile&& o) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  static Result<MappedFile> open(const std::string& path);

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  std::span<const uint8_t> bytes() const { return {data_, size_}; }
  const std::string& path() const { return path_; }

 private:
  void reset();
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::string path_;
};

enum class MemoryKind : uint8_t { kHost, kPinnedHost, kDevice, kMapped };

// A move-only owning allocation of one MemoryKind, 256-byte aligned.
class Buffer {
 public:
  Buffer() = default;
  ~Buffer();
  Buffer(Buffer&& o) noexcept;
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  // kHost: aligned heap memory. kPinnedHost: cudaHostAlloc (portable | mapped), so kernels can
  // read it zero-copy. kDevice: cudaMalloc. kMapped is not allocatable (see MappedFile).
  static Result<Buffer> allocate(MemoryKind kind, size_t bytes);

  void* data() const { return data_; }
  size_t size() const { return size_; }
  MemoryKind kind() const { return kind_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }

 private:
  void reset();
  void* data_ = nullptr;
  size_t size_ = 0;
  MemoryKind kind_ = MemoryKind::kHost;
};

// True when this binary was built with CUDA and a device is visible.
bool cuda_available();

}  // namespace moebius
