#include "kernels/ep_dispatch.cuh"

#include "kernels/cuda_check.h"

namespace moebius::kernels {
namespace {

constexpr int kPlanThreads = 1024;  // one block: the positions are a prefix count over all pairs
constexpr int kCopyThreads = 128;

// Positions by warp match: the lanes of a warp with the same destination find each other with
// __match_any_sync (sm_70+), the lowest such lane publishes the warp's count, and a lane's position
// is the destination's running base + the counts of the warps before it + its rank among its
// peers. One 1024-pair chunk per iteration; four barriers per chunk. At decode (T * k <= 512)
// this is one chunk.
__global__ void __launch_bounds__(kPlanThreads)
    ep_plan_kernel(const int32_t* __restrict__ ids,  // [capacity * k]
                   const int32_t* __restrict__ num_tokens, int capacity, int top_k, int num_experts, int num_ranks,
                   int slots, int32_t* __restrict__ send_pos, int32_t* __restrict__ send_counts,
                   int32_t* __restrict__ send_meta) {
  __shared__ int base[kEpMaxRanks];
  __shared__ int warp_count[kPlanThreads / 32][kEpMaxRanks];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int T = min(max(*num_tokens, 0), capacity);
  const int P = T * top_k, per = num_experts / num_ranks;
  if (tid < num_ranks) base[tid] = 0;
  for (int c0 = 0; c0 < P; c0 += kPlanThreads) {
    if (lane < num_ranks) warp_count[warp][lane] = 0;
    __syncthreads();
    const int p = c0 + tid;
    const bool live = p < P;
    const int id = live ? ids[p] : 0;
    const int d = live ? id / per : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, d);
    const int rank_in_warp = __popc(peers & ((1u << lane) - 1u));
    if (live && rank_in_warp == 0) warp_count[warp][d] = __popc(peers);
    __syncthreads();
    if (live) {
      int pos = base[d] + rank_in_warp;
      for (int w = 0; w < warp; ++w) pos += warp_count[w][d];
      send_pos[p] = pos;
      send_meta[static_cast<int64_t>(d) * slots + pos] = id - d * per;
    }
    __syncthreads();
    if (tid < num_ranks) {
      int add = 0;
      for (int w = 0; w < kPlanThreads / 32; ++w) add += warp_count[w][tid];
      base[tid] += add;
    }
    __syncthreads();
  }
  if (tid < num_ranks) send_counts[tid] = base[tid];
}

// Copies one row of `vecs` 16-byte vectors; the row is read once, so streaming loads.
__device__ __forceinline__ void copy_row(const int4* __restrict__ src, int4* __restrict__ dst, int vecs) {
  for (int v = threadIdx.x; v < vecs; v += blockDim.x) dst[v] = __ldcs(src + v);
}

// One block per pair (grid capacity * k): dead pairs exit.
__global__ void __launch_bounds__(kCopyThreads)
    ep_pack_rows_kernel(const __nv_bfloat16* __restrict__ x, const int32_t* __restrict__ ids,
                        const int32_t* __restrict__ send_pos, const int32_t* __restrict__ num_tokens, int capacity,
                        int hidden, int top_k, int per, int slots, __nv_bfloat16* __restrict__ send_x) {
  const int p = blockIdx.x;
  const int T = min(max(*num_tokens, 0), capacity);
  if (p >= T * top_k) return;
  const int d = ids[p] / per;
  const int64_t row = static_cast<int64_t>(d) * slots + send_pos[p];
  copy_row(reinterpret_cast<const int4*>(x + static_cast<int64_t>(p / top_k) * hidden),
           reinterpret_cast<int4*>(send_x + row * hidden), hidden / 8);
}

// Source rank s and the first compacted row of its rows: counts is [N * N], rank `me`'s column.
__device__ __forceinline__ int prefix_before(const int32_t* counts, int me, int num_ranks, int s) {
  int j = 0;
  for (int r = 0; r < s; ++r) j += counts[r * num_ranks + me];
  return j;
}

// One block per received row slot (grid N * slots).
__global__ void __launch_bounds__(kCopyThreads)
    ep_compact_kernel(const __nv_bfloat16* __restrict__ recv_x, const int32_t* __restrict__ recv_meta,
                      const int32_t* __restrict__ counts, int me, int num_ranks, int slots, int hidden,
                      __nv_bfloat16* __restrict__ x_local, int32_t* __restrict__ local_ids,
                      int32_t* __restrict__ num_local) {
  const int s = blockIdx.x / slots, i = blockIdx.x % slots;
  if (blockIdx.x == 0 && threadIdx.x == 0) *num_local = prefix_before(counts, me, num_ranks, num_ranks);
  if (i >= counts[s * num_ranks + me]) return;
  const int j = prefix_before(counts, me, num_ranks, s) + i;
  const int64_t src = static_cast<int64_t>(s) * slots + i;
  if (threadIdx.x == 0) local_ids[j] = recv_meta[src];
  copy_row(reinterpret_cast<const int4*>(recv_x + src * hidden), reinterpret_cast<int4*>(x_local + int64_t{j} * hidden),
           hidden / 8);
}

__global__ void __launch_bounds__(kCopyThreads)
    ep_return_pack_kernel(const float* __restrict__ y_local, const int32_t* __restrict__ counts, int me, int num_ranks,
                          int slots, int hidden, float* __restrict__ ret_send) {
  const int s = blockIdx.x / slots, i = blockIdx.x % slots;
  if (i >= counts[s * num_ranks + me]) return;
  const int j = prefix_before(counts, me, num_ranks, s) + i;
  copy_row(reinterpret_cast<const int4*>(y_local + int64_t{j} * hidden),
           reinterpret_cast<int4*>(ret_send + (static_cast<int64_t>(s) * slots + i) * hidden), hidden / 4);
}

__global__ void __launch_bounds__(kCopyThreads)
    ep_unpack_return_kernel(const float* __restrict__ ret_recv, const int32_t* __restrict__ ids,
                            const int32_t* __restrict__ send_pos, const int32_t* __restrict__ num_tokens, int capacity,
                            int top_k, int per, int slots, int hidden, float* __restrict__ y_pairs) {
  const int p = blockIdx.x;
  const int T = min(max(*num_tokens, 0), capacity);
  if (p >= T * top_k) return;
  const int d = ids[p] / per;
  copy_row(reinterpret_cast<const int4*>(ret_recv + (static_cast<int64_t>(d) * slots + send_pos[p]) * hidden),
           reinterpret_cast<int4*>(y_pairs + static_cast<int64_t>(p) * hidden), hidden / 4);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void launch_ep_plan(const int32_t* topk_ids, const int32_t* num_tokens, int capacity, int top_k, int num_experts,
                    int num_ranks, int32_t* send_pos, int32_t* send_counts, int32_t* send_meta, cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(num_ranks >= 1 && num_ranks <= kEpMaxRanks, "1 <= N <= kEpMaxRanks");
  MOEBIUS_LAUNCH_ASSERT(num_experts % num_ranks == 0, "E % N == 0");
  ep_plan_kernel<<<1, kPlanThreads, 0, stream>>>(topk_ids, num_tokens, capacity, top_k, num_experts, num_ranks,
                                                 capacity * top_k, send_pos, send_counts, send_meta);
  CUDA_CHECK_LAUNCH();
}

void launch_ep_pack_rows(const __nv_bfloat16* x, const int32_t* topk_ids, const int32_t* send_pos,
                         const int32_t* num_tokens, int capacity, int hidden, int top_k, int num_experts,
                         int num_ranks, __nv_bfloat16* send_x, cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(hidden % 8 == 0 && aligned16(x) && aligned16(send_x), "bf16 rows in 16-byte vectors");
  MOEBIUS_LAUNCH_ASSERT(num_experts % num_ranks == 0, "E % N == 0");
  if (capacity * top_k == 0) return;
  ep_pack_rows_kernel<<<capacity * top_k, kCopyThreads, 0, stream>>>(
      x, topk_ids, send_pos, num_tokens, capacity, hidden, top_k, num_experts / num_ranks, capacity * top_k, send_x);
  CUDA_CHECK_LAUNCH();
}

void launch_ep_compact(const __nv_bfloat16* recv_x, const int32_t* recv_meta, const int32_t* counts, int me,
                       int num_ranks, int slots, int hidden, __nv_bfloat16* x_local, int32_t* local_ids,
                       int32_t* num_local, cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(hidden % 8 == 0 && aligned16(recv_x) && aligned16(x_local), "bf16 rows in 16-byte vectors");
  MOEBIUS_LAUNCH_ASSERT(me >= 0 && me < num_ranks && slots >= 1, "rank and slots");
  ep_compact_kernel<<<num_ranks * slots, kCopyThreads, 0, stream>>>(recv_x, recv_meta, counts, me, num_ranks, slots,
                                                                    hidden, x_local, local_ids, num_local);
  CUDA_CHECK_LAUNCH();
}

void launch_ep_return_pack(const float* y_local, const int32_t* counts, int me, int num_ranks, int slots, int hidden,
                           float* ret_send, cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(hidden % 4 == 0 && aligned16(y_local) && aligned16(ret_send), "fp32 rows in 16-byte vectors");
  MOEBIUS_LAUNCH_ASSERT(me >= 0 && me < num_ranks && slots >= 1, "rank and slots");
  ep_return_pack_kernel<<<num_ranks * slots, kCopyThreads, 0, stream>>>(y_local, counts, me, num_ranks, slots, hidden,
                                                                        ret_send);
  CUDA_CHECK_LAUNCH();
}

void launch_ep_unpack_return(const float* ret_recv, const int32_t* topk_ids, const int32_t* send_pos,
                             const int32_t* num_tokens, int capacity, int top_k, int num_experts, int num_ranks,
                             int hidden, float* y_pairs, cudaStream_t stream) {
  MOEBIUS_LAUNCH_ASSERT(hidden % 4 == 0 && aligned16(ret_recv) && aligned16(y_pairs), "fp32 rows in 16-byte vectors");
  MOEBIUS_LAUNCH_ASSERT(num_experts % num_ranks == 0, "E % N == 0");
  if (capacity * top_k == 0) return;
  ep_unpack_return_kernel<<<capacity * top_k, kCopyThreads, 0, stream>>>(ret_recv, topk_ids, send_pos, num_tokens,
                                                                         capacity, top_k, num_experts / num_ranks,
                                                                         capacity * top_k, hidden, y_pairs);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moebius::kernels
