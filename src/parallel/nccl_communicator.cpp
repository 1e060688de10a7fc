#include "parallel/nccl_communicator.h"

#if defined(MOEBIUS_HAS_CUDA) && defined(MOEBIUS_HAS_NCCL)

#include <cstdlib>
#include <cstring>

namespace moebius::parallel {
namespace {

Status nccl_status(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return Ok{};
  return Error::format("NCCL {} failed: {} ({})", what, ncclGetErrorString(r), static_cast<int>(r));
}

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Ok{};
  return Error::format("CUDA {} failed: {}", what, cudaGetErrorString(e));
}

}  // namespace

Result<NcclId> nccl_unique_id() {
  ncclUniqueId id;
  MOEBIUS_TRY(nccl_status(ncclGetUniqueId(&id), "ncclGetUniqueId"));
  NcclId out;
  std::memcpy(out.data(), id.internal, out.size());
  return out;
}

Result<std::unique_ptr<NcclCommunicator>> NcclCommunicator::create(const NcclId& id, int rank, int size, int device) {
  if (size < 1 || rank < 0 || rank >= size) return Error::format("bad NCCL rank {} of {}", rank, size);
  int count = 0;
  MOEBIUS_TRY(cuda_status(cudaGetDeviceCount(&count), "cudaGetDeviceCount"));
  if (device < 0 || device >= count)
    return Error::format("rank {} wants CUDA device {}, this node has {} (one GPU per rank: --ep at most {})", rank,
                         device, count, count);
  MOEBIUS_TRY(cuda_status(cudaSetDevice(device), "cudaSetDevice"));
  // [TAG_NO_NVLS] NVLink SHARP / multicast stays off: the lent machines must not create multicast
  // objects (cuMulticastCreate). Overwrite: a user's NCCL_NVLS_ENABLE=1 is not honoured.
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator());
  c->rank_ = rank;
  c->size_ = size;
  c->device_ = device;
  ncclUniqueId nid;
  std::memcpy(nid.internal, id.data(), id.size());
  MOEBIUS_TRY(nccl_status(ncclCommInitRank(&c->comm_, size, nid, rank), "ncclCommInitRank"));
  MOEBIUS_TRY(cuda_status(cudaMalloc(&c->barrier_buf_, sizeof(int)), "cudaMalloc"));
  return c;
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_ != nullptr) ncclCommDestroy(comm_);
  if (barrier_buf_ != nullptr) cudaFree(barrier_buf_);
}

Status NcclCommunicator::all_gather(const void* send, void* recv, size_t bytes) {
  return nccl_status(ncclAllGather(send, recv, bytes, ncclUint8, comm_, stream_), "ncclAllGather");
}

Status NcclCommunicator::all_to_all_v(const void* send, std::span<const size_t> send_bytes,
                                      std::span<const size_t> send_offsets, void* recv,
                                      std::span<const size_t> recv_bytes, std::span<const size_t> recv_offsets) {
  const size_t n = static_cast<size_t>(size_);
  MOEBIUS_ASSERT(send_bytes.size() == n && send_offsets.size() == n && recv_bytes.size() == n &&
                 recv_offsets.size() == n);
  MOEBIUS_TRY(nccl_status(ncclGroupStart(), "ncclGroupStart"));
  Status st = Ok{};
  for (size_t p = 0; p < n && st.ok(); ++p) {
    const int peer = static_cast<int>(p);
    if (send_bytes[p] > 0)
      st = nccl_status(ncclSend(static_cast<const uint8_t*>(send) + send_offsets[p], send_bytes[p], ncclUint8, peer,
                                comm_, stream_),
                       "ncclSend");
    if (st.ok() && recv_bytes[p] > 0)
      st = nccl_status(ncclRecv(static_cast<uint8_t*>(recv) + recv_offsets[p], recv_bytes[p], ncclUint8, peer, comm_,
                                stream_),
                       "ncclRecv");
  }
  Status end = nccl_status(ncclGroupEnd(), "ncclGroupEnd");
  MOEBIUS_TRY(st);
  return end;
}

Status NcclCommunicator::barrier() {
  MOEBIUS_TRY(nccl_status(ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclInt32, ncclSum, comm_, stream_),
                          "ncclAllReduce"));
  return cuda_status(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

}  // namespace moebius::parallel

#endif  // MOEBIUS_HAS_CUDA && MOEBIUS_HAS_NCCL
