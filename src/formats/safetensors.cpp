#include "formats/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <unordered_map>
#include <utility>

#include <nlohmann/json.hpp>

namespace moebius {

namespace {

using json = nlohmann::json;

// A safetensors header nests 3 levels (root -> tensor -> shape) and an HF index 3 as well. Deeper
// input is refused while parsing, before it can build a huge DOM; the slack above 3 lets a
// slightly wrong entry (e.g. "shape": [[1]]) still get a precise error naming its tensor.
constexpr int kMaxJsonDepth = 8;
// An index file is a JSON map of names; bound it like a header.
constexpr uint64_t kMaxIndexBytes = kSafetensorsMaxHeaderBytes;

// A first pass over the JSON text that builds nothing: it refuses duplicate keys (nlohmann would
// silently keep the last one, so two entries for one tensor would go unnoticed) and nesting deeper
// than kMaxJsonDepth, before the DOM parse can spend memory on either. (nlohmann's parser callback
// could do this in one pass, but its DOM builder then rescans the parent object after each child
// object, which is quadratic: 100k tensors took minutes.)
class JsonPrecheck {
 public:
  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(json::number_integer_t) { return true; }
  bool number_unsigned(json::number_unsigned_t) { return true; }
  bool number_float(json::number_float_t, const std::string&) { return true; }
  bool string(std::string&) { return true; }
  bool binary(json::binary_t&) { return true; }
  bool start_object(size_t) { return push(); }
  bool start_array(size_t) { return push(); }
  bool end_object() { return pop(); }
  bool end_array() { return pop(); }
  bool key(std::string& k) {
    MOEBIUS_ASSERT(depth_ >= 1, "key outside an object");
    if (!keys_[depth_ - 1].insert(k).second) return fail(fmt::format("duplicate key '{}'", k));
    return true;
  }
  template <typename Exception>
  bool parse_error(size_t, const std::string&, const Exception& e) {
    // Drop nlohmann's "[json.exception.parse_error.101] " prefix; keep position and reason.
    std::string_view w = e.what();
    if (const size_t p = w.find("] "); p != std::string_view::npos) w.remove_prefix(p + 2);
    return fail(fmt::format("invalid JSON: {}", w));
  }
  const std::string& error() const { return error_; }

 private:
  bool push() {
    if (depth_ >= static_cast<size_t>(kMaxJsonDepth)) return fail(fmt::format("JSON nests deeper than {} levels", kMaxJsonDepth));
    if (keys_.size() <= depth_) keys_.resize(depth_ + 1);
    keys_[depth_++].clear();  // containers at one depth never overlap in time: reuse the set
    return true;
  }
  bool pop() {
    --depth_;
    return true;
  }
  bool fail(std::string message) {
    if (error_.empty()) error_ = std::move(message);
    return false;  // stops sax_parse
  }
  size_t depth_ = 0;
  std::vector<std::set<std::string, std::less<>>> keys_;  // keys of the open container at each depth
  std::string error_;
};

// Parses untrusted JSON: no duplicate keys, bounded nesting, no exception escapes.
Result<json> parse_json(std::string_view text) {
  // nlohmann's lexer takes a NUL byte for the end of input, so "{}\0<anything>" would pass. A raw
  // NUL is never valid JSON (inside strings it must be escaped), so refuse it up front.
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos)
    return Error::format("invalid JSON: NUL byte at offset {}", nul);
  JsonPrecheck check;
  if (!json::sax_parse(text.begin(), text.end(), &check)) {
    MOEBIUS_ASSERT(!check.error().empty(), "sax_parse failed without a reason");
    return Error(check.error());
  }
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  MOEBIUS_ASSERT(!j.is_discarded(), "JSON accepted by the precheck failed to parse");
  return j;
}

uint64_t load_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void store_u64_le(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

const char* json_type(const json& j) { return j.type_name(); }

bool valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    int n = 0;
    uint32_t cp = 0;
    if (c < 0x80) { ++i; continue; }
    if ((c & 0xE0) == 0xC0) { n = 1; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { n = 2; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { n = 3; cp = c & 0x07; }
    else return false;
    if (s.size() - i <= static_cast<size_t>(n)) return false;  // truncated sequence
    for (int k = 1; k <= n; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + static_cast<size_t>(k)]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    // Overlong forms, surrogates and code points past U+10FFFF are not UTF-8.
    if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000)) return false;
    if ((cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) return false;
    i += static_cast<size_t>(n) + 1;
  }
  return true;
}

// Rules shared by reader and writer, so the writer never produces a file the reader refuses.
Status check_tensor_name(std::string_view name) {
  if (name.empty()) return Error("tensor name is empty");
  if (name == "__metadata__") return Error("'__metadata__' is reserved and cannot name a tensor");
  if (!valid_utf8(name)) return Error("tensor name is not valid UTF-8");
  // Control characters come from no real exporter and would garble every error message and log
  // line that prints the name.
  for (char c : name)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7F)
      return Error::format("tensor name contains control character 0x{:02x}", static_cast<unsigned char>(c));
  return Ok{};
}

// numel(shape) * dtype_size with overflow checks. Every dim is already known to be >= 0.
Result<uint64_t> checked_nbytes(const Shape& shape, DType dtype) {
  uint64_t numel = 1;
  for (int i = 0; i < shape.rank; ++i) {
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(shape[i]), &numel) ||
        numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return Error::format("element count of shape {} overflows int64", shape.str()).in_field("shape");
  }
  uint64_t nbytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(dtype)), &nbytes))
    return Error::format("byte size of shape {} x {} bytes overflows 64 bits", shape.str(), dtype_size(dtype))
        .in_field("shape");
  return nbytes;
}

// A JSON integer >= 0. nlohmann stores non-negative integers as unsigned, negative ones (and
// "-0") as signed, and floats (2.0, 1e3) or integers past u64 as floating point; like serde's usize
// (the official reader) we accept exactly the integers in [0, 2^64).
std::optional<uint64_t> as_uint(const json& j) {
  if (j.is_number_unsigned()) return j.get<uint64_t>();
  if (j.is_number_integer() && j.get<int64_t>() >= 0) return static_cast<uint64_t>(j.get<int64_t>());
  return std::nullopt;
}

// One header entry -> TensorInfo (offsets checked against the data section, not yet against
// other tensors).
Result<TensorInfo> parse_entry(const std::string& name, const json& j, std::span<const uint8_t> data) {
  MOEBIUS_TRY(check_tensor_name(name));
  if (!j.is_object()) return Error::format("entry must be an object, got {}", json_type(j));
  for (const auto& [k, v] : j.items()) {
    (void)v;
    if (k != "dtype" && k != "shape" && k != "data_offsets")
      return Error::format("unknown key (allowed: dtype, shape, data_offsets)").in_field(k);
  }
  TensorInfo t;
  t.name = name;

  const auto dt = j.find("dtype");
  if (dt == j.end()) return Error("missing").in_field("dtype");
  if (!dt->is_string()) return Error::format("must be a string, got {}", json_type(*dt)).in_field("dtype");
  const auto& dname = dt->get_ref<const std::string&>();
  const auto dtype = dtype_from_name(dname);
  if (!dtype) return Error::format("unknown dtype '{}'", dname).in_field("dtype");
  t.dtype = *dtype;

  const auto sh = j.find("shape");
  if (sh == j.end()) return Error("missing").in_field("shape");
  if (!sh->is_array()) return Error::format("must be an array, got {}", json_type(*sh)).in_field("shape");
  if (sh->size() > static_cast<size_t>(kMaxDims))
    return Error::format("rank {} exceeds the maximum of {}", sh->size(), kMaxDims).in_field("shape");
  for (const auto& d : *sh) {
    const auto v = as_uint(d);
    if (!v && d.is_number_integer())
      return Error::format("dimension {} is negative", d.get<int64_t>()).in_field("shape");
    if (!v)
      return Error::format("dimension must be a non-negative integer, got {} {}", json_type(d), d.dump())
          .in_field("shape");
    if (*v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return Error::format("dimension {} does not fit int64", *v).in_field("shape");
    t.shape.dims[static_cast<size_t>(t.shape.rank++)] = static_cast<int64_t>(*v);
  }

  const auto off = j.find("data_offsets");
  if (off == j.end()) return Error("missing").in_field("data_offsets");
  if (!off->is_array() || off->size() != 2)
    return Error::format("must be an array [begin, end], got {}", off->dump()).in_field("data_offsets");
  for (size_t i = 0; i < 2; ++i) {
    const auto v = as_uint((*off)[i]);
    if (!v)
      return Error::format("offsets must be non-negative integers, got {}", (*off)[i].dump()).in_field("data_offsets");
    t.data_offsets[i] = *v;
  }
  const auto [begin, end] = t.data_offsets;
  if (begin > end) return Error::format("begin {} > end {}", begin, end).in_field("data_offsets");
  if (end > data.size())
    return Error::format("end {} is past the end of the data section ({} bytes)", end, data.size())
        .in_field("data_offsets");

  MOEBIUS_ASSIGN_OR_RETURN(const uint64_t nbytes, checked_nbytes(t.shape, t.dtype));
  if (end - begin != nbytes)
    return Error::format("[{}, {}) spans {} bytes but {} {} needs {}", begin, end, end - begin,
                         dtype_name(t.dtype), t.shape.str(), nbytes)
        .in_field("data_offsets");
  t.data = data.data() + begin;
  return t;
}

Error missing_tensor(std::string_view name) { return Error("not found").in_tensor(std::string(name)); }

Result<TensorView> check_expected(const TensorView& v, std::string_view name, DType expect_dtype,
                                  const std::optional<Shape>& expect_shape) {
  if (v.dtype != expect_dtype)
    return Error::format("dtype is {}, expected {}", dtype_name(v.dtype), dtype_name(expect_dtype))
        .in_tensor(std::string(name))
        .in_field("dtype");
  if (expect_shape && !(v.shape == *expect_shape))
    return Error::format("shape is {}, expected {}", v.shape.str(), expect_shape->str())
        .in_tensor(std::string(name))
        .in_field("shape");
  return v;
}

}  // namespace

// =============================================================================================
// SafetensorsFile
// =============================================================================================
Result<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  MOEBIUS_ASSIGN_OR_RETURN(MappedFile mapped, MappedFile::open(path));
  MOEBIUS_ASSIGN_OR_RETURN(SafetensorsFile f, parse_impl(mapped.bytes(), path, MemoryKind::kMapped));
  // The mapping's address does not change when MappedFile moves, so f's pointers stay valid.
  f.file_ = std::move(mapped);
  return f;
}

Result<SafetensorsFile> SafetensorsFile::parse(std::span<const uint8_t> bytes, std::string name) {
  return parse_impl(bytes, std::move(name), MemoryKind::kHost);
}

Result<SafetensorsFile> SafetensorsFile::parse_impl(std::span<const uint8_t> bytes, std::string name,
                                                    MemoryKind where) {
  auto fail = [&name](Error e) { return std::move(e).in_file(name); };
  if (bytes.size() < 8)
    return fail(Error::format("file is {} bytes, too short for the 8-byte header length", bytes.size()));
  const uint64_t n = load_u64_le(bytes.data());
  if (n == 0) return fail(Error("header length is 0; a header is at least '{}'"));
  if (n > kSafetensorsMaxHeaderBytes)
    return fail(Error::format("header length {} exceeds the limit of {} bytes", n, kSafetensorsMaxHeaderBytes));
  if (n > bytes.size() - 8)
    return fail(Error::format("header length {} is larger than the {} bytes after it", n, bytes.size() - 8));

  const std::string_view text(reinterpret_cast<const char*>(bytes.data() + 8), static_cast<size_t>(n));
  const std::span<const uint8_t> data = bytes.subspan(8 + static_cast<size_t>(n));
  // The official reader refuses headers that do not start with '{' (InvalidHeaderStart); leading
  // whitespace is therefore refused too. Trailing whitespace is the writers' padding and allowed.
  if (text.front() != '{') return fail(Error::format("header does not start with '{{' (first byte 0x{:02x})",
                                                     static_cast<unsigned char>(text.front())));
  auto parsed = parse_json(text);
  if (!parsed.ok()) return fail(std::move(parsed).error().in_field("header"));
  const json& header = parsed.value();
  MOEBIUS_ASSERT(header.is_object(), "a JSON text starting with '{{' parsed as {}", json_type(header));

  SafetensorsFile f;
  f.bytes_ = bytes;
  f.name_ = name;
  f.where_ = where;
  f.header_size_ = n;
  f.tensors_.reserve(header.size());
  // nlohmann's object is a std::map, so items come in bytewise name order and tensors_ is sorted.
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (!value.is_object())
        return fail(Error::format("must be an object of strings, got {}", json_type(value)).in_field("__metadata__"));
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string())
          return fail(Error::format("value of '{}' must be a string, got {}", mk, json_type(mv))
                          .in_field("__metadata__"));
        f.metadata_.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    auto info = parse_entry(key, value, data);
    if (!info.ok()) return fail(std::move(info).error().in_tensor(key));
    f.tensors_.push_back(std::move(info).value());
  }
  MOEBIUS_ASSERT(std::is_sorted(f.tensors_.begin(), f.tensors_.end(),
                                [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; }));

  // The data section must be tiled exactly: in offset order each tensor starts where the previous
  // one ended, the first at 0 and the last ending at the end of the file. This rules out overlaps
  // (two names aliasing the same bytes), holes and trailing junk, as the official reader does
  // (InvalidOffset / MetadataIncompleteBuffer). Zero-byte tensors sit anywhere on the cursor.
  std::vector<const TensorInfo*> by_offset;
  by_offset.reserve(f.tensors_.size());
  for (const auto& t : f.tensors_) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->data_offsets != b->data_offsets ? a->data_offsets < b->data_offsets : a->name < b->name;
  });
  uint64_t cursor = 0;
  const TensorInfo* prev = nullptr;  // the last tensor with bytes, i.e. the one that ends at cursor
  for (const TensorInfo* t : by_offset) {
    const auto [begin, end] = t->data_offsets;
    if (begin < cursor)
      return fail(Error::format("[{}, {}) overlaps tensor '{}' at [{}, {})", begin, end, prev->name,
                                prev->data_offsets[0], prev->data_offsets[1])
                      .in_tensor(t->name)
                      .in_field("data_offsets"));
    if (begin > cursor)
      return fail(Error::format("hole in the data section: bytes [{}, {}) before this tensor belong to no tensor",
                                cursor, begin)
                      .in_tensor(t->name)
                      .in_field("data_offsets"));
    if (end > begin) prev = t;
    cursor = end;
  }
  if (cursor != data.size())
    return fail(Error::format("the data section has {} bytes but the tensors cover only [0, {}): {} trailing bytes "
                              "belong to no tensor",
                              data.size(), cursor, data.size() - cursor));
  return f;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& t : tensors_) out.push_back(t.name);
  return out;
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  const auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                                   [](const TensorInfo& t, std::string_view n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

TensorView SafetensorsFile::view(const TensorInfo& info) const {
  TensorView v;
  // Read-only bytes behind a mutable pointer: TensorView has no const flavour. See the header.
  v.data = const_cast<uint8_t*>(info.data);
  v.dtype = info.dtype;
  v.shape = info.shape;
  v.where = where_;
  return v;
}

Result<TensorView> SafetensorsFile::view(std::string_view name) const {
  const TensorInfo* t = find(name);
  if (t == nullptr) return missing_tensor(name).in_file(name_);
  return view(*t);
}

Result<TensorView> SafetensorsFile::get(std::string_view name, DType expect_dtype,
                                        std::optional<Shape> expect_shape) const {
  MOEBIUS_ASSIGN_OR_RETURN(const TensorView v, view(name));
  auto r = check_expected(v, name, expect_dtype, expect_shape);
  if (!r.ok()) return std::move(r).error().in_file(name_);
  return r;
}

// =============================================================================================
// SafetensorsCheckpoint
// =============================================================================================
namespace fs = std::filesystem;

namespace {
constexpr std::string_view kIndexName = "model.safetensors.index.json";
constexpr std::string_view kSingleName = "model.safetensors";

bool file_exists(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// Shard names come from a JSON file we did not write: they must name a file in the index's
// directory, never a path that escapes it.
Status check_shard_name(const std::string& s) {
  if (s.empty()) return Error("shard file name is empty");
  if (s == "." || s == "..") return Error::format("shard file name '{}' is not a file name", s);
  if (s.find('/') != std::string::npos || s.find('\\') != std::string::npos)
    return Error::format("shard file name '{}' must be a plain file name without '/' or '\\'", s);
  if (s.find('\0') != std::string::npos) return Error("shard file name contains a NUL byte");
  return Ok{};
}
}  // namespace

Result<SafetensorsCheckpoint> SafetensorsCheckpoint::open(const std::string& dir_or_file) {
  std::error_code ec;
  const fs::path p(dir_or_file);
  const auto st = fs::status(p, ec);
  if (ec || !fs::exists(st)) return Error("no such file or directory").in_file(dir_or_file);
  SafetensorsCheckpoint c;
  if (fs::is_directory(st)) {
    if (file_exists(p / kIndexName)) {
      MOEBIUS_ASSIGN_OR_RETURN(c, open_index((p / kIndexName).string(), p.string()));
    } else if (file_exists(p / kSingleName)) {
      MOEBIUS_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::open((p / kSingleName).string()));
      c.shards_.push_back(std::move(f));
    } else {
      return Error::format("directory has neither {} nor {}", kIndexName, kSingleName).in_file(dir_or_file);
    }
  } else if (p.string().ends_with(".json")) {
    MOEBIUS_ASSIGN_OR_RETURN(c, open_index(p.string(), p.has_parent_path() ? p.parent_path().string() : "."));
  } else {
    MOEBIUS_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::open(p.string()));
    c.shards_.push_back(std::move(f));
  }
  c.path_ = dir_or_file;
  if (!c.sharded_) {
    c.metadata_ = c.shards_[0].metadata();
    const auto& ts = c.shards_[0].tensors();
    for (uint32_t i = 0; i < ts.size(); ++i) c.entries_.push_back({0, i});
  }
  return c;
}

Result<SafetensorsCheckpoint> SafetensorsCheckpoint::open_index(const std::string& index_path,
                                                                const std::string& dir) {
  auto fail = [&index_path](Error e) { return std::move(e).in_file(index_path); };
  MOEBIUS_ASSIGN_OR_RETURN(MappedFile mapped, MappedFile::open(index_path));
  if (mapped.size() > kMaxIndexBytes)
    return fail(Error::format("index is {} bytes, more than the limit of {}", mapped.size(), kMaxIndexBytes));
  auto parsed = parse_json({reinterpret_cast<const char*>(mapped.data()), mapped.size()});
  if (!parsed.ok()) return fail(std::move(parsed).error());
  const json& index = parsed.value();
  if (!index.is_object()) return fail(Error::format("index must be a JSON object, got {}", json_type(index)));

  SafetensorsCheckpoint c;
  c.sharded_ = true;
  if (const auto m = index.find("metadata"); m != index.end()) {
    if (!m->is_object()) return fail(Error::format("must be an object, got {}", json_type(*m)).in_field("metadata"));
    for (const auto& [k, v] : m->items()) c.metadata_.emplace(k, v.is_string() ? v.get<std::string>() : v.dump());
  }
  const auto wm = index.find("weight_map");
  if (wm == index.end()) return fail(Error("missing").in_field("weight_map"));
  if (!wm->is_object()) return fail(Error::format("must be an object, got {}", json_type(*wm)).in_field("weight_map"));

  // weight_map: tensor -> shard. Shards are opened once each, in name order.
  std::map<std::string, uint32_t> shard_ids;
  for (const auto& [tensor, shard] : wm->items()) {
    if (!shard.is_string())
      return fail(Error::format("shard must be a string, got {}", json_type(shard)).in_tensor(tensor).in_field("weight_map"));
    const auto& s = shard.get_ref<const std::string&>();
    if (auto st = check_shard_name(s); !st.ok()) return fail(std::move(st).error().in_tensor(tensor).in_field("weight_map"));
    shard_ids.emplace(s, 0);
  }
  if (shard_ids.empty()) return fail(Error("lists no tensors").in_field("weight_map"));
  for (auto& [s, id] : shard_ids) {
    id = static_cast<uint32_t>(c.shards_.size());
    const fs::path shard_path = fs::path(dir) / s;
    if (!file_exists(shard_path))
      return fail(Error::format("shard '{}' listed in weight_map does not exist", shard_path.string()));
    MOEBIUS_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::open(shard_path.string()));
    c.shards_.push_back(std::move(f));
  }

  // Every tensor of every shard, checked against the index in both directions. Duplicates first:
  // a tensor in two shards is the root cause of any index mismatch it also produces.
  std::unordered_map<std::string_view, Entry> seen;
  for (uint32_t si = 0; si < c.shards_.size(); ++si) {
    const auto& ts = c.shards_[si].tensors();
    for (uint32_t ti = 0; ti < ts.size(); ++ti) {
      if (const auto [it, fresh] = seen.emplace(ts[ti].name, Entry{si, ti}); !fresh)
        return fail(Error::format("tensor is in two shards: '{}' and '{}'", c.shards_[it->second.shard].name(),
                                  c.shards_[si].name())
                        .in_tensor(ts[ti].name));
    }
  }
  for (uint32_t si = 0; si < c.shards_.size(); ++si) {
    const auto& ts = c.shards_[si].tensors();
    for (uint32_t ti = 0; ti < ts.size(); ++ti) {
      const std::string& name = ts[ti].name;
      const auto listed = wm->find(name);
      if (listed == wm->end())
        return fail(Error::format("present in shard '{}' but not listed in the index's weight_map", c.shards_[si].name())
                        .in_tensor(name));
      if (shard_ids.at(listed->get_ref<const std::string&>()) != si)
        return fail(Error::format("weight_map says shard '{}' but the tensor is in '{}'",
                                  listed->get_ref<const std::string&>(), c.shards_[si].name())
                        .in_tensor(name));
      c.entries_.push_back({si, ti});
    }
  }
  for (const auto& [tensor, shard] : wm->items()) {
    if (!seen.contains(tensor))
      return fail(Error::format("listed in weight_map but missing from shard '{}'", shard.get_ref<const std::string&>())
                      .in_tensor(tensor));
  }
  std::sort(c.entries_.begin(), c.entries_.end(),
            [&c](const Entry& a, const Entry& b) { return c.info(a).name < c.info(b).name; });
  return c;
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& e : entries_) out.push_back(info(e).name);
  return out;
}

const SafetensorsCheckpoint::Entry* SafetensorsCheckpoint::find_entry(std::string_view name) const {
  const auto it = std::lower_bound(entries_.begin(), entries_.end(), name,
                                   [this](const Entry& e, std::string_view n) { return info(e).name < n; });
  return it != entries_.end() && info(*it).name == name ? &*it : nullptr;
}

const TensorInfo* SafetensorsCheckpoint::find(std::string_view name) const {
  const Entry* e = find_entry(name);
  return e ? &info(*e) : nullptr;
}

const SafetensorsFile* SafetensorsCheckpoint::shard_of(std::string_view name) const {
  const Entry* e = find_entry(name);
  return e ? &shards_[e->shard] : nullptr;
}

Result<TensorView> SafetensorsCheckpoint::view(std::string_view name) const {
  const Entry* e = find_entry(name);
  if (e == nullptr) return missing_tensor(name).in_file(path_);
  return shards_[e->shard].view(info(*e));
}

Result<TensorView> SafetensorsCheckpoint::get(std::string_view name, DType expect_dtype,
                                              std::optional<Shape> expect_shape) const {
  const Entry* e = find_entry(name);
  if (e == nullptr) return missing_tensor(name).in_file(path_);
  return shards_[e->shard].get(name, expect_dtype, std::move(expect_shape));
}

// =============================================================================================
// SafetensorsWriter
// =============================================================================================
Status SafetensorsWriter::add_entry(std::string name, DType dtype, const Shape& shape,
                                    std::span<const uint8_t> bytes, bool copy) {
  if (auto st = check_tensor_name(name); !st.ok()) return std::move(st).error().in_tensor(name);
  if (shape.rank < 0 || shape.rank > kMaxDims)
    return Error::format("rank {} outside [0, {}]", shape.rank, kMaxDims).in_tensor(name).in_field("shape");
  for (int i = 0; i < shape.rank; ++i)
    if (shape[i] < 0) return Error::format("negative dimension in {}", shape.str()).in_tensor(name).in_field("shape");
  auto nbytes = checked_nbytes(shape, dtype);
  if (!nbytes.ok()) return std::move(nbytes).error().in_tensor(name);
  if (bytes.size() != nbytes.value())
    return Error::format("got {} bytes but {} {} needs {}", bytes.size(), dtype_name(dtype), shape.str(), nbytes.value())
        .in_tensor(name);
  if (!names_.insert(name).second) return Error("added twice").in_tensor(name);
  Entry e{std::move(name), dtype, shape, {}, {}, copy};
  if (copy) e.owned.assign(bytes.begin(), bytes.end());
  else e.borrowed = bytes;
  entries_.push_back(std::move(e));
  return Ok{};
}

Status SafetensorsWriter::add(std::string name, DType dtype, const Shape& shape, std::span<const uint8_t> bytes) {
  return add_entry(std::move(name), dtype, shape, bytes, /*copy=*/true);
}

Status SafetensorsWriter::add_borrowed(std::string name, DType dtype, const Shape& shape,
                                       std::span<const uint8_t> bytes) {
  return add_entry(std::move(name), dtype, shape, bytes, /*copy=*/false);
}

Status SafetensorsWriter::add(std::string name, const TensorView& view) {
  if (view.where == MemoryKind::kDevice)
    return Error("device memory cannot be written directly; copy it to the host first").in_tensor(name);
  for (int i = 0; i < view.shape.rank; ++i)
    if (view.shape[i] < 0) return Error::format("negative dimension in {}", view.shape.str()).in_tensor(name);
  auto nbytes = checked_nbytes(view.shape, view.dtype);
  if (!nbytes.ok()) return std::move(nbytes).error().in_tensor(name);
  if (nbytes.value() > 0 && view.data == nullptr) return Error("view has no data").in_tensor(name);
  return add(std::move(name), view.dtype, view.shape,
             {static_cast<const uint8_t*>(view.data), static_cast<size_t>(nbytes.value())});
}

Status SafetensorsWriter::set_metadata(std::string key, std::string value) {
  if (!valid_utf8(key) || !valid_utf8(value))
    return Error::format("metadata key or value is not valid UTF-8").in_field("__metadata__");
  metadata_[std::move(key)] = std::move(value);
  return Ok{};
}

std::vector<const SafetensorsWriter::Entry*> SafetensorsWriter::layout(std::vector<const Entry*> entries) {
  // [TAG_SAFETENSORS_ALIGNMENT] Element sizes are powers of two; placing larger ones first makes
  // every offset a multiple of the element size at that offset, with the data section itself
  // 8-byte aligned (the header is padded to N % 8 == 0).
  std::sort(entries.begin(), entries.end(), [](const Entry* a, const Entry* b) {
    const size_t sa = dtype_size(a->dtype), sb = dtype_size(b->dtype);
    return sa != sb ? sa > sb : a->name < b->name;
  });
  return entries;
}

Result<std::string> SafetensorsWriter::header(const std::vector<const Entry*>& order,
                                              const std::map<std::string, std::string>& metadata) {
  // ordered_json keeps insertion order: "__metadata__" first, then tensors in data order, each
  // with keys in the order the official writer uses.
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    auto& m = h["__metadata__"] = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
  }
  uint64_t offset = 0;
  for (const Entry* e : order) {
    auto shape = nlohmann::ordered_json::array();
    for (int i = 0; i < e->shape.rank; ++i) shape.push_back(e->shape[i]);
    const uint64_t end = offset + e->bytes().size();
    h[e->name] = {{"dtype", dtype_name(e->dtype)}, {"shape", std::move(shape)}, {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string text;
  try {
    text = h.dump();  // names and metadata were checked for UTF-8 in add(), so this cannot throw
  } catch (const nlohmann::json::exception& e) {
    return Error::format("cannot serialize header: {}", e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  if (text.size() > kSafetensorsMaxHeaderBytes)
    return Error::format("header would be {} bytes, over the limit of {}", text.size(), kSafetensorsMaxHeaderBytes);
  return text;
}

Result<std::vector<uint8_t>> SafetensorsWriter::serialize() const {
  std::vector<const Entry*> all;
  for (const auto& e : entries_) all.push_back(&e);
  const auto order = layout(std::move(all));
  MOEBIUS_ASSIGN_OR_RETURN(const std::string h, header(order, metadata_));
  size_t total = 8 + h.size();
  for (const Entry* e : order) total += e->bytes().size();
  std::vector<uint8_t> out(8);
  out.reserve(total);
  store_u64_le(out.data(), h.size());
  out.insert(out.end(), h.begin(), h.end());
  for (const Entry* e : order) out.insert(out.end(), e->bytes().begin(), e->bytes().end());
  return out;
}

namespace {

Status write_all(int fd, const uint8_t* p, size_t n, const std::string& path) {
  while (n > 0) {
    // Linux writes at most ~2 GiB per call; stay below that.
    const ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      return Error::format("write failed: {}", std::strerror(errno)).in_file(path);
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Ok{};
}

// Writes `chunks` to `path` atomically (see SafetensorsWriter::write).
Status write_atomically(const std::string& path, const std::vector<std::span<const uint8_t>>& chunks) {
  static std::atomic<uint64_t> counter{0};
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    tmp = fmt::format("{}.tmp-{}-{}", path, ::getpid(), counter.fetch_add(1));
    // 0666 and O_EXCL: the umask decides permissions as for any new file, and we never clobber a
    // file someone else is writing.
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST)
      return Error::format("cannot create temporary file '{}': {}", tmp, std::strerror(errno)).in_file(path);
  }
  if (fd < 0) return Error("cannot find a free temporary file name").in_file(path);
  auto abandon = [&](Error e) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return e;
  };
  for (const auto& c : chunks)
    if (auto st = write_all(fd, c.data(), c.size(), path); !st.ok()) return abandon(std::move(st).error());
  if (::fsync(fd) != 0) return abandon(Error::format("fsync failed: {}", std::strerror(errno)).in_file(path));
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return Error::format("close failed: {}", std::strerror(err)).in_file(path);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return Error::format("cannot rename '{}' into place: {}", tmp, std::strerror(err)).in_file(path);
  }
  // The rename is durable only once the directory entry is on disk.
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    const int rc = ::fsync(dfd);
    const int err = errno;
    ::close(dfd);
    // Some file systems cannot fsync a directory (EINVAL); the data itself is already synced.
    if (rc != 0 && err != EINVAL)
      return Error::format("fsync of directory '{}' failed: {}", dir.string(), std::strerror(err)).in_file(path);
  }
  return Ok{};
}

}  // namespace

Status SafetensorsWriter::write_file(const std::string& path, const std::vector<const Entry*>& entries,
                                     const std::map<std::string, std::string>& metadata) {
  const auto order = layout(entries);
  auto h = header(order, metadata);
  if (!h.ok()) return std::move(h).error().in_file(path);
  uint8_t len[8];
  store_u64_le(len, h.value().size());
  std::vector<std::span<const uint8_t>> chunks;
  chunks.emplace_back(len, 8);
  chunks.emplace_back(reinterpret_cast<const uint8_t*>(h.value().data()), h.value().size());
  for (const Entry* e : order) chunks.push_back(e->bytes());
  return write_atomically(path, chunks);
}

Status SafetensorsWriter::write(const std::string& path) const {
  std::vector<const Entry*> all;
  for (const auto& e : entries_) all.push_back(&e);
  return write_file(path, all, metadata_);
}

Status SafetensorsWriter::write_sharded(const std::string& dir, uint64_t max_shard_bytes, std::string_view base) const {
  if (auto st = check_shard_name(std::string(base) + ".safetensors"); !st.ok()) return std::move(st).error().in_file(dir);
  std::vector<const Entry*> sorted;
  for (const auto& e : entries_) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(), [](const Entry* a, const Entry* b) { return a->name < b->name; });

  // Greedy split in name order, so tensors of one layer tend to share a shard.
  std::vector<std::vector<const Entry*>> shards(1);
  uint64_t in_shard = 0, total = 0;
  for (const Entry* e : sorted) {
    const uint64_t n = e->bytes().size();
    if (!shards.back().empty() && in_shard + n > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(e);
    in_shard += n;
    total += n;
  }

  nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}}, {"weight_map", nlohmann::ordered_json::object()}};
  auto& weight_map = index["weight_map"];
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string file = fmt::format("{}-{:05d}-of-{:05d}.safetensors", base, i + 1, shards.size());
    MOEBIUS_TRY(write_file((fs::path(dir) / file).string(), shards[i], metadata_));
    for (const Entry* e : shards[i]) weight_map[e->name] = file;
  }
  // Written last: until the index is in place the checkpoint is not visible as a sharded one.
  const std::string text = index.dump(2) + "\n";
  return write_atomically((fs::path(dir) / (std::string(base) + ".safetensors.index.json")).string(),
                          {{reinterpret_cast<const uint8_t*>(text.data()), text.size()}});
}

}  // namespace moebius
