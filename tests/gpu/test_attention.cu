// The attention kernels (src/kernels/attention.cu) against the CPU reference,
// cpu::attention_reference, on random bf16 inputs with fixed seeds. Caches are paged with the
// blocks of every sequence scattered over a shuffled pool (plus blocks no sequence owns), block
// tables are -1 past each sequence's blocks (a kernel that read them would fault), outputs are
// poisoned (0xFF = bf16 NaN) before each run, rows no live sequence owns must stay poisoned, and
// guard bands must stay intact.
//
// Tolerance: bf16 out against an fp64 reference. The output's own rounding is <= 2^-9 relative
// (rms ~1.6e-3), and P is rounded to bf16 before the PV mma (FlashAttention does the same); the
// expected normalised MSE is a few 1e-6. Every SEQUENCE must have nmse <= 5e-5, i.e. a normalised
// rms error <= 7e-3 (a mask off by one key, a dropped tile or a wrong head fails this by orders of
// magnitude on the short sequences present in each batch).
//
// Geometries:
//   Qwen3-30B-A3B attention: nh 32, nkv 4, hd 128 (G = 8)
//   Qwen3-235B-A22B attention: nh 64, nkv 4, hd 128 (G = 16, the decode kernel's limit)
//   the tiny fixture (tests/data/tiny-qwen3-moe): nh 4, nkv 2, hd 16
//   hd 64 with G = 8 and with G = 1 (plain multi-head)
//
// Decode is one kernel (split blocks, the last one per (sequence, kv head) merges, found with a
// counter it resets): the tests below cover one split and many (contexts 1 .. 10240), batches of 1
// to 64 sequences of different lengths in one launch, reruns and graph replays that must be
// bit-identical (arrival order differs; a counter left non-zero would leave outputs poisoned), and
// a PDL chain where the kernel before attention writes q and the newest K/V rows late, as the rope
// kernel does ([TAG_ATTN_DECODE_PREWAIT]: attention reads older rows before its wait).
#include "gpu/gpu_test_util.h"  // first: it makes fmt compile under nvcc

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "cpu/attention.h"
#include "kernels/attention.cuh"
#include "kernels/pdl.cuh"

namespace moebius {
namespace {

using kernels::AttentionDecodePlan;
using kernels::AttentionDims;
using testing::bytes_are;
using testing::CudaStream;
using testing::DeviceBuffer;

constexpr double kMaxNmse = 5e-5;
constexpr uint8_t kPoison = 0xFF;

struct Geometry {
  const char* name;
  int nh, nkv, hd;
};
const Geometry kQwen3_30B{"Qwen3-30B-A3B", 32, 4, 128};  // Qwen3-30B-A3B
const Geometry kQwen3_235B{"Qwen3-235B-A22B", 64, 4, 128};  // Qwen3-235B-A22B
const Geometry kTiny{"tiny-qwen3-moe", 4, 2, 16};          // tests/data/tiny-qwen3-moe/config.json
const Geometry kHd64G8{"hd64-G8", 16, 2, 64};
const Geometry kHd64Mha{"hd64-MHA", 8, 8, 64};

int num_sms() {
  int dev = 0, n = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

float bf16_round(float x) { return static_cast<float>(bf16(x)); }

// A batch on the host: sequence s has q_lens[s] new tokens and a context of ctxs[s] (new ones
// included). Sized for capacities (max_seqs, max_blocks, num_blocks, t_cap) so that graph replays
// can reuse the device buffers.
struct Batch {
  Geometry geo{};
  int block_size = 16;
  std::vector<int> q_lens, ctxs;
  int max_seqs = 0, max_blocks = 0, num_blocks = 0, t_cap = 0;
  std::vector<float> q;                   // [t_cap, nh, hd], bf16 values
  std::vector<float> k_pool, v_pool;      // [num_blocks, nkv, bs, hd], bf16 values
  std::vector<int32_t> table;             // [max_seqs, max_blocks]
  std::vector<int32_t> cu, lens;          // [max_seqs + 1], [max_seqs]
  std::vector<float> want;                // [T, nh, hd]

  int total_q() const { return std::accumulate(q_lens.begin(), q_lens.end(), 0); }
  int64_t row() const { return int64_t{geo.nh} * geo.hd; }
};

// Capacities default to this batch's needs plus slack: 3 spare blocks, 2 spare sequences, 5 spare
// query rows, 2 spare block-table columns.
Batch make_batch(const Geometry& geo, int bs, std::vector<int> q_lens, std::vector<int> ctxs, uint32_t seed,
                 float q_scale = 2.0f, int max_seqs = -1, int max_blocks = -1, int num_blocks = -1, int t_cap = -1) {
  Batch b;
  b.geo = geo;
  b.block_size = bs;
  b.q_lens = std::move(q_lens);
  b.ctxs = std::move(ctxs);
  const int n = static_cast<int>(b.ctxs.size());
  int need_blocks = 0, widest = 1;
  for (int c : b.ctxs) {
    need_blocks += (c + bs - 1) / bs;
    widest = std::max(widest, (c + bs - 1) / bs);
  }
  b.max_seqs = max_seqs > 0 ? max_seqs : n + 2;
  b.max_blocks = max_blocks > 0 ? max_blocks : widest + 2;
  b.num_blocks = num_blocks > 0 ? num_blocks : need_blocks + 3;
  b.t_cap = t_cap > 0 ? t_cap : b.total_q() + 5;
  EXPECT_LE(need_blocks, b.num_blocks);
  EXPECT_LE(b.total_q(), b.t_cap);
  EXPECT_LE(n, b.max_seqs);

  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  b.q.resize(static_cast<size_t>(b.t_cap) * b.row());
  for (float& x : b.q) x = bf16_round(q_scale * u(rng));
  const size_t pool = static_cast<size_t>(b.num_blocks) * geo.nkv * bs * geo.hd;
  b.k_pool.resize(pool);
  b.v_pool.resize(pool);
  for (float& x : b.k_pool) x = bf16_round(u(rng));
  for (float& x : b.v_pool) x = bf16_round(u(rng));
  std::vector<int32_t> phys(static_cast<size_t>(b.num_blocks));
  std::iota(phys.begin(), phys.end(), 0);
  std::shuffle(phys.begin(), phys.end(), rng);
  b.table.assign(static_cast<size_t>(b.max_seqs) * b.max_blocks, -1);
  b.cu.assign(static_cast<size_t>(b.max_seqs) + 1, 0);
  b.lens.assign(static_cast<size_t>(b.max_seqs), 0);
  int next = 0;
  for (int s = 0; s < n; ++s) {
    for (int i = 0; i < (b.ctxs[s] + bs - 1) / bs; ++i) b.table[static_cast<size_t>(s) * b.max_blocks + i] = phys[next++];
    b.cu[s + 1] = b.cu[s] + b.q_lens[s];
    b.lens[s] = b.ctxs[s];
  }
  for (int s = n; s < b.max_seqs; ++s) b.cu[s + 1] = b.cu[s];

  // Reference, sequence by sequence, over a contiguous copy of its cache rows.
  const int kvd = geo.nkv * geo.hd;
  b.want.assign(static_cast<size_t>(b.total_q()) * b.row(), 0.0f);
  for (int s = 0; s < n; ++s) {
    const int ctx = b.ctxs[s];
    std::vector<float> kc(static_cast<size_t>(ctx) * kvd), vc(kc.size());
    std::vector<const float*> kr(static_cast<size_t>(ctx)), vr(kr.size());
    for (int j = 0; j < ctx; ++j) {
      const int64_t blk = b.table[static_cast<size_t>(s) * b.max_blocks + j / bs];
      for (int h = 0; h < geo.nkv; ++h) {
        const int64_t off = ((blk * geo.nkv + h) * bs + j % bs) * geo.hd;  // [TAG_KV_CACHE_LAYOUT]
        std::copy_n(b.k_pool.begin() + off, geo.hd, kc.begin() + static_cast<int64_t>(j) * kvd + h * geo.hd);
        std::copy_n(b.v_pool.begin() + off, geo.hd, vc.begin() + static_cast<int64_t>(j) * kvd + h * geo.hd);
      }
      kr[static_cast<size_t>(j)] = kc.data() + static_cast<int64_t>(j) * kvd;
      vr[static_cast<size_t>(j)] = vc.data() + static_cast<int64_t>(j) * kvd;
    }
    cpu::attention_reference(b.q.data() + b.cu[s] * b.row(), b.q_lens[s], geo.nh, geo.nkv, geo.hd,
                             ctx - b.q_lens[s], kr.data(), vr.data(), b.want.data() + b.cu[s] * b.row());
  }
  return b;
}

std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16(v[i]);
  return out;
}

// Device copies of a batch's inputs at its capacities, plus the output.
struct DeviceBatch {
  explicit DeviceBatch(const Batch& b)
      : q(b.q.size()), k(b.k_pool.size()), v(b.v_pool.size()), table(b.table.size()), cu(b.cu.size()),
        lens(b.lens.size()), num_seqs(1), out(static_cast<size_t>(b.t_cap) * b.row()) {
    upload(b);
  }
  void upload(const Batch& b) {
    q.upload(to_bf16(b.q));
    k.upload(to_bf16(b.k_pool));
    v.upload(to_bf16(b.v_pool));
    table.upload(b.table);
    cu.upload(b.cu);
    lens.upload(b.lens);
    num_seqs.upload(std::vector<int32_t>{static_cast<int32_t>(b.ctxs.size())});
  }
  AttentionDims dims(const Batch& b) const {
    return AttentionDims{b.geo.nh, b.geo.nkv, b.geo.hd, b.block_size, b.max_blocks};
  }
  DeviceBuffer<__nv_bfloat16> q, k, v;
  DeviceBuffer<int32_t> table, cu, lens, num_seqs;
  DeviceBuffer<__nv_bfloat16> out;
};

// out rows [0, total_q) against the reference, per sequence; rows past stay poisoned; guards.
void expect_matches(const Batch& b, const DeviceBatch& d, const char* what) {
  const std::vector<__nv_bfloat16> raw = d.out.download();
  std::vector<float> got(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) got[i] = __bfloat162float(raw[i]);
  double worst = 0;
  for (size_t s = 0; s < b.ctxs.size(); ++s) {
    const size_t off = static_cast<size_t>(b.cu[s]) * b.row(), n = static_cast<size_t>(b.q_lens[s]) * b.row();
    const double e = testing::nmse(got.data() + off, b.want.data() + off, n);
    EXPECT_LE(e, kMaxNmse) << what << ": sequence " << s << " (q_len " << b.q_lens[s] << ", context " << b.ctxs[s]
                           << ")";
    if (!(e <= worst)) worst = e;
  }
  const size_t live = static_cast<size_t>(b.total_q()) * b.row();
  EXPECT_TRUE(bytes_are(raw.data() + live, raw.size() - live, kPoison)) << what << ": rows past the batch were written";
  EXPECT_TRUE(d.out.guards_intact()) << what;
  EXPECT_TRUE(d.k.guards_intact() && d.v.guards_intact()) << what;
  std::printf("[ attention ] %-16s %-7s seqs %zu rows %d worst nmse %.3g\n", b.geo.name, what, b.ctxs.size(),
              b.total_q(), worst);
}

void run_prefill(const Batch& b, int max_q_len = -1) {
  if (max_q_len < 0) max_q_len = *std::max_element(b.q_lens.begin(), b.q_lens.end());
  CudaStream stream;
  DeviceBatch d(b);
  d.out.poison(kPoison, stream);
  kernels::launch_attention_prefill(d.q.data(), b.row(), d.cu.data(), d.lens.data(), d.num_seqs.data(), d.k.data(),
                                    d.v.data(), d.table.data(), d.dims(b), b.max_seqs, max_q_len, d.out.data(), stream);
  stream.sync();
  expect_matches(b, d, "prefill");
}

// Decode: every q_len is 1. plan_splits = 0: the planner's choice; else a forced max_splits (1:
// never a merge).
void run_decode(const Batch& b, int plan_splits = 0) {
  const int max_ctx = *std::max_element(b.ctxs.begin(), b.ctxs.end());
  CudaStream stream;
  DeviceBatch d(b);
  AttentionDecodePlan plan = kernels::plan_attention_decode(d.dims(b), b.max_seqs, max_ctx, num_sms());
  if (plan_splits > 0) plan = AttentionDecodePlan{b.max_seqs, max_ctx, plan_splits};
  const size_t ws_bytes = kernels::attention_decode_workspace_bytes(d.dims(b), plan);
  DeviceBuffer<uint8_t> ws(std::max<size_t>(ws_bytes, 16));
  ws.poison(0xFF, stream);  // NaN partials: a merge that read an unwritten split would show it
  kernels::init_attention_decode_workspace(ws.data(), d.dims(b), plan, stream);  // the counters only
  d.out.poison(kPoison, stream);
  kernels::launch_attention_decode(d.q.data(), b.row(), d.lens.data(), d.num_seqs.data(), d.k.data(), d.v.data(),
                                   d.table.data(), d.dims(b), plan, ws_bytes ? ws.data() : nullptr, d.out.data(),
                                   stream);
  stream.sync();
  SCOPED_TRACE(::testing::Message() << "decode plan: max_splits " << plan.max_splits);
  expect_matches(b, d, plan.max_splits > 1 ? "decode" : "decode1");
  EXPECT_TRUE(ws.guards_intact());
}

std::vector<int> ones(size_t n) { return std::vector<int>(n, 1); }

bool same_bytes(const std::vector<__nv_bfloat16>& a, const std::vector<__nv_bfloat16>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(__nv_bfloat16)) == 0;
}

// ------------------------------------------------------------------------------------------------
// Prefill
// ------------------------------------------------------------------------------------------------

TEST(AttentionGpuPrefill, FullPrefillOddLengths) {
  MOEBIUS_REQUIRE_GPU();
  const std::vector<int> lens = {1, 7, 63, 65, 1000};
  for (const Geometry& g : {kQwen3_30B, kTiny, kHd64G8, kHd64Mha}) {
    SCOPED_TRACE(g.name);
    run_prefill(make_batch(g, 16, lens, lens, 11));
    for (int n : lens) run_prefill(make_batch(g, 16, {n}, {n}, 13 + n));  // each alone
  }
}

TEST(AttentionGpuPrefill, ChunkedPrefillAndMixedBatch) {
  MOEBIUS_REQUIRE_GPU();
  // (q_len, context): chunks appended to existing caches, decode rows (q_len 1) and a fresh prefill
  // in one batch; contexts that end mid-block and on a block edge.
  const std::vector<int> q = {7, 65, 1, 1, 63, 128, 33};
  const std::vector<int> c = {100, 1065, 500, 1, 79, 2048, 33};
  for (const Geometry& g : {kQwen3_30B, kQwen3_235B, kTiny, kHd64G8}) {
    SCOPED_TRACE(g.name);
    run_prefill(make_batch(g, 16, q, c, 21));
  }
}

TEST(AttentionGpuPrefill, BlockSizesAndPeakySoftmax) {
  MOEBIUS_REQUIRE_GPU();
  const std::vector<int> q = {1, 40, 300}, c = {17, 40, 777};
  for (int bs : {1, 7, 32, 64}) {
    SCOPED_TRACE(::testing::Message() << "block_size " << bs);
    run_prefill(make_batch(kQwen3_30B, bs, q, c, 31u + bs));
    run_prefill(make_batch(kTiny, bs, q, c, 37u + bs));
  }
  // Large scores (q scaled by 16: logits of several tens): the running max moves a lot.
  run_prefill(make_batch(kQwen3_30B, 16, q, c, 41, /*q_scale=*/16.0f));
  run_prefill(make_batch(kHd64G8, 16, q, c, 43, /*q_scale=*/16.0f));
}

TEST(AttentionGpuPrefill, GridLargerThanBatch) {
  MOEBIUS_REQUIRE_GPU();
  // max_q_len far above the live q_lens and max_num_seqs above the live count: the extra blocks
  // must exit without writing.
  run_prefill(make_batch(kQwen3_30B, 16, {3, 5}, {10, 5}, 51, 2.0f, /*max_seqs=*/9), /*max_q_len=*/700);
}

// ------------------------------------------------------------------------------------------------
// Decode
// ------------------------------------------------------------------------------------------------

TEST(AttentionGpuDecode, ContextsOneToTenThousand) {
  MOEBIUS_REQUIRE_GPU();
  const std::vector<int> ctx = {1, 2, 15, 16, 17, 31, 33, 64, 100, 257, 1000, 4097, 10000};
  for (const Geometry& g : {kQwen3_30B, kQwen3_235B, kTiny, kHd64G8, kHd64Mha}) {
    SCOPED_TRACE(g.name);
    const Batch b = make_batch(g, 16, ones(ctx.size()), ctx, 61);
    run_decode(b);
    run_decode(b, /*plan_splits=*/1);
  }
}

TEST(AttentionGpuDecode, OneLongSequenceSplits) {
  MOEBIUS_REQUIRE_GPU();
  // One sequence: the planner splits 10000 keys over many blocks; also odd block sizes.
  for (int c : {1, 129, 5000, 10000}) {
    run_decode(make_batch(kQwen3_30B, 16, {1}, {c}, 71u + c));
    run_decode(make_batch(kTiny, 16, {1}, {c}, 73u + c));
  }
  run_decode(make_batch(kQwen3_30B, 7, {1, 1}, {3000, 45}, 79));
  run_decode(make_batch(kQwen3_30B, 16, {1, 1}, {3000, 45}, 83, /*q_scale=*/16.0f));
}

TEST(AttentionGpuDecode, ShortSequencesSkipTheMerge) {
  MOEBIUS_REQUIRE_GPU();
  // A forced 64-split plan with sequences on both sides of the one-split limit (256 keys,
  // [TAG_ATTN_DECODE_SPLIT]): contexts <= 256 are written directly and never touch the (poisoned)
  // workspace; longer ones go through it and the last block's merge.
  const std::vector<int> ctx = {1, 15, 63, 64, 65, 128, 129, 255, 256, 257, 1000, 4096};
  for (const Geometry& g : {kQwen3_30B, kTiny, kHd64G8}) {
    SCOPED_TRACE(g.name);
    run_decode(make_batch(g, 16, ones(ctx.size()), ctx, 87), /*plan_splits=*/64);
  }
}

TEST(AttentionGpuDecode, MatchesPrefillKernelOnDecodeRows) {
  MOEBIUS_REQUIRE_GPU();
  // The same batch of q_len-1 rows through both kernels (a mixed batch may go to prefill whole).
  const std::vector<int> ctx = {5, 300, 2049};
  const Batch b = make_batch(kQwen3_30B, 16, ones(ctx.size()), ctx, 89);
  run_prefill(b);
  run_decode(b);
}

TEST(AttentionGpuDecode, ContextsAndGqaRatios) {
  MOEBIUS_REQUIRE_GPU();
  // One split (<= 256 keys) and many (the planner gives one sequence 33 splits on 132 SMs);
  // GQA 8 and 16. Each context alone (the planner's single-sequence plan) and all in one batch.
  const std::vector<int> ctx = {1, 2, 17, 255, 256, 1000, 4097, 10240};
  for (const Geometry& g : {kQwen3_30B, kQwen3_235B}) {
    SCOPED_TRACE(g.name);
    for (int c : ctx) run_decode(make_batch(g, 16, {1}, {c}, 201u + c));
    const Batch b = make_batch(g, 16, ones(ctx.size()), ctx, 203);
    run_decode(b);
    run_decode(b, /*plan_splits=*/256);  // the most splits a plan may have
  }
}

// n sequences of lengths spread over [1, 10240], the listed contexts first.
std::vector<int> mixed_contexts(int n, uint32_t seed) {
  const int listed[] = {1, 2, 17, 255, 256, 1000, 4097, 10240};
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> len(1, 10240);
  std::vector<int> c;
  for (int i = 0; i < n; ++i) c.push_back(i < 8 ? listed[i] : len(rng));
  std::shuffle(c.begin(), c.end(), rng);
  return c;
}

TEST(AttentionGpuDecode, BatchesOfOneToSixtyFour) {
  MOEBIUS_REQUIRE_GPU();
  // Many (sequence, kv head) counters in one launch: the planner's plan (one split from 33
  // sequences at nkv 4) and a forced 8-split plan, where every long sequence merges.
  for (int n : {1, 2, 3, 8, 17, 33, 64}) {
    SCOPED_TRACE(::testing::Message() << n << " sequences");
    const Batch b = make_batch(kQwen3_30B, 16, ones(static_cast<size_t>(n)), mixed_contexts(n, 300u + n), 301u + n);
    run_decode(b);
    run_decode(b, /*plan_splits=*/8);
  }
  const Batch b = make_batch(kQwen3_235B, 16, ones(24), mixed_contexts(24, 333), 335);
  run_decode(b);
  run_decode(b, /*plan_splits=*/8);
}

// Copies q and, per live sequence and kv head, the newest K and V rows (element offsets `rows`, hd
// each) from the true buffers into the ones attention reads, after sleeping ~`sleep_ns`. It
// triggers its dependents first, so attention's blocks are resident and past their pre-wait loads
// long before these writes land: an attention kernel that read q or a newest row before its wait
// would see the poison.
__global__ void late_writer_kernel(const int64_t* rows, int n_rows, int hd, const __nv_bfloat16* k_src,
                                   const __nv_bfloat16* v_src, __nv_bfloat16* k_dst, __nv_bfloat16* v_dst,
                                   const __nv_bfloat16* q_src, __nv_bfloat16* q_dst, int64_t q_elems,
                                   unsigned sleep_ns) {
  kernels::pdl_launch_dependents();
  uint64_t t0 = 0, t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < sleep_ns);
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = tid; i < static_cast<int64_t>(n_rows) * hd; i += stride) {
    const int64_t off = rows[i / hd] + i % hd;
    k_dst[off] = k_src[off];
    v_dst[off] = v_src[off];
  }
  for (int64_t i = tid; i < q_elems; i += stride) q_dst[i] = q_src[i];
}

TEST(AttentionGpuDecode, PdlChainWithLateNewestRows) {
  MOEBIUS_REQUIRE_GPU();
  const std::vector<int> ctx = {1, 2, 17, 192, 193, 255, 256, 1000, 4097, 10240};
  for (const Geometry& g : {kQwen3_30B, kQwen3_235B, kTiny}) {
    SCOPED_TRACE(g.name);
    const Batch b = make_batch(g, 16, ones(ctx.size()), ctx, 401);
    CudaStream stream;
    DeviceBatch d(b);
    // True q / K / V stay in `truth`; d gets NaN in q and in every newest row. [TAG_KV_CACHE_LAYOUT]
    DeviceBatch truth(b);
    std::vector<int64_t> rows;
    Batch poisoned = b;
    for (size_t s = 0; s < ctx.size(); ++s) {
      const int p = ctx[s] - 1;
      const int64_t blk = b.table[s * b.max_blocks + p / b.block_size];
      for (int h = 0; h < g.nkv; ++h) {
        const int64_t off = ((blk * g.nkv + h) * b.block_size + p % b.block_size) * g.hd;
        rows.push_back(off);
        std::fill_n(poisoned.k_pool.begin() + off, g.hd, NAN);
        std::fill_n(poisoned.v_pool.begin() + off, g.hd, NAN);
      }
    }
    std::fill(poisoned.q.begin(), poisoned.q.end(), NAN);
    DeviceBuffer<int64_t> d_rows(rows.size());
    d_rows.upload(rows);
    const AttentionDims dims = d.dims(b);
    const AttentionDecodePlan plan = kernels::plan_attention_decode(dims, b.max_seqs, 10240, num_sms());
    const size_t ws_bytes = kernels::attention_decode_workspace_bytes(dims, plan);
    DeviceBuffer<uint8_t> ws(std::max<size_t>(ws_bytes, 16));
    kernels::init_attention_decode_workspace(ws.data(), dims, plan, stream);
    auto enqueue = [&] {
      kernels::launch_pdl(late_writer_kernel, dim3(8), dim3(256), 0, stream, d_rows.data(),
                          static_cast<int>(rows.size()), g.hd, truth.k.data(), truth.v.data(), d.k.data(), d.v.data(),
                          truth.q.data(), d.q.data(), static_cast<int64_t>(b.q.size()), 20000u);
      kernels::launch_attention_decode(d.q.data(), b.row(), d.lens.data(), d.num_seqs.data(), d.k.data(), d.v.data(),
                                       d.table.data(), dims, plan, ws.data(), d.out.data(), stream);
    };
    d.upload(poisoned);
    d.out.poison(kPoison, stream);
    enqueue();
    stream.sync();
    expect_matches(b, d, "pdl");
    const std::vector<__nv_bfloat16> eager = d.out.download();

    // The same chain captured once and replayed: every replay bit-identical to the eager run.
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    enqueue();
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int r = 0; r < 3; ++r) {
      SCOPED_TRACE(::testing::Message() << "replay " << r);
      d.upload(poisoned);
      d.out.poison(kPoison, stream);
      CUDA_CHECK(cudaGraphLaunch(exec, stream));
      stream.sync();
      EXPECT_TRUE(same_bytes(d.out.download(), eager)) << "graph replay differs from the eager run";
    }
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
  }
}

TEST(AttentionGpuDecode, RerunsAreBitIdentical) {
  MOEBIUS_REQUIRE_GPU();
  // Five launches on one workspace initialised once: the counters must come back to zero after
  // each, and the merge order must not depend on which split finished last.
  const int n = 40;
  const Batch b = make_batch(kQwen3_30B, 16, ones(n), mixed_contexts(n, 501), 503);
  CudaStream stream;
  DeviceBatch d(b);
  const AttentionDims dims = d.dims(b);
  for (int max_splits : {0, 8, 256}) {
    SCOPED_TRACE(::testing::Message() << "max_splits " << max_splits);
    AttentionDecodePlan plan = kernels::plan_attention_decode(dims, b.max_seqs, 10240, num_sms());
    if (max_splits > 0) plan.max_splits = max_splits;
    const size_t ws_bytes = kernels::attention_decode_workspace_bytes(dims, plan);
    DeviceBuffer<uint8_t> ws(std::max<size_t>(ws_bytes, 16));
    ws.poison(0xFF, stream);
    kernels::init_attention_decode_workspace(ws.data(), dims, plan, stream);
    std::vector<__nv_bfloat16> first;
    for (int r = 0; r < 5; ++r) {
      d.out.poison(kPoison, stream);
      kernels::launch_attention_decode(d.q.data(), b.row(), d.lens.data(), d.num_seqs.data(), d.k.data(), d.v.data(),
                                       d.table.data(), dims, plan, ws.data(), d.out.data(), stream);
      stream.sync();
      if (r == 0) {
        expect_matches(b, d, "rerun");
        first = d.out.download();
      } else {
        EXPECT_TRUE(same_bytes(d.out.download(), first)) << "rerun " << r << " differs";
      }
    }
    EXPECT_TRUE(ws.guards_intact());
  }
}

// ------------------------------------------------------------------------------------------------
// CUDA graphs: capture once at the bucket's maxima, replay with other live batches
// ------------------------------------------------------------------------------------------------

TEST(AttentionGpuGraph, DecodeAndPrefillReplayAtTwoSizes) {
  MOEBIUS_REQUIRE_GPU();
  // [TAG_ATTN_GRAPH_BUCKET] Bucket: 8 sequences, contexts up to 4096, 16-token blocks; prefill
  // rows up to 256 per sequence.
  constexpr int kSeqs = 8, kMaxCtx = 4096, kBs = 16, kMaxBlocks = kMaxCtx / kBs, kBlocks = kSeqs * kMaxBlocks + 4;
  constexpr int kMaxQ = 256, kTCap = kSeqs * kMaxQ;
  const Geometry g = kQwen3_30B;
  struct Replay {
    std::vector<int> q, c;
  };
  const Replay decode_replays[2] = {{ones(3), {5, 1000, 4096}}, {ones(8), {1, 17, 64, 333, 2048, 4095, 4096, 77}}};
  const Replay prefill_replays[2] = {{{256, 1}, {256, 4000}}, {{3, 100, 17, 1, 256, 64, 9, 30}, {3, 4096, 17, 1, 600, 64, 9, 3000}}};
  for (bool decode : {true, false}) {
    SCOPED_TRACE(decode ? "decode graph" : "prefill graph");
    const Replay* replays = decode ? decode_replays : prefill_replays;
    Batch first = make_batch(g, kBs, replays[0].q, replays[0].c, 101, 2.0f, kSeqs, kMaxBlocks, kBlocks, kTCap);
    DeviceBatch d(first);
    CudaStream stream;
    const AttentionDims dims = d.dims(first);
    const AttentionDecodePlan plan = kernels::plan_attention_decode(dims, kSeqs, kMaxCtx, num_sms());
    const size_t ws_bytes = kernels::attention_decode_workspace_bytes(dims, plan);
    DeviceBuffer<uint8_t> ws(std::max<size_t>(ws_bytes, 16));
    kernels::init_attention_decode_workspace(ws.data(), dims, plan, stream);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    if (decode)
      kernels::launch_attention_decode(d.q.data(), first.row(), d.lens.data(), d.num_seqs.data(), d.k.data(),
                                       d.v.data(), d.table.data(), dims, plan, ws.data(), d.out.data(), stream);
    else
      kernels::launch_attention_prefill(d.q.data(), first.row(), d.cu.data(), d.lens.data(), d.num_seqs.data(),
                                        d.k.data(), d.v.data(), d.table.data(), dims, kSeqs, kMaxQ, d.out.data(),
                                        stream);
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int r = 0; r < 2; ++r) {
      SCOPED_TRACE(::testing::Message() << "replay " << r);
      const Batch b = r == 0 ? std::move(first)
                             : make_batch(g, kBs, replays[r].q, replays[r].c, 103, 2.0f, kSeqs, kMaxBlocks, kBlocks,
                                          kTCap);
      d.upload(b);  // synchronous copies, outside the graph: the live batch is device data only
      d.out.poison(kPoison, stream);
      CUDA_CHECK(cudaGraphLaunch(exec, stream));
      stream.sync();
      expect_matches(b, d, decode ? "graph-d" : "graph-p");
    }
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
  }
}

}  // namespace
}  // namespace moebius
