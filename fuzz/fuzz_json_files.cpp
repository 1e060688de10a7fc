// libFuzzer target: the JSON files moebius reads besides a checkpoint's config and tokenizer.json
// (those are fuzz_model_config and fuzz_tokenizer_json), each parser on the same bytes:
//   - offload::profile_from_json: a routing profile (`--placement FILE`, `profile-experts --out`);
//   - tune::TuneCache::open: the per-GPU tuning cache file under $MOEBIUS_CACHE_DIR, and
//     tune::MoeTuneChoice::from_json on every value it returns;
//   - chat::ChatTemplate::from_tokenizer_config: a checkpoint's tokenizer_config.json.
// The two file readers get the bytes through a file in a per-process temporary directory.
// Beyond "no crash, no sanitizer report" (the crash this target was written after: nesting 200k
// levels deep overflowed the stack, [TAG_JSON_DEPTH]):
//   - a refused profile is an Error with a message and the file; an accepted one validates,
//     holds num_experts counts and masses per layer with finite, non-negative masses, and
//     survives profile_to_json -> profile_from_json unchanged;
//   - the tuning cache never fails to open: a file it cannot use leaves it empty with a warning,
//     and a cached value either parses into a choice whose winner has a block_m in [1, 1024] and
//     a split-K of 4 or 8, or is refused with a message;
//   - a tokenizer_config.json is loaded or refused with a moebius::Error naming the file; no other
//     exception escapes.
#include <unistd.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "chat/chat_template.h"
#include "core/error.h"
#include "core/log.h"
#include "fuzz_check.h"
#include "offload/routing_profile.h"
#include "tune/moe_tune_key.h"
#include "tune/tune_cache.h"

using namespace moebius;
using moebius::fuzz::check;

namespace {

const std::string& temp_dir() {
  static const std::string dir = [] {
    std::filesystem::path p =
        std::filesystem::temp_directory_path() / ("moebius-fuzz-json-" + std::to_string(::getpid()));
    std::filesystem::create_directories(p);
    return p.string();
  }();
  return dir;
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  check(static_cast<bool>(out));
}

void fuzz_profile(const std::string& text) {
  auto p = offload::profile_from_json(text, "fuzz.json");
  if (!p.ok()) {
    check(!p.error().message().empty() && p.error().file() == "fuzz.json");
    return;
  }
  check(p->validate().ok());
  check(p->num_experts >= 1 && p->top_k >= 1 && p->top_k <= p->num_experts);
  for (const offload::LayerRouting& l : p->layers) {
    check(l.counts.size() == static_cast<size_t>(p->num_experts) && l.mass.size() == l.counts.size());
    for (double m : l.mass) check(std::isfinite(m) && m >= 0);
  }
  auto again = offload::profile_from_json(offload::profile_to_json(*p), "again.json");
  check(again.ok() && again->num_experts == p->num_experts && again->top_k == p->top_k &&
        again->tokens == p->tokens && again->layers.size() == p->layers.size());
  for (size_t i = 0; i < p->layers.size(); ++i)
    check(again->layers[i].layer == p->layers[i].layer && again->layers[i].counts == p->layers[i].counts &&
          again->layers[i].mass == p->layers[i].mass);
}

void fuzz_tune_cache(const std::string& text) {
  const std::string device = "GPU-fuzz";
  write_file(tune::cache_file_path(temp_dir(), device), text);
  const tune::CacheNamespace ns{"0.1.0", "12.8", "NVIDIA H200"};
  const tune::TuneCache cache = tune::TuneCache::open(temp_dir(), device, ns);
  if (cache.size() == 0) return;
  // Every key the file could hold is a string; ask for the ones a fuzzer reaches easily.
  for (const char* key : {"a", "k", "moe.v4", ""}) {
    auto value = cache.get(key);
    if (!value) continue;
    auto choice = tune::MoeTuneChoice::from_json(*value);
    if (!choice.ok()) {
      check(!choice.error().message().empty());
      continue;
    }
    for (const tune::MoeTuneConfig* c : {&choice->winner, &choice->heuristic}) {
      check(c->block_m >= 1 && c->block_m <= 1024 && !c->gemm_path.empty());
      check(c->split_k_warps == 4 || c->split_k_warps == 8);
      check(c->rows_per_block >= 0 && c->rows_per_block <= 64);
    }
    check(std::isfinite(choice->winner_us) && choice->winner_us >= 0);
  }
}

void fuzz_tokenizer_config(const std::string& text) {
  const std::string path = temp_dir() + "/tokenizer_config.json";
  write_file(path, text);
  try {
    (void)chat::ChatTemplate::from_tokenizer_config(path);
  } catch (const Error& e) {
    check(!e.message().empty() && e.file() == path);
  } catch (...) {
    check(false);  // only moebius::Error may leave the loader
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool quiet = (set_log_level(LogLevel::kError), true);  // the cache warns on most inputs
  (void)quiet;
  if (size > (64u << 10)) return 0;  // the files are small; larger inputs only slow the search
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz_profile(text);
  fuzz_tune_cache(text);
  fuzz_tokenizer_config(text);
  return 0;
}
