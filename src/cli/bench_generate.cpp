// `moebius bench generate`: the whole CUDA model, single stream.
//
//   moebius bench generate --geometry qwen3-30b-a3b --load-format dummy --experts nvfp4
//                          [--context 1024,10240] [--prefill 1024] [--decode-steps 64]
//   moebius bench generate --model DIR [--experts ...]
//
// Prefill: a fresh prompt of --prefill random tokens in one forward (eager), timed on the host
// around forward() (which ends in a stream synchronize), best of 3 after a warm-up.
// Decode at context C: the KV cache is filled to C tokens by prefill chunks, then --decode-steps
// single-token steps replay the batch-1 CUDA graph back to back (the host enqueues step i+1 while
// the GPU runs step i; one synchronize at the end), after 3 warm-up steps (the first captures the
// graph). Tokens are random ids, not sampled: this times the model, not the sampler.
//
// Counted bytes: decode reads Qwen3MoeCuda::decode_weight_bytes() per token (dense weights,
// routers, top_k experts per MoE layer, lm_head) plus C * kv_bytes_per_context_token() of KV
// cache. The floor is bytes / the HBM read rate (--ceilings: the H200's measured 4.57 TB/s on an
// H200, docs/PERF.md; measured at start on other GPUs);
// "% floor" is floor time / measured time. Prefill reads every weight once per forward
// (total_weight_bytes), so its bytes floor is weak (prefill is compute-bound); it is printed for
// completeness.
//
// Expert offload (--gpu-memory-budget GB|auto [--placement FILE], docs/OFFLOAD.md): cold experts are
// read from pinned host memory. The "pcie" rows give the bytes moved over PCIe per token
// (Qwen3MoeCuda::last_step_cold_bytes: zero-copy reads from the routing, or a staged layer's DMA;
// prefill from the timed forward, decode averaged over kPcieSteps extra steps after the timed ones) and that rate against --pcie-gbps
// (55.3 GB/s: pinned cudaMemcpy host-to-device measured on the H200).
// With --expert-cache lru|freq the "expert cache" rows give, per run (the timed prefills, the timed
// decode steps at each context), the hit rate (routed (token, expert) pairs whose expert was on the
// GPU), the swaps and their PCIe bytes per token, counted over the steps whose routing reached the
// cache during the run (it arrives one step late, two in the back-to-back decode loop:
// Qwen3MoeCuda::expert_cache_stats); the "pcie" rows add the swap bytes per token to the reads.
// With --expert-prefetch N the "expert prefetch" rows give, over the same extra decode steps, the
// experts copied ahead per token and how many of them were routed to (Qwen3MoeCuda::
// last_step_prefetch); the "pcie" rows count each copy once and no zero-copy read for its hits.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/geometry.h"
#include "cli/progress.h"
#include "core/error.h"
#include "model/generate.h"
#include "model/qwen3_moe_config.h"
#include "model/weight_source.h"

#ifdef MOEBIUS_HAS_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda_check.h"
#include "model/block_allocator.h"
#include "model/qwen3_moe_cuda.h"
#include "runtime/device_ceilings.h"
#endif

namespace moebius::cli {
namespace {

struct BenchGenerateOptions {
  std::string geometry;
  std::string model_dir;
  std::string load_format = "dummy";
  std::string experts = "nvfp4";
  std::string context = "1024,10240";
  int prefill = 1024;
  int decode_steps = 64;
  int group_size = 128;
  uint64_t seed = 1;
  std::string ceilings = "auto";
  bool no_autotune = false;
  std::string gpu_memory_budget;
  std::string placement_file;
  std::string cold_path = "auto";
  offload::ExpertCacheFlags expert_cache;
  int expert_prefetch = 0;
  int expert_dma = -1;  // Qwen3MoeCudaOptions::expert_dma_slots
  int max_resident_experts = -1;
  double pcie_gbps = 55.3;
};

// --expert-cache and its settings (checked in every build, before any device work).
Result<std::optional<offload::CacheOptions>> expert_cache_options(const BenchGenerateOptions& o) {
  return offload::parse_expert_cache_flags(o.expert_cache, !o.gpu_memory_budget.empty() || o.max_resident_experts >= 0);
}

#ifdef MOEBIUS_HAS_CUDA

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Status run(const BenchGenerateOptions& o) {
  const model::WeightSource source{o.model_dir, o.geometry, o.load_format};
  MOEBIUS_TRY(model::validate_weight_source(source));
  if (o.prefill < 1) return Error::format("must be >= 1, got {}", o.prefill).in_field("--prefill");
  if (o.decode_steps < 1) return Error::format("must be >= 1, got {}", o.decode_steps).in_field("--decode-steps");
  MOEBIUS_ASSIGN_OR_RETURN(std::vector<int64_t> contexts, parse_int_list(o.context, "--context", int64_t{1} << 20));
  MOEBIUS_ASSIGN_OR_RETURN(std::optional<WeightFormat> experts, model::parse_experts_format(o.experts));
  MOEBIUS_ASSIGN_OR_RETURN(model::Qwen3MoeConfig config, model::weight_source_config(source));
  MOEBIUS_ASSIGN_OR_RETURN(std::optional<offload::CacheOptions> expert_cache, expert_cache_options(o));
  constexpr int kWarmup = 3;
  constexpr int kPcieSteps = 8;
  const int64_t max_ctx = *std::max_element(contexts.begin(), contexts.end());
  const int64_t need = std::max<int64_t>(max_ctx + kWarmup + o.decode_steps + kPcieSteps, o.prefill);
  if (need > config.context_limit())
    return Error::format("context {} + {} steps exceeds the model's {} positions", max_ctx, o.decode_steps,
                         config.context_limit())
        .in_field("--context");

  // Before the model loads: measuring needs free device memory.
  MOEBIUS_ASSIGN_OR_RETURN(const runtime::DeviceCeilings ceilings, runtime::device_ceilings(o.ceilings));
  model::Qwen3MoeCudaOptions co;
  co.experts_format = experts;
  co.experts_group_size = o.group_size;
  co.max_context = static_cast<int>(need);
  co.max_tokens = o.prefill;
  co.max_seqs = 1;
  co.graph_batches = {1};
  co.seed = o.seed;
  co.autotune = !o.no_autotune;
  co.gpu_memory_budget = o.gpu_memory_budget;
  co.placement_file = o.placement_file;
  co.cold_path = o.cold_path;
  co.max_resident_experts = o.max_resident_experts;
  co.expert_cache = expert_cache;
  co.expert_prefetch = o.expert_prefetch;
  co.expert_dma_slots = o.expert_dma;
  ProgressBar bar("loading layers");
  co.progress = [&bar](int done, int total) { bar.update(done, total); };
  MOEBIUS_ASSIGN_OR_RETURN(std::unique_ptr<model::Qwen3MoeCuda> m, model::Qwen3MoeCuda::open(source, co));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("moebius bench generate  %s  %s (L=%d H=%lld E=%d k=%d V=%lld)  experts=%s  weights=%s\n", prop.name,
              o.geometry.empty() ? o.model_dir.c_str() : o.geometry.c_str(), config.num_hidden_layers,
              static_cast<long long>(config.hidden_size), config.num_experts, config.num_experts_per_tok,
              static_cast<long long>(config.vocab_size), moe::kernel_format_name(m->experts_format()),
              o.load_format.c_str());
  std::fputs(model::format_memory_plan(m->memory_plan()).c_str(), stdout);
  const double wbytes = static_cast<double>(m->decode_weight_bytes());
  const double kv_per_ctx = static_cast<double>(m->kv_bytes_per_context_token());
  std::printf("decode weight bytes per token: %.2f MB; KV bytes per context token: %.1f KB; floor %.2f TB/s (%s)\n",
              wbytes / 1e6, kv_per_ctx / 1e3, ceilings.hbm_read_bytes_per_s / 1e12, ceilings.source.c_str());

  std::mt19937 rng(static_cast<uint32_t>(o.seed));
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(config.vocab_size - 1));
  auto random_ids = [&](int64_t n) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (auto& x : v) x = tok(rng);
    return v;
  };
  model::BlockAllocator blocks(m->num_blocks());
  std::vector<float> logits(static_cast<size_t>(config.vocab_size));
  // Prefills tokens [start, start + ids.size()) of the sequence owning `table`, in max_tokens chunks.
  auto prefill = [&](const std::vector<int32_t>& ids, int64_t start, const std::vector<int32_t>& table) -> Status {
    for (int64_t off = 0; off < static_cast<int64_t>(ids.size()); off += m->max_tokens()) {
      const int64_t n = std::min<int64_t>(m->max_tokens(), static_cast<int64_t>(ids.size()) - off);
      const model::SequenceStep seq{std::span<const int32_t>(ids.data() + off, static_cast<size_t>(n)), start + off,
                                    table};
      MOEBIUS_ASSIGN_OR_RETURN(model::StepBatch b, m->make_batch(std::span<const model::SequenceStep>(&seq, 1)));
      MOEBIUS_TRY(m->forward(b, logits.data()));
    }
    return Ok{};
  };

  std::vector<std::string> pcie_rows, cache_rows, prefetch_rows, dma_rows;
  // The expert cache's counts over one run; its swap bytes per token for the pcie rows.
  auto cache_run = [&](const char* phase, int64_t context, const offload::ModelCacheStats& before) -> double {
    if (!m->expert_cache_on()) return 0.0;
    const offload::ModelCacheStats r = m->expert_cache_stats().since(before);
    const double tokens = static_cast<double>(std::max<uint64_t>(r.tokens, 1));
    cache_rows.push_back(fmt::format("{:<8} {:>8} {:>9.1f}% {:>10.3f} {:>10.2f} {:>7} {:>7}", phase, context,
                                     100.0 * r.hit_rate(), static_cast<double>(r.swaps) / tokens,
                                     static_cast<double>(r.swap_bytes) / tokens / 1e6, r.steps, r.dropped_steps));
    return static_cast<double>(r.swap_bytes) / tokens;
  };
  std::printf("\n%-8s %8s %10s %10s %10s %10s %9s %9s\n", "phase", "context", "tok/s", "us/token", "MB/token",
              "GB/s", "floor t/s", "% floor");
  // Prefill.
  {
    std::vector<int32_t> table;
    MOEBIUS_TRY(blocks.ensure(table, o.prefill, m->block_size()));
    const std::vector<int32_t> ids = random_ids(o.prefill);
    MOEBIUS_TRY(prefill(ids, 0, table));  // warm-up
    double best = 1e30;
    const offload::ModelCacheStats cache_before = m->expert_cache_stats();
    for (int r = 0; r < 3; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      MOEBIUS_TRY(prefill(ids, 0, table));
      best = std::min(best, seconds_since(t0));
    }
    const double swap_bytes = cache_run("prefill", o.prefill, cache_before);  // per token
    double pcie_bytes = 0;
    if (m->offloaded()) {  // one more prefill with the routing captured (untimed)
      m->set_routing_capture(true);
      MOEBIUS_TRY(prefill(ids, 0, table));
      pcie_bytes = static_cast<double>(m->last_step_cold_bytes(std::min(o.prefill, m->max_tokens())));
      m->set_routing_capture(false);
    }
    blocks.release(table);
    const double tok_s = o.prefill / best;
    if (m->offloaded()) {
      const double per_token = pcie_bytes / o.prefill + swap_bytes;
      pcie_rows.push_back(fmt::format("{:<8} {:>8} {:>10.2f} {:>10.2f} {:>10.1f} {:>8.1f}%", "prefill", o.prefill,
                                      per_token / 1e6, swap_bytes / 1e6, per_token * tok_s / 1e9,
                                      100.0 * per_token * tok_s / 1e9 / o.pcie_gbps));
    }
    const double bytes = static_cast<double>(m->total_weight_bytes()) * std::ceil(double(o.prefill) / m->max_tokens());
    const double floor_s = bytes / ceilings.hbm_read_bytes_per_s;
    std::printf("%-8s %8d %10.1f %10.2f %10.2f %10.1f %9.1f %8.1f%%\n", "prefill", o.prefill, tok_s,
                1e6 * best / o.prefill, bytes / o.prefill / 1e6, bytes / best / 1e9, o.prefill / floor_s,
                100.0 * floor_s / best);
    std::fflush(stdout);
  }
  // Decode at each context.
  for (int64_t C : contexts) {
    std::vector<int32_t> table;
    MOEBIUS_TRY(blocks.ensure(table, C + kWarmup + o.decode_steps + kPcieSteps, m->block_size()));
    MOEBIUS_TRY(prefill(random_ids(C), 0, table));
    const std::vector<int32_t> ids = random_ids(kWarmup + o.decode_steps + kPcieSteps);
    int64_t pos = C;
    auto step = [&](int i) -> Status {
      const model::SequenceStep seq{std::span<const int32_t>(&ids[static_cast<size_t>(i)], 1), pos++, table};
      MOEBIUS_ASSIGN_OR_RETURN(model::StepBatch b, m->make_batch(std::span<const model::SequenceStep>(&seq, 1)));
      return m->enqueue(b);
    };
    // A window that crosses from one decode graph's context range to the next
    // ([TAG_ATTN_CLUSTER_MERGE], [TAG_ATTN_PORTABLE_CLUSTER]) captures the second graph inside it
    // (one eager step): then it runs again from C, the same ids rewriting the same KV, and only
    // that second pass is timed. A window within one graph runs once, so the expert cache's
    // counts (--expert-cache) see each step once.
    double secs = 0.0;
    offload::ModelCacheStats cache_before;
    int64_t dma_posts = 0;  // [TAG_EXPERT_ROUTED_DMA] over the timed steps
    uint64_t dma_bytes = 0;
    for (int pass = 0;; ++pass) {
      pos = C;
      for (int i = 0; i < kWarmup; ++i) MOEBIUS_TRY(step(i));
      CUDA_CHECK(cudaStreamSynchronize(m->stream()));
      const int64_t graphs_before = m->graph_steps();
      cache_before = m->expert_cache_stats();
      dma_posts = m->expert_dma_posts();
      dma_bytes = m->expert_dma_bytes();
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < o.decode_steps; ++i) MOEBIUS_TRY(step(kWarmup + i));
      CUDA_CHECK(cudaStreamSynchronize(m->stream()));
      secs = seconds_since(t0);
      dma_posts = m->expert_dma_posts() - dma_posts;
      dma_bytes = m->expert_dma_bytes() - dma_bytes;
      if (m->graph_steps() - graphs_before == o.decode_steps) break;
      if (pass == 1) return Error("decode steps did not run as CUDA graph replays (internal)");
    }
    const double tok_s = o.decode_steps / secs;
    if (m->expert_dma_on()) {
      const double per_token = static_cast<double>(dma_bytes) / o.decode_steps;
      dma_rows.push_back(fmt::format("{:<8} {:>8} {:>10.1f} {:>10.2f} {:>10.1f} {:>8.1f}%", "decode", C,
                                     static_cast<double>(dma_posts) / o.decode_steps, per_token / 1e6,
                                     per_token * tok_s / 1e9, 100.0 * per_token * tok_s / 1e9 / o.pcie_gbps));
    }
    const double swap_bytes = cache_run("decode", C, cache_before);  // per token
    if (m->offloaded()) {  // the routing of a few more steps (eager, captured), read back one by one
      double pcie = 0;
      model::Qwen3MoeCuda::PrefetchCounts pf;  // [TAG_EXPERT_PREFETCH] over the same steps
      m->set_routing_capture(true);
      for (int i = 0; i < kPcieSteps; ++i) {
        MOEBIUS_TRY(step(kWarmup + o.decode_steps + i));
        pcie += static_cast<double>(m->last_step_cold_bytes(1));
        const model::Qwen3MoeCuda::PrefetchCounts c = m->last_step_prefetch(1);
        pf.copied += c.copied;
        pf.hits += c.hits;
        pf.routed_cold += c.routed_cold;
      }
      m->set_routing_capture(false);
      if (m->expert_prefetch_on())
        prefetch_rows.push_back(fmt::format("{:<8} {:>8} {:>10.2f} {:>9.1f}% {:>9.1f}%", "decode", C,
                                            static_cast<double>(pf.copied) / kPcieSteps,
                                            100.0 * static_cast<double>(pf.hits) / std::max<double>(pf.copied, 1),
                                            100.0 * static_cast<double>(pf.hits) / std::max<double>(pf.routed_cold, 1)));
      pcie = pcie / kPcieSteps + swap_bytes;
      pcie_rows.push_back(fmt::format("{:<8} {:>8} {:>10.2f} {:>10.2f} {:>10.1f} {:>8.1f}%", "decode", C, pcie / 1e6,
                                      swap_bytes / 1e6, pcie * tok_s / 1e9, 100.0 * pcie * tok_s / 1e9 / o.pcie_gbps));
    }
    blocks.release(table);
    const double ctx_mid = static_cast<double>(C) + kWarmup + o.decode_steps / 2.0;
    for (const bool with_kv : {false, true}) {
      const double bytes = wbytes + (with_kv ? kv_per_ctx * ctx_mid : 0.0);
      const double floor_s = bytes / ceilings.hbm_read_bytes_per_s;
      std::printf("%-8s %8lld %10.1f %10.2f %10.2f %10.1f %9.1f %8.1f%%\n", with_kv ? "  +kv" : "decode",
                  static_cast<long long>(C), tok_s, 1e6 * secs / o.decode_steps, bytes / 1e6, bytes * tok_s / 1e9,
                  1.0 / floor_s, 100.0 * floor_s * tok_s);
    }
    std::fflush(stdout);
  }
  std::printf("(decode: weights only; +kv: weights plus the KV cache read at that context)\n");
  if (!pcie_rows.empty()) {
    std::printf("\nexpert offload: bytes moved over PCIe per token (zero-copy reads or staged copies, plus the "
                "expert cache's swaps), and that rate vs %.1f GB/s\n",
                o.pcie_gbps);
    std::printf("%-8s %8s %10s %10s %10s %9s\n", "phase", "context", "MB/token", "swap MB", "GB/s", "% PCIe");
    for (const std::string& r : pcie_rows) std::printf("%s\n", r.c_str());
  }
  if (!cache_rows.empty()) {
    std::printf("\nexpert cache (%s): routed (token, expert) pairs found resident, swaps per token (each moves two "
                "experts' bytes over PCIe), over the steps fed to the cache during the run\n",
                m->memory_plan().expert_cache.c_str());
    std::printf("%-8s %8s %10s %10s %10s %7s %7s\n", "phase", "context", "hit rate", "swaps/tok", "swap MB/tok",
                "steps", "dropped");
    for (const std::string& r : cache_rows) std::printf("%s\n", r.c_str());
  }
  if (!dma_rows.empty()) {
    std::printf("\nrouted expert DMA (%s): posts per token (one per MoE layer that chose a copy), bytes the copy "
                "engines moved per token, and that rate vs %.1f GB/s, over the timed steps\n",
                m->memory_plan().expert_dma.c_str(), o.pcie_gbps);
    std::printf("%-8s %8s %10s %10s %10s %9s\n", "phase", "context", "posts/tok", "MB/token", "GB/s", "% PCIe");
    for (const std::string& r : dma_rows) std::printf("%s\n", r.c_str());
  }
  if (!prefetch_rows.empty()) {
    std::printf("\nexpert prefetch (%s): experts copied ahead per token, the share of them routed to (precision), "
                "the share of the predicted layers' routed cold experts they covered (recall)\n",
                m->memory_plan().expert_prefetch.c_str());
    std::printf("%-8s %8s %10s %10s %10s\n", "phase", "context", "copied/tok", "precision", "recall");
    for (const std::string& r : prefetch_rows) std::printf("%s\n", r.c_str());
  }
  return Ok{};
}

#else

Status run(const BenchGenerateOptions& o) {
  MOEBIUS_TRY(expert_cache_options(o));  // a malformed flag is named the same way in every build
  return Error("this build of moebius has no CUDA support").in_field("--backend");
}

#endif  // MOEBIUS_HAS_CUDA

}  // namespace

void register_bench_generate(CLI::App& bench) {
  auto o = std::make_shared<BenchGenerateOptions>();
  CLI::App* cmd = bench.add_subcommand("generate", "time the whole CUDA model: prefill and single-stream decode");
  cmd->add_option("--geometry", o->geometry, "qwen3-30b-a3b or qwen3-235b-a22b (dummy weights)");
  cmd->add_option("--model", o->model_dir, "model directory (config.json; checkpoint unless --load-format dummy)");
  cmd->add_option("--load-format", o->load_format, "dummy (random weights) or auto (read the checkpoint)")
      ->capture_default_str();
  cmd->add_option("--experts", o->experts, "bf16, nvfp4, int4, int2")->capture_default_str();
  cmd->add_option("--context", o->context, "decode contexts, comma-separated")->capture_default_str();
  cmd->add_option("--prefill", o->prefill, "prefill length (one forward)")->capture_default_str();
  cmd->add_option("--decode-steps", o->decode_steps, "timed decode steps per context")->capture_default_str();
  cmd->add_option("--group-size", o->group_size, "int formats: K elements per scale")->capture_default_str();
  cmd->add_option("--seed", o->seed, "weights and token ids")->capture_default_str();
  cmd->add_flag("--no-autotune", o->no_autotune, "run the MoE kernels' heuristic configurations (no tuning)");
  add_offload_options(cmd, &o->gpu_memory_budget, &o->placement_file, &o->expert_cache, &o->expert_prefetch,
                      &o->expert_dma);
  cmd->add_option("--cold-path", o->cold_path, "prefill: auto (cost model), zero-copy or staged")
      ->capture_default_str();
  cmd->add_option("--max-resident-experts", o->max_resident_experts,
                  "at most this many experts per layer on the GPU (compare placements at one residency)");
  cmd->add_option("--pcie-gbps", o->pcie_gbps, "host-to-device rate the PCIe rows compare with")->capture_default_str();
  add_ceilings_option(cmd, &o->ceilings);
  cmd->final_callback([o] {
    Status s = run(*o);
    if (!s.ok()) {
      std::fprintf(stderr, "moebius bench generate: error: %s\n", s.error().what().c_str());
      throw CLI::RuntimeError(2);
    }
  });
}

}  // namespace moebius::cli
