// The experts of a decode-sized MoE layer in ONE persistent kernel: GEMM1 + activation, GEMM2 and
// the combine (moe_gemm.cuh's kGateUp, kDown in kStore mode, then moe_combine.cuh), for the tiles
// launch_moe_align (or the fused routing) produced. Launcher only; the kernel is in
// moe_fused_experts.cu, which explains the schedule.
//
// Why: at one to eight tokens the three kernels each wait for the one before to drain, and GEMM2
// cannot start fetching its weights until GEMM1's blocks leave the SMs, so the layer spent ~13 us
// of kernels on ~4.6 us of weight bytes (docs/PERF.md run P1, Qwen3-30B-A3B nvfp4 at T = 1: gemm1
// 7.64, gemm2 4.36, combine 1.27 us). Here every block requests its GEMM1 AND GEMM2 weights from
// the copy engine as soon as the routing is known, and only the math waits for GEMM1's results.
//
// Results are bit-identical to the three kernels (same per-warp K ranges, the same warp-order sums,
// the same combine order): tests/gpu/test_moe_fused_experts.cu checks it, and the CPU oracle.
//
// Status: correct but SLOWER than the three kernels, so the layer runs it only when asked
// (MoeCudaOptions::fuse_experts, `bench moe --expert-kernels fused`, MOEBIUS_FUSED_EXPERTS=1).
// Measured on the H200 (docs/PERF.md runs Q2-Q8, Qwen3-30B-A3B nvfp4, the experts alone):
// T = 1 16.1 us against 13.3, T = 4 39.2 against 33.4; decode 384 tok/s against 408. Its phase
// stamps (MOEBIUS_FUSED_EXPERTS_STAMPS, [TAG_FUSED_EXPERTS_STAMPS]) say where the time goes
// (moe_fused_experts.cu, last paragraph of its header).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/moe_gemm.cuh"

namespace moebius::kernels {

// Most tokens a launch may carry: the block stages every token's activation row once.
inline constexpr int kFusedExpertsMaxTokens = 8;

struct MoeFusedExpertsArgs {
  MoeWeightFormat format = MoeWeightFormat::kNvFp4;
  const ExpertMatrixPtrs* experts13 = nullptr;  // [E] [TAG_EXPERT_PTR_TABLE], device resident only
  const ExpertMatrixPtrs* experts2 = nullptr;   // [E]
  int num_experts = 0;
  MoeGemmDims dims13, dims2;
  // From launch_moe_align (padded variant) with block_m 8.
  const int32_t* padded_pair_ids = nullptr;
  const int32_t* tile_expert = nullptr;
  const int32_t* num_tiles = nullptr;  // [1] device: live tiles
  int max_tiles = 0;                   // entries of tile_expert (a bound on *num_tiles)
  int top_k = 1;
  const int32_t* num_tokens = nullptr;  // [1] device: T  [TAG_MOE_GRAPH_CAPACITY]
  int capacity = 1;
  const __nv_bfloat16* x = nullptr;  // [capacity, x_stride], rows 16-byte aligned
  int x_stride = 0;
  MoeActivationParams act;
  __nv_bfloat16* h = nullptr;  // [capacity * top_k, h_stride] scratch: GEMM1's output per pair
  int h_stride = 0;            // a multiple of 8
  const float* topk_weights = nullptr;  // [capacity * top_k]
  __nv_bfloat16* out = nullptr;         // [capacity, out_stride]: rows [0, T) written
  int out_stride = 0;
  // kFusedExpertsSyncWords zeroed words of device memory; the kernel leaves them zeroed. One set
  // per launch in flight.
  uint32_t* sync = nullptr;
};

inline constexpr int kFusedExpertsSyncWords = 2;

// Whether the kernel can run these shapes on the current device: sm_90 or newer, an nvfp4, int4 or
// int2 layer (bf16 tiles are four times larger than the ring's slots are sized for), capacity
// <= kFusedExpertsMaxTokens, block_m 8, and a shared-memory plan (x, h and y of every pair staged,
// and at least four ring slots: Qwen3-30B-A3B nvfp4 fits up to capacity 4).
// The caller also guarantees 16-byte aligned x rows and expert addresses (the bulk copies need it).
bool moe_fused_experts_supported(MoeWeightFormat format, const MoeGemmDims& dims13, const MoeGemmDims& dims2,
                                 int capacity, int block_m, int top_k, int num_experts, int max_tiles);

void launch_moe_fused_experts(const MoeFusedExpertsArgs& args, cudaStream_t stream);

}  // namespace moebius::kernels
