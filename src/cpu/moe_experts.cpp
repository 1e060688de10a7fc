#include "cpu/moe_experts.h"

#include <cmath>
#include <numeric>

#include "core/dtype.h"

namespace moebius::cpu {

namespace {

float silu(float v) { return v / (1.0f + std::exp(-v)); }

// Double accumulation keeps the oracle's own rounding error far below any kernel's. Four
// independent partial sums break the add latency chain (the compiler may not reorder fp adds);
// the summation order is fixed, so results stay deterministic.
double dot(const float* a, const float* b, int64_t n) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += static_cast<double>(a[i]) * b[i];
    s1 += static_cast<double>(a[i + 1]) * b[i + 1];
    s2 += static_cast<double>(a[i + 2]) * b[i + 2];
    s3 += static_cast<double>(a[i + 3]) * b[i + 3];
  }
  for (; i < n; ++i) s0 += static_cast<double>(a[i]) * b[i];
  return (s0 + s1) + (s2 + s3);
}

Status check_matrix(const QuantMatrix& m, int64_t rows, int64_t cols, int expert, const char* name) {
  if (m.rows != rows || m.cols != cols)
    return Error::format("expert {} {} is [{}, {}], expected [{}, {}]", expert, name, m.rows, m.cols, rows, cols);
  return Ok{};
}

}  // namespace

float apply_activation(const ActivationConfig& act, float g, float u) {
  switch (act.kind) {
    case Activation::kSiLU:
      return silu(g) * u;
    case Activation::kSiLUClamped:
      return silu(std::min(g, act.limit)) * std::clamp(u, -act.limit, act.limit);
    case Activation::kGptOss: {
      const float gc = std::min(g, act.limit);
      const float uc = std::clamp(u, -act.limit, act.limit);
      return (uc + 1.0f) * gc / (1.0f + std::exp(-act.alpha * gc));
    }
  }
  return 0.0f;
}

Status validate_experts(const MoeShape& shape, const std::vector<ExpertWeights>& experts) {
  if (shape.hidden <= 0 || shape.intermediate <= 0 || shape.num_experts <= 0 || shape.top_k <= 0 ||
      shape.top_k > shape.num_experts)
    return Error::format("bad MoE shape H={} I={} E={} k={}", shape.hidden, shape.intermediate, shape.num_experts,
                         shape.top_k);
  if (static_cast<int64_t>(experts.size()) != shape.num_experts)
    return Error::format("{} experts given, expected {}", experts.size(), shape.num_experts);
  for (int e = 0; e < shape.num_experts; ++e) {
    const auto& ex = experts[static_cast<size_t>(e)];
    MOEBIUS_TRY(check_matrix(ex.gate, shape.intermediate, shape.hidden, e, "gate_proj"));
    MOEBIUS_TRY(check_matrix(ex.up, shape.intermediate, shape.hidden, e, "up_proj"));
    MOEBIUS_TRY(check_matrix(ex.down, shape.hidden, shape.intermediate, e, "down_proj"));
  }
  return Ok{};
}

Status moe_experts_reference(const MoeShape& shape, const std::vector<ExpertWeights>& experts,
                             const MoeReferenceOptions& options, const float* x, int64_t num_tokens,
                             const int32_t* ids, const float* weights, float* out) {
  MOEBIUS_TRY(validate_experts(shape, experts));
  const int64_t H = shape.hidden, I = shape.intermediate;
  const int E = shape.num_experts, k = shape.top_k;

  // Group the (token, slot) pairs by expert, in token order.
  std::vector<std::vector<int64_t>> routed(static_cast<size_t>(E));
  for (int64_t i = 0; i < num_tokens * k; ++i) {
    const int32_t e = ids[i];
    if (e < 0 || e >= E)
      return Error::format("token {} slot {} routes to expert {}, outside [0, {})", i / k, i % k, e, E);
    routed[static_cast<size_t>(e)].push_back(i);
  }

  // One output row per (token, slot), so the combine below sums in a fixed order no matter which
  // thread produced which row: the result is bit-identical run to run.
  std::vector<float> slot_out(static_cast<size_t>(num_tokens * k * H));

#pragma omp parallel
  {
    std::vector<float> wg, wu, wd, h(static_cast<size_t>(I));
#pragma omp for schedule(dynamic, 1)
    for (int e = 0; e < E; ++e) {
      const auto& list = routed[static_cast<size_t>(e)];
      if (list.empty()) continue;
      const ExpertWeights& ex = experts[static_cast<size_t>(e)];
      wg.resize(static_cast<size_t>(I * H));
      wu.resize(static_cast<size_t>(I * H));
      wd.resize(static_cast<size_t>(H * I));
      dequantize_rows(ex.gate, 0, I, wg.data());
      dequantize_rows(ex.up, 0, I, wu.data());
      dequantize_rows(ex.down, 0, H, wd.data());
      for (int64_t pair : list) {
        const float* xt = x + (pair / k) * H;
        for (int64_t i = 0; i < I; ++i) {
          const float g = static_cast<float>(dot(wg.data() + i * H, xt, H));
          const float u = static_cast<float>(dot(wu.data() + i * H, xt, H));
          float a = apply_activation(options.activation, g, u);
          if (options.round_intermediate_to_bf16) a = bf16_bits_to_float(float_to_bf16_bits(a));
          h[static_cast<size_t>(i)] = a;
        }
        float* y = slot_out.data() + pair * H;
        for (int64_t j = 0; j < H; ++j) y[j] = static_cast<float>(dot(wd.data() + j * I, h.data(), I));
      }
    }
  }

#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* o = out + t * H;
    for (int64_t j = 0; j < H; ++j) o[j] = 0.0f;
    for (int s = 0; s < k; ++s) {
      const float w = weights[t * k + s];
      const float* y = slot_out.data() + (t * k + s) * H;
      for (int64_t j = 0; j < H; ++j) o[j] += w * y[j];
    }
  }
  return Ok{};
}

size_t touched_weight_bytes(const std::vector<ExpertWeights>& experts, const int32_t* ids, int64_t num_tokens,
                            int top_k) {
  std::vector<char> used(experts.size(), 0);
  for (int64_t i = 0; i < num_tokens * top_k; ++i)
    if (ids[i] >= 0 && static_cast<size_t>(ids[i]) < experts.size()) used[static_cast<size_t>(ids[i])] = 1;
  size_t bytes = 0;
  for (size_t e = 0; e < experts.size(); ++e)
    if (used[e]) bytes += weight_bytes(experts[e].gate) + weight_bytes(experts[e].up) + weight_bytes(experts[e].down);
  return bytes;
}

}  // namespace moebius::cpu
