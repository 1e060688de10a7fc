// [TAG_CUDA_CONNECTIONS] How many hardware work queues the process's CUDA context gets.
//
// CUDA multiplexes streams onto CUDA_DEVICE_MAX_CONNECTIONS hardware queues (default 8, at most
// 32), assigned as streams are created. Two streams on one queue are ordered as if they were one:
// work enqueued on the second waits behind everything enqueued earlier on the first. That is
// harmless for streams that never wait on the host, and a deadlock for the routed-expert copies
// [TAG_EXPERT_ROUTED_DMA]: a decode graph's wait kernels spin until the copier thread's copies
// land, and copies queued behind those very kernels never start (until the wait gives up after
// 2 s; PERF.md Z38: the 235B decode failed this way where the tests and the probe, with fewer
// streams, passed). So the CLI asks for 32 queues before its first CUDA call, and the copier is
// refused with fewer.
#pragma once

namespace moebius::runtime {

inline constexpr int kCudaConnectionsWanted = 32;

// Sets CUDA_DEVICE_MAX_CONNECTIONS to kCudaConnectionsWanted unless the environment already sets
// it (the user's value wins). Takes effect only before the process's first CUDA call.
void request_cuda_connections();

// The queue count the context uses: the variable's value when it is a whole number in 1..32, else
// 8 (CUDA's default; a value this cannot read is taken as that).
int cuda_connections();

}  // namespace moebius::runtime
