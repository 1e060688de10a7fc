#include "parallel/in_process_communicator.h"

#include <cstring>
#include <system_error>
#include <thread>

#include <fmt/format.h>

namespace moebius::parallel {

Status check_expert_split(int num_experts, int size) {
  if (size < 1) return Error::format("expert parallelism needs at least one rank, got {}", size);
  if (num_experts < size || num_experts % size != 0)
    return Error::format("num_experts {} does not split evenly over {} expert-parallel ranks (--ep must divide it)",
                         num_experts, size)
        .in_field("num_experts");
  return Ok{};
}

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<InProcessGroup> group, int rank) : group_(std::move(group)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size_; }
  bool buffers_on_device() const override { return false; }
  const char* name() const override { return "in-process"; }

  Status all_gather(const void* send, void* recv, size_t bytes) override {
    InProcessGroup& g = *group_;
    {
      std::lock_guard<std::mutex> lock(g.mu_);
      g.posted_[static_cast<size_t>(rank_)] = {send, {}, {}, bytes, 1};
    }
    MOEBIUS_TRY(g.wait_all());
    Status st = Ok{};
    for (int r = 0; r < g.size_; ++r) {
      const auto& p = g.posted_[static_cast<size_t>(r)];
      if (p.op != 1 || p.gather_bytes != bytes) {
        st = Error::format("in-process all_gather: rank {} posted another collective or size ({} vs {} bytes)", r,
                           p.gather_bytes, bytes);
        break;
      }
      if (bytes > 0) std::memcpy(static_cast<uint8_t*>(recv) + static_cast<size_t>(r) * bytes, p.send, bytes);
    }
    MOEBIUS_TRY(g.wait_all());  // the senders' buffers are read; they may be reused now
    return st;
  }

  Status all_to_all_v(const void* send, std::span<const size_t> send_bytes, std::span<const size_t> send_offsets,
                      void* recv, std::span<const size_t> recv_bytes, std::span<const size_t> recv_offsets) override {
    InProcessGroup& g = *group_;
    const size_t n = static_cast<size_t>(g.size_);
    MOEBIUS_ASSERT(send_bytes.size() == n && send_offsets.size() == n && recv_bytes.size() == n &&
                   recv_offsets.size() == n);
    {
      std::lock_guard<std::mutex> lock(g.mu_);
      g.posted_[static_cast<size_t>(rank_)] = {send, send_bytes, send_offsets, 0, 2};
    }
    MOEBIUS_TRY(g.wait_all());
    Status st = Ok{};
    for (size_t s = 0; s < n; ++s) {
      const auto& p = g.posted_[s];
      if (p.op != 2) {
        st = Error::format("in-process all_to_all_v: rank {} posted another collective", s);
        break;
      }
      const size_t b = p.send_bytes[static_cast<size_t>(rank_)];
      if (b != recv_bytes[s]) {
        st = Error::format("in-process all_to_all_v: rank {} sends {} bytes to rank {}, which expects {}", s, b,
                           rank_, recv_bytes[s]);
        break;
      }
      if (b > 0)
        std::memcpy(static_cast<uint8_t*>(recv) + recv_offsets[s],
                    static_cast<const uint8_t*>(p.send) + p.send_offsets[static_cast<size_t>(rank_)], b);
    }
    MOEBIUS_TRY(g.wait_all());
    return st;
  }

  Status barrier() override {
    InProcessGroup& g = *group_;
    {
      std::lock_guard<std::mutex> lock(g.mu_);
      g.posted_[static_cast<size_t>(rank_)] = {nullptr, {}, {}, 0, 3};
    }
    return g.wait_all();
  }

 private:
  std::shared_ptr<InProcessGroup> group_;
  int rank_;
};

InProcessGroup::InProcessGroup(int size) : size_(size), posted_(static_cast<size_t>(size)) {}

std::shared_ptr<InProcessGroup> InProcessGroup::create(int size) {
  MOEBIUS_ASSERT(size >= 1);
  return std::shared_ptr<InProcessGroup>(new InProcessGroup(size));
}

std::unique_ptr<Communicator> InProcessGroup::communicator(int rank) {
  MOEBIUS_ASSERT(rank >= 0 && rank < size_);
  return std::make_unique<InProcessCommunicator>(shared_from_this(), rank);
}

void InProcessGroup::abort(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!aborted_) {
    aborted_ = true;
    abort_reason_ = why;
  }
  cv_.notify_all();
}

Status InProcessGroup::wait_all() {
  std::unique_lock<std::mutex> lock(mu_);
  if (aborted_) return Error("in-process communicator aborted: " + abort_reason_);
  const uint64_t gen = generation_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return Ok{};
  }
  cv_.wait(lock, [&] { return generation_ != gen || aborted_; });
  if (generation_ == gen) return Error("in-process communicator aborted: " + abort_reason_);
  return Ok{};
}

std::vector<Status> run_ranks(int size, const std::function<Status(Communicator&)>& fn) {
  auto group = InProcessGroup::create(size);
  std::vector<Status> results(static_cast<size_t>(size), Status(Ok{}));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    try {
      threads.emplace_back([&, r] {
        std::unique_ptr<Communicator> comm = group->communicator(r);
        Status st = fn(*comm);
        if (!st.ok()) group->abort("rank " + std::to_string(r) + " failed: " + st.error().what());
        results[static_cast<size_t>(r)] = std::move(st);
      });
    } catch (const std::system_error& e) {
      // The host cannot start another thread (a process or memory limit): the ranks already
      // running would wait in their first collective for this one forever, so abort the group and
      // say which rank could not start.
      const std::string why = fmt::format("could not start the thread of rank {} of {}: {}", r, size, e.what());
      group->abort(why);
      for (int q = r; q < size; ++q) results[static_cast<size_t>(q)] = Error(why);
      break;
    }
  }
  for (auto& t : threads) t.join();
  return results;
}

}  // namespace moebius::parallel
