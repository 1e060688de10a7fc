// Times whole MoE layers (router, routing, GEMM1 + SwiGLU, GEMM2, combine) on the GPU.
//
// Method: several layers with different random weights ("weight sets") are captured back to back
// in one CUDA graph, so consecutive layers touch different experts and the 60 MB L2 cannot serve
// a layer's weights from the previous replay; enough sets are used that the weights touched per
// replay exceed 200 MB. The graph is replayed `iters` times between CUDA events and the time is
// divided by replays x sets.
//
// Reported per token count T:
//   touched   experts routed to by at least one token (measured from the routing, averaged);
//             the expected value for uniform routing is E * (1 - (1 - k/E)^T)
//   MB        touched expert bytes (packed weights + scales) + router weights, per layer
//   floor     max(MB / HBM read bandwidth, flops / bf16 peak), flops = 2*T*k*3*H*I + 2*T*H*E
//   x floor   measured time / floor
// and per stage: microseconds, and the TFLOP/s of each expert GEMM on the routed pairs
// (GEMM1 2*T*k*2I*H, GEMM2 2*T*k*H*I).
#include "cli/bench_moe_cuda.h"

#ifdef MOEBIUS_HAS_CUDA

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <cstdio>
#include <memory>
#include <vector>

#include "core/log.h"
#include "cli/graph_timer.h"
#include "kernels/cuda_check.h"
#include "kernels/fill.cuh"
#include "moe/moe_layer_cuda.h"
#include "runtime/device_ceilings.h"

namespace moebius::cli {

namespace {

Result<moe::KernelFormat> parse_kernel_format(const std::string& s) {
  if (s == "bf16") return moe::KernelFormat::kBF16;
  if (s == "nvfp4") return moe::KernelFormat::kNvFp4;
  if (s == "int4") return moe::KernelFormat::kInt4;
  if (s == "int2") return moe::KernelFormat::kInt2;
  return Error::format("the CUDA backend runs bf16, nvfp4, int4 or int2 experts, not '{}'", s).in_field("--format");
}

Result<moe::MoeGemmPath> parse_gemm_path(const std::string& s) {
  if (s == "auto") return moe::MoeGemmPath::kAuto;
  if (s == "decode") return moe::MoeGemmPath::kDecode;
  if (s == "prefill") return moe::MoeGemmPath::kPrefill;
  if (s == "wgmma") return moe::MoeGemmPath::kPrefillWgmma;
  return Error::format("expected auto, decode, prefill or wgmma, not '{}'", s).in_field("--gemm-path");
}

}  // namespace

Status run_bench_moe_cuda(const BenchMoeCudaOptions& o) {
  if (!cuda_available()) return Error("no CUDA device is visible").in_field("--backend");
  MOEBIUS_ASSIGN_OR_RETURN(moe::KernelFormat format, parse_kernel_format(o.format));
  MOEBIUS_ASSIGN_OR_RETURN(moe::MoeGemmPath gemm_path, parse_gemm_path(o.gemm_path));
  const MoeGeometry& g = o.geometry;
  const cpu::MoeShape shape{g.hidden, g.intermediate, g.num_experts, g.top_k};
  MOEBIUS_ASSIGN_OR_RETURN(const runtime::DeviceCeilings ceilings, runtime::device_ceilings(o.ceilings));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("moebius bench moe  backend=cuda (%s)  geometry=%s (H=%lld I=%lld E=%d k=%d)  format=%s%s  combine=%s"
              "  gemm-path=%s\n",
              prop.name, g.name.c_str(), static_cast<long long>(g.hidden), static_cast<long long>(g.intermediate),
              g.num_experts, g.top_k, o.format.c_str(),
              (format == moe::KernelFormat::kInt4 || format == moe::KernelFormat::kInt2)
                  ? (" g=" + std::to_string(o.group_size)).c_str()
                  : "",
              o.atomic_combine ? "atomic-bf16" : "fp32-deterministic", o.gemm_path.c_str());
  std::printf("floors: HBM %.2f TB/s, bf16 %.0f TFLOP/s (%s)\n", ceilings.hbm_read_bytes_per_s / 1e12,
              ceilings.bf16_flops_per_s / 1e12, ceilings.source.c_str());
  std::printf("%7s %7s %4s %5s %10s %8s %9s %9s %9s %9s %8s\n", "tokens", "path", "bm", "sets", "us/layer", "touched", "MB",
              "GB/s", "TFLOP/s", "floor us", "x floor");

  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int64_t T : o.tokens) {
    moe::MoeCudaOptions opt;
    opt.capacity = static_cast<int>(T);
    opt.combine = o.atomic_combine ? kernels::MoeCombineMode::kAtomic : kernels::MoeCombineMode::kStore;
    opt.gemm_path = gemm_path;
    opt.block_m = o.block_m;
    opt.fuse_routing = !o.separate_routing;
    opt.fuse_experts = o.fused_experts;
    // Size the weight-set rotation from the expected touched bytes.
    const double expect_touched = g.num_experts * (1.0 - std::pow(1.0 - static_cast<double>(g.top_k) / g.num_experts,
                                                                  static_cast<double>(T)));
    std::vector<std::unique_ptr<moe::MoeLayerCuda>> sets;
    MOEBIUS_ASSIGN_OR_RETURN(auto first, moe::MoeLayerCuda::create_dummy(shape, format, o.group_size, opt, o.seed));
    const double per_layer = expect_touched * static_cast<double>(first->expert_bytes());
    const double layer_total = static_cast<double>(first->expert_bytes()) * g.num_experts;
    int n_sets = static_cast<int>(std::ceil(200e6 / std::max(per_layer, 1.0)));
    n_sets = std::clamp(n_sets, 2, 16);
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    n_sets = std::max(1, std::min(n_sets, static_cast<int>(0.6 * static_cast<double>(free_b) / layer_total)));
    sets.push_back(std::move(first));
    for (int i = 1; i < n_sets; ++i) {
      MOEBIUS_ASSIGN_OR_RETURN(auto l, moe::MoeLayerCuda::create_dummy(shape, format, o.group_size, opt, o.seed + 7919 * i));
      sets.push_back(std::move(l));
    }
    void *x = nullptr, *out = nullptr, *n = nullptr;
    CUDA_CHECK(cudaMalloc(&x, sizeof(uint16_t) * T * g.hidden));
    CUDA_CHECK(cudaMalloc(&out, sizeof(uint16_t) * T * g.hidden));
    CUDA_CHECK(cudaMalloc(&n, sizeof(int32_t)));
    kernels::launch_fill_random_bf16(x, static_cast<size_t>(T * g.hidden), 2.0f, o.seed + 5, stream);
    const int32_t nt = static_cast<int32_t>(T);
    CUDA_CHECK(cudaMemcpyAsync(n, &nt, 4, cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));

    const auto* xb = static_cast<const __nv_bfloat16*>(x);
    const auto* nd = static_cast<const int32_t*>(n);
    auto* ob = static_cast<__nv_bfloat16*>(out);
    const double us = time_graph_us(stream, o.iters, n_sets, [&] {
      for (auto& l : sets) l->forward(xb, nd, ob, stream);
    });
    // Per-stage times: each stage alone, replayed over all sets (its inputs are in place from the
    // full replays above). The stages overlap nothing in the full graph, so they add up to about
    // the layer time; the difference is the dependency latency between kernels.
    std::string stage_line;
    double stage_sum = 0, gemm1_us = 0, gemm2_us = 0, experts_us = 0;
    for (int st = 0; st < static_cast<int>(moe::MoeStage::kCount); ++st) {
      const auto stage = static_cast<moe::MoeStage>(st);
      if (!sets[0]->uses_stage(stage)) continue;
      const double sus = time_graph_us(stream, o.iters, n_sets, [&] {
        for (auto& l : sets) l->enqueue_stage(stage, xb, nd, l->topk_ids(), l->topk_weights(), ob, stream);
      });
      stage_sum += sus;
      if (stage == moe::MoeStage::kGateUp) gemm1_us = sus;
      if (stage == moe::MoeStage::kDown) gemm2_us = sus;
      if (stage == moe::MoeStage::kExpertsFused) experts_us = sus;
      stage_line += fmt::format(" {} {:.2f}", moe::moe_stage_name(stage), sus);
    }

    // Touched experts, from each set's routing of this input.
    double touched = 0;
    std::vector<int32_t> ids(static_cast<size_t>(T * g.top_k));
    for (auto& l : sets) {
      CUDA_CHECK(cudaMemcpy(ids.data(), l->topk_ids(), 4 * ids.size(), cudaMemcpyDeviceToHost));
      std::vector<char> used(static_cast<size_t>(g.num_experts), 0);
      for (int32_t id : ids)
        if (id >= 0 && id < g.num_experts) used[static_cast<size_t>(id)] = 1;
      touched += static_cast<double>(std::count(used.begin(), used.end(), 1));
    }
    touched /= n_sets;
    const double bytes = touched * static_cast<double>(sets[0]->expert_bytes()) + 2.0 * g.num_experts * g.hidden;
    const double flops = 2.0 * T * g.top_k * 3.0 * g.hidden * g.intermediate + 2.0 * T * g.hidden * g.num_experts;
    const double floor_us = 1e6 * std::max(bytes / ceilings.hbm_read_bytes_per_s, flops / ceilings.bf16_flops_per_s);
    std::printf("%7lld %7s %4d %5d %10.2f %8.1f %9.2f %9.1f %9.1f %9.2f %8.2f\n", static_cast<long long>(T),
                moe::moe_gemm_path_name(sets[0]->gemm_path()), sets[0]->block_m(), n_sets, us, touched, bytes / 1e6, bytes / (us * 1e-6) / 1e9,
                flops / (us * 1e-6) / 1e12, floor_us, us / floor_us);
    std::printf("        stages us:%s (sum %.2f)\n", stage_line.c_str(), stage_sum);
    // The output bits of set 0's forward (32-bit FNV-1a of the live rows' bf16 bytes): builds whose
    // kernels are meant to be bit-identical (an A/B of a kernel refactor) must print the same hash.
    // The atomic combine's order varies run to run, so it has none.
    if (!o.atomic_combine) {
      sets[0]->forward(xb, nd, ob, stream);
      std::vector<uint16_t> host(static_cast<size_t>(T * g.hidden));
      CUDA_CHECK(cudaMemcpyAsync(host.data(), out, sizeof(uint16_t) * host.size(), cudaMemcpyDeviceToHost, stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
      uint32_t h = 2166136261u;
      for (uint16_t v : host)
        for (int b = 0; b < 2; ++b) h = (h ^ ((v >> (8 * b)) & 0xFFu)) * 16777619u;
      std::printf("        output #%08x\n", h);
    }
    // The expert GEMMs alone, on the routed pairs only (padding rows not counted as work).
    const double pair_flops = 2.0 * T * g.top_k * g.hidden * g.intermediate;
    if (experts_us > 0)
      std::printf("        experts (fused) TFLOP/s %.1f, weight GB/s %.1f\n", 3.0 * pair_flops / (experts_us * 1e-6) / 1e12,
                  touched * static_cast<double>(sets[0]->expert_bytes()) / (experts_us * 1e-6) / 1e9);
    else
      std::printf("        gemm TFLOP/s: gemm1 %.1f  gemm2 %.1f\n", 2.0 * pair_flops / (gemm1_us * 1e-6) / 1e12,
                  pair_flops / (gemm2_us * 1e-6) / 1e12);
    std::fflush(stdout);
    CUDA_CHECK(cudaFree(x));
    CUDA_CHECK(cudaFree(out));
    CUDA_CHECK(cudaFree(n));
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
  return Ok{};
}

}  // namespace moebius::cli

#else

namespace moebius::cli {
Status run_bench_moe_cuda(const BenchMoeCudaOptions&) {
  return Error("this build of moebius has no CUDA support; use --backend cpu").in_field("--backend");
}
}  // namespace moebius::cli

#endif  // MOEBIUS_HAS_CUDA
