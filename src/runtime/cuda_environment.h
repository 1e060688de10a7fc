// The CUDA environment variables the process asks for before its first CUDA call: what the
// routed-expert copies [TAG_EXPERT_ROUTED_DMA] need so that the copies a host thread issues never
// wait behind the kernels that spin until they land.
//
// [TAG_CUDA_CONNECTIONS] CUDA multiplexes streams onto CUDA_DEVICE_MAX_CONNECTIONS hardware queues
// (default 8, at most 32), assigned as streams are created; two streams on one queue are ordered
// as one. A copier stream sharing a queue with the decode graph would queue its copies behind the
// waits for them (Z39's test with 8 queues did not show such sharing, but nothing documents the
// assignment). The CLI asks for 32 always (nothing else depends on the count), and the copies are
// refused with fewer.
//
// [TAG_CUDA_EAGER_LOADING] With lazy module loading (CUDA 12's default), a kernel's first launch
// loads its module, and a load may wait for the work already running; that includes the spinning
// waits. Runs Z39-Z39b: GPU tests of the model with the copies stalled after the first post under
// lazy loading and passed with CUDA_MODULE_LOADING=EAGER. So the CLI asks for eager loading when the
// copies are asked for (it costs start-up time and a little memory for every kernel's code, which
// other runs need not pay), and the copies are refused under lazy loading.
#pragma once

namespace moebius::runtime {

inline constexpr int kCudaConnectionsWanted = 32;

// Sets CUDA_DEVICE_MAX_CONNECTIONS to kCudaConnectionsWanted unless the environment already sets
// it (the user's value wins). Takes effect only before the process's first CUDA call.
void request_cuda_connections();

// The queue count the context uses: the variable's value when it is a whole number in 1..32, else
// 8 (CUDA's default; a value this cannot read is taken as that).
int cuda_connections();

// Sets CUDA_MODULE_LOADING=EAGER unless the environment already sets it. Only before the first
// CUDA call.
void request_eager_module_loading();

// Whether the context loads every module at its creation (CUDA_MODULE_LOADING is EAGER).
bool eager_module_loading();

}  // namespace moebius::runtime
