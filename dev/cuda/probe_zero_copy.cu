// Probe: how fast can a kernel read mapped pinned host memory over PCIe, and how fast does a pinned
// cudaMemcpyAsync go each way? The two rates docs/OFFLOAD.md's cost model takes as inputs (the
// issue's H200 numbers: 51.3 GB/s for a plain kernel with 16-byte loads, 55.3 GB/s memcpy).
// Variants of the kernel read (grid-stride, every byte once, an XOR of the words to a sink so
// nothing is optimized away):
//   v4       16-byte loads (uint4), one per thread per iteration
//   v4x4     16-byte loads, 4 independent loads in flight per thread (more bytes in flight hide
//            the ~1-2 us PCIe round trip)
//   chunk    one warp reads one 512-byte tile chunk per step (32 lanes x 16 bytes, the
//            [TAG_EXPERT_TILE_LAYOUT] access of the MoE GEMMs)
//   v1       4-byte loads (the narrow-read baseline)
// Sizes: 256 MiB and 1 GiB (a decode layer reads ~36 MB of cold experts, a staged prefill layer
// copies ~577 MB). Prints GB/s (1e9 bytes) per variant, best of 5 timed with CUDA events.
// Then the next-layer prefetch's question ([TAG_EXPERT_PREFETCH], docs/PERF.md run Z28): how fast
// do SMALL grids read 10 MB (two Qwen3-235B int2 experts), alone and while a kernel that holds
// every SM (two 512-thread blocks with 77 KiB of shared memory each, like the dense GEMVs) runs on
// another stream; the copy's stream at normal or the greatest priority.
// Usage: dev_probe_zero_copy   (no arguments)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "kernels/cuda_check.h"
#include "probe_util.h"

namespace {

__global__ void read_v4(const uint4* __restrict__ p, size_t n, unsigned* __restrict__ sink) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // practically never; keeps the loads
}

// n: 16-byte pieces, a multiple of 32 (whole 512-byte chunks).
__global__ void read_chunk(const uint4* __restrict__ p, size_t n, unsigned* __restrict__ sink) {
  const size_t chunks = n / 32, warp = (blockIdx.x * size_t{blockDim.x} + threadIdx.x) / 32;
  const size_t warps = size_t{gridDim.x} * blockDim.x / 32;
  const unsigned lane = threadIdx.x % 32;
  unsigned acc = 0;
  for (size_t c = warp; c < chunks; c += warps) {
    const uint4 v = p[c * 32 + lane];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

__global__ void read_v1(const unsigned* __restrict__ p, size_t n, unsigned* __restrict__ sink) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    acc ^= p[i];
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

template <typename F>
float best_ms(cudaStream_t s, F&& launch) {
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  launch();  // warm-up
  CUDA_CHECK(cudaStreamSynchronize(s));
  float best = 1e30f;
  for (int r = 0; r < 5; ++r) {
    CUDA_CHECK(cudaEventRecord(a, s));
    launch();
    CUDA_CHECK(cudaEventRecord(b, s));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    best = std::min(best, ms);
  }
  CUDA_CHECK(cudaEventDestroy(a));
  CUDA_CHECK(cudaEventDestroy(b));
  return best;
}

// Holds its SM for about `ns` nanoseconds (a stand-in for the decode step's kernels).
__global__ void hold_sm(long long ns) {
  extern __shared__ unsigned char smem[];
  const long long t0 = clock64();
  // clock64 counts SM cycles; ~1.7 GHz on H100/H200 under load.
  while (clock64() - t0 < ns * 17 / 10)
    if (blockDim.x <= 0) smem[threadIdx.x] = static_cast<unsigned char>(t0);  // never: smem need not be touched
}

// The prefetch copy's shapes: (blocks, threads) reading `bytes` of mapped memory with v4x4, alone
// and beside hold_sm on every SM.
void small_grid_sweep(int sms, unsigned* sink) {
  const size_t bytes = size_t{10} << 20;
  void* host = nullptr;
  CUDA_CHECK(cudaHostAlloc(&host, bytes, cudaHostAllocPortable | cudaHostAllocMapped));
  std::memset(host, 0x5a, bytes);
  void* alias = nullptr;
  CUDA_CHECK(cudaHostGetDevicePointer(&alias, host, 0));
  const auto* p4 = static_cast<const uint4*>(alias);
  int least = 0, greatest = 0;
  CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t busy, lo, hi;
  CUDA_CHECK(cudaStreamCreateWithFlags(&busy, cudaStreamNonBlocking));
  CUDA_CHECK(cudaStreamCreateWithPriority(&lo, cudaStreamNonBlocking, least));
  CUDA_CHECK(cudaStreamCreateWithPriority(&hi, cudaStreamNonBlocking, greatest));
  const int hold_smem = 77 * 1024;
  CUDA_CHECK(cudaFuncSetAttribute(hold_sm, cudaFuncAttributeMaxDynamicSharedMemorySize, hold_smem));
  std::printf("\nprefetch copy of 10 MB: us (GB/s), alone and beside ~2 ms of kernels on every SM: 'smem' 2 x 512\n"
              "threads with 77 KiB each (room left for threads, not shared memory), 'full' 4 x 512 threads (none left)\n");
  std::printf("%7s %7s %16s %16s %16s %16s\n", "blocks", "threads", "alone", "smem, normal", "smem, greatest",
              "full, greatest");
  const int shapes[][2] = {{16, 512}, {16, 128}, {32, 128}, {66, 128}, {sms, 128}, {sms, 256}, {2 * sms, 128}};
  for (const auto& sh : shapes) {
    const int blocks = sh[0], threads = sh[1];
    const size_t n4 = bytes / 16;
    float t[4];
    t[0] = best_ms(lo, [&] { dev_probe::read_v4x4<<<blocks, threads, 0, lo>>>(p4, n4, sink); });
    CUDA_CHECK(cudaGetLastError());
    const struct {
      cudaStream_t cs;
      int per_sm, smem;
    } modes[3] = {{lo, 2, hold_smem}, {hi, 2, hold_smem}, {hi, 4, 0}};
    for (int m = 0; m < 3; ++m) {
      t[m + 1] = best_ms(modes[m].cs, [&] {
        hold_sm<<<modes[m].per_sm * sms, 512, modes[m].smem, busy>>>(2000000);
        dev_probe::read_v4x4<<<blocks, threads, 0, modes[m].cs>>>(p4, n4, sink);
      });
      CUDA_CHECK(cudaGetLastError());
      CUDA_CHECK(cudaStreamSynchronize(busy));
    }
    auto cell = [&](float ms) {
      char b[32];
      std::snprintf(b, sizeof(b), "%.0f (%.1f)", ms * 1e3, static_cast<double>(bytes) / (ms * 1e-3) / 1e9);
      return std::string(b);
    };
    std::printf("%7d %7d %16s %16s %16s %16s\n", blocks, threads, cell(t[0]).c_str(), cell(t[1]).c_str(),
                cell(t[2]).c_str(), cell(t[3]).c_str());
  }
  for (cudaStream_t x : {busy, lo, hi}) CUDA_CHECK(cudaStreamDestroy(x));
  CUDA_CHECK(cudaFreeHost(host));
}

}  // namespace

int main() {
  int dev = 0, sms = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned* sink = nullptr;
  CUDA_CHECK(cudaMalloc(&sink, 16));
  const int threads = 256, blocks = sms * 8;
  std::printf("%-10s %10s %10s\n", "variant", "MiB", "GB/s");
  for (size_t mib : {size_t{256}, size_t{1024}}) {
    const size_t bytes = mib << 20;
    void* host = nullptr;
    CUDA_CHECK(cudaHostAlloc(&host, bytes, cudaHostAllocPortable | cudaHostAllocMapped));
    std::memset(host, 0x5a, bytes);
    void* alias = nullptr;
    CUDA_CHECK(cudaHostGetDevicePointer(&alias, host, 0));
    void* dev_buf = nullptr;
    CUDA_CHECK(cudaMalloc(&dev_buf, bytes));
    const auto* p4 = static_cast<const uint4*>(alias);
    const size_t n4 = bytes / 16;
    auto report = [&](const char* name, float ms) {
      std::printf("%-10s %10zu %10.1f\n", name, mib, static_cast<double>(bytes) / (ms * 1e-3) / 1e9);
    };
    report("v4", best_ms(s, [&] { read_v4<<<blocks, threads, 0, s>>>(p4, n4, sink); }));
    CUDA_CHECK(cudaGetLastError());
    report("v4x4", best_ms(s, [&] { dev_probe::read_v4x4<<<blocks, threads, 0, s>>>(p4, n4, sink); }));
    CUDA_CHECK(cudaGetLastError());
    report("chunk", best_ms(s, [&] { read_chunk<<<blocks, threads, 0, s>>>(p4, n4, sink); }));
    CUDA_CHECK(cudaGetLastError());
    const auto* p1 = static_cast<const unsigned*>(alias);
    report("v1", best_ms(s, [&] { read_v1<<<blocks, threads, 0, s>>>(p1, bytes / 4, sink); }));
    CUDA_CHECK(cudaGetLastError());
    report("memcpyH2D",
           best_ms(s, [&] { CUDA_CHECK(cudaMemcpyAsync(dev_buf, host, bytes, cudaMemcpyHostToDevice, s)); }));
    report("memcpyD2H",
           best_ms(s, [&] { CUDA_CHECK(cudaMemcpyAsync(host, dev_buf, bytes, cudaMemcpyDeviceToHost, s)); }));
    CUDA_CHECK(cudaFree(dev_buf));
    CUDA_CHECK(cudaFreeHost(host));
  }
  small_grid_sweep(sms, sink);
  CUDA_CHECK(cudaFree(sink));
  CUDA_CHECK(cudaStreamDestroy(s));
  return 0;
}
