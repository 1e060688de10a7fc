// The host side of the routed-expert copies [TAG_EXPERT_ROUTED_DMA] (kernels/expert_dma.cuh has the
// protocol; docs/OFFLOAD.md, "Routed experts by DMA"): a thread that polls the device's post in
// mapped host memory and turns each choice into cudaMemcpyAsync calls on its own copy stream, so
// the routed cold experts move at the copy engines' rate (54-55 GB/s on every host measured)
// rather than at the rate a kernel reads mapped memory (33-51 GB/s, PERF.md Z1, Z30-Z32, Z37).
//
// Per post: the w13 arrays of every chosen slot whose w13 part is chosen, then the 4-byte copy of
// the ticket into flag13; then the w2 arrays, then flag2. The copies of one stream run in order, so
// a flag lands after the bytes it vouches for. The thread spins while posts come (a decode step
// posts one per MoE layer, ~1 ms apart when the copies dominate) and sleeps ~50 us between polls
// after 2 ms without one, so an idle server does not keep a core busy.
//
// Failure: a CUDA error in the thread, or a malformed post (a layer, count, id or part out of
// range, or a chosen part without a home in host memory), stops the serving; the device's next wait then gives up after kExpertDmaWaitNs and sets
// the failed word (as it does when the thread is merely stalled that long). From then on the
// choices choose nothing, so the layers read zero-copy again. The step that timed out computed
// with slots that may not have landed, so the runner checks health() at every step: it reports
// the failure once, naming the cause, and Ok after that.
#pragma once

#ifdef MOEBIUS_HAS_CUDA

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "kernels/expert_dma.cuh"

namespace moebius::runtime {

// One expert's four arrays at home, for copies: pinned host pointers (or device pointers); a null
// scale pointer means the format has none. All null: the expert is never copied (resident).
struct RoutedCopySource {
  const void* w13 = nullptr;
  const void* s13 = nullptr;
  const void* w2 = nullptr;
  const void* s2 = nullptr;
};

struct RoutedCopierConfig {
  int num_layers = 0;   // the post's layer index is in [0, num_layers)
  int num_experts = 0;  // its ids in [0, num_experts)
  int num_slots = 0;    // its count in [1, num_slots]
  std::vector<RoutedCopySource> sources;  // [num_layers * num_experts]
  kernels::ExpertDmaSlots slots;          // device: where slot j's arrays go
  size_t w13_bytes = 0, s13_bytes = 0, w2_bytes = 0, s2_bytes = 0;  // one expert's arrays
  // The copy stream, owned by the copier from create() on, or null to create one there. A caller
  // creates it right after the stream its kernels wait on ([TAG_CUDA_CONNECTIONS]: the driver hands
  // out hardware queues in turn as streams are created, so a stream created later could land on
  // the waiting stream's queue after 31 others).
  cudaStream_t stream = nullptr;
};

class RoutedExpertCopier {
 public:
  // Allocates the post, the flags and the copy stream on the current device and starts the thread.
  static Result<std::unique_ptr<RoutedExpertCopier>> create(RoutedCopierConfig config);
  ~RoutedExpertCopier();  // stops and joins the thread, then waits for its copies
  RoutedExpertCopier(const RoutedExpertCopier&) = delete;
  RoutedExpertCopier& operator=(const RoutedExpertCopier&) = delete;

  // What the choose and wait kernels take (device addresses).
  const kernels::ExpertDmaSignal& signal() const { return signal_; }
  // Ok, or (once) the failure: a device wait's timeout, with the thread's cause if it has one
  // (CUDA error, malformed post), else whether the thread had issued that ticket's copies (then
  // they queued behind the waits: [TAG_CUDA_CONNECTIONS]) or never picked the post up. Reads host
  // memory only (no synchronization).
  Status health() const;
  int64_t posts_served() const { return served_.load(std::memory_order_relaxed); }
  uint64_t bytes_copied() const { return bytes_.load(std::memory_order_relaxed); }

 private:
  RoutedExpertCopier() = default;
  void serve();
  // Issues the arrays of `part` for every chosen slot of `post`, then the flag copy; false (with
  // the error recorded) on a CUDA error. The post was checked: every chosen part has a home.
  bool issue(const kernels::ExpertDmaPost& post, unsigned part, unsigned ticket);
  // The first chosen slot of a well-formed post whose chosen part lacks a home array, or -1.
  int first_without_home(const kernels::ExpertDmaPost& post) const;
  void fail(std::string why);

  RoutedCopierConfig config_;
  kernels::ExpertDmaSignal signal_;
  int device_ = 0;
  kernels::ExpertDmaPost* post_ = nullptr;  // pinned, mapped: the device writes it
  unsigned* failed_ = nullptr;              // pinned, mapped: a device wait gave up
  unsigned* flag_values_ = nullptr;         // pinned [2]: the flag copies' sources
  unsigned* device_words_ = nullptr;        // device [3]: ticket, flag13, flag2
  cudaStream_t stream_ = nullptr;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> served_{0};
  std::atomic<unsigned> issued_{0};  // the last ticket whose copies and flags are all issued
  std::atomic<uint64_t> bytes_{0};
  mutable std::mutex error_mutex_;
  mutable std::atomic<bool> reported_{false};  // health() has returned the failure
  std::string error_;  // the thread's failure; empty while healthy
};

}  // namespace moebius::runtime

#endif  // MOEBIUS_HAS_CUDA
