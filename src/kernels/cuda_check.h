// The one way to check CUDA calls, shared by every kernel family and by the GPU tests:
//
//   CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
//   my_kernel<<<grid, block, 0, stream>>>(...);
//   CUDA_CHECK_LAUNCH();  // right after every launch
//   MOEBIUS_LAUNCH_ASSERT(k <= 16, "top_k must be <= 16");  // shapes/alignment, at the launcher
//
// A failure prints the expression, file, line and the CUDA error's name and text, then aborts. A
// failed CUDA call or a bad launch shape inside the engine is our bug (or a dead device), never
// something a user can fix, so these are asserts, not Error values (STYLE.md). User input is
// validated one layer up, before it reaches a launcher.
//
// This header stays free of core/error.h on purpose: that header pulls in fmt, and fmt 9 does not
// compile under nvcc in C++20 mode (it turns constexpr off when it sees __NVCC__ and then trips over
// its own C++20 constexpr paths).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

namespace moebius::kernels {

[[noreturn]] inline void cuda_check_fail(const char* expr, cudaError_t err, const char* file, int line) {
  std::fprintf(stderr, "moebius: CUDA error at %s:%d: '%s' failed: %s (%s)\n", file, line, expr,
               cudaGetErrorName(err), cudaGetErrorString(err));
  std::abort();
}

[[noreturn]] inline void launch_assert_fail(const char* expr, const char* what, const char* file, int line) {
  std::fprintf(stderr, "moebius: internal error at %s:%d: launcher assertion '%s' failed: %s\n", file, line, expr,
               what);
  std::abort();
}

}  // namespace moebius::kernels

// Any call that returns cudaError_t.
#define CUDA_CHECK(expr)                                                                  \
  do {                                                                                    \
    const cudaError_t moebius_cuda_err_ = (expr);                                         \
    if (moebius_cuda_err_ != cudaSuccess)                                                 \
      ::moebius::kernels::cuda_check_fail(#expr, moebius_cuda_err_, __FILE__, __LINE__);  \
  } while (0)

// After every <<<...>>>: catches launch-configuration errors (bad grid or block, too much shared
// memory, no kernel image for this GPU) at the launch site. Faults inside the kernel surface
// asynchronously at the next synchronizing call. cudaGetLastError is not a stream operation, so
// this is legal while a stream is being captured into a CUDA graph.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

// Shape and alignment checks at launchers. `what` is a string literal.
#define MOEBIUS_LAUNCH_ASSERT(cond, what)                                                   \
  do {                                                                                      \
    if (!(cond)) ::moebius::kernels::launch_assert_fail(#cond, what, __FILE__, __LINE__);   \
  } while (0)
