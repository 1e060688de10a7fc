// `moebius bench ceilings`: the current GPU's physical ceilings, measured now (runtime/
// device_ceilings.h): the HBM read stream, a cuBLAS bf16 GEMM, pinned copies both ways and a
// kernel reading mapped pinned host memory. These are the denominators of every "fraction of the
// floor" the other benchmarks print (they take the table on the H200 and measure elsewhere), and
// of the offload cost model's PCIe rates. Run it on a new GPU before reading any ratio.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <memory>

#include "cli/commands.h"
#include "core/error.h"

#ifdef MOEBIUS_HAS_CUDA
#include <cuda_runtime_api.h>

#include "core/memory.h"
#include "kernels/cuda_check.h"
#include "runtime/device_ceilings.h"
#endif

namespace moebius::cli {
namespace {

struct BenchCeilingsOptions {
  int64_t device_mib = 1024;  // the HBM stream's buffer
  int64_t host_mib = 512;     // the pinned buffer of the copies and the mapped read
  int gemm_n = 8192;
};

// The options, checked in every build so that a bad one is named on machines without a GPU too.
Status check_options(const BenchCeilingsOptions& o) {
  if (o.device_mib < 1 || o.device_mib > (int64_t{1} << 20)) return Error("must be 1..1048576").in_field("--device-mib");
  if (o.host_mib < 1 || o.host_mib > (int64_t{1} << 20)) return Error("must be 1..1048576").in_field("--host-mib");
  if (o.gemm_n < 256 || o.gemm_n > 32768 || o.gemm_n % 256 != 0)
    return Error("must be a multiple of 256 in 256..32768").in_field("--gemm-n");
  return Ok{};
}

#ifdef MOEBIUS_HAS_CUDA

Status run(const BenchCeilingsOptions& o) {
  MOEBIUS_TRY(check_options(o));
  if (!cuda_available()) return Error("no CUDA device is visible");
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("moebius bench ceilings  %s, %d SMs, %.1f GiB; best of several timings each\n", prop.name,
              prop.multiProcessorCount, static_cast<double>(prop.totalGlobalMem) / (1u << 30));
  const size_t dev_bytes = static_cast<size_t>(o.device_mib) << 20, host_bytes = static_cast<size_t>(o.host_mib) << 20;
  MOEBIUS_ASSIGN_OR_RETURN(double hbm, runtime::measure_device_read(dev_bytes));
  std::printf("%-34s %10.1f GB/s   (%lld MiB, read-only stream)\n", "HBM read", hbm / 1e9,
              static_cast<long long>(o.device_mib));
  std::fflush(stdout);
  MOEBIUS_ASSIGN_OR_RETURN(double gemm, runtime::measure_bf16_gemm(o.gemm_n));
  std::printf("%-34s %10.1f TFLOP/s (n = %d, cuBLAS, fp32 accumulation)\n", "bf16 GEMM", gemm / 1e12, o.gemm_n);
  std::fflush(stdout);
  MOEBIUS_ASSIGN_OR_RETURN(double h2d, runtime::measure_pinned_copy(host_bytes, true));
  MOEBIUS_ASSIGN_OR_RETURN(double d2h, runtime::measure_pinned_copy(host_bytes, false));
  std::printf("%-34s %10.1f GB/s   (%lld MiB)\n", "pinned host -> device copy", h2d / 1e9,
              static_cast<long long>(o.host_mib));
  std::printf("%-34s %10.1f GB/s\n", "device -> pinned host copy", d2h / 1e9);
  std::fflush(stdout);
  MOEBIUS_ASSIGN_OR_RETURN(double mapped, runtime::measure_mapped_read(host_bytes));
  std::printf("%-34s %10.1f GB/s   (zero-copy expert reads)\n", "kernel read of mapped pinned host", mapped / 1e9);
  return Ok{};
}

#else

Status run(const BenchCeilingsOptions& o) {
  MOEBIUS_TRY(check_options(o));
  return Error("this build of moebius has no CUDA support");
}

#endif  // MOEBIUS_HAS_CUDA

}  // namespace

void register_bench_ceilings(CLI::App& bench) {
  auto opts = std::make_shared<BenchCeilingsOptions>();
  CLI::App* cmd = bench.add_subcommand("ceilings", "measure this GPU's HBM, bf16 GEMM and host-link ceilings");
  cmd->add_option("--device-mib", opts->device_mib, "HBM stream buffer (MiB; well above the L2)")->capture_default_str();
  cmd->add_option("--host-mib", opts->host_mib, "pinned host buffer (MiB)")->capture_default_str();
  cmd->add_option("--gemm-n", opts->gemm_n, "GEMM size n (n x n x n, a multiple of 256)")->capture_default_str();
  cmd->final_callback([opts] {
    Status s = run(*opts);
    if (!s.ok()) {
      std::fprintf(stderr, "moebius bench ceilings: error: %s\n", s.error().what().c_str());
      throw CLI::RuntimeError(2);
    }
  });
}

}  // namespace moebius::cli
