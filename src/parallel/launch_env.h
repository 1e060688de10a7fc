// How an expert-parallel worker learns its place, and how rank 0's ncclUniqueId reaches the other
// ranks without MPI (the GPU machine has no libmpi, so moebius never links it).
//
// Rank, size and device, in order of precedence:
//   - the built-in launcher (`moebius serve|generate --ep N` spawns N workers): MOEBIUS_EP_RANK,
//     MOEBIUS_EP_SIZE, MOEBIUS_EP_LOCAL_RANK;
//   - mpirun (OpenMPI): OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK
//     (or LOCAL_RANK) for the device.
// The ncclUniqueId (128 opaque bytes) goes through a file rendezvous: rank 0 writes
// `<dir>/<name>` (to a temporary name, then rename(2), so a reader never sees half a file) and the
// others poll for it. The directory must be visible to every rank (one node: /tmp is fine). The
// built-in launcher makes a fresh directory per run (mkdtemp) and passes it in
// MOEBIUS_EP_RENDEZVOUS; under mpirun it is --ep-rendezvous DIR or MOEBIUS_EP_RENDEZVOUS, and the
// file name carries the job id (PMIX_NAMESPACE or OMPI_MCA_ess_base_jobid) so a stale file from
// an earlier job is never read. We chose a file over a TCP socket from rank 0 because it needs no
// port choice, no firewall and no address discovery on one node; multi-node jobs need a shared
// filesystem directory.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"

namespace moebius::parallel {

struct EpPlacement {
  int rank = 0;
  int size = 1;
  int local_rank = 0;         // the CUDA device index on this node
  std::string rendezvous;     // a directory visible to every rank
  std::string job_id;         // distinguishes concurrent or earlier jobs sharing the directory
  bool from_mpirun = false;
};

// The placement from the environment (see above); nullopt when no launcher variable is set (a
// plain single process). Errors for malformed or inconsistent values, naming the variable.
Result<std::optional<EpPlacement>> placement_from_env();

// Rank 0: writes `bytes` to dir/name atomically. Other ranks: wait up to timeout_s for the file
// and return its contents, which must be `expected_size` bytes. Errors name the path.
Status rendezvous_publish(const std::string& dir, const std::string& name, const std::vector<uint8_t>& bytes);
Result<std::vector<uint8_t>> rendezvous_wait(const std::string& dir, const std::string& name, size_t expected_size,
                                             double timeout_s);

}  // namespace moebius::parallel
