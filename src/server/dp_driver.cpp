#include "server/dp_driver.h"

#include <algorithm>
#include <array>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/log.h"

namespace moebius::server {

Result<bool> run_dp_part(parallel::Communicator& comm, DpPart& part, const DpStepMessage& m, int64_t vocab,
                         std::vector<float>& logits, std::string* why) {
  std::vector<RunnerSeq> seqs;
  seqs.reserve(m.seqs.size());
  for (const DpSeq& s : m.seqs)
    seqs.push_back(RunnerSeq{s.id, s.tokens, s.start, s.block_table, s.want_logits, 0, s.all_logits});
  size_t rows = 0;
  const Status mine = part.prepare(seqs, &rows);
  const int32_t flag = mine.ok() ? 1 : 0;
  std::vector<int32_t> flags(static_cast<size_t>(comm.size()));
  MOEBIUS_TRY(comm.all_gather(&flag, flags.data(), sizeof(flag)));
  std::vector<int> refused;
  for (size_t r = 0; r < flags.size(); ++r)
    if (flags[r] == 0) refused.push_back(static_cast<int>(r));
  if (!refused.empty()) {
    *why = !mine.ok() ? fmt::format("rank {}: {}", comm.rank(), mine.error().what())
                      : fmt::format("rank(s) {} could not run their part of the step (the reason is in the log)",
                                    fmt::join(refused, ", "));
    if (!mine.ok() && comm.rank() != 0) log_error("serve --ep: {}", *why);
    return false;
  }
  MOEBIUS_TRY(part.run(logits));
  // The gather's sizes are rank 0's row counts: a part that returned other rows would desynchronize it.
  if (logits.size() != rows * static_cast<size_t>(vocab))
    return Error::format("rank {}'s part returned {} logits for {} rows of {}", comm.rank(), logits.size(), rows, vocab);
  return true;
}

Status follow_dp_steps(parallel::Communicator& comm, DpPart& part, int64_t vocab) {
  std::vector<float> logits, unused;
  for (;;) {
    MOEBIUS_ASSIGN_OR_RETURN(DpStepMessage m, dp_exchange_step(comm, {}));
    if (m.stop) return Ok{};
    std::string why;
    MOEBIUS_ASSIGN_OR_RETURN(bool ran, run_dp_part(comm, part, m, vocab, logits, &why));
    if (ran) MOEBIUS_TRY(dp_gather_logits(comm, logits, {}, vocab, unused));
  }
}

Status DpStepDriver::step(std::span<const RunnerSeq> seqs, DpPart& own, std::vector<float>& logits, Status* refused) {
  const size_t N = static_cast<size_t>(comm_.size());
  *refused = Ok{};
  std::vector<DpStepMessage> msgs(N);
  std::vector<int64_t> rows(N, 0);
  std::vector<std::pair<size_t, int64_t>> where;  // per wanted row, in step order: (rank, its row)
  for (const RunnerSeq& s : seqs) {
    if (s.pool < 0 || static_cast<size_t>(s.pool) >= N) {
      *refused = Error::format("sequence {} is placed on pool {}; there are {}", s.id, s.pool, N);
      return Ok{};  // nothing was sent: every rank is still in step
    }
    const size_t r = static_cast<size_t>(s.pool);
    msgs[r].seqs.push_back(DpSeq{s.id, s.start, s.want_logits, {s.tokens.begin(), s.tokens.end()},
                                 {s.block_table.begin(), s.block_table.end()}, s.all_logits});
    for (size_t i = 0; i < logits_rows(s); ++i) where.emplace_back(r, rows[r]++);
  }
  MOEBIUS_ASSIGN_OR_RETURN(DpStepMessage mine, dp_exchange_step(comm_, msgs));
  std::string why;
  MOEBIUS_ASSIGN_OR_RETURN(bool ran, run_dp_part(comm_, own, mine, vocab_, own_, &why));
  if (!ran) {
    *refused = Error(why);
    return Ok{};
  }
  MOEBIUS_TRY(dp_gather_logits(comm_, own_, rows, vocab_, gathered_));
  const size_t V = static_cast<size_t>(vocab_);
  std::vector<size_t> first_row(N, 0);  // where rank r's rows start in gathered_ (rank 0: in own_)
  for (size_t r = 2; r < N; ++r) first_row[r] = first_row[r - 1] + static_cast<size_t>(rows[r - 1]);
  logits.resize(where.size() * V);
  for (size_t i = 0; i < where.size(); ++i) {
    const auto [r, row] = where[i];
    const float* src = r == 0 ? own_.data() + static_cast<size_t>(row) * V
                              : gathered_.data() + (first_row[r] + static_cast<size_t>(row)) * V;
    std::copy(src, src + V, logits.data() + i * V);
  }
  return Ok{};
}

Status DpStepDriver::stop() {
  std::vector<DpStepMessage> stop(static_cast<size_t>(comm_.size()));
  for (DpStepMessage& m : stop) m.stop = true;
  MOEBIUS_TRY(dp_exchange_step(comm_, stop));
  return Ok{};
}

Status dp_check_same_limits(parallel::Communicator& comm, const RunnerLimits& l) {
  constexpr size_t kFields = 6;
  const std::array<int64_t, kFields> mine = {l.block_size, l.num_blocks, l.max_context, l.max_step_tokens, l.max_seqs,
                                             l.kv_pools};
  std::vector<int64_t> all(kFields * static_cast<size_t>(comm.size()));
  MOEBIUS_TRY(comm.all_gather(mine.data(), all.data(), sizeof(mine)));
  static constexpr std::array<const char*, kFields> kNames = {"block size",      "KV blocks per pool", "context",
                                                              "tokens per step", "sequences per step", "KV pools"};
  for (int r = 1; r < comm.size(); ++r)
    for (size_t f = 0; f < kFields; ++f)
      if (all[static_cast<size_t>(r) * kFields + f] != all[f])
        return Error::format("data-parallel rank {} has {} {}, rank 0 {}: every rank must be started with the same "
                             "options and find the same memory",
                             r, kNames[f], all[static_cast<size_t>(r) * kFields + f], all[f])
            .in_field("--ep");
  return Ok{};
}

}  // namespace moebius::server
