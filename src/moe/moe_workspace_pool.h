// The device workspace pool of the CUDA MoE layers: MoeCudaOptions::workspace_pool. Layers whose
// workspaces have the same layout share one zeroed device block, reference-counted; a model's 48
// layers of one geometry and capacity then hold one workspace instead of 48.
// [TAG_MOE_WORKSPACE_POOL] Sharing is safe because the layers of one pool run one after another
// on one stream and each forward writes every workspace byte it reads before reading it; a pool
// must not be shared by layers that run concurrently (two streams, two engines). One reader comes
// after the forward: a deferred combine ([TAG_MOE_DEFERRED_COMBINE]) reads the GEMM2 rows and
// routed weights in the next layer's qkv GEMV, which the stream orders before any later forward
// of the pool writes them (it reads only the live rows' expert outputs, which this forward wrote).
#pragma once

#ifdef MOEBIUS_HAS_CUDA

#include <cstddef>

#include "core/error.h"
#include "core/workspace_pool.h"

namespace moebius::moe {

// cudaMalloc, then zeroed (columns of h past I are never written and must stay finite).
struct DeviceZeroAllocator {
  Result<void*> allocate(size_t bytes);
  void deallocate(void* p, size_t bytes) noexcept;
};

using MoeWorkspacePool = WorkspacePool<DeviceZeroAllocator>;

}  // namespace moebius::moe

#endif  // MOEBIUS_HAS_CUDA
