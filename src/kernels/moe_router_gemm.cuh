// The MoE router ("mlp.gate") as a tensor-core GEMM, for prefill-sized token counts: launchers
// only (the kernel lives in moe_router_gemm.cu, which explains the tiling).
//
//   logits[t][e] = sum_h W[e][h] * x[t][h], fp32, for t < T = min(*num_tokens, capacity).
//
// The CUDA-core router (launch_moe_router_logits, moe_route.cuh) re-reads x from L2 once per
// expert; this one reads W once per token tile and x once per expert tile, and multiplies on the
// tensor cores (mma.sync m16n8k16 bf16, fp32 accumulation). The two agree to fp32 summation order,
// not bit for bit.
//
// [TAG_MOE_GRAPH_CAPACITY] T is read on the device from num_tokens (clamped to [0, capacity]); the
// grid is sized from the host `capacity`, so one captured launch replays for any T. Rows t >= T of
// logits are never written.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moebius::kernels {

// The block tiles (experts x tokens per block) the kernel is instantiated for; kAuto picks one from
// the capacity, E and the SM count (moe_router_gemm.cu). Forcing one is for tests and probes.
enum class RouterGemmTile : uint8_t { kAuto, k128x64, k128x32, k128x16, k64x16 };
const char* router_gemm_tile_name(RouterGemmTile tile);
// The tile kAuto takes for this capacity and E on the current device.
RouterGemmTile router_gemm_pick_tile(int capacity, int num_experts);

// Whether the GEMM takes these shapes: x rows 16-byte aligned (x % 16 bytes, x_stride % 8), W rows
// too (hidden % 8; W itself must be 16-byte aligned, as cudaMalloc gives), hidden >= 8 and
// num_experts >= 1 (any E: past the last 16-expert tile the rows are zero-filled).
bool moe_router_gemm_supported(const void* x, int x_stride, int hidden, int num_experts);

//   x              [capacity, x_stride] bf16; columns [hidden, x_stride) and rows >= T are never read.
//   router_weight  [E, hidden] bf16 row-major.
//   num_tokens     [1] int32, device: T.
//   capacity       host int >= 0: grid size; x and logits hold `capacity` rows.
//   logits         [capacity, E] fp32: rows [0, T) written, the rest untouched.
// Each logit is one thread's fixed-order sum: bit-identical run to run, and for a given tile
// independent of T and of the other tokens. Aborts (MOEBIUS_LAUNCH_ASSERT) on shapes that
// moe_router_gemm_supported rejects.
void launch_moe_router_gemm(const __nv_bfloat16* x, int x_stride, const __nv_bfloat16* router_weight,
                            const int32_t* num_tokens, int capacity, int hidden, int num_experts, float* logits,
                            cudaStream_t stream, RouterGemmTile tile = RouterGemmTile::kAuto);

}  // namespace moebius::kernels
