#include "core/thread_pool.h"

#include <algorithm>
#include <chrono>
#include <exception>

namespace moebius {

ThreadPool::ThreadPool(unsigned threads) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  workers_.reserve(threads);
  for (unsigned i = 0; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::enqueue(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
}

bool ThreadPool::try_run_one() {
  std::function<void()> job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (jobs_.empty()) return false;
    job = std::move(jobs_.front());
    jobs_.pop_front();
  }
  job();
  return true;
}

void ThreadPool::worker_loop() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping and drained
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

void ThreadPool::parallel_for(int64_t begin, int64_t end, const std::function<void(int64_t)>& fn) {
  if (end <= begin) return;
  const int64_t n = end - begin;
  const int64_t chunks = std::min<int64_t>(n, static_cast<int64_t>(size()) + 1);
  const int64_t per = (n + chunks - 1) / chunks;
  auto run_chunk = [&fn, begin, end, per](int64_t c) {
    const int64_t lo = begin + c * per;
    const int64_t hi = std::min(end, lo + per);
    for (int64_t i = lo; i < hi; ++i) fn(i);
  };
  std::vector<std::future<void>> pending;
  pending.reserve(static_cast<size_t>(chunks));
  for (int64_t c = 1; c < chunks; ++c) pending.push_back(submit([&run_chunk, c] { run_chunk(c); }));
  std::exception_ptr first;
  try {
    run_chunk(0);
  } catch (...) {
    first = std::current_exception();
  }
  for (auto& f : pending) {
    // Help drain the queue while waiting: a parallel_for called from inside a worker would
    // otherwise wait on chunks that no free worker is left to run.
    while (f.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
      if (!try_run_one()) f.wait_for(std::chrono::microseconds(200));
    }
    try {
      f.get();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

ThreadPool& ThreadPool::global() {
  static ThreadPool pool;
  return pool;
}

}  // namespace moebius
