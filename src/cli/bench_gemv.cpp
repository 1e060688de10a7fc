// `moebius bench gemv`: the dense projections of decode (src/kernels/dense_gemv.cuh, dispatched by
// runtime::DenseGemm) against cuBLAS, on the geometry's shapes:
//
//   qkv      x [M, H]       -> [M, (nh + 2 nkv) hd]   bf16 out   (Qwen3-30B-A3B: 2048 -> 5120)
//   o        x [M, nh hd]   -> [M, H]                 bf16 out   (4096 -> 2048)
//   lm_head  x [M, H]       -> [M, V]                 fp32 out   (2048 -> 151936)
//
// Counted bytes: the weight (N K bf16) + x (M K bf16) + y (M N, 2 or 4 bytes). Reported: us per
// call, GB/s and the fraction of the HBM read rate (--ceilings: 4.57 TB/s on the H200, docs/PERF.md;
// measured at start on other GPUs).
// Several weight copies ("sets") rotate so that the bytes touched per graph replay exceed 200 MB
// and the 50 MB L2 cannot serve a call from the previous replay; timed by CUDA-graph replay
// between CUDA events.
//
// Columns:
//   gemv       our kernel, calls back to back in the graph: each call is launched with
//              programmatic dependent launch and prefetches its weights while the previous call
//              finishes, as it does after the RMSNorm / attention kernels in the model.
//   alone      our kernel with a tiny normally-launched kernel before every call (no overlap with
//              the previous call), that kernel's own replay time subtracted: one isolated call,
//              launch ramp and tail included.
//   cublas     runtime::DenseGemm with the GEMV off (what the runner used before), back to back.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/geometry.h"
#include "core/error.h"
#include "model/qwen3_moe_config.h"

#ifdef MOEBIUS_HAS_CUDA
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "cli/graph_timer.h"
#include "core/memory.h"
#include "kernels/cuda_check.h"
#include "kernels/dense_gemv.cuh"
#include "kernels/fill.cuh"
#include "runtime/dense_gemm.h"
#include "runtime/device_ceilings.h"
#endif

namespace moebius::cli {
namespace {

struct BenchGemvOptions {
  std::string geometry = "qwen3-30b-a3b";
  std::string shapes = "qkv,o,lm_head";
  std::string tokens = "1,4,16";
  int iters = 20;
  uint64_t seed = 1;
  std::string ceilings = "auto";  // runtime::device_ceilings
};

#ifdef MOEBIUS_HAS_CUDA

struct Shape {
  std::string name;
  int N = 0, K = 0;
  bool fp32_out = false;
};

Result<std::vector<Shape>> shapes_of(const model::Qwen3MoeConfig& c, const std::string& spec) {
  const int H = static_cast<int>(c.hidden_size), q_dim = c.num_attention_heads * c.head_dim;
  const int qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim;
  std::vector<Shape> out;
  size_t pos = 0;
  while (pos <= spec.size()) {
    const size_t comma = std::min(spec.find(',', pos), spec.size());
    const std::string name = spec.substr(pos, comma - pos);
    if (name == "qkv") out.push_back({name, qkv, H, false});
    else if (name == "o") out.push_back({name, H, q_dim, false});
    else if (name == "lm_head") out.push_back({name, static_cast<int>(c.vocab_size), H, true});
    else return Error::format("unknown shape '{}' (qkv, o, lm_head)", name).in_field("--shapes");
    pos = comma + 1;
  }
  return out;
}

Status run(const BenchGemvOptions& o) {
  if (!cuda_available()) return Error("no CUDA device is visible");
  MOEBIUS_ASSIGN_OR_RETURN(model::Qwen3MoeConfig config, model::named_qwen3_moe_config(o.geometry));
  MOEBIUS_ASSIGN_OR_RETURN(std::vector<Shape> shapes, shapes_of(config, o.shapes));
  MOEBIUS_ASSIGN_OR_RETURN(std::vector<int64_t> tokens, parse_int_list(o.tokens, "--tokens", 64));
  MOEBIUS_ASSIGN_OR_RETURN(const runtime::DeviceCeilings ceilings, runtime::device_ceilings(o.ceilings));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("moebius bench gemv  %s (%s)  y[M,N] = x[M,K] W[N,K]^T, bf16 weights; %% of %.2f TB/s (%s)\n",
              o.geometry.c_str(), prop.name, ceilings.hbm_read_bytes_per_s / 1e12, ceilings.source.c_str());
  std::printf("%-8s %3s %7s %6s %5s %9s | %8s %7s %6s | %8s %6s | %8s %7s %6s\n", "shape", "M", "N", "K", "sets", "MB",
              "gemv us", "GB/s", "of HBM", "alone us", "of HBM", "cublas us", "GB/s", "of HBM");

  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<runtime::DenseGemm> cublas, runtime::DenseGemm::create());
  cublas->set_gemv_max_m(0);
  void* barrier = nullptr;  // 16 bytes a tiny kernel fills before each isolated call
  CUDA_CHECK(cudaMalloc(&barrier, 16));

  for (const Shape& sh : shapes) {
    const size_t w_elems = static_cast<size_t>(sh.N) * sh.K;
    const double w_bytes = 2.0 * static_cast<double>(w_elems);
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    int sets = std::clamp(static_cast<int>(std::ceil(200e6 / w_bytes)), 1, 64);
    sets = static_cast<int>(std::min<double>(sets, 0.5 * static_cast<double>(free_b) / w_bytes));
    if (sets < 1) {
      std::printf("%-8s   skipped (the weight does not fit)\n", sh.name.c_str());
      continue;
    }
    void *w_raw = nullptr, *x_raw = nullptr, *y = nullptr;
    CUDA_CHECK(cudaMalloc(&w_raw, w_elems * 2 * sets));
    CUDA_CHECK(cudaMalloc(&x_raw, static_cast<size_t>(64) * sh.K * 2));
    CUDA_CHECK(cudaMalloc(&y, static_cast<size_t>(64) * sh.N * 4));
    auto* w = static_cast<__nv_bfloat16*>(w_raw);
    auto* x = static_cast<__nv_bfloat16*>(x_raw);
    kernels::launch_fill_random_bf16(w, w_elems * sets, 0.05f, o.seed, stream);
    kernels::launch_fill_random_bf16(x, static_cast<size_t>(64) * sh.K, 1.0f, o.seed + 1, stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    auto wset = [&](int i) { return w + w_elems * static_cast<size_t>(i); };

    for (int64_t m64 : tokens) {
      const int M = static_cast<int>(m64);
      const double bytes = w_bytes + 2.0 * M * sh.K + (sh.fp32_out ? 4.0 : 2.0) * M * sh.N;
      auto call = [&](runtime::DenseGemm* g, int i) {
        if (g != nullptr) {
          if (sh.fp32_out) g->linear(x, sh.K, wset(i), M, sh.N, sh.K, static_cast<float*>(y), sh.N, stream);
          else g->linear(x, sh.K, wset(i), M, sh.N, sh.K, static_cast<__nv_bfloat16*>(y), sh.N, stream);
        } else if (sh.fp32_out) {
          kernels::launch_dense_gemv(x, sh.K, wset(i), M, sh.N, sh.K, static_cast<float*>(y), sh.N, stream);
        } else {
          kernels::launch_dense_gemv(x, sh.K, wset(i), M, sh.N, sh.K, static_cast<__nv_bfloat16*>(y), sh.N, stream);
        }
      };
      const bool gemv_ok = M <= kernels::kDenseGemvMaxM && kernels::dense_gemv_supports(M, sh.K);
      double gemv_us = NAN, alone_us = NAN;
      if (gemv_ok) {
        gemv_us = time_graph_us(stream, o.iters, sets, [&] {
          for (int i = 0; i < sets; ++i) call(nullptr, i);
        });
        const double with_barrier = time_graph_us(stream, o.iters, sets, [&] {
          for (int i = 0; i < sets; ++i) {
            kernels::launch_fill_u16(barrier, 8, static_cast<uint16_t>(i), stream);
            call(nullptr, i);
          }
        });
        const double barrier_only = time_graph_us(stream, o.iters, sets, [&] {
          for (int i = 0; i < sets; ++i) kernels::launch_fill_u16(barrier, 8, static_cast<uint16_t>(i), stream);
        });
        alone_us = with_barrier - barrier_only;
      }
      call(cublas.get(), 0);  // cuBLAS picks its algorithm outside the capture
      CUDA_CHECK(cudaStreamSynchronize(stream));
      const double cublas_us = time_graph_us(stream, o.iters, sets, [&] {
        for (int i = 0; i < sets; ++i) call(cublas.get(), i);
      });
      auto gbs = [&](double us) { return bytes / (us * 1e-6) / 1e9; };
      auto pct = [&](double us) { return 100.0 * bytes / (us * 1e-6) / ceilings.hbm_read_bytes_per_s; };
      std::printf("%-8s %3d %7d %6d %5d %9.2f | %8.2f %7.0f %5.1f%% | %8.2f %5.1f%% | %8.2f %7.0f %5.1f%%\n",
                  sh.name.c_str(), M, sh.N, sh.K, sets, bytes / 1e6, gemv_us, gbs(gemv_us), pct(gemv_us), alone_us,
                  pct(alone_us), cublas_us, gbs(cublas_us), pct(cublas_us));
      std::fflush(stdout);
    }
    CUDA_CHECK(cudaFree(w));
    CUDA_CHECK(cudaFree(x));
    CUDA_CHECK(cudaFree(y));
  }
  CUDA_CHECK(cudaFree(barrier));
  CUDA_CHECK(cudaStreamDestroy(stream));
  return Ok{};
}

#else

Status run(const BenchGemvOptions&) { return Error("this build of moebius has no CUDA support"); }

#endif  // MOEBIUS_HAS_CUDA

}  // namespace

void register_bench_gemv(CLI::App& bench) {
  auto opts = std::make_shared<BenchGemvOptions>();
  CLI::App* cmd = bench.add_subcommand("gemv", "time the dense decode projections (our GEMV kernel vs cuBLAS)");
  cmd->add_option("--geometry", opts->geometry, "qwen3-30b-a3b or qwen3-235b-a22b")->capture_default_str();
  cmd->add_option("--shapes", opts->shapes, "comma-separated: qkv, o, lm_head")->capture_default_str();
  cmd->add_option("--tokens", opts->tokens, "comma-separated token counts M (1..64; the GEMV takes <= 16)")
      ->capture_default_str();
  cmd->add_option("--iters", opts->iters, "graph replays timed per configuration")->capture_default_str();
  cmd->add_option("--seed", opts->seed, "random seed")->capture_default_str();
  add_ceilings_option(cmd, &opts->ceilings);
  cmd->final_callback([opts] {
    Status s = run(*opts);
    if (!s.ok()) {
      std::fprintf(stderr, "moebius bench gemv: error: %s\n", s.error().what().c_str());
      throw CLI::RuntimeError(2);
    }
  });
}

}  // namespace moebius::cli
