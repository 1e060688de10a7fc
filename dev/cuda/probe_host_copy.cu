// Probe: routed experts copied by the copy engines on the orders of a HOST thread that reads the
// routing from mapped memory (docs/OFFLOAD.md, "Routed experts by DMA").
//
// Why: run Z37 (docs/PERF.md) measured memcpy nodes inside switch conditional nodes at the rate of a
// kernel reading mapped memory (32.7 GB/s against 54.4 for cudaMemcpyAsync on that host; the
// driver does not give them the copy engines' rate), with instantiation superlinear in the node
// count. The other way to let the device choose the copies without a host sync of the stream: the
// device posts its choice to mapped host memory, a host thread polls it and issues ordinary
// cudaMemcpyAsync calls on a copy stream, then a 4-byte copy of a flag; a kernel in the graph waits
// for the flag before the consumer runs. The graph never waits on the host, only on memory.
//
// Per layer, in a graph of L layers (the decode step's chain):
//   announce (1 warp: picks S distinct ids, writes them and then a sequence number to the mailbox
//   in mapped host memory) -> wait (1 thread spins on the device flag, with a timeout) -> check
//   (both ends of every slot hold the picked expert's tags) -> optional compute stand-in (spins
//   `compute_us`, the layer's non-cold work, during which the link idles in this design).
// Host thread: for each layer and replay, spin on the mailbox's sequence number, issue S copies of
// `bytes` from pinned memory into the layer's slots, then the flag copy, all on one copy stream.
//
// Printed: us a layer and GB/s of the copies against (a) one pinned cudaMemcpyAsync of the same
// bytes, (b) S separate copies from scattered experts issued by the host alone, (c) a kernel
// reading them through the mapped alias. The per-layer overhead is what (us a layer - compute) has
// beyond bytes / (b)'s rate. Every replay's slots are checked; a timeout or a wrong byte fails.
// Sizes: Qwen3-235B-A22B int2: an expert 5.01 MB, its down projection 1.67 MB, 94 MoE layers.
// Usage: dev_probe_host_copy   (no arguments)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "kernels/cuda_check.h"
#include "probe_expert_tags.h"
#include "probe_util.h"

namespace {

using dev_probe::pick_id;
constexpr int kExperts = dev_probe::kProbeExperts;
constexpr int kMaxSlots = 8;
constexpr int kMaxLayers = 94;

// One layer's post from the device to the host thread: ids first, then seq (the replay + 1) after a
// system-scope fence, so a host that sees seq also sees the ids. 64 bytes: its own cache line.
struct alignas(64) Mailbox {
  uint32_t seq;
  uint32_t ids[kMaxSlots];
};

// counters: [0] replay, [1] errors, [2] checked, [3] timeouts, [4] sink.
__global__ void announce_kernel(Mailbox* mailbox, unsigned* ids, int slots, int layer, const unsigned* counters) {
  const int j = threadIdx.x;
  const unsigned replay = counters[0];
  if (j < slots) {
    const unsigned id = pick_id(replay, layer, j);
    ids[j] = id;
    mailbox->ids[j] = id;
  }
  __syncwarp();
  if (j == 0) {
    __threadfence_system();
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(&mailbox->seq), "r"(replay + 1) : "memory");
  }
}

__device__ inline unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins until the host's flag copy has landed (flag == replay + 1). The 2 s bound turns a dead host
// thread into a counted timeout instead of a hung graph; after one, every later wait returns at once.
__global__ void wait_kernel(const unsigned* flag, unsigned* counters) {
  const unsigned want = counters[0] + 1;
  if (*reinterpret_cast<volatile unsigned*>(counters + 3) != 0) return;
  const unsigned long long start = now_ns();
  for (;;) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
    if (v == want) return;
    if (now_ns() - start > 2000000000ull) {
      atomicAdd(counters + 3, 1u);
      return;
    }
  }
}

// The layer's other work, as a fixed time on one block (the link idles meanwhile).
__global__ void compute_kernel(int us) {
  const unsigned long long start = now_ns();
  while (now_ns() - start < 1000ull * static_cast<unsigned>(us)) {
  }
}

__global__ void bump_kernel(unsigned* counters) { counters[0] += 1; }

struct Setup {
  unsigned char* host = nullptr;   // [E][bytes] pinned
  unsigned char* slots = nullptr;  // [2][S][bytes] on the device: layers alternate between two sets
  Mailbox* mailbox = nullptr;      // [layers] pinned, mapped (host pointer)
  Mailbox* mailbox_dev = nullptr;  // its device alias
  unsigned* flags = nullptr;       // device: [layers]
  unsigned* flag_values = nullptr; // pinned: [layers], the flag copies' sources
  unsigned* ids = nullptr;         // device: [layers][S]
  unsigned* counters = nullptr;    // device: see announce_kernel
};

struct Case {
  const char* name;
  int layers, slots;
  size_t bytes;
  int compute_us;
  int reps;
};

unsigned char* slot_of(const Setup& su, const Case& c, int layer, int j) {
  return su.slots + (static_cast<size_t>(layer % 2) * kMaxSlots + static_cast<size_t>(j)) * c.bytes;
}

cudaGraphExec_t build(const Setup& su, const Case& c, cudaStream_t s) {
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int l = 0; l < c.layers; ++l) {
    unsigned* ids = su.ids + static_cast<size_t>(l) * kMaxSlots;
    announce_kernel<<<1, 32, 0, s>>>(su.mailbox_dev + l, ids, c.slots, l, su.counters);
    wait_kernel<<<1, 1, 0, s>>>(su.flags + l, su.counters);
    dev_probe::check_slot_tags<<<1, 32, 0, s>>>(slot_of(su, c, l, 0), c.bytes, c.slots, ids, su.counters + 1,
                                                 su.counters + 2);
    if (c.compute_us > 0) compute_kernel<<<1, 32, 0, s>>>(c.compute_us);
  }
  bump_kernel<<<1, 1, 0, s>>>(su.counters);
  cudaGraph_t g;
  CUDA_CHECK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  CUDA_CHECK(cudaGraphDestroy(g));
  return exec;
}

// The host thread: serves replays 1.. until `stop`, layer by layer. Returns through `stats` the
// number of layers served and the summed issue time (from seeing the post to the flag copy issued).
struct ProxyStats {
  long long layers = 0;
  double issue_us = 0;
  bool timed_out = false;
};

void proxy(const Setup& su, const Case& c, cudaStream_t copy, const std::atomic<bool>& stop, ProxyStats& stats) {
  CUDA_CHECK(cudaSetDevice(0));
  using clock = std::chrono::steady_clock;
  for (uint32_t replay = 1;; ++replay) {
    for (int l = 0; l < c.layers; ++l) {
      volatile uint32_t* seq = &su.mailbox[l].seq;
      const auto t0 = clock::now();
      while (*seq != replay) {
        if (stop.load(std::memory_order_relaxed)) return;
        if (clock::now() - t0 > std::chrono::seconds(5)) {
          stats.timed_out = true;
          return;
        }
      }
      std::atomic_thread_fence(std::memory_order_acquire);
      const auto t1 = clock::now();
      for (int j = 0; j < c.slots; ++j) {
        const uint32_t id = const_cast<const volatile uint32_t&>(su.mailbox[l].ids[j]);
        CUDA_CHECK(cudaMemcpyAsync(slot_of(su, c, l, j), su.host + static_cast<size_t>(id) * c.bytes, c.bytes,
                                   cudaMemcpyHostToDevice, copy));
      }
      // Safe to overwrite: the device posts layer l of the next replay only after this replay's
      // wait on layer l saw the flag, i.e. after this copy read its source.
      su.flag_values[l] = replay;
      CUDA_CHECK(cudaMemcpyAsync(su.flags + l, su.flag_values + l, 4, cudaMemcpyHostToDevice, copy));
      stats.issue_us += std::chrono::duration<double, std::micro>(clock::now() - t1).count();
      ++stats.layers;
    }
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main() {
  if (!dev_probe::has_device()) return 0;
  const size_t expert_bytes = dev_probe::kInt2ExpertBytes, down_bytes = dev_probe::kInt2DownBytes;
  Setup su;
  CUDA_CHECK(cudaHostAlloc(&su.host, kExperts * expert_bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(su.host, 0x5A, kExperts * expert_bytes);
  auto tag = [&](size_t bytes) { dev_probe::tag_experts(su.host, bytes); };
  CUDA_CHECK(cudaMalloc(&su.slots, 2 * kMaxSlots * expert_bytes));
  CUDA_CHECK(cudaHostAlloc(&su.mailbox, sizeof(Mailbox) * kMaxLayers, cudaHostAllocMapped | cudaHostAllocPortable));
  CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&su.mailbox_dev), su.mailbox, 0));
  CUDA_CHECK(cudaHostAlloc(&su.flag_values, sizeof(unsigned) * kMaxLayers, cudaHostAllocPortable));
  CUDA_CHECK(cudaMalloc(&su.flags, sizeof(unsigned) * kMaxLayers));
  CUDA_CHECK(cudaMalloc(&su.ids, sizeof(unsigned) * kMaxLayers * kMaxSlots));
  CUDA_CHECK(cudaMalloc(&su.counters, sizeof(unsigned) * 8));
  cudaStream_t s, copy;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_CHECK(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking));
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  auto time_ms = [&](cudaStream_t st, auto&& enqueue) {
    CUDA_CHECK(cudaEventRecord(a, st));
    enqueue();
    CUDA_CHECK(cudaEventRecord(b, st));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    return static_cast<double>(ms);
  };

  // Baselines on 8 whole experts: one copy, 8 scattered copies issued by the host, a mapped read.
  double scattered_gbs = 0;
  {
    tag(expert_bytes);
    const size_t bytes = kMaxSlots * expert_bytes;
    unsigned char* alias = nullptr;
    CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&alias), su.host, 0));
    int sms = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    std::vector<double> one, scattered, mapped;
    for (int k = 0; k < 7; ++k) {
      const size_t off = static_cast<size_t>(k % 8) * bytes;
      one.push_back(bytes / (1e6 * time_ms(s, [&] {
                      CUDA_CHECK(cudaMemcpyAsync(su.slots, su.host + off, bytes, cudaMemcpyHostToDevice, s));
                    })));
      scattered.push_back(bytes / (1e6 * time_ms(s, [&] {
                            for (int j = 0; j < kMaxSlots; ++j)
                              CUDA_CHECK(cudaMemcpyAsync(su.slots + j * expert_bytes,
                                                         su.host + pick_id(k, 0, j) * expert_bytes, expert_bytes,
                                                         cudaMemcpyHostToDevice, s));
                          })));
      mapped.push_back(bytes / (1e6 * time_ms(s, [&] {
                         dev_probe::read_v4x4<<<sms * 4, 256, 0, s>>>(reinterpret_cast<const uint4*>(alias + off),
                                                                      bytes / 16, su.counters + 4);
                       })));
    }
    scattered_gbs = median(scattered);
    std::printf("baseline, 8 experts (%.1f MB): one pinned cudaMemcpyAsync %.1f GB/s, 8 scattered copies %.1f GB/s, "
                "kernel reading mapped %.1f GB/s (median of 7)\n",
                bytes / 1e6, median(one), scattered_gbs, median(mapped));
  }

  const Case cases[] = {
      {"whole experts, 8 slots, 8 layers", 8, 8, expert_bytes, 0, 10},
      {"whole experts, 8 slots, 94 layers", 94, 8, expert_bytes, 0, 3},
      {"whole experts, 8 slots, 94 layers, 100 us compute", 94, 8, expert_bytes, 100, 3},
      {"down projections, 2 slots, 94 layers", 94, 2, down_bytes, 0, 5},
      {"down projections, 1 slot, 94 layers", 94, 1, down_bytes, 0, 5},
      {"tags only (64 B), 1 slot, 94 layers", 94, 1, 64, 0, 20},
  };
  int failures = 0;
  for (const Case& c : cases) {
    tag(c.bytes);
    std::memset(su.mailbox, 0, sizeof(Mailbox) * kMaxLayers);
    CUDA_CHECK(cudaMemset(su.counters, 0, sizeof(unsigned) * 8));
    CUDA_CHECK(cudaMemset(su.flags, 0, sizeof(unsigned) * kMaxLayers));
    CUDA_CHECK(cudaMemset(su.slots, 0, 2 * kMaxSlots * expert_bytes));
    CUDA_CHECK(cudaDeviceSynchronize());
    const cudaGraphExec_t exec = build(su, c, s);
    std::atomic<bool> stop{false};
    ProxyStats stats;
    std::thread host(proxy, std::cref(su), std::cref(c), copy, std::cref(stop), std::ref(stats));
    for (int i = 0; i < 2; ++i) CUDA_CHECK(cudaGraphLaunch(exec, s));  // warm-up
    std::vector<double> us;
    for (int k = 0; k < 5; ++k)
      us.push_back(1000.0 *
                   time_ms(s, [&] {
                     for (int i = 0; i < c.reps; ++i) CUDA_CHECK(cudaGraphLaunch(exec, s));
                   }) /
                   c.reps);
    CUDA_CHECK(cudaStreamSynchronize(s));
    stop = true;
    host.join();
    CUDA_CHECK(cudaStreamSynchronize(copy));
    unsigned counters[8];
    CUDA_CHECK(cudaMemcpy(counters, su.counters, sizeof(counters), cudaMemcpyDeviceToHost));
    const double replay_us = median(us), layer_us = replay_us / c.layers;
    const double moved = static_cast<double>(c.slots) * c.bytes;  // a layer's
    const double copy_us = moved / (scattered_gbs * 1e3);
    const unsigned replays = counters[0];
    const unsigned expect = replays * static_cast<unsigned>(c.layers * c.slots);
    const bool ok = counters[1] == 0 && counters[3] == 0 && counters[2] == expect && replays > 0 && !stats.timed_out;
    if (!ok) ++failures;
    std::printf("%-50s %8.1f us a layer, %5.1f GB/s over the layer's copy time | overhead %6.1f us a layer "
                "(host issue %5.1f us) | checks %u of %u, errors %u, timeouts %u %s\n",
                c.name, layer_us, moved / ((layer_us - c.compute_us) * 1e3), layer_us - c.compute_us - copy_us,
                stats.layers ? stats.issue_us / stats.layers : 0.0, counters[2], expect, counters[1], counters[3],
                ok ? "ok" : "FAILED");
    CUDA_CHECK(cudaGraphExecDestroy(exec));
  }
  CUDA_CHECK(cudaEventDestroy(a));
  CUDA_CHECK(cudaEventDestroy(b));
  CUDA_CHECK(cudaStreamDestroy(s));
  CUDA_CHECK(cudaStreamDestroy(copy));
  CUDA_CHECK(cudaFree(su.slots));
  CUDA_CHECK(cudaFree(su.flags));
  CUDA_CHECK(cudaFree(su.ids));
  CUDA_CHECK(cudaFree(su.counters));
  CUDA_CHECK(cudaFreeHost(su.mailbox));
  CUDA_CHECK(cudaFreeHost(su.flag_values));
  CUDA_CHECK(cudaFreeHost(su.host));
  return failures == 0 ? 0 : 1;
}
