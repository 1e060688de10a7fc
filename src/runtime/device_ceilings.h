// The device's physical ceilings, which every benchmark's "fraction of the floor" divides by: the
// HBM read rate (weight streams), the bf16 tensor-core peak (prefill GEMMs), pinned host<->device
// copies (staged expert offload) and kernel reads of mapped pinned memory (zero-copy offload).
//
// The H200 the project is measured on has a table entry (docs/PERF.md: 4.57 TB/s, 791 TFLOP/s,
// measured with these same methods), so ratios stay comparable run to run there. Any other GPU is
// measured when a benchmark starts (~0.5 s), so an H100 or a 24 GB card gets ratios against its
// own ceilings rather than the H200's. `moebius bench ceilings` prints all four.
#pragma once

#ifdef MOEBIUS_HAS_CUDA

#include <cstddef>
#include <string>

#include "core/error.h"

namespace moebius::runtime {

// bytes/s of a read-only stream over `bytes` of device memory (kernels::launch_read_stream_xor;
// best of several timings and grid sizes). bytes is rounded down to a multiple of 64; it should
// dwarf the L2 (50 MB on Hopper) or the number is the L2's.
Result<double> measure_device_read(size_t bytes);
// bytes/s of the same kernel reading pinned host memory through its mapping (over PCIe/C2C).
Result<double> measure_mapped_read(size_t bytes);
// bytes/s of cudaMemcpyAsync between pinned host memory and the device, one direction.
Result<double> measure_pinned_copy(size_t bytes, bool host_to_device);
// flop/s of a cuBLAS bf16 GEMM n x n x n (fp32 accumulation, bf16 out; random inputs).
Result<double> measure_bf16_gemm(int n);

struct DeviceCeilings {
  std::string device;  // cudaDeviceProp::name of the current device
  double hbm_read_bytes_per_s = 0;
  double bf16_flops_per_s = 0;
  std::string source;  // where the numbers come from, for the benchmark's header line
};

// auto: the table entry where the current device has one, else measured now; table: the entry or an
// error naming the device; measure: always measured now.
enum class CeilingsMode { kAuto, kTable, kMeasure };
Result<CeilingsMode> parse_ceilings_mode(const std::string& s);
Result<DeviceCeilings> device_ceilings(CeilingsMode mode);
// The benchmarks' --ceilings flag: parse_ceilings_mode, then device_ceilings.
Result<DeviceCeilings> device_ceilings(const std::string& mode);

}  // namespace moebius::runtime

#endif  // MOEBIUS_HAS_CUDA
