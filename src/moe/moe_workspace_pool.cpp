#include "moe/moe_workspace_pool.h"

#ifdef MOEBIUS_HAS_CUDA

#include <cuda_runtime_api.h>

#include "kernels/cuda_check.h"

namespace moebius::moe {

Result<void*> DeviceZeroAllocator::allocate(size_t bytes) {
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes == 0 ? 256 : bytes);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free allocation error
    return Error::format("cudaMalloc of a {:.1f} MiB MoE workspace failed: {}", static_cast<double>(bytes) / (1 << 20),
                         cudaGetErrorString(err));
  }
  CUDA_CHECK(cudaMemset(p, 0, bytes == 0 ? 256 : bytes));
  // A device memset may return before it ran, on the legacy stream, which does not order with the
  // non-blocking streams the layers run on: finish it before anyone writes the block.
  CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  return p;
}

void DeviceZeroAllocator::deallocate(void* p, size_t) noexcept {
  if (p != nullptr) (void)cudaFree(p);
}

}  // namespace moebius::moe

#endif  // MOEBIUS_HAS_CUDA
