#include "runtime/device_ceilings.h"

#ifdef MOEBIUS_HAS_CUDA

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <functional>
#include <memory>

#include "core/memory.h"
#include "kernels/cuda_check.h"
#include "kernels/device_info.h"
#include "kernels/fill.cuh"
#include "kernels/read_stream.cuh"
#include "runtime/dense_gemm.h"

namespace moebius::runtime {
namespace {

// An event-timed stream with the launches' own RAII: seconds per call of `work`, best of `reps`
// timings of `calls` back-to-back calls after one warm-up call. Best, not median: a ceiling is
// what the hardware can do, and a slower timing is interference (clocks ramping, the host).
double best_seconds_per_call(const std::function<void(cudaStream_t)>& work, int calls, int reps) {
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  work(s);
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    CUDA_CHECK(cudaEventRecord(e0, s));
    for (int c = 0; c < calls; ++c) work(s);
    CUDA_CHECK(cudaEventRecord(e1, s));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    best = std::min(best, 1e-3 * ms / calls);
  }
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  CUDA_CHECK(cudaStreamDestroy(s));
  return best;
}

// The read stream over src at 1, 2 and 4 blocks per SM (the best grid differs between HBM and a
// mapped host read, whose latency is ~10x longer), best of all.
Result<double> time_read_stream(const void* src, size_t bytes, int calls) {
  const int sms = kernels::current_device_sm_count();
  MOEBIUS_ASSIGN_OR_RETURN(Buffer partials, Buffer::allocate(MemoryKind::kDevice, sizeof(uint32_t) * 8 * sms));
  double best = 1e30;
  for (int per_sm : {1, 2, 4, 8}) {
    best = std::min(best, best_seconds_per_call(
                              [&](cudaStream_t s) {
                                kernels::launch_read_stream_xor(src, bytes, per_sm * sms, partials.as<uint32_t>(), s);
                              },
                              calls, 3));
  }
  return static_cast<double>(bytes) / best;
}

}  // namespace

Result<double> measure_device_read(size_t bytes) {
  bytes -= bytes % 64;
  if (bytes == 0) return Error("the read measurement needs at least 64 bytes");
  MOEBIUS_ASSIGN_OR_RETURN(Buffer src, Buffer::allocate(MemoryKind::kDevice, bytes));
  kernels::launch_fill_random_bytes(src.data(), bytes, 1, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  return time_read_stream(src.data(), bytes, 10);
}

Result<double> measure_mapped_read(size_t bytes) {
  bytes -= bytes % 64;
  if (bytes == 0) return Error("the read measurement needs at least 64 bytes");
  // Pinned memory from Buffer is cudaHostAlloc(portable | mapped): the kernel reads it through its
  // device mapping, as the zero-copy offload path reads cold experts.
  MOEBIUS_ASSIGN_OR_RETURN(Buffer src, Buffer::allocate(MemoryKind::kPinnedHost, bytes));
  std::fill_n(src.as<unsigned char>(), bytes, static_cast<unsigned char>(0x5a));
  void* mapped = nullptr;
  CUDA_CHECK(cudaHostGetDevicePointer(&mapped, src.data(), 0));
  return time_read_stream(mapped, bytes, 2);
}

Result<double> measure_pinned_copy(size_t bytes, bool host_to_device) {
  if (bytes == 0) return Error("the copy measurement needs at least one byte");
  MOEBIUS_ASSIGN_OR_RETURN(Buffer host, Buffer::allocate(MemoryKind::kPinnedHost, bytes));
  MOEBIUS_ASSIGN_OR_RETURN(Buffer dev, Buffer::allocate(MemoryKind::kDevice, bytes));
  std::fill_n(host.as<unsigned char>(), bytes, static_cast<unsigned char>(0x5a));
  const double s = best_seconds_per_call(
      [&](cudaStream_t st) {
        if (host_to_device) CUDA_CHECK(cudaMemcpyAsync(dev.data(), host.data(), bytes, cudaMemcpyHostToDevice, st));
        else CUDA_CHECK(cudaMemcpyAsync(host.data(), dev.data(), bytes, cudaMemcpyDeviceToHost, st));
      },
      3, 3);
  return static_cast<double>(bytes) / s;
}

Result<double> measure_bf16_gemm(int n) {
  if (n < 256 || n % 256 != 0) return Error::format("the GEMM measurement needs n a multiple of 256, got {}", n);
  const size_t elems = static_cast<size_t>(n) * n;
  MOEBIUS_ASSIGN_OR_RETURN(Buffer x, Buffer::allocate(MemoryKind::kDevice, 2 * elems));
  MOEBIUS_ASSIGN_OR_RETURN(Buffer w, Buffer::allocate(MemoryKind::kDevice, 2 * elems));
  MOEBIUS_ASSIGN_OR_RETURN(Buffer y, Buffer::allocate(MemoryKind::kDevice, 2 * elems));
  // Random operands: the tensor cores draw less power on zeros and would clock higher than on
  // real activations and weights.
  kernels::launch_fill_random_bf16(x.data(), elems, 1.0f, 2, nullptr);
  kernels::launch_fill_random_bf16(w.data(), elems, 1.0f, 3, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<DenseGemm> gemm, DenseGemm::create());
  gemm->set_gemv_max_m(0);
  const double s = best_seconds_per_call(
      [&](cudaStream_t st) {
        gemm->linear(x.as<__nv_bfloat16>(), n, w.as<__nv_bfloat16>(), n, n, n, y.as<__nv_bfloat16>(), n, st);
      },
      10, 3);
  return 2.0 * n * static_cast<double>(n) * n / s;
}

Result<CeilingsMode> parse_ceilings_mode(const std::string& s) {
  if (s == "auto") return CeilingsMode::kAuto;
  if (s == "table") return CeilingsMode::kTable;
  if (s == "measure") return CeilingsMode::kMeasure;
  return Error::format("unknown ceilings mode '{}' (auto, table, measure)", s).in_field("--ceilings");
}

Result<DeviceCeilings> device_ceilings(CeilingsMode mode) {
  if (!cuda_available()) return Error("no CUDA device is visible");
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  DeviceCeilings c;
  c.device = prop.name;
  // The table: devices whose ceilings were measured with the functions above and recorded in
  // docs/PERF.md. Only the H200 SXM so far, by its exact name: "NVIDIA H200 NVL" (a 600 W card)
  // and the GH200s (other HBM rates) contain "H200" too, and get measured.
  const bool in_table = c.device == "NVIDIA H200";
  if (mode == CeilingsMode::kTable && !in_table)
    return Error::format("no table ceilings for '{}' (only the H200 has them); use --ceilings measure", c.device)
        .in_field("--ceilings");
  if (in_table && mode != CeilingsMode::kMeasure) {
    c.hbm_read_bytes_per_s = 4.57e12;
    c.bf16_flops_per_s = 791e12;
    c.source = "table: the H200's measured ceilings, docs/PERF.md";
    return c;
  }
  // 1 GiB (20x the L2) where it fits in a quarter of the free memory; a benchmark that needs the
  // rest allocates after this returns.
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const size_t read_bytes = std::min<size_t>(size_t{1} << 30, free_b / 4);
  MOEBIUS_ASSIGN_OR_RETURN(c.hbm_read_bytes_per_s, measure_device_read(read_bytes));
  MOEBIUS_ASSIGN_OR_RETURN(c.bf16_flops_per_s, measure_bf16_gemm(free_b > (size_t{2} << 30) ? 8192 : 4096));
  c.source = "measured now: read stream over " + std::to_string(read_bytes >> 20) + " MiB, cuBLAS bf16 GEMM";
  return c;
}

Result<DeviceCeilings> device_ceilings(const std::string& mode) {
  MOEBIUS_ASSIGN_OR_RETURN(CeilingsMode m, parse_ceilings_mode(mode));
  return device_ceilings(m);
}

}  // namespace moebius::runtime

#endif  // MOEBIUS_HAS_CUDA
