// The numbers /metrics exports in Prometheus' text format (version 0.0.4). The engine thread
// writes them, HTTP threads read them: counters and gauges are atomics, histograms take a mutex
// (observed once per token at most, so it is never contended for long).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace moebius::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);  // ascending; +Inf is implicit
  void observe(double x);
  // "name_bucket{le=...} n" lines, name_sum and name_count, after HELP and TYPE.
  std::string render(const std::string& name, const std::string& help) const;
  uint64_t count() const;

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;  // [bounds + 1], not cumulative
  double sum_ = 0.0;
  uint64_t count_ = 0;
};

struct EngineMetrics {
  std::atomic<int64_t> queue_depth{0};        // waiting (never run, or preempted)
  std::atomic<int64_t> running{0};            // holding KV, stepped every iteration
  std::atomic<int64_t> kv_blocks_used{0};
  std::atomic<int64_t> kv_blocks_total{0};
  std::atomic<int64_t> prompt_tokens_total{0};
  std::atomic<int64_t> generation_tokens_total{0};
  std::atomic<int64_t> requests_finished_total{0};  // stop or length
  std::atomic<int64_t> requests_cancelled_total{0};
  std::atomic<int64_t> requests_failed_total{0};
  std::atomic<int64_t> requests_rejected_total{0};  // queue full
  std::atomic<int64_t> preemptions_total{0};
  std::atomic<int64_t> steps_total{0};
  std::atomic<int64_t> weight_updates_total{0};     // POST /update_weights_from_disk that took effect
  // Prefix caching ([TAG_PREFIX_CACHE]): tokens of admitted sequences looked up, and of those the
  // tokens found cached (not computed); published blocks, held or not.
  std::atomic<int64_t> prefix_cache_queries_total{0};
  std::atomic<int64_t> prefix_cache_hits_total{0};
  // [TAG_PREFIX_CACHE_INFLIGHT] Steps a waiting sequence was held back because a running one was
  // computing its next prefix block.
  std::atomic<int64_t> prefix_cache_waits_total{0};
  std::atomic<int64_t> kv_blocks_cached{0};
  // The dynamic expert cache (--expert-cache), copied from the runner after every step; rendered
  // only when expert_cache_on. Pairs are routed (token, expert) pairs summed over the MoE layers.
  std::atomic<bool> expert_cache_on{false};
  std::atomic<int64_t> expert_cache_routed_pairs_total{0};
  std::atomic<int64_t> expert_cache_resident_pairs_total{0};
  std::atomic<int64_t> expert_cache_swaps_total{0};
  std::atomic<int64_t> expert_cache_swap_bytes_total{0};
  std::atomic<double> generation_tokens_per_second{0.0};  // over the last few seconds
  Histogram ttft{{0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60}};
  Histogram itl{{0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 5}};
  Histogram e2e{{0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300}};

  std::string render() const;  // every metric, prefixed moebius_

  // [TAG_SERVE_DP] Live sequences per data-parallel rank (the runner's sequences_per_rank),
  // rendered as moebius_dp_rank_sequences{rank="r"} only when non-empty.
  void set_dp_rank_sequences(std::vector<int> v) {
    std::lock_guard<std::mutex> lock(dp_mu_);
    dp_rank_sequences_ = std::move(v);
  }
  std::vector<int> dp_rank_sequences() const {
    std::lock_guard<std::mutex> lock(dp_mu_);
    return dp_rank_sequences_;
  }

 private:
  mutable std::mutex dp_mu_;
  std::vector<int> dp_rank_sequences_;
};

}  // namespace moebius::server
