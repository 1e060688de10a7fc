#include "cli/ep_workers.h"

#include <unistd.h>

#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "core/log.h"
#include "parallel/launch_env.h"
#include "parallel/launcher.h"

#if defined(MOEBIUS_HAS_CUDA) && defined(MOEBIUS_HAS_NCCL)
#include <cuda_runtime_api.h>

#include "parallel/nccl_communicator.h"
#endif

namespace moebius::cli {

namespace {

// This process's command line with argv[0] replaced by /proc/self/exe (execv does no PATH search):
// the workers run exactly the command the user typed, and learn their rank from the environment.
Result<std::vector<std::string>> own_command_line() {
  char self[4096];
  const ssize_t len = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (len <= 0) return Error("cannot find this executable (/proc/self/exe)");
  self[len] = '\0';
  std::ifstream f("/proc/self/cmdline", std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (all.empty()) return Error("cannot read this process's arguments (/proc/self/cmdline)");
  std::vector<std::string> argv;
  for (size_t at = 0; at < all.size();) {
    const size_t end = all.find('\0', at);
    argv.push_back(all.substr(at, end == std::string::npos ? std::string::npos : end - at));
    if (end == std::string::npos) break;
    at = end + 1;
  }
  argv[0] = self;
  return argv;
}

}  // namespace

Result<EpRole> start_ep_cuda(int ep, const model::WeightSource& source) {
#if !defined(MOEBIUS_HAS_CUDA) || !defined(MOEBIUS_HAS_NCCL)
  (void)ep;
  (void)source;
  return Error("this build of moebius has no CUDA and NCCL; expert parallelism on the CUDA backend needs both")
      .in_field("--ep");
#else
  MOEBIUS_ASSIGN_OR_RETURN(std::optional<parallel::EpPlacement> placed, parallel::placement_from_env());
  EpRole role;
  if (placed) {
    if (placed->size != ep)
      return Error::format("{} ranks were started ({}), but --ep is {}", placed->size,
                           placed->from_mpirun ? "mpirun -np" : "the launcher", ep)
          .in_field("--ep");
    MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<parallel::NcclCommunicator> comm, parallel::nccl_from_placement(*placed));
    role.comm = std::shared_ptr<parallel::Communicator>(std::move(comm));
    return role;
  }
  if (ep < 1 || ep > 1024) return Error::format("must be in [1, 1024], got {}", ep).in_field("--ep");
  MOEBIUS_ASSIGN_OR_RETURN(model::Qwen3MoeConfig config, model::weight_source_config(source));
  if (Status st = parallel::check_expert_split(config.num_experts, ep); !st.ok())
    return std::move(st).error().in_field("--ep");
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) return Error("no CUDA device is visible").in_field("--ep");
  // NCCL cannot put two ranks of one communicator on one GPU.
  if (ep > devices)
    return Error::format("--ep {} needs {} GPUs (one rank per GPU), this machine has {}", ep, ep, devices)
        .in_field("--ep");
  parallel::LaunchOptions lo;
  lo.size = ep;
  MOEBIUS_ASSIGN_OR_RETURN(lo.argv, own_command_line());
  log_info("expert parallelism: starting {} worker processes, one per GPU", ep);
  MOEBIUS_TRY(parallel::launch_workers(lo));
  role.launched = true;
  return role;
#endif
}

}  // namespace moebius::cli
