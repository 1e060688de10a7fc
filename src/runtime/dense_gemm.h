// Dense BF16 GEMMs through cuBLAS (the attention projections, the dense MLP layers and lm_head of
// the model runner): y[M, N] = x[M, K] * w[N, K]^T, bf16 inputs, fp32 accumulation, bf16 or fp32
// output. cuBLAS stays here, out of src/kernels/ (whose launchers are our own kernels).
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

  size_t workspace_bytes() const { return workspace_.size(); }

 private:
  DenseGemm() = default;
  void gemm(const __nv_bfloat16* x, int64_t ldx, const __nv_bfloat16* w, int M, int N, int K, void* y, int64_t ldy,
            bool fp32_out, cudaStream_t stream);
  void* handle_ = nullptr;  // cublasHandle_t
  Buffer workspace_;
};

}  // namespace moebius::runtime

#endif  // MOEBIUS_HAS_CUDA
