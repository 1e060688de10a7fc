// `moebius bench moe --backend cuda`: the fused MoE layer timed by CUDA-graph replay.
#pragma once

#include <string>
#include <vector>

#include "cli/geometry.h"
#include "core/error.h"

namespace moebius::cli {

struct BenchMoeCudaOptions {
  MoeGeometry geometry;
  std::string format;  // bf16, nvfp4, int4, int2
  std::vector<int64_t> tokens;
  int group_size = 128;
  int iters = 50;
  bool atomic_combine = false;
  std::string gemm_path = "auto";  // auto, decode, prefill or wgmma (moe::MoeGemmPath)
  int block_m = 0;                 // tokens per GEMM tile; 0 = the layer's choice
  bool separate_routing = false;   // the three routing kernels even where the fused one applies
  bool fused_experts = false;      // the fused experts kernel where the layer allows it
  uint64_t seed = 1;
  std::string ceilings = "auto";  // runtime::device_ceilings: the floors' HBM rate and bf16 peak
};

Status run_bench_moe_cuda(const BenchMoeCudaOptions& o);

}  // namespace moebius::cli
