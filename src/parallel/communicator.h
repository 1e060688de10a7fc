// The communicator expert parallelism runs over: a group of `size` ranks, each a GPU (NCCL) or a
// thread standing in for one on the CPU backend (in-process). Only the collectives the EP MoE
// needs, so the dispatch/combine logic is written once and tested on the CPU:
//   - all_gather: every rank's `bytes` (the per-step token counts), in rank order;
//   - all_to_all_v: rank r sends send_bytes[d] bytes from send + send_offsets[d] to each rank d
//     and receives recv_bytes[s] bytes from each rank s into recv + recv_offsets[s];
//   - barrier.
// Every rank must call the same collectives in the same order with matching sizes
// (send_bytes[d] on rank r == recv_bytes[r] on rank d); a mismatch is our bug, and the
// in-process implementation reports it as an error value on every rank rather than corrupting
// memory.
//
// Where the buffers live depends on the implementation (buffers_on_device()): host memory for the
// in-process one, device memory of the rank's GPU for NCCL, whose collectives are enqueued on the
// stream given to set_stream() and return before they complete (no host synchronization; they
// may be captured in a CUDA graph).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "core/error.h"

namespace moebius::parallel {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // True: the collectives take device pointers of this rank's GPU (NCCL). False: host pointers.
  virtual bool buffers_on_device() const = 0;
  // A name for logs ("in-process", "nccl").
  virtual const char* name() const = 0;

  // recv [size * bytes] <- every rank's send [bytes], rank r's at recv + r * bytes.
  virtual Status all_gather(const void* send, void* recv, size_t bytes) = 0;
  // See above; the spans have `size()` entries each. Zero-byte entries send or receive nothing.
  virtual Status all_to_all_v(const void* send, std::span<const size_t> send_bytes,
                              std::span<const size_t> send_offsets, void* recv, std::span<const size_t> recv_bytes,
                              std::span<const size_t> recv_offsets) = 0;
  // Returns once every rank has called it (NCCL: and the stream's work before it completed).
  virtual Status barrier() = 0;
};

// The contiguous block of experts rank `rank` of `size` owns: [begin, end), E / size each.
// [TAG_EP_EXPERT_OWNER] every place that maps an expert to its rank relies on this layout.
struct ExpertRange {
  int begin = 0;
  int end = 0;
  int count() const { return end - begin; }
};
inline int experts_per_rank(int num_experts, int size) { return num_experts / size; }
inline ExpertRange expert_range(int num_experts, int size, int rank) {
  const int per = experts_per_rank(num_experts, size);
  return {rank * per, (rank + 1) * per};
}
inline int expert_owner(int expert, int num_experts, int size) { return expert / experts_per_rank(num_experts, size); }

// An error value unless `num_experts` splits evenly over `size` ranks (a user's --ep choice).
Status check_expert_split(int num_experts, int size);

}  // namespace moebius::parallel
