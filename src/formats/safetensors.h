// safetensors: reader (one file, mmap'd), sharded checkpoints (HF index + shards) and writer.
//
// On-disk format (https://github.com/huggingface/safetensors):
//   [u64 little-endian N][N bytes of UTF-8 JSON header][data section]
// The header maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]} with offsets
// relative to the start of the data section, plus an optional "__metadata__" string->string map.
//
// The reader is the first thing to touch untrusted bytes, so it validates everything before any
// TensorInfo is handed out; after a successful parse every TensorInfo's bytes lie inside the
// buffer and have exactly numel * dtype_size bytes. It is at least as strict as the official Rust
// implementation (same header limit; offsets must tile the data section with no gap, no overlap
// and nothing left over) and stricter where that one is lenient: unknown keys in a tensor entry,
// duplicate JSON keys, empty or control-character tensor names and rank > kMaxDims are refused.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/memory.h"
#include "core/tensor.h"

namespace moebius {

// The official implementation's MAX_HEADER_SIZE. Real headers are well under 10 MB even for
// checkpoints with tens of thousands of tensors; anything larger is corrupt or hostile.
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

// One tensor of a safetensors file. `data` points into the mmap'd file (or the buffer given to
// SafetensorsFile::parse) and is valid as long as that file object / buffer lives. The bytes are
// read-only: files are mapped PROT_READ.
//
// Alignment: the format does not require aligned offsets. Files written by SafetensorsWriter and by
// the official writers have every tensor aligned to its element size (see
// [TAG_SAFETENSORS_ALIGNMENT]); files from other writers may not, so code that reinterprets `data`
// as T* must check (reinterpret_cast<uintptr_t>(data) % alignof(T)) or copy.
struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  std::array<uint64_t, 2> data_offsets{};  // [begin, end) relative to the data section
  const uint8_t* data = nullptr;           // first byte; one-past-the-end is data + nbytes()

  uint64_t nbytes() const { return data_offsets[1] - data_offsets[0]; }
  std::span<const uint8_t> bytes() const { return {data, static_cast<size_t>(nbytes())}; }
};

class SafetensorsFile {
 public:
  SafetensorsFile() = default;
  SafetensorsFile(SafetensorsFile&&) noexcept = default;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept = default;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  // mmaps `path` read-only and validates it. Views have MemoryKind::kMapped.
  static Result<SafetensorsFile> open(const std::string& path);
  // Validates `bytes` in place without copying or owning them: the caller keeps them alive for
  // the lifetime of the returned object. `name` is used in error messages. Views have kHost.
  static Result<SafetensorsFile> parse(std::span<const uint8_t> bytes, std::string name);

  // The path given to open() or the name given to parse().
  const std::string& name() const { return name_; }
  // All tensors, sorted by name (bytewise), so iteration order is deterministic.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  std::vector<std::string> names() const;
  size_t size() const { return tensors_.size(); }
  // nullptr when absent. O(log n).
  const TensorInfo* find(std::string_view name) const;
  // "__metadata__" (empty when the file has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // A read-only view of the tensor's bytes (do not write through TensorView::data).
  Result<TensorView> view(std::string_view name) const;
  TensorView view(const TensorInfo& info) const;
  // The view of `name`, or an error naming the file and tensor when it is missing or its dtype
  // (or shape, when given) is not the expected one. This is what model loaders should call.
  Result<TensorView> get(std::string_view name, DType expect_dtype,
                         std::optional<Shape> expect_shape = {}) const;

  uint64_t header_size() const { return header_size_; }       // N
  uint64_t data_offset() const { return 8 + header_size_; }   // where the data section starts
  std::span<const uint8_t> bytes() const { return bytes_; }   // the whole file

 private:
  static Result<SafetensorsFile> parse_impl(std::span<const uint8_t> bytes, std::string name,
                                            MemoryKind where);

  MappedFile file_;  // empty for parse()
  std::span<const uint8_t> bytes_;
  std::string name_;
  MemoryKind where_ = MemoryKind::kHost;
  uint64_t header_size_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint that may be split over several files, opened from
//   - a directory with model.safetensors.index.json ({"metadata": {...}, "weight_map": {tensor: shard}}),
//   - a directory with a single model.safetensors,
//   - a *.safetensors file, or a *.index.json file (shards are looked up next to it).
// The index and the shards must agree exactly: every indexed tensor is in its shard, no tensor is
// in two shards, and no shard holds a tensor the index does not list. The last one is an error,
// not a warning: a shard that disagrees with its index means a stale index or a mixed-up
// directory, and loading would then depend on which file we happened to look in.
class SafetensorsCheckpoint {
 public:
  SafetensorsCheckpoint() = default;
  SafetensorsCheckpoint(SafetensorsCheckpoint&&) noexcept = default;
  SafetensorsCheckpoint& operator=(SafetensorsCheckpoint&&) noexcept = default;

  static Result<SafetensorsCheckpoint> open(const std::string& dir_or_file);

  // The path given to open().
  const std::string& path() const { return path_; }
  bool is_sharded() const { return sharded_; }
  // Each shard opened once, sorted by file name.
  const std::vector<SafetensorsFile>& shards() const { return shards_; }
  // Sharded: the index's "metadata" with non-string values in their JSON spelling (HF writes
  // {"total_size": 123}, which reads back as "123"). Single file: that file's "__metadata__".
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // All tensor names across shards, sorted.
  std::vector<std::string> names() const;
  size_t size() const { return entries_.size(); }
  const TensorInfo* find(std::string_view name) const;
  // The shard that holds `name`, nullptr when absent.
  const SafetensorsFile* shard_of(std::string_view name) const;
  Result<TensorView> view(std::string_view name) const;
  Result<TensorView> get(std::string_view name, DType expect_dtype,
                         std::optional<Shape> expect_shape = {}) const;

 private:
  struct Entry {
    uint32_t shard;
    uint32_t index;  // into shards_[shard].tensors()
  };
  const Entry* find_entry(std::string_view name) const;
  const TensorInfo& info(const Entry& e) const { return shards_[e.shard].tensors()[e.index]; }
  static Result<SafetensorsCheckpoint> open_index(const std::string& index_path, const std::string& dir);

  std::string path_;
  bool sharded_ = false;
  std::vector<SafetensorsFile> shards_;
  std::vector<Entry> entries_;  // sorted by tensor name
  std::map<std::string, std::string> metadata_;
};

// Builds a safetensors file in the canonical layout:
//   - header: compact JSON, "__metadata__" first (only when non-empty), then the tensors in data
//     order, each as {"dtype","shape","data_offsets"}; padded with spaces so N % 8 == 0, which
//     makes the data section start 8-byte aligned;
//   - data order: element size descending, then name ascending (bytewise). Like the official
//     writer (which sorts by dtype, then name) this keeps every tensor aligned to its element size
//     with no padding between tensors, which the format would not allow anyway.
//     [TAG_SAFETENSORS_ALIGNMENT]
// The same bytes come out for the same tensors regardless of the order of add() calls.
class SafetensorsWriter {
 public:
  // Copies `bytes`. Fails when the name is empty, "__metadata__", not UTF-8, has control
  // characters or is already added, or when bytes.size() != numel(shape) * dtype_size(dtype).
  Status add(std::string name, DType dtype, const Shape& shape, std::span<const uint8_t> bytes);
  // Same, without copying: `bytes` must stay valid until the last write()/serialize() call.
  Status add_borrowed(std::string name, DType dtype, const Shape& shape, std::span<const uint8_t> bytes);
  // Copies a host-readable view (kHost, kPinnedHost, kMapped); kDevice is refused.
  Status add(std::string name, const TensorView& view);
  // Key and value must be valid UTF-8.
  Status set_metadata(std::string key, std::string value);

  size_t size() const { return entries_.size(); }

  // The whole file in memory (tests, fuzzing, small files).
  Result<std::vector<uint8_t>> serialize() const;
  // Writes atomically: a temporary file next to `path`, fsync, rename over `path`, fsync of the
  // directory. Readers see the old file or the complete new one, never a partial one. A crash
  // can leave a "<path>.tmp-<pid>-<n>" file behind.
  Status write(const std::string& path) const;
  // Splits the tensors (in name order) into shards of at most `max_shard_bytes` of tensor data
  // (a larger tensor gets a shard of its own) and writes "<base>-00001-of-0000K.safetensors"...
  // plus "<base>.safetensors.index.json" into the existing directory `dir`, the index last, so
  // the checkpoint becomes visible only when complete. Every shard carries this writer's
  // metadata; the index's metadata is {"total_size": <sum of tensor bytes>}, as HF writes it.
  Status write_sharded(const std::string& dir, uint64_t max_shard_bytes,
                       std::string_view base = "model") const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    Shape shape;
    std::vector<uint8_t> owned;
    std::span<const uint8_t> borrowed;
    bool is_owned = false;
    std::span<const uint8_t> bytes() const { return is_owned ? std::span<const uint8_t>(owned) : borrowed; }
  };
  Status add_entry(std::string name, DType dtype, const Shape& shape, std::span<const uint8_t> bytes,
                   bool copy);
  // Data order of `entries` ([TAG_SAFETENSORS_ALIGNMENT]) and the padded header for it.
  static std::vector<const Entry*> layout(std::vector<const Entry*> entries);
  static Result<std::string> header(const std::vector<const Entry*>& order,
                                    const std::map<std::string, std::string>& metadata);
  static Status write_file(const std::string& path, const std::vector<const Entry*>& entries,
                           const std::map<std::string, std::string>& metadata);

  std::vector<Entry> entries_;
  std::set<std::string, std::less<>> names_;  // duplicate check in O(log n): checkpoints have 100k tensors
  std::map<std::string, std::string> metadata_;
};

}  // namespace moebius
