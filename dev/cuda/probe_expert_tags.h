// Tagged experts for the expert-copy probes (probe_device_dma.cu, probe_host_copy.cu): a pinned
// host array of kProbeExperts experts whose bytes start and end with a tag word, the ids each
// (replay, layer, slot) copies, and a kernel that checks both ends of every slot, so a skipped,
// late or wrong copy counts as an error. Sizes: Qwen3-235B-A22B int2.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace dev_probe {

inline constexpr int kProbeExperts = 128;
inline constexpr size_t kInt2ExpertBytes = 5013504;  // 3 x 4096 x 1536 x 2 bits + fp16 scales per 128
inline constexpr size_t kInt2DownBytes = 1671168;    // its w2 + scales

// The expert a slot of a layer receives in replay r: distinct over the layer's slots (stride 17 is
// coprime to 128), changing with the replay and the layer.
__host__ __device__ inline unsigned pick_id(unsigned replay, int layer, int slot) {
  const unsigned base = (replay * 2654435761u + static_cast<unsigned>(layer) * 40503u) >> 7;
  return (base + static_cast<unsigned>(slot) * 17u) % kProbeExperts;
}

// The tag word at an expert's start (end 0) and in its last 4 bytes (end 1).
__host__ __device__ inline uint32_t tag_of(unsigned e, int end) { return (e + 1u) * 0x9E3779B1u + (end ? 7u : 0u); }

// Tags kProbeExperts experts of `bytes` each, back to back from `host`.
inline void tag_experts(unsigned char* host, size_t bytes) {
  for (unsigned e = 0; e < kProbeExperts; ++e) {
    unsigned char* p = host + e * bytes;
    const uint32_t a = tag_of(e, 0), z = tag_of(e, 1);
    std::memcpy(p, &a, 4);
    std::memcpy(p + bytes - 4, &z, 4);
  }
}

// One thread per slot j < n_slots: slot j (at slots + j * bytes) must hold expert ids[j].
__global__ inline void check_slot_tags(const unsigned char* slots, size_t bytes, int n_slots, const unsigned* ids,
                                       unsigned* errors, unsigned* checked) {
  const int j = threadIdx.x;
  if (j >= n_slots) return;
  const unsigned char* s = slots + static_cast<size_t>(j) * bytes;
  const uint32_t first = *reinterpret_cast<const uint32_t*>(s);
  const uint32_t last = *reinterpret_cast<const uint32_t*>(s + bytes - 4);
  if (first != tag_of(ids[j], 0) || last != tag_of(ids[j], 1)) atomicAdd(errors, 1u);
  atomicAdd(checked, 1u);
}

}  // namespace dev_probe
