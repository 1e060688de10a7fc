// Shared-memory mbarriers and the bulk copy engine (sm_90), shared by the kernels that run a
// producer/consumer ring in shared memory: the wgmma prefill GEMMs (moe_gemm_wgmma.cu) and the
// fused decode experts (moe_fused_experts.cu). Device code only; each wrapper is one PTX
// instruction (PTX ISA 8.x), so callers guard their use by __CUDA_ARCH__ >= 900.
//
// An mbarrier counts arrivals and, for the bulk copy engine, transaction bytes: a phase completes
// when both reach zero. Waiters name the phase by its parity (0, 1, 0, ...), so a ring slot's
// barrier is reused every time the ring wraps.
#pragma once

#include <cstdint>

namespace moebius::kernels {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the bulk copy engine (the async proxy) and to the
// other threads once they pass the next barrier.
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.b32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// Blocks until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile(
      "{\n"
      ".reg .b64 state;\n"
      "mbarrier.arrive.shared::cta.b64 state, [%0];\n"
      "}\n" ::"r"(bar)
      : "memory");
}

// One arrival that also expects `bytes` more transaction bytes in the current phase (the bulk
// copies that will complete on this barrier).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile(
      "{\n"
      ".reg .b64 state;\n"
      "mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n"
      "}\n" ::"r"(bar),
      "r"(bytes)
      : "memory");
}

// Arrives on the barrier when every cp.async this thread issued before has completed; the
// barrier's expected count includes this arrival (.noinc).
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// An L2 policy that marks lines evict-first: for data read exactly once (streamed weights).
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// Bulk copy of `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to this
// block's shared memory by the copy engine; its bytes complete the transaction count of `bar`.
__device__ __forceinline__ void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                              uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::"r"(
          dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}

}  // namespace moebius::kernels
