// The next-layer expert prefetch kernels [TAG_EXPERT_PREFETCH] (kernels/expert_prefetch.cuh)
// against the CPU reference (cpu/expert_prefetch.h), on fresh random inputs:
//  - predict: the logits within a bf16-rounding tolerance at real and odd shapes (Qwen3-30B-A3B
//    H=2048 E=128 k=8; Qwen3-235B-A22B H=4096; odd H, E up to 512, T 0-8, skewed and empty cold
//    sets, correction bias, no delta), the selection EXACTLY the reference's on the kernel's own
//    logits, the record (saved home entries) and the log; the previous owner's entries restored;
//  - copy + publish: slot bytes equal to the homes (device and mapped pinned sources, sizes and
//    offsets that are not 16-byte multiples, 1-132 blocks), the slot padding untouched, the table
//    entries pointed at the slots with their global scales kept; restore puts them back;
//  - the three kernels in a CUDA graph, replayed with changing token counts.
#include "gpu/gpu_test_util.h"  // first: see the fmt note there

#include <cuda_bf16.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/memory.h"
#include "cpu/expert_prefetch.h"
#include "kernels/expert_prefetch.cuh"

namespace moebius {
namespace {

using kernels::ExpertMatrixPtrs;
using kernels::ExpertPrefetchRecord;
using kernels::ExpertPrefetchSlots;

struct PredictCase {
  int hidden, experts, top_k, capacity, tokens, slots;
  enum Cold { kRandom, kAll, kNone, kOne } cold;
  bool delta, bias;
};

std::vector<uint16_t> bits_of(const std::vector<bf16>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = v[i].bits;
  return b;
}

// Distinct fake entries (the predict kernel only copies them).
std::vector<ExpertMatrixPtrs> fake_table(int E, uintptr_t base) {
  std::vector<ExpertMatrixPtrs> t(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) {
    t[static_cast<size_t>(e)].weight = reinterpret_cast<const void*>(base + 0x10000 * static_cast<uintptr_t>(e));
    t[static_cast<size_t>(e)].scales = reinterpret_cast<const void*>(base + 0x10000 * static_cast<uintptr_t>(e) + 0x800);
    t[static_cast<size_t>(e)].global_scale[0] = 0.5f + static_cast<float>(e);
    t[static_cast<size_t>(e)].global_scale[1] = 0.25f + static_cast<float>(e);
  }
  return t;
}

bool same_entry(const ExpertMatrixPtrs& a, const ExpertMatrixPtrs& b) { return std::memcmp(&a, &b, sizeof(a)) == 0; }

TEST(ExpertPrefetchGpu, PredictMatchesTheCpuReference) {
  MOEBIUS_REQUIRE_GPU();
  std::mt19937 rng(20261206);
  const PredictCase cases[] = {
      {64, 16, 4, 1, 1, 2, PredictCase::kRandom, true, false},
      {2048, 128, 8, 1, 1, 4, PredictCase::kRandom, true, false},   // Qwen3-30B-A3B, one token
      {4096, 128, 8, 8, 8, 8, PredictCase::kRandom, true, false},   // Qwen3-235B-A22B, eight tokens
      {4096, 128, 8, 4, 3, 2, PredictCase::kAll, true, true},       // sigmoid-style bias
      {136, 512, 2, 2, 2, 8, PredictCase::kNone, true, false},      // nothing cold: no copy
      {1024, 256, 8, 8, 0, 4, PredictCase::kRandom, true, false},   // no live token
      {72, 8, 2, 3, 3, 1, PredictCase::kOne, false, false},         // skewed: one cold expert, no delta
      {2056, 100, 6, 5, 5, 3, PredictCase::kRandom, false, true},   // odd E and H
  };
  for (const PredictCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "H=" << c.hidden << " E=" << c.experts << " k=" << c.top_k
                                      << " cap=" << c.capacity << " T=" << c.tokens << " slots=" << c.slots);
    const size_t H = static_cast<size_t>(c.hidden), E = static_cast<size_t>(c.experts),
                 C = static_cast<size_t>(c.capacity);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_real_distribution<float> ud(-0.05f, 0.05f);
    std::vector<float> resid(C * H), norm(H), bias;
    std::vector<bf16> delta, router(E * H);
    for (float& v : resid) v = 3.0f * nd(rng);
    for (float& v : norm) v = 0.5f + 0.05f * nd(rng);
    for (bf16& v : router) v = bf16(ud(rng));
    if (c.delta) {
      delta.resize(C * H);
      for (bf16& v : delta) v = bf16(nd(rng));
    }
    if (c.bias) {
      bias.resize(E);
      for (float& v : bias) v = 0.1f * nd(rng);
    }
    std::vector<uint8_t> cold(E);
    for (size_t e = 0; e < E; ++e)
      cold[e] = c.cold == PredictCase::kAll      ? 1
                : c.cold == PredictCase::kNone   ? 0
                : c.cold == PredictCase::kOne    ? (e == 5 ? 1 : 0)
                                                 : static_cast<uint8_t>(rng() % 3 != 0);
    // The token whose top-k holds expert 5 in the skewed case: make it so on row 0.
    if (c.cold == PredictCase::kOne)
      for (size_t i = 0; i < H; ++i) router[5 * H + i] = bf16(0.2f * (resid[i] > 0 ? 1.0f : -1.0f) * (norm[i] > 0 ? 1.0f : -1.0f));

    testing::DeviceBuffer<float> d_resid(C * H), d_norm(H), d_bias(std::max<size_t>(E, 1)), d_logits(8 * E);
    testing::DeviceBuffer<uint16_t> d_delta(std::max<size_t>(C * H, 1)), d_router(E * H);
    testing::DeviceBuffer<uint8_t> d_cold(E);
    testing::DeviceBuffer<int32_t> d_tokens(1), d_log(1 + kernels::kExpertPrefetchMaxSlots);
    testing::DeviceBuffer<unsigned> d_counter(1);
    testing::DeviceBuffer<ExpertMatrixPtrs> d_t13(E), d_t2(E);
    testing::DeviceBuffer<ExpertPrefetchRecord> d_rec(1);
    d_resid.upload(resid);
    d_norm.upload(norm);
    if (c.bias) d_bias.upload(bias);
    if (c.delta) d_delta.upload(bits_of(delta));
    d_router.upload(bits_of(router));
    d_cold.upload(cold);
    d_tokens.upload(std::vector<int32_t>{c.tokens});
    const std::vector<ExpertMatrixPtrs> t13 = fake_table(c.experts, 0x100000000ull), t2 = fake_table(c.experts, 0x200000000ull);
    d_t13.upload(t13);
    d_t2.upload(t2);
    CUDA_CHECK(cudaMemset(d_rec.data(), 0, sizeof(ExpertPrefetchRecord)));
    CUDA_CHECK(cudaMemset(d_counter.data(), 0, sizeof(unsigned)));
    d_logits.poison(0xFF);
    d_log.poison(0xFF);

    kernels::ExpertPrefetchPredictArgs a;
    a.resid = d_resid.data();
    a.delta = c.delta ? reinterpret_cast<const __nv_bfloat16*>(d_delta.data()) : nullptr;
    a.norm_weight = d_norm.data();
    a.eps = 1e-6f;
    a.router = reinterpret_cast<const __nv_bfloat16*>(d_router.data());
    a.correction_bias = c.bias ? d_bias.data() : nullptr;
    a.cold = d_cold.data();
    a.hidden = c.hidden;
    a.num_experts = c.experts;
    a.top_k = c.top_k;
    a.num_tokens = d_tokens.data();
    a.capacity = c.capacity;
    a.slots = c.slots;
    a.table13 = d_t13.data();
    a.table2 = d_t2.data();
    a.record = d_rec.data();
    a.logits = d_logits.data();
    a.counter = d_counter.data();
    a.log = d_log.data();
    testing::CudaStream stream;
    kernels::launch_expert_prefetch_predict(a, stream);
    stream.sync();

    const cpu::ExpertPrefetchShape shape{c.hidden, c.experts, c.top_k, 1e-6f};
    const size_t T = static_cast<size_t>(c.tokens);
    const std::vector<float> want = cpu::expert_prefetch_logits(shape, c.tokens, resid, delta, norm, router, bias);
    const std::vector<float> got_all = d_logits.download();
    const std::vector<float> got(got_all.begin(), got_all.begin() + static_cast<std::ptrdiff_t>(T * E));
    // Tolerance: a bf16 rounding of xn may differ (the rms scale's last bits), each flip moving
    // one product by 2^-8 relative; bound by the sum of |products|.
    for (size_t t = 0; t < T; ++t)
      for (size_t e = 0; e < E; ++e) {
        const float g = got[t * E + e], w = want[t * E + e];
        ASSERT_TRUE(std::isfinite(g)) << "logit (" << t << ", " << e << ") not written";
        EXPECT_NEAR(g, w, 2e-3f * (std::fabs(w) + 1.0f)) << "logit (" << t << ", " << e << ")";
      }
    const std::vector<int> sel = cpu::expert_prefetch_select(shape, c.tokens, got, cold, c.slots);
    const std::vector<int32_t> log = d_log.download();
    ASSERT_EQ(log[0], static_cast<int32_t>(sel.size()));
    for (size_t i = 0; i < sel.size(); ++i) EXPECT_EQ(log[1 + i], sel[i]) << "selection " << i;
    EXPECT_TRUE(d_log.guards_intact());
    EXPECT_TRUE(d_logits.guards_intact());
    if (c.cold == PredictCase::kNone || c.tokens == 0) EXPECT_EQ(sel.size(), 0u);
    if (c.cold == PredictCase::kOne && c.tokens > 0) EXPECT_EQ(sel, std::vector<int>{5});
    if (c.cold == PredictCase::kAll && c.tokens > 0) EXPECT_EQ(static_cast<int>(sel.size()), c.slots);
    ExpertPrefetchRecord rec;
    CUDA_CHECK(cudaMemcpy(&rec, d_rec.data(), sizeof(rec), cudaMemcpyDeviceToHost));
    ASSERT_EQ(rec.count, static_cast<int>(sel.size()));
    EXPECT_EQ(rec.table13, sel.empty() ? nullptr : d_t13.data());
    for (size_t i = 0; i < sel.size(); ++i) {
      EXPECT_EQ(rec.ids[i], sel[i]);
      EXPECT_TRUE(same_entry(rec.saved13[i], t13[static_cast<size_t>(sel[i])]));
      EXPECT_TRUE(same_entry(rec.saved2[i], t2[static_cast<size_t>(sel[i])]));
    }
    EXPECT_EQ(d_counter.download()[0], 0u) << "the counter must be left zeroed for the next launch";
    // The table entries are publish's to change, not predict's.
    const std::vector<ExpertMatrixPtrs> after = d_t13.download();
    for (size_t e = 0; e < E; ++e) EXPECT_TRUE(same_entry(after[e], t13[e]));
  }
}

// The homes of `n` experts in the region layout ([n][w13][n][s13][n][w2][n][s2], arrays 256-byte
// aligned) at `base`, filled with random bytes; the table entries pointing at them.
struct Homes {
  size_t w13, s13, w2, s2;
  size_t bytes(int n) const {
    auto a = [](size_t x) { return (x + 255) / 256 * 256; };
    const size_t c = static_cast<size_t>(n);
    return a(w13 * c) + a(s13 * c) + a(w2 * c) + a(s2 * c);
  }
  void entries(uint8_t* base, int n, int first, std::vector<ExpertMatrixPtrs>* t13, std::vector<ExpertMatrixPtrs>* t2) const {
    auto a = [](size_t x) { return (x + 255) / 256 * 256; };
    const size_t c = static_cast<size_t>(n);
    uint8_t* ps13 = base + a(w13 * c);
    uint8_t* pw2 = ps13 + a(s13 * c);
    uint8_t* ps2 = pw2 + a(w2 * c);
    for (int i = 0; i < n; ++i) {
      const size_t k = static_cast<size_t>(i);
      ExpertMatrixPtrs& x = (*t13)[static_cast<size_t>(first + i)];
      ExpertMatrixPtrs& y = (*t2)[static_cast<size_t>(first + i)];
      x.weight = base + w13 * k;
      x.scales = s13 ? ps13 + s13 * k : nullptr;
      y.weight = pw2 + w2 * k;
      y.scales = s2 ? ps2 + s2 * k : nullptr;
      x.global_scale[0] = 1.5f + static_cast<float>(first + i);
      y.global_scale[1] = 2.5f + static_cast<float>(first + i);
    }
  }
};

// What an entry's four arrays hold, read back from wherever they are.
std::vector<uint8_t> read_array(const void* p, size_t n) {
  std::vector<uint8_t> v(n);
  if (n > 0) CUDA_CHECK(cudaMemcpy(v.data(), p, n, cudaMemcpyDefault));
  return v;
}

TEST(ExpertPrefetchGpu, CopyAndPublishPointTheTablesAtExactCopies) {
  MOEBIUS_REQUIRE_GPU();
  std::mt19937 rng(7);
  // Sizes: Qwen3-30B-A3B nvfp4-like multiples of 16, then scale arrays of 4- and 2-byte multiples
  // (sources misaligned for 16-byte loads after the first expert), then a bf16-like one without scales.
  const Homes shapes[] = {{3 * 4096, 1536, 2 * 4096, 768}, {4096 + 48, 1000, 2048, 36}, {512, 0, 512, 0}, {2048, 6, 1040, 2}};
  constexpr int E = 16, kDevice = 8;  // experts 0-7 in device memory, 8-15 in mapped pinned memory
  for (const Homes& h : shapes) {
    for (int blocks : {1, 3, 16, 132}) {
      SCOPED_TRACE(::testing::Message() << "w13=" << h.w13 << " s13=" << h.s13 << " w2=" << h.w2 << " s2=" << h.s2
                                        << " blocks=" << blocks);
      const size_t dev_bytes = h.bytes(kDevice), host_bytes = h.bytes(E - kDevice);
      testing::DeviceBuffer<uint8_t> dev(dev_bytes);
      auto pinned = Buffer::allocate(MemoryKind::kPinnedHost, host_bytes);
      ASSERT_TRUE(pinned.ok());
      std::vector<uint8_t> rnd(std::max(dev_bytes, host_bytes));
      for (uint8_t& b : rnd) b = static_cast<uint8_t>(rng());
      CUDA_CHECK(cudaMemcpy(dev.data(), rnd.data(), dev_bytes, cudaMemcpyHostToDevice));
      for (uint8_t& b : rnd) b = static_cast<uint8_t>(rng());
      std::memcpy(pinned->data(), rnd.data(), host_bytes);
      void* alias = nullptr;
      CUDA_CHECK(cudaHostGetDevicePointer(&alias, pinned->data(), 0));
      std::vector<ExpertMatrixPtrs> t13(E), t2(E);
      h.entries(dev.data(), kDevice, 0, &t13, &t2);
      h.entries(static_cast<uint8_t*>(alias), E - kDevice, kDevice, &t13, &t2);
      testing::DeviceBuffer<ExpertMatrixPtrs> d_t13(E), d_t2(E);
      d_t13.upload(t13);
      d_t2.upload(t2);

      // Slots as the runner lays them out; poisoned, so padding written by mistake shows.
      ExpertPrefetchSlots s = kernels::expert_prefetch_slots(nullptr, h.w13, h.s13, h.w2, h.s2);
      constexpr int kSlots = 5;
      testing::DeviceBuffer<uint8_t> slots(kSlots * s.stride);
      slots.poison(0xEE);
      s.base = slots.data();
      // A record as predict leaves it: device and host experts mixed, one slot unused.
      const std::vector<int> ids = {9, 2, 15, 7};
      ExpertPrefetchRecord rec;
      rec.table13 = d_t13.data();
      rec.table2 = d_t2.data();
      rec.count = static_cast<int>(ids.size());
      for (size_t i = 0; i < ids.size(); ++i) {
        rec.ids[i] = ids[i];
        rec.saved13[i] = t13[static_cast<size_t>(ids[i])];
        rec.saved2[i] = t2[static_cast<size_t>(ids[i])];
      }
      testing::DeviceBuffer<ExpertPrefetchRecord> d_rec(1);
      CUDA_CHECK(cudaMemcpy(d_rec.data(), &rec, sizeof(rec), cudaMemcpyHostToDevice));
      testing::CudaStream stream;
      kernels::launch_expert_prefetch_copy(d_rec.data(), s, blocks, /*priority=*/0, stream);
      kernels::launch_expert_prefetch_publish(d_rec.data(), s, stream);
      stream.sync();
      EXPECT_TRUE(slots.guards_intact());
      const std::vector<uint8_t> got = slots.download();
      const std::vector<ExpertMatrixPtrs> n13 = d_t13.download(), n2 = d_t2.download();
      for (size_t i = 0; i < ids.size(); ++i) {
        const size_t e = static_cast<size_t>(ids[i]);
        const uint8_t* slot = got.data() + i * s.stride;
        const struct {
          const void* src;
          size_t off, n;
        } arrays[] = {{t13[e].weight, 0, h.w13}, {t13[e].scales, s.off_s13, h.s13}, {t2[e].weight, s.off_w2, h.w2},
                      {t2[e].scales, s.off_s2, h.s2}};
        for (const auto& ar : arrays) {
          if (ar.n == 0) continue;
          const std::vector<uint8_t> want = read_array(ar.src, ar.n);
          EXPECT_EQ(std::memcmp(slot + ar.off, want.data(), ar.n), 0) << "expert " << e << " array at " << ar.off;
        }
        // Padding between the arrays is never written.
        for (size_t b = h.w13; b < s.off_s13; ++b) ASSERT_EQ(slot[b], 0xEE) << "padding byte " << b;
        for (size_t b = s.off_s2 + h.s2; b < s.stride; ++b) ASSERT_EQ(slot[b], 0xEE) << "padding byte " << b;
        // The tables now point at the slot, scales kept.
        uint8_t* dslot = slots.data() + i * s.stride;
        EXPECT_EQ(n13[e].weight, dslot);
        EXPECT_EQ(n13[e].scales, h.s13 ? dslot + s.off_s13 : nullptr);
        EXPECT_EQ(n2[e].weight, dslot + s.off_w2);
        EXPECT_EQ(n2[e].scales, h.s2 ? dslot + s.off_s2 : nullptr);
        EXPECT_EQ(n13[e].global_scale[0], t13[e].global_scale[0]);
        EXPECT_EQ(n2[e].global_scale[1], t2[e].global_scale[1]);
      }
      for (size_t b = ids.size() * s.stride; b < got.size(); ++b) ASSERT_EQ(got[b], 0xEE) << "unused slot byte " << b;
      for (int e = 0; e < E; ++e)
        if (std::find(ids.begin(), ids.end(), e) == ids.end()) {
          EXPECT_TRUE(same_entry(n13[static_cast<size_t>(e)], t13[static_cast<size_t>(e)])) << "expert " << e;
          EXPECT_TRUE(same_entry(n2[static_cast<size_t>(e)], t2[static_cast<size_t>(e)])) << "expert " << e;
        }
      // Restore: every entry home again, the record empty.
      kernels::launch_expert_prefetch_restore(d_rec.data(), stream);
      stream.sync();
      const std::vector<ExpertMatrixPtrs> r13 = d_t13.download(), r2 = d_t2.download();
      for (int e = 0; e < E; ++e) {
        EXPECT_TRUE(same_entry(r13[static_cast<size_t>(e)], t13[static_cast<size_t>(e)])) << "expert " << e;
        EXPECT_TRUE(same_entry(r2[static_cast<size_t>(e)], t2[static_cast<size_t>(e)])) << "expert " << e;
      }
      CUDA_CHECK(cudaMemcpy(&rec, d_rec.data(), sizeof(rec), cudaMemcpyDeviceToHost));
      EXPECT_EQ(rec.count, 0);
      EXPECT_EQ(rec.table13, nullptr);
    }
  }
}

// The runner's sequence for two layers A then B sharing the slots, captured in a graph and
// replayed: B's predict puts A's entries back before B's copy, and a replay's first predict puts
// the last owner's back; token counts change between replays through device memory.
TEST(ExpertPrefetchGpu, TheSequenceReplaysInAGraph) {
  MOEBIUS_REQUIRE_GPU();
  std::mt19937 rng(99);
  constexpr int H = 256, E = 32, K = 4, kSlots = 3;
  const Homes h{4096, 512, 2048, 256};
  std::vector<float> resid(2 * H), norm(H, 1.0f);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float& v : resid) v = nd(rng);
  // Two layers' homes in pinned memory (everything cold), their tables and routers.
  struct LayerData {
    std::vector<ExpertMatrixPtrs> t13, t2;
    testing::DeviceBuffer<ExpertMatrixPtrs> d13{E}, d2{E};
    testing::DeviceBuffer<uint16_t> router{static_cast<size_t>(E) * H};
  };
  auto pinned = Buffer::allocate(MemoryKind::kPinnedHost, 2 * h.bytes(E));
  ASSERT_TRUE(pinned.ok());
  for (size_t i = 0; i < 2 * h.bytes(E); ++i) pinned->as<uint8_t>()[i] = static_cast<uint8_t>(rng());
  void* alias = nullptr;
  CUDA_CHECK(cudaHostGetDevicePointer(&alias, pinned->data(), 0));
  LayerData L[2];
  std::uniform_real_distribution<float> ud(-0.1f, 0.1f);
  std::vector<bf16> routers[2];
  for (int l = 0; l < 2; ++l) {
    L[l].t13.resize(E);
    L[l].t2.resize(E);
    h.entries(static_cast<uint8_t*>(alias) + l * h.bytes(E), E, 0, &L[l].t13, &L[l].t2);
    L[l].d13.upload(L[l].t13);
    L[l].d2.upload(L[l].t2);
    routers[l].resize(static_cast<size_t>(E) * H);
    for (bf16& v : routers[l]) v = bf16(ud(rng));
    L[l].router.upload(bits_of(routers[l]));
  }
  testing::DeviceBuffer<float> d_resid(2 * H), d_norm(H), d_logits(8 * E);
  testing::DeviceBuffer<uint8_t> d_cold(E);
  testing::DeviceBuffer<int32_t> d_tokens(1), d_log(2 * (1 + kernels::kExpertPrefetchMaxSlots));
  testing::DeviceBuffer<unsigned> d_counter(1);
  testing::DeviceBuffer<ExpertPrefetchRecord> d_rec(1);
  d_resid.upload(resid);
  d_norm.upload(norm);
  d_cold.upload(std::vector<uint8_t>(E, 1));
  CUDA_CHECK(cudaMemset(d_rec.data(), 0, sizeof(ExpertPrefetchRecord)));
  CUDA_CHECK(cudaMemset(d_counter.data(), 0, sizeof(unsigned)));
  ExpertPrefetchSlots s = kernels::expert_prefetch_slots(nullptr, h.w13, h.s13, h.w2, h.s2);
  testing::DeviceBuffer<uint8_t> slots(kSlots * s.stride);
  s.base = slots.data();

  testing::CudaStream stream;
  auto enqueue = [&](cudaStream_t st) {
    for (int l = 0; l < 2; ++l) {
      kernels::ExpertPrefetchPredictArgs a;
      a.resid = d_resid.data();
      a.norm_weight = d_norm.data();
      a.router = reinterpret_cast<const __nv_bfloat16*>(L[l].router.data());
      a.cold = d_cold.data();
      a.hidden = H;
      a.num_experts = E;
      a.top_k = K;
      a.num_tokens = d_tokens.data();
      a.capacity = 2;
      a.slots = kSlots;
      a.table13 = L[l].d13.data();
      a.table2 = L[l].d2.data();
      a.record = d_rec.data();
      a.logits = d_logits.data();
      a.counter = d_counter.data();
      a.log = d_log.data() + l * (1 + kernels::kExpertPrefetchMaxSlots);
      kernels::launch_expert_prefetch_predict(a, st);
      kernels::launch_expert_prefetch_copy(d_rec.data(), s, 4, /*priority=*/-1, st);
      kernels::launch_expert_prefetch_publish(d_rec.data(), s, st);
    }
  };
  cudaGraph_t graph = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  enqueue(stream);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const cpu::ExpertPrefetchShape shape{H, E, K, 1e-6f};
  for (int tokens : {1, 2, 0, 2}) {
    SCOPED_TRACE(::testing::Message() << "tokens=" << tokens);
    d_tokens.upload(std::vector<int32_t>{tokens});
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    stream.sync();
    // Layer A's entries are home (B's predict put them back); B's point at the slots, which hold
    // B's experts' bytes.
    const std::vector<ExpertMatrixPtrs> a13 = L[0].d13.download(), b13 = L[1].d13.download(), b2 = L[1].d2.download();
    for (int e = 0; e < E; ++e) EXPECT_TRUE(same_entry(a13[static_cast<size_t>(e)], L[0].t13[static_cast<size_t>(e)]));
    const std::vector<int32_t> log = d_log.download();
    const int32_t* lb = log.data() + 1 + kernels::kExpertPrefetchMaxSlots;
    const std::vector<float> lg = d_logits.download();
    const std::vector<int> want = cpu::expert_prefetch_select(
        shape, tokens, std::vector<float>(lg.begin(), lg.begin() + tokens * E), std::vector<uint8_t>(E, 1), kSlots);
    ASSERT_EQ(lb[0], static_cast<int32_t>(want.size()));
    if (tokens > 0) EXPECT_EQ(lb[0], kSlots);
    const std::vector<uint8_t> got = slots.download();
    for (int i = 0; i < lb[0]; ++i) {
      const size_t e = static_cast<size_t>(lb[1 + i]);
      EXPECT_EQ(static_cast<int>(e), want[static_cast<size_t>(i)]);
      EXPECT_EQ(b13[e].weight, slots.data() + static_cast<size_t>(i) * s.stride);
      EXPECT_EQ(b2[e].scales, slots.data() + static_cast<size_t>(i) * s.stride + s.off_s2);
      const std::vector<uint8_t> w = read_array(L[1].t13[e].weight, h.w13);
      EXPECT_EQ(std::memcmp(got.data() + static_cast<size_t>(i) * s.stride, w.data(), h.w13), 0);
    }
    for (int e = 0; e < E; ++e)
      if (std::find(lb + 1, lb + 1 + lb[0], e) == lb + 1 + lb[0])
        EXPECT_TRUE(same_entry(b13[static_cast<size_t>(e)], L[1].t13[static_cast<size_t>(e)]));
    EXPECT_EQ(d_counter.download()[0], 0u);
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
}

}  // namespace
}  // namespace moebius
