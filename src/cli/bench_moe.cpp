// `moebius bench moe`: times one MoE layer (router, routing, experts, combine) per token count and
// reports microseconds per layer, GB/s of expert weight bytes touched, and GFLOP/s.
//
// Touched bytes: every expert routed to by at least one token is read once (packed weights plus
// scales). Flops: 2*T*k*3*H*I for the experts plus 2*T*H*E for the router.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cli/bench_moe_cuda.h"
#include "cli/commands.h"
#include "cli/geometry.h"
#include "core/dtype.h"
#include "core/log.h"
#include "cpu/moe_layer.h"
#include "formats/quant_matrix.h"

namespace moebius::cli {

namespace {

struct BenchMoeOptions {
  std::string backend = "cpu";
  std::string geometry = "1024,512,32,4";
  std::string format = "nvfp4";
  std::string tokens = "1,16,128";
  int group_size = 128;
  int iters = 0;  // 0: the backend default (cpu 3 runs, cuda 30 graph replays)
  std::string combine = "fp32";
  std::string gemm_path = "auto";
  int block_m = 0;
  std::string routing = "auto";
  std::string expert_kernels = "separate";
  std::string ceilings = "auto";
  uint64_t seed = 1;
};

Result<WeightFormat> parse_format(const std::string& s) {
  if (s == "f32") return WeightFormat::kF32;
  if (s == "bf16") return WeightFormat::kBF16;
  if (s == "nvfp4") return WeightFormat::kNvFp4;
  if (s == "int4") return WeightFormat::kInt4;
  if (s == "int2") return WeightFormat::kInt2;
  if (s == "int8") return WeightFormat::kInt8;
  return Error::format("unknown format '{}'; expected one of bf16, nvfp4, int4, int2, int8, f32", s).in_field("--format");
}

Result<QuantMatrix> random_matrix(WeightFormat fmt, int64_t rows, int64_t cols, int group_size, std::mt19937_64& rng) {
  std::vector<float> w(static_cast<size_t>(rows * cols));
  std::normal_distribution<float> dist(0.0f, 1.0f / std::sqrt(static_cast<float>(cols)));
  for (auto& v : w) v = dist(rng);
  return quantize(fmt, w.data(), rows, cols, fmt == WeightFormat::kNvFp4 ? 16 : group_size);
}

Status run_bench_moe(const BenchMoeOptions& o) {
  MOEBIUS_ASSIGN_OR_RETURN(MoeGeometry g, parse_geometry(o.geometry));
  MOEBIUS_ASSIGN_OR_RETURN(WeightFormat fmt, parse_format(o.format));
  MOEBIUS_ASSIGN_OR_RETURN(std::vector<int64_t> token_counts, parse_int_list(o.tokens, "--tokens", 1 << 16));
  if (o.backend == "cuda") {
    BenchMoeCudaOptions c;
    c.geometry = g;
    c.format = o.format;
    c.tokens = token_counts;
    c.group_size = o.group_size;
    c.iters = o.iters > 0 ? o.iters : 30;
    c.atomic_combine = o.combine == "atomic";
    c.gemm_path = o.gemm_path;
    c.block_m = o.block_m;
    if (o.routing != "auto" && o.routing != "separate")
      return Error::format("unknown routing '{}'; expected auto or separate", o.routing).in_field("--routing");
    c.separate_routing = o.routing == "separate";
    if (o.expert_kernels != "separate" && o.expert_kernels != "fused")
      return Error::format("unknown expert kernels '{}'; expected separate or fused", o.expert_kernels)
          .in_field("--expert-kernels");
    c.fused_experts = o.expert_kernels == "fused";
    c.seed = o.seed;
    c.ceilings = o.ceilings;
    return run_bench_moe_cuda(c);
  }
  if (o.combine != "fp32") return Error("the CPU backend has only the fp32 combine").in_field("--combine");
  if (o.gemm_path != "auto") return Error("the CPU backend has one expert path").in_field("--gemm-path");
  if (o.block_m != 0) return Error("the CPU backend has no GEMM tiles").in_field("--block-m");
  if (o.routing != "auto") return Error("the CPU backend has one routing path").in_field("--routing");
  if (o.ceilings != "auto") return Error("the CPU backend prints no ratio to a device ceiling").in_field("--ceilings");
  if (o.expert_kernels != "separate")
    return Error("the CPU backend has one expert path").in_field("--expert-kernels");
  if (o.backend != "cpu") return Error::format("unknown backend '{}'; expected cpu or cuda", o.backend).in_field("--backend");
  if (o.iters < 0) return Error("must be at least 1 (or 0 for the default)").in_field("--iters");
  const int iters = o.iters > 0 ? o.iters : 3;

  cpu::MoeLayerReference layer;
  layer.shape = {g.hidden, g.intermediate, g.num_experts, g.top_k};
  layer.router.num_experts = g.num_experts;
  layer.router.top_k = g.top_k;
  std::mt19937_64 rng(o.seed);
  layer.router_weight.resize(static_cast<size_t>(g.num_experts * g.hidden));
  std::normal_distribution<float> rdist(0.0f, 1.0f / std::sqrt(static_cast<float>(g.hidden)));
  for (auto& v : layer.router_weight) v = rdist(rng);

  log_info("bench moe: building {} random {} experts (H={} I={} E={} k={})", g.num_experts, o.format, g.hidden,
           g.intermediate, g.num_experts, g.top_k);
  layer.experts.reserve(static_cast<size_t>(g.num_experts));
  for (int e = 0; e < g.num_experts; ++e) {
    cpu::ExpertWeights ex;
    MOEBIUS_ASSIGN_OR_RETURN(ex.gate, random_matrix(fmt, g.intermediate, g.hidden, o.group_size, rng));
    MOEBIUS_ASSIGN_OR_RETURN(ex.up, random_matrix(fmt, g.intermediate, g.hidden, o.group_size, rng));
    MOEBIUS_ASSIGN_OR_RETURN(ex.down, random_matrix(fmt, g.hidden, g.intermediate, o.group_size, rng));
    layer.experts.push_back(std::move(ex));
  }

  std::printf("moebius bench moe  backend=%s  geometry=%s (H=%lld I=%lld E=%d k=%d)  format=%s\n", o.backend.c_str(),
              g.name.c_str(), static_cast<long long>(g.hidden), static_cast<long long>(g.intermediate), g.num_experts,
              g.top_k, o.format.c_str());
  std::printf("%8s %12s %9s %14s %10s %10s\n", "tokens", "us/layer", "experts", "weight MB", "GB/s", "GFLOP/s");
  for (int64_t T : token_counts) {
    std::vector<float> x(static_cast<size_t>(T * g.hidden)), out(static_cast<size_t>(T * g.hidden));
    std::normal_distribution<float> xdist(0.0f, 1.0f);
    for (auto& v : x) v = bf16_bits_to_float(float_to_bf16_bits(xdist(rng)));  // activations are bf16
    std::vector<int32_t> ids(static_cast<size_t>(T * g.top_k));
    std::vector<float> w(static_cast<size_t>(T * g.top_k));
    MOEBIUS_TRY(layer.forward(x.data(), T, out.data(), ids.data(), w.data()));  // warm-up
    std::vector<double> times;
    for (int it = 0; it < iters; ++it) {
      const auto t0 = std::chrono::steady_clock::now();
      MOEBIUS_TRY(layer.forward(x.data(), T, out.data(), ids.data(), w.data()));
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(times.begin(), times.end());
    const double sec = times[times.size() / 2];
    const size_t bytes = cpu::touched_weight_bytes(layer.experts, ids.data(), T, g.top_k);
    std::vector<char> used(static_cast<size_t>(g.num_experts), 0);
    for (int32_t id : ids) used[static_cast<size_t>(id)] = 1;
    const int touched = static_cast<int>(std::count(used.begin(), used.end(), 1));
    const double flops = 2.0 * T * g.top_k * 3.0 * g.hidden * g.intermediate + 2.0 * T * g.hidden * g.num_experts;
    std::printf("%8lld %12.1f %9d %14.2f %10.3f %10.2f\n", static_cast<long long>(T), sec * 1e6, touched, bytes / 1e6,
                bytes / sec / 1e9, flops / sec / 1e9);
  }
  return Ok{};
}

}  // namespace

void register_bench_moe(CLI::App& bench) {
  auto opts = std::make_shared<BenchMoeOptions>();
  CLI::App* cmd = bench.add_subcommand("moe", "time one MoE layer (routing, experts, combine)");
  cmd->add_option("--backend", opts->backend, "cpu or cuda")->capture_default_str();
  cmd->add_option("--geometry", opts->geometry, "qwen3-30b-a3b, qwen3-235b-a22b, or H,I,E,k")->capture_default_str();
  cmd->add_option("--format", opts->format, "expert weight format: bf16, nvfp4, int4, int2, int8, f32")
      ->capture_default_str();
  cmd->add_option("--tokens", opts->tokens, "comma-separated token counts")->capture_default_str();
  cmd->add_option("--group-size", opts->group_size, "group size for int formats (32, 64, 128, -1)")
      ->capture_default_str();
  cmd->add_option("--iters", opts->iters,
                  "timed repetitions per token count (cpu: median of runs, default 3; cuda: graph replays averaged, default 30)")
      ->capture_default_str();
  cmd->add_option("--seed", opts->seed, "random seed")->capture_default_str();
  cmd->add_option("--combine", opts->combine, "fp32 (deterministic) or atomic (in-kernel bf16 atomics, cuda only)")
      ->capture_default_str();
  cmd->add_option("--gemm-path", opts->gemm_path,
                  "expert GEMM kernels: auto (by tokens per expert), decode, prefill (mma.sync) or wgmma "
                  "(sm_90a; cuda only)")
      ->capture_default_str();
  cmd->add_option("--block-m", opts->block_m,
                  "tokens per GEMM tile (cuda only): 0 = the layer's choice; decode 8/16/32/64, wgmma 64/128, "
                  "prefill (mma.sync) 64, or 128 for bf16/nvfp4")
      ->capture_default_str();
  cmd->add_option("--routing", opts->routing,
                  "cuda only: auto (one fused routing kernel up to the layer's fused capacity) or separate "
                  "(router, top-k and align kernels)")
      ->capture_default_str();
  cmd->add_option("--expert-kernels", opts->expert_kernels,
                  "cuda only: separate (GEMM1, GEMM2 and combine kernels) or fused (one persistent kernel "
                  "where the layer allows it: decode, capacity <= 8, nvfp4/int4/int2, sm_90)")
      ->capture_default_str();
  add_ceilings_option(cmd, &opts->ceilings);
  cmd->final_callback([opts] {
    Status s = run_bench_moe(*opts);
    if (!s.ok()) {
      std::fprintf(stderr, "moebius bench moe: error: %s\n", s.error().what().c_str());
      throw CLI::RuntimeError(2);
    }
  });
}

}  // namespace moebius::cli
