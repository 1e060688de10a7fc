// A fixed-size thread pool for host-side work: loading and repacking shards, online
// quantization, the CPU backend's outer loops. Tasks are plain closures; parallel_for splits an
// index range into contiguous chunks so each worker touches contiguous memory.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

namespace moebius {

class ThreadPool {
 public:
  // threads == 0 means std::thread::hardware_concurrency().
  explicit ThreadPool(unsigned threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  unsigned size() const { return static_cast<unsigned>(workers_.size()); }

  // Runs fn() on a worker; the future carries its result or exception.
  template <typename F>
  auto submit(F&& fn) -> std::future<decltype(fn())> {
    using R = decltype(fn());
    auto task = std::make_shared<std::packaged_task<R()>>(std::forward<F>(fn));
    std::future<R> fut = task->get_future();
    enqueue([task] { (*task)(); });
    return fut;
  }

  // Calls fn(i) for every i in [begin, end), split into at most size() contiguous chunks, and
  // waits. The calling thread runs one chunk itself and then helps run queued jobs while it
  // waits, so a parallel_for nested inside a pool task cannot deadlock. A range of one index
  // runs on the calling thread with no hand-off, so callers need no special case for it. The
  // first exception thrown by any fn is rethrown here after all chunks finish.
  void parallel_for(int64_t begin, int64_t end, const std::function<void(int64_t)>& fn);

  // The process-wide pool used by default.
  static ThreadPool& global();

 private:
  void enqueue(std::function<void()> job);
  void worker_loop();
  bool try_run_one();

  std::vector<std::thread> workers_;
  std::deque<std::function<void()>> jobs_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
};

}  // namespace moebius
