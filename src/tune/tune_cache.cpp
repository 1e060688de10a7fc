#include "tune/tune_cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/json_depth.h"
#include "core/memory.h"
#include "core/log.h"

namespace moebius::tune {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string errno_text() { return std::strerror(errno); }

// An exclusive flock held for the object's life. [TAG_TUNE_CACHE_WRITE]
class FileLock {
 public:
  static Result<FileLock> exclusive(const std::string& path) {
    FileLock l;
    l.fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (l.fd_ < 0) return Error::format("cannot open the lock file: {}", errno_text()).in_file(path);
    int rc;
    do rc = ::flock(l.fd_, LOCK_EX);
    while (rc != 0 && errno == EINTR);
    if (rc != 0) return Error::format("flock failed: {}", errno_text()).in_file(path);
    return l;
  }
  FileLock(FileLock&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  FileLock& operator=(FileLock&&) = delete;
  ~FileLock() {
    if (fd_ >= 0) ::close(fd_);  // closing the descriptor releases the lock
  }

 private:
  FileLock() = default;
  int fd_ = -1;
};

Status write_all(int fd, const std::string& data, const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Error::format("write failed: {}", errno_text()).in_file(path);
    }
    done += static_cast<size_t>(n);
  }
  return Ok{};
}

// Writes `data` to a temporary file beside `path`, flushes it to disk and renames it over `path`.
Status write_atomically(const std::string& path, const std::string& data) {
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Error::format("cannot create a temporary file: {}", errno_text()).in_file(tmp);
  Status st = write_all(fd, data, tmp);
  if (st.ok() && ::fsync(fd) != 0) st = Error::format("fsync failed: {}", errno_text()).in_file(tmp);
  ::close(fd);
  if (st.ok() && ::rename(tmp.c_str(), path.c_str()) != 0)
    st = Error::format("cannot rename '{}' over it: {}", tmp, errno_text()).in_file(path);
  if (!st.ok()) {
    ::unlink(tmp.c_str());
    return st;
  }
  // The rename itself reaches the disk with the directory (best effort: the data is already safe).
  const int dfd = ::open(fs::path(path).parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
  return Ok{};
}

bool is_str(const json& e, const char* k) { return e.contains(k) && e[k].is_string(); }

bool well_formed(const json& e) {
  return e.is_object() && is_str(e, "moebius") && is_str(e, "cuda") && is_str(e, "gpu") && is_str(e, "key") &&
         e.contains("value") && e["value"].is_object();
}

bool in_namespace(const json& e, const CacheNamespace& ns) {
  return e["moebius"].get<std::string>() == ns.moebius && e["cuda"].get<std::string>() == ns.cuda &&
         e["gpu"].get<std::string>() == ns.gpu;
}

}  // namespace

Result<std::string> default_cache_dir() {
  if (const char* d = std::getenv("MOEBIUS_CACHE_DIR"); d != nullptr && *d != '\0') return std::string(d);
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0')
    return (fs::path(h) / ".cache" / "moebius").string();
  return Error("neither $MOEBIUS_CACHE_DIR nor $HOME is set; no place for the tuning cache");
}

std::string cache_file_path(const std::string& dir, const std::string& device_id) {
  std::string name = device_id.empty() ? "unknown-device" : device_id;
  for (char& c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == '-';
    if (!ok) c = '_';
  }
  if (name == "." || name == "..") name = "_";
  return (fs::path(dir) / (name + ".json")).string();
}

TuneCache TuneCache::open(const std::string& dir, const std::string& device_id, CacheNamespace ns) {
  TuneCache c;
  c.dir_ = dir;
  c.path_ = cache_file_path(dir, device_id);
  c.ns_ = std::move(ns);
  c.reload();
  return c;
}

void TuneCache::warn(std::string text) {
  if (std::find(warnings_.begin(), warnings_.end(), text) != warnings_.end()) return;  // put() re-reads
  log_warn("tuning cache '{}': {}", path_, text);
  warnings_.push_back(std::move(text));
}

TuneCache::FileContent TuneCache::read_file() {
  FileContent out;
  std::error_code ec;
  if (!fs::exists(path_, ec)) return out;
  auto read = read_small_file(path_);
  if (!read.ok()) {
    warn(fmt::format("cannot be read ({}); ignored", read.error().message()));
    return out;
  }
  const std::string& text = read.value();
  // [TAG_JSON_DEPTH] Entries' values are copied (adopt, get), which recurses once per level.
  if (json_nesting_depth(text) > kMaxJsonFileDepth) {
    warn(fmt::format("nests deeper than {} levels (corrupt); ignored, and replaced at the next write",
                     kMaxJsonFileDepth));
    return out;
  }
  const json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    warn(fmt::format("not valid JSON ({} bytes; truncated or corrupt); ignored, and replaced at the next write",
                     text.size()));
    return out;
  }
  if (!doc.is_object() || !doc.contains("moebius_tune_cache") || !doc["moebius_tune_cache"].is_number_integer()) {
    warn("not a moebius tuning cache (no integer 'moebius_tune_cache'); ignored");
    return out;
  }
  const int64_t schema = doc["moebius_tune_cache"].get<int64_t>();
  if (schema != kTuneCacheSchema) {
    out.newer_schema = schema > kTuneCacheSchema;
    warn(fmt::format("schema {} (this moebius reads {}); ignored{}", schema, kTuneCacheSchema,
                     out.newer_schema ? " and left as it is" : ""));
    return out;
  }
  if (!doc.contains("entries") || !doc["entries"].is_array()) {
    warn("'entries' is not an array; ignored");
    return out;
  }
  size_t bad = 0;
  for (const json& e : doc["entries"]) {
    if (well_formed(e)) out.entries.push_back(e);
    else ++bad;
  }
  if (bad > 0) warn(fmt::format("{} malformed entries ignored", bad));
  return out;
}

void TuneCache::adopt(const FileContent& f) {
  ignored_ns_ = 0;
  for (const json& e : f.entries) {
    if (in_namespace(e, ns_)) entries_[e["key"].get<std::string>()] = e["value"];
    else ++ignored_ns_;
  }
}

void TuneCache::reload() { adopt(read_file()); }

std::optional<json> TuneCache::get(const std::string& key) const {
  auto it = entries_.find(key);
  if (it == entries_.end()) return std::nullopt;
  return it->second;
}

Status TuneCache::put(const std::string& key, const json& value) {
  MOEBIUS_ASSERT(value.is_object(), "tuning cache values are objects");
  entries_[key] = value;
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) return Error::format("cannot create the directory: {}", ec.message()).in_file(dir_);
  MOEBIUS_ASSIGN_OR_RETURN(FileLock lock, FileLock::exclusive(path_ + ".lock"));
  FileContent f = read_file();  // under the lock: nobody writes between this read and the rename
  if (f.newer_schema)
    return Error("written by a newer moebius (schema above ours); not overwritten").in_file(path_);
  std::vector<json> merged;
  merged.reserve(f.entries.size() + 1);
  for (json& e : f.entries)
    if (!(in_namespace(e, ns_) && e["key"].get<std::string>() == key)) merged.push_back(std::move(e));
  merged.push_back(json{{"moebius", ns_.moebius}, {"cuda", ns_.cuda}, {"gpu", ns_.gpu}, {"key", key}, {"value", value}});
  const json doc{{"moebius_tune_cache", kTuneCacheSchema}, {"entries", merged}};
  MOEBIUS_TRY(write_atomically(path_, doc.dump(1) + "\n"));
  f.entries = std::move(merged);
  adopt(f);  // what other processes wrote meanwhile, plus ours
  return Ok{};
}

}  // namespace moebius::tune
