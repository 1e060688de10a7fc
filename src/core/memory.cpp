#include "core/memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#ifdef MOEBIUS_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace moebius {

// ---------------------------------------------------------------------------------------------
// MappedFile
// ---------------------------------------------------------------------------------------------
MappedFile::~MappedFile() { reset(); }

MappedFile::MappedFile(MappedFile&& o) noexcept
    : data_(o.data_), size_(o.size_), path_(std::move(o.path_)) {
  o.data_ = nullptr;
  o.size_ = 0;
}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    reset();
    data_ = o.data_;
    size_ = o.size_;
    path_ = std::move(o.path_);
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

void MappedFile::reset() {
  if (data_ != nullptr && size_ > 0) munmap(const_cast<uint8_t*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
}

namespace {

struct RegularFile {
  int fd = -1;
  uint64_t size = 0;
};

// `path` opened read-only when it is a regular file (closed and an error naming it otherwise).
// O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer; it is refused instead.
Result<RegularFile> open_regular_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return Error::format("cannot open: {}", std::strerror(errno)).in_file(path);
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return Error::format("cannot stat: {}", std::strerror(err)).in_file(path);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Error(S_ISDIR(st.st_mode) ? "not a regular file (a directory)" : "not a regular file").in_file(path);
  }
  return RegularFile{fd, static_cast<uint64_t>(st.st_size)};
}

}  // namespace

Result<std::string> read_small_file(const std::string& path, uint64_t max_bytes) {
  MOEBIUS_ASSIGN_OR_RETURN(const RegularFile file, open_regular_file(path));
  if (file.size > max_bytes) {
    ::close(file.fd);
    return Error::format("{} bytes; a file of this kind is at most {} (is this the right file?)", file.size,
                         max_bytes)
        .in_file(path);
  }
  std::string text(static_cast<size_t>(file.size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(file.fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(file.fd);
      return Error::format("read error: {}", std::strerror(err)).in_file(path);
    }
    if (n == 0) break;  // the file shrank while being read: keep what is there
    got += static_cast<size_t>(n);
  }
  ::close(file.fd);
  text.resize(got);
  return text;
}

Result<MappedFile> MappedFile::open(const std::string& path) {
  MOEBIUS_ASSIGN_OR_RETURN(const RegularFile file, open_regular_file(path));
  const int fd = file.fd;
  MappedFile f;
  f.path_ = path;
  f.size_ = static_cast<size_t>(file.size);
  if (f.size_ > 0) {
    void* p = mmap(nullptr, f.size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      f.size_ = 0;
      return Error::format("mmap of {} bytes failed: {}", file.size, std::strerror(err)).in_file(path);
    }
    f.data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping keeps the file alive
  return f;
}

// ---------------------------------------------------------------------------------------------
// Buffer
// ---------------------------------------------------------------------------------------------
namespace {
constexpr size_t kAlignment = 256;  // cudaMalloc's alignment; enough for 128-bit vector loads
}

Buffer::~Buffer() { reset(); }

Buffer::Buffer(Buffer&& o) noexcept : data_(o.data_), size_(o.size_), kind_(o.kind_) {
  o.data_ = nullptr;
  o.size_ = 0;
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    reset();
    data_ = o.data_;
    size_ = o.size_;
    kind_ = o.kind_;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

void Buffer::reset() {
  if (data_ == nullptr) return;
  switch (kind_) {
    case MemoryKind::kHost:
      std::free(data_);
      break;
#ifdef MOEBIUS_HAS_CUDA
    case MemoryKind::kPinnedHost:
      cudaFreeHost(data_);
      break;
    case MemoryKind::kDevice:
      cudaFree(data_);
      break;
#endif
    default:
      break;
  }
  data_ = nullptr;
  size_ = 0;
}

Result<Buffer> Buffer::allocate(MemoryKind kind, size_t bytes) {
  Buffer b;
  b.kind_ = kind;
  b.size_ = bytes;
  const size_t padded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  switch (kind) {
    case MemoryKind::kHost:
      b.data_ = std::aligned_alloc(kAlignment, padded == 0 ? kAlignment : padded);
      if (b.data_ == nullptr) return Error::format("out of host memory allocating {} bytes", bytes);
      return b;
    case MemoryKind::kPinnedHost:
    case MemoryKind::kDevice: {
#ifdef MOEBIUS_HAS_CUDA
      cudaError_t err;
      if (kind == MemoryKind::kPinnedHost) {
        // Portable: usable from every device. Mapped: kernels may read it zero-copy over PCIe.
        err = cudaHostAlloc(&b.data_, padded == 0 ? kAlignment : padded,
                            cudaHostAllocPortable | cudaHostAllocMapped);
      } else {
        err = cudaMalloc(&b.data_, padded == 0 ? kAlignment : padded);
      }
      if (err != cudaSuccess) {
        b.data_ = nullptr;
        (void)cudaGetLastError();  // clear the sticky-free error so later calls are not confused
        return Error::format("{} allocation of {} bytes failed: {}",
                             kind == MemoryKind::kPinnedHost ? "pinned host" : "device", bytes,
                             cudaGetErrorString(err));
      }
      return b;
#else
      return Error("this build of moebius has no CUDA support; pinned and device memory are unavailable");
#endif
    }
    case MemoryKind::kMapped:
      break;
  }
  return Error("kMapped memory comes from MappedFile, not Buffer::allocate");
}

bool cuda_available() {
#ifdef MOEBIUS_HAS_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
#else
  return false;
#endif
}

}  // namespace moebius
