// Dense BF16 GEMMs (the attention projections, the dense MLP layers and lm_head of the model
// runner): y[M, N] = x[M, K] * w[N, K]^T, bf16 inputs, fp32 accumulation, bf16 or fp32 output.
// cuBLAS stays here, out of src/kernels/ (whose launchers are our own kernels).
//
// Dispatch: M <= gemv_max_m() (default 4) with a weight of at most kGemvMaxWeightElems goes to our
// weight-streaming kernel kernels::launch_dense_gemv when it supports the shape (K a multiple of
// 8, 16-byte aligned x and w, ldx a multiple of 8, x fitting in shared memory); everything else to
// cuBLAS. Measured on the H200 (docs/PERF.md run J1, `moebius bench gemv`, Qwen3-30B-A3B): the
// GEMV wins qkv and o at M = 1 (7.3 / 6.8 us against cuBLAS 7.8 / 8.8) and their sum at M = 4
// (15.3 against 16.4), cuBLAS wins at M = 16 (16.5 against 19.0) and on the lm_head at every M
// (150 against 161-194 us). M = 5-15 was not measured. At decode the
// projections are weight streams: cuBLAS ran Qwen3-30B-A3B's qkv at 11.4 us and o at 9.1 us
// against floors of 4.6 and 3.7 (docs/PERF.md run E), and its kernels cannot overlap the previous
// kernel (ours prefetch weights under programmatic dependent launch; docs/DENSE_KERNELS.md).
//
// Graph capture: the handle gets a fixed workspace at creation (cublasSetWorkspace), so no call
// allocates, and every call sets the stream it is given; both are what cuBLAS asks of calls
// captured into a CUDA graph. Nothing here synchronizes the host.
//
// Errors from cuBLAS inside a forward are our bug (bad shapes) or a dead device: they abort with
// the call, file and line, like CUDA_CHECK.
#pragma once

#ifdef MOEBIUS_HAS_CUDA

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/error.h"
#include "core/memory.h"
#include "kernels/dense_gemv.cuh"

namespace moebius::runtime {

class DenseGemm {
 public:
  static constexpr size_t kDefaultWorkspace = size_t{32} << 20;  // cuBLAS' advice for Hopper
  static Result<std::unique_ptr<DenseGemm>> create(size_t workspace_bytes = kDefaultWorkspace);
  ~DenseGemm();
  DenseGemm(const DenseGemm&) = delete;
  DenseGemm& operator=(const DenseGemm&) = delete;

  // y[m, n] = sum_k x[m * ldx + k] * w[n * K + k]  for m < M, n < N (row-major; w is a PyTorch
  // Linear weight [N, K]); y row stride ldy (>= N). M == 0 is a no-op.
  void linear(const __nv_bfloat16* x, int64_t ldx, const __nv_bfloat16* w, int M, int N, int K, __nv_bfloat16* y,
              int64_t ldy, cudaStream_t stream);
  void linear(const __nv_bfloat16* x, int64_t ldx, const __nv_bfloat16* w, int M, int N, int K, float* y, int64_t ldy,
              cudaStream_t stream);

  // [TAG_GEMV_RMS_NORM] y = (RMSNorm(resid + delta) * weight) . w^T with the norm folded into the
  // GEMV kernel (kernels::launch_dense_gemv_rms_norm; the residual update goes to norm.resid_out).
  // Only where linear() would take the GEMV for this shape: fuses_rms_norm says so, and callers run
  // the norm kernel and linear() otherwise. Bit-identical to that pair.
  bool fuses_rms_norm(const __nv_bfloat16* w, int M, int N, int K) const;
  void linear_rms_norm(const kernels::DenseGemvRmsNorm& norm, const __nv_bfloat16* w, int M, int N, int K,
                       __nv_bfloat16* y, int64_t ldy, cudaStream_t stream);

  size_t workspace_bytes() const { return workspace_.size(); }

  // The largest M sent to the GEMV kernel (0: cuBLAS for everything; benchmarks compare the two).
  // Values above kernels::kDenseGemvMaxM are clamped to it.
  void set_gemv_max_m(int m);
  int gemv_max_m() const { return gemv_max_m_; }
  // Whether linear() with these arguments takes the GEMV kernel (tests check both paths are taken).
  bool uses_gemv(const __nv_bfloat16* x, int64_t ldx, const __nv_bfloat16* w, int M, int N, int K) const;
  // Weights larger than this (elements) go to cuBLAS at any M: the lm_head (151936 x 2048).
  static constexpr int64_t kGemvMaxWeightElems = int64_t{64} << 20;

 private:
  DenseGemm() = default;
  void gemm(const __nv_bfloat16* x, int64_t ldx, const __nv_bfloat16* w, int M, int N, int K, void* y, int64_t ldy,
            bool fp32_out, cudaStream_t stream);
  void* handle_ = nullptr;  // cublasHandle_t
  int gemv_max_m_ = 4;
  Buffer workspace_;
};

}  // namespace moebius::runtime

#endif  // MOEBIUS_HAS_CUDA
