// [TAG_SERVE_DP] How one data-parallel step runs over the expert-parallel ranks, whatever the
// backend (`serve --ep N`: threads over the in-process communicator on the CPU, one process per GPU
// over NCCL on CUDA). The wire format is dp_step.h's; this file is the protocol around it:
//
//   rank 0 (the engine's thread):  split the step's sequences by pool (= rank) -> dp_exchange_step
//                                  -> run its own part -> dp_gather_logits -> the wanted rows back
//                                  in the step's order
//   ranks 1..N-1 (followers):      dp_exchange_step -> run their part -> dp_gather_logits, until
//                                  a stop message
//
// Running a part is itself two collectives deep: every rank first checks and prepares its own
// sequences (DpPart::prepare), the ranks all-gather a flag, and only if every rank accepted does
// any rank run (DpPart::run: the model's forward, whose MoE layers are collectives, so one rank
// that refused alone would leave the others waiting inside it). A refused step therefore leaves
// every rank in step; an error inside a collective may not, and the caller must then stop the
// group (the in-process group's abort; NCCL: the runner reports failed()).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "parallel/communicator.h"
#include "server/dp_step.h"
#include "server/step_runner.h"

namespace moebius::server {

// One rank's model over the rank's own sequences of a step (its KV pool, its experts).
class DpPart {
 public:
  virtual ~DpPart() = default;
  // Checks and prepares `seqs` (possibly none) without running anything; *rows: the logits rows
  // run() will return (the sequences with want_logits). An error refuses the step.
  virtual Status prepare(std::span<const RunnerSeq> seqs, size_t* rows) = 0;
  // Runs what prepare() accepted; a collective, so it runs on every rank, one with no sequences
  // too. `logits` gets [rows, vocab] fp32, the wanted rows in the sequences' order.
  virtual Status run(std::vector<float>& logits) = 0;
};

// One rank's part after its message: prepare, agree, run (`logits`: [rows, vocab]). Returns false when some rank refused
// (nobody ran; *why names the rank, with its reason when it is this one); an error means the ranks
// may be out of step. A follower's own refusal also goes to the log (only rank 0's reaches the
// engine).
Result<bool> run_dp_part(parallel::Communicator& comm, DpPart& part, const DpStepMessage& m, int64_t vocab,
                         std::vector<float>& logits, std::string* why);

// A follower rank (1..N-1): steps until rank 0 sends stop. A step some rank refused is skipped by
// every rank; any other error ends the loop (the caller stops the group).
Status follow_dp_steps(parallel::Communicator& comm, DpPart& part, int64_t vocab);

// Rank 0's side of every step.
class DpStepDriver {
 public:
  DpStepDriver(parallel::Communicator& comm, int64_t vocab) : comm_(comm), vocab_(vocab) {}

  // Places each sequence on rank s.pool, runs the step on every rank (rank 0's part is `own`) and
  // puts the wanted logits rows in `logits` in the step's order. A step some rank refused returns
  // Ok with *refused set to the reason (every rank is still in step); an error return means a
  // collective failed and the ranks may be out of step.
  Status step(std::span<const RunnerSeq> seqs, DpPart& own, std::vector<float>& logits, Status* refused);
  // Tells every follower to return from follow_dp_steps.
  Status stop();

 private:
  parallel::Communicator& comm_;
  int64_t vocab_;
  std::vector<float> own_, gathered_;  // rank 0's rows, the other ranks' rows
};

// The limits every rank's part was built with must be the same (the engine plans one pool size
// for every rank, and the MoE collectives' capacities follow the step limits): one all-gather,
// and an error naming the first rank that differs from rank 0. Every rank calls it once, after
// loading, before the first step.
Status dp_check_same_limits(parallel::Communicator& comm, const RunnerLimits& limits);

}  // namespace moebius::server
