#include "runtime/dense_gemm.h"

#ifdef MOEBIUS_HAS_CUDA

#include <cublas_v2.h>

#include <cstdio>
#include <cstdlib>

#include "kernels/cuda_check.h"
#include "kernels/dense_gemv.cuh"

namespace moebius::runtime {
namespace {

[[noreturn]] void cublas_fail(const char* expr, cublasStatus_t st, const char* file, int line) {
  std::fprintf(stderr, "moebius: cuBLAS error at %s:%d: '%s' failed: %s (%d)\n", file, line, expr,
               cublasGetStatusString(st), static_cast<int>(st));
  std::abort();
}

#define CUBLAS_CHECK(expr)                                                    \
  do {                                                                        \
    const cublasStatus_t moebius_cublas_st_ = (expr);                         \
    if (moebius_cublas_st_ != CUBLAS_STATUS_SUCCESS)                          \
      cublas_fail(#expr, moebius_cublas_st_, __FILE__, __LINE__);             \
  } while (0)

}  // namespace

Result<std::unique_ptr<DenseGemm>> DenseGemm::create(size_t workspace_bytes) {
  std::unique_ptr<DenseGemm> g(new DenseGemm());
  cublasHandle_t h = nullptr;
  const cublasStatus_t st = cublasCreate(&h);
  if (st != CUBLAS_STATUS_SUCCESS)
    return Error::format("cublasCreate failed: {} ({})", cublasGetStatusString(st), static_cast<int>(st));
  g->handle_ = h;
  MOEBIUS_ASSIGN_OR_RETURN(g->workspace_, Buffer::allocate(MemoryKind::kDevice, workspace_bytes));
  CUBLAS_CHECK(cublasSetWorkspace(h, g->workspace_.data(), g->workspace_.size()));
  // Tensor-core math with fp32 accumulation is what CUBLAS_COMPUTE_32F asks for on bf16 inputs;
  // no reduced-precision reductions.
  CUBLAS_CHECK(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
  return g;
}

DenseGemm::~DenseGemm() {
  if (handle_ != nullptr) (void)cublasDestroy(static_cast<cublasHandle_t>(handle_));
}

void DenseGemm::set_gemv_max_m(int m) { gemv_max_m_ = m < 0 ? 0 : (m > kernels::kDenseGemvMaxM ? kernels::kDenseGemvMaxM : m); }

bool DenseGemm::uses_gemv(const __nv_bfloat16* x, int64_t ldx, const __nv_bfloat16* w, int M, int N,
                          int K) const {
  return M >= 1 && M <= gemv_max_m_ && static_cast<int64_t>(N) * K <= kGemvMaxWeightElems && ldx % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(w) % 16 == 0 && kernels::dense_gemv_supports(M, K);
}

bool DenseGemm::fuses_rms_norm(const __nv_bfloat16* w, int M, int N, int K) const {
  return M >= 1 && M <= gemv_max_m_ && static_cast<int64_t>(N) * K <= kGemvMaxWeightElems &&
         reinterpret_cast<uintptr_t>(w) % 16 == 0 && kernels::dense_gemv_supports(M, K);
}

void DenseGemm::linear_rms_norm(const kernels::DenseGemvRmsNorm& norm, const __nv_bfloat16* w, int M, int N, int K,
                                __nv_bfloat16* y, int64_t ldy, cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(fuses_rms_norm(w, M, N, K), "linear_rms_norm: the shape does not take the GEMV kernel");
  kernels::launch_dense_gemv_rms_norm(norm, w, M, N, K, y, ldy, stream);
}

void DenseGemm::gemm(const __nv_bfloat16* x, int64_t ldx, const __nv_bfloat16* w, int M, int N, int K, void* y,
                     int64_t ldy, bool fp32_out, cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(M >= 0 && N > 0 && K > 0 && ldx >= K && ldy >= N, "dense gemm: bad shape");
  if (M == 0) return;
  if (uses_gemv(x, ldx, w, M, N, K)) {
    if (fp32_out) kernels::launch_dense_gemv(x, ldx, w, M, N, K, static_cast<float*>(y), ldy, stream);
    else kernels::launch_dense_gemv(x, ldx, w, M, N, K, static_cast<__nv_bfloat16*>(y), ldy, stream);
    return;
  }
  auto h = static_cast<cublasHandle_t>(handle_);
  CUBLAS_CHECK(cublasSetStream(h, stream));
  // Column-major view: Y^T [N, M] = W [N, K] (row-major [N, K] = column-major [K, N], transposed)
  // times X^T [K, M] (row-major [M, K] = column-major [K, M]).
  const float alpha = 1.0f, beta = 0.0f;
  CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, w, CUDA_R_16BF, K, x, CUDA_R_16BF,
                            static_cast<int>(ldx), &beta, y, fp32_out ? CUDA_R_32F : CUDA_R_16BF,
                            static_cast<int>(ldy), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void DenseGemm::linear(const __nv_bfloat16* x, int64_t ldx, const __nv_bfloat16* w, int M, int N, int K,
                       __nv_bfloat16* y, int64_t ldy, cudaStream_t stream) {
  gemm(x, ldx, w, M, N, K, y, ldy, false, stream);
}

void DenseGemm::linear(const __nv_bfloat16* x, int64_t ldx, const __nv_bfloat16* w, int M, int N, int K, float* y,
                       int64_t ldy, cudaStream_t stream) {
  gemm(x, ldx, w, M, N, K, y, ldy, true, stream);
}

}  // namespace moebius::runtime

#endif  // MOEBIUS_HAS_CUDA
