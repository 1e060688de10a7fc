#include "parallel/launch_env.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

namespace moebius::parallel {
namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

Result<int> env_int(const char* name, int lo, int hi) {
  const char* v = env(name);
  if (v == nullptr) return Error::format("environment variable {} is not set", name);
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || x < lo || x > hi)
    return Error::format("environment variable {}='{}' is not an integer in [{}, {}]", name, v, lo, hi);
  return static_cast<int>(x);
}

}  // namespace

Result<std::optional<EpPlacement>> placement_from_env() {
  EpPlacement p;
  if (env("MOEBIUS_EP_RANK") != nullptr || env("MOEBIUS_EP_SIZE") != nullptr) {
    MOEBIUS_ASSIGN_OR_RETURN(p.size, env_int("MOEBIUS_EP_SIZE", 1, 1024));
    MOEBIUS_ASSIGN_OR_RETURN(p.rank, env_int("MOEBIUS_EP_RANK", 0, p.size - 1));
    p.local_rank = p.rank;
    if (env("MOEBIUS_EP_LOCAL_RANK") != nullptr) {
      MOEBIUS_ASSIGN_OR_RETURN(p.local_rank, env_int("MOEBIUS_EP_LOCAL_RANK", 0, 1023));
    }
    if (const char* d = env("MOEBIUS_EP_RENDEZVOUS")) p.rendezvous = d;
    if (const char* j = env("MOEBIUS_EP_JOB_ID")) p.job_id = j;
    return std::optional<EpPlacement>(p);
  }
  if (env("OMPI_COMM_WORLD_RANK") == nullptr) return std::optional<EpPlacement>();
  p.from_mpirun = true;
  MOEBIUS_ASSIGN_OR_RETURN(p.size, env_int("OMPI_COMM_WORLD_SIZE", 1, 1024));
  MOEBIUS_ASSIGN_OR_RETURN(p.rank, env_int("OMPI_COMM_WORLD_RANK", 0, p.size - 1));
  p.local_rank = p.rank;
  if (env("OMPI_COMM_WORLD_LOCAL_RANK") != nullptr) {
    MOEBIUS_ASSIGN_OR_RETURN(p.local_rank, env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0, 1023));
  } else if (env("LOCAL_RANK") != nullptr) {
    MOEBIUS_ASSIGN_OR_RETURN(p.local_rank, env_int("LOCAL_RANK", 0, 1023));
  }
  if (const char* d = env("MOEBIUS_EP_RENDEZVOUS")) p.rendezvous = d;
  if (const char* j = env("PMIX_NAMESPACE")) p.job_id = j;
  else if (const char* j2 = env("OMPI_MCA_ess_base_jobid")) p.job_id = j2;
  return std::optional<EpPlacement>(p);
}

Status rendezvous_publish(const std::string& dir, const std::string& name, const std::vector<uint8_t>& bytes) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Error::format("cannot create the rendezvous directory: {}", ec.message()).in_file(dir);
  const fs::path final_path = fs::path(dir) / name;
  const fs::path tmp = fs::path(dir) / (name + ".tmp." + std::to_string(::getpid()));
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    f.flush();
    if (!f) return Error("cannot write the rendezvous file").in_file(tmp.string());
  }
  fs::rename(tmp, final_path, ec);
  if (ec) return Error::format("cannot rename into place: {}", ec.message()).in_file(final_path.string());
  return Ok{};
}

Result<std::vector<uint8_t>> rendezvous_wait(const std::string& dir, const std::string& name, size_t expected_size,
                                             double timeout_s) {
  namespace fs = std::filesystem;
  const fs::path path = fs::path(dir) / name;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    std::ifstream f(path, std::ios::binary);
    if (f) {
      std::vector<uint8_t> out(expected_size + 1);
      f.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(out.size()));
      const size_t got = static_cast<size_t>(f.gcount());
      if (got != expected_size)
        return Error::format("rendezvous file holds {} bytes, expected {}", got, expected_size).in_file(path.string());
      out.resize(expected_size);
      return out;
    }
    if (std::chrono::steady_clock::now() > deadline)
      return Error::format("rank 0 did not publish the rendezvous file within {} s (is the directory shared by every "
                           "rank, and did rank 0 start?)",
                           timeout_s)
          .in_file(path.string());
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace moebius::parallel
