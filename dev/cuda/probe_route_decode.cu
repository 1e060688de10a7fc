// Probe: where the ~11 us of the fused decode routing (launch_moe_route_small, T = 1) goes.
// docs/PERF.md (session 3) measured the fused kernel at 11 us whatever its load pattern; this
// times, as chains of 32 dependent PDL launches in one CUDA graph (the way the layer runs), the
// fused kernel, each of its parts as a separate kernel, and empty kernels of the same launch
// shapes (one 8-block cluster of 512 threads with and without a cluster barrier; 8 plain blocks),
// so the launch/barrier cost and the work separate.
// Geometry: Qwen3-30B-A3B router (H = 2048, E = 128, k = 8), softmax, renormalised; T = 1 and 8.
// Usage: dev_probe_route_decode   (no arguments; prints a table)
// It also compiles kernels/moe_route.cu itself with MOEBIUS_ROUTE_PHASE_STAMP defined, so the fused
// kernel records clock64() at its phase boundaries (thread 0 of every block; the launchers it
// calls are this file's copy, so the kernels library's moe_route object is not linked in), and
// prints block 0's phase times of the last launch.
#include <cuda_runtime_api.h>

#include <cstdint>

namespace route_probe {
constexpr int kBlocks = 8, kPhases = 9;
__device__ unsigned long long g_clock[kBlocks][kPhases];
__device__ unsigned long long g_timer[kBlocks][kPhases];
__device__ __forceinline__ void stamp(int phase) {
  if (threadIdx.x != 0 || blockIdx.x >= kBlocks) return;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  g_clock[blockIdx.x][phase] = clock64();
  g_timer[blockIdx.x][phase] = t;
}
}  // namespace route_probe
#define MOEBIUS_ROUTE_PHASE_STAMP(i) route_probe::stamp(i)
#include "kernels/moe_route.cu"

#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "kernels/cuda_check.h"
#include "kernels/moe_route.cuh"
#include "kernels/pdl.cuh"
#include "probe_util.h"

namespace {

namespace k = moebius::kernels;  // the launchers compiled above

__global__ void empty_kernel(int* sink) {
  k::pdl_wait();
  k::pdl_launch_dependents();
  if (threadIdx.x == 1023) *sink = 0;  // never true: keeps the kernel from being empty to the compiler
}

__global__ void empty_cluster_kernel(int* sink, int do_sync) {
  namespace cg = cooperative_groups;
  k::pdl_wait();
  k::pdl_launch_dependents();
  if (do_sync) cg::this_cluster().sync();
  if (threadIdx.x == 1023) *sink = 0;
}

}  // namespace

int main() {
  if (!dev_probe::has_device()) return 0;
  constexpr int H = 2048, E = 128, K = 8, cap_max = 16, block_m = 8;
  k::RouteParams p;
  p.num_experts = E;
  p.top_k = K;
  p.scoring = k::RouteScoring::kSoftmax;
  p.renormalize = true;
  // Random inputs (never zeros: METHOD.md).
  uint32_t st = 12345;
  __nv_bfloat16* x = dev_probe::random_bf16(static_cast<size_t>(cap_max) * H, 1.0f, st);
  __nv_bfloat16* w = dev_probe::random_bf16(static_cast<size_t>(E) * H, 0.1f, st);
  const int64_t max_tiles = k::moe_align_max_tiles(cap_max, K, E, block_m);
  const int64_t max_padded = k::moe_align_max_padded(cap_max, K, E, block_m);
  float *logits, *wts;
  int32_t *ids, *off, *sorted, *poff, *pids, *texp, *ntiles, *ntok, *sink;
  CUDA_CHECK(cudaMalloc(&logits, sizeof(float) * cap_max * E));
  CUDA_CHECK(cudaMalloc(&wts, sizeof(float) * cap_max * K));
  CUDA_CHECK(cudaMalloc(&ids, sizeof(int32_t) * cap_max * K));
  CUDA_CHECK(cudaMalloc(&off, sizeof(int32_t) * (E + 1)));
  CUDA_CHECK(cudaMalloc(&sorted, sizeof(int32_t) * cap_max * K));
  CUDA_CHECK(cudaMalloc(&poff, sizeof(int32_t) * (E + 1)));
  CUDA_CHECK(cudaMalloc(&pids, sizeof(int32_t) * max_padded));
  CUDA_CHECK(cudaMalloc(&texp, sizeof(int32_t) * max_tiles));
  CUDA_CHECK(cudaMalloc(&ntiles, sizeof(int32_t)));
  CUDA_CHECK(cudaMalloc(&ntok, sizeof(int32_t)));
  CUDA_CHECK(cudaMalloc(&sink, sizeof(int32_t)));

  std::printf("%-44s %6s %10s\n", "kernel (chain of 32 PDL launches)", "T", "us/launch");
  for (int T : {1, 2, 8}) {
    CUDA_CHECK(cudaMemcpy(ntok, &T, sizeof(int), cudaMemcpyHostToDevice));
    const int cap = T;
    auto row = [&](const char* name, const std::function<void(cudaStream_t)>& f) {
      std::printf("%-44s %6d %10.2f\n", name, T, dev_probe::time_chain(f));
    };
    row("fused route_small (router+topk+align)", [&](cudaStream_t s) {
      k::launch_moe_route_small(x, H, w, H, nullptr, ntok, cap, p, block_m, logits, ids, wts, off, sorted, poff, pids,
                                texp, ntiles, s);
    });
    {
      // Phase stamps of the last fused launch of that chain: block 0's clock64 deltas.
      unsigned long long clk[route_probe::kBlocks][route_probe::kPhases], tim[route_probe::kBlocks][route_probe::kPhases];
      CUDA_CHECK(cudaMemcpyFromSymbol(clk, route_probe::g_clock, sizeof(clk)));
      CUDA_CHECK(cudaMemcpyFromSymbol(tim, route_probe::g_timer, sizeof(tim)));
      const char* block_names[] = {"start->pdl_wait done", "router GEMV (this block)", "cluster barrier",
                                   "2a scores", "2b rank", "2c renorm+publish+count", "scan+tiles", "sort ids+pad"};
      // One or two tokens: warp t of block 0 routes token t, warp 0 aligns (no block phases).
      const char* warp_names[] = {"start->pdl_wait done", "router GEMV (this block)", "cluster barrier",
                                  "logits out + route_one_token", "publish", "bar (T=2)", "-", "align in warp 0"};
      const char* const* names = T < 3 ? warp_names : block_names;
      std::printf("   fused kernel, block 0, cycles per phase (T=%d):", T);
      for (int ph = 0; ph + 1 < route_probe::kPhases; ++ph)
        std::printf(" %s %llu;", names[ph], clk[0][ph + 1] - clk[0][ph]);
      std::printf("\n   blocks' start spread (globaltimer ns):");
      for (int b = 0; b < route_probe::kBlocks; ++b)
        std::printf(" %lld/%lld", static_cast<long long>(tim[b][0] - tim[0][0]),
                    static_cast<long long>(tim[b][2] - tim[0][0]));
      std::printf("  (start/GEMV done, relative to block 0's start); block 0 end %lld ns\n",
                  static_cast<long long>(tim[0][8] - tim[0][0]));
    }
    row("router_logits (GEMV) alone", [&](cudaStream_t s) {
      k::launch_moe_router_logits(x, H, w, ntok, cap, H, E, logits, s);
    });
    row("route_topk alone (fp32 logits)", [&](cudaStream_t s) {
      k::launch_moe_route_topk(static_cast<const float*>(logits), nullptr, ntok, cap, p, ids, wts, s);
    });
    row("align alone (count + scatter)", [&](cudaStream_t s) {
      k::launch_moe_align(ids, ntok, cap, K, E, block_m, off, sorted, poff, pids, texp, ntiles, s);
    });
    row("empty: 8 blocks x 512", [&](cudaStream_t s) {
      k::launch_pdl(empty_kernel, dim3(8), dim3(512), 0, s, sink);
    });
    row("empty: cluster of 8 x 512, no barrier", [&](cudaStream_t s) {
      k::launch_pdl_cluster(empty_cluster_kernel, dim3(8), dim3(512), 0, 8, s, sink, 0);
    });
    row("empty: cluster of 8 x 512, cluster.sync", [&](cudaStream_t s) {
      k::launch_pdl_cluster(empty_cluster_kernel, dim3(8), dim3(512), 0, 8, s, sink, 1);
    });
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  return 0;
}
