// Host-buffer collectives over an NCCL communicator, for the little control traffic that moves
// between the CUDA ranks' host code: data-parallel serving's step messages and logits rows
// (server/dp_step.h, [TAG_SERVE_DP]). NCCL only moves device memory, so each collective copies the
// send bytes into a device scratch, runs the NCCL collective on `stream`, copies the received bytes
// back and synchronizes the stream (the host acts on them next). Not for the MoE's dispatch: that
// stays on the device and in CUDA graphs (moe/moe_layer_ep_cuda.h).
//
// The scratch is sized once with reserve() from the runner's limits (a step's messages and wanted
// logits rows); a larger collective still grows it (never shrunk), and one of more than kMaxBytes
// is an error, not an allocation. Calls must not overlap the stream's capture or another thread's use of
// the same NCCL communicator (the DP protocol runs between forwards, which end in a synchronize).
#pragma once

#include "parallel/communicator.h"

#if defined(MOEBIUS_HAS_CUDA) && defined(MOEBIUS_HAS_NCCL)

#include <cuda_runtime_api.h>

#include "parallel/nccl_communicator.h"

namespace moebius::parallel {

class HostStagedCommunicator final : public Communicator {
 public:
  static constexpr size_t kMaxBytes = size_t{4} << 30;  // send + receive bytes of one collective

  // `device` must outlive this object; `stream` is the stream of its device's work (the runner's).
  HostStagedCommunicator(NcclCommunicator& device, cudaStream_t stream) : device_(device), stream_(stream) {}
  ~HostStagedCommunicator() override;
  HostStagedCommunicator(const HostStagedCommunicator&) = delete;
  HostStagedCommunicator& operator=(const HostStagedCommunicator&) = delete;

  int rank() const override { return device_.rank(); }
  int size() const override { return device_.size(); }
  bool buffers_on_device() const override { return false; }
  const char* name() const override { return "nccl (host-staged)"; }

  Status all_gather(const void* send, void* recv, size_t bytes) override;
  Status all_to_all_v(const void* send, std::span<const size_t> send_bytes, std::span<const size_t> send_offsets,
                      void* recv, std::span<const size_t> recv_bytes, std::span<const size_t> recv_offsets) override;
  Status barrier() override;
  // Allocates the scratch for collectives of up to `bytes` (send + receive) now, so later calls of
  // at most that size never allocate. Errors name the size.
  Status reserve(size_t bytes);

 private:
  // The scratch at >= bytes (cudaMalloc outside any capture).
  Result<uint8_t*> scratch(size_t bytes);

  NcclCommunicator& device_;
  cudaStream_t stream_;
  uint8_t* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
};

}  // namespace moebius::parallel

#endif  // MOEBIUS_HAS_CUDA && MOEBIUS_HAS_NCCL
