// Which path serves a layer's cold experts, per layer and batch size (docs/OFFLOAD.md):
//   zero-copy  the GEMM kernels read the experts' pinned host memory directly through the address
//              table. Bytes cross PCIe once per token TILE that reads them: the decode kernel
//              streams an expert's weights once per tile of block_m tokens, so an expert routed
//              n times costs ceil(n / block_m) reads.
//   staged     a copy stream DMAs the layer's cold experts into a fixed device staging buffer
//              (double-buffered: layer l+1's copy runs under layer l's compute), and the kernels
//              read the staged copy at HBM speed. Bytes cross PCIe once per expert, but every cold
//              expert the layer may route to is copied (the routing is not known on the host
//              without a sync, and the forward never syncs), and the copy only hides behind the
//              previous layer's compute.
// The model is deliberately small: bytes over a measured rate plus a fixed latency. Its inputs
// (the rates) come from the H200 probe in the issue: 51.3 GB/s for a kernel reading mapped pinned
// memory with 16-byte loads, 55.3 GB/s for pinned cudaMemcpy.
#pragma once

#include <cstdint>

namespace moebius::offload {

struct LinkRates {
  double zero_copy_gbps = 51.3;   // kernel reads of mapped pinned memory (16-byte loads), H200
  double dma_gbps = 55.3;         // pinned cudaMemcpyAsync host -> device, H200
  double dma_latency_us = 8.0;    // one copy's issue + completion (an estimate; measure)
};

struct ColdLayerShape {
  int tokens = 1;            // T of the forward
  int top_k = 8;
  int num_experts = 128;
  int cold_experts = 0;      // of this layer
  uint64_t expert_bytes = 0;
  int block_m = 8;           // the GEMM's token tile at this T
  double hidden_compute_us = 0;  // compute of the previous layer a staged copy can hide under
};

enum class ColdPath : uint8_t { kZeroCopy, kStaged };
const char* cold_path_name(ColdPath p);

struct ColdCost {
  double touched_cold = 0;       // expected distinct cold experts routed to (uniform routing)
  double zero_copy_bytes = 0;    // bytes over PCIe on the zero-copy path
  double staged_bytes = 0;       // bytes over PCIe on the staged path (every cold expert)
  double zero_copy_us = 0;       // time those reads add to the forward
  double staged_us = 0;          // copy time not hidden under the previous layer
  ColdPath choice = ColdPath::kZeroCopy;
};

// Uniform routing: each token routes to a given expert with probability k / E (top-k picks k
// distinct experts), independently of the other tokens, so an expert is routed to by
// n ~ Binomial(T, k / E) tokens.
ColdCost cold_path_cost(const ColdLayerShape& s, const LinkRates& rates = {});

}  // namespace moebius::offload
