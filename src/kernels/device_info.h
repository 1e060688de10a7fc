// Host-side facts about the current CUDA device that launchers size their grids by, queried once
// per device and cached: a driver attribute query on every launch is not free (it shows in
// decode-sized layers, where a launch is a few microseconds).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>

#include "kernels/cuda_check.h"

namespace moebius::kernels {

// One attribute of the current device, cached per device and attribute (a handful are used).
template <cudaDeviceAttr kAttr>
int current_device_attribute() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  const bool cacheable = device >= 0 && device < kMaxDevices;
  int n = cacheable ? cached[device].load(std::memory_order_relaxed) : 0;
  if (n == 0) {
    CUDA_CHECK(cudaDeviceGetAttribute(&n, kAttr, device));
    if (cacheable) cached[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

// Streaming multiprocessors of the current device.
inline int current_device_sm_count() { return current_device_attribute<cudaDevAttrMultiProcessorCount>(); }

// The most dynamic shared memory one block may opt in to (cudaFuncSetAttribute).
inline int current_device_smem_optin() {
  return current_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>();
}

// The compute capability's major number (9 on Hopper).
inline int current_device_cc_major() { return current_device_attribute<cudaDevAttrComputeCapabilityMajor>(); }

}  // namespace moebius::kernels
