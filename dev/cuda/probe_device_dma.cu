// Probe: can the DEVICE choose which pinned-host experts the copy engines move? (docs/OFFLOAD.md,
// "Slow zero-copy hosts": on some hosts a kernel reads mapped memory at ~33 GB/s while pinned
// DMA copies run at 55 GB/s; and even at 51 GB/s a kernel read is ~7% below the copy engines.)
//
// The mechanism: a CUDA graph whose switch conditional nodes have one memcpy node per expert as
// their branches. A kernel that knows the routing sets each switch's value
// (cudaGraphSetConditional) to the expert a slot should receive; the switch then runs exactly that
// branch's host-to-device copy. One switch per slot, so a MoE layer with S slots holds S x E
// memcpy nodes, and a Qwen3-235B-A22B decode graph (94 MoE layers, 8 slots, 128 experts) ~96k.
//
// Questions, each printed:
//   1. Does it work (the right bytes land in every slot, every replay, with ids the kernel picks)?
//   2. The rate: bytes moved / replay time, against a plain pinned cudaMemcpyAsync of the same bytes
//      and a kernel reading them through the mapped alias (the zero-copy path).
//   3. The latency a layer adds: pick kernel -> S switches -> a consumer kernel, per layer, in a
//      chain of layers (the decode step's shape), at S = 8 whole experts and S = 2 down projections.
//   4. The cost of the node count: graph build and instantiate time for 1, 8 and 94 layers.
// Answer (run Z37, docs/PERF.md; H100): correct on every replay, but the copies ran at 32.7-33.0
// GB/s, the rate of a kernel reading mapped memory on that host (33.7), not the copy engines' 54.4;
// and instantiation grew faster than the node count (28 s at 96k nodes). dev/cuda/probe_host_copy.cu
// tries the other way: a host thread issues the copies the device posts.
// Sizes: Qwen3-235B-A22B int2: an expert 5.01 MB, its down projection (w2 + scales) 1.67 MB.
// Usage: dev_probe_device_dma   (no arguments)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kernels/cuda_check.h"
#include "probe_expert_tags.h"
#include "probe_util.h"

namespace {

using dev_probe::kProbeExperts;
using dev_probe::pick_id;
constexpr int kExperts = kProbeExperts;

// Sets the layer's S switch values; its ids go to `ids` for the check. replay: device counter.
__global__ void pick_kernel(const cudaGraphConditionalHandle* handles, int slots, int layer, const unsigned* replay,
                            unsigned* ids) {
  const int j = threadIdx.x;
  if (j >= slots) return;
  const unsigned id = pick_id(*replay, layer, j);
  ids[j] = id;
  cudaGraphSetConditional(handles[j], id);
}

__global__ void bump_kernel(unsigned* replay) { *replay += 1; }

struct Setup {
  unsigned char* host = nullptr;  // [E][bytes] pinned, mapped
  unsigned char* slots = nullptr;  // [layers][S][bytes] on the device
  cudaGraphConditionalHandle* handles = nullptr;  // device: [layers][S]
  unsigned* ids = nullptr;                        // device: [layers][S]
  unsigned* counters = nullptr;                   // device: replay, errors, checked
};

cudaGraphNode_t add_kernel(cudaGraph_t g, const std::vector<cudaGraphNode_t>& deps, void* fn, dim3 grid, dim3 block,
                           void** args) {
  cudaKernelNodeParams p{};
  p.func = fn;
  p.gridDim = grid;
  p.blockDim = block;
  p.kernelParams = args;
  cudaGraphNode_t n;
  CUDA_CHECK(cudaGraphAddKernelNode(&n, g, deps.data(), deps.size(), &p));
  return n;
}

struct Built {
  cudaGraphExec_t exec = nullptr;
  double build_ms = 0, instantiate_ms = 0;
  size_t memcpy_nodes = 0;
};

// One graph: per layer pick -> S switches (E memcpy branches each) -> check, layers in a chain
// (each layer's pick after the previous check), then the replay counter's bump.
Built build(const Setup& su, int layers, int slots, size_t bytes, size_t slot_stride_layers) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  cudaGraph_t g;
  CUDA_CHECK(cudaGraphCreate(&g, 0));
  std::vector<cudaGraphConditionalHandle> h(static_cast<size_t>(layers) * slots);
  for (auto& x : h) CUDA_CHECK(cudaGraphConditionalHandleCreate(&x, g, kExperts, cudaGraphCondAssignDefault));
  CUDA_CHECK(cudaMemcpy(su.handles, h.data(), h.size() * sizeof(h[0]), cudaMemcpyHostToDevice));
  Built b;
  std::vector<cudaGraphNode_t> prev;
  // Kernel arguments must outlive the add calls only (the node copies them).
  for (int l = 0; l < layers; ++l) {
    const cudaGraphConditionalHandle* hl = su.handles + static_cast<size_t>(l) * slots;
    unsigned* ids = su.ids + static_cast<size_t>(l) * slots;
    int layer = l, n_slots = slots;
    const unsigned* replay = su.counters;
    void* pick_args[] = {&hl, &n_slots, &layer, &replay, &ids};
    cudaGraphNode_t pick = add_kernel(g, prev, reinterpret_cast<void*>(pick_kernel), dim3(1), dim3(32), pick_args);
    unsigned char* layer_slots = su.slots + (l % slot_stride_layers) * static_cast<size_t>(slots) * bytes;
    std::vector<cudaGraphNode_t> sw(static_cast<size_t>(slots));
    for (int j = 0; j < slots; ++j) {
      cudaGraphNodeParams p{};
      p.type = cudaGraphNodeTypeConditional;
      p.conditional.handle = h[static_cast<size_t>(l) * slots + j];
      p.conditional.type = cudaGraphCondTypeSwitch;
      p.conditional.size = kExperts;
      CUDA_CHECK(cudaGraphAddNode(&sw[static_cast<size_t>(j)], g, &pick, nullptr, 1, &p));
      for (int e = 0; e < kExperts; ++e) {
        cudaGraphNode_t m;
        CUDA_CHECK(cudaGraphAddMemcpyNode1D(&m, p.conditional.phGraph_out[e], nullptr, 0,
                                            layer_slots + static_cast<size_t>(j) * bytes,
                                            su.host + static_cast<size_t>(e) * bytes, bytes, cudaMemcpyHostToDevice));
        ++b.memcpy_nodes;
      }
    }
    const unsigned char* cs = layer_slots;
    size_t nbytes = bytes;
    unsigned* errors = su.counters + 1;
    unsigned* checked = su.counters + 2;
    const unsigned* cids = ids;
    void* check_args[] = {&cs, &nbytes, &n_slots, &cids, &errors, &checked};
    prev = {add_kernel(g, sw, reinterpret_cast<void*>(dev_probe::check_slot_tags), dim3(1), dim3(32), check_args)};
  }
  unsigned* replay_w = su.counters;
  void* bump_args[] = {&replay_w};
  add_kernel(g, prev, reinterpret_cast<void*>(bump_kernel), dim3(1), dim3(1), bump_args);
  const auto t1 = clock::now();
  CUDA_CHECK(cudaGraphInstantiate(&b.exec, g, 0));
  const auto t2 = clock::now();
  CUDA_CHECK(cudaGraphDestroy(g));
  b.build_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
  b.instantiate_ms = std::chrono::duration<double, std::milli>(t2 - t1).count();
  return b;
}

// Median us per replay of `exec` (11 timings of `reps` replays each, after 3 warm-up replays).
double time_replays(cudaGraphExec_t exec, cudaStream_t s, int reps) {
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) CUDA_CHECK(cudaGraphLaunch(exec, s));
  std::vector<double> t;
  for (int k = 0; k < 11; ++k) {
    CUDA_CHECK(cudaEventRecord(a, s));
    for (int i = 0; i < reps; ++i) CUDA_CHECK(cudaGraphLaunch(exec, s));
    CUDA_CHECK(cudaEventRecord(b, s));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(1000.0 * ms / reps);
  }
  std::sort(t.begin(), t.end());
  CUDA_CHECK(cudaEventDestroy(a));
  CUDA_CHECK(cudaEventDestroy(b));
  return t[t.size() / 2];
}

}  // namespace

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("no CUDA device\n");
    return 0;
  }
  const size_t expert_bytes = dev_probe::kInt2ExpertBytes, down_bytes = dev_probe::kInt2DownBytes;
  const int max_layers = 94, max_slots = 8;
  Setup su;
  CUDA_CHECK(cudaHostAlloc(&su.host, kExperts * expert_bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(su.host, 0x5A, kExperts * expert_bytes);
  // Both sizes' tags: the down-projection runs copy the first down_bytes of each expert's stride...
  // so each probe size gets its own layout below (re-tagged before its runs).
  auto tag = [&](size_t bytes) { dev_probe::tag_experts(su.host, bytes); };
  const size_t slot_layers = 2;  // layers alternate between two slot sets, as a decode step would
  CUDA_CHECK(cudaMalloc(&su.slots, slot_layers * max_slots * expert_bytes));
  CUDA_CHECK(cudaMalloc(&su.handles, sizeof(cudaGraphConditionalHandle) * max_layers * max_slots));
  CUDA_CHECK(cudaMalloc(&su.ids, sizeof(unsigned) * max_layers * max_slots));
  CUDA_CHECK(cudaMalloc(&su.counters, sizeof(unsigned) * 4));
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  // Baselines on the same bytes: pinned DMA of S whole experts, and a kernel reading them mapped.
  {
    tag(expert_bytes);
    const size_t bytes = max_slots * expert_bytes;
    cudaEvent_t a, b;
    CUDA_CHECK(cudaEventCreate(&a));
    CUDA_CHECK(cudaEventCreate(&b));
    std::vector<double> dma, zc;
    unsigned char* dev_alias = nullptr;
    CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_alias), su.host, 0));
    int sms = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    for (int k = 0; k < 7; ++k) {
      const size_t off = static_cast<size_t>(k % 8) * bytes;  // a different 40 MB each time
      float ms = 0;
      CUDA_CHECK(cudaEventRecord(a, s));
      CUDA_CHECK(cudaMemcpyAsync(su.slots, su.host + off, bytes, cudaMemcpyHostToDevice, s));
      CUDA_CHECK(cudaEventRecord(b, s));
      CUDA_CHECK(cudaEventSynchronize(b));
      CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      dma.push_back(bytes / (ms * 1e6));
      CUDA_CHECK(cudaEventRecord(a, s));
      dev_probe::read_v4x4<<<sms * 4, 256, 0, s>>>(reinterpret_cast<const uint4*>(dev_alias + off), bytes / 16, su.counters + 3);
      CUDA_CHECK(cudaEventRecord(b, s));
      CUDA_CHECK(cudaEventSynchronize(b));
      CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      zc.push_back(bytes / (ms * 1e6));
    }
    std::sort(dma.begin(), dma.end());
    std::sort(zc.begin(), zc.end());
    std::printf("baseline, 8 experts (%.1f MB): pinned cudaMemcpyAsync %.1f GB/s, kernel reading mapped %.1f GB/s "
                "(median of 7)\n",
                bytes / 1e6, dma[3], zc[3]);
    CUDA_CHECK(cudaEventDestroy(a));
    CUDA_CHECK(cudaEventDestroy(b));
  }

  struct Case {
    const char* name;
    int layers, slots;
    size_t bytes;
    int reps;
  };
  const Case cases[] = {
      {"whole experts, 8 slots, 1 layer", 1, 8, expert_bytes, 20},
      {"whole experts, 8 slots, 8 layers", 8, 8, expert_bytes, 5},
      {"down projections, 2 slots, 8 layers", 8, 2, down_bytes, 20},
      {"down projections, 1 slot, 8 layers", 8, 1, down_bytes, 20},
      {"whole experts, 8 slots, 94 layers", 94, 8, expert_bytes, 2},
  };
  int failures = 0;
  for (const Case& c : cases) {
    tag(c.bytes);
    CUDA_CHECK(cudaMemset(su.counters, 0, sizeof(unsigned) * 4));
    CUDA_CHECK(cudaMemset(su.slots, 0, slot_layers * max_slots * expert_bytes));
    const Built b = build(su, c.layers, c.slots, c.bytes, slot_layers);
    const double us = time_replays(b.exec, s, c.reps);
    CUDA_CHECK(cudaStreamSynchronize(s));
    unsigned counters[4];
    CUDA_CHECK(cudaMemcpy(counters, su.counters, sizeof(counters), cudaMemcpyDeviceToHost));
    const double moved = static_cast<double>(c.layers) * c.slots * c.bytes;
    const unsigned replays = counters[0];
    const unsigned expect = replays * static_cast<unsigned>(c.layers * c.slots);
    const bool ok = counters[1] == 0 && counters[2] == expect && replays > 0;
    if (!ok) ++failures;
    std::printf(
        "%-38s %6zu memcpy nodes: build %8.1f ms, instantiate %8.1f ms | %9.1f us a replay, %7.1f us a layer, "
        "%5.1f GB/s | checks %u of %u, errors %u %s\n",
        c.name, b.memcpy_nodes, b.build_ms, b.instantiate_ms, us, us / c.layers, moved / (us * 1e3), counters[2],
        expect, counters[1], ok ? "ok" : "FAILED");
    CUDA_CHECK(cudaGraphExecDestroy(b.exec));
  }
  CUDA_CHECK(cudaStreamDestroy(s));
  CUDA_CHECK(cudaFree(su.slots));
  CUDA_CHECK(cudaFree(su.handles));
  CUDA_CHECK(cudaFree(su.ids));
  CUDA_CHECK(cudaFree(su.counters));
  CUDA_CHECK(cudaFreeHost(su.host));
  return failures == 0 ? 0 : 1;
}
