// `moebius bench attention`: the CUDA attention kernels (src/kernels/attention.cuh) on a paged
// bf16 KV cache with random contents, timed by CUDA-graph replay between CUDA events.
//
//   decode   batch sequences, one query token each, every sequence at `context` tokens: the one
//            decode kernel (split blocks, the last per (sequence, kv head) merges, QK-norm +
//            RoPE + the K/V write of the new token folded in), with the splits and keys per split
//            it chooses for that context. Counted bytes: the K and V rows
//            read, batch * context * nkv * hd * 2 (K, V) * 2 bytes (q, out and the split partials
//            are < 1% at these sizes and not counted). Several
//            cache copies ("sets", like layers) are captured back to back so that the bytes touched
//            per replay exceed 200 MB and the 50 MB L2 cannot serve a replay from the previous one.
//            Reported: us per launch, GB/s, and the fraction of the device's HBM read rate
//            (--ceilings: the H200's measured 4.57 TB/s on an H200, else measured at start).
//   prefill  batch fresh prompts of `context` tokens (q_len = context, causal). Counted flops:
//            QK^T and PV over the causal triangle, 4 * nh * hd * context * (context + 1) / 2 per
//            sequence. Reported: us, TFLOP/s and the fraction of the bf16 dense peak (791 TFLOP/s
//            on the H200, as bench moe). Configurations over 65536 tokens are skipped.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/geometry.h"
#include "core/error.h"

#ifdef MOEBIUS_HAS_CUDA
#include <cuda_runtime_api.h>

#include "core/memory.h"
#include "cpu/rope.h"
#include "kernels/attention.cuh"
#include "cli/graph_timer.h"
#include "kernels/cuda_check.h"
#include "kernels/fill.cuh"
#include "runtime/device_ceilings.h"
#endif

namespace moebius::cli {
namespace {

struct BenchAttentionOptions {
  int heads = 32;  // Qwen3-30B-A3B
  int kv_heads = 4;
  int head_dim = 128;
  int block_size = 16;
  std::string mode = "decode";
  std::string context = "1024,10240";
  std::string batch = "1,8,64";
  int iters = 20;
  int max_splits = 0;  // decode: 0 = the planner's choice, else this many splits at most
  std::string merge = "auto";  // decode: auto (the planner's), cluster or workspace
  uint64_t seed = 1;
  std::string ceilings = "auto";  // runtime::device_ceilings
};

#ifdef MOEBIUS_HAS_CUDA

template <typename T>
T* device_alloc(size_t count) {
  void* p = nullptr;
  CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)));
  return static_cast<T*>(p);
}

Status run(const BenchAttentionOptions& o) {
  // The options first, so that a bad one is named on machines without a GPU too.
  if (o.mode != "decode" && o.mode != "prefill")
    return Error::format("expected decode or prefill, got '{}'", o.mode).in_field("--mode");
  if (o.head_dim != 16 && o.head_dim != 64 && o.head_dim != 128)
    return Error::format("the kernels support head_dim 16, 64, 128, not {}", o.head_dim).in_field("--head-dim");
  if (o.kv_heads <= 0 || o.heads % o.kv_heads != 0)
    return Error::format("--kv-heads {} must divide --heads {}", o.kv_heads, o.heads).in_field("--kv-heads");
  if (o.mode == "decode" && o.heads / o.kv_heads > 16)
    return Error("decode supports at most 16 query heads per kv head").in_field("--heads");
  if (o.block_size <= 0) return Error("must be positive").in_field("--block-size");
  if (o.max_splits < 0 || o.max_splits > 256) return Error("must be in [0, 256]").in_field("--max-splits");
  if (o.merge != "auto" && o.merge != "cluster" && o.merge != "workspace")
    return Error::format("expected auto, cluster or workspace, got '{}'", o.merge).in_field("--merge");
  MOEBIUS_ASSIGN_OR_RETURN(std::vector<int64_t> contexts, parse_int_list(o.context, "--context", 1 << 20));
  MOEBIUS_ASSIGN_OR_RETURN(std::vector<int64_t> batches, parse_int_list(o.batch, "--batch", 4096));
  if (!cuda_available()) return Error("no CUDA device is visible");
  MOEBIUS_ASSIGN_OR_RETURN(const runtime::DeviceCeilings ceilings, runtime::device_ceilings(o.ceilings));
  const bool decode = o.mode == "decode";
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("moebius bench attention  %s (%s)  nh=%d nkv=%d hd=%d block=%d; ceilings %.2f TB/s, %.0f TFLOP/s (%s)\n",
              o.mode.c_str(), prop.name, o.heads, o.kv_heads, o.head_dim, o.block_size,
              ceilings.hbm_read_bytes_per_s / 1e12, ceilings.bf16_flops_per_s / 1e12, ceilings.source.c_str());
  if (decode)
    std::printf("%8s %6s %5s %7s %5s %5s %10s %10s %9s %8s\n", "context", "batch", "sets", "splits", "part", "merge",
                "us", "KV MB", "GB/s", "of HBM");
  else
    std::printf("%8s %6s %10s %10s %9s %8s\n", "context", "batch", "us", "GFLOP", "TFLOP/s", "of peak");

  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int64_t row = int64_t{o.heads} * o.head_dim;
  for (int64_t ctx : contexts)
    for (int64_t batch : batches) {
      const int64_t q_rows = decode ? batch : batch * ctx;
      if (!decode && q_rows > 65536) {
        std::printf("%8lld %6lld   skipped (over 65536 tokens)\n", static_cast<long long>(ctx),
                    static_cast<long long>(batch));
        continue;
      }
      const int64_t blocks_per_seq = (ctx + o.block_size - 1) / o.block_size;
      const int64_t blocks = batch * blocks_per_seq;
      const int64_t pool = blocks * o.kv_heads * o.block_size * o.head_dim;  // elements per K or V
      const double kv_bytes = 2.0 * batch * ctx * o.kv_heads * o.head_dim * 2.0;
      size_t free_b = 0, total_b = 0;
      CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
      int sets = decode ? static_cast<int>(std::ceil(200e6 / kv_bytes)) : 1;
      sets = std::clamp(sets, 1, 64);
      sets = std::min<int64_t>(sets, static_cast<int64_t>(0.5 * static_cast<double>(free_b) / (4.0 * pool)));
      if (sets < 1) {
        std::printf("%8lld %6lld   skipped (cache does not fit)\n", static_cast<long long>(ctx),
                    static_cast<long long>(batch));
        continue;
      }
      auto* k = device_alloc<__nv_bfloat16>(static_cast<size_t>(pool) * sets);
      auto* v = device_alloc<__nv_bfloat16>(static_cast<size_t>(pool) * sets);
      kernels::launch_fill_random_bf16(k, static_cast<size_t>(pool) * sets, 1.0f, o.seed, stream);
      kernels::launch_fill_random_bf16(v, static_cast<size_t>(pool) * sets, 1.0f, o.seed + 1, stream);
      auto* q = device_alloc<__nv_bfloat16>(static_cast<size_t>(q_rows * row));
      auto* out = device_alloc<__nv_bfloat16>(static_cast<size_t>(q_rows * row));
      kernels::launch_fill_random_bf16(q, static_cast<size_t>(q_rows * row), 2.0f, o.seed + 2, stream);
      // Sequence s owns blocks [s * blocks_per_seq, (s + 1) * blocks_per_seq).
      std::vector<int32_t> table(static_cast<size_t>(blocks)), lens(static_cast<size_t>(batch), static_cast<int32_t>(ctx)),
          cu(static_cast<size_t>(batch + 1));
      for (int64_t i = 0; i < blocks; ++i) table[static_cast<size_t>(i)] = static_cast<int32_t>(i);
      for (int64_t s = 0; s <= batch; ++s) cu[static_cast<size_t>(s)] = static_cast<int32_t>(s * (decode ? 1 : ctx));
      const int32_t n_live = static_cast<int32_t>(batch);
      auto* d_table = device_alloc<int32_t>(table.size());
      auto* d_lens = device_alloc<int32_t>(lens.size());
      auto* d_cu = device_alloc<int32_t>(cu.size());
      auto* d_n = device_alloc<int32_t>(1);
      CUDA_CHECK(cudaMemcpy(d_table, table.data(), 4 * table.size(), cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemcpy(d_lens, lens.data(), 4 * lens.size(), cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemcpy(d_cu, cu.data(), 4 * cu.size(), cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemcpy(d_n, &n_live, 4, cudaMemcpyHostToDevice));
      const kernels::AttentionDims dims{o.heads, o.kv_heads, o.head_dim, o.block_size,
                                        static_cast<int>(blocks_per_seq)};
      kernels::AttentionDecodePlan plan = kernels::plan_attention_decode(
          dims, static_cast<int>(batch), static_cast<int>(ctx), prop.multiProcessorCount);
      if (o.max_splits > 0) {  // a sweep of the split count: clusters when they may hold that many
        plan.max_splits = o.max_splits;
        plan.cluster_merge = o.max_splits > 1 && o.max_splits <= kernels::attention_decode_cluster_cap(dims);
      }
      if (o.merge == "workspace") plan.cluster_merge = false;
      if (o.merge == "cluster" && plan.max_splits > 1 && !plan.cluster_merge) {
        std::printf("%8lld %6lld   skipped (--merge cluster: %d splits are not one cluster)\n", static_cast<long long>(ctx),
                    static_cast<long long>(batch), plan.max_splits);
        continue;
      }
      const size_t ws_bytes = decode ? kernels::attention_decode_workspace_bytes(dims, plan) : 0;
      auto* ws = device_alloc<uint8_t>(ws_bytes);
      if (ws_bytes > 0) kernels::init_attention_decode_workspace(ws, dims, plan, stream);
      // Decode takes the new token raw (the qkv GEMV's output) and does QK-norm + RoPE + the K/V
      // write itself: q (random, as the GEMV left it), k and v rows, norm weights of 1, Qwen3's theta.
      const int64_t kv_row = int64_t{o.kv_heads} * o.head_dim;
      auto* k_new = device_alloc<__nv_bfloat16>(static_cast<size_t>(batch * kv_row));
      auto* v_new = device_alloc<__nv_bfloat16>(static_cast<size_t>(batch * kv_row));
      kernels::launch_fill_random_bf16(k_new, static_cast<size_t>(batch * kv_row), 1.0f, o.seed + 3, stream);
      kernels::launch_fill_random_bf16(v_new, static_cast<size_t>(batch * kv_row), 1.0f, o.seed + 4, stream);
      const std::vector<float> ones(static_cast<size_t>(o.head_dim), 1.0f), inv = cpu::rope_inv_freq(1e6, o.head_dim);
      auto* d_norm = device_alloc<float>(ones.size());
      auto* d_inv = device_alloc<float>(inv.size());
      CUDA_CHECK(cudaMemcpy(d_norm, ones.data(), 4 * ones.size(), cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemcpy(d_inv, inv.data(), 4 * inv.size(), cudaMemcpyHostToDevice));
      const kernels::AttentionDecodeToken token{q, row, k_new, kv_row, v_new, kv_row, d_norm, d_norm, d_inv, 1e-6f};
      // Every sequence is at `ctx`: this is the split the kernel picks on the device for each.
      const kernels::AttentionDecodeSplit split = kernels::attention_decode_split(static_cast<int>(ctx), plan.max_splits);
      CUDA_CHECK(cudaStreamSynchronize(stream));

      const double us = time_graph_us(stream, o.iters, sets, [&] {
        for (int i = 0; i < sets; ++i) {
          __nv_bfloat16* ki = k + static_cast<size_t>(pool) * i;
          __nv_bfloat16* vi = v + static_cast<size_t>(pool) * i;
          if (decode)
            kernels::launch_attention_decode(token, d_lens, d_n, ki, vi, d_table, dims, plan, ws_bytes ? ws : nullptr,
                                             out, stream);
          else
            kernels::launch_attention_prefill(q, row, d_cu, d_lens, d_n, ki, vi, d_table, dims,
                                              static_cast<int>(batch), static_cast<int>(ctx), out, stream);
        }
      });
      if (decode) {
        const double gbs = kv_bytes / (us * 1e-6) / 1e9;
        const char* merge = split.splits == 1 ? "-" : (plan.cluster_merge ? "clus" : "ws");
        std::printf("%8lld %6lld %5d %7d %5d %5s %10.2f %10.2f %9.1f %7.1f%%\n", static_cast<long long>(ctx),
                    static_cast<long long>(batch), sets, split.splits, split.partition, merge, us, kv_bytes / 1e6, gbs,
                    100.0 * gbs * 1e9 / ceilings.hbm_read_bytes_per_s);
      } else {
        const double flops = 2.0 * o.heads * o.head_dim * static_cast<double>(ctx) * (ctx + 1) * batch;
        const double tf = flops / (us * 1e-6) / 1e12;
        std::printf("%8lld %6lld %10.2f %10.2f %9.1f %7.1f%%\n", static_cast<long long>(ctx),
                    static_cast<long long>(batch), us, flops / 1e9, tf, 100.0 * tf * 1e12 / ceilings.bf16_flops_per_s);
      }
      std::fflush(stdout);
      for (void* p : {static_cast<void*>(k), static_cast<void*>(v), static_cast<void*>(q), static_cast<void*>(out),
                      static_cast<void*>(d_table), static_cast<void*>(d_lens), static_cast<void*>(d_cu),
                      static_cast<void*>(d_n), static_cast<void*>(ws), static_cast<void*>(k_new),
                      static_cast<void*>(v_new), static_cast<void*>(d_norm), static_cast<void*>(d_inv)})
        CUDA_CHECK(cudaFree(p));
    }
  CUDA_CHECK(cudaStreamDestroy(stream));
  return Ok{};
}

#else

Status run(const BenchAttentionOptions&) { return Error("this build of moebius has no CUDA support"); }

#endif  // MOEBIUS_HAS_CUDA

}  // namespace

void register_bench_attention(CLI::App& bench) {
  auto opts = std::make_shared<BenchAttentionOptions>();
  CLI::App* cmd = bench.add_subcommand("attention", "time the CUDA paged attention kernels (decode or prefill)");
  cmd->add_option("--mode", opts->mode, "decode or prefill")->capture_default_str();
  cmd->add_option("--heads", opts->heads, "query heads")->capture_default_str();
  cmd->add_option("--kv-heads", opts->kv_heads, "KV heads")->capture_default_str();
  cmd->add_option("--head-dim", opts->head_dim, "head dimension: 16, 64 or 128")->capture_default_str();
  cmd->add_option("--block-size", opts->block_size, "tokens per KV cache block")->capture_default_str();
  cmd->add_option("--context", opts->context, "comma-separated context lengths")->capture_default_str();
  cmd->add_option("--batch", opts->batch, "comma-separated batch sizes (sequences)")->capture_default_str();
  cmd->add_option("--iters", opts->iters, "graph replays timed per configuration")->capture_default_str();
  cmd->add_option("--seed", opts->seed, "random seed")->capture_default_str();
  cmd->add_option("--max-splits", opts->max_splits,
                  "decode: at most this many split blocks per (sequence, kv head); 0 = the planner's choice")
      ->capture_default_str();
  cmd->add_option("--merge", opts->merge,
                  "decode: how splits merge: auto (the planner's choice), cluster (shared memory of a thread-block "
                  "cluster) or workspace (global memory, the last split)")
      ->capture_default_str();
  add_ceilings_option(cmd, &opts->ceilings);
  cmd->final_callback([opts] {
    Status s = run(*opts);
    if (!s.ok()) {
      std::fprintf(stderr, "moebius bench attention: error: %s\n", s.error().what().c_str());
      throw CLI::RuntimeError(2);
    }
  });
}

}  // namespace moebius::cli
