// Next-layer expert prefetch [TAG_EXPERT_PREFETCH]; launchers and protocol in expert_prefetch.cuh,
// CPU reference cpu/expert_prefetch.cpp.
//
// Predict: grid ceil(E / 2) blocks of 8 warps. Every block normalises the T <= 8 live rows itself
// (T x H fp32 + bf16 from L2: 24 KB a row at Qwen3-235B's H = 4096, far less than the router's
// E x H bf16 = 1 MB that the grid splits), keeps them in shared memory as bf16, and 4 warps take
// one expert: its router row is read once (16-byte loads, each lane's loads issued together) and
// dotted with every row. The last block to finish (threadFenceReduction: fence, one atomic, the
// block that brings the count to the grid size) ranks the logits from L2 and writes the record.
// The ranking is O(T E^2) comparisons (E = 128: 64 per thread per token), cheaper than a sort at
// these sizes, and exact: the Borda counts are integers, so the selection is the CPU reference's
// for the same logits. It is on the step's critical path (the copy needs its record), so it is
// built for latency: a few round trips, not a bandwidth-sized grid.
//
// Copy: `blocks` x 128 threads stream each segment (an expert's w13 weights, w13 scales, w2
// weights, w2 scales) with eight 16-byte loads in flight per thread: a PCIe read takes ~1-2 us, so
// the ~50 GB/s link needs ~100 KB in flight (Little's law), and one 16 KB block per SM is ~2 MB.
// The grid size barely matters for the rate (run Z29: 16 x 512 up to 264 x 128 threads all read
// 10 MB at ~49 GB/s, alone or beside kernels that leave thread room on each SM); small blocks are
// the ones most likely to find that room. What matters is when it starts: the launch carries a
// priority so its blocks are dispatched ahead of the main stream's pending ones (run Z31: at equal
// priority the copy started 26 us late, behind the qkv GEMV's blocks).
// Sources are the saved home entries, so the same kernel copies from mapped pinned memory or from
// the device. Segments whose addresses or sizes are not 16-byte multiples (scale arrays of some
// shapes) go by 4-byte words, then bytes.
#include "kernels/expert_prefetch.cuh"

#include <algorithm>

#include "kernels/cuda_check.h"

namespace moebius::kernels {
namespace {

constexpr int kPredictWarps = 8;
constexpr int kPredictThreads = kPredictWarps * 32;
constexpr int kPredictExpertsPerBlock = 2;
constexpr int kPredictWarpsPerExpert = kPredictWarps / kPredictExpertsPerBlock;
constexpr int kDotLoads = 4;  // 16-byte router loads a lane keeps in flight
constexpr int kCopyThreads = 128;
constexpr int kCopyLoadsInFlight = 8;

// Table entries written by this block earlier in the kernel: read through L2, never a stale L1 line.
__device__ __forceinline__ ExpertMatrixPtrs load_entry_cg(const ExpertMatrixPtrs* p) {
  static_assert(sizeof(ExpertMatrixPtrs) == 24 && alignof(ExpertMatrixPtrs) == 8, "three 8-byte words");
  const unsigned long long* w = reinterpret_cast<const unsigned long long*>(p);
  unsigned long long v[3];
#pragma unroll
  for (int i = 0; i < 3; ++i) v[i] = __ldcg(w + i);
  ExpertMatrixPtrs e;
  memcpy(&e, v, sizeof(e));
  return e;
}

// Each of the kExpertPrefetchMaxTokens per-lane values summed over the warp, into out[t] (lane 0).
__device__ __forceinline__ void warp_sums_to_shared(const float (&v)[kExpertPrefetchMaxTokens],
                                                    float* out /* [kExpertPrefetchMaxTokens] */, int lane) {
#pragma unroll
  for (int t = 0; t < kExpertPrefetchMaxTokens; ++t) {
    float x = v[t];
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    if (lane == 0) out[t] = x;
  }
}

// Eight consecutive elements of row t of the residual plus its delta, as fp32 (16-byte loads: H is a
// multiple of 8 and the rows 16-byte aligned, checked by the launcher).
__device__ __forceinline__ void load_row8(const ExpertPrefetchPredictArgs& a, int t, int i, float v[8]) {
  const size_t o = static_cast<size_t>(t) * a.hidden + i;
  const float4 x0 = *reinterpret_cast<const float4*>(a.resid + o);
  const float4 x1 = *reinterpret_cast<const float4*>(a.resid + o + 4);
  v[0] = x0.x, v[1] = x0.y, v[2] = x0.z, v[3] = x0.w, v[4] = x1.x, v[5] = x1.y, v[6] = x1.z, v[7] = x1.w;
  if (a.delta != nullptr) {
    const uint4 d = *reinterpret_cast<const uint4*>(a.delta + o);
    const __nv_bfloat162* d2 = reinterpret_cast<const __nv_bfloat162*>(&d);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(d2[j]);
      v[2 * j] += f.x;
      v[2 * j + 1] += f.y;
    }
  }
}

// dynamic shared memory: xn [capacity][hidden] bf16.
// Block b takes experts kPredictExpertsPerBlock * b + (0, 1), kPredictWarpsPerExpert warps each.
// Run Z29 (H100, Qwen3-235B H = 4096, T = 1) timed the first version at 23.5 us: its loops issued
// one load a thread per iteration (16 dependent L2 / HBM round trips for the norm, 16 more for a
// warp's router row). Here every loop issues its loads together: ~one round trip for the norm,
// one for the 4 KB of router row a warp reads at H = 4096, over 64 blocks instead of 16.
__global__ void __launch_bounds__(kPredictThreads) expert_prefetch_predict_kernel(const ExpertPrefetchPredictArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  __nv_bfloat16* xn = reinterpret_cast<__nv_bfloat16*>(smem);
  __shared__ float red[kPredictWarps][kExpertPrefetchMaxTokens];
  __shared__ float rscale[kExpertPrefetchMaxTokens];
  __shared__ float lg[kExpertPrefetchMaxTokens * kExpertPrefetchMaxExperts];  // the last block's logits
  __shared__ int score[kExpertPrefetchMaxExperts];
  __shared__ int sel[kExpertPrefetchMaxSlots];
  __shared__ int ncand;
  __shared__ bool last;
  const int H = a.hidden, E = a.num_experts, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  __shared__ uint8_t cold[kExpertPrefetchMaxExperts];
  ExpertPrefetchRecord* rec = a.record;
  // The set's previous owner (an earlier MoE layer, finished before this launch) gets its home
  // entries back first thing, in block 0, off the last block's serial tail: every block's atomic
  // below follows its fence, so the last block's record writes come after these reads.
  if (blockIdx.x == 0 && tid < kExpertPrefetchMaxSlots) {
    const int old_count = rec->count;
    ExpertMatrixPtrs* const t13 = rec->table13;
    ExpertMatrixPtrs* const t2 = rec->table2;
    const int id = rec->ids[tid];
    const ExpertMatrixPtrs s13 = rec->saved13[tid], s2 = rec->saved2[tid];
    if (tid < min(old_count, kExpertPrefetchMaxSlots) && t2 != nullptr) {
      if (t13 != nullptr) t13[id] = s13;
      t2[id] = s2;
    }
  }
  for (int x = tid; x < E; x += kPredictThreads) cold[x] = a.cold[x];
  const int T = max(0, min(*a.num_tokens, a.capacity));
  const int chunks = H / 8;  // 8-element chunks of a row

  // The router rows: kPredictWarpsPerExpert warps split an expert's row by interleaved 16-byte
  // chunks, a lane's kDotLoads chunks loaded together (H = 4096: all of them). The first group is
  // loaded before the norm below, which hides its HBM round trip.
  const int e = blockIdx.x * kPredictExpertsPerBlock + warp / kPredictWarpsPerExpert;
  const int part = warp % kPredictWarpsPerExpert;
  constexpr int kStride = kPredictWarpsPerExpert * 32;  // chunks between a lane's consecutive ones
  const __nv_bfloat16* w = a.router + static_cast<size_t>(e < E ? e : 0) * H;
  uint4 wv[kDotLoads];
  auto load_router = [&](int c0) {
#pragma unroll
    for (int u = 0; u < kDotLoads; ++u) {
      const int c = c0 + u * kStride;
      wv[u] = (e < E && c < chunks) ? __ldg(reinterpret_cast<const uint4*>(w + c * 8)) : make_uint4(0, 0, 0, 0);
    }
  };
  const int c_first = part * 32 + lane;
  load_router(c_first);

  // Each live row's sum of squares (cpu: over x + delta in fp32), all rows at once, 4 chunks of
  // loads in flight a thread.
  float ss[kExpertPrefetchMaxTokens];
#pragma unroll
  for (int t = 0; t < kExpertPrefetchMaxTokens; ++t) ss[t] = 0;
#pragma unroll
  for (int t = 0; t < kExpertPrefetchMaxTokens; ++t) {
    if (t >= T) break;
#pragma unroll 4
    for (int c = tid; c < chunks; c += kPredictThreads) {
      float v[8];
      load_row8(a, t, c * 8, v);
#pragma unroll
      for (int j = 0; j < 8; ++j) ss[t] = fmaf(v[j], v[j], ss[t]);
    }
  }
  warp_sums_to_shared(ss, red[warp], lane);
  __syncthreads();
  if (tid < T) {
    float s = 0;
#pragma unroll
    for (int w = 0; w < kPredictWarps; ++w) s += red[w][tid];
    rscale[tid] = rsqrtf(s / static_cast<float>(H) + a.eps);
  }
  __syncthreads();
  // The normalised bf16 rows (cpu: bf16(x * r * w)); the second read of the rows hits L1.
  for (int t = 0; t < T; ++t) {
    const float r = rscale[t];
#pragma unroll 4
    for (int c = tid; c < chunks; c += kPredictThreads) {
      float v[8];
      load_row8(a, t, c * 8, v);
      const float4 w0 = *reinterpret_cast<const float4*>(a.norm_weight + c * 8);
      const float4 w1 = *reinterpret_cast<const float4*>(a.norm_weight + c * 8 + 4);
      const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
      uint4 packed;
      __nv_bfloat162* p2 = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
      for (int j = 0; j < 4; ++j)
        p2[j] = __halves2bfloat162(__float2bfloat16(v[2 * j] * r * w[2 * j]),
                                   __float2bfloat16(v[2 * j + 1] * r * w[2 * j + 1]));
      *reinterpret_cast<uint4*>(xn + static_cast<size_t>(t) * H + c * 8) = packed;
    }
  }
  __syncthreads();

  // Router row . every normalised row.
  float acc[kExpertPrefetchMaxTokens];
#pragma unroll
  for (int t = 0; t < kExpertPrefetchMaxTokens; ++t) acc[t] = 0;
  if (e < E) {
    for (int c0 = c_first; c0 < chunks; c0 += kDotLoads * kStride) {
      if (c0 != c_first) load_router(c0);
#pragma unroll
      for (int u = 0; u < kDotLoads; ++u) {
        const int c = c0 + u * kStride;
        if (c >= chunks) break;
        const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv[u]);
#pragma unroll
        for (int t = 0; t < kExpertPrefetchMaxTokens; ++t) {
          if (t >= T) break;
          const uint4 xv = *reinterpret_cast<const uint4*>(xn + static_cast<size_t>(t) * H + c * 8);
          const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 wf = __bfloat1622float2(w2[j]), xf = __bfloat1622float2(x2[j]);
            acc[t] = fmaf(wf.x, xf.x, acc[t]);
            acc[t] = fmaf(wf.y, xf.y, acc[t]);
          }
        }
      }
    }
  }
  warp_sums_to_shared(acc, red[warp], lane);
  __syncthreads();
  // The parts summed in a fixed order (run to run the same logits).
  if (tid < kPredictExpertsPerBlock * kExpertPrefetchMaxTokens) {
    const int k = tid / kExpertPrefetchMaxTokens, t = tid % kExpertPrefetchMaxTokens;
    const int ex = blockIdx.x * kPredictExpertsPerBlock + k;
    if (ex < E && t < T) {
      float v = 0;
#pragma unroll
      for (int p = 0; p < kPredictWarpsPerExpert; ++p) v += red[k * kPredictWarpsPerExpert + p][t];
      a.logits[static_cast<size_t>(t) * E + ex] = v + (a.correction_bias ? a.correction_bias[ex] : 0.0f);
    }
  }

  // The last block ranks and writes the record.
  __threadfence();
  __syncthreads();
  if (tid == 0) last = atomicAdd(a.counter, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int i = tid; i < T * E; i += kPredictThreads) lg[i] = __ldcg(a.logits + i);
  if (tid == 0) ncand = 0;
  __syncthreads();
  for (int x = tid; x < E; x += kPredictThreads) {
    int s = 0;
    for (int t = 0; t < T; ++t) {
      const float* l = lg + t * E;
      const float v = l[x];
      int rank = 0;
      for (int o = 0; o < E; ++o) rank += (l[o] > v || (l[o] == v && o < x)) ? 1 : 0;
      s += max(0, a.top_k - rank);
    }
    score[x] = s;
  }
  __syncthreads();
  for (int x = tid; x < E; x += kPredictThreads) {
    if (cold[x] == 0 || score[x] <= 0) continue;
    atomicAdd(&ncand, 1);
    int rank = 0;
    for (int o = 0; o < E; ++o)
      rank += (cold[o] != 0 && score[o] > 0 && (score[o] > score[x] || (score[o] == score[x] && o < x))) ? 1 : 0;
    if (rank < a.slots) sel[rank] = x;
  }
  __syncthreads();
  const int count = min(ncand, a.slots);
  if (tid < count) {
    const int id = sel[tid];
    rec->ids[tid] = id;
    rec->saved13[tid] = a.table13 != nullptr ? load_entry_cg(a.table13 + id) : ExpertMatrixPtrs{};
    rec->saved2[tid] = load_entry_cg(a.table2 + id);
    if (a.log) a.log[1 + tid] = id;
  }
  if (tid == 0) {
    rec->count = count;
    rec->table13 = count > 0 ? a.table13 : nullptr;
    rec->table2 = count > 0 ? a.table2 : nullptr;
    if (a.log) a.log[0] = count;
    *a.counter = 0;  // ready for the next launch (graph replays need no memset)
  }
}

// Read once (ld.global.cs: evict-first in L2; this step never reads the source again).
template <typename V>
__device__ __forceinline__ V load_stream(const V* p) {
  return __ldcs(p);
}

// n elements of V from src to dst, grid-strided, kCopyLoadsInFlight loads per thread per round.
template <typename V>
__device__ void copy_elems(const V* __restrict__ src, V* __restrict__ dst, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * kCopyThreads;
  size_t i = static_cast<size_t>(blockIdx.x) * kCopyThreads + threadIdx.x;
  for (; i + (kCopyLoadsInFlight - 1) * stride < n; i += kCopyLoadsInFlight * stride) {
    V v[kCopyLoadsInFlight];
#pragma unroll
    for (int r = 0; r < kCopyLoadsInFlight; ++r) v[r] = load_stream(src + i + r * stride);
#pragma unroll
    for (int r = 0; r < kCopyLoadsInFlight; ++r) dst[i + r * stride] = v[r];
  }
  for (; i < n; i += stride) dst[i] = load_stream(src + i);
}

__device__ void copy_segment(const uint8_t* src, uint8_t* dst, size_t bytes) {
  const uintptr_t mis = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst);
  size_t done = 0;
  if ((mis & 15) == 0) {
    copy_elems(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst), bytes / 16);
    done = bytes / 16 * 16;
  } else if ((mis & 3) == 0) {
    copy_elems(reinterpret_cast<const uint32_t*>(src), reinterpret_cast<uint32_t*>(dst), bytes / 4);
    done = bytes / 4 * 4;
  }
  if (blockIdx.x == 0)  // the tail (or everything, for byte-aligned arrays)
    for (size_t i = done + threadIdx.x; i < bytes; i += kCopyThreads) dst[i] = src[i];
}

__global__ void __launch_bounds__(kCopyThreads) expert_prefetch_copy_kernel(const ExpertPrefetchRecord* rec,
                                                                           const ExpertPrefetchSlots s) {
  const int count = min(rec->count, kExpertPrefetchMaxSlots);
  for (int i = 0; i < count; ++i) {
    uint8_t* slot = s.base + static_cast<size_t>(i) * s.stride;
    const ExpertMatrixPtrs a = rec->saved13[i], b = rec->saved2[i];
    if (rec->table13 != nullptr) {  // not a down-only prefetch
      copy_segment(static_cast<const uint8_t*>(a.weight), slot, s.w13_bytes);
      if (a.scales) copy_segment(static_cast<const uint8_t*>(a.scales), slot + s.off_s13, s.s13_bytes);
    }
    copy_segment(static_cast<const uint8_t*>(b.weight), slot + s.off_w2, s.w2_bytes);
    if (b.scales) copy_segment(static_cast<const uint8_t*>(b.scales), slot + s.off_s2, s.s2_bytes);
  }
}

__global__ void expert_prefetch_publish_kernel(const ExpertPrefetchRecord* rec, const ExpertPrefetchSlots s) {
  const int i = threadIdx.x;
  if (i >= min(rec->count, kExpertPrefetchMaxSlots) || rec->table2 == nullptr) return;
  uint8_t* slot = s.base + static_cast<size_t>(i) * s.stride;
  ExpertMatrixPtrs a = rec->saved13[i], b = rec->saved2[i];
  a.weight = slot;
  a.scales = a.scales ? slot + s.off_s13 : nullptr;
  b.weight = slot + s.off_w2;
  b.scales = b.scales ? slot + s.off_s2 : nullptr;
  if (rec->table13 != nullptr) rec->table13[rec->ids[i]] = a;
  rec->table2[rec->ids[i]] = b;
}

__global__ void expert_prefetch_restore_kernel(ExpertPrefetchRecord* rec) {
  const int i = threadIdx.x;
  if (i < min(rec->count, kExpertPrefetchMaxSlots) && rec->table2 != nullptr) {
    if (rec->table13 != nullptr) rec->table13[rec->ids[i]] = rec->saved13[i];
    rec->table2[rec->ids[i]] = rec->saved2[i];
  }
  __syncthreads();
  if (i == 0) {
    rec->count = 0;
    rec->table13 = nullptr;
    rec->table2 = nullptr;
  }
}

}  // namespace

void launch_expert_prefetch_predict(const ExpertPrefetchPredictArgs& a, cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(a.resid && a.norm_weight && a.router && a.cold && a.num_tokens && a.table2 &&
                            a.record && a.logits && a.counter,
                        "expert prefetch predict: null argument");
  MOEBIUS_LAUNCH_ASSERT(a.hidden > 0 && a.hidden % 8 == 0, "expert prefetch predict: hidden must be a multiple of 8");
  MOEBIUS_LAUNCH_ASSERT(a.num_experts > 0 && a.num_experts <= kExpertPrefetchMaxExperts,
                        "expert prefetch predict: num_experts out of range");
  MOEBIUS_LAUNCH_ASSERT(a.top_k > 0 && a.top_k <= a.num_experts, "expert prefetch predict: top_k out of range");
  MOEBIUS_LAUNCH_ASSERT(a.capacity > 0 && a.capacity <= kExpertPrefetchMaxTokens,
                        "expert prefetch predict: capacity out of range");
  MOEBIUS_LAUNCH_ASSERT(a.slots >= 0 && a.slots <= kExpertPrefetchMaxSlots, "expert prefetch predict: slots out of range");
  MOEBIUS_LAUNCH_ASSERT(reinterpret_cast<uintptr_t>(a.router) % 16 == 0 && reinterpret_cast<uintptr_t>(a.resid) % 16 == 0 &&
                            reinterpret_cast<uintptr_t>(a.delta) % 16 == 0 &&
                            reinterpret_cast<uintptr_t>(a.norm_weight) % 16 == 0,
                        "expert prefetch predict: router, resid, delta and norm weight 16-byte aligned");
  const size_t smem = sizeof(__nv_bfloat16) * static_cast<size_t>(a.capacity) * static_cast<size_t>(a.hidden);
  MOEBIUS_LAUNCH_ASSERT(smem <= 160 * 1024, "expert prefetch predict: capacity x hidden too large for shared memory");
  if (smem > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(expert_prefetch_predict_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
  const int blocks = (a.num_experts + kPredictExpertsPerBlock - 1) / kPredictExpertsPerBlock;
  expert_prefetch_predict_kernel<<<blocks, kPredictThreads, smem, stream>>>(a);
  CUDA_CHECK_LAUNCH();
}

void launch_expert_prefetch_copy(const ExpertPrefetchRecord* record, const ExpertPrefetchSlots& slots, int blocks,
                                 int priority, cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(record != nullptr && slots.base != nullptr, "expert prefetch copy: null argument");
  MOEBIUS_LAUNCH_ASSERT(blocks > 0 && blocks <= 1024, "expert prefetch copy: blocks out of range");
  MOEBIUS_LAUNCH_ASSERT(slots.stride % 256 == 0 && reinterpret_cast<uintptr_t>(slots.base) % 256 == 0,
                        "expert prefetch copy: slots must be 256-byte aligned");
  // The priority as a launch attribute, not only the stream's: stream capture keeps it on the node.
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(kCopyThreads);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributePriority;
  attr[0].val.priority = priority;
  config.attrs = attr;
  config.numAttrs = 1;
  CUDA_CHECK(cudaLaunchKernelEx(&config, expert_prefetch_copy_kernel, record, slots));
}

void launch_expert_prefetch_publish(const ExpertPrefetchRecord* record, const ExpertPrefetchSlots& slots,
                                    cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(record != nullptr && slots.base != nullptr, "expert prefetch publish: null argument");
  expert_prefetch_publish_kernel<<<1, 32, 0, stream>>>(record, slots);
  CUDA_CHECK_LAUNCH();
}

void launch_expert_prefetch_restore(ExpertPrefetchRecord* record, cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(record != nullptr, "expert prefetch restore: null argument");
  expert_prefetch_restore_kernel<<<1, 32, 0, stream>>>(record);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moebius::kernels
