// `moebius bench ep`: the expert-parallel MoE layer (moe/moe_layer_ep_cuda.h) on N GPUs of this
// machine, one NCCL rank per GPU, random weights of a named geometry. Ranks are threads of this
// process (--launch threads), worker processes of the built-in launcher (--launch processes:
// parallel/launcher.h, the ncclUniqueId through the file rendezvous), or the processes of
// `mpirun -np N moebius bench ep ...` (detected from OMPI_COMM_WORLD_*; no libmpi is linked). Every rank carries
// T tokens; per T it prints rank 0's CUDA-graph replay times of each phase (route, dispatch,
// experts, return, combine) and of the whole layer, in microseconds, with the dispatch and return
// bandwidth: wire GB/s counts the bytes NCCL moves to OTHER ranks (the capacity-padded regions,
// [TAG_EP_CAPACITY_SLOTS]), live GB/s only the live rows among them at uniform routing
// (T * k * (N - 1) / N rows), both against --nvlink-gbps (the per-direction link bandwidth; the
// default 450 is H100/H200 NVLink 4: 18 links x 25 GB/s). The whole layer is also timed on
// one GPU holding every expert (the single-GPU MoeLayerCuda) for comparison.
#include <unistd.h>

#include <cstdio>
#include <optional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "cli/geometry.h"
#include "core/error.h"

#if defined(MOEBIUS_HAS_CUDA) && defined(MOEBIUS_HAS_NCCL)
#include "cli/graph_timer.h"
#include "kernels/cuda_check.h"
#include "kernels/fill.cuh"
#include "moe/moe_layer_cuda.h"
#include "moe/moe_layer_ep_cuda.h"
#include "parallel/launcher.h"
#include "parallel/nccl_communicator.h"
#endif

namespace moebius::cli {
namespace {

struct BenchEpOptions {
  int ep = 1;
  std::string geometry = "qwen3-30b-a3b";
  std::string format = "nvfp4";
  std::string tokens = "1,8,64";
  int group_size = 128;
  int iters = 50;
  double nvlink_gbps = 450.0;
  uint64_t seed = 1;
  std::string launch = "threads";  // threads | processes (the built-in launcher); mpirun is detected
};

#if defined(MOEBIUS_HAS_CUDA) && defined(MOEBIUS_HAS_NCCL)

Result<moe::KernelFormat> ep_kernel_format(const std::string& s) {
  if (s == "bf16") return moe::KernelFormat::kBF16;
  if (s == "nvfp4") return moe::KernelFormat::kNvFp4;
  if (s == "int4") return moe::KernelFormat::kInt4;
  if (s == "int2") return moe::KernelFormat::kInt2;
  return Error::format("expected bf16, nvfp4, int4 or int2, not '{}'", s).in_field("--format");
}

struct Row {
  double phase_us[static_cast<int>(moe::EpPhase::kCount)] = {};
  double layer_us = 0, single_us = 0;
};

// One rank's measurements over every T (collective: every rank runs the same sequence). Rank 0
// also times the single-GPU layer and fills rows / wire bytes.
Status bench_rank(const BenchEpOptions& o, const MoeGeometry& g, moe::KernelFormat format,
                  const std::vector<int64_t>& tokens, parallel::NcclCommunicator& comm, std::vector<Row>& rows,
                  std::vector<size_t>& wire_dispatch, std::vector<size_t>& wire_return) {
  const int r = comm.rank();
  const cpu::MoeShape shape{g.hidden, g.intermediate, g.num_experts, g.top_k};
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int T = static_cast<int>(tokens[i]);
    moe::MoeEpCudaOptions opt;
    opt.capacity = T;
    MOEBIUS_ASSIGN_OR_RETURN(auto layer, moe::MoeLayerEpCuda::create_dummy(shape, format, o.group_size, comm, opt, o.seed));
    __nv_bfloat16 *x, *out;
    int32_t* n;
    CUDA_CHECK(cudaMalloc(&x, sizeof(__nv_bfloat16) * T * g.hidden));
    CUDA_CHECK(cudaMalloc(&out, sizeof(__nv_bfloat16) * T * g.hidden));
    CUDA_CHECK(cudaMalloc(&n, sizeof(int32_t)));
    kernels::launch_fill_random_bf16(x, static_cast<size_t>(T) * g.hidden, 1.0f, o.seed + 100 + r, stream);
    CUDA_CHECK(cudaMemcpyAsync(n, &T, 4, cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    Row row;
    Status st = Ok{};
    row.layer_us = time_graph_us(stream, o.iters, 1, [&] {
      if (st.ok()) st = layer->forward(x, n, out, stream);
    });
    for (int p = 0; p < static_cast<int>(moe::EpPhase::kCount) && st.ok(); ++p)
      row.phase_us[p] = time_graph_us(stream, o.iters, 1, [&] {
        if (st.ok()) st = layer->enqueue_phase(static_cast<moe::EpPhase>(p), x, n, out, stream);
      });
    MOEBIUS_TRY(st);
    if (r == 0) {
      // The single-GPU layer over all E experts, same T (rank 0 alone; the others wait at the
      // barrier below).
      moe::MoeCudaOptions so;
      so.capacity = T;
      MOEBIUS_ASSIGN_OR_RETURN(auto single, moe::MoeLayerCuda::create_dummy(shape, format, o.group_size, so, o.seed));
      row.single_us = time_graph_us(stream, o.iters, 1, [&] { single->forward(x, n, out, stream); });
      rows[i] = row;
      wire_dispatch[i] = layer->dispatch_wire_bytes();
      wire_return[i] = layer->return_wire_bytes();
    }
    comm.set_stream(stream);
    MOEBIUS_TRY(comm.barrier());
    CUDA_CHECK(cudaFree(x));
    CUDA_CHECK(cudaFree(out));
    CUDA_CHECK(cudaFree(n));
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
  return Ok{};
}

void print_rows(const BenchEpOptions& o, const MoeGeometry& g, int N, const char* how,
                const std::vector<int64_t>& tokens, const std::vector<Row>& rows,
                const std::vector<size_t>& wire_dispatch, const std::vector<size_t>& wire_return) {
  std::printf("bench ep: %s (H=%lld I=%lld E=%d k=%d) %s, EP=%d (%d experts per GPU, %s), every rank T tokens, "
              "rank 0's CUDA-graph replays, %d iters\n",
              g.name.c_str(), static_cast<long long>(g.hidden), static_cast<long long>(g.intermediate), g.num_experts,
              g.top_k, o.format.c_str(), N, g.num_experts / N, how, o.iters);
  std::printf("%6s %8s %10s %9s %9s %7s %9s %10s %9s %9s %9s %10s\n", "T", "route_us", "dispatch", "wireGB/s",
              "liveGB/s", "%link", "experts", "return_us", "wireGB/s", "combine", "layer_us", "1gpu_us");
  for (size_t i = 0; i < tokens.size(); ++i) {
    const Row& w = rows[i];
    const double remote = N > 1 ? static_cast<double>(N - 1) / N : 0.0;
    const double T = static_cast<double>(tokens[i]);
    const double d_us = w.phase_us[static_cast<int>(moe::EpPhase::kDispatch)];
    const double r_us = w.phase_us[static_cast<int>(moe::EpPhase::kReturn)];
    const double d_wire = static_cast<double>(wire_dispatch[i]) * remote;
    const double d_live = T * g.top_k * remote * (static_cast<double>(g.hidden) * 2 + 4);
    const double r_wire = static_cast<double>(wire_return[i]) * remote;
    const double d_gbps = d_wire / (d_us * 1e3), l_gbps = d_live / (d_us * 1e3), r_gbps = r_wire / (r_us * 1e3);
    std::printf("%6lld %8.1f %10.1f %9.1f %9.1f %6.1f%% %9.1f %10.1f %9.1f %9.1f %9.1f %10.1f\n",
                static_cast<long long>(tokens[i]), w.phase_us[static_cast<int>(moe::EpPhase::kRoute)], d_us, d_gbps,
                l_gbps, 100.0 * d_gbps / o.nvlink_gbps, w.phase_us[static_cast<int>(moe::EpPhase::kExperts)], r_us,
                r_gbps, w.phase_us[static_cast<int>(moe::EpPhase::kCombine)], w.layer_us, w.single_us);
  }
}

Status run_bench_ep(const BenchEpOptions& o) {
  MOEBIUS_ASSIGN_OR_RETURN(MoeGeometry g, parse_geometry(o.geometry));
  MOEBIUS_ASSIGN_OR_RETURN(moe::KernelFormat format, ep_kernel_format(o.format));
  MOEBIUS_ASSIGN_OR_RETURN(std::vector<int64_t> tokens, parse_int_list(o.tokens, "--tokens", 4096));
  if (o.iters < 1) return Error("must be at least 1").in_field("--iters");
  if (o.launch != "threads" && o.launch != "processes")
    return Error::format("expected threads or processes, not '{}'", o.launch).in_field("--launch");
  MOEBIUS_ASSIGN_OR_RETURN(std::optional<parallel::EpPlacement> placed, parallel::placement_from_env());
  std::vector<Row> rows(tokens.size());
  std::vector<size_t> wire_dispatch(tokens.size()), wire_return(tokens.size());

  if (placed) {  // one worker of the built-in launcher, or one mpirun process
    const parallel::EpPlacement& p = *placed;
    MOEBIUS_TRY(parallel::check_expert_split(g.num_experts, p.size));
    MOEBIUS_ASSIGN_OR_RETURN(auto comm, parallel::nccl_from_placement(p));
    MOEBIUS_TRY(bench_rank(o, g, format, tokens, *comm, rows, wire_dispatch, wire_return));
    if (p.rank == 0)
      print_rows(o, g, p.size, p.from_mpirun ? "mpirun processes" : "launcher processes", tokens, rows, wire_dispatch,
                 wire_return);
    return Ok{};
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) return Error("no CUDA device");
  if (o.ep < 1 || o.ep > devices)
    return Error::format("--ep {} needs {} GPUs, this machine has {}", o.ep, o.ep, devices).in_field("--ep");
  MOEBIUS_TRY(parallel::check_expert_split(g.num_experts, o.ep));
  const int N = o.ep;
  if (o.launch == "processes") {  // the built-in launcher: this binary once per rank
    char self[4096];
    const ssize_t len = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (len <= 0) return Error("cannot find this executable (/proc/self/exe)");
    self[len] = '\0';
    parallel::LaunchOptions lo;
    lo.size = N;
    lo.argv = {self, "bench", "ep", "--ep", std::to_string(N), "--geometry", o.geometry, "--format", o.format,
               "--tokens", o.tokens, "--group-size", std::to_string(o.group_size), "--iters", std::to_string(o.iters),
               "--nvlink-gbps", std::to_string(o.nvlink_gbps), "--seed", std::to_string(o.seed)};
    return parallel::launch_workers(lo);
  }
  MOEBIUS_ASSIGN_OR_RETURN(parallel::NcclId id, parallel::nccl_unique_id());
  std::vector<Status> status(static_cast<size_t>(N), Status(Ok{}));
  std::vector<std::thread> threads;
  for (int r = 0; r < N; ++r) {
    threads.emplace_back([&, r] {
      status[static_cast<size_t>(r)] = [&]() -> Status {
        MOEBIUS_ASSIGN_OR_RETURN(auto comm, parallel::NcclCommunicator::create(id, r, N, r));
        return bench_rank(o, g, format, tokens, *comm, rows, wire_dispatch, wire_return);
      }();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < N; ++r)
    if (!status[static_cast<size_t>(r)].ok())
      return std::move(status[static_cast<size_t>(r)]).error().with_context("rank " + std::to_string(r));
  print_rows(o, g, N, "threads", tokens, rows, wire_dispatch, wire_return);
  return Ok{};
}

#else

Status run_bench_ep(const BenchEpOptions&) {
  return Error("moebius bench ep needs a build with CUDA and NCCL (this one has neither or lacks NCCL)");
}

#endif

}  // namespace

void register_bench_ep(CLI::App& bench) {
  auto opts = std::make_shared<BenchEpOptions>();
  CLI::App* cmd = bench.add_subcommand("ep", "time the expert-parallel MoE layer on N GPUs (dispatch, combine)");
  cmd->add_option("--ep", opts->ep, "GPUs (ranks), one thread each; must divide E")->capture_default_str();
  cmd->add_option("--geometry", opts->geometry, "qwen3-30b-a3b, qwen3-235b-a22b, or H,I,E,k")->capture_default_str();
  cmd->add_option("--format", opts->format, "expert format: bf16, nvfp4, int4, int2")->capture_default_str();
  cmd->add_option("--tokens", opts->tokens, "comma-separated tokens per rank")->capture_default_str();
  cmd->add_option("--group-size", opts->group_size, "group size for int formats")->capture_default_str();
  cmd->add_option("--iters", opts->iters, "graph replays per measurement")->capture_default_str();
  cmd->add_option("--nvlink-gbps", opts->nvlink_gbps, "per-direction link bandwidth for the % column")
      ->capture_default_str();
  cmd->add_option("--seed", opts->seed, "random seed")->capture_default_str();
  cmd->add_option("--launch", opts->launch,
                  "threads (one process, a thread per GPU) or processes (the built-in launcher: one worker process "
                  "per GPU); under mpirun each process is one rank")
      ->capture_default_str();
  cmd->final_callback([opts] {
    Status s = run_bench_ep(*opts);
    if (!s.ok()) {
      std::fprintf(stderr, "moebius bench ep: error: %s\n", s.error().what().c_str());
      throw CLI::RuntimeError(2);
    }
  });
}

}  // namespace moebius::cli
