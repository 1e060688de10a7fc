// Probe: how fast can the decode GEMM's memory pattern go on this GPU, without any math?
// At T=1 the Qwen3-30B-A3B GEMM1 streams 8 experts x 1536 rows x 2048 nvfp4 columns (12.6 MB) and
// takes 12.6 us (1 TB/s; docs/PERF.md), while the HBM floor for those bytes is 2.75 us. This
// separates the memory system's answer from the kernel's: the same grid (96 row tiles x 8
// experts, 128 threads, 16-byte evict-first loads, 2 rounds of 4 per lane) reading the same bytes
// from experts scattered over a 2.4 GB pool (so TLB and L2 behave as in the layer benchmark), with
// the work per byte removed. Variants:
//   chain     expert id and pointer through two dependent loads (tile table -> pointer table),
//             as the GEMM does
//   direct    expert base addresses as kernel arguments: no dependent loads before the stream
//   deep8     like chain, 8 loads in flight per lane (one round)
//   wide      like chain, 8 warps per block splitting K (one round of 4 per lane)
// Each graph replays 10 launches over 10 weight sets; prints us per launch and GB/s.
// Usage: dev_probe_decode_stream   (no arguments)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "kernels/cuda_check.h"

namespace {

constexpr int kExperts = 128, kRouted = 8, kSets = 10;
constexpr int kRowTiles = 96;          // 1536 rows / 16
constexpr int kChunks = 32;            // 2048 k / 64 per 512-byte chunk
constexpr size_t kTileBytes = 512;
constexpr size_t kExpertBytes = size_t{kRowTiles} * kChunks * kTileBytes;  // 1.5 MiB

struct Ptrs {
  const uint4* base[kRouted];
};

template <int kWarps, int kDepth, bool kChain>
__global__ void stream_kernel(const int* __restrict__ tile_expert, const uint4* const* __restrict__ table,
                              Ptrs direct, unsigned* __restrict__ sink) {
  const int row_tile = blockIdx.x, tile = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint4* base;
  if constexpr (kChain) {
    const int e = tile_expert[tile];
    base = table[e];
  } else {
    base = direct.base[tile];
  }
  const uint4* w = base + static_cast<size_t>(row_tile) * kChunks * 32 + lane;
  const int c_begin = kChunks * warp / kWarps, c_end = kChunks * (warp + 1) / kWarps;
  unsigned acc = 0;
  for (int c0 = c_begin; c0 < c_end; c0 += kDepth) {
    uint4 v[kDepth];
#pragma unroll
    for (int p = 0; p < kDepth; ++p)
      if (c0 + p < c_end) v[p] = __ldcs(w + static_cast<size_t>(c0 + p) * 32);
#pragma unroll
    for (int p = 0; p < kDepth; ++p)
      if (c0 + p < c_end) acc ^= v[p].x ^ v[p].y ^ v[p].z ^ v[p].w;
  }
  if (acc == 0x12345678u) sink[0] = acc;  // keeps the loads; practically never true
}

template <int kWarps, int kDepth, bool kChain>
double time_variant(const int* const* tiles, const uint4* const* const* tables, const std::vector<Ptrs>& direct,
                    unsigned* sink) {
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kSets; ++i) {
    stream_kernel<kWarps, kDepth, kChain><<<dim3(kRowTiles, kRouted), kWarps * 32, 0, s>>>(tiles[i], tables[i],
                                                                                          direct[i], sink);
    CUDA_CHECK_LAUNCH();
  }
  CUDA_CHECK(cudaStreamEndCapture(s, &g));
  CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
  for (int i = 0; i < 3; ++i) CUDA_CHECK(cudaGraphLaunch(ge, s));
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  constexpr int kReps = 30;
  CUDA_CHECK(cudaEventRecord(e0, s));
  for (int i = 0; i < kReps; ++i) CUDA_CHECK(cudaGraphLaunch(ge, s));
  CUDA_CHECK(cudaEventRecord(e1, s));
  CUDA_CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  CUDA_CHECK(cudaGraphExecDestroy(ge));
  CUDA_CHECK(cudaGraphDestroy(g));
  CUDA_CHECK(cudaStreamDestroy(s));
  return 1e3 * ms / (kReps * kSets);
}

}  // namespace

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("no CUDA device\n");
    return 0;
  }
  // 10 sets x 128 experts x 1.5 MiB = 1.9 GiB of "weights", filled so nothing is all zeros.
  const size_t set_bytes = kExpertBytes * kExperts;
  uint8_t* pool = nullptr;
  CUDA_CHECK(cudaMalloc(&pool, set_bytes * kSets));
  CUDA_CHECK(cudaMemset(pool, 0x5A, set_bytes * kSets));
  unsigned* sink = nullptr;
  CUDA_CHECK(cudaMalloc(&sink, 4));

  std::mt19937 rng(7);
  std::vector<int*> tiles(kSets);
  std::vector<const uint4**> tables(kSets);
  std::vector<Ptrs> direct(kSets);
  for (int i = 0; i < kSets; ++i) {
    std::vector<int> all(kExperts);
    for (int e = 0; e < kExperts; ++e) all[e] = e;
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int> routed(all.begin(), all.begin() + kRouted);
    std::vector<const uint4*> table(kExperts);
    for (int e = 0; e < kExperts; ++e)
      table[e] = reinterpret_cast<const uint4*>(pool + set_bytes * i + kExpertBytes * e);
    for (int r = 0; r < kRouted; ++r) direct[i].base[r] = table[routed[r]];
    CUDA_CHECK(cudaMalloc(&tiles[i], sizeof(int) * kRouted));
    CUDA_CHECK(cudaMemcpy(tiles[i], routed.data(), sizeof(int) * kRouted, cudaMemcpyHostToDevice));
    const uint4** dt = nullptr;
    CUDA_CHECK(cudaMalloc(&dt, sizeof(void*) * kExperts));
    CUDA_CHECK(cudaMemcpy(dt, table.data(), sizeof(void*) * kExperts, cudaMemcpyHostToDevice));
    tables[i] = dt;
  }
  const double bytes = static_cast<double>(kExpertBytes) * kRouted;
  auto report = [&](const char* name, double us) {
    std::printf("%-10s %8.2f us %8.1f GB/s  (floor at 4.57 TB/s: %.2f us)\n", name, us, bytes / (us * 1e-6) / 1e9,
                bytes / 4.57e12 * 1e6);
  };
  std::printf("decode GEMM1 stream pattern: %d experts x %.1f MiB = %.1f MB per launch\n", kRouted,
              kExpertBytes / 1048576.0, bytes / 1e6);
  report("chain", time_variant<4, 4, true>(tiles.data(), tables.data(), direct, sink));
  report("direct", time_variant<4, 4, false>(tiles.data(), tables.data(), direct, sink));
  report("deep8", time_variant<4, 8, true>(tiles.data(), tables.data(), direct, sink));
  report("wide", time_variant<8, 4, true>(tiles.data(), tables.data(), direct, sink));
  for (int i = 0; i < kSets; ++i) {
    CUDA_CHECK(cudaFree(tiles[i]));
    CUDA_CHECK(cudaFree(const_cast<uint4**>(tables[i])));
  }
  CUDA_CHECK(cudaFree(pool));
  CUDA_CHECK(cudaFree(sink));
  return 0;
}
