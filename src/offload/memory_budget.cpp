#include "offload/memory_budget.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "offload/placement.h"

namespace moebius::offload {

namespace {
std::string gib(uint64_t b) { return fmt::format("{:.2f} GiB", static_cast<double>(b) / static_cast<double>(kGiB)); }
}  // namespace

Result<BudgetSpec> parse_gpu_memory_budget(const std::string& text, const std::string& field) {
  BudgetSpec s;
  if (text == "auto") {
    s.is_auto = true;
    return s;
  }
  char* end = nullptr;
  const double gb = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(gb) || gb <= 0 || gb > 1e6)
    return Error::format("'{}' is neither \"auto\" nor a positive number of GiB", text).in_field(field);
  s.bytes = static_cast<uint64_t>(gb * static_cast<double>(kGiB));
  return s;
}

uint64_t auto_budget_bytes(uint64_t free_bytes) {
  const uint64_t margin = std::max<uint64_t>(kGiB, free_bytes / 20);
  return free_bytes > margin ? free_bytes - margin : 0;
}

Result<BudgetPlan> plan_budget(const BudgetRequest& r) {
  BudgetPlan p;
  p.fixed = r.non_expert_weights + r.kv_cache + r.workspace + r.staging;
  if (p.fixed > r.budget)
    return Error::format(
               "a GPU memory budget of {} cannot hold what must stay on the GPU: non-expert weights {} + KV cache "
               "{} + workspace {} + staging {} = {}; raise the budget or lower --max-context / --kv-blocks",
               gib(r.budget), gib(r.non_expert_weights), gib(r.kv_cache), gib(r.workspace), gib(r.staging),
               gib(p.fixed))
        .in_field("--gpu-memory-budget");
  p.expert_budget = r.budget - p.fixed;
  const int64_t all = int64_t{r.num_moe_layers} * r.num_experts;
  p.resident_total = r.expert_bytes == 0 ? all : std::min<int64_t>(all, static_cast<int64_t>(p.expert_budget / r.expert_bytes));
  p.cold_total = all - p.resident_total;
  p.pinned_bytes = static_cast<uint64_t>(p.cold_total) * r.expert_bytes;
  p.per_layer = per_layer_counts(p.resident_total, r.num_moe_layers, r.num_experts);
  return p;
}

std::string format_budget_plan(const BudgetRequest& r, const BudgetPlan& p) {
  const int64_t all = int64_t{r.num_moe_layers} * r.num_experts;
  std::string s = fmt::format("GPU memory budget {}: fixed {} (non-expert weights {}, KV {}, workspace {}, staging {})\n",
                              gib(r.budget), gib(p.fixed), gib(r.non_expert_weights), gib(r.kv_cache),
                              gib(r.workspace), gib(r.staging));
  s += fmt::format("  experts: {} of {} resident ({:.1f}%, {} per expert), {} cold in pinned host memory ({})\n",
                   p.resident_total, all, all ? 100.0 * static_cast<double>(p.resident_total) / static_cast<double>(all) : 100.0,
                   fmt::format("{:.2f} MiB", static_cast<double>(r.expert_bytes) / (1 << 20)), p.cold_total,
                   gib(p.pinned_bytes));
  return s;
}

uint64_t host_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  uint64_t value = 0;
  std::string unit;
  while (f >> key >> value) {
    std::getline(f, unit);
    if (key == "MemAvailable:") return value * 1024;
  }
  return 0;
}

Status check_host_memory(uint64_t pinned, uint64_t available) {
  const uint64_t keep = std::max<uint64_t>(4 * kGiB, available / 10);
  if (pinned + keep > available)
    return Error::format("the cold experts need {} of pinned host memory, and the host has {} available; {} must "
                         "stay free for the rest of the process: raise --gpu-memory-budget, use a smaller expert "
                         "format, or free host memory",
                         gib(pinned), gib(available), gib(keep))
        .in_field("--gpu-memory-budget");
  return Ok{};
}

}  // namespace moebius::offload
