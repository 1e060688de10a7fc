// The routed-expert DMA [TAG_EXPERT_ROUTED_DMA] (kernels/expert_dma.cuh, with the host thread of
// runtime/routed_expert_copier.h) against the CPU reference (cpu/expert_dma.h), on fresh random
// routings, eagerly and replayed through one captured graph:
//  - the choice (record ids and parts) EXACTLY the reference's: duplicates, ids out of range, 1-8
//    live rows of a capacity-8 step, fewer slots than candidates, experts resident (device
//    entries) and experts whose w2 another copy already holds (device entries for that part);
//  - the slots: the chosen parts' bytes equal to the homes in pinned host memory (array sizes and
//    offsets that are not 16-byte multiples), everything else still poison (nothing copied for a
//    part not chosen or a slot left empty), all of it landed once the waits returned;
//  - the table entries: chosen parts pointed at the slot (global scales kept), all others
//    untouched; restore puts every entry back;
//  - the failure: a post the copier refuses ends the wait after kExpertDmaWaitNs with the failure
//    word set and one error from health() naming the cause; later waits return at once and later
//    choices choose nothing (the layer reads zero-copy again).
#include "gpu/gpu_test_util.h"  // first: see the fmt note there

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cpu/expert_dma.h"
#include "kernels/expert_dma.cuh"
#include "kernels/expert_prefetch.cuh"
#include "runtime/routed_expert_copier.h"

namespace moebius {
namespace {

using kernels::ExpertDmaRecord;
using testing::bytes_are;
using testing::CudaStream;
using testing::DeviceBuffer;
using kernels::ExpertMatrixPtrs;

bool same_entry(const ExpertMatrixPtrs& a, const ExpertMatrixPtrs& b) {
  return a.weight == b.weight && a.scales == b.scales && a.global_scale[0] == b.global_scale[0] &&
         a.global_scale[1] == b.global_scale[1];
}

// One layer's homes and tables for the tests: E experts, odd array sizes (copies have no alignment
// rule, the slots' offsets do), some resident (device homes), some whose w2 another copy holds.
struct Homes {
  static constexpr int E = 40;
  static constexpr size_t w13_bytes = 3000 + 13, s13_bytes = 190, w2_bytes = 1500 + 7, s2_bytes = 94;
  static constexpr size_t home_bytes = E * (w13_bytes + s13_bytes + w2_bytes + s2_bytes);
  kernels::ExpertPrefetchSlots layout = kernels::expert_prefetch_slots(nullptr, w13_bytes, s13_bytes, w2_bytes, s2_bytes);
  uint8_t* host = nullptr;
  uint8_t* alias = nullptr;
  uint8_t *h13 = nullptr, *hs13 = nullptr, *h2 = nullptr, *hs2 = nullptr;
  size_t a13 = 0, as13 = 0, a2 = 0, as2 = 0;
  DeviceBuffer<uint8_t> device_home{home_bytes};  // resident experts' bytes (never copied)
  std::vector<uint8_t> resident, copied2, home13, home2;
  std::vector<ExpertMatrixPtrs> t13, t2;

  explicit Homes(std::mt19937& rng) : resident(E), copied2(E), home13(E), home2(E), t13(E), t2(E) {
    CUDA_CHECK(cudaHostAlloc(&host, home_bytes, cudaHostAllocMapped));
    for (size_t b = 0; b < home_bytes; ++b) host[b] = static_cast<uint8_t>(rng());
    CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&alias), host, 0));
    h13 = host;
    hs13 = h13 + E * w13_bytes;
    h2 = hs13 + E * s13_bytes;
    hs2 = h2 + E * w2_bytes;
    as13 = E * w13_bytes;
    a2 = as13 + E * s13_bytes;
    as2 = a2 + E * w2_bytes;
    for (int e = 0; e < E; ++e) {
      const size_t u = static_cast<size_t>(e);
      resident[u] = rng() % 4 == 0;
      copied2[u] = !resident[u] && rng() % 5 == 0;
      const uint8_t* base = resident[u] ? device_home.data() : alias;
      t13[u].weight = base + a13 + u * w13_bytes;
      t13[u].scales = base + as13 + u * s13_bytes;
      t13[u].global_scale[0] = 0.5f + e;
      t13[u].global_scale[1] = 1.5f + e;
      t2[u].weight = (copied2[u] ? device_home.data() : base) + a2 + u * w2_bytes;
      t2[u].scales = (copied2[u] ? device_home.data() : base) + as2 + u * s2_bytes;
      t2[u].global_scale[0] = 2.5f + e;
      t2[u].global_scale[1] = 3.5f + e;
      home13[u] = !resident[u];
      home2[u] = !resident[u] && !copied2[u];
    }
  }
  ~Homes() { CUDA_CHECK(cudaFreeHost(host)); }
  Homes(const Homes&) = delete;
  Homes& operator=(const Homes&) = delete;

  // The copier's sources (layer 0): the cold experts' pinned homes; resident experts none.
  runtime::RoutedCopierConfig copier_config(uint8_t* slots, int num_slots) const {
    runtime::RoutedCopierConfig c;
    c.num_layers = 1;
    c.num_experts = E;
    c.num_slots = num_slots;
    c.sources.resize(E);
    for (int e = 0; e < E; ++e) {
      const size_t u = static_cast<size_t>(e);
      if (resident[u]) continue;
      c.sources[u] = {h13 + u * w13_bytes, hs13 + u * s13_bytes, h2 + u * w2_bytes, hs2 + u * s2_bytes};
    }
    c.slots = {slots, layout.stride, layout.off_s13, layout.off_w2, layout.off_s2};
    c.w13_bytes = w13_bytes;
    c.s13_bytes = s13_bytes;
    c.w2_bytes = w2_bytes;
    c.s2_bytes = s2_bytes;
    return c;
  }

  // The choose kernel's arguments for layer 0 over these homes and tables.
  kernels::ExpertDmaChooseArgs choose_args(const int32_t* topk_ids, const int32_t* num_tokens, int capacity, int top_k,
                                           ExpertMatrixPtrs* table13, ExpertMatrixPtrs* table2, uint8_t* slots,
                                           int num_slots, const runtime::RoutedExpertCopier& copier,
                                           ExpertDmaRecord* record) const {
    kernels::ExpertDmaChooseArgs a;
    a.topk_ids = topk_ids;
    a.num_tokens = num_tokens;
    a.capacity = capacity;
    a.top_k = top_k;
    a.num_experts = E;
    a.table13 = table13;
    a.table2 = table2;
    a.home = {alias + a13, alias + a13 + E * w13_bytes, alias + a2, alias + a2 + E * w2_bytes};
    a.slots = {slots, layout.stride, layout.off_s13, layout.off_w2, layout.off_s2};
    a.num_slots = num_slots;
    a.layer = 0;
    a.signal = copier.signal();
    a.record = record;
    return a;
  }
};

TEST(ExpertDmaGpu, ChoiceCopiesAndTablesMatchTheCpuReference) {
  MOEBIUS_REQUIRE_GPU();
  constexpr int E = Homes::E, k = 8, capacity = 8;
  const size_t w13_bytes = Homes::w13_bytes, s13_bytes = Homes::s13_bytes, w2_bytes = Homes::w2_bytes,
               s2_bytes = Homes::s2_bytes;
  for (const int num_slots : {3, 8}) {
    for (const bool graph : {false, true}) {
      SCOPED_TRACE(::testing::Message() << num_slots << " slots" << (graph ? ", graph replays" : ", eager"));
      std::mt19937 rng(1234u + static_cast<unsigned>(num_slots) + (graph ? 77u : 0u));
      Homes h(rng);
      const kernels::ExpertPrefetchSlots& layout = h.layout;
      DeviceBuffer<ExpertMatrixPtrs> table13(E), table2(E);
      DeviceBuffer<uint8_t> slots(num_slots * layout.stride);
      DeviceBuffer<int32_t> topk(capacity * k), ntok(1);
      DeviceBuffer<ExpertDmaRecord> record(1);
      CudaStream stream;
      auto made = runtime::RoutedExpertCopier::create(h.copier_config(slots.data(), num_slots));
      ASSERT_TRUE(made.ok()) << made.error().what();
      std::unique_ptr<runtime::RoutedExpertCopier> copier = std::move(made).value();

      kernels::ExpertDmaChooseArgs a = h.choose_args(topk.data(), ntok.data(), capacity, k, table13.data(), table2.data(),
                                                     slots.data(), num_slots, *copier, record.data());
      // The runner's shape on one stream: choose, the w2 wait, the w13 wait.
      auto enqueue = [&](cudaStream_t s) {
        kernels::launch_expert_dma_choose(a, s);
        kernels::launch_expert_dma_wait(record.data(), a.signal, kernels::kExpertDmaPart2, s);
        kernels::launch_expert_dma_wait(record.data(), a.signal, kernels::kExpertDmaPart13, s);
      };
      cudaGraphExec_t exec = nullptr;
      if (graph) {
        cudaGraph_t g = nullptr;
        CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        enqueue(stream);
        CUDA_CHECK(cudaStreamEndCapture(stream, &g));
        CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
        CUDA_CHECK(cudaGraphDestroy(g));
      }
      int64_t posts = 0;
      for (int trial = 0; trial < 24; ++trial) {
        SCOPED_TRACE(::testing::Message() << "trial " << trial);
        const int rows = trial == 0 ? 1 : 1 + static_cast<int>(rng() % capacity);
        std::vector<int32_t> ids(capacity * k, -1);
        for (int p = 0; p < rows * k; ++p) {
          const unsigned r = rng() % 20;
          // Trial 5: only resident experts (the choice is empty: no post, the waits return at once).
          ids[static_cast<size_t>(p)] =
              trial == 5 ? -1 : r == 0 ? -1 : r == 1 ? E + 3 : static_cast<int32_t>(rng() % (trial % 3 == 0 ? 6 : E));
        }
        // Padding rows past the live ones hold ids the choice must not read.
        for (int p = rows * k; p < capacity * k; ++p) ids[static_cast<size_t>(p)] = static_cast<int32_t>(rng() % E);
        topk.upload(ids);
        ntok.upload(std::vector<int32_t>{rows});
        table13.upload(h.t13);
        table2.upload(h.t2);
        slots.poison(0xCD, stream);
        record.poison(0x00, stream);
        if (graph) CUDA_CHECK(cudaGraphLaunch(exec, stream));
        else enqueue(stream);
        stream.sync();
        ASSERT_TRUE(copier->health().ok()) << copier->health().error().what();
        const std::vector<cpu::ExpertDmaChoice> want =
            cpu::expert_dma_choose(ids, rows, k, E, h.home13, h.home2, num_slots);
        posts += want.empty() ? 0 : 1;
        EXPECT_EQ(copier->posts_served(), posts);
        const ExpertDmaRecord got = record.download()[0];
        ASSERT_EQ(got.count, static_cast<int>(want.size()));
        const std::vector<ExpertMatrixPtrs> g13 = table13.download(), g2 = table2.download();
        const std::vector<uint8_t> s = slots.download();
        std::vector<uint8_t> touched13(E), touched2(E);
        for (size_t j = 0; j < want.size(); ++j) {
          const int e = want[j].expert;
          const size_t u = static_cast<size_t>(e);
          EXPECT_EQ(got.ids[j], e) << "slot " << j;
          EXPECT_EQ(got.parts[j], want[j].parts) << "slot " << j;
          const uint8_t* slot = s.data() + j * layout.stride;
          const uint8_t* dslot = slots.data() + j * layout.stride;
          if (want[j].parts & kernels::kExpertDmaPart13) {
            touched13[u] = 1;
            EXPECT_EQ(std::memcmp(slot, h.h13 + u * w13_bytes, w13_bytes), 0) << "w13 of slot " << j;
            EXPECT_EQ(std::memcmp(slot + layout.off_s13, h.hs13 + u * s13_bytes, s13_bytes), 0) << "s13 of slot " << j;
            ExpertMatrixPtrs want13 = h.t13[u];
            want13.weight = dslot;
            want13.scales = dslot + layout.off_s13;
            EXPECT_TRUE(same_entry(g13[u], want13)) << "table13 of expert " << e;
          } else {
            EXPECT_TRUE(bytes_are(slot, w13_bytes, 0xCD)) << "w13 of slot " << j << " copied for nothing";
          }
          if (want[j].parts & kernels::kExpertDmaPart2) {
            touched2[u] = 1;
            EXPECT_EQ(std::memcmp(slot + layout.off_w2, h.h2 + u * w2_bytes, w2_bytes), 0) << "w2 of slot " << j;
            EXPECT_EQ(std::memcmp(slot + layout.off_s2, h.hs2 + u * s2_bytes, s2_bytes), 0) << "s2 of slot " << j;
            ExpertMatrixPtrs want2 = h.t2[u];
            want2.weight = dslot + layout.off_w2;
            want2.scales = dslot + layout.off_s2;
            EXPECT_TRUE(same_entry(g2[u], want2)) << "table2 of expert " << e;
          } else {
            EXPECT_TRUE(bytes_are(slot + layout.off_w2, w2_bytes, 0xCD)) << "w2 of slot " << j << " copied for nothing";
          }
        }
        for (size_t j = want.size(); j < static_cast<size_t>(num_slots); ++j)
          EXPECT_TRUE(bytes_are(s.data() + j * layout.stride, layout.stride, 0xCD)) << "empty slot " << j << " written";
        for (int e = 0; e < E; ++e) {
          const size_t u = static_cast<size_t>(e);
          if (!touched13[u]) EXPECT_TRUE(same_entry(g13[u], h.t13[u])) << "table13 of expert " << e << " changed";
          if (!touched2[u]) EXPECT_TRUE(same_entry(g2[u], h.t2[u])) << "table2 of expert " << e << " changed";
        }
        kernels::launch_expert_dma_restore(record.data(), stream);
        stream.sync();
        const std::vector<ExpertMatrixPtrs> r13 = table13.download(), r2 = table2.download();
        for (int e = 0; e < E; ++e) {
          EXPECT_TRUE(same_entry(r13[static_cast<size_t>(e)], h.t13[static_cast<size_t>(e)])) << "restored table13 " << e;
          EXPECT_TRUE(same_entry(r2[static_cast<size_t>(e)], h.t2[static_cast<size_t>(e)])) << "restored table2 " << e;
        }
        EXPECT_EQ(record.download()[0].count, 0);
      }
      EXPECT_GT(posts, 12);
      EXPECT_TRUE(slots.guards_intact());
      EXPECT_TRUE(table13.guards_intact() && table2.guards_intact());
      if (exec != nullptr) CUDA_CHECK(cudaGraphExecDestroy(exec));
    }
  }
}

// Back-to-back choices in one graph, as the layers of a decode step make them: each round's
// choose -> wait2 -> wait13 -> a device check of every chosen slot against its home (read through
// the saved entries) -> restore, with no host synchronization between rounds, so the single post
// slot, the flag values and the slots are reused while the host thread serves them one by one.
__global__ void verify_slots_kernel(const ExpertDmaRecord* rec, const ExpertMatrixPtrs* table13,
                                    const ExpertMatrixPtrs* table2, size_t w13_bytes, size_t s13_bytes, size_t w2_bytes,
                                    size_t s2_bytes, unsigned* errors) {
  for (int j = 0; j < rec->count; ++j) {
    const int e = rec->ids[j];
    struct Part {
      const uint8_t* got;
      const uint8_t* want;
      size_t bytes;
    };
    const Part parts[4] = {
        {static_cast<const uint8_t*>(table13[e].weight), static_cast<const uint8_t*>(rec->saved13[j].weight), w13_bytes},
        {static_cast<const uint8_t*>(table13[e].scales), static_cast<const uint8_t*>(rec->saved13[j].scales), s13_bytes},
        {static_cast<const uint8_t*>(table2[e].weight), static_cast<const uint8_t*>(rec->saved2[j].weight), w2_bytes},
        {static_cast<const uint8_t*>(table2[e].scales), static_cast<const uint8_t*>(rec->saved2[j].scales), s2_bytes},
    };
    for (int q = 0; q < 4; ++q) {
      const bool chosen = (rec->parts[j] & (q < 2 ? kernels::kExpertDmaPart13 : kernels::kExpertDmaPart2)) != 0;
      if (!chosen) continue;
      for (size_t b = threadIdx.x; b < parts[q].bytes; b += blockDim.x)
        if (parts[q].got[b] != parts[q].want[b]) {
          atomicAdd(errors, 1u);
          break;
        }
    }
  }
}

TEST(ExpertDmaGpu, BackToBackChoicesInOneGraphLandBeforeTheirWaits) {
  MOEBIUS_REQUIRE_GPU();
  constexpr int E = Homes::E, k = 8, num_slots = 8, rounds = 16;
  std::mt19937 rng(4321u);
  Homes h(rng);
  DeviceBuffer<ExpertMatrixPtrs> table13(E), table2(E);
  DeviceBuffer<uint8_t> slots(num_slots * h.layout.stride);
  DeviceBuffer<int32_t> topk(rounds * k), ntok(1);
  DeviceBuffer<ExpertDmaRecord> record(1);
  DeviceBuffer<unsigned> errors(1);
  CudaStream stream;
  auto made = runtime::RoutedExpertCopier::create(h.copier_config(slots.data(), num_slots));
  ASSERT_TRUE(made.ok()) << made.error().what();
  std::unique_ptr<runtime::RoutedExpertCopier> copier = std::move(made).value();
  kernels::ExpertDmaChooseArgs a = h.choose_args(topk.data(), ntok.data(), 1, k, table13.data(), table2.data(),
                                                 slots.data(), num_slots, *copier, record.data());
  cudaGraph_t g = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int r = 0; r < rounds; ++r) {
    a.topk_ids = topk.data() + r * k;
    kernels::launch_expert_dma_choose(a, stream);
    kernels::launch_expert_dma_wait(record.data(), a.signal, kernels::kExpertDmaPart2, stream);
    kernels::launch_expert_dma_wait(record.data(), a.signal, kernels::kExpertDmaPart13, stream);
    verify_slots_kernel<<<1, 256, 0, stream>>>(record.data(), table13.data(), table2.data(), Homes::w13_bytes,
                                               Homes::s13_bytes, Homes::w2_bytes, Homes::s2_bytes, errors.data());
    kernels::launch_expert_dma_restore(record.data(), stream);
  }
  CUDA_CHECK(cudaStreamEndCapture(stream, &g));
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  CUDA_CHECK(cudaGraphDestroy(g));
  int64_t expect_posts = 0;
  for (int replay = 0; replay < 3; ++replay) {
    std::vector<int32_t> ids(rounds * k);
    for (int r = 0; r < rounds; ++r) {
      std::vector<int32_t> row(k);
      for (int32_t& x : row) x = static_cast<int32_t>(rng() % E);
      std::copy(row.begin(), row.end(), ids.begin() + r * k);
      expect_posts += cpu::expert_dma_choose(row, 1, k, E, h.home13, h.home2, num_slots).empty() ? 0 : 1;
    }
    topk.upload(ids);
    ntok.upload(std::vector<int32_t>{1});
    table13.upload(h.t13);
    table2.upload(h.t2);
    errors.upload(std::vector<unsigned>{0});
    slots.poison(0xCD, stream);
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    stream.sync();
    ASSERT_TRUE(copier->health().ok()) << copier->health().error().what();
    EXPECT_EQ(errors.download()[0], 0u) << "replay " << replay << ": a slot read before its bytes landed";
    EXPECT_EQ(copier->posts_served(), expect_posts);
    const std::vector<ExpertMatrixPtrs> g13 = table13.download(), g2 = table2.download();
    for (int e = 0; e < E; ++e) {
      EXPECT_TRUE(same_entry(g13[static_cast<size_t>(e)], h.t13[static_cast<size_t>(e)])) << "table13 " << e;
      EXPECT_TRUE(same_entry(g2[static_cast<size_t>(e)], h.t2[static_cast<size_t>(e)])) << "table2 " << e;
    }
  }
  EXPECT_GT(expect_posts, 2 * rounds);
  CUDA_CHECK(cudaGraphExecDestroy(exec));
}

// A post the copier refuses (a chosen expert without a home in its sources): the wait gives up
// after kExpertDmaWaitNs and sets the failure word; health() names the cause, once; every later
// wait returns at once and every later choice chooses nothing, leaving the tables alone.
TEST(ExpertDmaGpu, UnservedPostsFailWithinTheBoundAndSay) {
  MOEBIUS_REQUIRE_GPU();
  using clock = std::chrono::steady_clock;
  constexpr int E = Homes::E, k = 8, num_slots = 4;
  std::mt19937 rng(99u);
  Homes h(rng);
  DeviceBuffer<ExpertMatrixPtrs> table13(E), table2(E);
  DeviceBuffer<uint8_t> slots(num_slots * h.layout.stride);
  DeviceBuffer<int32_t> topk(k), ntok(1);
  DeviceBuffer<ExpertDmaRecord> record(1);
  CudaStream stream;
  runtime::RoutedCopierConfig cc = h.copier_config(slots.data(), num_slots);
  int victim = -1;  // a cold expert whose source the copier lacks
  for (int e = 0; e < E && victim < 0; ++e)
    if (!h.resident[static_cast<size_t>(e)] && !h.copied2[static_cast<size_t>(e)]) victim = e;
  ASSERT_GE(victim, 0);
  cc.sources[static_cast<size_t>(victim)] = {};
  auto made = runtime::RoutedExpertCopier::create(std::move(cc));
  ASSERT_TRUE(made.ok()) << made.error().what();
  std::unique_ptr<runtime::RoutedExpertCopier> copier = std::move(made).value();
  topk.upload(std::vector<int32_t>(k, victim));
  ntok.upload(std::vector<int32_t>{1});
  table13.upload(h.t13);
  table2.upload(h.t2);
  record.poison(0x00, stream);
  kernels::ExpertDmaChooseArgs a = h.choose_args(topk.data(), ntok.data(), 1, k, table13.data(), table2.data(),
                                                 slots.data(), num_slots, *copier, record.data());
  const auto t0 = clock::now();
  kernels::launch_expert_dma_choose(a, stream);
  kernels::launch_expert_dma_wait(record.data(), a.signal, kernels::kExpertDmaPart13, stream);
  stream.sync();
  const double waited = std::chrono::duration<double>(clock::now() - t0).count();
  const double bound = static_cast<double>(kernels::kExpertDmaWaitNs) / 1e9;
  EXPECT_GE(waited, 0.9 * bound);
  EXPECT_LT(waited, bound + 3.0);
  const Status st = copier->health();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.error().what().find("no home"), std::string::npos) << st.error().what();
  EXPECT_EQ(copier->posts_served(), 0);
  EXPECT_TRUE(copier->health().ok());  // reported once
  // Later waits return at once (the failure is sticky), so a broken step cannot hang the stream.
  const auto t1 = clock::now();
  kernels::launch_expert_dma_wait(record.data(), a.signal, kernels::kExpertDmaPart2, stream);
  stream.sync();
  EXPECT_LT(std::chrono::duration<double>(clock::now() - t1).count(), 0.5);
  // The next choice chooses nothing: the tables stay as they are, no post, no wait.
  kernels::launch_expert_dma_restore(record.data(), stream);
  table13.upload(h.t13);
  table2.upload(h.t2);
  const auto t2 = clock::now();
  kernels::launch_expert_dma_choose(a, stream);
  kernels::launch_expert_dma_wait(record.data(), a.signal, kernels::kExpertDmaPart13, stream);
  stream.sync();
  EXPECT_LT(std::chrono::duration<double>(clock::now() - t2).count(), 0.5);
  EXPECT_EQ(record.download()[0].count, 0);
  const std::vector<ExpertMatrixPtrs> g13 = table13.download(), g2 = table2.download();
  for (int e = 0; e < E; ++e) {
    EXPECT_TRUE(same_entry(g13[static_cast<size_t>(e)], h.t13[static_cast<size_t>(e)])) << "table13 " << e;
    EXPECT_TRUE(same_entry(g2[static_cast<size_t>(e)], h.t2[static_cast<size_t>(e)])) << "table2 " << e;
  }
}

// [TAG_CUDA_CONNECTIONS] The copier's stream must not share a hardware queue with the stream whose
// kernels wait for its copies (they would queue behind the waits until the bound). CUDA assigns
// queues as streams are created; with the 32 this binary asks for (as the CLI does), any 0-30
// streams created between the waiting stream and the copier leave the two apart. Run Z39 with
// CUDA_DEVICE_MAX_CONNECTIONS=8 and lazy loading: only the first round stalled (the kernels' first
// launch: [TAG_CUDA_EAGER_LOADING]), so this guards both settings of cuda_environment.h.
TEST(ExpertDmaGpu, CopiesDoNotQueueBehindTheirWaitsWhateverStreamsCameBetween) {
  MOEBIUS_REQUIRE_GPU();
  using clock = std::chrono::steady_clock;
  constexpr int E = Homes::E, k = 8, num_slots = 4;
  std::mt19937 rng(4242u);
  Homes h(rng);
  std::vector<int32_t> ids;
  for (int e = 0; e < E && static_cast<int>(ids.size()) < k; ++e)
    if (!h.resident[static_cast<size_t>(e)]) ids.push_back(e);
  ASSERT_EQ(static_cast<int>(ids.size()), k);
  DeviceBuffer<ExpertMatrixPtrs> table13(E), table2(E);
  DeviceBuffer<uint8_t> slots(num_slots * h.layout.stride);
  DeviceBuffer<int32_t> topk(k), ntok(1);
  DeviceBuffer<ExpertDmaRecord> record(1);
  topk.upload(ids);
  ntok.upload(std::vector<int32_t>{1});
  std::vector<int> stalled;
  for (int between = 0; between <= 30; ++between) {
    table13.upload(h.t13);
    table2.upload(h.t2);
    CudaStream waiting;
    std::vector<std::unique_ptr<CudaStream>> others;
    for (int i = 0; i < between; ++i) others.push_back(std::make_unique<CudaStream>());
    auto made = runtime::RoutedExpertCopier::create(h.copier_config(slots.data(), num_slots));
    ASSERT_TRUE(made.ok()) << made.error().what();
    std::unique_ptr<runtime::RoutedExpertCopier> copier = std::move(made).value();
    record.poison(0x00, waiting);
    const kernels::ExpertDmaChooseArgs a = h.choose_args(topk.data(), ntok.data(), 1, k, table13.data(),
                                                         table2.data(), slots.data(), num_slots, *copier, record.data());
    const auto t0 = clock::now();
    kernels::launch_expert_dma_choose(a, waiting);
    kernels::launch_expert_dma_wait(record.data(), a.signal, kernels::kExpertDmaPart13, waiting);
    kernels::launch_expert_dma_wait(record.data(), a.signal, kernels::kExpertDmaPart2, waiting);
    kernels::launch_expert_dma_restore(record.data(), waiting);
    waiting.sync();
    const double waited = std::chrono::duration<double>(clock::now() - t0).count();
    const Status st = copier->health();
    if (!st.ok() || waited > 0.5) {
      stalled.push_back(between);
      ADD_FAILURE() << between << " streams between: waited " << waited << " s; "
                    << (st.ok() ? std::string("healthy") : st.error().what());
    }
    EXPECT_EQ(copier->posts_served(), 1) << between << " streams between";
  }
  EXPECT_TRUE(stalled.empty()) << "CUDA_DEVICE_MAX_CONNECTIONS " << runtime::cuda_connections() << ": "
                               << stalled.size() << " of 31 counts stalled";
}

}  // namespace
}  // namespace moebius
