// The autotuner's host side (src/tune): capacity buckets, the cache key, the persistent cache
// (concurrent writer processes, corrupt, truncated and foreign files), and the reference-counted
// workspace pool (core/workspace_pool.h) over a counting allocator.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "core/workspace_pool.h"
#include "tune/capacity_buckets.h"
#include "tune/moe_tune_key.h"
#include "tune/tune_cache.h"

namespace moebius::tune {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using nlohmann::json;

// ---- capacity buckets -------------------------------------------------------------------------

std::vector<int> sizes(const CapacityBuckets& b) { return {b.sizes().begin(), b.sizes().end()}; }

TEST(CapacityBuckets, PowersOfTwoUpToTheDecodeTokensPlusThePrefillChunk) {
  // moebius serve defaults: graph batches up to 64, no speculative verify, 2048-token chunks.
  auto b = CapacityBuckets::make(64, 1, 2048);
  ASSERT_TRUE(b.ok()) << b.error().what();
  EXPECT_THAT(sizes(*b), ElementsAre(1, 2, 4, 8, 16, 32, 64, 2048));
  EXPECT_EQ(b->largest(), 2048);
  // Batch 8 with 4 tokens verified per sequence: 32 decode tokens.
  EXPECT_THAT(sizes(*CapacityBuckets::make(8, 4, 512)), ElementsAre(1, 2, 4, 8, 16, 32, 512));
  // A decode batch that is not a power of two rounds up...
  EXPECT_THAT(sizes(*CapacityBuckets::make(48, 1, 2048)), ElementsAre(1, 2, 4, 8, 16, 32, 64, 2048));
  // ...unless the prefill chunk is smaller than that power.
  EXPECT_THAT(sizes(*CapacityBuckets::make(48, 1, 48)), ElementsAre(1, 2, 4, 8, 16, 32, 48));
  EXPECT_THAT(sizes(*CapacityBuckets::make(1, 1, 1)), ElementsAre(1));
  EXPECT_THAT(sizes(*CapacityBuckets::make(2, 1, 32)), ElementsAre(1, 2, 32));
  EXPECT_THAT(sizes(*CapacityBuckets::make(64, 1, 16)), ElementsAre(1, 2, 4, 8, 16, 32, 64));
}

TEST(CapacityBuckets, ATokenCountTakesTheNextBucketUp) {
  auto b = CapacityBuckets::make(64, 1, 2048);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b->bucket_for(1), 1);
  EXPECT_EQ(*b->bucket_for(3), 4);
  EXPECT_EQ(*b->bucket_for(33), 64);
  EXPECT_EQ(*b->bucket_for(64), 64);
  EXPECT_EQ(*b->bucket_for(65), 2048);
  EXPECT_EQ(*b->bucket_for(2048), 2048);
  EXPECT_EQ(*b->index_for(65), 7u);
  // Exhaustively against a linear scan.
  for (int t = 1; t <= 2048; ++t) {
    int want = -1;
    for (int s : b->sizes())
      if (s >= t) {
        want = s;
        break;
      }
    ASSERT_EQ(*b->bucket_for(t), want) << t;
    ASSERT_EQ(b->sizes()[*b->index_for(t)], want) << t;
  }
}

TEST(CapacityBuckets, ACountAboveTheLargestBucketIsAnError) {
  auto b = CapacityBuckets::make(64, 1, 2048);
  ASSERT_TRUE(b.ok());
  for (int t : {2049, 4096, INT_MAX}) {
    auto r = b->bucket_for(t);
    ASSERT_FALSE(r.ok()) << t;
    EXPECT_THAT(r.error().what(), HasSubstr(std::to_string(t) + " tokens exceed the largest MoE capacity bucket 2048"));
    EXPECT_FALSE(b->index_for(t).ok());
  }
  for (int t : {0, -1, INT_MIN}) EXPECT_FALSE(b->bucket_for(t).ok()) << t;
}

TEST(CapacityBuckets, ABucketIsTunedAtItsPowerOfTwo) {
  EXPECT_EQ(tuning_bucket(1), 1);
  EXPECT_EQ(tuning_bucket(2), 2);
  EXPECT_EQ(tuning_bucket(3), 4);
  EXPECT_EQ(tuning_bucket(37), 64);
  EXPECT_EQ(tuning_bucket(2048), 2048);
  EXPECT_EQ(tuning_bucket(2049), 4096);
  EXPECT_EQ(tuning_bucket(1 << 20), 1 << 20);
}

TEST(CapacityBuckets, RefusesBadLimits) {
  EXPECT_EQ(CapacityBuckets::make(0, 1, 64).error().field(), "max_decode_batch");
  EXPECT_EQ(CapacityBuckets::make(1, 0, 64).error().field(), "verify_width");
  EXPECT_EQ(CapacityBuckets::make(1, 1, 0).error().field(), "prefill_chunk");
  EXPECT_FALSE(CapacityBuckets::make(1 << 20, 2, 64).ok());     // decode tokens past 2^20
  EXPECT_FALSE(CapacityBuckets::make(1, 1, (1 << 20) + 1).ok());
  EXPECT_FALSE(CapacityBuckets::make(INT_MAX, INT_MAX, 64).ok());  // no overflow
}

// ---- the key --------------------------------------------------------------------------------

MoeTuneKey qwen3_30b_key() {
  // Qwen3-30B-A3B: H=2048, I=768, E=128, k=8.
  MoeTuneKey k;
  k.hidden = 2048;
  k.intermediate = 768;
  k.num_experts = 128;
  k.top_k = 8;
  k.format = "nvfp4";
  k.group_size = 0;
  k.activation = "silu";
  k.combine = "store";
  k.bucket = 64;
  return k;
}

TEST(MoeTuneKey, TextFormIsStable) {
  // The cache files depend on this text: changing it orphans every stored winner.
  EXPECT_EQ(qwen3_30b_key().str(), "moe.v9 H=2048 I=768 E=128 k=8 fmt=nvfp4 g=0 act=silu combine=store bucket=64");
}

TEST(MoeTuneKey, EveryFieldChangesTheText) {
  const std::string base = qwen3_30b_key().str();
  std::vector<MoeTuneKey> v(9, qwen3_30b_key());
  v[0].hidden = 4096;
  v[1].intermediate = 1536;
  v[2].num_experts = 64;
  v[3].top_k = 4;
  v[4].format = "int4";
  v[5].group_size = 128;
  v[6].activation = "silu_clamped(7)";
  v[7].combine = "atomic";
  v[8].bucket = 128;
  std::vector<std::string> seen{base};
  for (const MoeTuneKey& k : v) {
    EXPECT_NE(k.str(), base);
    for (const std::string& s : seen) EXPECT_NE(k.str(), s);
    seen.push_back(k.str());
  }
}

MoeTuneChoice sample_choice() {
  MoeTuneChoice c;
  c.winner = {"prefill", 64, false};
  c.heuristic = {"decode", 8, true};
  c.winner_us = 21.5;
  c.heuristic_us = 30.25;
  c.candidates = 11;
  return c;
}

TEST(MoeTuneChoice, RoundTripsThroughJsonAndValidates) {
  const MoeTuneChoice c = sample_choice();
  auto back = MoeTuneChoice::from_json(json::parse(c.to_json().dump()));
  ASSERT_TRUE(back.ok()) << back.error().what();
  EXPECT_EQ(back->winner, c.winner);
  EXPECT_EQ(back->heuristic, c.heuristic);
  EXPECT_DOUBLE_EQ(back->winner_us, 21.5);
  EXPECT_DOUBLE_EQ(back->heuristic_us, 30.25);
  EXPECT_EQ(back->candidates, 11);
  EXPECT_EQ(c.winner.str(), "prefill bm=64");
  EXPECT_EQ(c.heuristic.str(), "decode bm=8 fused");
  // rows_per_block round-trips, is optional (older entries: the heuristic) and bounded.
  MoeTuneChoice rows = c;
  rows.winner = {"decode", 8, false, 4};
  auto rows_back = MoeTuneChoice::from_json(json::parse(rows.to_json().dump()));
  ASSERT_TRUE(rows_back.ok()) << rows_back.error().what();
  EXPECT_EQ(rows_back->winner.rows_per_block, 4);
  EXPECT_EQ(rows.winner.str(), "decode bm=8 rows=4");
  json old = c.to_json();
  old["winner"].erase("rows_per_block");
  auto old_back = MoeTuneChoice::from_json(old);
  ASSERT_TRUE(old_back.ok()) << old_back.error().what();
  EXPECT_EQ(old_back->winner.rows_per_block, 0);
  // split_k_warps likewise: 4 or 8, optional (older entries ran 4).
  MoeTuneChoice wide = c;
  wide.winner = {"decode", 8, true, 4, 8};
  auto wide_back = MoeTuneChoice::from_json(json::parse(wide.to_json().dump()));
  ASSERT_TRUE(wide_back.ok()) << wide_back.error().what();
  EXPECT_EQ(wide_back->winner.split_k_warps, 8);
  EXPECT_EQ(wide.winner.str(), "decode bm=8 fused rows=4 warps=8");
  old["winner"].erase("split_k_warps");
  auto older = MoeTuneChoice::from_json(old);
  ASSERT_TRUE(older.ok()) << older.error().what();
  EXPECT_EQ(older->winner.split_k_warps, 4);

  auto bad = [&](const std::function<void(json&)>& edit) {
    json j = c.to_json();
    edit(j);
    return MoeTuneChoice::from_json(j);
  };
  EXPECT_EQ(bad([](json& j) { j.erase("winner"); }).error().field(), "winner");
  EXPECT_EQ(bad([](json& j) { j["winner"]["block_m"] = "8"; }).error().field(), "winner.block_m");
  EXPECT_EQ(bad([](json& j) { j["winner"]["block_m"] = 0; }).error().field(), "winner.block_m");
  EXPECT_EQ(bad([](json& j) { j["heuristic"]["gemm_path"] = ""; }).error().field(), "heuristic.gemm_path");
  EXPECT_EQ(bad([](json& j) { j["heuristic"]["fuse_routing"] = 1; }).error().field(), "heuristic.fuse_routing");
  EXPECT_EQ(bad([](json& j) { j["winner"]["rows_per_block"] = -1; }).error().field(), "winner.rows_per_block");
  EXPECT_EQ(bad([](json& j) { j["winner"]["rows_per_block"] = "4"; }).error().field(), "winner.rows_per_block");
  EXPECT_EQ(bad([](json& j) { j["winner"]["split_k_warps"] = 6; }).error().field(), "winner.split_k_warps");
  EXPECT_EQ(bad([](json& j) { j["heuristic"]["split_k_warps"] = "8"; }).error().field(), "heuristic.split_k_warps");
  EXPECT_EQ(bad([](json& j) { j["winner_us"] = -1.0; }).error().field(), "winner_us");
  EXPECT_EQ(bad([](json& j) { j["heuristic_us"] = "fast"; }).error().field(), "heuristic_us");
  EXPECT_FALSE(MoeTuneChoice::from_json(json::array()).ok());
}

// ---- the cache ------------------------------------------------------------------------------

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "moebius-tune-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data()) ? tmpl : "";
    EXPECT_FALSE(path_.empty()) << "mkdtemp failed";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

const CacheNamespace kNs{"0.1.0", "12.8", "NVIDIA H200"};
const std::string kDevice = "GPU-8a1c2d3e-0000-1111-2222-333344445555";

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

json value(int i) { return json{{"i", i}}; }

TEST(TuneCache, FileNamedByDeviceUnderTheCacheDir) {
  EXPECT_EQ(cache_file_path("/c", kDevice), "/c/" + kDevice + ".json");
  EXPECT_EQ(cache_file_path("/c", "a/b c"), "/c/a_b_c.json");
  EXPECT_EQ(cache_file_path("/c", ".."), "/c/_.json");
  EXPECT_EQ(cache_file_path("/c", ""), "/c/unknown-device.json");

  const char* saved_dir = std::getenv("MOEBIUS_CACHE_DIR");
  const char* saved_home = std::getenv("HOME");
  const std::string keep_dir = saved_dir ? saved_dir : "", keep_home = saved_home ? saved_home : "";
  ::setenv("MOEBIUS_CACHE_DIR", "/tmp/x-cache", 1);
  EXPECT_EQ(*default_cache_dir(), "/tmp/x-cache");
  ::setenv("MOEBIUS_CACHE_DIR", "", 1);  // empty counts as unset
  ::setenv("HOME", "/home/u", 1);
  EXPECT_EQ(*default_cache_dir(), "/home/u/.cache/moebius");
  ::unsetenv("MOEBIUS_CACHE_DIR");
  ::unsetenv("HOME");
  EXPECT_FALSE(default_cache_dir().ok());
  if (saved_dir) ::setenv("MOEBIUS_CACHE_DIR", keep_dir.c_str(), 1);
  if (saved_home) ::setenv("HOME", keep_home.c_str(), 1);
}

TEST(TuneCache, PutPersistsWithTheNamespaceAndReopens) {
  TempDir tmp;
  const std::string dir = tmp.path() + "/nested/cache";  // created by the first put
  TuneCache c = TuneCache::open(dir, kDevice, kNs);
  EXPECT_EQ(c.size(), 0u);
  EXPECT_TRUE(c.warnings().empty());
  EXPECT_FALSE(c.get("k1").has_value());
  ASSERT_TRUE(c.put("k1", value(1)).ok());
  ASSERT_TRUE(c.put("k2", value(2)).ok());
  ASSERT_TRUE(c.put("k1", value(3)).ok());  // overwrites
  EXPECT_EQ(c.get("k1"), value(3));

  const json doc = json::parse(read_text(c.path()));
  EXPECT_EQ(doc["moebius_tune_cache"], kTuneCacheSchema);
  ASSERT_EQ(doc["entries"].size(), 2u);
  const json& e = doc["entries"][0]["key"] == "k2" ? doc["entries"][0] : doc["entries"][1];
  EXPECT_EQ(e["moebius"], "0.1.0");
  EXPECT_EQ(e["cuda"], "12.8");
  EXPECT_EQ(e["gpu"], "NVIDIA H200");
  EXPECT_EQ(e["value"], value(2));

  TuneCache again = TuneCache::open(dir, kDevice, kNs);
  EXPECT_EQ(again.size(), 2u);
  EXPECT_EQ(again.get("k1"), value(3));
  EXPECT_EQ(again.get("k2"), value(2));
  EXPECT_TRUE(again.warnings().empty());
  // Another device has its own file.
  EXPECT_EQ(TuneCache::open(dir, "GPU-other", kNs).size(), 0u);
  // No temporary files are left behind.
  for (const auto& f : fs::directory_iterator(dir))
    EXPECT_THAT(f.path().filename().string(), ::testing::Not(HasSubstr(".tmp"))) << f.path();
}

TEST(TuneCache, AnotherNamespaceIsIgnoredButKept) {
  TempDir tmp;
  ASSERT_TRUE(TuneCache::open(tmp.path(), kDevice, kNs).put("k", value(1)).ok());
  for (const CacheNamespace& other : {CacheNamespace{"0.2.0", "12.8", "NVIDIA H200"},
                                      CacheNamespace{"0.1.0", "13.0", "NVIDIA H200"},
                                      CacheNamespace{"0.1.0", "12.8", "NVIDIA H100 80GB HBM3"}}) {
    TuneCache c = TuneCache::open(tmp.path(), kDevice, other);
    EXPECT_FALSE(c.get("k").has_value()) << other.moebius << " " << other.cuda << " " << other.gpu;
    EXPECT_EQ(c.ignored_other_namespaces(), 1u);
    EXPECT_TRUE(c.warnings().empty());  // a mismatch is not an error
  }
  // A writer of another version keeps the first version's entry in the file.
  TuneCache v2 = TuneCache::open(tmp.path(), kDevice, {"0.2.0", "12.8", "NVIDIA H200"});
  ASSERT_TRUE(v2.put("k", value(2)).ok());
  EXPECT_EQ(TuneCache::open(tmp.path(), kDevice, kNs).get("k"), value(1));
  EXPECT_EQ(v2.get("k"), value(2));
}

// A cache file of one entry in kNs whose value is {"a": {"a": ... 1}} nested `levels` deep.
std::string deep_entry_file(int levels) {
  std::string v;
  for (int i = 0; i < levels; ++i) v += R"({"a":)";
  v += "1" + std::string(static_cast<size_t>(levels), '}');
  return R"({"moebius_tune_cache": 1, "entries": [{"moebius": "0.1.0", "cuda": "12.8", "gpu": "NVIDIA H200", )"
         R"("key": "a", "value": )" + v + "}]}";
}

TEST(TuneCache, CorruptTruncatedAndForeignFilesAreIgnoredWithAWarning) {
  TempDir tmp;
  TuneCache good = TuneCache::open(tmp.path(), kDevice, kNs);
  ASSERT_TRUE(good.put("a", value(1)).ok());
  ASSERT_TRUE(good.put("b", value(2)).ok());
  const std::string path = good.path(), text = read_text(path);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"truncated", text.substr(0, text.size() / 2)},
      {"truncated to one byte", text.substr(0, 1)},
      {"empty", ""},
      {"garbage", "\x7f" "ELF\x01\x02 not json at all"},
      {"a JSON array", "[1, 2, 3]"},
      {"no schema", R"({"entries": []})"},
      {"an older schema", R"({"moebius_tune_cache": 0, "entries": []})"},
      {"entries not an array", R"({"moebius_tune_cache": 1, "entries": {"a": 1}})"},
      // [TAG_JSON_DEPTH] A well-formed entry whose value (an object) nests 200k levels: copying it
      // (adopt, get) recursed per level and overflowed the stack before the depth check.
      {"nested 200k levels deep", deep_entry_file(200000)},
  };
  for (const auto& [what, content] : cases) {
    SCOPED_TRACE(what);
    write_text(path, content);
    TuneCache c = TuneCache::open(tmp.path(), kDevice, kNs);
    EXPECT_EQ(c.size(), 0u);
    EXPECT_FALSE(c.get("a").has_value());
    ASSERT_EQ(c.warnings().size(), 1u);
    // The next write replaces the bad file with a good one.
    ASSERT_TRUE(c.put("c", value(3)).ok());
    TuneCache after = TuneCache::open(tmp.path(), kDevice, kNs);
    EXPECT_TRUE(after.warnings().empty());
    EXPECT_EQ(after.get("c"), value(3));
  }
}

TEST(TuneCache, MalformedEntriesAreDroppedAndTheRestKept) {
  TempDir tmp;
  const std::string path = cache_file_path(tmp.path(), kDevice);
  json ok1{{"moebius", "0.1.0"}, {"cuda", "12.8"}, {"gpu", "NVIDIA H200"}, {"key", "ok1"}, {"value", value(1)}};
  json ok2 = ok1;
  ok2["key"] = "ok2";
  json no_key = ok1;
  no_key.erase("key");
  json bad_value = ok1;
  bad_value["key"] = "bv";
  bad_value["value"] = 7;
  json bad_ns = ok1;
  bad_ns["key"] = "bn";
  bad_ns["cuda"] = 12.8;
  write_text(path, json{{"moebius_tune_cache", 1}, {"entries", {ok1, no_key, bad_value, 42, bad_ns, ok2}}}.dump());
  TuneCache c = TuneCache::open(tmp.path(), kDevice, kNs);
  EXPECT_EQ(c.size(), 2u);
  EXPECT_EQ(c.get("ok1"), value(1));
  EXPECT_EQ(c.get("ok2"), value(1));
  ASSERT_EQ(c.warnings().size(), 1u);
  EXPECT_THAT(c.warnings()[0], HasSubstr("4 malformed entries"));
}

TEST(TuneCache, AFileOfANewerSchemaIsNeverOverwritten) {
  TempDir tmp;
  const std::string path = cache_file_path(tmp.path(), kDevice);
  const std::string newer = R"({"moebius_tune_cache": 99, "entries": [{"anything": true}]})";
  write_text(path, newer);
  TuneCache c = TuneCache::open(tmp.path(), kDevice, kNs);
  EXPECT_EQ(c.warnings().size(), 1u);
  const Status st = c.put("k", value(1));
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(read_text(path), newer);
  EXPECT_EQ(c.get("k"), value(1));  // still usable in this process
}

TEST(TuneCache, AnUnwritableDirectoryIsAnErrorNotACrash) {
  TempDir tmp;
  const std::string file = tmp.path() + "/a-file";
  write_text(file, "x");
  TuneCache c = TuneCache::open(file + "/sub", kDevice, kNs);  // a directory under a regular file
  EXPECT_FALSE(c.put("k", value(1)).ok());
  EXPECT_EQ(c.get("k"), value(1));
}

// Four writer processes (fork) put 25 distinct entries each, one put at a time, so every put is a
// locked read-merge-rename racing the others; meanwhile this process keeps reading the file and
// must never see it partial. Afterwards all 100 entries are there.
TEST(TuneCache, ConcurrentWriterProcessesLoseNoEntries) {
  TempDir tmp;
  constexpr int kWriters = 4, kPerWriter = 25;
  std::vector<pid_t> pids;
  for (int w = 0; w < kWriters; ++w) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0) << "fork failed";
    if (pid == 0) {
      int failures = 0;
      TuneCache c = TuneCache::open(tmp.path(), kDevice, kNs);
      for (int i = 0; i < kPerWriter; ++i)
        if (!c.put(fmt::format("w{}-{}", w, i), value(w * 1000 + i)).ok()) ++failures;
      ::_exit(failures == 0 ? 0 : 1);
    }
    pids.push_back(pid);
  }
  int reads = 0, bad_reads = 0, running = kWriters;
  std::vector<int> status(kWriters, -1);
  while (running > 0) {
    TuneCache r = TuneCache::open(tmp.path(), kDevice, kNs);
    ++reads;
    bad_reads += r.warnings().empty() ? 0 : 1;
    for (int w = 0; w < kWriters; ++w) {
      if (status[w] != -1) continue;
      int st = 0;
      if (::waitpid(pids[w], &st, WNOHANG) == pids[w]) {
        status[w] = st;
        --running;
      }
    }
  }
  for (int w = 0; w < kWriters; ++w) {
    EXPECT_TRUE(WIFEXITED(status[w])) << "writer " << w;
    EXPECT_EQ(WEXITSTATUS(status[w]), 0) << "writer " << w << " had failed puts";
  }
  EXPECT_EQ(bad_reads, 0) << "of " << reads << " concurrent reads";
  TuneCache all = TuneCache::open(tmp.path(), kDevice, kNs);
  EXPECT_TRUE(all.warnings().empty());
  EXPECT_EQ(all.size(), static_cast<size_t>(kWriters * kPerWriter));
  for (int w = 0; w < kWriters; ++w)
    for (int i = 0; i < kPerWriter; ++i)
      EXPECT_EQ(all.get(fmt::format("w{}-{}", w, i)), value(w * 1000 + i)) << w << " " << i;
  for (const auto& f : fs::directory_iterator(tmp.path()))
    EXPECT_THAT(f.path().filename().string(), ::testing::Not(HasSubstr(".tmp"))) << f.path();
}

}  // namespace
}  // namespace moebius::tune

// ---- the workspace pool -------------------------------------------------------------------------

namespace moebius {
namespace {

struct AllocStats {
  int allocs = 0, frees = 0;
  size_t live_bytes = 0;
  bool fail_next = false;
};

// Host memory with counters, standing in for cudaMalloc / cudaFree.
struct CountingAllocator {
  AllocStats* stats = nullptr;
  Result<void*> allocate(size_t bytes) {
    if (stats->fail_next) {
      stats->fail_next = false;
      return Error::format("out of memory ({} bytes)", bytes);
    }
    ++stats->allocs;
    stats->live_bytes += bytes;
    return std::malloc(bytes);
  }
  void deallocate(void* p, size_t bytes) noexcept {
    ++stats->frees;
    stats->live_bytes -= bytes;
    std::free(p);
  }
};

using Pool = WorkspacePool<CountingAllocator>;

// Stands in for a MoE layer holding its workspace.
struct FakeLayer {
  Pool::Handle ws;
};

TEST(WorkspacePool, LayersOfOneLayoutShareABlockCountedTwoOneZero) {
  AllocStats s;
  Pool pool(CountingAllocator{&s});
  auto a = std::make_unique<FakeLayer>(FakeLayer{*pool.acquire("moe H=2048 cap=64", 4096)});
  auto b = std::make_unique<FakeLayer>(FakeLayer{*pool.acquire("moe H=2048 cap=64", 4096)});
  EXPECT_EQ(a->ws->data(), b->ws->data());
  EXPECT_EQ(s.allocs, 1);
  EXPECT_EQ(pool.use_count("moe H=2048 cap=64"), 2);
  EXPECT_EQ(pool.holders(), 2);
  EXPECT_EQ(pool.live_blocks(), 1u);
  EXPECT_EQ(pool.live_bytes(), 4096u);
  a.reset();
  EXPECT_EQ(pool.use_count("moe H=2048 cap=64"), 1);
  EXPECT_EQ(pool.holders(), 1);
  EXPECT_EQ(s.frees, 0);
  b.reset();
  EXPECT_EQ(pool.use_count("moe H=2048 cap=64"), 0);
  EXPECT_EQ(pool.holders(), 0);
  EXPECT_EQ(s.frees, 1);
  EXPECT_EQ(s.live_bytes, 0u);
  EXPECT_EQ(pool.live_blocks(), 0u);
  // A later layer of the same layout gets a fresh block.
  FakeLayer c{*pool.acquire("moe H=2048 cap=64", 4096)};
  EXPECT_EQ(s.allocs, 2);
  EXPECT_EQ(pool.use_count("moe H=2048 cap=64"), 1);
}

TEST(WorkspacePool, OtherLayoutsGetTheirOwnBlocks) {
  AllocStats s;
  Pool pool(CountingAllocator{&s});
  FakeLayer d1{*pool.acquire("decode", 100)}, d2{*pool.acquire("decode", 100)}, p1{*pool.acquire("prefill", 5000)};
  EXPECT_NE(d1.ws->data(), p1.ws->data());
  EXPECT_EQ(pool.use_count("decode"), 2);
  EXPECT_EQ(pool.use_count("prefill"), 1);
  EXPECT_EQ(pool.use_count("nothing"), 0);
  EXPECT_EQ(pool.live_bytes(), 5100u);
  EXPECT_EQ(s.allocs, 2);
}

TEST(WorkspacePool, BlocksOutliveThePoolAndFailuresLeaveNothing) {
  AllocStats s;
  FakeLayer keep;
  {
    Pool pool(CountingAllocator{&s});
    s.fail_next = true;
    auto r = pool.acquire("x", 64);
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.error().what(), ::testing::HasSubstr("out of memory"));
    EXPECT_EQ(pool.live_blocks(), 0u);
    keep.ws = *pool.acquire("x", 64);
    EXPECT_EQ(s.allocs, 1);
  }
  EXPECT_EQ(s.frees, 0);  // the pool is gone, the block is not
  keep.ws.reset();
  EXPECT_EQ(s.frees, 1);
}

TEST(WorkspacePool, SameKeyWithOtherBytesIsOurBug) {
  AllocStats s;
  Pool pool(CountingAllocator{&s});
  FakeLayer a{*pool.acquire("k", 64)};
  EXPECT_DEATH((void)pool.acquire("k", 128), "asked with 128 bytes");
}

}  // namespace
}  // namespace moebius
