// The Communicator over NCCL, one process per GPU. Built only with CUDA and NCCL
// (MOEBIUS_HAS_NCCL); libnccl.so.2 is linked dynamically (the GPU machine has it in
// /usr/lib/x86_64-linux-gnu, CI in /usr/local/cuda/lib64).
//
// Collectives take device pointers and are enqueued on the stream given to set_stream(); they
// never synchronize the host, so a decode step that calls them with fixed sizes can be captured in
// a CUDA graph. all_to_all_v is grouped ncclSend/ncclRecv (zero-byte peers skipped); all_gather
// is ncclAllGather on bytes.
//
// NVLink multicast (NVLS) is kept off: create() sets NCCL_NVLS_ENABLE=0 before the communicator
// is initialized, and nothing in moebius calls cuMulticastCreate.
#pragma once

#include <memory>

#include "parallel/communicator.h"

#if defined(MOEBIUS_HAS_CUDA) && defined(MOEBIUS_HAS_NCCL)

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <array>

namespace moebius::parallel {

using NcclId = std::array<uint8_t, NCCL_UNIQUE_ID_BYTES>;

// ncclGetUniqueId on rank 0. NCCL's bootstrap root listens in the process that called it, so it
// must stay alive until every rank has initialized.
Result<NcclId> nccl_unique_id();

class NcclCommunicator final : public Communicator {
 public:
  // Binds `device`, sets NCCL_NVLS_ENABLE=0 and joins the group (ncclCommInitRank blocks until
  // every rank joined). Errors carry NCCL's message.
  static Result<std::unique_ptr<NcclCommunicator>> create(const NcclId& id, int rank, int size, int device);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool buffers_on_device() const override { return true; }
  const char* name() const override { return "nccl"; }
  int device() const { return device_; }

  void set_stream(cudaStream_t stream) { stream_ = stream; }
  cudaStream_t stream() const { return stream_; }

  Status all_gather(const void* send, void* recv, size_t bytes) override;
  Status all_to_all_v(const void* send, std::span<const size_t> send_bytes, std::span<const size_t> send_offsets,
                      void* recv, std::span<const size_t> recv_bytes, std::span<const size_t> recv_offsets) override;
  // A one-int all-reduce on the stream, then a stream synchronize (never inside a captured graph).
  Status barrier() override;

 private:
  NcclCommunicator() = default;
  ncclComm_t comm_ = nullptr;
  int rank_ = 0, size_ = 1, device_ = 0;
  cudaStream_t stream_ = nullptr;
  int* barrier_buf_ = nullptr;  // one device int
};

}  // namespace moebius::parallel

#endif  // MOEBIUS_HAS_CUDA && MOEBIUS_HAS_NCCL
