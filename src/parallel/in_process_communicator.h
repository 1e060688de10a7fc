// Ranks as threads of one process, for the CPU backend and for testing the EP dispatch/combine
// logic without GPUs. An InProcessGroup is the shared rendezvous; each rank's thread holds its own
// InProcessCommunicator made by group->communicator(rank). A collective posts the rank's buffer
// descriptors in the group, waits for every rank (barrier), copies what is addressed to it
// straight out of the senders' buffers, and waits again so no sender reuses its buffer early.
//
// A rank that fails outside a collective must call abort() (run_ranks does): ranks blocked in or
// entering a collective then return an error instead of waiting forever.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "parallel/communicator.h"

namespace moebius::parallel {

class InProcessGroup : public std::enable_shared_from_this<InProcessGroup> {
 public:
  static std::shared_ptr<InProcessGroup> create(int size);

  int size() const { return size_; }
  // The communicator of rank `rank` (one per rank thread; it keeps the group alive).
  std::unique_ptr<Communicator> communicator(int rank);
  // Every waiting and later collective returns an error naming `why`.
  void abort(const std::string& why);

 private:
  friend class InProcessCommunicator;
  explicit InProcessGroup(int size);

  // What a rank posted for the collective in flight.
  struct Posted {
    const void* send = nullptr;
    std::span<const size_t> send_bytes, send_offsets;
    size_t gather_bytes = 0;
    int op = 0;  // 1 all_gather, 2 all_to_all_v, 3 barrier: ranks must agree
  };
  // Waits until all ranks arrived (a generation-counting barrier); error when aborted.
  Status wait_all();

  const int size_;
  std::vector<Posted> posted_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  std::string abort_reason_;
};

// Runs fn(comm) on `size` threads, one per rank, and returns each rank's status in rank order.
// A rank whose fn returns an error aborts the group, so the others stop at their next collective.
std::vector<Status> run_ranks(int size, const std::function<Status(Communicator&)>& fn);

}  // namespace moebius::parallel
