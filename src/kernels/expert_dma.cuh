// Routed cold experts copied by the copy engines in offloaded decode [TAG_EXPERT_ROUTED_DMA]
// (docs/OFFLOAD.md, "Routed experts by DMA"): after a MoE layer's routing, a kernel picks the
// layer's routed cold experts, points their table entries [TAG_EXPERT_PTR_TABLE] at device slots,
// and POSTS its choice to mapped host memory. A host thread (runtime/routed_expert_copier.h) polls
// the post, issues one cudaMemcpyAsync per array on a copy stream, then a 4-byte copy of the
// post's ticket into a device flag: first for the w13 parts, then for the w2 parts. A wait kernel
// before GEMM1 spins on the w13 flag, one on a side stream before GEMM2 on the w2 flag, so the
// GEMMs read the device. A restore kernel after the layer points the entries back home. Nothing
// waits on the host: the stream waits on memory, and a CUDA graph of the step stays valid.
//
// Why the host issues the copies: the GEMMs' zero-copy reads reach ~93% of the copy rate at best
// (51.3 against 55.3 GB/s on the H200) and only ~60% on some hosts (33 GB/s), while the copy
// engines move 54-55 GB/s on all of them (PERF.md Z1, Z30-Z32); memcpy nodes in switch
// conditional nodes, chosen by the device, ran at the mapped-read rate instead (run Z37).
// The CPU reference of the choice is cpu::expert_dma_choose.
//
// What is chosen, per part: an expert is copied for a part when its table entry for that part
// points into the layer's cold region (its home in pinned memory). Resident experts point at the
// device; an expert the next-layer prefetch [TAG_EXPERT_PREFETCH] already copied points at the
// prefetch's slot. Experts are taken in order of first appearance in the live rows' top-k ids
// (row-major), up to the slot count; the rest stay zero-copy reads (a step of several rows can
// route more cold experts than there are slots). Results never change: a slot holds the bytes of
// the expert's home.
//
// The protocol, per choice with at least one slot (a choice of none posts nothing and its waits
// return at once): ticket t = the device counter + 1; the post's fields, then a system-scope
// fence, then post.seq = t. The host reads the post whole, copies, and writes t to flag13 (after
// the w13 copies) and flag2 (after the w2 copies), in stream order on its copy stream. One post
// slot is enough: the device posts t + 1 only after GEMM2 of t, which waited for flag2 = t, which
// the host copied after it had read post t. A wait gives up after kExpertDmaWaitNs, sets *failed
// (mapped host memory, so the runner sees it without a sync) and every later wait returns at once,
// and every later choice chooses nothing (zero-copy reads again): a stalled or dead host thread
// becomes one error the runner reports for the step it spoiled, never a hung stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/moe_gemm.cuh"

namespace moebius::kernels {

inline constexpr int kExpertDmaMaxSlots = 16;  // experts a MoE layer copies per step
inline constexpr int kExpertDmaMaxIds = 512;   // live rows x top-k the choice reads (one block)

// Parts of an expert: the w13 arrays (weights and scales) and the w2 arrays.
inline constexpr unsigned kExpertDmaPart13 = 1u, kExpertDmaPart2 = 2u;

// How long a wait spins for the host's flag before it reports a failure (the host thread polls
// continuously during decode; a round trip is microseconds).
inline constexpr unsigned long long kExpertDmaWaitNs = 2000000000ull;

// The device's post to the host thread (mapped pinned host memory, three 64-byte lines). seq is
// written last, after a system-scope fence.
struct alignas(64) ExpertDmaPost {
  unsigned seq = 0;  // the ticket
  int layer = 0;     // the MoE layer index the runner gave the choice
  int count = 0;
  int ids[kExpertDmaMaxSlots] = {};
  unsigned parts[kExpertDmaMaxSlots] = {};
};

// Where a choice posts and what its waits read.
struct ExpertDmaSignal {
  ExpertDmaPost* post = nullptr;   // device alias of the mapped post
  unsigned* ticket = nullptr;      // device: the last ticket posted (zeroed at setup)
  const unsigned* flag13 = nullptr;  // device: the last ticket whose w13 copies landed
  const unsigned* flag2 = nullptr;   // device: ... whose w2 copies landed
  unsigned* failed = nullptr;      // device alias of a mapped word: the ticket a wait gave up on (0: none)
};

// The slots' state (device memory, zeroed by the caller): whose entries point into the slots, which
// parts, and what the entries held before.
struct ExpertDmaRecord {
  ExpertMatrixPtrs* table13 = nullptr;
  ExpertMatrixPtrs* table2 = nullptr;
  int count = 0;
  unsigned ticket = 0;  // the post's, when count > 0
  int ids[kExpertDmaMaxSlots] = {};
  unsigned parts[kExpertDmaMaxSlots] = {};  // kExpertDmaPart13 | kExpertDmaPart2
  ExpertMatrixPtrs saved13[kExpertDmaMaxSlots] = {};
  ExpertMatrixPtrs saved2[kExpertDmaMaxSlots] = {};
};

// Slot i's arrays: base + i * stride, then w13 weights at 0, w13 scales at off_s13, w2 weights at
// off_w2, w2 scales at off_s2 (the layout of kernels::ExpertPrefetchSlots, one whole expert).
struct ExpertDmaSlots {
  uint8_t* base = nullptr;
  size_t stride = 0;
  size_t off_s13 = 0, off_w2 = 0, off_s2 = 0;
};

// A layer's cold region as the kernels see it (device aliases): an entry whose weight pointer lies
// in [w13_begin, w13_end) (w2: [w2_begin, w2_end)) points home.
struct ExpertDmaHome {
  const uint8_t* w13_begin = nullptr;
  const uint8_t* w13_end = nullptr;
  const uint8_t* w2_begin = nullptr;
  const uint8_t* w2_end = nullptr;
};

struct ExpertDmaChooseArgs {
  const int32_t* topk_ids = nullptr;    // [capacity, top_k] device
  const int32_t* num_tokens = nullptr;  // [1] device: live rows [TAG_MOE_GRAPH_CAPACITY]
  int capacity = 0;                     // capacity * top_k <= kExpertDmaMaxIds
  int top_k = 0;
  int num_experts = 0;                  // ids outside [0, num_experts) are ignored
  ExpertMatrixPtrs* table13 = nullptr;  // [num_experts] the layer's tables
  ExpertMatrixPtrs* table2 = nullptr;
  ExpertDmaHome home;
  ExpertDmaSlots slots;
  int num_slots = 0;                    // <= kExpertDmaMaxSlots
  int layer = 0;                        // copied into the post (the host's source table row)
  ExpertDmaSignal signal;
  ExpertDmaRecord* record = nullptr;    // empty (count 0) on entry: the runner restores after each layer
};

// The choice, the record, the table entries pointed at the slots (global scales kept) and the
// post (one block; no copy).
void launch_expert_dma_choose(const ExpertDmaChooseArgs& args, cudaStream_t stream);

// Waits (one thread) until the host's flag for the record's choice reads its ticket (part:
// kExpertDmaPart13 or kExpertDmaPart2, which flag); at once when the choice is empty or a wait has
// failed before.
void launch_expert_dma_wait(const ExpertDmaRecord* record, const ExpertDmaSignal& signal, unsigned part,
                            cudaStream_t stream);

// The record's entries back to what they held, only the parts it changed; the record emptied.
void launch_expert_dma_restore(ExpertDmaRecord* record, cudaStream_t stream);

}  // namespace moebius::kernels
