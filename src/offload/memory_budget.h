// The GPU memory budget (`--gpu-memory-budget GB|auto`): what must stay on the GPU comes first
// (attention and dense weights, embeddings, routers, the KV cache, the workspace, the DMA staging
// buffer); the experts get what is left, as a number of resident experts per MoE layer
// (placement.h picks which). The cold experts go to ONE pinned host allocation made at load
// (never grown at runtime), checked here against the host's available memory, so running out is
// an error at start-up and never the OOM killer later.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"

namespace moebius::offload {

inline constexpr uint64_t kGiB = 1ull << 30;

// `--gpu-memory-budget`: "auto", or a positive number of GiB (a "24 GB" card holds 24 GiB).
struct BudgetSpec {
  bool is_auto = false;
  uint64_t bytes = 0;  // when !is_auto
};
Result<BudgetSpec> parse_gpu_memory_budget(const std::string& text, const std::string& field = "--gpu-memory-budget");
// "auto": the device's free memory at load (cudaMemGetInfo) less a margin of max(1 GiB, 5%) for
// the CUDA context's later growth (cuBLAS handles, graph instantiation, fragmentation).
uint64_t auto_budget_bytes(uint64_t device_free_bytes);

struct BudgetRequest {
  uint64_t budget = 0;              // device bytes the model may use
  uint64_t non_expert_weights = 0;  // attention, norms, routers, dense MLPs, embeddings, lm_head
  uint64_t kv_cache = 0;
  uint64_t workspace = 0;
  uint64_t staging = 0;             // DMA staging buffer (0 without staging)
  uint64_t expert_bytes = 0;        // one expert's packed weights + scales (every MoE layer alike)
  int num_moe_layers = 0;
  int num_experts = 0;
};

struct BudgetPlan {
  uint64_t fixed = 0;          // non-expert weights + KV + workspace + staging
  uint64_t expert_budget = 0;  // budget - fixed
  int64_t resident_total = 0;  // experts on the GPU, all layers
  int64_t cold_total = 0;      // experts in pinned host memory
  uint64_t pinned_bytes = 0;   // cold_total * expert_bytes
  std::vector<int> per_layer;  // resident experts per MoE layer (placement.h per_layer_counts)
  bool all_resident() const { return cold_total == 0; }
};

// Error (field --gpu-memory-budget) naming every number when the budget cannot hold the fixed part.
Result<BudgetPlan> plan_budget(const BudgetRequest& r);
std::string format_budget_plan(const BudgetRequest& r, const BudgetPlan& p);

// MemAvailable of /proc/meminfo in bytes (0 when it cannot be read).
uint64_t host_available_bytes();
// The pinned allocation must leave max(4 GiB, 10%) of the host's available memory to everything
// else (page cache of an mmap'd checkpoint, the process itself); error naming the numbers otherwise.
Status check_host_memory(uint64_t pinned_bytes, uint64_t available_bytes);

}  // namespace moebius::offload
