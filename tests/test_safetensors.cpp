// safetensors reader, sharded checkpoints and writer. Malformed files are built byte by byte here
// so each test shows exactly which rule it breaks; valid files come from SafetensorsWriter or by
// hand, never from committed fixtures.
#include "formats/safetensors.h"

#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace moebius {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------
std::vector<uint8_t> le64(uint64_t v) {
  std::vector<uint8_t> out(8);
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<uint8_t>(v >> (8 * i));
  return out;
}

// [u64 N][header][data]; N is the header's length unless overridden.
std::vector<uint8_t> raw_file(std::string_view header, size_t data_bytes = 0, std::optional<uint64_t> n = {}) {
  std::vector<uint8_t> out = le64(n.value_or(header.size()));
  out.insert(out.end(), header.begin(), header.end());
  for (size_t i = 0; i < data_bytes; ++i) out.push_back(static_cast<uint8_t>(i * 7 + 1));
  return out;
}


std::vector<uint8_t> random_bytes(std::mt19937& rng, size_t n) {
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "moebius-st-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data()) ? tmpl : "";
    EXPECT_FALSE(path_.empty()) << "mkdtemp failed";
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string operator/(std::string_view name) const { return (fs::path(path_) / name).string(); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

void write_text(const std::string& path, std::string_view text) {
  std::ofstream f(path, std::ios::binary);
  f.write(text.data(), static_cast<std::streamsize>(text.size()));
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& b) {
  write_text(path, {reinterpret_cast<const char*>(b.data()), b.size()});
}

// A small valid checkpoint with mixed dtypes; names chosen so name order != data order.
SafetensorsWriter sample_writer() {
  SafetensorsWriter w;
  std::mt19937 rng(7);
  EXPECT_TRUE(w.add("model.embed.weight", DType::kBF16, {4, 3}, random_bytes(rng, 24)).ok());
  EXPECT_TRUE(w.add("model.layers.0.mlp.experts.0.down_proj.weight", DType::kF8E4M3, {3, 5}, random_bytes(rng, 15)).ok());
  EXPECT_TRUE(w.add("model.layers.0.mlp.gate.weight", DType::kF32, {2, 4}, random_bytes(rng, 32)).ok());
  EXPECT_TRUE(w.add("model.norm.weight", DType::kF16, {4}, random_bytes(rng, 8)).ok());
  EXPECT_TRUE(w.add("scale", DType::kF64, {}, random_bytes(rng, 8)).ok());
  EXPECT_TRUE(w.add("empty", DType::kI32, {0, 3}, {}).ok());
  EXPECT_TRUE(w.set_metadata("format", "pt").ok());
  return w;
}

// Touches every byte of every tensor, so ASan flags any view that points outside the input.
uint32_t checksum(const SafetensorsFile& f) {
  uint32_t h = 0;
  for (const auto& t : f.tensors())
    for (uint8_t b : t.bytes()) h = h * 31 + b;
  return h;
}

// ---------------------------------------------------------------------------------------------
// Valid files
// ---------------------------------------------------------------------------------------------
TEST(SafetensorsRead, MinimalEmptyHeader) {
  auto f = SafetensorsFile::parse(raw_file("{}      "), "empty.safetensors");
  ASSERT_TRUE(f.ok()) << f.error().what();
  EXPECT_EQ(f->size(), 0u);
  EXPECT_TRUE(f->metadata().empty());
  EXPECT_EQ(f->header_size(), 8u);
  EXPECT_EQ(f->data_offset(), 16u);
}

TEST(SafetensorsRead, HandWrittenFileWithPaddingScalarAndZeroSized) {
  // Offsets deliberately unaligned (u8[3] then f32[]): the format allows it and we must too.
  const std::string h =
      R"({"__metadata__":{"format":"pt","note":"x"},"b":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},)"
      R"("s":{"dtype":"F32","shape":[],"data_offsets":[3,7]},"z0":{"dtype":"BF16","shape":[0,4],"data_offsets":[3,3]},)"
      R"("z1":{"dtype":"F64","shape":[5,0],"data_offsets":[7,7]}}     )";
  const auto bytes = raw_file(h, 7);
  auto f = SafetensorsFile::parse(bytes, "hand.safetensors");
  ASSERT_TRUE(f.ok()) << f.error().what();
  EXPECT_THAT(f->names(), ::testing::ElementsAre("b", "s", "z0", "z1"));
  EXPECT_EQ(f->metadata().at("format"), "pt");
  const TensorInfo* s = f->find("s");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->dtype, DType::kF32);
  EXPECT_EQ(s->shape.rank, 0);
  EXPECT_EQ(s->nbytes(), 4u);
  EXPECT_EQ(s->data, bytes.data() + f->data_offset() + 3);
  EXPECT_EQ(f->find("z0")->nbytes(), 0u);
  EXPECT_EQ(f->find("missing"), nullptr);
  auto v = f->view("b");
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->where, MemoryKind::kHost);
  EXPECT_EQ(v->as<uint8_t>()[2], bytes[f->data_offset() + 2]);
}

TEST(SafetensorsRead, AcceptsJsonWhitespacePaddingAndEscapedNames) {
  // serde_json (the official reader) allows any JSON whitespace after the object.
  const std::string h = "{\"a\\u00e9\":{\"dtype\":\"I8\",\"shape\":[2],\"data_offsets\":[0,2]}} \n\t ";
  auto f = SafetensorsFile::parse(raw_file(h, 2), "ws.safetensors");
  ASSERT_TRUE(f.ok()) << f.error().what();
  EXPECT_NE(f->find("a\xc3\xa9"), nullptr);
}

TEST(SafetensorsRead, AcceptsNegativeZeroLikeTheOfficialReader) {
  auto f = SafetensorsFile::parse(raw_file(R"({"z":{"dtype":"F32","shape":[-0],"data_offsets":[-0,0]}})"),
                                  "z.safetensors");
  ASSERT_TRUE(f.ok()) << f.error().what();
  EXPECT_EQ(f->find("z")->shape, Shape{0});
}

TEST(SafetensorsRead, GetChecksDtypeAndShape) {
  auto bytes = sample_writer().serialize();
  ASSERT_TRUE(bytes.ok());
  auto f = SafetensorsFile::parse(*bytes, "model.safetensors");
  ASSERT_TRUE(f.ok()) << f.error().what();
  EXPECT_TRUE(f->get("model.norm.weight", DType::kF16, Shape{4}).ok());
  EXPECT_TRUE(f->get("model.norm.weight", DType::kF16).ok());

  auto missing = f->get("model.nope", DType::kF16);
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.error().what(), HasSubstr("file 'model.safetensors': tensor 'model.nope': not found"));

  auto dtype = f->get("model.norm.weight", DType::kBF16, Shape{4});
  ASSERT_FALSE(dtype.ok());
  EXPECT_THAT(dtype.error().what(),
              HasSubstr("tensor 'model.norm.weight': field 'dtype': dtype is F16, expected BF16"));

  auto shape = f->get("model.embed.weight", DType::kBF16, Shape{3, 4});
  ASSERT_FALSE(shape.ok());
  EXPECT_THAT(shape.error().what(), HasSubstr("field 'shape': shape is [4, 3], expected [3, 4]"));
}

TEST(SafetensorsRead, OpenNonexistentNamesThePath) {
  auto f = SafetensorsFile::open("/nonexistent/dir/x.safetensors");
  ASSERT_FALSE(f.ok());
  EXPECT_THAT(f.error().what(), HasSubstr("/nonexistent/dir/x.safetensors"));
}

// ---------------------------------------------------------------------------------------------
// Malformed files: one test per rule, each checking that the message names the problem.
// ---------------------------------------------------------------------------------------------
struct BadCase {
  std::string name;
  std::vector<uint8_t> bytes;
  std::string expect;  // substring of Error::what()
};

std::ostream& operator<<(std::ostream& os, const BadCase& c) { return os << c.name; }

// One tensor "w" with the given entry body; `data` bytes of data section.
std::vector<uint8_t> one(std::string_view entry, size_t data) {
  return raw_file(std::string(R"({"w":)") + std::string(entry) + "}", data);
}

std::vector<BadCase> bad_cases() {
  const std::string ok_entry = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  std::string deep = R"({"w":{"dtype":"F32","shape":)";
  for (int i = 0; i < 9; ++i) deep += "[";
  for (int i = 0; i < 9; ++i) deep += "]";
  deep += R"(,"data_offsets":[0,0]}})";
  std::vector<uint8_t> nul_padded = raw_file(std::string("{}") + std::string(6, '\0'));
  return {
      {"EmptyFile", {}, "file is 0 bytes, too short"},
      {"ShorterThanLength", {1, 0, 0, 0, 0}, "file is 5 bytes, too short for the 8-byte header length"},
      {"HeaderLengthZero", raw_file("{}", 0, 0), "header length is 0"},
      {"HeaderLengthOverLimit", raw_file("{}", 0, 100'000'001), "header length 100000001 exceeds the limit of 100000000"},
      {"HeaderLengthMaxU64", raw_file("{}", 0, ~uint64_t{0}), "exceeds the limit"},
      {"HeaderLengthPastEnd", raw_file("{}", 0, 40), "header length 40 is larger than the 2 bytes after it"},
      {"HeaderNotJson", raw_file("{abc}"), "field 'header': invalid JSON"},
      {"HeaderTruncatedJson", raw_file(R"({"w":)"), "invalid JSON"},
      {"HeaderNotObject", raw_file("[1, 2]  "), "header does not start with '{'"},
      {"HeaderLeadingSpace", raw_file(" {}"), "header does not start with '{' (first byte 0x20)"},
      {"HeaderTrailingGarbage", raw_file("{}  x"), "invalid JSON"},
      {"HeaderNulPadding", nul_padded, "invalid JSON"},
      {"HeaderInvalidUtf8", raw_file("{\"\xff\":1}"), "invalid JSON"},
      {"HeaderTooDeep", raw_file(deep), "nests deeper than 8 levels"},
      {"DuplicateTensor", raw_file(R"({"w":)" + ok_entry + R"(,"w":)" + ok_entry + "}", 8), "duplicate key 'w'"},
      {"DuplicateField", one(R"({"dtype":"F32","dtype":"F16","shape":[2],"data_offsets":[0,8]})", 8),
       "duplicate key 'dtype'"},
      {"DuplicateMetadataKey", raw_file(R"({"__metadata__":{"a":"1","a":"2"}})"), "duplicate key 'a'"},
      {"MetadataNotObject", raw_file(R"({"__metadata__":["a"]})"), "field '__metadata__': must be an object"},
      {"MetadataValueNotString", raw_file(R"({"__metadata__":{"k":1}})"),
       "field '__metadata__': value of 'k' must be a string, got number"},
      {"EntryNotObject", one("[1]", 0), "tensor 'w': entry must be an object, got array"},
      {"EmptyTensorName", raw_file(R"({"":)" + ok_entry + "}", 8), "tensor name is empty"},
      {"ControlCharInName", raw_file(R"({"a\u0001":)" + ok_entry + "}", 8), "control character 0x01"},
      {"UnknownKey", one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8],"extra":1})", 8),
       "tensor 'w': field 'extra': unknown key"},
      {"MissingDtype", one(R"({"shape":[2],"data_offsets":[0,8]})", 8), "tensor 'w': field 'dtype': missing"},
      {"DtypeNotString", one(R"({"dtype":4,"shape":[2],"data_offsets":[0,8]})", 8), "field 'dtype': must be a string"},
      {"UnknownDtype", one(R"({"dtype":"F12","shape":[2],"data_offsets":[0,8]})", 8), "unknown dtype 'F12'"},
      {"LowercaseDtype", one(R"({"dtype":"f32","shape":[2],"data_offsets":[0,8]})", 8), "unknown dtype 'f32'"},
      {"MissingShape", one(R"({"dtype":"F32","data_offsets":[0,8]})", 8), "field 'shape': missing"},
      {"ShapeNotArray", one(R"({"dtype":"F32","shape":2,"data_offsets":[0,8]})", 8), "field 'shape': must be an array"},
      {"ShapeNegative", one(R"({"dtype":"F32","shape":[-2],"data_offsets":[0,8]})", 8), "dimension -2 is negative"},
      {"ShapeFloat", one(R"({"dtype":"F32","shape":[2.0],"data_offsets":[0,8]})", 8),
       "dimension must be a non-negative integer, got number 2.0"},
      {"ShapeString", one(R"({"dtype":"F32","shape":["2"],"data_offsets":[0,8]})", 8), "got string"},
      {"ShapeDimPastInt64", one(R"({"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,0]})", 0),
       "dimension 9223372036854775808 does not fit int64"},
      {"RankTooLarge", one(R"({"dtype":"U8","shape":[1,1,1,1,1,1,1],"data_offsets":[0,1]})", 1),
       "rank 7 exceeds the maximum of 6"},
      {"MissingOffsets", one(R"({"dtype":"F32","shape":[2]})", 8), "field 'data_offsets': missing"},
      {"OffsetsWrongLength", one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8,16]})", 8),
       "must be an array [begin, end]"},
      {"OffsetNegative", one(R"({"dtype":"F32","shape":[2],"data_offsets":[-8,0]})", 8),
       "offsets must be non-negative integers, got -8"},
      {"OffsetBeginAfterEnd", one(R"({"dtype":"F32","shape":[2],"data_offsets":[8,0]})", 8), "begin 8 > end 0"},
      {"OffsetPastDataSection", one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 4),
       "end 8 is past the end of the data section (4 bytes)"},
      {"NumelOverflow", one(R"({"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]})", 0),
       "element count of shape [4294967296, 4294967296] overflows int64"},
      {"ByteSizeOverflow", one(R"({"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,0]})", 0),
       "overflows 64 bits"},
      {"SizeMismatch", one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,4]})", 4),
       "[0, 4) spans 4 bytes but F32 [2] needs 8"},
      {"Overlap", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
       "tensor 'b': field 'data_offsets': [4, 12) overlaps tensor 'a' at [0, 8)"},
      {"ZeroSizedInsideAnother", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                          R"("z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})", 8),
       "tensor 'z': field 'data_offsets': [4, 4) overlaps tensor 'a'"},
      {"Aliased", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8),
       "overlaps tensor 'a'"},
      {"HoleBetween", raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                               R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})", 12),
       "tensor 'b': field 'data_offsets': hole in the data section: bytes [4, 8)"},
      {"HoleAtStart", one(R"({"dtype":"F32","shape":[1],"data_offsets":[4,8]})", 8), "hole in the data section: bytes [0, 4)"},
      {"TrailingBytes", one(R"({"dtype":"F32","shape":[1],"data_offsets":[0,4]})", 8),
       "the data section has 8 bytes but the tensors cover only [0, 4): 4 trailing bytes"},
      {"DataWithoutTensors", raw_file("{}", 3), "3 trailing bytes belong to no tensor"},
  };
}

class SafetensorsMalformed : public ::testing::TestWithParam<BadCase> {};

TEST_P(SafetensorsMalformed, RefusedWithClearMessage) {
  const BadCase& c = GetParam();
  // An exactly sized heap copy, so ASan catches any read past the end.
  std::unique_ptr<uint8_t[]> buf(new uint8_t[c.bytes.size() + 1]);
  std::copy(c.bytes.begin(), c.bytes.end(), buf.get());
  auto f = SafetensorsFile::parse({buf.get(), c.bytes.size()}, "bad.safetensors");
  ASSERT_FALSE(f.ok()) << "accepted: " << c.name;
  EXPECT_THAT(f.error().what(), HasSubstr("file 'bad.safetensors': "));
  EXPECT_THAT(f.error().what(), HasSubstr(c.expect));
  EXPECT_EQ(f.error().file(), "bad.safetensors");
}

INSTANTIATE_TEST_SUITE_P(Safetensors, SafetensorsMalformed, ::testing::ValuesIn(bad_cases()),
                         [](const ::testing::TestParamInfo<BadCase>& i) { return i.param.name; });

// ---------------------------------------------------------------------------------------------
// Writer
// ---------------------------------------------------------------------------------------------
TEST(SafetensorsWrite, GoldenBytesMatchTheOfficialLayout) {
  // What safetensors' own serializer produces for {"a": zeros(2, f32)} with metadata {"format": "pt"}.
  SafetensorsWriter w;
  const std::vector<uint8_t> zeros(8, 0);
  ASSERT_TRUE(w.add("a", DType::kF32, {2}, zeros).ok());
  ASSERT_TRUE(w.set_metadata("format", "pt").ok());
  auto bytes = w.serialize();
  ASSERT_TRUE(bytes.ok());
  const std::string header = R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string padded = header + std::string((8 - header.size() % 8) % 8, ' ');
  std::vector<uint8_t> expect = raw_file(padded);
  expect.insert(expect.end(), zeros.begin(), zeros.end());
  EXPECT_EQ(*bytes, expect);
}

TEST(SafetensorsWrite, RoundTripEveryDtypeAndShape) {
  const DType dtypes[] = {DType::kBool, DType::kU8,  DType::kI8,  DType::kU16,  DType::kI16,
                          DType::kU32,  DType::kI32, DType::kU64, DType::kI64,  DType::kF16,
                          DType::kBF16, DType::kF32, DType::kF64, DType::kF8E4M3, DType::kF8E5M2};
  const Shape shapes[] = {{}, {0}, {1}, {3}, {2, 3}, {0, 5}, {5, 0, 2}, {2, 1, 3, 1, 2, 1}, {7, 3}};
  std::mt19937 rng(42);
  struct Expect {
    std::string name;
    DType dtype;
    Shape shape;
    std::vector<uint8_t> bytes;
  };
  std::vector<Expect> expect;
  for (DType d : dtypes)
    for (size_t s = 0; s < std::size(shapes); ++s) {
      const size_t n = static_cast<size_t>(shapes[s].numel()) * dtype_size(d);
      expect.push_back({fmt::format("t.{}.{}", dtype_name(d), s), d, shapes[s], random_bytes(rng, n)});
    }
  // Add in two different orders: the output must not depend on it.
  SafetensorsWriter w1, w2;
  for (const auto& e : expect) ASSERT_TRUE(w1.add(e.name, e.dtype, e.shape, e.bytes).ok());
  auto shuffled = expect;
  std::shuffle(shuffled.begin(), shuffled.end(), rng);
  for (const auto& e : shuffled) ASSERT_TRUE(w2.add_borrowed(e.name, e.dtype, e.shape, e.bytes).ok());
  ASSERT_TRUE(w1.set_metadata("format", "pt").ok());
  ASSERT_TRUE(w2.set_metadata("format", "pt").ok());
  auto b1 = w1.serialize();
  auto b2 = w2.serialize();
  ASSERT_TRUE(b1.ok() && b2.ok());
  EXPECT_EQ(*b1, *b2);

  TempDir dir;
  ASSERT_TRUE(w1.write(dir / "rt.safetensors").ok());
  auto f = SafetensorsFile::open(dir / "rt.safetensors");
  ASSERT_TRUE(f.ok()) << f.error().what();
  EXPECT_EQ(std::vector<uint8_t>(f->bytes().begin(), f->bytes().end()), *b1);
  EXPECT_EQ(f->header_size() % 8, 0u);
  EXPECT_EQ(f->metadata().at("format"), "pt");
  ASSERT_EQ(f->size(), expect.size());
  for (const auto& e : expect) {
    SCOPED_TRACE(e.name);
    auto v = f->get(e.name, e.dtype, e.shape);
    ASSERT_TRUE(v.ok()) << v.error().what();
    EXPECT_EQ(v->where, MemoryKind::kMapped);
    const TensorInfo* t = f->find(e.name);
    EXPECT_EQ(std::vector<uint8_t>(t->bytes().begin(), t->bytes().end()), e.bytes);
    // [TAG_SAFETENSORS_ALIGNMENT] every tensor aligned to its element size within the file.
    EXPECT_EQ((f->data_offset() + t->data_offsets[0]) % dtype_size(e.dtype), 0u);
  }
  // Re-writing what we read reproduces the same bytes.
  SafetensorsWriter w3;
  for (const auto& t : f->tensors()) ASSERT_TRUE(w3.add(t.name, f->view(t)).ok());
  ASSERT_TRUE(w3.set_metadata("format", "pt").ok());
  EXPECT_EQ(*w3.serialize(), *b1);
}

TEST(SafetensorsWrite, WriteReplacesAtomicallyAndLeavesNoTemporaries) {
  TempDir dir;
  const std::string path = dir / "m.safetensors";
  write_text(path, "old contents");
  ASSERT_TRUE(sample_writer().write(path).ok());
  ASSERT_TRUE(SafetensorsFile::open(path).ok());
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 1);
  auto bad = sample_writer().write(dir / "no/such/dir/m.safetensors");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.error().what(), HasSubstr("no/such/dir/m.safetensors"));
}

TEST(SafetensorsWrite, RefusesBadTensors) {
  SafetensorsWriter w;
  const std::vector<uint8_t> eight(8);
  ASSERT_TRUE(w.add("a", DType::kF32, {2}, eight).ok());
  EXPECT_THAT(w.add("a", DType::kF32, {2}, eight).error().what(), HasSubstr("tensor 'a': added twice"));
  EXPECT_THAT(w.add("b", DType::kF32, {3}, eight).error().what(), HasSubstr("got 8 bytes but F32 [3] needs 12"));
  EXPECT_THAT(w.add("", DType::kU8, {8}, eight).error().what(), HasSubstr("tensor name is empty"));
  EXPECT_THAT(w.add("__metadata__", DType::kU8, {8}, eight).error().what(), HasSubstr("reserved"));
  EXPECT_THAT(w.add("x\n", DType::kU8, {8}, eight).error().what(), HasSubstr("control character 0x0a"));
  EXPECT_THAT(w.add("\xc3(", DType::kU8, {8}, eight).error().what(), HasSubstr("not valid UTF-8"));
  EXPECT_THAT(w.add("n", DType::kU8, {-1, -8}, eight).error().what(), HasSubstr("negative dimension"));
  EXPECT_THAT(w.set_metadata("k", "\xff").error().what(), HasSubstr("not valid UTF-8"));
  TensorView dev;
  dev.where = MemoryKind::kDevice;
  dev.shape = {1};
  EXPECT_THAT(w.add("d", dev).error().what(), HasSubstr("device memory"));
  EXPECT_EQ(w.size(), 1u);
}

// ---------------------------------------------------------------------------------------------
// Sharded checkpoints
// ---------------------------------------------------------------------------------------------
TEST(SafetensorsCheckpoint, ShardedRoundTrip) {
  TempDir dir;
  SafetensorsWriter w;
  std::mt19937 rng(3);
  // Qwen3-MoE-style names, several experts, small sizes.
  std::map<std::string, std::vector<uint8_t>> want;
  for (int layer = 0; layer < 2; ++layer)
    for (int e = 0; e < 4; ++e)
      for (const char* p : {"gate_proj", "up_proj", "down_proj"}) {
        const std::string name = fmt::format("model.layers.{}.mlp.experts.{}.{}.weight", layer, e, p);
        want[name] = random_bytes(rng, 2 * 6 * 4);
        ASSERT_TRUE(w.add(name, DType::kBF16, {6, 4}, want[name]).ok());
      }
  ASSERT_TRUE(w.set_metadata("format", "pt").ok());
  ASSERT_TRUE(w.write_sharded(dir.path(), /*max_shard_bytes=*/200).ok());
  ASSERT_TRUE(fs::exists(dir / "model.safetensors.index.json"));

  for (const std::string& path : {dir.path(), dir / "model.safetensors.index.json"}) {
    auto c = SafetensorsCheckpoint::open(path);
    ASSERT_TRUE(c.ok()) << c.error().what();
    EXPECT_TRUE(c->is_sharded());
    EXPECT_GT(c->shards().size(), 2u);
    EXPECT_EQ(c->size(), want.size());
    EXPECT_EQ(c->metadata().at("total_size"), std::to_string(want.size() * 48));
    std::vector<std::string> names;
    for (const auto& [n, b] : want) names.push_back(n);
    EXPECT_EQ(c->names(), names);
    for (const auto& [n, b] : want) {
      auto v = c->get(n, DType::kBF16, Shape{6, 4});
      ASSERT_TRUE(v.ok()) << v.error().what();
      EXPECT_EQ(std::memcmp(v->data, b.data(), b.size()), 0);
      ASSERT_NE(c->shard_of(n), nullptr);
      EXPECT_EQ(c->shard_of(n)->find(n), c->find(n));
      EXPECT_EQ(c->shard_of(n)->metadata().at("format"), "pt");
    }
    auto missing = c->get("lm_head.weight", DType::kBF16);
    ASSERT_FALSE(missing.ok());
    EXPECT_THAT(missing.error().what(), HasSubstr("tensor 'lm_head.weight': not found"));
    auto wrong = c->get(names[0], DType::kF32);
    ASSERT_FALSE(wrong.ok());
    EXPECT_THAT(wrong.error().what(), HasSubstr("-of-"));  // names the shard file
    EXPECT_THAT(wrong.error().what(), HasSubstr("dtype is BF16, expected F32"));
  }
}

TEST(SafetensorsCheckpoint, SingleFileAndDirectory) {
  TempDir dir;
  ASSERT_TRUE(sample_writer().write(dir / "model.safetensors").ok());
  for (const std::string& path : {dir.path(), dir / "model.safetensors"}) {
    auto c = SafetensorsCheckpoint::open(path);
    ASSERT_TRUE(c.ok()) << c.error().what();
    EXPECT_FALSE(c->is_sharded());
    EXPECT_EQ(c->shards().size(), 1u);
    EXPECT_EQ(c->size(), 6u);
    EXPECT_EQ(c->metadata().at("format"), "pt");
    EXPECT_TRUE(c->get("scale", DType::kF64, Shape{}).ok());
    EXPECT_EQ(c->names(), c->shards()[0].names());
  }
  TempDir empty;
  auto none = SafetensorsCheckpoint::open(empty.path());
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(none.error().what(), HasSubstr("neither model.safetensors.index.json nor model.safetensors"));
  auto absent = SafetensorsCheckpoint::open(empty / "nothing");
  ASSERT_FALSE(absent.ok());
  EXPECT_THAT(absent.error().what(), HasSubstr("no such file or directory"));
}

// Two shards a.safetensors {x, y} and b.safetensors {z}, and an index given by the test.
struct IndexCase {
  std::string name;
  std::string index;
  std::string expect;
};

std::ostream& operator<<(std::ostream& os, const IndexCase& c) { return os << c.name; }

class SafetensorsIndex : public ::testing::TestWithParam<IndexCase> {};

TEST_P(SafetensorsIndex, RefusedWithClearMessage) {
  const IndexCase& c = GetParam();
  TempDir dir;
  const std::vector<uint8_t> four(4);
  SafetensorsWriter a, b;
  ASSERT_TRUE(a.add("x", DType::kF32, {1}, four).ok());
  ASSERT_TRUE(a.add("y", DType::kF32, {1}, four).ok());
  ASSERT_TRUE(b.add("z", DType::kF32, {1}, four).ok());
  ASSERT_TRUE(a.write(dir / "a.safetensors").ok());
  ASSERT_TRUE(b.write(dir / "b.safetensors").ok());
  ASSERT_TRUE(a.write(dir / "dup.safetensors").ok());  // same tensors as a
  write_bytes(dir / "corrupt.safetensors", raw_file("{}", 1));
  write_text(dir / "model.safetensors.index.json", c.index);
  auto ck = SafetensorsCheckpoint::open(dir.path());
  ASSERT_FALSE(ck.ok()) << "accepted: " << c.name;
  EXPECT_THAT(ck.error().what(), HasSubstr(c.expect));
}

const std::string kGoodMap = R"("x":"a.safetensors","y":"a.safetensors","z":"b.safetensors")";

INSTANTIATE_TEST_SUITE_P(
    Safetensors, SafetensorsIndex,
    ::testing::Values(
        IndexCase{"NotJson", "{weight_map}", "invalid JSON"},
        IndexCase{"NotObject", "[]", "index must be a JSON object, got array"},
        IndexCase{"MissingWeightMap", R"({"metadata":{}})", "field 'weight_map': missing"},
        IndexCase{"WeightMapNotObject", R"({"weight_map":[]})", "field 'weight_map': must be an object"},
        IndexCase{"WeightMapEmpty", R"({"weight_map":{}})", "lists no tensors"},
        IndexCase{"MetadataNotObject", R"({"metadata":1,"weight_map":{)" + kGoodMap + "}}", "field 'metadata'"},
        IndexCase{"ShardNotString", R"({"weight_map":{"x":1}})", "tensor 'x': field 'weight_map': shard must be a string"},
        IndexCase{"ShardPathEscapes", R"({"weight_map":{"x":"../a.safetensors"}})", "must be a plain file name"},
        IndexCase{"ShardInSubdir", R"({"weight_map":{"x":"sub/a.safetensors"}})", "must be a plain file name"},
        IndexCase{"ShardDotDot", R"({"weight_map":{"x":".."}})", "'..' is not a file name"},
        IndexCase{"ShardEmptyName", R"({"weight_map":{"x":""}})", "shard file name is empty"},
        IndexCase{"ShardMissing", R"({"weight_map":{"x":"c.safetensors"}})", "c.safetensors' listed in weight_map does not exist"},
        IndexCase{"ShardCorrupt", R"({"weight_map":{"x":"corrupt.safetensors"}})", "corrupt.safetensors': "},
        IndexCase{"DuplicateTensorInIndex", R"({"weight_map":{"x":"a.safetensors",)" + kGoodMap + "}}", "duplicate key 'x'"},
        IndexCase{"TensorMissingFromShard", R"({"weight_map":{)" + kGoodMap + R"(,"w":"b.safetensors"}})",
                  "tensor 'w': listed in weight_map but missing from shard 'b.safetensors'"},
        IndexCase{"TensorNotInIndex", R"({"weight_map":{"x":"a.safetensors","z":"b.safetensors"}})",
                  "tensor 'y': present in shard"},
        IndexCase{"TensorInWrongShard", R"({"weight_map":{"x":"a.safetensors","y":"a.safetensors","z":"a.safetensors"}})",
                  "tensor 'z': listed in weight_map but missing from shard 'a.safetensors'"},
        IndexCase{"WeightMapPointsElsewhere",
                  R"({"weight_map":{"x":"a.safetensors","y":"b.safetensors","z":"b.safetensors"}})",
                  "tensor 'y': weight_map says shard 'b.safetensors' but the tensor is in"},
        IndexCase{"TensorInTwoShards", R"({"weight_map":{"x":"a.safetensors","y":"dup.safetensors"}})",
                  "tensor is in two shards"}),
    [](const ::testing::TestParamInfo<IndexCase>& i) { return i.param.name; });

// ---------------------------------------------------------------------------------------------
// Randomized mutations: every mutant must parse or be refused, never crash or read out of
// bounds (the fuzz build runs this under ASan and UBSan). Accepted mutants must survive a
// write/read round trip unchanged.
// ---------------------------------------------------------------------------------------------
TEST(SafetensorsMutation, RandomMutantsNeverCrash) {
  auto base = sample_writer().serialize();
  ASSERT_TRUE(base.ok());
  std::mt19937 rng(20240607);
  const size_t header_end = 8 + static_cast<size_t>(base->at(0)) + 256 * base->at(1);
  static const char* const kTokens[] = {"{", "}", "[", "]", ",", ":", "\"", "-1", "0", "1e3", "2.0",
                                        "18446744073709551616", "9223372036854775807", "\"F32\"", "\\u0000",
                                        "\"shape\":[]", "\"data_offsets\":[0,0]", " ", "null", "\xff"};
  int accepted = 0, refused = 0;
  for (int iter = 0; iter < 2000; ++iter) {
    std::vector<uint8_t> m = *base;
    const int n_mut = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < n_mut && !m.empty(); ++k) {
      // Most mutations land in the header, where the parsing logic is.
      const size_t lim = (rng() % 4 != 0) ? std::min(m.size(), header_end) : m.size();
      const size_t pos = rng() % lim;
      switch (rng() % 8) {
        case 0: m[pos] ^= static_cast<uint8_t>(1u << (rng() % 8)); break;
        case 1: m[pos] = static_cast<uint8_t>(rng()); break;
        case 2: m.insert(m.begin() + static_cast<ptrdiff_t>(pos), static_cast<uint8_t>(rng())); break;
        case 3: m.erase(m.begin() + static_cast<ptrdiff_t>(pos)); break;
        case 4: m.resize(rng() % m.size()); break;
        case 5: if (m[pos] >= '0' && m[pos] <= '9') m[pos] = static_cast<uint8_t>('0' + rng() % 10); break;
        case 6: {
          // Insert a JSON token into the header and, half of the time, fix up the length field.
          const std::string tok = kTokens[rng() % std::size(kTokens)];
          const size_t hl = std::min(m.size(), header_end);
          if (hl <= 8) break;
          const size_t at = 8 + rng() % (hl - 8);
          m.insert(m.begin() + static_cast<ptrdiff_t>(at), tok.begin(), tok.end());
          if (rng() % 2 && m.size() >= 8) {
            uint64_t n = 0;
            for (int i = 7; i >= 0; --i) n = (n << 8) | m[static_cast<size_t>(i)];
            const auto fixed = le64(n + tok.size());
            std::copy(fixed.begin(), fixed.end(), m.begin());
          }
          break;
        }
        case 7:
          if (m.size() >= 8) {
            const auto len = le64(rng() % (m.size() + 16));
            std::copy(len.begin(), len.end(), m.begin());
          }
          break;
      }
    }
    std::unique_ptr<uint8_t[]> buf(new uint8_t[m.size() + 1]);
    std::copy(m.begin(), m.end(), buf.get());
    const std::span<const uint8_t> bytes(buf.get(), m.size());
    auto f = SafetensorsFile::parse(bytes, "mutant.safetensors");
    if (!f.ok()) {
      ++refused;
      EXPECT_THAT(f.error().what(), HasSubstr("mutant.safetensors")) << "iteration " << iter;
      continue;
    }
    ++accepted;
    (void)checksum(*f);
    SafetensorsWriter w;
    for (const auto& t : f->tensors()) {
      ASSERT_GE(t.data, bytes.data());
      ASSERT_LE(t.data + t.nbytes(), bytes.data() + bytes.size());
      ASSERT_TRUE(w.add_borrowed(t.name, t.dtype, t.shape, t.bytes()).ok()) << "iteration " << iter;
    }
    for (const auto& [k, v] : f->metadata()) ASSERT_TRUE(w.set_metadata(k, v).ok());
    auto again_bytes = w.serialize();
    ASSERT_TRUE(again_bytes.ok()) << again_bytes.error().what();
    auto again = SafetensorsFile::parse(*again_bytes, "rewritten");
    ASSERT_TRUE(again.ok()) << "iteration " << iter << ": " << again.error().what();
    EXPECT_EQ(again->names(), f->names());
    EXPECT_EQ(again->metadata(), f->metadata());
  }
  RecordProperty("accepted", accepted);
  RecordProperty("refused", refused);
  // The mutations must exercise both outcomes, or the test proves nothing.
  EXPECT_GT(accepted, 20);
  EXPECT_GT(refused, 1000);
}

}  // namespace
}  // namespace moebius
