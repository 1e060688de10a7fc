// `--ep N` on the CUDA backend (generate, serve): one worker process per GPU, each one NCCL rank
// (docs/EXPERT_PARALLEL.md). start_ep_cuda decides this process's role:
//   - started by the built-in launcher or by mpirun (parallel::placement_from_env): it is one
//     rank; the result holds its NCCL communicator (ncclGetUniqueId on rank 0, through the file
//     rendezvous). The launcher's --ep must equal the number of ranks.
//   - otherwise it is the launcher: it checks --ep against the GPUs of this machine and the
//     model's experts, runs this same command line once per rank (parallel::launch_workers) and
//     waits for the workers; the result has `launched` set and the caller returns.
#pragma once

#include <memory>

#include "core/error.h"
#include "model/weight_source.h"
#include "parallel/communicator.h"

namespace moebius::cli {

struct EpRole {
  bool launched = false;                          // this process ran the workers; nothing left to do
  std::shared_ptr<parallel::Communicator> comm;   // a worker: its rank's NCCL communicator
};

Result<EpRole> start_ep_cuda(int ep, const model::WeightSource& source);

}  // namespace moebius::cli
