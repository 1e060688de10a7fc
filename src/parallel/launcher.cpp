#include "parallel/launcher.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include "core/log.h"

namespace moebius::parallel {
namespace {

std::string describe(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return "ended";
}

}  // namespace

Status launch_workers(const LaunchOptions& o) {
  if (o.size < 1 || o.size > 1024) return Error::format("--ep must be in [1, 1024], got {}", o.size);
  if (o.argv.empty()) return Error("no worker command");
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/moebius-ep-XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr)
    return Error::format("cannot create the rendezvous directory: {}", std::strerror(errno)).in_file(templ);
  const std::string dir(buf.data());
  const std::string job = std::to_string(::getpid());

  // Everything the children need is built before fork (only async-signal-safe calls after it).
  std::vector<std::vector<std::string>> envs(static_cast<size_t>(o.size));
  std::vector<char*> argv;
  for (const auto& a : o.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<std::vector<char*>> envp(static_cast<size_t>(o.size));
  for (int r = 0; r < o.size; ++r) {
    auto& e = envs[static_cast<size_t>(r)];
    for (char** p = environ; *p != nullptr; ++p)
      if (std::strncmp(*p, "MOEBIUS_EP_", 11) != 0 && std::strncmp(*p, "OMPI_COMM_WORLD_", 16) != 0) e.emplace_back(*p);
    e.push_back("MOEBIUS_EP_RANK=" + std::to_string(r));
    e.push_back("MOEBIUS_EP_SIZE=" + std::to_string(o.size));
    e.push_back("MOEBIUS_EP_LOCAL_RANK=" + std::to_string(r));
    e.push_back("MOEBIUS_EP_RENDEZVOUS=" + dir);
    e.push_back("MOEBIUS_EP_JOB_ID=" + job);
    e.push_back("NCCL_NVLS_ENABLE=0");  // [TAG_NO_NVLS]
    for (auto& s : e) envp[static_cast<size_t>(r)].push_back(s.data());
    envp[static_cast<size_t>(r)].push_back(nullptr);
  }
  const pid_t parent = ::getpid();
  std::vector<pid_t> pids(static_cast<size_t>(o.size), -1);
  Status result = Ok{};
  for (int r = 0; r < o.size; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      result = Error::format("fork failed for rank {}: {}", r, std::strerror(errno));
      break;
    }
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != parent) ::_exit(127);  // the launcher died between fork and prctl
      ::execve(argv[0], argv.data(), envp[static_cast<size_t>(r)].data());
      ::_exit(127);
    }
    pids[static_cast<size_t>(r)] = pid;
  }
  // Supervise: the first worker to fail brings the others down.
  int alive = 0;
  for (pid_t p : pids) alive += p > 0;
  bool stopping = !result.ok();
  auto stop_deadline = std::chrono::steady_clock::now();
  if (stopping) {
    for (pid_t p : pids)
      if (p > 0) ::kill(p, SIGTERM);
    stop_deadline += std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(o.grace_s));
  }
  bool killed = false;
  while (alive > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      int rank = -1;
      for (int r = 0; r < o.size; ++r)
        if (pids[static_cast<size_t>(r)] == pid) rank = r;
      if (rank < 0) continue;
      pids[static_cast<size_t>(rank)] = -1;
      --alive;
      const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
      if (failed && !stopping) {
        result = Error::format("expert-parallel worker rank {} {}; stopping the other {} worker(s)", rank,
                               describe(status), alive);
        log_error("{}", result.error().message());
        stopping = true;
        for (pid_t p : pids)
          if (p > 0) ::kill(p, SIGTERM);
        stop_deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(o.grace_s));
      }
      continue;
    }
    if (stopping && !killed && std::chrono::steady_clock::now() > stop_deadline) {
      for (pid_t p : pids)
        if (p > 0) ::kill(p, SIGKILL);
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return result;
}

#if defined(MOEBIUS_HAS_CUDA) && defined(MOEBIUS_HAS_NCCL)
Result<std::unique_ptr<NcclCommunicator>> nccl_from_placement(const EpPlacement& p, double timeout_s) {
  std::string dir = p.rendezvous;
  if (dir.empty()) dir = "/tmp/moebius-ep-" + std::to_string(::getuid());
  if (p.from_mpirun && p.job_id.empty() && p.rendezvous.empty())
    log_warn("no job id in the environment (PMIX_NAMESPACE / OMPI_MCA_ess_base_jobid): give each job its own "
             "--ep-rendezvous directory, or a stale id file could be read");
  const std::string name = "nccl-id." + (p.job_id.empty() ? std::string("job") : p.job_id);
  NcclId id{};
  if (p.rank == 0) {
    MOEBIUS_ASSIGN_OR_RETURN(id, nccl_unique_id());
    MOEBIUS_TRY(rendezvous_publish(dir, name, std::vector<uint8_t>(id.begin(), id.end())));
  } else {
    MOEBIUS_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, rendezvous_wait(dir, name, id.size(), timeout_s));
    std::copy(bytes.begin(), bytes.end(), id.begin());
  }
  auto comm = NcclCommunicator::create(id, p.rank, p.size, p.local_rank);
  if (p.rank == 0) {  // every rank has joined (or failed): the id file is not needed any more
    std::error_code ec;
    std::filesystem::remove(std::filesystem::path(dir) / name, ec);
  }
  return comm;
}
#endif

}  // namespace moebius::parallel
