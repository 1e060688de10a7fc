// The persistent tuning cache: one JSON file per physical GPU, <dir>/<device id>.json, where dir is
// $MOEBIUS_CACHE_DIR (default ~/.cache/moebius) and the device id is the GPU's UUID
// ("GPU-8a1c...").
//
//   {"moebius_tune_cache": 1,
//    "entries": [{"moebius": "0.1.0", "cuda": "12.8", "gpu": "NVIDIA H200",
//                 "key": "moe.v9 H=2048 ...", "value": {...}}, ...]}
//
// Every entry carries its namespace (moebius version, CUDA runtime version, GPU name); entries of
// another namespace are kept in the file but never returned. A file that does not parse, a file of
// another schema and malformed entries are ignored with a warning (warnings() keeps the text) and
// never crash. [TAG_TUNE_CACHE_WRITE] put() takes an exclusive flock on <file>.lock, re-reads the
// file, merges its entry into what is on disk, writes a temporary file and renames it over the
// old one, so readers (who take no lock) see the old or the new file whole, and writers in other
// processes never lose each other's entries.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moebius::tune {

struct CacheNamespace {
  std::string moebius;  // moebius version
  std::string cuda;     // CUDA runtime version, "12.8"
  std::string gpu;      // device name, "NVIDIA H200"
  bool operator==(const CacheNamespace&) const = default;
};

inline constexpr int kTuneCacheSchema = 1;

// $MOEBIUS_CACHE_DIR when set and non-empty, else $HOME/.cache/moebius; an error when neither
// can be found.
Result<std::string> default_cache_dir();
// "<dir>/<device_id>.json"; characters of the id outside [A-Za-z0-9._-] become '_'.
std::string cache_file_path(const std::string& dir, const std::string& device_id);

class TuneCache {
 public:
  // Reads the file if it exists. Never fails on the file's content (see warnings()); the directory
  // is created by the first put().
  static TuneCache open(const std::string& dir, const std::string& device_id, CacheNamespace ns);

  // This namespace's value of `key`, if any.
  std::optional<nlohmann::json> get(const std::string& key) const;
  // Stores `value` under `key` in memory and in the file ([TAG_TUNE_CACHE_WRITE]), and picks up
  // whatever other processes wrote meanwhile. On an I/O error the value stays in memory.
  Status put(const std::string& key, const nlohmann::json& value);
  // Stores `value` under `key` in memory only.
  void remember(const std::string& key, const nlohmann::json& value) { entries_[key] = value; }
  // Re-reads the file (entries written by other processes).
  void reload();

  const std::string& path() const { return path_; }
  const CacheNamespace& ns() const { return ns_; }
  size_t size() const { return entries_.size(); }  // entries of this namespace
  size_t ignored_other_namespaces() const { return ignored_ns_; }
  const std::vector<std::string>& warnings() const { return warnings_; }

 private:
  struct FileContent {
    std::vector<nlohmann::json> entries;  // well-formed entries of every namespace
    bool newer_schema = false;            // written by a newer moebius: never overwritten
  };
  FileContent read_file();
  void adopt(const FileContent& f);
  void warn(std::string text);

  std::string dir_, path_;
  CacheNamespace ns_;
  std::map<std::string, nlohmann::json> entries_;  // this namespace: key -> value
  size_t ignored_ns_ = 0;
  std::vector<std::string> warnings_;
};

}  // namespace moebius::tune
