// Device and pinned-host Buffers (src/core/memory.h) on a real GPU: allocation, alignment, a copy
// round trip, a kernel reading mapped pinned memory zero-copy, and a clear error when an
// allocation cannot be satisfied.
#include "gpu/gpu_test_util.h"  // first: see the fmt note there

#include <numeric>

#include "core/memory.h"

namespace moebius {
namespace {

__global__ void sum_kernel(const int* p, int n, int* out) {
  int s = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += p[i];
  atomicAdd(out, s);
}

TEST(MemoryGpu, DeviceAndPinnedBuffersRoundTrip) {
  MOEBIUS_REQUIRE_GPU();
  ASSERT_TRUE(cuda_available());
  const int n = 1 << 20;
  auto pinned = Buffer::allocate(MemoryKind::kPinnedHost, n * sizeof(int));
  auto device = Buffer::allocate(MemoryKind::kDevice, n * sizeof(int));
  ASSERT_TRUE(pinned.ok()) << pinned.error().what();
  ASSERT_TRUE(device.ok()) << device.error().what();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(device->data()) % 256, 0u);
  std::iota(pinned->as<int>(), pinned->as<int>() + n, 0);
  CUDA_CHECK(cudaMemcpy(device->data(), pinned->data(), n * sizeof(int), cudaMemcpyHostToDevice));
  std::fill(pinned->as<int>(), pinned->as<int>() + n, -1);
  CUDA_CHECK(cudaMemcpy(pinned->data(), device->data(), n * sizeof(int), cudaMemcpyDeviceToHost));
  for (int i = 0; i < n; i += 4097) ASSERT_EQ(pinned->as<int>()[i], i);

  // Zero-copy: a kernel reads the mapped pinned buffer directly (the offload path's mechanism).
  int* dev_view = nullptr;
  CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_view), pinned->data(), 0));
  for (int i = 0; i < 1000; ++i) pinned->as<int>()[i] = 1;
  testing::DeviceBuffer<int> out(1);
  CUDA_CHECK(cudaMemset(out.data(), 0, sizeof(int)));
  sum_kernel<<<1, 256>>>(dev_view, 1000, out.data());
  CUDA_CHECK_LAUNCH();
  EXPECT_EQ(out.download()[0], 1000);
}

TEST(MemoryGpu, ImpossibleAllocationIsAClearError) {
  MOEBIUS_REQUIRE_GPU();
  auto huge = Buffer::allocate(MemoryKind::kDevice, size_t{1} << 50);  // 1 PiB
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.error().what().find("device allocation"), std::string::npos) << huge.error().what();
  // The failed allocation leaves no sticky error behind.
  auto small = Buffer::allocate(MemoryKind::kDevice, 1024);
  EXPECT_TRUE(small.ok());
}

}  // namespace
}  // namespace moebius
