#include "parallel/host_staged_communicator.h"

#if defined(MOEBIUS_HAS_CUDA) && defined(MOEBIUS_HAS_NCCL)

#include <algorithm>
#include <cstdint>

namespace moebius::parallel {
namespace {

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Ok{};
  return Error::format("CUDA {} failed: {}", what, cudaGetErrorString(e));
}

// The bytes a send or receive layout spans: max over peers of offset + bytes (0 when none); an
// error for a region whose end does not fit size_t (it would wrap to a small extent).
Result<size_t> extent(std::span<const size_t> bytes, std::span<const size_t> offsets) {
  size_t end = 0;
  for (size_t p = 0; p < bytes.size(); ++p) {
    if (bytes[p] == 0) continue;
    if (offsets[p] > SIZE_MAX - bytes[p])
      return Error::format("a host-staged region of {} bytes at offset {} ends past the address space", bytes[p],
                           offsets[p]);
    end = std::max(end, offsets[p] + bytes[p]);
  }
  return end;
}

}  // namespace

HostStagedCommunicator::~HostStagedCommunicator() {
  if (scratch_ != nullptr) cudaFree(scratch_);
}

Result<uint8_t*> HostStagedCommunicator::scratch(size_t bytes) {
  if (bytes > kMaxBytes)
    return Error::format("a host-staged collective of {} bytes, more than the {} this communicator stages", bytes,
                         kMaxBytes);
  if (bytes <= scratch_bytes_) return scratch_;
  // Geometric growth: a run of slowly growing collectives allocates O(log) times, not every call.
  MOEBIUS_TRY(reserve(std::min(kMaxBytes, std::max(bytes, 2 * scratch_bytes_))));
  return scratch_;
}

Status HostStagedCommunicator::reserve(size_t bytes) {
  if (bytes <= scratch_bytes_) return Ok{};
  MOEBIUS_TRY(cuda_status(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"));
  if (scratch_ != nullptr) MOEBIUS_TRY(cuda_status(cudaFree(scratch_), "cudaFree"));
  scratch_ = nullptr;
  scratch_bytes_ = 0;
  void* p = nullptr;
  if (cudaError_t e = cudaMalloc(&p, bytes); e != cudaSuccess)
    return Error::format("CUDA cudaMalloc of {} MiB for the data-parallel collectives failed: {}", bytes >> 20,
                         cudaGetErrorString(e));
  scratch_ = static_cast<uint8_t*>(p);
  scratch_bytes_ = bytes;
  return Ok{};
}

Status HostStagedCommunicator::all_gather(const void* send, void* recv, size_t bytes) {
  const size_t n = static_cast<size_t>(size());
  if (bytes == 0) return Ok{};
  // The send slot plus n receive slots; checked before the multiplication can wrap.
  if (bytes > kMaxBytes / (n + 1))
    return Error::format("a host-staged all_gather of {} bytes from each of {} ranks, more than the {} this communicator "
                         "stages",
                         bytes, n, kMaxBytes);
  MOEBIUS_ASSIGN_OR_RETURN(uint8_t * d, scratch(bytes * (n + 1)));
  uint8_t* d_recv = d + bytes;
  MOEBIUS_TRY(cuda_status(cudaMemcpyAsync(d, send, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync"));
  device_.set_stream(stream_);
  MOEBIUS_TRY(device_.all_gather(d, d_recv, bytes));
  MOEBIUS_TRY(cuda_status(cudaMemcpyAsync(recv, d_recv, bytes * n, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync"));
  return cuda_status(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

Status HostStagedCommunicator::all_to_all_v(const void* send, std::span<const size_t> send_bytes,
                                            std::span<const size_t> send_offsets, void* recv,
                                            std::span<const size_t> recv_bytes,
                                            std::span<const size_t> recv_offsets) {
  const size_t n = static_cast<size_t>(size());
  if (send_bytes.size() != n || send_offsets.size() != n || recv_bytes.size() != n || recv_offsets.size() != n)
    return Error::format("all_to_all_v over {} ranks got layouts of {}/{}/{}/{} entries", n, send_bytes.size(),
                         send_offsets.size(), recv_bytes.size(), recv_offsets.size());
  MOEBIUS_ASSIGN_OR_RETURN(const size_t out, extent(send_bytes, send_offsets));
  MOEBIUS_ASSIGN_OR_RETURN(const size_t in, extent(recv_bytes, recv_offsets));
  // Either side alone past the cap is refused here, before the sums below could wrap.
  if (out > kMaxBytes || in > kMaxBytes)
    return Error::format("a host-staged collective of {} + {} bytes, more than the {} this communicator stages", out, in,
                         kMaxBytes);
  // Receives start on a 256-byte boundary after the sends (NCCL's preferred alignment).
  const size_t recv_at = (out + 255) / 256 * 256;
  MOEBIUS_ASSIGN_OR_RETURN(uint8_t * d, scratch(std::max<size_t>(1, recv_at + in)));
  // Region by region: the caller's bytes between regions are neither read nor written.
  for (size_t p = 0; p < n; ++p)
    if (send_bytes[p] > 0)
      MOEBIUS_TRY(cuda_status(cudaMemcpyAsync(d + send_offsets[p], static_cast<const uint8_t*>(send) + send_offsets[p],
                                              send_bytes[p], cudaMemcpyHostToDevice, stream_),
                              "cudaMemcpyAsync"));
  device_.set_stream(stream_);
  MOEBIUS_TRY(device_.all_to_all_v(d, send_bytes, send_offsets, d + recv_at, recv_bytes, recv_offsets));
  for (size_t p = 0; p < n; ++p)
    if (recv_bytes[p] > 0)
      MOEBIUS_TRY(cuda_status(cudaMemcpyAsync(static_cast<uint8_t*>(recv) + recv_offsets[p], d + recv_at + recv_offsets[p],
                                              recv_bytes[p], cudaMemcpyDeviceToHost, stream_),
                              "cudaMemcpyAsync"));
  return cuda_status(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

Status HostStagedCommunicator::barrier() {
  device_.set_stream(stream_);
  return device_.barrier();
}

}  // namespace moebius::parallel

#endif  // MOEBIUS_HAS_CUDA && MOEBIUS_HAS_NCCL
