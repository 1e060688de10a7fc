// Next-layer expert prefetch for offloaded decode [TAG_EXPERT_PREFETCH] (docs/OFFLOAD.md,
// "Prefetch"): three launchers that predict which cold experts the next MoE layer will route to,
// copy them from pinned host memory into device slots, and point that layer's address tables
// [TAG_EXPERT_PTR_TABLE] at the copies. The CPU reference of the prediction is
// cpu/expert_prefetch.h; the kernels are in expert_prefetch.cu, which explains the schedule.
//
// Why: a zero-copy decode step reads the routed cold experts over PCIe inside the MoE GEMMs, and
// between two MoE layers (attention, the dense GEMVs: ~15% of an offloaded Qwen3-235B step) the
// link sits idle, because the next layer's experts are not known before its routing (docs/PERF.md
// run Z9c: 82% of the copy rate over the step, ~96% while the reads run). A copy issued right
// after layer j's MoE, of the experts layer j' is predicted to need, fills that gap; a right
// guess is a device read in j''s GEMMs, a wrong one costs its PCIe bytes and nothing else.
//
// Protocol per prefetch (the model runner, model/qwen3_moe_cuda_prefetch.h, one slot set):
//   main stream: ... layer j's MoE -> launch_expert_prefetch_predict (puts the slots' previous
//                owner's table entries back home, writes the record) -> event
//   copy stream: wait event -> launch_expert_prefetch_copy -> launch_expert_prefetch_publish -> event
//   main stream: ... attention of j' ... wait event -> layer j''s MoE (reads the slots)
// Results never change: a slot holds the same bytes as the expert's home in host memory, and the
// tables point at a slot only between publish and the set's next predict, which the runner orders
// after every reader. Everything is captured in the decode CUDA graphs; no host synchronization.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/moe_gemm.cuh"

namespace moebius::kernels {

inline constexpr int kExpertPrefetchMaxSlots = 8;      // experts copied ahead per MoE layer
inline constexpr int kExpertPrefetchMaxTokens = 8;     // rows the predictor ranks (decode steps)
inline constexpr int kExpertPrefetchMaxExperts = 512;  // the selection's logits in shared memory

// One slot set's state (device memory, zero-initialised by the caller): whose table entries point
// into the set's slots now, and what they held before.
struct ExpertPrefetchRecord {
  ExpertMatrixPtrs* table13 = nullptr;  // the owner layer's tables; table2 null: no owner, table13
  ExpertMatrixPtrs* table2 = nullptr;   // null (with table2 set): a down-only prefetch
  int count = 0;                        // experts in the slots
  int ids[kExpertPrefetchMaxSlots] = {};
  ExpertMatrixPtrs saved13[kExpertPrefetchMaxSlots] = {};  // the entries before publish (the homes)
  ExpertMatrixPtrs saved2[kExpertPrefetchMaxSlots] = {};
};

// Where slot i of a set keeps an expert's four arrays: base + i * stride, then w13 weights at 0,
// w13 scales at off_s13, w2 weights at off_w2, w2 scales at off_s2 (the region layout of one
// expert, moe::expert_region_bytes(.., 1)). Byte counts per array of one expert.
struct ExpertPrefetchSlots {
  uint8_t* base = nullptr;  // 256-byte aligned
  size_t stride = 0;        // a multiple of 256
  size_t off_s13 = 0, off_w2 = 0, off_s2 = 0;
  size_t w13_bytes = 0, s13_bytes = 0, w2_bytes = 0, s2_bytes = 0;
};
// The slots at `base` for experts of these array sizes, each array 256-byte aligned.
inline ExpertPrefetchSlots expert_prefetch_slots(uint8_t* base, size_t w13_bytes, size_t s13_bytes, size_t w2_bytes,
                                                 size_t s2_bytes) {
  auto a256 = [](size_t n) { return (n + 255) / 256 * 256; };
  ExpertPrefetchSlots s;
  s.base = base;
  s.w13_bytes = w13_bytes;
  s.s13_bytes = s13_bytes;
  s.w2_bytes = w2_bytes;
  s.s2_bytes = s2_bytes;
  s.off_s13 = a256(w13_bytes);
  s.off_w2 = s.off_s13 + a256(s13_bytes);
  s.off_s2 = s.off_w2 + a256(w2_bytes);
  s.stride = s.off_s2 + a256(s2_bytes);
  return s;
}

struct ExpertPrefetchPredictArgs {
  const float* resid = nullptr;          // [capacity, hidden] fp32: the residual stream after layer j's attention
  const __nv_bfloat16* delta = nullptr;  // [capacity, hidden] bf16 added to it (layer j's MoE output), or null
  const float* norm_weight = nullptr;    // [hidden] layer j''s post-attention RMSNorm weight
  float eps = 1e-6f;
  const __nv_bfloat16* router = nullptr;   // [num_experts, hidden] layer j''s router
  const float* correction_bias = nullptr;  // [num_experts] or null
  const uint8_t* cold = nullptr;           // [num_experts] 1: layer j''s expert lives in host memory
  int hidden = 0;                          // a multiple of 8 (16-byte rows)
  int num_experts = 0;                     // <= kExpertPrefetchMaxExperts
  int top_k = 0;
  const int32_t* num_tokens = nullptr;     // [1] device: live rows T [TAG_MOE_GRAPH_CAPACITY]
  int capacity = 0;                        // <= kExpertPrefetchMaxTokens
  int slots = 0;                           // experts to copy ahead, <= kExpertPrefetchMaxSlots
  ExpertMatrixPtrs* table13 = nullptr;     // [num_experts] layer j''s address tables (device); table13
  ExpertMatrixPtrs* table2 = nullptr;      // null: copy and publish only the down projections (w2)
  ExpertPrefetchRecord* record = nullptr;  // the slot set's record
  float* logits = nullptr;                 // [kExpertPrefetchMaxTokens, num_experts] scratch
  unsigned* counter = nullptr;             // [1] zeroed; the kernel leaves it zeroed
  int32_t* log = nullptr;                  // [1 + kExpertPrefetchMaxSlots] count, ids (statistics), or null
};

// The prediction and selection (cpu::expert_prefetch_logits / _select), then the record: the
// previous owner's entries restored, the new owner's current entries saved. Writes no table entry
// of the new owner (publish does, after the copy).
void launch_expert_prefetch_predict(const ExpertPrefetchPredictArgs& args, cudaStream_t stream);

// The record's experts from their saved homes into the slots (any mix of device and mapped pinned
// host sources). `blocks` copy blocks (the copy competes with the main stream's kernels for SMs) at
// launch priority `priority` (cudaDeviceGetStreamPriorityRange: 0 is the default, lower is sooner).
void launch_expert_prefetch_copy(const ExpertPrefetchRecord* record, const ExpertPrefetchSlots& slots, int blocks,
                                 int priority, cudaStream_t stream);

// The record's table entries pointed at the slots (global scales kept).
void launch_expert_prefetch_publish(const ExpertPrefetchRecord* record, const ExpertPrefetchSlots& slots,
                                    cudaStream_t stream);

// The record's owner's entries restored and the record emptied (before a weight update, or at
// teardown of a run that prefetched).
void launch_expert_prefetch_restore(ExpertPrefetchRecord* record, cudaStream_t stream);

}  // namespace moebius::kernels
