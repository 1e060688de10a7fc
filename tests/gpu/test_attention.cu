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
// a PDL chain where the kernel before attention writes the new token's q/k/v late, as the qkv GEMV
// does ([TAG_ATTN_DECODE_PREWAIT]: attention reads older rows before its wait). Decode folds in
// QK-norm + RoPE + the K/V write: its batches carry the raw token, the reference sees the finished
// one (CPU RMSNorm and RoPE), and the newest cache rows start as NaN and must be written.
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
#include "cpu/norm.h"
#include "cpu/rope.h"
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
constexpr float kEps = 1e-6f;  // Qwen3's rms_norm_eps
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
  // Decode batches (every q_len 1) also carry the new token as the qkv projection leaves it; q and
  // the newest cache rows above then hold what QK-norm + RoPE make of it, rounded to bf16.
  bool decode = false;
  std::vector<float> q_raw;               // [max_seqs, nh, hd], bf16 values
  std::vector<float> k_raw, v_raw;        // [max_seqs, nkv, hd], bf16 values
  std::vector<float> q_norm, k_norm;      // [hd]
  std::vector<float> inv_freq;            // [hd / 2]
  std::vector<int64_t> new_rows;          // element offset in a pool of each (sequence, kv head)'s newest row

  int total_q() const { return std::accumulate(q_lens.begin(), q_lens.end(), 0); }
  int64_t row() const { return int64_t{geo.nh} * geo.hd; }
};

// The decode step's new token ([TAG_KV_CACHE_LAYOUT]): raw q/k/v rows and norm weights drawn here,
// then q and the newest K/V rows of the batch replaced by their finished values (CPU references:
// RMSNorm, RoPE neox at position ctx - 1, Qwen3's theta 1e6), rounded to bf16 as the kernel's Q
// tile and the cache hold them. q_scale scales the q norm weights (the norm removes q's own scale).
void finish_decode_token(Batch& b, std::mt19937& rng, float q_scale) {
  const Geometry& g = b.geo;
  const size_t qrow = static_cast<size_t>(g.nh) * g.hd, kvrow = static_cast<size_t>(g.nkv) * g.hd;
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  b.q_raw.assign(static_cast<size_t>(b.max_seqs) * qrow, 0.0f);
  b.k_raw.assign(static_cast<size_t>(b.max_seqs) * kvrow, 0.0f);
  b.v_raw.assign(b.k_raw.size(), 0.0f);
  b.q_norm.resize(static_cast<size_t>(g.hd));
  b.k_norm.resize(static_cast<size_t>(g.hd));
  for (float& w : b.q_norm) w = 0.5f * q_scale * (1.0f + 0.5f * u(rng));
  for (float& w : b.k_norm) w = 1.0f + 0.5f * u(rng);
  b.inv_freq = cpu::rope_inv_freq(1e6, g.hd);
  b.new_rows.clear();
  std::vector<float> x(qrow), y(kvrow);
  for (size_t s = 0; s < b.ctxs.size(); ++s) {
    const int64_t pos = b.ctxs[s] - 1;
    float* qr = b.q_raw.data() + s * qrow;
    std::copy_n(b.q.begin() + static_cast<int64_t>(b.cu[s]) * b.row(), qrow, qr);
    for (size_t i = 0; i < kvrow; ++i) {
      b.k_raw[s * kvrow + i] = bf16_round(u(rng));
      b.v_raw[s * kvrow + i] = bf16_round(u(rng));
    }
    cpu::rms_norm_reference(qr, b.q_norm.data(), g.nh, g.hd, kEps, x.data());
    cpu::rope_neox_reference(x.data(), 1, g.nh, g.hd, &pos, b.inv_freq.data());
    for (size_t i = 0; i < qrow; ++i) b.q[static_cast<size_t>(b.cu[s]) * qrow + i] = bf16_round(x[i]);
    cpu::rms_norm_reference(b.k_raw.data() + s * kvrow, b.k_norm.data(), g.nkv, g.hd, kEps, y.data());
    cpu::rope_neox_reference(y.data(), 1, g.nkv, g.hd, &pos, b.inv_freq.data());
    const int64_t blk = b.table[s * b.max_blocks + pos / b.block_size];
    for (int h = 0; h < g.nkv; ++h) {
      const int64_t off = ((blk * g.nkv + h) * b.block_size + pos % b.block_size) * g.hd;
      b.new_rows.push_back(off);
      for (int i = 0; i < g.hd; ++i) {
        b.k_pool[static_cast<size_t>(off + i)] = bf16_round(y[static_cast<size_t>(h * g.hd + i)]);
        b.v_pool[static_cast<size_t>(off + i)] = b.v_raw[s * kvrow + static_cast<size_t>(h * g.hd + i)];
      }
    }
  }
}

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

  b.decode = n > 0 && std::all_of(b.q_lens.begin(), b.q_lens.end(), [](int x) { return x == 1; });
  if (b.decode) finish_decode_token(b, rng, q_scale);

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

std::vector<float> with_nan_rows(std::vector<float> pool, const std::vector<int64_t>& rows, int hd) {
  for (int64_t off : rows) std::fill_n(pool.begin() + off, hd, NAN);
  return pool;
}

// Device copies of a batch's inputs at its capacities, plus the output. decode: q and the newest
// cache rows are uploaded as NaN (the decode kernel must read the raw token and write those rows).
struct DeviceBatch {
  explicit DeviceBatch(const Batch& b, bool decode = false)
      : q(b.q.size()), k(b.k_pool.size()), v(b.v_pool.size()), table(b.table.size()), cu(b.cu.size()),
        lens(b.lens.size()), num_seqs(1), out(static_cast<size_t>(b.t_cap) * b.row()),
        q_raw(std::max<size_t>(b.q_raw.size(), 1)), k_raw(std::max<size_t>(b.k_raw.size(), 1)),
        v_raw(std::max<size_t>(b.v_raw.size(), 1)), q_norm(std::max<size_t>(b.q_norm.size(), 1)),
        k_norm(std::max<size_t>(b.k_norm.size(), 1)), inv_freq(std::max<size_t>(b.inv_freq.size(), 1)) {
    upload(b, decode);
  }
  void upload(const Batch& b, bool decode = false) {
    EXPECT_TRUE(!decode || b.decode);
    if (b.decode) {
      q_raw.upload(to_bf16(b.q_raw));
      k_raw.upload(to_bf16(b.k_raw));
      v_raw.upload(to_bf16(b.v_raw));
      q_norm.upload(b.q_norm);
      k_norm.upload(b.k_norm);
      inv_freq.upload(b.inv_freq);
    }
    if (decode) {
      q.upload(to_bf16(std::vector<float>(b.q.size(), NAN)));
      k.upload(to_bf16(with_nan_rows(b.k_pool, b.new_rows, b.geo.hd)));
      v.upload(to_bf16(with_nan_rows(b.v_pool, b.new_rows, b.geo.hd)));
    } else {
      q.upload(to_bf16(b.q));
      k.upload(to_bf16(b.k_pool));
      v.upload(to_bf16(b.v_pool));
    }
    table.upload(b.table);
    cu.upload(b.cu);
    lens.upload(b.lens);
    num_seqs.upload(std::vector<int32_t>{static_cast<int32_t>(b.ctxs.size())});
  }
  AttentionDims dims(const Batch& b) const {
    return AttentionDims{b.geo.nh, b.geo.nkv, b.geo.hd, b.block_size, b.max_blocks};
  }
  // The decode kernel's view of the new token (raw q/k/v rows of max_seqs sequences).
  kernels::AttentionDecodeToken token(const Batch& b) {
    const int64_t kv = int64_t{b.geo.nkv} * b.geo.hd;
    return kernels::AttentionDecodeToken{q_raw.data(), b.row(),       k_raw.data(),    kv,  v_raw.data(),
                                         kv,           q_norm.data(), k_norm.data(), inv_freq.data(), kEps};
  }
  void launch_decode(const Batch& b, const AttentionDecodePlan& plan, void* ws, cudaStream_t stream) {
    kernels::launch_attention_decode(token(b), lens.data(), num_seqs.data(), k.data(), v.data(), table.data(), dims(b),
                                     plan, ws, out.data(), stream);
  }
  DeviceBuffer<__nv_bfloat16> q, k, v;
  DeviceBuffer<int32_t> table, cu, lens, num_seqs;
  DeviceBuffer<__nv_bfloat16> out;
  DeviceBuffer<__nv_bfloat16> q_raw, k_raw, v_raw;
  DeviceBuffer<float> q_norm, k_norm, inv_freq;
};

// After a decode launch: the newest K rows hold the finished k (bf16, within one ulp of the CPU
// reference's rounding: the kernel and the reference sum the norm in other orders), the newest V
// rows the raw v exactly, every other cache element is untouched.
void expect_cache(const Batch& b, const DeviceBatch& d, const char* what) {
  for (int pool = 0; pool < 2; ++pool) {
    const std::vector<__nv_bfloat16> raw = (pool == 0 ? d.k : d.v).download();
    const std::vector<float>& want = pool == 0 ? b.k_pool : b.v_pool;
    std::vector<float> got(raw.size());
    for (size_t i = 0; i < raw.size(); ++i) got[i] = __bfloat162float(raw[i]);
    for (int64_t off : b.new_rows) {
      if (pool == 0)
        EXPECT_TRUE(testing::all_close(got.data() + off, want.data() + off, static_cast<size_t>(b.geo.hd), 1.0 / 128,
                                       1e-6))
            << what << ": newest k row at " << off;
      else
        EXPECT_TRUE(testing::same_values(got.data() + off, want.data() + off, static_cast<size_t>(b.geo.hd)))
            << what << ": newest v row at " << off;
      std::copy_n(want.begin() + off, b.geo.hd, got.begin() + off);  // checked; the rest must be exact
    }
    EXPECT_TRUE(testing::same_values(got.data(), want.data(), got.size())) << what << ": cache rows not the new token's";
  }
}

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
// never a merge), merged through the workspace or, with `cluster`, in a thread-block cluster
// ([TAG_ATTN_CLUSTER_MERGE]).
void run_decode(const Batch& b, int plan_splits = 0, bool cluster = false) {
  const int max_ctx = *std::max_element(b.ctxs.begin(), b.ctxs.end());
  CudaStream stream;
  DeviceBatch d(b, /*decode=*/true);
  AttentionDecodePlan plan = kernels::plan_attention_decode(d.dims(b), b.max_seqs, max_ctx, num_sms());
  if (plan_splits > 0) plan = AttentionDecodePlan{b.max_seqs, max_ctx, plan_splits, cluster};
  SCOPED_TRACE(::testing::Message() << "cluster merge " << plan.cluster_merge);
  const size_t ws_bytes = kernels::attention_decode_workspace_bytes(d.dims(b), plan);
  DeviceBuffer<uint8_t> ws(std::max<size_t>(ws_bytes, 16));
  ws.poison(0xFF, stream);  // NaN partials: a merge that read an unwritten split would show it
  kernels::init_attention_decode_workspace(ws.data(), d.dims(b), plan, stream);  // the counters only
  d.out.poison(kPoison, stream);
  d.launch_decode(b, plan, ws_bytes ? ws.data() : nullptr, stream);
  stream.sync();
  SCOPED_TRACE(::testing::Message() << "decode plan: max_splits " << plan.max_splits);
  expect_matches(b, d, plan.max_splits > 1 ? "decode" : "decode1");
  expect_cache(b, d, "decode");
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
  // [TAG_ATTN_KV_ONE_BLOCK] 64, 128: one cache block per 64-key tile; 1, 16, 32: the power-of-two
  // loader; 7: the general one.
  for (int bs : {1, 7, 16, 32, 64, 128}) {
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

TEST(AttentionGpuDecode, BlockSizesAroundTheKeyTile) {
  MOEBIUS_REQUIRE_GPU();
  // [TAG_ATTN_KV_ONE_BLOCK] Block sizes that are multiples of the 16-key tile take the one-block
  // loader, with tiles at every offset inside a block (32, 48, 64); 4 and 8 the power-of-two one
  // (a tile over several blocks); 24 the general one. Natural plans and a forced 64-split plan
  // (64-key splits that start inside blocks).
  const std::vector<int> ctx = {1, 16, 17, 100, 255, 256, 257, 1000, 3001};
  for (int bs : {4, 8, 24, 32, 48, 64}) {
    SCOPED_TRACE(::testing::Message() << "block_size " << bs);
    for (const Geometry& g : {kQwen3_30B, kTiny}) {
      SCOPED_TRACE(g.name);
      const Batch b = make_batch(g, bs, ones(ctx.size()), ctx, 91u + bs);
      run_decode(b);
      run_decode(b, /*plan_splits=*/64);
      run_decode(b, /*plan_splits=*/16, /*cluster=*/true);
    }
  }
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

TEST(AttentionGpuDecode, ClusterMergeAtEverySplitCount) {
  MOEBIUS_REQUIRE_GPU();
  // [TAG_ATTN_CLUSTER_MERGE] Forced cluster plans of 2 to the cap (16), odd counts included, over
  // contexts from one key (no merge) to 10000 (640-key splits), in a batch whose sequences split
  // differently within one launch.
  const std::vector<int> ctx = {1, 63, 64, 65, 257, 1000, 4097, 10000};
  for (const Geometry& g : {kQwen3_30B, kTiny, kHd64G8}) {
    SCOPED_TRACE(g.name);
    const Batch b = make_batch(g, 16, ones(ctx.size()), ctx, 97);
    for (int c : {2, 3, 7, 8, 13, 16}) run_decode(b, c, /*cluster=*/true);
  }
  // Qwen3-235B-A22B (G = 16: a full m16 tile, at most 8 splits a cluster), and one query head per
  // kv head.
  const Batch b = make_batch(kQwen3_235B, 16, {1, 1}, {3000, 300}, 101);
  for (int c : {2, 5, 8}) run_decode(b, c, /*cluster=*/true);  // 8: the cap at G = 16
  run_decode(make_batch(kHd64Mha, 16, {1, 1}, {3000, 300}, 103), 16, /*cluster=*/true);
}

TEST(AttentionGpuDecode, PlannerPicksClustersThatFitOneWave) {
  MOEBIUS_REQUIRE_GPU();
  // [TAG_ATTN_CLUSTER_MERGE] One sequence of Qwen3-30B-A3B: 4 clusters of up to 16 splits fit any
  // H100/H200, and the cost model takes them at 1k context, not at 10k (32 shorter splits win).
  const AttentionDims d{32, 4, 128, 16, 4096};
  const AttentionDecodePlan at1k = kernels::plan_attention_decode(d, 1, 1024, num_sms());
  EXPECT_TRUE(at1k.cluster_merge);
  EXPECT_GE(at1k.max_splits, 2);
  EXPECT_LE(at1k.max_splits, kernels::attention_decode_cluster_cap(d));
  EXPECT_EQ(kernels::attention_decode_workspace_bytes(d, at1k), 0u);
  const AttentionDecodePlan at10k = kernels::plan_attention_decode(d, 1, 10240, num_sms());
  EXPECT_FALSE(at10k.cluster_merge);
  EXPECT_GT(at10k.max_splits, at1k.max_splits);
  // [TAG_ATTN_DECODE_STAGES] Short splits take the 2-stage ring, long ones the 4-stage ring: 1k in
  // 16 splits is one tile per warp, 10k in ~32 about five; 64 sequences at 10k are one split of
  // 10240 keys each, 160 tiles per warp.
  EXPECT_EQ(at1k.stages, 2);
  EXPECT_EQ(at10k.stages, 2);
  EXPECT_EQ(kernels::plan_attention_decode(d, 64, 10240, num_sms()).stages, 4);
  // The boundary the runner plans its short-context graphs at: cluster up to it, not past it.
  const int limit = kernels::attention_decode_cluster_context(d, 1, num_sms());
  EXPECT_GT(limit, 1024);
  EXPECT_LT(limit, 10240);
  EXPECT_TRUE(kernels::plan_attention_decode(d, 1, limit, num_sms()).cluster_merge);
  EXPECT_FALSE(kernels::plan_attention_decode(d, 1, limit + 16, num_sms()).cluster_merge);
  // [TAG_ATTN_PORTABLE_CLUSTER] 4 clusters of 16 fit the H100/H200, but at 1k the plan takes 8 (run
  // V1) up to the portable boundary, and 16 past it, up to the cluster boundary.
  const int portable = kernels::attention_decode_portable_cluster_context(d, 1, num_sms());
  EXPECT_EQ(at1k.max_splits, 8);
  EXPECT_GT(portable, 1024);
  EXPECT_LT(portable, limit);
  const AttentionDecodePlan at_portable = kernels::plan_attention_decode(d, 1, portable, num_sms());
  const AttentionDecodePlan past_portable = kernels::plan_attention_decode(d, 1, portable + 16, num_sms());
  EXPECT_TRUE(at_portable.cluster_merge);
  EXPECT_EQ(at_portable.max_splits, 8);
  EXPECT_TRUE(past_portable.cluster_merge);
  EXPECT_EQ(past_portable.max_splits, 16);
  // Qwen3-235B-A22B's clusters are capped at 8 (G = 16): no portable boundary of their own.
  EXPECT_EQ(kernels::attention_decode_portable_cluster_context(AttentionDims{64, 4, 128, 16, 4096}, 1, num_sms()), 0);
  for (int seqs : {2, 4, 8, 64}) {
    for (int ctx : {1024, 10240}) {
      const AttentionDecodePlan p = kernels::plan_attention_decode(d, seqs, ctx, num_sms());
      SCOPED_TRACE(::testing::Message() << seqs << " sequences, context " << ctx << ": " << p.max_splits << " splits");
      // One wave of blocks, unless one split per (sequence, kv head) is already more than that.
      EXPECT_LE(static_cast<int64_t>(p.max_splits) * seqs * d.num_kv_heads,
                std::max<int64_t>(num_sms(), int64_t{seqs} * d.num_kv_heads));
      if (p.cluster_merge) EXPECT_LE(p.max_splits, kernels::attention_decode_cluster_cap(d));
      EXPECT_EQ(kernels::attention_decode_workspace_bytes(d, p) == 0, p.max_splits == 1 || p.cluster_merge);
    }
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

// Copies the new token's raw q, k and v (what the qkv GEMV writes) from `src` to `dst`, after
// sleeping ~`sleep_ns`. It triggers its dependents first, so attention's blocks are resident and
// past their pre-wait loads long before these writes land: an attention kernel that read the
// token before its wait would see the poison.
__global__ void late_writer_kernel(const __nv_bfloat16* q_src, const __nv_bfloat16* k_src, const __nv_bfloat16* v_src,
                                   __nv_bfloat16* q_dst, __nv_bfloat16* k_dst, __nv_bfloat16* v_dst, int64_t q_elems,
                                   int64_t kv_elems, unsigned sleep_ns) {
  kernels::pdl_launch_dependents();
  uint64_t t0 = 0, t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < sleep_ns);
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = tid; i < q_elems; i += stride) q_dst[i] = q_src[i];
  for (int64_t i = tid; i < kv_elems; i += stride) {
    k_dst[i] = k_src[i];
    v_dst[i] = v_src[i];
  }
}

TEST(AttentionGpuDecode, PdlChainWithLateToken) {
  MOEBIUS_REQUIRE_GPU();
  // The newest key in a prologue tile (ctx <= 192 in one split, and the last split of 1000) and
  // past it (193 .. 256: loaded in the key loop), single and many splits.
  const std::vector<int> ctx = {1, 2, 17, 192, 193, 255, 256, 1000, 4097, 10240};
  for (const Geometry& g : {kQwen3_30B, kQwen3_235B, kTiny}) {
    SCOPED_TRACE(g.name);
    const Batch b = make_batch(g, 16, ones(ctx.size()), ctx, 401);
    CudaStream stream;
    DeviceBatch d(b, /*decode=*/true), truth(b);
    const AttentionDims dims = d.dims(b);
    const AttentionDecodePlan plan = kernels::plan_attention_decode(dims, b.max_seqs, 10240, num_sms());
    const size_t ws_bytes = kernels::attention_decode_workspace_bytes(dims, plan);
    DeviceBuffer<uint8_t> ws(std::max<size_t>(ws_bytes, 16));
    kernels::init_attention_decode_workspace(ws.data(), dims, plan, stream);
    auto enqueue = [&] {
      kernels::launch_pdl(late_writer_kernel, dim3(8), dim3(256), 0, stream, truth.q_raw.data(), truth.k_raw.data(),
                          truth.v_raw.data(), d.q_raw.data(), d.k_raw.data(), d.v_raw.data(),
                          static_cast<int64_t>(b.q_raw.size()), static_cast<int64_t>(b.k_raw.size()), 20000u);
      d.launch_decode(b, plan, ws.data(), stream);
    };
    auto reset = [&] {  // poisoned token, poisoned newest cache rows, poisoned output
      d.upload(b, /*decode=*/true);
      d.q_raw.poison(0xFF, stream);
      d.k_raw.poison(0xFF, stream);
      d.v_raw.poison(0xFF, stream);
      d.out.poison(kPoison, stream);
    };
    reset();
    enqueue();
    stream.sync();
    expect_matches(b, d, "pdl");
    expect_cache(b, d, "pdl");
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
      reset();
      CUDA_CHECK(cudaGraphLaunch(exec, stream));
      stream.sync();
      EXPECT_TRUE(same_bytes(d.out.download(), eager)) << "graph replay differs from the eager run";
      expect_cache(b, d, "pdl-graph");
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
  DeviceBatch d(b, /*decode=*/true);
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
      d.launch_decode(b, plan, ws.data(), stream);
      stream.sync();
      if (r == 0) {
        expect_matches(b, d, "rerun");
        expect_cache(b, d, "rerun");
        first = d.out.download();
      } else {
        EXPECT_TRUE(same_bytes(d.out.download(), first)) << "rerun " << r << " differs";
      }
    }
    EXPECT_TRUE(ws.guards_intact());
  }
}

// [TAG_ATTN_DECODE_STAGES] The ring depth changes when tiles load, never the order a warp adds
// them in: 2 and 4 stages give the same bits, with the workspace merge and with clusters, at
// contexts where a warp has one tile and where it has dozens.
TEST(AttentionGpuDecode, TwoAndFourRingStagesAgreeBitForBit) {
  MOEBIUS_REQUIRE_GPU();
  const int n = 6;
  const Batch b = make_batch(kQwen3_30B, 16, ones(n), {1, 63, 1024, 1040, 4096, 10240}, 611);
  CudaStream stream;
  DeviceBatch d(b, /*decode=*/true);
  const AttentionDims dims = d.dims(b);
  for (int variant = 0; variant < 3; ++variant) {
    AttentionDecodePlan plan = kernels::plan_attention_decode(dims, b.max_seqs, 10240, num_sms());
    if (variant == 1) plan = AttentionDecodePlan{b.max_seqs, 10240, 4, /*cluster_merge=*/true};
    if (variant == 2) plan = AttentionDecodePlan{b.max_seqs, 10240, 64, /*cluster_merge=*/false};
    SCOPED_TRACE(::testing::Message() << "max_splits " << plan.max_splits << " cluster " << plan.cluster_merge);
    const size_t ws_bytes = kernels::attention_decode_workspace_bytes(dims, plan);
    DeviceBuffer<uint8_t> ws(std::max<size_t>(ws_bytes, 16));
    std::vector<__nv_bfloat16> with[2];
    for (int i = 0; i < 2; ++i) {
      plan.stages = i == 0 ? 2 : 4;
      ws.poison(0xFF, stream);
      kernels::init_attention_decode_workspace(ws.data(), dims, plan, stream);
      d.out.poison(kPoison, stream);
      d.launch_decode(b, plan, ws_bytes ? ws.data() : nullptr, stream);
      stream.sync();
      expect_matches(b, d, plan.stages == 2 ? "2 stages" : "4 stages");
      with[i] = d.out.download();
    }
    EXPECT_TRUE(same_bytes(with[0], with[1]));
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
    DeviceBatch d(first, decode);
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
      d.launch_decode(first, plan, ws.data(), stream);
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
      d.upload(b, decode);  // synchronous copies, outside the graph: the live batch is device data only
      d.out.poison(kPoison, stream);
      CUDA_CHECK(cudaGraphLaunch(exec, stream));
      stream.sync();
      expect_matches(b, d, decode ? "graph-d" : "graph-p");
      if (decode) expect_cache(b, d, "graph-d");
    }
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
  }
}

}  // namespace
}  // namespace moebius
