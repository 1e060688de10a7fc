// The read-stream kernel behind `moebius bench ceilings` (kernels/read_stream.cuh) against a CPU
// XOR of the same bytes: every byte must be read once whatever the grid (a stream that skipped or
// re-read a part would also be timed wrong), from device memory and from mapped pinned memory.
// Then the measurement functions on this GPU: plausible, finite numbers.
#include "gpu/gpu_test_util.h"  // first: see the fmt note there

#include <random>

#include "core/memory.h"
#include "kernels/read_stream.cuh"
#include "runtime/device_ceilings.h"

namespace moebius {
namespace {

// The CPU reference: the XOR of every 32-bit word (little-endian, as the GPU loads them).
uint32_t xor_words(const std::vector<uint32_t>& words) {
  uint32_t x = 0;
  for (uint32_t w : words) x ^= w;
  return x;
}

uint32_t gpu_xor(const void* src, size_t bytes, int blocks) {
  testing::DeviceBuffer<uint32_t> partial(blocks);
  partial.poison(0xA7);
  kernels::launch_read_stream_xor(src, bytes, blocks, partial.data(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_TRUE(partial.guards_intact()) << "the kernel wrote outside its " << blocks << " partials";
  uint32_t x = 0;
  for (uint32_t p : partial.download()) x ^= p;
  return x;
}

TEST(ReadStreamGpu, XorOfEveryWordForAnyGrid) {
  MOEBIUS_REQUIRE_GPU();
  std::mt19937 rng(20261205);
  // Sizes: one 64-byte unit, odd multiples (the tail loop), and ~9.5 MB (many full rounds).
  // Random words follow the `bytes` the kernel is given (the guard bands hold equal words, whose
  // XOR is 0): a read past the end changes the XOR.
  constexpr size_t kTailWords = 256;
  for (size_t bytes : {size_t{64}, size_t{192}, size_t{64} * 1001, size_t{9999936}}) {
    std::vector<uint32_t> host(bytes / 4 + kTailWords);
    for (auto& w : host) w = rng();
    testing::DeviceBuffer<uint32_t> dev(host.size());
    dev.upload(host);
    host.resize(bytes / 4);
    const uint32_t want = xor_words(host);
    for (int blocks : {1, 3, 132, 1056}) EXPECT_EQ(gpu_xor(dev.data(), bytes, blocks), want) << bytes << " bytes, " << blocks << " blocks";
  }
}

TEST(ReadStreamGpu, ReadsMappedPinnedMemory) {
  MOEBIUS_REQUIRE_GPU();
  const size_t bytes = size_t{64} * 12345;
  auto pinned = Buffer::allocate(MemoryKind::kPinnedHost, bytes + 1024);  // random words past the end too
  ASSERT_TRUE(pinned.ok()) << pinned.error().what();
  std::mt19937 rng(7);
  std::vector<uint32_t> host((bytes + 1024) / 4);
  for (auto& w : host) w = rng();
  std::copy(host.begin(), host.end(), pinned->as<uint32_t>());
  host.resize(bytes / 4);
  void* mapped = nullptr;
  CUDA_CHECK(cudaHostGetDevicePointer(&mapped, pinned->data(), 0));
  EXPECT_EQ(gpu_xor(mapped, bytes, 264), xor_words(host));
}

TEST(DeviceCeilingsGpu, MeasuredNumbersArePlausible) {
  MOEBIUS_REQUIRE_GPU();
  // Small sizes to keep the test short; the numbers only have to be finite and physical: above
  // what any Hopper-class part misses by 10x, below what none reaches.
  auto hbm = runtime::measure_device_read(size_t{256} << 20);
  ASSERT_TRUE(hbm.ok()) << hbm.error().what();
  EXPECT_GT(*hbm, 100e9);
  EXPECT_LT(*hbm, 20e12);
  auto gemm = runtime::measure_bf16_gemm(2048);
  ASSERT_TRUE(gemm.ok()) << gemm.error().what();
  EXPECT_GT(*gemm, 10e12);
  EXPECT_LT(*gemm, 5e15);
  auto h2d = runtime::measure_pinned_copy(size_t{64} << 20, true);
  ASSERT_TRUE(h2d.ok()) << h2d.error().what();
  EXPECT_GT(*h2d, 1e9);
  EXPECT_LT(*h2d, 1e12);
  EXPECT_FALSE(runtime::measure_bf16_gemm(1000).ok());  // not a multiple of 256: an error, no launch
  auto auto_c = runtime::device_ceilings(runtime::CeilingsMode::kAuto);
  ASSERT_TRUE(auto_c.ok()) << auto_c.error().what();
  EXPECT_FALSE(auto_c->source.empty());
  EXPECT_GT(auto_c->hbm_read_bytes_per_s, 100e9);
  EXPECT_GT(auto_c->bf16_flops_per_s, 10e12);
  EXPECT_FALSE(runtime::parse_ceilings_mode("fast").ok());
}

}  // namespace
}  // namespace moebius
