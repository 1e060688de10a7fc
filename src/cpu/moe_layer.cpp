#include "cpu/moe_layer.h"

#include "cpu/linear.h"

namespace moebius::cpu {

void router_logits_reference(const float* router_weight, const float* x, int64_t num_tokens, int64_t hidden,
                             int num_experts, float* logits) {
  linear_reference(x, router_weight, num_tokens, num_experts, hidden, logits);
}

Status MoeLayerReference::validate() const {
  MOEBIUS_TRY(router.validate());
  if (router.num_experts != shape.num_experts || router.top_k != shape.top_k)
    return Error::format("router has E={} k={}, layer has E={} k={}", router.num_experts, router.top_k,
                         shape.num_experts, shape.top_k);
  if (static_cast<int64_t>(router_weight.size()) != shape.num_experts * shape.hidden)
    return Error::format("router weight has {} elements, expected [E={}, H={}]", router_weight.size(),
                         shape.num_experts, shape.hidden)
        .in_tensor("mlp.gate.weight");
  return validate_experts(shape, experts);
}

Status MoeLayerReference::forward(const float* x, int64_t num_tokens, float* out, int32_t* ids_out,
                                  float* weights_out) const {
  MOEBIUS_TRY(validate());
  const int E = shape.num_experts, k = shape.top_k;
  std::vector<float> logits(static_cast<size_t>(num_tokens * E));
  router_logits_reference(router_weight.data(), x, num_tokens, shape.hidden, E, logits.data());
  std::vector<int32_t> ids(static_cast<size_t>(num_tokens * k));
  std::vector<float> w(static_cast<size_t>(num_tokens * k));
  MOEBIUS_TRY(route_reference(router, logits.data(), num_tokens, ids.data(), w.data()));
  MOEBIUS_TRY(moe_experts_reference(shape, experts, options, x, num_tokens, ids.data(), w.data(), out));
  if (ids_out) std::copy(ids.begin(), ids.end(), ids_out);
  if (weights_out) std::copy(w.begin(), w.end(), weights_out);
  return Ok{};
}

}  // namespace moebius::cpu
