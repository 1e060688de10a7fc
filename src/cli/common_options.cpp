// The flags several `moebius` commands share; declared in cli/commands.h.
#include "cli/commands.h"

#include <cstdlib>

#ifdef MOEBIUS_HAS_CUDA
#include "runtime/cuda_environment.h"
#endif

namespace moebius::cli {

void add_offload_options(CLI::App* cmd, std::string* gpu_memory_budget, std::string* placement_file,
                         offload::ExpertCacheFlags* expert_cache, int* expert_prefetch, int* expert_dma) {
  cmd->add_option("--gpu-memory-budget", *gpu_memory_budget,
                  "cuda: GiB of device memory for the model, or auto; experts that do not fit are read from "
                  "pinned host memory (default: every expert on the GPU)");
  cmd->add_option("--placement", *placement_file,
                  "cuda: routing profile (moebius profile-experts) choosing the resident experts (default: uniform)");
  cmd->add_option("--expert-cache", expert_cache->policy,
                  "cuda, with --gpu-memory-budget: off, or swap experts between the GPU and host memory as the "
                  "routing moves, lru or freq (frequency with decay); decided from each step's routing one step late")
      ->capture_default_str();
  cmd->add_option("--expert-cache-decay", expert_cache->decay,
                  "--expert-cache freq: score multiplier per step, in (0, 1]")
      ->capture_default_str();
  cmd->add_option("--expert-cache-swaps", expert_cache->max_swaps,
                  "--expert-cache: experts swapped in per MoE layer per step at most (each moves 2 experts' bytes over "
                  "PCIe); 0 only measures the hit rate")
      ->capture_default_str();
  // 8: kernels::kExpertPrefetchMaxSlots (the CUDA runner checks it again).
  cmd->add_option("--expert-prefetch", *expert_prefetch,
                  "cuda, with --gpu-memory-budget: after each MoE layer of a decode step, predict the next MoE layer's "
                  "routing and copy the down projections of up to N of its cold experts to the GPU while the layers "
                  "between run (2 measured best); 0: off")
      ->check(CLI::Range(0, 8))
      ->capture_default_str();
  // 16: kernels::kExpertDmaMaxSlots (the CUDA runner checks it again).
  cmd->add_option("--expert-dma", *expert_dma,
                  "cuda, with --gpu-memory-budget: in decode steps, copy up to N of each MoE layer's routed cold "
                  "experts to the GPU by the copy engines once the layer's routing is known (a host thread issues the "
                  "copies the GPU posts) instead of the kernels reading them over PCIe; 0: off (default: "
                  "$MOEBIUS_EXPERT_DMA_SLOTS, else off)")
      ->check(CLI::Range(0, 16))
      ->each([](const std::string& n) {
#ifdef MOEBIUS_HAS_CUDA
        // [TAG_CUDA_EAGER_LOADING] The copies need every module loaded before the first step; the
        // command's first CUDA call comes after parsing.
        if (std::atoi(n.c_str()) > 0) runtime::request_eager_module_loading();  // Range checked it first
#else
        (void)n;
#endif
      });  // no default shown: absent (-1) is the environment's choice, 0 is off
}

void add_ep_option(CLI::App* cmd, int* ep) {
  cmd->add_option("--ep", *ep, "expert parallelism: split the experts over N ranks (cpu: threads of this process; cuda: one worker "
                  "process per GPU, or one rank per process under mpirun)")
      ->capture_default_str();
}

void add_ceilings_option(CLI::App* cmd, std::string* mode) {
  cmd->add_option("--ceilings", *mode,
                  "cuda: the HBM read rate and bf16 peak the ratios divide by: auto (the H200's measured table on an "
                  "H200, else measured at start), table, or measure")
      ->check(CLI::IsMember({"auto", "table", "measure"}))
      ->capture_default_str();
}

}  // namespace moebius::cli
