// The `moebius` subcommands. Each registers its flags on a CLI11 app and runs when selected.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

#include "offload/expert_cache.h"

namespace moebius::cli {

// Flags several commands share (common_options.cpp), registered with one name and help text.
// --gpu-memory-budget GB|auto, --placement FILE and the dynamic cache's --expert-cache off|lru|freq,
// --expert-cache-decay D, --expert-cache-swaps N (expert offload, docs/OFFLOAD.md; the values are
// checked by offload::parse_expert_cache_flags before the model loads).
void add_offload_options(CLI::App* cmd, std::string* gpu_memory_budget, std::string* placement_file,
                         offload::ExpertCacheFlags* expert_cache, int* expert_prefetch, int* expert_dma);
// --ep N (expert parallelism, docs/EXPERT_PARALLEL.md).
void add_ep_option(CLI::App* cmd, int* ep);
// --ceilings auto|table|measure: the HBM and bf16 ceilings a benchmark's ratios divide by
// (runtime/device_ceilings.h).
void add_ceilings_option(CLI::App* cmd, std::string* mode);

// `moebius bench moe`: time one MoE layer on a backend.
void register_bench_moe(CLI::App& bench);
// `moebius bench attention`: time the CUDA paged attention kernels (bench_attention.cpp).
void register_bench_attention(CLI::App& bench);
// `moebius bench gemv`: the dense decode projections, our GEMV kernel vs cuBLAS (bench_gemv.cpp).
void register_bench_gemv(CLI::App& bench);
// `moebius bench generate`: the whole CUDA model, prefill and decode tok/s (bench_generate.cpp).
void register_bench_generate(CLI::App& bench);
// `moebius bench ceilings`: this GPU's HBM, GEMM and host-link ceilings (bench_ceilings.cpp).
void register_bench_ceilings(CLI::App& bench);
// `moebius bench ep`: the expert-parallel MoE layer on N GPUs (bench_ep.cpp).
void register_bench_ep(CLI::App& bench);
// `moebius bench serve`: load-test an OpenAI-compatible server (bench_serve.cpp).
void register_bench_serve(CLI::App& bench);
// `moebius bench engine`: the serving engine's host time per step, no model (bench_engine.cpp).
void register_bench_engine(CLI::App& bench);
void register_generate(CLI::App& app);  // `moebius generate`: sample text from a model (generate.cpp)
// `moebius eval logprobs`: the teacher-forced logprob oracle (eval.cpp).
void register_eval(CLI::App& app);
// `moebius serve`: the OpenAI-compatible server (serve.cpp).
void register_serve(CLI::App& app);
// `moebius tune`: tune the CUDA MoE kernels per capacity bucket into the per-GPU cache (tune.cpp).
void register_tune(CLI::App& app);
// `moebius profile-experts`: routing counts and mass per layer and expert, as JSON (profile_experts.cpp).
void register_profile_experts(CLI::App& app);

}  // namespace moebius::cli
