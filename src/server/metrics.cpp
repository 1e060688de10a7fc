#include "server/metrics.h"

#include <algorithm>

#include <fmt/format.h>

namespace moebius::server {

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double x) {
  const size_t b = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), x) - bounds_.begin());
  std::lock_guard<std::mutex> lock(mu_);
  ++counts_[b];
  sum_ += x;
  ++count_;
}

uint64_t Histogram::count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return count_;
}

std::string Histogram::render(const std::string& name, const std::string& help) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out = fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds_[i], cum);
  }
  out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, count_, name, sum_, name, count_);
  return out;
}

namespace {

void metric(std::string& out, const char* name, const char* type, const char* help, double value) {
  fmt::format_to(std::back_inserter(out), "# HELP moebius_{} {}\n# TYPE moebius_{} {}\nmoebius_{} {}\n", name, help, name,
                 type, name, value);
}

}  // namespace

std::string EngineMetrics::render() const {
  std::string out;
  const double used = static_cast<double>(kv_blocks_used.load()), total = static_cast<double>(kv_blocks_total.load());
  metric(out, "queue_depth", "gauge", "Requests waiting to run (new or preempted).", double(queue_depth.load()));
  metric(out, "running_requests", "gauge", "Requests holding KV cache and stepped every iteration.",
         double(running.load()));
  metric(out, "kv_blocks_used", "gauge", "KV cache blocks in use.", used);
  metric(out, "kv_blocks_total", "gauge", "KV cache blocks in the pool.", total);
  metric(out, "kv_usage_ratio", "gauge", "Fraction of the KV cache in use.", total > 0 ? used / total : 0.0);
  metric(out, "generation_tokens_per_second", "gauge", "Generated tokens per second over the last 5 seconds.",
         generation_tokens_per_second.load());
  metric(out, "prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", double(prompt_tokens_total.load()));
  metric(out, "generation_tokens_total", "counter", "Generated tokens.", double(generation_tokens_total.load()));
  metric(out, "requests_finished_total", "counter", "Requests finished by a stop condition or the length limit.",
         double(requests_finished_total.load()));
  metric(out, "requests_cancelled_total", "counter", "Requests cancelled (client disconnects).",
         double(requests_cancelled_total.load()));
  metric(out, "requests_failed_total", "counter", "Requests ended by an engine error.",
         double(requests_failed_total.load()));
  metric(out, "requests_rejected_total", "counter", "Requests answered 429 because the queue was full.",
         double(requests_rejected_total.load()));
  metric(out, "preemptions_total", "counter", "Sequences preempted (KV freed, recomputed later).",
         double(preemptions_total.load()));
  metric(out, "prefix_cache_queries_total", "counter",
         "Tokens of admitted sequences looked up in the prefix cache (every admission, preempted ones again).",
         double(prefix_cache_queries_total.load()));
  metric(out, "prefix_cache_hits_total", "counter", "Of those, tokens whose KV was found cached and not computed.",
         double(prefix_cache_hits_total.load()));
  metric(out, "prefix_cache_waits_total", "counter",
         "Steps a waiting request was held back while a running one computed its next prefix block.",
         double(prefix_cache_waits_total.load()));
  metric(out, "kv_blocks_cached", "gauge", "KV cache blocks published in the prefix cache (held or evictable).",
         double(kv_blocks_cached.load()));
  metric(out, "engine_steps_total", "counter", "Forward steps run.", double(steps_total.load()));
  metric(out, "weight_updates_total", "counter", "Weight updates from disk that took effect.",
         double(weight_updates_total.load()));
  if (const std::vector<int> dp = dp_rank_sequences(); !dp.empty()) {
    out += "# HELP moebius_dp_rank_sequences Live sequences (KV caches) on each data-parallel rank.\n"
           "# TYPE moebius_dp_rank_sequences gauge\n";
    for (size_t r = 0; r < dp.size(); ++r)
      fmt::format_to(std::back_inserter(out), "moebius_dp_rank_sequences{{rank=\"{}\"}} {}\n", r, dp[r]);
  }
  if (expert_cache_on.load()) {
    const double routed = double(expert_cache_routed_pairs_total.load()),
                 resident = double(expert_cache_resident_pairs_total.load());
    metric(out, "expert_cache_routed_pairs_total", "counter",
           "Routed (token, expert) pairs fed to the expert cache, summed over the MoE layers.", routed);
    metric(out, "expert_cache_resident_pairs_total", "counter",
           "Of those, the pairs whose expert was on the GPU when the step ran.", resident);
    metric(out, "expert_cache_hit_ratio", "gauge", "resident_pairs_total / routed_pairs_total since start.",
           routed > 0 ? resident / routed : 0.0);
    metric(out, "expert_cache_swaps_total", "counter", "Experts swapped into the GPU by the cache.",
           double(expert_cache_swaps_total.load()));
    metric(out, "expert_cache_swap_bytes_total", "counter", "Bytes the swaps moved over PCIe (both directions).",
           double(expert_cache_swap_bytes_total.load()));
  }
  out += ttft.render("moebius_time_to_first_token_seconds", "Time from arrival to the first generated token.");
  out += itl.render("moebius_inter_token_latency_seconds", "Time between consecutive generated tokens of a request.");
  out += e2e.render("moebius_e2e_request_latency_seconds", "Time from arrival to the last token.");
  return out;
}

}  // namespace moebius::server
