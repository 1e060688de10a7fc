// Routed cold experts by the copy engines [TAG_EXPERT_ROUTED_DMA]; launchers and protocol in
// expert_dma.cuh, CPU reference cpu/expert_dma.cpp.
//
// Choose: one block, a thread per (row, k) id (T x k <= 512; decode steps have T <= 8, so <= 64).
// The order of first appearance comes from an atomicMin of the position per expert in shared
// memory; a first appearance whose entries point home in either part is a candidate, and its rank
// among candidates (a block prefix count: warp ballots, then the warps' totals) is its slot. So the
// choice is deterministic and exactly the CPU reference's. It is a latency chain on the step's
// critical path between the routing and the copies (a few shared-memory rounds and one dependent
// read of the table entries), not a bandwidth problem. Its post to the host is ~150 bytes of
// PCIe writes by one thread after the block's barrier.
//
// Wait: one thread spinning on a device word that a copy engine writes (ld.acquire.gpu, so the
// slot bytes the earlier copies of the same copy stream wrote are visible to the GEMM launched
// after the wait: a kernel boundary, and the copies completed before the flag's copy began).
#include "kernels/expert_dma.cuh"

#include <climits>
#include <vector>

#include "kernels/cuda_check.h"

namespace moebius::kernels {
namespace {

constexpr int kChooseThreads = kExpertDmaMaxIds;
constexpr int kChooseWarps = kChooseThreads / 32;
constexpr int kMaxExperts = 1024;  // the first-appearance table in shared memory

__device__ __forceinline__ bool points_home(const void* p, const uint8_t* begin, const uint8_t* end) {
  const uint8_t* q = static_cast<const uint8_t*>(p);
  return q >= begin && q < end;
}

__global__ void __launch_bounds__(kChooseThreads) expert_dma_choose_kernel(const ExpertDmaChooseArgs a) {
  __shared__ int first[kMaxExperts];
  __shared__ int warp_count[kChooseWarps];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int e = tid; e < a.num_experts; e += kChooseThreads) first[e] = INT_MAX;
  const int rows = min(max(*a.num_tokens, 0), a.capacity);
  const int n = rows * a.top_k;
  __syncthreads();
  const int e = tid < n ? a.topk_ids[tid] : -1;
  const bool valid = e >= 0 && e < a.num_experts;
  if (valid) atomicMin(&first[e], tid);
  __syncthreads();
  unsigned parts = 0;
  ExpertMatrixPtrs s13, s2;
  if (valid && first[e] == tid) {
    s13 = a.table13[e];
    s2 = a.table2[e];
    if (points_home(s13.weight, a.home.w13_begin, a.home.w13_end)) parts |= kExpertDmaPart13;
    if (points_home(s2.weight, a.home.w2_begin, a.home.w2_end)) parts |= kExpertDmaPart2;
  }
  // Rank among the candidates in position order.
  const unsigned ballot = __ballot_sync(0xffffffffu, parts != 0);
  if (lane == 0) warp_count[warp] = __popc(ballot);
  __syncthreads();
  int rank = __popc(ballot & ((1u << lane) - 1u)), total = 0;
  for (int w = 0; w < kChooseWarps; ++w) {
    if (w < warp) rank += warp_count[w];
    total += warp_count[w];
  }
  // After a failed wait (the host thread stalled or died) the layer chooses nothing: its experts
  // stay zero-copy reads, so later steps are right again while the runner reports the failure.
  const bool failed = *reinterpret_cast<volatile const unsigned*>(a.signal.failed) != 0;
  const int chosen = failed ? 0 : min(total, a.num_slots);
  ExpertDmaRecord& r = *a.record;
  if (parts != 0 && rank < chosen) {
    uint8_t* slot = a.slots.base + static_cast<size_t>(rank) * a.slots.stride;
    r.ids[rank] = e;
    r.parts[rank] = parts;
    r.saved13[rank] = s13;
    r.saved2[rank] = s2;
    if (parts & kExpertDmaPart13) {
      ExpertMatrixPtrs p = s13;
      p.weight = slot;
      p.scales = s13.scales ? slot + a.slots.off_s13 : nullptr;
      a.table13[e] = p;
    }
    if (parts & kExpertDmaPart2) {
      ExpertMatrixPtrs p = s2;
      p.weight = slot + a.slots.off_w2;
      p.scales = s2.scales ? slot + a.slots.off_s2 : nullptr;
      a.table2[e] = p;
    }
  }
  __syncthreads();  // the record's ids and parts, written above, are read by thread 0 below
  if (tid == 0) {
    r.table13 = a.table13;
    r.table2 = a.table2;
    r.count = chosen;
    if (chosen > 0) {
      const unsigned t = *a.signal.ticket + 1;
      *a.signal.ticket = t;
      r.ticket = t;
      ExpertDmaPost* post = a.signal.post;
      post->layer = a.layer;
      post->count = chosen;
      for (int j = 0; j < chosen; ++j) {
        post->ids[j] = r.ids[j];
        post->parts[j] = r.parts[j];
      }
      // The fields reach host memory before seq does: the host reads them only after it saw seq.
      __threadfence_system();
      asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(&post->seq), "r"(t) : "memory");
    }
  }
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void expert_dma_wait_kernel(const ExpertDmaRecord* rec, const unsigned* flag, unsigned* failed) {
  if (rec->count == 0) return;
  volatile unsigned* fail = failed;
  if (*fail != 0) return;
  const unsigned want = rec->ticket;
  const unsigned long long start = global_ns();
  for (;;) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
    // Tickets grow by one per posted choice (wrapping after 2^32): a flag at or past ours is done.
    if (static_cast<int>(v - want) >= 0) return;
    if (global_ns() - start > kExpertDmaWaitNs) {
      *fail = want != 0u ? want : 1u;  // the ticket given up on (nonzero), for the runner's message
      __threadfence_system();
      return;
    }
  }
}

__global__ void expert_dma_restore_kernel(ExpertDmaRecord* rec) {
  const int i = threadIdx.x;
  if (i < min(rec->count, kExpertDmaMaxSlots)) {
    if (rec->parts[i] & kExpertDmaPart13) rec->table13[rec->ids[i]] = rec->saved13[i];
    if (rec->parts[i] & kExpertDmaPart2) rec->table2[rec->ids[i]] = rec->saved2[i];
  }
  __syncthreads();
  if (i == 0) rec->count = 0;
}

}  // namespace

void launch_expert_dma_choose(const ExpertDmaChooseArgs& a, cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(a.topk_ids && a.num_tokens && a.table13 && a.table2 && a.record && a.slots.base,
                        "expert dma choose: null argument");
  MOEBIUS_LAUNCH_ASSERT(a.signal.post && a.signal.ticket && a.signal.failed, "expert dma choose: null signal");
  MOEBIUS_LAUNCH_ASSERT(a.capacity > 0 && a.top_k > 0 && a.capacity * a.top_k <= kExpertDmaMaxIds,
                        "expert dma choose: capacity x top_k out of range");
  MOEBIUS_LAUNCH_ASSERT(a.num_experts > 0 && a.num_experts <= kMaxExperts, "expert dma choose: num_experts out of range");
  MOEBIUS_LAUNCH_ASSERT(a.num_slots > 0 && a.num_slots <= kExpertDmaMaxSlots, "expert dma choose: slots out of range");
  expert_dma_choose_kernel<<<1, kChooseThreads, 0, stream>>>(a);
  CUDA_CHECK_LAUNCH();
}

void launch_expert_dma_wait(const ExpertDmaRecord* record, const ExpertDmaSignal& signal, unsigned part,
                            cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(record && signal.flag13 && signal.flag2 && signal.failed, "expert dma wait: null argument");
  MOEBIUS_LAUNCH_ASSERT(part == kExpertDmaPart13 || part == kExpertDmaPart2, "expert dma wait: part 13 or 2");
  expert_dma_wait_kernel<<<1, 1, 0, stream>>>(record, part == kExpertDmaPart13 ? signal.flag13 : signal.flag2,
                                              signal.failed);
  CUDA_CHECK_LAUNCH();
}

void launch_expert_dma_restore(ExpertDmaRecord* record, cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(record != nullptr, "expert dma restore: null argument");
  expert_dma_restore_kernel<<<1, 32, 0, stream>>>(record);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moebius::kernels
