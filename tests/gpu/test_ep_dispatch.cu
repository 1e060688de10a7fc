// Expert parallelism on the GPU.
//  - EpDispatchGpu: every packing kernel of kernels/ep_dispatch.cuh against its CPU reference
//    (src/cpu/ep_pack.h) on random and skewed routings, poisoned outputs, guard bands. One GPU.
//  - MoeLayerEpGpu: the EP layer over NCCL. EP = 1 (one GPU, a one-rank NCCL communicator) against
//    the CPU oracle and the single-GPU layer, eagerly and replayed from one captured CUDA graph;
//    EP = 2 and 4 (one thread per GPU, each with its own rank; skipped with fewer GPUs) against the
//    oracle on each rank's tokens, with a zero-token rank and very uneven counts.
#include "gpu/gpu_test_util.h"  // first: see the fmt note there

#include <algorithm>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <utility>

#include "core/dtype.h"
#include "cpu/ep_pack.h"
#include "gpu/moe_layer_test_util.h"
#include "kernels/ep_dispatch.cuh"
#include "moe/moe_layer_ep_cuda.h"
#include "parallel/communicator.h"
#include "parallel/nccl_communicator.h"

namespace moebius::moe {
namespace {

using namespace moe_test;
using ::moebius::testing::bytes_are;
using ::moebius::testing::same_values;

// Routing ids [T, k]: distinct experts per token; `skew` sends every pair to the last rank.
std::vector<int32_t> random_ids(int64_t T, int k, int E, int N, bool skew, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(T * k));
  const int per = E / N;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> pool;
    for (int e = skew ? E - per : 0; e < E; ++e) pool.push_back(e);
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int s = 0; s < k; ++s) ids[static_cast<size_t>(t * k + s)] = pool[static_cast<size_t>(s) % pool.size()];
  }
  return ids;
}

struct DispatchCase {
  int64_t T, cap;
  int k, E, N;
  bool skew;
};

TEST(EpDispatchGpu, KernelsMatchTheirCpuReferences) {
  MOEBIUS_REQUIRE_GPU();
  CudaStream stream;
  const int64_t H = 64;
  // Qwen3-30B-A3B: E=128, k=8; decode capacities and a prefill-sized chunk (several plan chunks).
  const DispatchCase cases[] = {{0, 4, 8, 128, 4, false},  {1, 1, 8, 128, 1, false},  {3, 4, 8, 128, 2, false},
                                {64, 64, 8, 128, 4, false}, {64, 64, 8, 128, 4, true},  {200, 256, 8, 128, 8, false},
                                {37, 40, 4, 16, 16, false}, {300, 300, 8, 128, 32, true}};
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << "T=" << c.T << " cap=" << c.cap << " k=" << c.k << " E=" << c.E
                                      << " N=" << c.N << " skew=" << c.skew);
    const int64_t S = c.cap * c.k;
    const auto ids = random_ids(c.T, c.k, c.E, c.N, c.skew, 7 + c.T);
    const auto x = random_x(c.cap, H, 3);
    // CPU references.
    std::vector<int32_t> pos(static_cast<size_t>(S), -5), cnt(static_cast<size_t>(c.N)),
        meta(static_cast<size_t>(c.N * S), -5);
    cpu::ep_plan_reference(ids.data(), c.T, c.k, c.E, c.N, S, pos.data(), cnt.data(), meta.data());
    std::vector<uint16_t> send(static_cast<size_t>(c.N * S * H), 0xFFFF);
    cpu::ep_pack_rows_reference(x.data(), c.T, H, c.k, ids.data(), c.E, c.N, pos.data(), S, send.data());
    // GPU.
    DeviceBuffer<int32_t> dids(static_cast<size_t>(S) + 1), dn(1), dpos(static_cast<size_t>(S)),
        dcnt(static_cast<size_t>(c.N)), dmeta(static_cast<size_t>(c.N * S));
    DeviceBuffer<__nv_bfloat16> dx(static_cast<size_t>(c.cap * H)), dsend(static_cast<size_t>(c.N * S * H));
    dids.upload(ids);
    dx.upload(x);
    const int32_t n = static_cast<int32_t>(c.T);
    CUDA_CHECK(cudaMemcpy(dn.data(), &n, 4, cudaMemcpyHostToDevice));
    dpos.poison(0xFB, stream);
    dmeta.poison(0xFB, stream);
    dsend.poison(0xFF, stream);
    kernels::launch_ep_plan(dids.data(), dn.data(), static_cast<int>(c.cap), c.k, c.E, c.N, dpos.data(), dcnt.data(),
                            dmeta.data(), stream);
    kernels::launch_ep_pack_rows(dx.data(), dids.data(), dpos.data(), dn.data(), static_cast<int>(c.cap),
                                 static_cast<int>(H), c.k, c.E, c.N, dsend.data(), stream);
    stream.sync();
    const auto gpos = dpos.download(), gcnt = dcnt.download(), gmeta = dmeta.download();
    EXPECT_TRUE(same_values(gpos.data(), pos.data(), static_cast<size_t>(c.T * c.k)));
    EXPECT_TRUE(bytes_are(gpos.data() + c.T * c.k, static_cast<size_t>(S - c.T * c.k), 0xFB));
    EXPECT_TRUE(same_values(gcnt.data(), cnt.data(), cnt.size()));
    const auto gsend = dsend.download();
    for (int d = 0; d < c.N; ++d) {  // live rows equal; the rest untouched
      const size_t live = static_cast<size_t>(cnt[static_cast<size_t>(d)]);
      EXPECT_TRUE(same_values(gmeta.data() + d * S, meta.data() + d * S, live));
      EXPECT_TRUE(bytes_are(gmeta.data() + d * S + live, static_cast<size_t>(S) - live, 0xFB));
      EXPECT_EQ(0, std::memcmp(gsend.data() + d * S * H, send.data() + d * S * H, live * H * 2)) << "rank " << d;
      EXPECT_TRUE(bytes_are(gsend.data() + (d * S + static_cast<int64_t>(live)) * H, (S - live) * H, 0xFF));
    }
    EXPECT_TRUE(dpos.guards_intact() && dmeta.guards_intact() && dsend.guards_intact() && dcnt.guards_intact());

    // Receiver side of rank `me` = N - 1: counts [N, N] with rank s sending cnt rotated by s.
    const int me = c.N - 1;
    std::vector<int32_t> counts(static_cast<size_t>(c.N * c.N));
    for (int s = 0; s < c.N; ++s)
      for (int d = 0; d < c.N; ++d)
        counts[static_cast<size_t>(s * c.N + d)] = cnt[static_cast<size_t>((d + s) % c.N)];
    std::vector<uint16_t> recv = send;  // any rows; only the live ones are read
    std::vector<int32_t> rmeta(meta.size());
    for (size_t i = 0; i < rmeta.size(); ++i) rmeta[i] = static_cast<int32_t>(i % 97);
    std::vector<uint16_t> xl(static_cast<size_t>(c.N * S * H), 0xFFFF);
    std::vector<int32_t> lids(static_cast<size_t>(c.N * S), -5);
    int32_t nl = -1;
    cpu::ep_compact_reference(recv.data(), rmeta.data(), counts.data(), me, c.N, S, H, xl.data(), lids.data(), &nl);
    DeviceBuffer<__nv_bfloat16> drecv(recv.size()), dxl(xl.size());
    DeviceBuffer<int32_t> drmeta(rmeta.size()), dcounts(counts.size()), dlids(lids.size()), dnl(1);
    drecv.upload(recv);
    drmeta.upload(rmeta);
    dcounts.upload(counts);
    dxl.poison(0xFF, stream);
    dlids.poison(0xFB, stream);
    kernels::launch_ep_compact(drecv.data(), drmeta.data(), dcounts.data(), me, c.N, static_cast<int>(S),
                               static_cast<int>(H), dxl.data(), dlids.data(), dnl.data(), stream);
    // Return path: y_local rows -> regions; then the pairs' rows back from a ret_recv.
    std::vector<float> yl(static_cast<size_t>(c.N * S * H));
    for (size_t i = 0; i < yl.size(); ++i) yl[i] = static_cast<float>(i % 1013) * 0.5f;
    // Reference outputs start as the GPU poison (all bytes 0xFF), so untouched rows compare equal.
    std::vector<float> ret(yl.size());
    std::memset(ret.data(), 0xFF, ret.size() * sizeof(float));
    cpu::ep_return_pack_reference(yl.data(), counts.data(), me, c.N, S, H, ret.data());
    std::vector<float> yp(static_cast<size_t>(S * H));
    std::memset(yp.data(), 0xFF, yp.size() * sizeof(float));
    cpu::ep_unpack_return_reference(yl.data(), ids.data(), pos.data(), c.T, c.k, c.E, c.N, S, H, yp.data());
    DeviceBuffer<float> dyl(yl.size()), dret(ret.size()), dyp(yp.size());
    dyl.upload(yl);
    dret.poison(0xFF, stream);
    dyp.poison(0xFF, stream);
    kernels::launch_ep_return_pack(dyl.data(), dcounts.data(), me, c.N, static_cast<int>(S), static_cast<int>(H),
                                   dret.data(), stream);
    kernels::launch_ep_unpack_return(dyl.data(), dids.data(), dpos.data(), dn.data(), static_cast<int>(c.cap), c.k,
                                     c.E, c.N, static_cast<int>(H), dyp.data(), stream);
    stream.sync();
    int32_t gnl = -1;
    CUDA_CHECK(cudaMemcpy(&gnl, dnl.data(), 4, cudaMemcpyDeviceToHost));
    EXPECT_EQ(gnl, nl);
    const auto gxl = dxl.download();
    const auto glids = dlids.download();
    EXPECT_EQ(0, std::memcmp(gxl.data(), xl.data(), static_cast<size_t>(nl) * H * 2));
    EXPECT_TRUE(bytes_are(gxl.data() + nl * H, static_cast<size_t>(c.N * S - nl) * H, 0xFF));
    EXPECT_TRUE(same_values(glids.data(), lids.data(), static_cast<size_t>(nl)));
    const auto gret = dret.download(), gyp = dyp.download();
    EXPECT_TRUE(same_values(gret.data(), ret.data(), ret.size()));  // bitwise: untouched rows stay poisoned
    EXPECT_TRUE(same_values(gyp.data(), yp.data(), yp.size()));
    EXPECT_TRUE(dxl.guards_intact() && dlids.guards_intact() && dret.guards_intact() && dyp.guards_intact());
  }
}

#if defined(MOEBIUS_HAS_NCCL)

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

// The full layer as rank `rank` of `size` holds it.
cpu::MoeLayerReference local_layer(const cpu::MoeLayerReference& full, int size, int rank) {
  cpu::MoeLayerReference m = full;
  const auto r = parallel::expert_range(full.shape.num_experts, size, rank);
  m.experts.assign(full.experts.begin() + r.begin, full.experts.begin() + r.end);
  return m;
}

struct RankResult {
  std::vector<uint16_t> out;  // [T, H]
  std::vector<int32_t> ids;   // [T, k]
  std::vector<float> w;       // [T, k]
  std::string error;
};

// Every rank on its own thread and GPU; rank r carries tokens[r] rows of its x (seeded by r).
std::vector<RankResult> run_ep(const cpu::MoeLayerReference& full, int size, const std::vector<int64_t>& tokens,
                               int capacity, bool graph) {
  auto id = parallel::nccl_unique_id();
  EXPECT_TRUE(id.ok()) << id.error().what();
  std::vector<RankResult> res(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      RankResult& out = res[static_cast<size_t>(r)];
      auto comm = parallel::NcclCommunicator::create(*id, r, size, r);
      if (!comm.ok()) { out.error = comm.error().what(); return; }
      MoeEpCudaOptions opt;
      opt.capacity = capacity;
      auto layer = MoeLayerEpCuda::create(local_layer(full, size, r), **comm, opt);
      if (!layer.ok()) { out.error = layer.error().what(); return; }
      const int64_t H = full.shape.hidden, T = tokens[static_cast<size_t>(r)];
      const int k = full.shape.top_k;
      CudaStream stream;
      DeviceBuffer<__nv_bfloat16> dx(static_cast<size_t>(capacity * H)), dout(static_cast<size_t>(capacity * H));
      DeviceBuffer<int32_t> dn(1);
      dx.upload(random_x(capacity, H, 100 + static_cast<uint64_t>(r)));
      const int32_t n = static_cast<int32_t>(T);
      CUDA_CHECK(cudaMemcpy(dn.data(), &n, 4, cudaMemcpyHostToDevice));
      dout.poison(0xFF, stream);
      if (graph) {  // capture once, replay twice
        cudaGraph_t g;
        cudaGraphExec_t exec;
        CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        Status st = (*layer)->forward(dx.data(), dn.data(), dout.data(), stream);
        CUDA_CHECK(cudaStreamEndCapture(stream, &g));
        if (!st.ok()) { out.error = st.error().what(); return; }
        CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
        for (int rep = 0; rep < 2; ++rep) CUDA_CHECK(cudaGraphLaunch(exec, stream));
        stream.sync();
        CUDA_CHECK(cudaGraphExecDestroy(exec));
        CUDA_CHECK(cudaGraphDestroy(g));
      } else {
        for (int rep = 0; rep < 2; ++rep) {
          Status st = (*layer)->forward(dx.data(), dn.data(), dout.data(), stream);
          if (!st.ok()) { out.error = st.error().what(); return; }
        }
        stream.sync();
      }
      out.out.resize(static_cast<size_t>(T * H));
      out.ids.resize(static_cast<size_t>(T * k));
      out.w.resize(out.ids.size());
      CUDA_CHECK(cudaMemcpy(out.out.data(), dout.data(), out.out.size() * 2, cudaMemcpyDeviceToHost));
      CUDA_CHECK(cudaMemcpy(out.ids.data(), (*layer)->topk_ids(), out.ids.size() * 4, cudaMemcpyDeviceToHost));
      CUDA_CHECK(cudaMemcpy(out.w.data(), (*layer)->topk_weights(), out.w.size() * 4, cudaMemcpyDeviceToHost));
    });
  }
  for (auto& t : threads) t.join();
  return res;
}

void check_against_oracle(const cpu::MoeLayerReference& full, const std::vector<RankResult>& res,
                          const std::vector<int64_t>& tokens, int capacity, const std::string& what) {
  for (size_t r = 0; r < res.size(); ++r) {
    ASSERT_TRUE(res[r].error.empty()) << what << " rank " << r << ": " << res[r].error;
    const int64_t T = tokens[r];
    if (T == 0) continue;
    auto x = random_x(capacity, full.shape.hidden, 100 + r);
    x.resize(static_cast<size_t>(T * full.shape.hidden));
    expect_matches_oracle(full, x, T, res[r].ids, res[r].w, res[r].out, what + " rank " + std::to_string(r));
  }
}

// Qwen3-MoE-like geometry small enough for a quick test: H=256, I=128, E=32, k=8.
const Geometry kEpGeometry{256, 128, 32, 8};

TEST(MoeLayerEpGpu, OneRankOverNcclMatchesTheOracleAndTheSingleGpuLayer) {
  MOEBIUS_REQUIRE_GPU();
  for (WeightFormat f : {WeightFormat::kNvFp4, WeightFormat::kInt4, WeightFormat::kBF16}) {
    const cpu::MoeLayerReference L = make_layer(f, kEpGeometry, 32, 5);
    // (T, capacity): capacity 320 takes the tensor-core router GEMM (router_takes_gemm: H = 256) in both
    // layers, 64 the small-batch router's tiles.
    for (auto [T, cap] : {std::pair<int64_t, int>{0, 64}, {1, 64}, {13, 64}, {64, 64}, {300, 320}}) {
      for (bool graph : {false, true}) {
        const std::string what = std::string(weight_format_name(f)) + " T=" + std::to_string(T) + " capacity " +
                                 std::to_string(cap) + (graph ? " graph" : " eager");
        const auto res = run_ep(L, 1, {T}, cap, graph);
        check_against_oracle(L, res, {T}, cap, what);
        if (T == 0 || !res[0].error.empty()) continue;
        // The single-GPU layer routes the same tokens the same way.
        MoeCudaOptions o;
        o.capacity = cap;
        auto single = MoeLayerCuda::create(L, o);
        ASSERT_TRUE(single.ok()) << single.error().what();
        auto x = random_x(cap, L.shape.hidden, 100);
        x.resize(static_cast<size_t>(T * L.shape.hidden));
        const LayerRun s = run_gpu(**single, x, T);
        EXPECT_EQ(s.ids, res[0].ids) << what;
        const auto a = to_float(s.out), b = to_float(res[0].out);
        EXPECT_LT(::moebius::testing::nmse(b.data(), a.data(), a.size()), 1e-5) << what;
      }
    }
  }
}

TEST(MoeLayerEpGpu, TwoAndFourRanksMatchTheOracle) {
  MOEBIUS_REQUIRE_GPU();
  const cpu::MoeLayerReference L = make_layer(WeightFormat::kNvFp4, kEpGeometry, 16, 9);
  for (int n : {2, 4}) {
    if (device_count() < n) {
      std::printf("  EP=%d skipped: %d GPU(s)\n", n, device_count());
      continue;
    }
    const std::vector<int64_t> tokens = n == 2 ? std::vector<int64_t>{0, 64} : std::vector<int64_t>{1, 0, 64, 7};
    for (bool graph : {false, true})
      check_against_oracle(L, run_ep(L, n, tokens, 64, graph), tokens, 64,
                           "EP=" + std::to_string(n) + (graph ? " graph" : " eager"));
  }
  if (device_count() < 2) GTEST_SKIP() << "EP=2 and EP=4 need 2 and 4 GPUs; this machine has " << device_count();
}

#endif  // MOEBIUS_HAS_NCCL

}  // namespace
}  // namespace moebius::moe
