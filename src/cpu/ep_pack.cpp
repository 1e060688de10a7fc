#include "cpu/ep_pack.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace moebius::cpu {

void ep_plan_reference(const int32_t* ids, int64_t num_tokens, int top_k, int num_experts, int num_ranks,
                       int64_t slots, int32_t* send_pos, int32_t* send_counts, int32_t* send_meta) {
  const int per = num_experts / num_ranks;
  std::fill_n(send_counts, num_ranks, 0);
  for (int64_t p = 0; p < num_tokens * top_k; ++p) {
    const int d = ids[p] / per;
    const int32_t pos = send_counts[d]++;
    send_pos[p] = pos;
    send_meta[d * slots + pos] = ids[p] - d * per;
  }
}

void ep_pack_rows_reference(const uint16_t* x, int64_t num_tokens, int64_t hidden, int top_k, const int32_t* ids,
                            int num_experts, int num_ranks, const int32_t* send_pos, int64_t slots, uint16_t* send_x) {
  const int per = num_experts / num_ranks;
  for (int64_t p = 0; p < num_tokens * top_k; ++p) {
    const int d = ids[p] / per;
    std::memcpy(send_x + (d * slots + send_pos[p]) * hidden, x + (p / top_k) * hidden, static_cast<size_t>(hidden) * 2);
  }
}

void ep_compact_reference(const uint16_t* recv_x, const int32_t* recv_meta, const int32_t* counts, int me,
                          int num_ranks, int64_t slots, int64_t hidden, uint16_t* x_local, int32_t* local_ids,
                          int32_t* num_local) {
  int64_t j = 0;
  for (int s = 0; s < num_ranks; ++s)
    for (int64_t i = 0; i < counts[s * num_ranks + me]; ++i, ++j) {
      std::memcpy(x_local + j * hidden, recv_x + (s * slots + i) * hidden, static_cast<size_t>(hidden) * 2);
      local_ids[j] = recv_meta[s * slots + i];
    }
  *num_local = static_cast<int32_t>(j);
}

void ep_return_pack_reference(const float* y_local, const int32_t* counts, int me, int num_ranks, int64_t slots,
                              int64_t hidden, float* ret_send) {
  int64_t j = 0;
  for (int s = 0; s < num_ranks; ++s)
    for (int64_t i = 0; i < counts[s * num_ranks + me]; ++i, ++j)
      std::memcpy(ret_send + (s * slots + i) * hidden, y_local + j * hidden, static_cast<size_t>(hidden) * 4);
}

void ep_unpack_return_reference(const float* ret_recv, const int32_t* ids, const int32_t* send_pos,
                                int64_t num_tokens, int top_k, int num_experts, int num_ranks, int64_t slots,
                                int64_t hidden, float* y_pairs) {
  const int per = num_experts / num_ranks;
  for (int64_t p = 0; p < num_tokens * top_k; ++p) {
    const int d = ids[p] / per;
    std::memcpy(y_pairs + p * hidden, ret_recv + (d * slots + send_pos[p]) * hidden, static_cast<size_t>(hidden) * 4);
  }
}

}  // namespace moebius::cpu
