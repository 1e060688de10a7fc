// Shared helpers for the GPU op tests (tests/gpu/*.cu): device buffers with guard bands, poison
// fills, a stream, and comparisons that report the first mismatch. Include this header FIRST in
// every GPU test (see the fmt note below).
//
// Typical use, in the spirit of llama.cpp's test-backend-ops:
//   DeviceBuffer<float> out(capacity * n);   // payload plus a guard band on each side
//   out.poison(0xFF, stream);                // 0xFF bytes: NaN in fp32/bf16, -1 in int32
//   launch_op(..., out.data(), stream);
//   stream.sync();
//   auto h = out.download();
//   EXPECT_TRUE(same_values(h.data(), want.data(), live));               // everything live written
//   EXPECT_TRUE(bytes_are(h.data() + live, h.size() - live, 0xFF));      // nothing past it
//   EXPECT_TRUE(out.guards_intact());                                    // nothing outside
#pragma once

// fmt 9 turns its constexpr support off when it sees __NVCC__ and then fails to compile its own
// C++20 constexpr code, so a .cu that includes core/error.h (through any cpu/*.h reference) needs
// it back on. The host-compiled libraries already see FMT_USE_CONSTEXPR=1, so this also keeps
// fmt's inline functions identical across translation units.
#ifdef FMT_VERSION
#error "include gpu/gpu_test_util.h before any header that includes fmt (core/error.h, cpu/*.h)"
#endif
#ifndef FMT_USE_CONSTEXPR
#define FMT_USE_CONSTEXPR 1
#endif

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/cuda_check.h"
#include "runtime/cuda_environment.h"

namespace moebius::testing {

// [TAG_CUDA_CONNECTIONS] [TAG_CUDA_EAGER_LOADING] The test binary runs in the environment the CLI
// asks for with the routed copies on (the tests turn them on): set while the static objects are
// built, before any test's first CUDA call.
inline const bool kCudaEnvironmentRequested =
    (runtime::request_cuda_connections(), runtime::request_eager_module_loading(), true);

inline bool gpu_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

// At the top of every GPU test, so the binary also runs (and skips) on a machine without a GPU.
#define MOEBIUS_REQUIRE_GPU()                                                      \
  do {                                                                             \
    if (!::moebius::testing::gpu_available()) GTEST_SKIP() << "no CUDA device";    \
  } while (0)

// A blocking stream (it orders with the legacy default stream that cudaMemcpy uses). Capture into
// a graph works on it as long as nothing touches the default stream during capture.
class CudaStream {
 public:
  CudaStream() { CUDA_CHECK(cudaStreamCreate(&s_)); }
  ~CudaStream() { (void)cudaStreamDestroy(s_); }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  cudaStream_t get() const { return s_; }
  operator cudaStream_t() const { return s_; }  // NOLINT(google-explicit-constructor)
  void sync() const { CUDA_CHECK(cudaStreamSynchronize(s_)); }

 private:
  cudaStream_t s_ = nullptr;
};

// Guard band on each side of a DeviceBuffer. 256 bytes keeps data() aligned like cudaMalloc.
inline constexpr size_t kGuardBytes = 256;
inline constexpr uint8_t kGuardByte = 0xA5;

// cudaMalloc'd [guard | count elements | guard]. Move-only.
template <typename T>
class DeviceBuffer {
  static_assert(std::is_trivially_copyable_v<T>);

 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) : count_(count) {
    CUDA_CHECK(cudaMalloc(&raw_, bytes() + 2 * kGuardBytes));
    CUDA_CHECK(cudaMemset(raw_, kGuardByte, bytes() + 2 * kGuardBytes));
  }
  ~DeviceBuffer() {
    if (raw_ != nullptr) (void)cudaFree(raw_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : raw_(std::exchange(o.raw_, nullptr)), count_(std::exchange(o.count_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(raw_, o.raw_);
    std::swap(count_, o.count_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* data() { return reinterpret_cast<T*>(static_cast<uint8_t*>(raw_) + kGuardBytes); }
  const T* data() const { return reinterpret_cast<const T*>(static_cast<const uint8_t*>(raw_) + kGuardBytes); }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

  // Host -> device, synchronous. U may be any type of the same size (moebius::bf16 for
  // __nv_bfloat16); at most size() elements.
  template <typename U>
  void upload(const std::vector<U>& host) {
    static_assert(sizeof(U) == sizeof(T) && std::is_trivially_copyable_v<U>);
    EXPECT_LE(host.size(), count_);
    CUDA_CHECK(cudaMemcpy(data(), host.data(), std::min(host.size(), count_) * sizeof(T), cudaMemcpyHostToDevice));
  }
  // Device -> host of the whole payload, synchronous (waits for blocking streams, not for
  // non-blocking ones: sync those first).
  std::vector<T> download() const {
    std::vector<T> host(count_);
    CUDA_CHECK(cudaMemcpy(host.data(), data(), bytes(), cudaMemcpyDeviceToHost));
    return host;
  }
  // Every payload byte := `byte` (stream-ordered). 0xFF is NaN in fp32/bf16 and -1 in int32;
  // pick another byte where -1 is a legal output.
  void poison(uint8_t byte = 0xFF, cudaStream_t stream = nullptr) {
    CUDA_CHECK(cudaMemsetAsync(data(), byte, bytes(), stream));
  }
  // True when both guard bands still hold kGuardByte: nothing wrote just outside the payload.
  bool guards_intact() const {
    std::vector<uint8_t> g(kGuardBytes);
    const uint8_t* base = static_cast<const uint8_t*>(raw_);
    for (const uint8_t* at : {base, base + kGuardBytes + bytes()}) {
      CUDA_CHECK(cudaMemcpy(g.data(), at, kGuardBytes, cudaMemcpyDeviceToHost));
      for (uint8_t b : g)
        if (b != kGuardByte) return false;
    }
    return true;
  }

 private:
  void* raw_ = nullptr;
  size_t count_ = 0;
};

// got[i] == want[i] for all i < n, bitwise (so NaN == NaN and -0 != +0). T must print with <<.
template <typename T>
::testing::AssertionResult same_values(const T* got, const T* want, size_t n) {
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < n; ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0 && bad++ == 0) first = i;
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << n << " differ; first at [" << first << "]: got "
                                       << +got[first] << ", want " << +want[first];
}

// Every byte of p[0, n) is `byte`: an output region the op must not have written.
template <typename T>
::testing::AssertionResult bytes_are(const T* p, size_t n, uint8_t byte) {
  const auto* b = reinterpret_cast<const uint8_t*>(p);
  for (size_t i = 0; i < n * sizeof(T); ++i)
    if (b[i] != byte)
      return ::testing::AssertionFailure() << "element " << i / sizeof(T) << " of " << n
                                           << " was written (byte " << +b[i] << ", poison " << +byte << ")";
  return ::testing::AssertionSuccess();
}

// |got - want| <= rel * |want| + abs elementwise; a NaN in got (an unwritten poisoned entry) fails.
inline ::testing::AssertionResult all_close(const float* got, const float* want, size_t n, double rel,
                                            double abs = 0.0) {
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < n; ++i) {
    const double g = got[i], w = want[i];
    if (!(std::fabs(g - w) <= rel * std::fabs(w) + abs) && bad++ == 0) first = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << n << " not within rel " << rel << " abs " << abs
                                       << "; first at [" << first << "]: got " << got[first] << ", want "
                                       << want[first];
}

// Normalised mean squared error sum((got - want)^2) / sum(want^2), as test-backend-ops compares.
inline double nmse(const float* got, const float* want, size_t n) {
  double err = 0, ref = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    err += d * d;
    ref += static_cast<double>(want[i]) * want[i];
  }
  return ref > 0 ? err / ref : err;
}

// Rows of `vocab` logits from another computation of the same model (expert parallelism, other
// kernels) against a reference: every value finite, max |dlogit| <= tol, nmse <= max_nmse, and
// the argmax equal wherever the reference's top-1 margin exceeds 2 tol. Prints what it measured.
inline void expect_logits_close(const std::vector<float>& got, const std::vector<float>& want, size_t vocab, float tol,
                                double max_nmse, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  float d = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << what << ": non-finite logit";
    d = std::max(d, std::fabs(got[i] - want[i]));
  }
  const double e = nmse(got.data(), want.data(), got.size());
  const bool same = std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0;
  std::printf("%-56s max |dlogit| %.4g  nmse %.3g  %s\n", what.c_str(), d, e, same ? "bit-identical" : "");
  EXPECT_LE(d, tol) << what;
  EXPECT_LE(e, max_nmse) << what;
  for (size_t r = 0; r * vocab < want.size(); ++r) {
    const float* w = want.data() + r * vocab;
    const float* g = got.data() + r * vocab;
    const auto top = std::max_element(w, w + vocab) - w;
    float second = -INFINITY;
    for (size_t v = 0; v < vocab; ++v)
      if (static_cast<ptrdiff_t>(v) != top) second = std::max(second, w[v]);
    if (w[top] - second > 2 * tol) EXPECT_EQ(std::max_element(g, g + vocab) - g, top) << what << " row " << r;
  }
}

}  // namespace moebius::testing
