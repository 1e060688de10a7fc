// The built-in launcher for expert parallelism without mpirun: starts one worker process per rank
// (fork + execv of the given command, normally this binary with the same subcommand), tells each
// its place through the environment (parallel/launch_env.h: MOEBIUS_EP_RANK, _SIZE, _LOCAL_RANK,
// _RENDEZVOUS, _JOB_ID) and supervises them: when a worker exits non-zero or dies from a signal,
// the others are sent SIGTERM (SIGKILL after `grace_s`), so no rank waits forever in a collective
// for a peer that is gone, and the error names the worker and how it ended. Workers also get
// PR_SET_PDEATHSIG(SIGTERM), so they go down with the launcher.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "parallel/launch_env.h"
#include "parallel/nccl_communicator.h"

namespace moebius::parallel {

struct LaunchOptions {
  int size = 1;
  std::vector<std::string> argv;  // argv[0] is the executable path (execv: no PATH search)
  double grace_s = 10.0;          // SIGTERM -> SIGKILL
};

// Runs the workers to completion. Ok when every worker exited 0. The rendezvous directory is a
// fresh mkdtemp directory under $TMPDIR (default /tmp), removed afterwards.
Status launch_workers(const LaunchOptions& options);

#if defined(MOEBIUS_HAS_CUDA) && defined(MOEBIUS_HAS_NCCL)
// A worker's NCCL communicator from its placement: rank 0 makes the ncclUniqueId and publishes it
// in the rendezvous directory (file "nccl-id.<job id>"), the others wait for it (timeout_s); all
// join with ncclCommInitRank on device local_rank. Rank 0 removes the file once every rank has
// joined. Under mpirun with no rendezvous directory given, /tmp/moebius-ep-<uid> is used.
Result<std::unique_ptr<NcclCommunicator>> nccl_from_placement(const EpPlacement& placement, double timeout_s = 120.0);
#endif

}  // namespace moebius::parallel
