// The routed-expert copier's host thread [TAG_EXPERT_ROUTED_DMA] (routed_expert_copier.h).
#include "runtime/routed_expert_copier.h"

#ifdef MOEBIUS_HAS_CUDA

#include <fmt/format.h>

#include <chrono>
#include <utility>

#include "kernels/cuda_check.h"
#include "runtime/cuda_environment.h"

namespace moebius::runtime {

namespace {

// A spin-wait hint: lets the sibling hyperthread run and saves power without giving up the core.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Ok{};
  return Error::format("routed expert copier: {}: {}", what, cudaGetErrorString(e));
}

}  // namespace

Result<std::unique_ptr<RoutedExpertCopier>> RoutedExpertCopier::create(RoutedCopierConfig config) {
  std::unique_ptr<RoutedExpertCopier> p(new RoutedExpertCopier());
  RoutedExpertCopier& r = *p;
  r.stream_ = std::exchange(config.stream, nullptr);  // owned (destroyed) from here on, errors included
  const RoutedCopierConfig& c = config;
  if (c.num_layers < 1 || c.num_experts < 1 || c.num_slots < 1 || c.num_slots > kernels::kExpertDmaMaxSlots)
    return Error::format("routed expert copier: {} layers, {} experts, {} slots (at most {})", c.num_layers,
                         c.num_experts, c.num_slots, kernels::kExpertDmaMaxSlots);
  if (c.sources.size() != static_cast<size_t>(c.num_layers) * static_cast<size_t>(c.num_experts))
    return Error::format("routed expert copier: {} sources for {} layers x {} experts", c.sources.size(),
                         c.num_layers, c.num_experts);
  if (c.slots.base == nullptr || c.w13_bytes == 0 || c.w2_bytes == 0)
    return Error("routed expert copier: no slots or empty expert arrays");
  r.config_ = std::move(config);
  MOEBIUS_TRY(cuda_status(cudaGetDevice(&r.device_), "cudaGetDevice"));
  MOEBIUS_TRY(cuda_status(cudaHostAlloc(reinterpret_cast<void**>(&r.post_), sizeof(kernels::ExpertDmaPost),
                                        cudaHostAllocMapped | cudaHostAllocPortable),
                          "the post (pinned)"));
  *r.post_ = kernels::ExpertDmaPost{};
  MOEBIUS_TRY(cuda_status(
      cudaHostAlloc(reinterpret_cast<void**>(&r.failed_), sizeof(unsigned), cudaHostAllocMapped | cudaHostAllocPortable),
      "the failure word (pinned)"));
  *r.failed_ = 0;
  MOEBIUS_TRY(cuda_status(cudaHostAlloc(reinterpret_cast<void**>(&r.flag_values_), 2 * sizeof(unsigned),
                                        cudaHostAllocPortable),
                          "the flag values (pinned)"));
  MOEBIUS_TRY(cuda_status(cudaMalloc(reinterpret_cast<void**>(&r.device_words_), 3 * sizeof(unsigned)),
                          "the ticket and flags (device)"));
  MOEBIUS_TRY(cuda_status(cudaMemset(r.device_words_, 0, 3 * sizeof(unsigned)), "zeroing the ticket and flags"));
  if (r.stream_ == nullptr)
    MOEBIUS_TRY(cuda_status(cudaStreamCreateWithFlags(&r.stream_, cudaStreamNonBlocking), "the copy stream"));
  MOEBIUS_TRY(cuda_status(cudaDeviceSynchronize(), "setup"));
  kernels::ExpertDmaSignal& s = r.signal_;
  MOEBIUS_TRY(cuda_status(cudaHostGetDevicePointer(reinterpret_cast<void**>(&s.post), r.post_, 0), "the post's alias"));
  MOEBIUS_TRY(
      cuda_status(cudaHostGetDevicePointer(reinterpret_cast<void**>(&s.failed), r.failed_, 0), "the failure alias"));
  s.ticket = r.device_words_;
  s.flag13 = r.device_words_ + 1;
  s.flag2 = r.device_words_ + 2;
  r.thread_ = std::thread([&r] { r.serve(); });
  return p;
}

RoutedExpertCopier::~RoutedExpertCopier() {
  stop_.store(true, std::memory_order_relaxed);
  if (thread_.joinable()) thread_.join();
  if (stream_ != nullptr) {
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamDestroy(stream_);
  }
  if (device_words_ != nullptr) (void)cudaFree(device_words_);
  for (void* h : {static_cast<void*>(post_), static_cast<void*>(failed_), static_cast<void*>(flag_values_)})
    if (h != nullptr) (void)cudaFreeHost(h);
}

Status RoutedExpertCopier::health() const {
  // A thread failure is reported once the device has given up on it too (its next wait times
  // out), so the error comes with the step it spoiled and later steps run zero-copy.
  const unsigned ticket = *reinterpret_cast<const volatile unsigned*>(failed_);
  if (reported_.load(std::memory_order_relaxed) || ticket == 0) return Ok{};
  std::string why;
  {
    std::lock_guard<std::mutex> lock(error_mutex_);
    why = error_;
  }
  if (why.empty()) {
    const unsigned issued = issued_.load(std::memory_order_acquire);
    why = static_cast<int>(issued - ticket) >= 0
              ? fmt::format("the host thread had issued the copies of post {}, but they did not land: they queued "
                            "behind the waiting kernels on a shared hardware queue (CUDA_DEVICE_MAX_CONNECTIONS "
                            "is {})",
                            ticket, cuda_connections())
              : fmt::format("the host thread did not pick up post {} (it had issued up to post {})", ticket, issued);
  }
  if (reported_.exchange(true, std::memory_order_relaxed)) return Ok{};  // another caller reported it
  return Error::format(
      "routed expert copies failed ({}); a MoE layer waited {} s for them and gave up, so the last step's results "
      "are invalid; decoding goes on with zero-copy reads",
      why, static_cast<double>(kernels::kExpertDmaWaitNs) / 1e9);
}

void RoutedExpertCopier::fail(std::string why) {
  std::lock_guard<std::mutex> lock(error_mutex_);
  if (error_.empty()) error_ = "routed expert copier: " + std::move(why);
}

int RoutedExpertCopier::first_without_home(const kernels::ExpertDmaPost& post) const {
  const RoutedCopierConfig& c = config_;
  for (int j = 0; j < post.count; ++j) {
    const RoutedCopySource& src =
        c.sources[static_cast<size_t>(post.layer) * static_cast<size_t>(c.num_experts) + static_cast<size_t>(post.ids[j])];
    const bool w13 = (post.parts[j] & kernels::kExpertDmaPart13) != 0, w2 = (post.parts[j] & kernels::kExpertDmaPart2) != 0;
    if ((w13 && (src.w13 == nullptr || (c.s13_bytes != 0 && src.s13 == nullptr))) ||
        (w2 && (src.w2 == nullptr || (c.s2_bytes != 0 && src.s2 == nullptr))))
      return j;
  }
  return -1;
}

bool RoutedExpertCopier::issue(const kernels::ExpertDmaPost& post, unsigned part, unsigned ticket) {
  const RoutedCopierConfig& c = config_;
  const bool w13 = part == kernels::kExpertDmaPart13;
  uint64_t bytes = 0;
  for (int j = 0; j < post.count; ++j) {
    if ((post.parts[j] & part) == 0) continue;
    const RoutedCopySource& src =
        c.sources[static_cast<size_t>(post.layer) * static_cast<size_t>(c.num_experts) + static_cast<size_t>(post.ids[j])];
    uint8_t* slot = c.slots.base + static_cast<size_t>(j) * c.slots.stride;
    struct Array {
      void* dst;
      const void* src;
      size_t bytes;
    };
    const Array arrays[2] = {
        w13 ? Array{slot, src.w13, c.w13_bytes} : Array{slot + c.slots.off_w2, src.w2, c.w2_bytes},
        w13 ? Array{slot + c.slots.off_s13, src.s13, c.s13_bytes} : Array{slot + c.slots.off_s2, src.s2, c.s2_bytes},
    };
    for (const Array& a : arrays) {
      if (a.bytes == 0) continue;
      if (const cudaError_t e = cudaMemcpyAsync(a.dst, a.src, a.bytes, cudaMemcpyDefault, stream_); e != cudaSuccess) {
        fail(fmt::format("cudaMemcpyAsync of layer {} expert {}: {}", post.layer, post.ids[j], cudaGetErrorString(e)));
        return false;
      }
      bytes += a.bytes;
    }
  }
  // Safe to overwrite: the device posted this ticket only after the previous one's flags landed.
  unsigned* value = flag_values_ + (w13 ? 0 : 1);
  *value = ticket;
  const unsigned* flag = w13 ? signal_.flag13 : signal_.flag2;
  if (const cudaError_t e =
          cudaMemcpyAsync(const_cast<unsigned*>(flag), value, sizeof(unsigned), cudaMemcpyHostToDevice, stream_);
      e != cudaSuccess) {
    fail(fmt::format("cudaMemcpyAsync of a flag: {}", cudaGetErrorString(e)));
    return false;
  }
  bytes_.fetch_add(bytes, std::memory_order_relaxed);
  return true;
}

void RoutedExpertCopier::serve() {
  using clock = std::chrono::steady_clock;
  if (const cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) {
    fail(fmt::format("cudaSetDevice({}): {}", device_, cudaGetErrorString(e)));
    return;
  }
  const RoutedCopierConfig& c = config_;
  const volatile kernels::ExpertDmaPost* post = post_;
  std::atomic_ref<unsigned> seq_word(post_->seq);  // the device's release store, read with acquire
  unsigned next = 1;
  auto last_post = clock::now();
  while (!stop_.load(std::memory_order_relaxed)) {
    const unsigned seq = seq_word.load(std::memory_order_acquire);
    if (seq != next) {
      if (seq != next - 1) {  // the device never posts past a ticket this thread has not served
        fail(fmt::format("the post holds ticket {} while ticket {} was due", seq, next));
        return;
      }
      if (clock::now() - last_post < std::chrono::milliseconds(2)) cpu_relax();
      else std::this_thread::sleep_for(std::chrono::microseconds(50));
      continue;
    }
    kernels::ExpertDmaPost p;
    p.seq = seq;
    p.layer = post->layer;
    p.count = post->count;
    bool valid = p.layer >= 0 && p.layer < c.num_layers && p.count >= 1 && p.count <= c.num_slots;
    for (int j = 0; valid && j < p.count; ++j) {
      p.ids[j] = post->ids[j];
      p.parts[j] = post->parts[j];
      valid = p.ids[j] >= 0 && p.ids[j] < c.num_experts && p.parts[j] != 0 &&
              (p.parts[j] & ~(kernels::kExpertDmaPart13 | kernels::kExpertDmaPart2)) == 0;
    }
    if (!valid) {
      fail(fmt::format("malformed post {} (layer {}, count {})", seq, p.layer, p.count));
      return;
    }
    if (const int j = first_without_home(p); j >= 0) {  // before the post counts as served
      fail(fmt::format("layer {} expert {}: chosen for a copy but has no home in host memory", p.layer, p.ids[j]));
      return;
    }
    // Counted before the flags are issued: a caller that saw its waits return sees the count.
    served_.fetch_add(1, std::memory_order_relaxed);
    if (!issue(p, kernels::kExpertDmaPart13, seq) || !issue(p, kernels::kExpertDmaPart2, seq)) return;
    issued_.store(seq, std::memory_order_release);
    ++next;
    last_post = clock::now();
  }
}

}  // namespace moebius::runtime

#endif  // MOEBIUS_HAS_CUDA
