#include "moe/ep_moe_cpu.h"

#include <cstring>

#include "core/dtype.h"
#include "moe/ep_plan.h"

namespace moebius::moe {
namespace {

size_t row_bytes(EpPayload p, int64_t H) { return static_cast<size_t>(H) * (p == EpPayload::kF32 ? 4 : 2); }

// Byte counts and offsets per rank of one all_to_all_v of `row` bytes per pair: the dispatch sends
// this rank's pairs and receives its experts' (forward), the return sends the received rows back
// (transposed counts).
struct ExchangeBytes {
  std::vector<size_t> send, send_off, recv, recv_off;
};
ExchangeBytes exchange_bytes(const EpStepPlan& plan, int N, size_t row, bool forward) {
  ExchangeBytes b{std::vector<size_t>(static_cast<size_t>(N)), std::vector<size_t>(static_cast<size_t>(N)),
                  std::vector<size_t>(static_cast<size_t>(N)), std::vector<size_t>(static_cast<size_t>(N))};
  for (int d = 0; d < N; ++d) {
    const size_t u = static_cast<size_t>(d);
    const size_t out_n = static_cast<size_t>(forward ? plan.send_count(d) : plan.recv_count(d));
    const size_t in_n = static_cast<size_t>(forward ? plan.recv_count(d) : plan.send_count(d));
    const int64_t out_begin = forward ? plan.send_begin[u] : plan.recv_begin[u];
    const int64_t in_begin = forward ? plan.recv_begin[u] : plan.send_begin[u];
    b.send[u] = out_n * row;
    b.send_off[u] = static_cast<size_t>(out_begin) * row;
    b.recv[u] = in_n * row;
    b.recv_off[u] = static_cast<size_t>(in_begin) * row;
  }
  return b;
}

}  // namespace

Status validate_ep_layer(const cpu::MoeLayerReference& layer, int size) {
  MOEBIUS_TRY(layer.router.validate());
  const cpu::MoeShape& s = layer.shape;
  MOEBIUS_TRY(parallel::check_expert_split(s.num_experts, size));
  if (layer.router.num_experts != s.num_experts || layer.router.top_k != s.top_k)
    return Error::format("router has E={} k={}, layer has E={} k={}", layer.router.num_experts, layer.router.top_k,
                         s.num_experts, s.top_k);
  if (static_cast<int64_t>(layer.router_weight.size()) != s.num_experts * s.hidden)
    return Error::format("router weight has {} elements, expected [E={}, H={}]", layer.router_weight.size(),
                         s.num_experts, s.hidden)
        .in_tensor("mlp.gate.weight");
  const cpu::MoeShape local{s.hidden, s.intermediate, parallel::experts_per_rank(s.num_experts, size), 1};
  return cpu::validate_experts(local, layer.experts);
}

Status ep_moe_experts_cpu(parallel::Communicator& comm, const cpu::MoeShape& shape,
                          const std::vector<cpu::ExpertWeights>& local_experts, const cpu::MoeReferenceOptions& options,
                          EpPayload payload, const float* x, int64_t num_tokens, const int32_t* ids,
                          const float* weights, float* out) {
  const int N = comm.size(), k = shape.top_k;
  const int64_t H = shape.hidden;
  MOEBIUS_ASSIGN_OR_RETURN(EpStepPlan plan, make_ep_step_plan(comm, ids, num_tokens, k, shape.num_experts));
  const size_t rb = row_bytes(payload, H), rec = rb + sizeof(int32_t);  // [TAG_EP_WIRE_FORMAT]

  // Dispatch: one record per pair in send order.
  std::vector<uint8_t> send(static_cast<size_t>(plan.num_pairs) * rec);
  std::vector<uint16_t> bf(payload == EpPayload::kBF16 ? static_cast<size_t>(H) : 0);
  for (int64_t j = 0; j < plan.num_pairs; ++j) {
    uint8_t* r = send.data() + static_cast<size_t>(j) * rec;
    const float* xt = x + (plan.send_order[static_cast<size_t>(j)] / k) * H;
    if (payload == EpPayload::kF32) {
      std::memcpy(r, xt, rb);
    } else {
      for (int64_t h = 0; h < H; ++h) bf[static_cast<size_t>(h)] = float_to_bf16_bits(xt[h]);
      std::memcpy(r, bf.data(), rb);
    }
    std::memcpy(r + rb, &plan.send_local_ids[static_cast<size_t>(j)], sizeof(int32_t));
  }
  const int64_t R = plan.num_received();
  std::vector<uint8_t> recv(static_cast<size_t>(R) * rec);
  const ExchangeBytes dispatch = exchange_bytes(plan, N, rec, /*forward=*/true);
  MOEBIUS_TRY(comm.all_to_all_v(send.data(), dispatch.send, dispatch.send_off, recv.data(), dispatch.recv,
                                dispatch.recv_off));

  // Local experts: every received pair is a "token" routed to one local expert with weight 1, so
  // the reference's combine leaves its FC2 row as it is (0 + 1 * y == y).
  const int local = static_cast<int>(local_experts.size());
  std::vector<float> xr(static_cast<size_t>(R * H)), ones(static_cast<size_t>(R), 1.0f), yr(static_cast<size_t>(R * H));
  std::vector<int32_t> lid(static_cast<size_t>(R));
  for (int64_t j = 0; j < R; ++j) {
    const uint8_t* r = recv.data() + static_cast<size_t>(j) * rec;
    float* row = xr.data() + j * H;
    if (payload == EpPayload::kF32) {
      std::memcpy(row, r, rb);
    } else {
      std::memcpy(bf.data(), r, rb);
      for (int64_t h = 0; h < H; ++h) row[h] = bf16_bits_to_float(bf[static_cast<size_t>(h)]);
    }
    std::memcpy(&lid[static_cast<size_t>(j)], r + rb, sizeof(int32_t));
    if (lid[static_cast<size_t>(j)] < 0 || lid[static_cast<size_t>(j)] >= local)
      return Error::format("EP rank {} received local expert {} (it owns {})", comm.rank(), lid[static_cast<size_t>(j)],
                           local);
  }
  if (R > 0) {
    const cpu::MoeShape ls{H, shape.intermediate, local, 1};
    MOEBIUS_TRY(cpu::moe_experts_reference(ls, local_experts, options, xr.data(), R, lid.data(), ones.data(), yr.data()));
  }

  // Return: the FC2 rows go back in received order; counts transposed.
  const size_t yb = static_cast<size_t>(H) * sizeof(float);
  std::vector<float> back(static_cast<size_t>(plan.num_pairs * H));
  const ExchangeBytes ret = exchange_bytes(plan, N, yb, /*forward=*/false);
  MOEBIUS_TRY(comm.all_to_all_v(yr.data(), ret.send, ret.send_off, back.data(), ret.recv, ret.recv_off));

  // Combine on the token's rank, in slot order, in fp32 (as moe_experts_reference does).
  std::vector<int64_t> where(static_cast<size_t>(plan.num_pairs));  // pair -> row of `back`
  for (int64_t j = 0; j < plan.num_pairs; ++j) where[static_cast<size_t>(plan.send_order[static_cast<size_t>(j)])] = j;
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* o = out + t * H;
    for (int64_t h = 0; h < H; ++h) o[h] = 0.0f;
    for (int s = 0; s < k; ++s) {
      const float w = weights[t * k + s];
      const float* y = back.data() + where[static_cast<size_t>(t * k + s)] * H;
      for (int64_t h = 0; h < H; ++h) o[h] += w * y[h];
    }
  }
  return Ok{};
}

Status ep_moe_layer_cpu(parallel::Communicator& comm, const cpu::MoeLayerReference& layer, EpPayload payload,
                        const float* x, int64_t num_tokens, float* out) {
  MOEBIUS_TRY(validate_ep_layer(layer, comm.size()));
  const int E = layer.shape.num_experts, k = layer.shape.top_k;
  std::vector<float> logits(static_cast<size_t>(num_tokens * E));
  std::vector<int32_t> ids(static_cast<size_t>(num_tokens * k));
  std::vector<float> w(static_cast<size_t>(num_tokens * k));
  if (num_tokens > 0) {
    cpu::router_logits_reference(layer.router_weight.data(), x, num_tokens, layer.shape.hidden, E, logits.data());
    MOEBIUS_TRY(cpu::route_reference(layer.router, logits.data(), num_tokens, ids.data(), w.data()));
  }
  return ep_moe_experts_cpu(comm, layer.shape, layer.experts, layer.options, payload, x, num_tokens, ids.data(),
                            w.data(), out);
}

}  // namespace moebius::moe
