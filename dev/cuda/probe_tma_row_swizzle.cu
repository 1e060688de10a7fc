// Probe: can TMA gather token rows one at a time into a 128-byte-swizzled wgmma panel, and
// multicast them to both blocks of a 2-block cluster?
//
// Why: the wgmma GEMMs' producer copies every activation row with 16-byte cp.async, and its feed
// (~25 KB a stage from L2) contends with the tensor work (docs/PERF.md run Z4). Sharing one panel
// between the two blocks of a cluster halves the activation bytes per flop, but the rows are
// gathered (sorted pair ids), so each must be its own copy: a 2D tensor-map copy with a box of
// 64 columns x 1 row, SWIZZLE_128B, at smem offset r * 128 of a 1 KiB-aligned panel. That is
// correct only if the hardware swizzles by the destination ADDRESS (16-byte piece q of the row at
// q ^ (address bits 7-9)), not by the row's index inside the box. This probe checks both ways,
// plain (each block copies all 16 rows) and multicast (each block copies 8 rows to both blocks).
//
// Prints one line per mode: "address" (the wgmma layout: usable), "box" (no swizzle within a
// one-row box) or "neither", and exits 1 unless both modes read "address".
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "probe_util.h"
#include "kernels/mbarrier.cuh"

namespace {

constexpr int kRows = 16;       // panel rows (tokens)
constexpr int kCols = 128;      // global row length, uint16 elements
constexpr int kGlobalRows = 64;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__global__ void __cluster_dims__(2, 1, 1) gather_rows(const __grid_constant__ CUtensorMap map, const int* perm,
                                                      int multicast, uint16_t* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ __align__(1024) uint8_t panel[kRows * 128];
  __shared__ __align__(8) uint64_t bar;
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  const uint32_t b = smem_addr(&bar);
  for (int i = threadIdx.x; i < kRows * 128; i += blockDim.x) panel[i] = 0xEE;  // poison
  if (threadIdx.x == 0) {
    moebius::kernels::mbar_init(b, 1);
    moebius::kernels::mbar_fence_init();
  }
  __syncthreads();
  // Both barriers initialised before any multicast write can land in the other block.
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
  if (threadIdx.x == 0) {
    moebius::kernels::mbar_arrive_expect_tx(b, kRows * 128);
    const int r0 = multicast ? static_cast<int>(rank) * (kRows / 2) : 0;
    const int r1 = multicast ? r0 + kRows / 2 : kRows;
    for (int r = r0; r < r1; ++r) {
      const uint32_t dst = smem_addr(panel + r * 128);
      const int x = 0, y = perm[r];
      if (multicast) {
        const uint16_t mask = 0x3;
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
            " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
            "l"(&map), "r"(x), "r"(y), "r"(b), "h"(mask)
            : "memory");
      } else {
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
            " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
            "l"(&map), "r"(x), "r"(y), "r"(b)
            : "memory");
      }
    }
  }
  moebius::kernels::mbar_wait(b, 0);
  for (int i = threadIdx.x; i < kRows * 64; i += blockDim.x)
    out[rank * kRows * 64 + i] = reinterpret_cast<const uint16_t*>(panel)[i];
  // No block leaves while the other may still be writing into it.
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
  (void)map, (void)perm, (void)multicast, (void)out;
#endif
}

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

}  // namespace

int main() {
  if (!dev_probe::has_device()) return 0;
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  if (fn == nullptr) {
    std::printf("cuTensorMapEncodeTiled: not found\n");
    return 1;
  }
  std::vector<uint16_t> host(kGlobalRows * kCols);
  for (int r = 0; r < kGlobalRows; ++r)
    for (int c = 0; c < kCols; ++c) host[r * kCols + c] = static_cast<uint16_t>(r * kCols + c);
  uint16_t* g = nullptr;
  CUDA_CHECK(cudaMalloc(&g, host.size() * 2));
  CUDA_CHECK(cudaMemcpy(g, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  int perm_h[kRows];
  for (int r = 0; r < kRows; ++r) perm_h[r] = (r * 37 + 5) % kGlobalRows;  // a gather
  int* perm = nullptr;
  CUDA_CHECK(cudaMalloc(&perm, sizeof(perm_h)));
  CUDA_CHECK(cudaMemcpy(perm, perm_h, sizeof(perm_h), cudaMemcpyHostToDevice));
  uint16_t* out = nullptr;
  CUDA_CHECK(cudaMalloc(&out, 2 * kRows * 64 * 2));

  CUtensorMap map{};
  const cuuint64_t dims[2] = {kCols, kGlobalRows};
  const cuuint64_t strides[1] = {kCols * 2};
  const cuuint32_t box[2] = {64, 1};
  const cuuint32_t estr[2] = {1, 1};
  const CUresult rc = reinterpret_cast<EncodeTiled>(fn)(
      &map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, g, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (rc != CUDA_SUCCESS) {
    std::printf("cuTensorMapEncodeTiled failed: %d\n", static_cast<int>(rc));
    return 1;
  }
  bool all_address = true;
  for (int multicast = 0; multicast < 2; ++multicast) {
    CUDA_CHECK(cudaMemset(out, 0, 2 * kRows * 64 * 2));
    gather_rows<<<2, 128>>>(map, perm, multicast, out);
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint16_t> got(2 * kRows * 64);
    CUDA_CHECK(cudaMemcpy(got.data(), out, got.size() * 2, cudaMemcpyDeviceToHost));
    bool by_address = true, by_box = true;
    for (int blk = 0; blk < 2; ++blk)
      for (int r = 0; r < kRows; ++r)
        for (int piece = 0; piece < 8; ++piece)
          for (int e = 0; e < 8; ++e) {
            const uint16_t v = got[(blk * kRows + r) * 64 + piece * 8 + e];
            by_address &= v == perm_h[r] * kCols + 8 * (piece ^ (r & 7)) + e;
            by_box &= v == perm_h[r] * kCols + 8 * piece + e;
          }
    std::printf("TMA one-row boxes, SWIZZLE_128B, %s: %s\n", multicast ? "multicast to 2 blocks" : "each block",
                by_address ? "address (the wgmma layout)" : by_box ? "box (unswizzled rows)" : "neither");
    all_address &= by_address;
  }
  return all_address ? 0 : 1;
}
