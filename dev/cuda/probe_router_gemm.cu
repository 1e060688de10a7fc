// Probe: the router GEMM's tiles (kernels/moe_router_gemm.cu) against the small-batch router
// (launch_moe_router_logits: 16 x 8 tensor-core tiles above capacity 8, a CUDA-core GEMV before
// session 15; the "gemv" rows), to replace two guesses with numbers: router_gemm_pick_tile's rule
// and the layer's kRouterGemmMinTokens (src/moe/moe_layer_cuda.h).
// Times each as a chain of 32 dependent PDL launches in one CUDA graph (dev_probe::time_chain), so
// W and x stay in L2 between launches, as x does in the layer (the previous kernel wrote it).
// Flops 2*T*E*H; "L2 MB" is the model the kernel's header gives: 2*T*E*H * (1/BT + 1/BE) bytes.
// Checks while it runs: every tile gives the same bits, and the GEMV agrees with the GEMM to
// 2^-12 of sum |w x| (different summation orders).
// Geometries: Qwen3-30B-A3B (H = 2048, E = 128), Qwen3-235B-A22B (H = 4096, E = 128),
// DeepSeek-V3 (H = 7168, E = 256). Usage: dev_probe_router_gemm   (no arguments; prints a table)
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kernels/cuda_check.h"
#include "kernels/moe_route.cuh"
#include "kernels/moe_router_gemm.cuh"
#include "probe_util.h"

namespace {

namespace k = moebius::kernels;

struct Geometry {
  const char* name;
  int H, E;
};

int tile_experts(k::RouterGemmTile t) { return t == k::RouterGemmTile::k64x16 ? 64 : 128; }
int tile_tokens(k::RouterGemmTile t) {
  return t == k::RouterGemmTile::k128x64 ? 64 : t == k::RouterGemmTile::k128x32 ? 32 : 16;
}

std::vector<float> download(const float* d, size_t n) {
  std::vector<float> h(n);
  CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
  return h;
}

}  // namespace

int main() {
  if (!dev_probe::has_device()) return 0;
  const Geometry geos[] = {{"qwen3-30b-a3b", 2048, 128}, {"qwen3-235b-a22b", 4096, 128}, {"deepseek-v3", 7168, 256}};
  const k::RouterGemmTile tiles[] = {k::RouterGemmTile::k128x64, k::RouterGemmTile::k128x32,
                                     k::RouterGemmTile::k128x16, k::RouterGemmTile::k64x16};
  constexpr int kMaxT = 4096;
  bool ok = true;
  std::printf("%-16s %5s %-8s %10s %8s %8s   (auto = the tile router_gemm_pick_tile takes)\n", "geometry", "T",
              "kernel", "us/launch", "TFLOP/s", "L2 MB");
  for (const Geometry& g : geos) {
    // Random inputs in [-0.5, 0.5) (never zeros), W scaled by 0.1.
    uint32_t st = 12345;
    __nv_bfloat16* x = dev_probe::random_bf16(static_cast<size_t>(kMaxT) * g.H, 1.0f, st);
    __nv_bfloat16* w = dev_probe::random_bf16(static_cast<size_t>(g.E) * g.H, 0.1f, st);
    float *gemm, *gemv;
    int32_t* ntok;
    CUDA_CHECK(cudaMalloc(&gemm, sizeof(float) * kMaxT * g.E));
    CUDA_CHECK(cudaMalloc(&gemv, sizeof(float) * kMaxT * g.E));
    CUDA_CHECK(cudaMalloc(&ntok, sizeof(int32_t)));
    for (int T : {64, 128, 256, 512, 1024, 2048, 4096}) {
      CUDA_CHECK(cudaMemcpy(ntok, &T, sizeof(int), cudaMemcpyHostToDevice));
      const double flop = 2.0 * T * g.E * g.H;
      auto row = [&](const char* name, double us, double l2_mb) {
        std::printf("%-16s %5d %-8s %10.2f %8.1f %8.1f\n", g.name, T, name, us, flop / us * 1e-6, l2_mb);
      };
      const double gemv_us =
          dev_probe::time_chain([&](cudaStream_t s) { k::launch_moe_router_logits(x, g.H, w, ntok, T, g.H, g.E, gemv, s); });
      row("gemv", gemv_us, 0.0);
      const auto ref = download(gemv, static_cast<size_t>(T) * g.E);
      std::vector<float> first;
      for (k::RouterGemmTile t : tiles) {
        const double us = dev_probe::time_chain(
            [&](cudaStream_t s) { k::launch_moe_router_gemm(x, g.H, w, ntok, T, g.H, g.E, gemm, s, t); });
        const double l2 = 2.0 * T * g.E * g.H * (1.0 / tile_tokens(t) + 1.0 / tile_experts(t)) * 1e-6;
        row(k::router_gemm_tile_name(t), us, l2);
        const auto got = download(gemm, ref.size());
        if (first.empty()) {
          first = got;
          // sum |w x| <= H * 0.5 * 0.05 per logit: 2^-12 of that bounds two fp32 summation orders.
          const double tol = std::ldexp(g.H * 0.025, -12);
          for (size_t i = 0; i < ref.size(); ++i)
            if (!(std::fabs(got[i] - ref[i]) <= tol)) {
              std::printf("  MISMATCH gemm vs gemv at %zu: %g vs %g\n", i, got[i], ref[i]);
              ok = false;
              break;
            }
        } else if (std::memcmp(first.data(), got.data(), got.size() * sizeof(float)) != 0) {
          std::printf("  MISMATCH: tile %s differs from tile %s\n", k::router_gemm_tile_name(t),
                      k::router_gemm_tile_name(tiles[0]));
          ok = false;
        }
      }
      std::printf("%-16s %5d %-8s -> %s\n", g.name, T, "auto", k::router_gemm_tile_name(k::router_gemm_pick_tile(T, g.E)));
    }
    CUDA_CHECK(cudaFree(x));
    CUDA_CHECK(cudaFree(w));
    CUDA_CHECK(cudaFree(gemm));
    CUDA_CHECK(cudaFree(gemv));
    CUDA_CHECK(cudaFree(ntok));
  }
  std::printf("%s\n", ok ? "all checks passed" : "CHECKS FAILED");
  return ok ? 0 : 1;
}
