// Core: errors with context, scalar dtypes, memory, thread pool, logging.
#include <sys/stat.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>

#include "core/dtype.h"
#include "core/error.h"
#include "core/log.h"
#include "core/memory.h"
#include "core/tensor.h"
#include "core/thread_pool.h"

namespace moebius {
namespace {

using ::testing::HasSubstr;

// ---- errors ----------------------------------------------------------------------------------
Result<int> parse_positive(int x) {
  if (x <= 0) return Error::format("expected a positive value, got {}", x).in_field("num_experts");
  return x;
}

Status load(int x) {
  MOEBIUS_ASSIGN_OR_RETURN(int v, parse_positive(x));
  (void)v;
  return Ok{};
}

TEST(CoreError, CarriesFileTensorFieldContext) {
  Error e = Error("end 4096 is past the data section").in_file("a.safetensors").in_tensor("w").in_field("data_offsets");
  EXPECT_EQ(e.what(), "file 'a.safetensors': tensor 'w': field 'data_offsets': end 4096 is past the data section");
  e.in_file("outer.safetensors");  // the innermost context wins
  EXPECT_THAT(e.what(), HasSubstr("'a.safetensors'"));
  e.with_context("loading layer 3");
  EXPECT_THAT(e.what(), HasSubstr("loading layer 3: end 4096"));
}

TEST(CoreError, PropagatesThroughMacros) {
  EXPECT_TRUE(load(3).ok());
  Status s = load(-1);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().field(), "num_experts");
  EXPECT_THAT(s.error().what(), HasSubstr("got -1"));
}

TEST(CoreError, ResultValueOnErrorAborts) {
  Result<int> r = Error("boom");
  EXPECT_DEATH((void)r.value(), "boom");
}

// ---- dtypes ----------------------------------------------------------------------------------
TEST(CoreDType, NamesRoundTripAndUnknownRefused) {
  for (DType t : {DType::kBool, DType::kU8, DType::kI8, DType::kU16, DType::kI16, DType::kU32, DType::kI32,
                  DType::kU64, DType::kI64, DType::kF16, DType::kBF16, DType::kF32, DType::kF64,
                  DType::kF8E4M3, DType::kF8E5M2}) {
    auto back = dtype_from_name(dtype_name(t));
    ASSERT_TRUE(back.has_value()) << dtype_name(t);
    EXPECT_EQ(*back, t);
  }
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF8E4M3), 1u);
  EXPECT_FALSE(dtype_from_name("F4").has_value());
  EXPECT_FALSE(dtype_from_name("bf16").has_value());  // safetensors names are upper case
  EXPECT_FALSE(dtype_from_name("").has_value());
}

TEST(CoreDType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16_bits(1.0f), 0x3F80);
  // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(float_to_bf16_bits(1.0f + 0x1p-8f), 0x3F80);
  // 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even): rounds up.
  EXPECT_EQ(float_to_bf16_bits(1.0f + 3 * 0x1p-8f), 0x3F82);
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::max()), 0x7F80);  // overflow -> inf
  EXPECT_EQ(float_to_bf16_bits(-0.0f), 0x8000);
  EXPECT_EQ(float_to_bf16_bits(NAN), 0x7FFF);
  EXPECT_EQ(bf16_bits_to_float(0xC040), -3.0f);
}

// [TAG_FINITE_WEIGHTS] The scans that refuse damaged checkpoint weights: NaN and both infinities
// anywhere (a block's first and last value, past the first block), the largest finite values not,
// bf16 data at an odd byte offset.
TEST(CoreDType, FirstNonFiniteFindsNanAndInfinityOnly) {
  std::vector<float> v(5000, 1.5f);
  v[17] = std::numeric_limits<float>::max();
  v[18] = -std::numeric_limits<float>::max();
  v[19] = std::numeric_limits<float>::denorm_min();
  EXPECT_EQ(first_non_finite(v.data(), 5000), -1);
  EXPECT_EQ(first_non_finite(v.data(), 0), -1);
  for (int64_t at : {0, 1023, 1024, 4999}) {
    for (float bad : {NAN, INFINITY, -INFINITY}) {
      std::vector<float> w = v;
      w[static_cast<size_t>(at)] = bad;
      if (at > 0) w[static_cast<size_t>(at) + (at == 4999 ? 0 : 1)] = bad;  // a later one too
      EXPECT_EQ(first_non_finite(w.data(), 5000), at) << at;
    }
  }
  std::vector<uint8_t> bytes(2 * 5000 + 1, 0);
  uint8_t* b = bytes.data() + 1;  // odd offset, as safetensors data may be
  const auto put = [&](int64_t i, uint16_t bits) {
    b[2 * i] = static_cast<uint8_t>(bits & 0xFF);
    b[2 * i + 1] = static_cast<uint8_t>(bits >> 8);
  };
  for (int64_t i = 0; i < 5000; ++i) put(i, 0x3FC0);
  put(3, 0x7F7F);  // the largest finite bf16
  put(4, 0xFF7F);
  EXPECT_EQ(first_non_finite_bf16(b, 5000), -1);
  for (uint16_t bad : {uint16_t{0x7FC0}, uint16_t{0x7F80}, uint16_t{0xFF80}, uint16_t{0xFFFF}, uint16_t{0x7F81}}) {
    put(2047, bad);
    EXPECT_EQ(first_non_finite_bf16(b, 5000), 2047) << bad;
    EXPECT_EQ(first_non_finite_bf16(b, 2047), -1) << bad;
    put(2047, 0x3FC0);
  }
}

TEST(CoreDType, Fp16RoundsAndOverflows) {
  EXPECT_EQ(float_to_fp16_bits(1.0f), 0x3C00);
  EXPECT_EQ(float_to_fp16_bits(65504.0f), 0x7BFF);
  EXPECT_EQ(float_to_fp16_bits(65519.0f), 0x7BFF);  // below the tie
  EXPECT_EQ(float_to_fp16_bits(65520.0f), 0x7C00);  // the tie rounds to even: infinity
  EXPECT_EQ(float_to_fp16_bits(0x1p-24f), 0x0001);  // smallest subnormal
  EXPECT_EQ(float_to_fp16_bits(0x1p-25f), 0x0000);  // tie with zero -> even (zero)
  EXPECT_EQ(float_to_fp16_bits(0x1.8p-25f), 0x0001);
  EXPECT_EQ(fp16_bits_to_float(0xC000), -2.0f);
  EXPECT_TRUE(std::isnan(fp16_bits_to_float(0x7E00)));
}

TEST(CoreDType, E4M3SaturatesAndRounds) {
  EXPECT_EQ(float_to_e4m3_bits(448.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3_bits(1000.0f), 0x7E);              // satfinite
  EXPECT_EQ(float_to_e4m3_bits(-1000.0f), 0xFE);
  EXPECT_EQ(float_to_e4m3_bits(1000.0f, Saturation::kNoSat), 0x7F);  // NaN
  EXPECT_EQ(float_to_e4m3_bits(INFINITY), 0x7E);
  EXPECT_EQ(float_to_e4m3_bits(NAN), 0x7F);
  EXPECT_EQ(float_to_e4m3_bits(0x1p-9f), 0x01);   // smallest subnormal
  EXPECT_EQ(float_to_e4m3_bits(0x1p-10f), 0x00);  // tie with zero -> zero
  EXPECT_EQ(float_to_e4m3_bits(1.0f), 0x38);
  EXPECT_EQ(float_to_e4m3_bits(1.0625f), 0x38);  // halfway 1 and 1.125: to even
  EXPECT_EQ(float_to_e4m3_bits(1.1875f), 0x3A);  // halfway 1.125 (odd) and 1.25: up
  EXPECT_EQ(e4m3_bits_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_bits_to_float(0x01), 0x1p-9f);
  EXPECT_TRUE(std::isnan(e4m3_bits_to_float(0xFF)));
}

TEST(CoreDType, E2M1GridAndTies) {
  const float grid[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(e2m1_bits_to_float(static_cast<uint8_t>(i)), grid[i]);
    EXPECT_EQ(e2m1_bits_to_float(static_cast<uint8_t>(i | 8)), -grid[i]);
    EXPECT_EQ(float_to_e2m1_bits(grid[i]), i);
  }
  EXPECT_EQ(float_to_e2m1_bits(0.25f), 0);   // tie 0 / 0.5 -> 0 (even)
  EXPECT_EQ(float_to_e2m1_bits(0.75f), 2);   // tie 0.5 / 1 -> 1.0 (even mantissa)
  EXPECT_EQ(float_to_e2m1_bits(2.5f), 4);    // tie 2 / 3 -> 2
  EXPECT_EQ(float_to_e2m1_bits(3.5f), 6);    // tie 3 / 4 -> 4
  EXPECT_EQ(float_to_e2m1_bits(5.0f), 6);    // tie 4 / 6 -> 4
  EXPECT_EQ(float_to_e2m1_bits(5.01f), 7);
  EXPECT_EQ(float_to_e2m1_bits(100.0f), 7);  // saturates
  EXPECT_EQ(float_to_e2m1_bits(-100.0f), 15);
}

TEST(CoreDType, RoundTripEveryRepresentableValue) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = bf16_bits_to_float(static_cast<uint16_t>(b));
    if (!std::isnan(f)) {
      EXPECT_EQ(float_to_bf16_bits(f), b);
    }
    const float h = fp16_bits_to_float(static_cast<uint16_t>(b));
    if (!std::isnan(h)) {
      EXPECT_EQ(float_to_fp16_bits(h), b);
    }
  }
  for (uint32_t b = 0; b < 256; ++b) {
    const float f = e4m3_bits_to_float(static_cast<uint8_t>(b));
    if (!std::isnan(f)) {
      EXPECT_EQ(float_to_e4m3_bits(f), b);
    }
  }
}

// ---- tensor and memory -----------------------------------------------------------------------
TEST(CoreTensor, ShapeBasics) {
  Shape s{128, 768, 2048};
  EXPECT_EQ(s.rank, 3);
  EXPECT_EQ(s.numel(), 128LL * 768 * 2048);
  EXPECT_EQ(s.str(), "[128, 768, 2048]");
  EXPECT_EQ(Shape{}.numel(), 1);  // a scalar
  TensorView v{nullptr, DType::kBF16, Shape{3, 5}};
  EXPECT_EQ(v.nbytes(), 30u);
}

TEST(CoreMemory, MappedFileReadsBytesAndNamesMissingFile) {
  const auto path = std::filesystem::temp_directory_path() / "moebius_mmap_test.bin";
  {
    std::ofstream f(path, std::ios::binary);
    f << "hello moebius";
  }
  auto m = MappedFile::open(path.string());
  ASSERT_TRUE(m.ok()) << m.error().what();
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(m->data()), m->size()), "hello moebius");
  MappedFile moved = std::move(*m);
  EXPECT_EQ(moved.size(), 13u);
  std::filesystem::remove(path);

  auto missing = MappedFile::open("/nonexistent/dir/model.safetensors");
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.error().what(), HasSubstr("/nonexistent/dir/model.safetensors"));
  auto dir = MappedFile::open("/tmp");
  ASSERT_FALSE(dir.ok());
  EXPECT_THAT(dir.error().what(), HasSubstr("not a regular file"));
}

// The JSON side files are read whole: only regular files within the cap, and a FIFO must be
// refused, not waited on (a test that hangs here is the bug).
TEST(CoreMemory, ReadSmallFileRefusesWhatCannotBeReadWhole) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("moebius_small_file_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string text_path = (dir / "config.json").string();
  {
    std::ofstream f(text_path, std::ios::binary);
    f << R"({"a": 1})";
  }
  auto ok = read_small_file(text_path);
  ASSERT_TRUE(ok.ok()) << ok.error().what();
  EXPECT_EQ(*ok, R"({"a": 1})");
  auto too_big = read_small_file(text_path, 4);
  ASSERT_FALSE(too_big.ok());
  EXPECT_THAT(too_big.error().what(), HasSubstr("at most 4"));
  EXPECT_EQ(too_big.error().file(), text_path);
  auto directory = read_small_file(dir.string());
  ASSERT_FALSE(directory.ok());
  EXPECT_THAT(directory.error().what(), HasSubstr("directory"));
  const std::string fifo = (dir / "fifo.json").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto from_fifo = read_small_file(fifo);
  ASSERT_FALSE(from_fifo.ok());
  EXPECT_THAT(from_fifo.error().what(), HasSubstr("not a regular file"));
  const std::string zero = (dir / "zero.json").string();
  fs::create_symlink("/dev/zero", zero);
  auto from_zero = read_small_file(zero);
  ASSERT_FALSE(from_zero.ok());
  EXPECT_THAT(from_zero.error().what(), HasSubstr("not a regular file"));
  auto missing = read_small_file((dir / "missing.json").string());
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.error().what(), HasSubstr("cannot open"));
  fs::remove_all(dir);
}

TEST(CoreMemory, HostBufferIsAlignedAndMovable) {
  auto b = Buffer::allocate(MemoryKind::kHost, 1000);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 256, 0u);
  std::memset(b->data(), 0xAB, 1000);
  Buffer moved = std::move(*b);
  EXPECT_EQ(moved.size(), 1000u);
  EXPECT_EQ(moved.as<uint8_t>()[999], 0xAB);
}

TEST(CoreMemory, DeviceBufferErrorsCleanlyWithoutGpu) {
  if (cuda_available()) GTEST_SKIP() << "a GPU is present; covered by the GPU tests";
  auto d = Buffer::allocate(MemoryKind::kDevice, 1 << 20);
  ASSERT_FALSE(d.ok());
  EXPECT_FALSE(d.error().what().empty());
}

// ---- thread pool -----------------------------------------------------------------------------
TEST(CoreThreadPool, ParallelForCoversEveryIndexOnce) {
  ThreadPool pool(3);
  for (int64_t n : {0, 1, 2, 3, 7, 1000, 12345}) {
    std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
    pool.parallel_for(0, n, [&](int64_t i) { hits[static_cast<size_t>(i)]++; });
    for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  }
}

TEST(CoreThreadPool, NestedParallelForDoesNotDeadlock) {
  ThreadPool pool(2);
  std::atomic<int64_t> sum{0};
  pool.parallel_for(0, 8, [&](int64_t i) {
    pool.parallel_for(0, 100, [&](int64_t j) { sum += i * 100 + j; });
  });
  EXPECT_EQ(sum.load(), 800 * 799 / 2);
}

TEST(CoreThreadPool, SubmitReturnsValuesAndExceptionsPropagate) {
  ThreadPool pool(2);
  auto f = pool.submit([] { return 42; });
  EXPECT_EQ(f.get(), 42);
  EXPECT_THROW(pool.parallel_for(0, 10, [](int64_t i) { if (i == 7) throw std::runtime_error("x"); }),
               std::runtime_error);
}

// ---- logging ---------------------------------------------------------------------------------
TEST(CoreLog, LevelFiltersMessages) {
  const LogLevel saved = log_level();
  set_log_level(LogLevel::kWarn);
  ::testing::internal::CaptureStderr();
  log_info("hidden {}", 1);
  log_warn("shown {}", 2);
  log_error("also shown");
  const std::string err = ::testing::internal::GetCapturedStderr();
  set_log_level(saved);
  EXPECT_EQ(err.find("hidden"), std::string::npos);
  EXPECT_NE(err.find("warn] shown 2"), std::string::npos) << err;
  EXPECT_NE(err.find("error] also shown"), std::string::npos) << err;
}

}  // namespace
}  // namespace moebius
