#include "moe/ep_plan.h"

namespace moebius::moe {

Status ep_local_plan(const int32_t* ids, int64_t num_tokens, int top_k, int num_experts, int size,
                     std::vector<int32_t>* send_counts, std::vector<int64_t>* send_order,
                     std::vector<int32_t>* send_local_ids) {
  MOEBIUS_TRY(parallel::check_expert_split(num_experts, size));
  const int64_t P = num_tokens * top_k;
  send_counts->assign(static_cast<size_t>(size), 0);
  for (int64_t i = 0; i < P; ++i) {
    if (ids[i] < 0 || ids[i] >= num_experts)
      return Error::format("token {} slot {} routes to expert {}, outside [0, {})", i / top_k, i % top_k, ids[i],
                           num_experts);
    ++(*send_counts)[static_cast<size_t>(parallel::expert_owner(ids[i], num_experts, size))];
  }
  std::vector<int64_t> cursor(static_cast<size_t>(size) + 1, 0);
  for (int d = 0; d < size; ++d) cursor[static_cast<size_t>(d) + 1] = cursor[static_cast<size_t>(d)] + (*send_counts)[static_cast<size_t>(d)];
  send_order->assign(static_cast<size_t>(P), 0);
  send_local_ids->assign(static_cast<size_t>(P), 0);
  const int per = parallel::experts_per_rank(num_experts, size);
  for (int64_t i = 0; i < P; ++i) {  // a stable counting sort: pair order within a destination
    const int d = parallel::expert_owner(ids[i], num_experts, size);
    const int64_t at = cursor[static_cast<size_t>(d)]++;
    (*send_order)[static_cast<size_t>(at)] = i;
    (*send_local_ids)[static_cast<size_t>(at)] = ids[i] - d * per;
  }
  return Ok{};
}

Result<EpStepPlan> make_ep_step_plan(parallel::Communicator& comm, const int32_t* ids, int64_t num_tokens, int top_k,
                                     int num_experts) {
  MOEBIUS_ASSERT(!comm.buffers_on_device(), "make_ep_step_plan exchanges host counts");
  EpStepPlan p;
  p.size = comm.size();
  p.rank = comm.rank();
  p.num_pairs = num_tokens * top_k;
  std::vector<int32_t> mine;
  MOEBIUS_TRY(ep_local_plan(ids, num_tokens, top_k, num_experts, p.size, &mine, &p.send_order, &p.send_local_ids));
  const size_t N = static_cast<size_t>(p.size);
  p.counts.assign(N * N, 0);
  MOEBIUS_TRY(comm.all_gather(mine.data(), p.counts.data(), N * sizeof(int32_t)));
  p.send_begin.assign(N + 1, 0);
  p.recv_begin.assign(N + 1, 0);
  for (size_t r = 0; r < N; ++r) {
    p.send_begin[r + 1] = p.send_begin[r] + p.send_count(static_cast<int>(r));
    p.recv_begin[r + 1] = p.recv_begin[r] + p.recv_count(static_cast<int>(r));
  }
  return p;
}

}  // namespace moebius::moe
