// Shared by the serving tests (engine, prefix cache, chat API): the tiny fixture's serving
// tokenizer (tests/data/tiny-serve), and a StepRunner that forwards every call to another, for
// test runners that record, script or change one part of what the engine sees, and one that
// holds the engine in its first step.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "server/engine.h"
#include "server/step_runner.h"
#include "test_util.h"
#include "tokenizer/bpe_tokenizer.h"

namespace moebius::testing {

// Everything a request's stream delivers until it finishes (at most a minute).
inline server::RequestUpdate drain(server::RequestStream& s) {
  server::RequestUpdate u;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!u.finished && std::chrono::steady_clock::now() < deadline) s.take(&u, std::chrono::milliseconds(100));
  EXPECT_TRUE(u.finished);
  return u;
}

inline const tokenizer::BpeTokenizer& tiny_serve_tokenizer() {
  static tokenizer::BpeTokenizer* tok = [] {
    auto t = tokenizer::BpeTokenizer::load(test_data_dir() + "/tiny-serve/tokenizer.json");
    EXPECT_TRUE(t.ok()) << t.error().what();
    return new tokenizer::BpeTokenizer(std::move(t).value());
  }();
  return *tok;
}

class ForwardingRunner : public server::StepRunner {
 public:
  explicit ForwardingRunner(std::unique_ptr<server::StepRunner> inner) : inner_(std::move(inner)) {}
  const model::Qwen3MoeConfig& config() const override { return inner_->config(); }
  const server::RunnerLimits& limits() const override { return inner_->limits(); }
  std::string describe() const override { return inner_->describe(); }
  Status step(std::span<const server::RunnerSeq> seqs, std::vector<float>& logits) override {
    return inner_->step(seqs, logits);
  }
  void release(int64_t id) override { inner_->release(id); }
  bool shares_kv_blocks() const override { return inner_->shares_kv_blocks(); }
  bool failed() const override { return inner_->failed(); }
  std::optional<offload::ModelCacheStats> expert_cache_stats() const override { return inner_->expert_cache_stats(); }
  Result<std::unique_ptr<server::StagedWeights>> stage_weights(const std::string& dir) const override {
    return inner_->stage_weights(dir);
  }
  void commit_weights(server::StagedWeights& staged) override { inner_->commit_weights(staged); }

 private:
  std::unique_ptr<server::StepRunner> inner_;
};

// Holds its first step until open(): requests submitted meanwhile reach the engine together.
class GatedRunner final : public ForwardingRunner {
 public:
  using ForwardingRunner::ForwardingRunner;
  Status step(std::span<const server::RunnerSeq> seqs, std::vector<float>& logits) override {
    {
      std::unique_lock<std::mutex> lock(mu_);
      entered_ = true;
      cv_.notify_all();
      cv_.wait(lock, [&] { return open_; });
    }
    return ForwardingRunner::step(seqs, logits);
  }
  void wait_entered() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return entered_; });
  }
  void open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool entered_ = false, open_ = false;
};

}  // namespace moebius::testing
