// The wgmma prefill GEMMs (kernels/moe_gemm_wgmma.cuh, sm_90a) against CPU references, in two
// layers:
//   1. Kernel level, element by element (MoeWgmmaKernel*): each launcher on hand-built tiles over
//      the real packed weights, every output element against a double-precision dot product of
//      the packed matrices' dequantized values (moe::unpack_to_float; the int formats' rounded
//      once to bf16 as the kernel folds them, moe::folded_int_weight), with a bound derived
//      from fp32 accumulation error, so a fragment, descriptor, swizzle or epilogue mapping mistake
//      fails loudly and names the element. Outputs are poisoned, and so are the inputs the kernel
//      must never read (activation columns past K, h rows of padding slots): a read of them
//      turns a result into NaN. Tiles with their live rows at the end (not the align's prefix)
//      and -1 tiles past the live ones ([TAG_MOE_GRAPH_CAPACITY]) are included, and each GEMM
//      is rerun on a 2- or 3-block persistent grid (many work items per block), bit-identical, and
//      on the dynamic schedule (MoeTiles::work_counter), which must leave its counter zeroed.
//   2. Layer level (MoeWgmmaLayer*): MoeLayerCuda forced onto MoeGemmPath::kPrefillWgmma against
//      the CPU oracle (normalised MSE, as test_moe_layer.cu), for every format, B in {1, 3, 64,
//      256, 1000, 4096}, E in {8, 128}, top-k in {1, 2, 8}, odd shapes, skewed routing and all
//      tokens on one expert, the atomic combine, bit-identical reruns, graph replay, and x rows
//      that are not 16-byte aligned (copied to an aligned stride before GEMM1).
// The tests skip where the kernels are not available (a build without 90a, or not a compute
// capability 9.0 GPU).
#include "gpu/gpu_test_util.h"  // first: see the fmt note there

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "cpu/moe_layer.h"
#include "gpu/moe_layer_test_util.h"
#include "kernels/moe_gemm_wgmma.cuh"
#include "moe/expert_layout.h"
#include "moe/moe_layer_cuda.h"

namespace moebius::moe {
namespace {

using namespace moe_test;

#define MOEBIUS_REQUIRE_WGMMA()                                                                          \
  do {                                                                                                   \
    MOEBIUS_REQUIRE_GPU();                                                                               \
    if (!kernels::moe_gemm_wgmma_available())                                                            \
      GTEST_SKIP() << "no wgmma kernels here (build without 90a, or not a compute capability 9.0 GPU)"; \
  } while (0)

constexpr uint16_t kBf16Poison = 0xFFFF;  // NaN

kernels::MoeWeightFormat to_kernel(KernelFormat f) {
  switch (f) {
    case KernelFormat::kBF16: return kernels::MoeWeightFormat::kBF16;
    case KernelFormat::kNvFp4: return kernels::MoeWeightFormat::kNvFp4;
    case KernelFormat::kInt4: return kernels::MoeWeightFormat::kInt4;
    case KernelFormat::kInt2: return kernels::MoeWeightFormat::kInt2;
  }
  return kernels::MoeWeightFormat::kBF16;
}

// ------------------------------------------------------------------------------------------------
// 1. Kernel level
// ------------------------------------------------------------------------------------------------

// A layer's experts packed into the tile layout and uploaded, with their exact dequantized values
// on the host: w13f[e] [2*I8 rows_padded, H cols_padded] (gate/up interleaved by 8 rows, see
// pack_gate_up), w2f[e] [H rows_padded, I cols_padded].
struct PackedExperts {
  KernelFormat format = KernelFormat::kBF16;
  std::vector<std::vector<float>> w13f, w2f;
  int64_t w13_cols = 0, w2_cols = 0;  // cols_padded (row strides of w13f / w2f)
  DeviceBuffer<uint8_t> w13, s13, w2, s2;
  DeviceBuffer<kernels::ExpertMatrixPtrs> table13, table2;
  kernels::MoeGemmDims dims13, dims2;
  int64_t w2_cols_padded = 0;  // h row stride the layer would use
};

PackedExperts pack_experts(const cpu::MoeLayerReference& L) {
  PackedExperts P;
  const int E = L.shape.num_experts;
  const int64_t H = L.shape.hidden, I = L.shape.intermediate;
  std::vector<PackedMatrix> a(static_cast<size_t>(E)), b(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) {
    const auto& ex = L.experts[static_cast<size_t>(e)];
    auto pa = pack_gate_up(ex.gate, ex.up);
    auto pb = pack_matrix(ex.down);
    EXPECT_TRUE(pa.ok() && pb.ok());
    a[static_cast<size_t>(e)] = std::move(pa).value();
    b[static_cast<size_t>(e)] = std::move(pb).value();
  }
  const PackedMatrix& a0 = a[0];
  const PackedMatrix& b0 = b[0];
  P.format = a0.format;
  P.dims13 = {static_cast<int>(a0.row_tiles()), static_cast<int>(H), static_cast<int>(a0.chunks()),
              static_cast<int>(a0.groups()), a0.group_size, static_cast<int>(I)};
  P.dims2 = {static_cast<int>(b0.row_tiles()), static_cast<int>(I), static_cast<int>(b0.chunks()),
             static_cast<int>(b0.groups()), b0.group_size, static_cast<int>(H)};
  P.w13_cols = a0.cols_padded;
  P.w2_cols = b0.cols_padded;
  P.w2_cols_padded = b0.cols_padded;
  const size_t aw = a0.weight.size(), as = a0.scales.size(), bw = b0.weight.size(), bs = b0.scales.size();
  P.w13 = DeviceBuffer<uint8_t>(aw * E);
  P.s13 = DeviceBuffer<uint8_t>(std::max<size_t>(as * E, 16));
  P.w2 = DeviceBuffer<uint8_t>(bw * E);
  P.s2 = DeviceBuffer<uint8_t>(std::max<size_t>(bs * E, 16));
  std::vector<kernels::ExpertMatrixPtrs> t13(static_cast<size_t>(E)), t2(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) {
    const auto& pa = a[static_cast<size_t>(e)];
    const auto& pb = b[static_cast<size_t>(e)];
    CUDA_CHECK(cudaMemcpy(P.w13.data() + aw * e, pa.weight.data(), aw, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(P.w2.data() + bw * e, pb.weight.data(), bw, cudaMemcpyHostToDevice));
    if (as) CUDA_CHECK(cudaMemcpy(P.s13.data() + as * e, pa.scales.data(), as, cudaMemcpyHostToDevice));
    if (bs) CUDA_CHECK(cudaMemcpy(P.s2.data() + bs * e, pb.scales.data(), bs, cudaMemcpyHostToDevice));
    t13[e].weight = P.w13.data() + aw * e;
    t13[e].scales = as ? P.s13.data() + as * e : nullptr;
    t13[e].global_scale[0] = pa.global_scale[0];
    t13[e].global_scale[1] = pa.global_scale[1];
    t2[e].weight = P.w2.data() + bw * e;
    t2[e].scales = bs ? P.s2.data() + bs * e : nullptr;
    t2[e].global_scale[0] = pb.global_scale[0];
    t2[e].global_scale[1] = pb.global_scale[1];
    std::vector<float> fa(static_cast<size_t>(pa.rows_padded * pa.cols_padded));
    std::vector<float> fb(static_cast<size_t>(pb.rows_padded * pb.cols_padded));
    unpack_to_float(pa, fa.data());
    unpack_to_float(pb, fb.data());
    if (kernels::moe_gemm_wgmma_rounds_weights(to_kernel(pa.format))) {  // [TAG_INT_FOLDED_SCALE]
      for (float& v : fa) v = folded_int_weight(v);
      for (float& v : fb) v = folded_int_weight(v);
    }
    P.w13f.push_back(std::move(fa));
    P.w2f.push_back(std::move(fb));
  }
  P.table13 = DeviceBuffer<kernels::ExpertMatrixPtrs>(static_cast<size_t>(E));
  P.table2 = DeviceBuffer<kernels::ExpertMatrixPtrs>(static_cast<size_t>(E));
  P.table13.upload(t13);
  P.table2.upload(t2);
  return P;
}

// Tiles as launch_moe_align builds them (each expert's pairs in increasing order, padded with -1
// to block_m), optionally with every tile's rows reversed (live rows last), and `extra` tiles of
// -1 past the live ones.
struct HostTiles {
  std::vector<int32_t> pair_ids;     // [grid_tiles * block_m]
  std::vector<int32_t> tile_expert;  // [grid_tiles]
  int block_m = 64, grid_tiles = 0, live_tiles = 0;
};

HostTiles make_tiles(const std::vector<int32_t>& ids, int E, int block_m, bool reversed, int extra) {
  HostTiles t;
  t.block_m = block_m;
  for (int e = 0; e < E; ++e) {
    std::vector<int32_t> pairs;
    for (size_t p = 0; p < ids.size(); ++p)
      if (ids[p] == e) pairs.push_back(static_cast<int32_t>(p));
    for (size_t i = 0; i < pairs.size(); i += static_cast<size_t>(block_m)) {
      std::vector<int32_t> tile(static_cast<size_t>(block_m), -1);
      for (size_t r = 0; r < static_cast<size_t>(block_m) && i + r < pairs.size(); ++r) tile[r] = pairs[i + r];
      if (reversed) std::reverse(tile.begin(), tile.end());
      t.pair_ids.insert(t.pair_ids.end(), tile.begin(), tile.end());
      t.tile_expert.push_back(e);
    }
  }
  t.live_tiles = static_cast<int>(t.tile_expert.size());
  t.grid_tiles = t.live_tiles + extra;
  t.tile_expert.resize(static_cast<size_t>(t.grid_tiles), -1);
  t.pair_ids.resize(static_cast<size_t>(t.grid_tiles) * block_m, -1);
  return t;
}

// Routing patterns over T tokens, k distinct experts each.
enum class Routing { kUniform, kHotExpert, kSameExperts, kHalfEmpty };
const char* routing_name(Routing r) {
  switch (r) {
    case Routing::kUniform: return "uniform";
    case Routing::kHotExpert: return "hot";
    case Routing::kSameExperts: return "same-k";
    case Routing::kHalfEmpty: return "half-empty";
  }
  return "?";
}

std::vector<int32_t> make_ids(Routing r, int64_t T, int E, int k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(T * k));
  std::vector<int32_t> perm(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int j = 0; j < k; ++j) {
      int32_t e = perm[j];
      switch (r) {
        case Routing::kUniform: break;
        case Routing::kHotExpert:  // slot 0 always expert 3, the others distinct from it
          e = j == 0 ? 3 : (perm[j] == 3 ? perm[0] : perm[j]);
          break;
        case Routing::kSameExperts: e = j; break;
        case Routing::kHalfEmpty: break;  // rebuilt below
      }
      ids[static_cast<size_t>(t * k + j)] = e;
    }
  }
  if (r == Routing::kHalfEmpty) {  // k distinct even experts per token (needs k <= E / 2)
    std::vector<int32_t> even;
    for (int e = 0; e < E; e += 2) even.push_back(e);
    for (int64_t t = 0; t < T; ++t) {
      std::shuffle(even.begin(), even.end(), rng);
      for (int j = 0; j < k; ++j) ids[static_cast<size_t>(t * k + j)] = even[static_cast<size_t>(j)];
    }
  }
  return ids;
}

std::vector<uint16_t> random_bf16(size_t n, float scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = float_to_bf16_bits(d(rng));
  return v;
}

double silu_d(double v) { return v / (1.0 + std::exp(-v)); }

struct KernelCase {
  const char* name;
  WeightFormat format;
  int group;
  Geometry g;
  std::vector<int64_t> tokens;
  std::vector<int> block_ms;
  Routing routing;
};

std::string kernel_case_label(const KernelCase& c, int64_t T, int bm, bool reversed) {
  return std::string(c.name) + " " + routing_name(c.routing) + " T=" + std::to_string(T) + " bm=" +
         std::to_string(bm) + (reversed ? " reversed" : "");
}

// GEMM1 then GEMM2 (kStore) then GEMM2 (kAtomic) through the wgmma launchers on one tile set;
// every element checked.
void run_kernel_case(const KernelCase& c, PackedExperts& P, int64_t T, int bm, bool reversed) {
  const std::string label = kernel_case_label(c, T, bm, reversed);
  const int E = c.g.E, k = c.g.k;
  const int64_t H = c.g.H, I = c.g.I;
  ASSERT_EQ(H % 8, 0) << "the wgmma GEMM1 needs 16-byte aligned x rows";
  const auto ids = make_ids(c.routing, T, E, k, 1000 + T);
  const HostTiles ht = make_tiles(ids, E, bm, reversed, /*extra=*/3);
  const kernels::MoeWeightFormat kf = to_kernel(P.format);
  CudaStream stream;

  DeviceBuffer<int32_t> d_pairs(ht.pair_ids.size()), d_tile_expert(ht.tile_expert.size());
  d_pairs.upload(ht.pair_ids);
  d_tile_expert.upload(ht.tile_expert);
  kernels::MoeTiles tiles;
  tiles.padded_pair_ids = d_pairs.data();
  tiles.tile_expert = d_tile_expert.data();
  tiles.block_m = bm;
  tiles.grid_tiles = ht.grid_tiles;
  tiles.top_k = k;

  // x [T, x_stride]: 8 NaN columns past H that a correct kernel never reads.
  const int64_t x_stride = H + 8;
  std::vector<uint16_t> x(static_cast<size_t>(T * x_stride), kBf16Poison);
  const auto xv = random_bf16(static_cast<size_t>(T * H), 1.0f, 7 + T);
  for (int64_t t = 0; t < T; ++t)
    std::memcpy(&x[static_cast<size_t>(t * x_stride)], &xv[static_cast<size_t>(t * H)], 2 * H);
  DeviceBuffer<__nv_bfloat16> dx(x.size());
  dx.upload(x);

  // ---- GEMM1: h [padded, h_stride] poisoned; columns I..h_stride must stay poisoned.
  const int64_t h_stride = P.w2_cols_padded + 8;
  const int64_t padded = static_cast<int64_t>(ht.grid_tiles) * bm;
  DeviceBuffer<__nv_bfloat16> dh(static_cast<size_t>(padded * h_stride));
  dh.poison(0xFF, stream);
  kernels::MoeActivationParams act;  // SiLU
  kernels::launch_moe_gemm_wgmma_gate_up(kf, P.table13.data(), P.dims13, tiles, dx.data(), static_cast<int>(x_stride),
                                        act, dh.data(), static_cast<int>(h_stride), stream);
  CUDA_CHECK(cudaGetLastError());
  stream.sync();
  const auto h = dh.download();
  EXPECT_TRUE(dh.guards_intact()) << label;
  {
    size_t bad = 0, checked = 0;
    std::string first;
    for (int64_t pos = 0; pos < padded; ++pos) {
      const int32_t pair = ht.pair_ids[static_cast<size_t>(pos)];
      const uint16_t* hrow = reinterpret_cast<const uint16_t*>(h.data()) + pos * h_stride;
      if (pair < 0) {
        for (int64_t i = 0; i < h_stride; ++i)
          if (hrow[i] != kBf16Poison && bad++ == 0) first = "padding row " + std::to_string(pos) + " written";
        continue;
      }
      const int64_t t = pair / k;
      const int e = ids[static_cast<size_t>(pair)];
      const float* W = P.w13f[static_cast<size_t>(e)].data();
      const uint16_t* xr = &x[static_cast<size_t>(t * x_stride)];
      for (int64_t i = 0; i < I; ++i) {
        const float* wg = W + ((i / 8) * 16 + (i % 8)) * P.w13_cols;
        const float* wu = wg + 8 * P.w13_cols;
        double gs = 0, us = 0, ga = 0, ua = 0;
        for (int64_t kk = 0; kk < H; ++kk) {
          const double xv_ = bf16_bits_to_float(xr[kk]);
          gs += wg[kk] * xv_;
          us += wu[kk] * xv_;
          ga += std::fabs(wg[kk] * xv_);
          ua += std::fabs(wu[kk] * xv_);
        }
        const double ref = silu_d(gs) * us;
        const double got = bf16_bits_to_float(hrow[i]);
        const double tol = std::ldexp(std::fabs(ref), -7) + 4e-4 * (1.1 * std::fabs(us) * ga + (std::fabs(gs) + 0.3) * ua) + 1e-6;
        ++checked;
        if (!(std::fabs(got - ref) <= tol) && bad++ == 0)
          first = "pos " + std::to_string(pos) + " (pair " + std::to_string(pair) + ", expert " + std::to_string(e) +
                  ") i " + std::to_string(i) + ": got " + std::to_string(got) + " want " + std::to_string(ref);
      }
      for (int64_t i = I; i < h_stride; ++i)
        if (hrow[i] != kBf16Poison && bad++ == 0) first = "column " + std::to_string(i) + " >= I written";
    }
    EXPECT_EQ(bad, 0u) << label << " GEMM1: " << bad << " bad of " << checked << "; first: " << first;
  }
  // Rerun on a 2-block persistent grid (many work items per block: the ring and the metadata
  // buffers carry over from item to item): bit-identical.
  dh.poison(0xFF, stream);
  kernels::moe_gemm_wgmma_set_grid_cap(2);
  kernels::launch_moe_gemm_wgmma_gate_up(kf, P.table13.data(), P.dims13, tiles, dx.data(), static_cast<int>(x_stride),
                                        act, dh.data(), static_cast<int>(h_stride), stream);
  kernels::moe_gemm_wgmma_set_grid_cap(0);
  stream.sync();
  EXPECT_EQ(0, std::memcmp(h.data(), dh.download().data(), h.size() * 2)) << label << " GEMM1 rerun (2 blocks) differs";
  // The dynamic schedule (work counter): bit-identical on the full grid and on 2 blocks, twice
  // each on the same counter pair, which every launch must leave zeroed for the next.
  DeviceBuffer<int32_t> d_counter(2);
  CUDA_CHECK(cudaMemsetAsync(d_counter.data(), 0, 2 * sizeof(int32_t), stream));
  kernels::MoeTiles dyn_tiles = tiles;
  dyn_tiles.work_counter = d_counter.data();
  auto expect_counter_reset = [&](const char* what) {
    const auto c = d_counter.download();
    EXPECT_TRUE(c[0] == 0 && c[1] == 0) << label << " " << what << ": work counter left at " << c[0] << ", " << c[1];
  };
  for (int cap : {0, 2, 0, 2}) {
    dh.poison(0xFF, stream);
    kernels::moe_gemm_wgmma_set_grid_cap(cap);
    kernels::launch_moe_gemm_wgmma_gate_up(kf, P.table13.data(), P.dims13, dyn_tiles, dx.data(),
                                          static_cast<int>(x_stride), act, dh.data(), static_cast<int>(h_stride), stream);
    kernels::moe_gemm_wgmma_set_grid_cap(0);
    stream.sync();
    EXPECT_EQ(0, std::memcmp(h.data(), dh.download().data(), h.size() * 2))
        << label << " GEMM1 on the dynamic schedule (grid cap " << cap << ") differs";
    expect_counter_reset("GEMM1");
  }

  // ---- GEMM2 input: fresh h with NaN in padding rows and in columns >= I (never read).
  std::vector<uint16_t> h2(static_cast<size_t>(padded * h_stride), kBf16Poison);
  const auto hv = random_bf16(static_cast<size_t>(padded * I), 0.5f, 99 + T);
  for (int64_t pos = 0; pos < padded; ++pos)
    if (ht.pair_ids[static_cast<size_t>(pos)] >= 0)
      std::memcpy(&h2[static_cast<size_t>(pos * h_stride)], &hv[static_cast<size_t>(pos * I)], 2 * I);
  dh.upload(h2);
  // kStore: y [T*k, y_stride] fp32, 4 poisoned columns past H.
  const int64_t y_stride = H + 4;
  DeviceBuffer<float> dy(static_cast<size_t>(T * k * y_stride));
  dy.poison(0xFF, stream);
  kernels::launch_moe_gemm_wgmma_down(kf, P.table2.data(), P.dims2, tiles, dh.data(), static_cast<int>(h_stride),
                                     kernels::MoeCombineMode::kStore, dy.data(), static_cast<int>(y_stride), nullptr,
                                     nullptr, 0, stream);
  CUDA_CHECK(cudaGetLastError());
  stream.sync();
  const auto y = dy.download();
  EXPECT_TRUE(dy.guards_intact()) << label;
  // Reference y and the per-element bound; pos of each pair.
  std::vector<int64_t> pos_of(static_cast<size_t>(T * k), -1);
  for (int64_t pos = 0; pos < padded; ++pos)
    if (ht.pair_ids[static_cast<size_t>(pos)] >= 0) pos_of[static_cast<size_t>(ht.pair_ids[static_cast<size_t>(pos)])] = pos;
  std::vector<double> yref(static_cast<size_t>(T * k * H)), yabs(yref.size());
  {
    size_t bad = 0;
    std::string first;
    for (int64_t p = 0; p < T * k; ++p) {
      const int64_t pos = pos_of[static_cast<size_t>(p)];
      ASSERT_GE(pos, 0);
      const int e = ids[static_cast<size_t>(p)];
      const float* W = P.w2f[static_cast<size_t>(e)].data();
      const uint16_t* hr = &h2[static_cast<size_t>(pos * h_stride)];
      for (int64_t n = 0; n < H; ++n) {
        double s = 0, a = 0;
        for (int64_t kk = 0; kk < I; ++kk) {
          const double term = W[n * P.w2_cols + kk] * static_cast<double>(bf16_bits_to_float(hr[kk]));
          s += term;
          a += std::fabs(term);
        }
        yref[static_cast<size_t>(p * H + n)] = s;
        yabs[static_cast<size_t>(p * H + n)] = a;
        const double got = y[static_cast<size_t>(p * y_stride + n)];
        if (!(std::fabs(got - s) <= 4e-4 * a + 1e-30) && bad++ == 0)
          first = "pair " + std::to_string(p) + " (expert " + std::to_string(e) + ") n " + std::to_string(n) +
                  ": got " + std::to_string(got) + " want " + std::to_string(s);
      }
      for (int64_t n = H; n < y_stride; ++n)
        if (!std::isnan(y[static_cast<size_t>(p * y_stride + n)]) && bad++ == 0) first = "y column >= H written";
    }
    EXPECT_EQ(bad, 0u) << label << " GEMM2 kStore: first: " << first;
  }
  dy.poison(0xFF, stream);
  kernels::moe_gemm_wgmma_set_grid_cap(3);
  kernels::launch_moe_gemm_wgmma_down(kf, P.table2.data(), P.dims2, tiles, dh.data(), static_cast<int>(h_stride),
                                     kernels::MoeCombineMode::kStore, dy.data(), static_cast<int>(y_stride), nullptr,
                                     nullptr, 0, stream);
  kernels::moe_gemm_wgmma_set_grid_cap(0);
  stream.sync();
  EXPECT_EQ(0, std::memcmp(y.data(), dy.download().data(), y.size() * 4)) << label << " GEMM2 rerun (3 blocks) differs";
  for (int cap : {0, 3}) {
    dy.poison(0xFF, stream);
    kernels::moe_gemm_wgmma_set_grid_cap(cap);
    kernels::launch_moe_gemm_wgmma_down(kf, P.table2.data(), P.dims2, dyn_tiles, dh.data(), static_cast<int>(h_stride),
                                       kernels::MoeCombineMode::kStore, dy.data(), static_cast<int>(y_stride), nullptr,
                                       nullptr, 0, stream);
    kernels::moe_gemm_wgmma_set_grid_cap(0);
    stream.sync();
    EXPECT_EQ(0, std::memcmp(y.data(), dy.download().data(), y.size() * 4))
        << label << " GEMM2 on the dynamic schedule (grid cap " << cap << ") differs";
    expect_counter_reset("GEMM2");
  }

  // ---- kAtomic: out [T, H] bf16, zeroed, += bf16(w * y) per pair.
  std::vector<float> wts(static_cast<size_t>(T * k));
  std::mt19937 rng(static_cast<unsigned>(T));
  for (auto& w : wts) w = std::uniform_real_distribution<float>(0.05f, 1.0f)(rng);
  DeviceBuffer<float> dw(wts.size());
  dw.upload(wts);
  DeviceBuffer<__nv_bfloat16> dout(static_cast<size_t>(T * H));
  CUDA_CHECK(cudaMemsetAsync(dout.data(), 0, dout.bytes(), stream));
  kernels::launch_moe_gemm_wgmma_down(kf, P.table2.data(), P.dims2, tiles, dh.data(), static_cast<int>(h_stride),
                                     kernels::MoeCombineMode::kAtomic, nullptr, 0, dw.data(), dout.data(),
                                     static_cast<int>(H), stream);
  CUDA_CHECK(cudaGetLastError());
  stream.sync();
  const auto out = dout.download();
  EXPECT_TRUE(dout.guards_intact()) << label;
  {
    size_t bad = 0;
    std::string first;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < H; ++n) {
        double s = 0, a = 0, b = 0;
        for (int j = 0; j < k; ++j) {
          const size_t p = static_cast<size_t>(t * k + j);
          s += wts[p] * yref[p * H + n];
          a += std::fabs(wts[p] * yref[p * H + n]);
          b += wts[p] * yabs[p * H + n];
        }
        const double got = bf16_bits_to_float(reinterpret_cast<const uint16_t*>(out.data())[t * H + n]);
        // bf16(w * y) and k bf16 atomic adds, each rounding by <= 2^-9 of its partial sum.
        if (!(std::fabs(got - s) <= std::ldexp(a, -9) * (2 * k + 1) + 4e-4 * b + 1e-30) && bad++ == 0)
          first = "token " + std::to_string(t) + " n " + std::to_string(n) + ": got " + std::to_string(got) +
                  " want " + std::to_string(s);
      }
    EXPECT_EQ(bad, 0u) << label << " GEMM2 kAtomic: first: " << first;
  }
  std::printf("  %-56s ok\n", label.c_str());
}

class MoeWgmmaKernel : public ::testing::TestWithParam<KernelCase> {};

TEST_P(MoeWgmmaKernel, EveryElementMatchesTheDequantizedWeights) {
  MOEBIUS_REQUIRE_WGMMA();
  const KernelCase& c = GetParam();
  const cpu::MoeLayerReference L = make_layer(c.format, c.g, c.group, 41);
  PackedExperts P = pack_experts(L);
  for (int bm : c.block_ms) {
    ASSERT_TRUE(kernels::moe_gemm_wgmma_supports(to_kernel(P.format), bm));
    for (int64_t T : c.tokens) {
      run_kernel_case(c, P, T, bm, /*reversed=*/false);
      // Live rows at the end of each tile (small shapes only: the references are the cost).
      if (T >= 3 && c.g.H * c.g.I <= 256 * 128) run_kernel_case(c, P, T, bm, /*reversed=*/true);
    }
  }
}

// Small H and I keep the double-precision references fast; the last cases have the real
// Qwen3-30B-A3B matrices (H=2048, I=768: GEMM1 K=2048 over 32 stages, 6 row blocks; GEMM2 8 row
// blocks) with 8 experts, so tiles are full or more than half full.
INSTANTIATE_TEST_SUITE_P(
    MoeWgmma, MoeWgmmaKernel,
    ::testing::Values(
        KernelCase{"bf16_E8_k2", WeightFormat::kBF16, 0, {256, 128, 8, 2}, {1, 64, 300}, {64, 128}, Routing::kUniform},
        KernelCase{"nvfp4_E8_k2", WeightFormat::kNvFp4, 16, {256, 128, 8, 2}, {1, 64, 300}, {64, 128}, Routing::kUniform},
        KernelCase{"int4_E8_k2", WeightFormat::kInt4, 128, {256, 128, 8, 2}, {1, 64, 300}, {64, 128}, Routing::kUniform},
        KernelCase{"int2_E8_k2", WeightFormat::kInt2, 128, {256, 128, 8, 2}, {1, 64, 300}, {64, 128}, Routing::kUniform},
        KernelCase{"nvfp4_E128_k8", WeightFormat::kNvFp4, 16, {256, 128, 128, 8}, {3, 256}, {64, 128}, Routing::kUniform},
        KernelCase{"int4_E128_k8_hot", WeightFormat::kInt4, 128, {256, 128, 128, 8}, {200}, {64, 128}, Routing::kHotExpert},
        KernelCase{"bf16_E16_k4_same", WeightFormat::kBF16, 0, {128, 64, 16, 4}, {500}, {64, 128}, Routing::kSameExperts},
        KernelCase{"nvfp4_E16_k4_same", WeightFormat::kNvFp4, 16, {128, 64, 16, 4}, {500}, {128}, Routing::kSameExperts},
        KernelCase{"int2_E16_k4_halfempty", WeightFormat::kInt2, 64, {128, 64, 16, 4}, {300}, {64, 128}, Routing::kHalfEmpty},
        // Odd shapes: row tiles that do not fill a 256-row block, K with a partial last stage
        // (bf16 K=72: chunks of 16, one of four valid in the last stage), groups straddling
        // stages and a partial last group (int4 K=200 g=48), padded int2 chunks (K=176 in 256,
        // K=48 in 128), g=16 (a group every k-step).
        KernelCase{"bf16_H200_I72", WeightFormat::kBF16, 0, {200, 72, 8, 2}, {5, 300}, {64, 128}, Routing::kUniform},
        KernelCase{"nvfp4_H144_I80", WeightFormat::kNvFp4, 16, {144, 80, 8, 2}, {5, 300}, {64, 128}, Routing::kUniform},
        KernelCase{"int4_H200_I80_g48", WeightFormat::kInt4, 48, {200, 80, 8, 2}, {5, 300}, {64, 128}, Routing::kUniform},
        KernelCase{"int2_H176_I48_g32", WeightFormat::kInt2, 32, {176, 48, 8, 2}, {5, 300}, {64, 128}, Routing::kUniform},
        KernelCase{"int2_g16", WeightFormat::kInt2, 16, {128, 64, 8, 2}, {7, 300}, {64, 128}, Routing::kUniform},
        // Qwen3-30B-A3B: H=2048, I=768 (8 of its 128 experts: ~64-96 tokens each).
        KernelCase{"nvfp4_qwen3_30b_E8", WeightFormat::kNvFp4, 16, {2048, 768, 8, 2}, {384}, {128}, Routing::kUniform},
        KernelCase{"int4_qwen3_30b_E8", WeightFormat::kInt4, 128, {2048, 768, 8, 2}, {256}, {64, 128}, Routing::kUniform},
        KernelCase{"int2_qwen3_30b_E8", WeightFormat::kInt2, 128, {2048, 768, 8, 2}, {256}, {64}, Routing::kUniform},
        KernelCase{"bf16_qwen3_30b_E8", WeightFormat::kBF16, 0, {2048, 768, 8, 2}, {384}, {128}, Routing::kUniform}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(MoeWgmmaKernelShapes, AlignmentRule) {
  // The layer decides the GEMM1 fallback with this; x rows of H % 8 != 0 elements are unaligned.
  alignas(16) static uint16_t buf[64];
  EXPECT_TRUE(kernels::moe_gemm_wgmma_rows_aligned(buf, 2048));
  EXPECT_FALSE(kernels::moe_gemm_wgmma_rows_aligned(buf, 129));
  EXPECT_FALSE(kernels::moe_gemm_wgmma_rows_aligned(buf + 1, 2048));
  EXPECT_TRUE(kernels::moe_gemm_wgmma_supports(kernels::MoeWeightFormat::kInt2, 64));
  EXPECT_TRUE(kernels::moe_gemm_wgmma_supports(kernels::MoeWeightFormat::kInt4, 128));
  EXPECT_FALSE(kernels::moe_gemm_wgmma_supports(kernels::MoeWeightFormat::kInt2, 32));
  EXPECT_TRUE(kernels::moe_gemm_wgmma_rounds_weights(kernels::MoeWeightFormat::kInt2));
  EXPECT_FALSE(kernels::moe_gemm_wgmma_rounds_weights(kernels::MoeWeightFormat::kNvFp4));
  EXPECT_TRUE(kernels::moe_gemm_wgmma_supports(kernels::MoeWeightFormat::kNvFp4, 128));
}

// ------------------------------------------------------------------------------------------------
// 2. Layer level
// ------------------------------------------------------------------------------------------------

struct LayerCase {
  const char* name;
  WeightFormat format;
  int group;
  Geometry g;
  std::vector<int64_t> tokens;
  int block_m;  // 0: the layer's choice
};

MoeCudaOptions wgmma_options(int capacity, int block_m) {
  MoeCudaOptions opt;
  opt.capacity = capacity;
  opt.gemm_path = MoeGemmPath::kPrefillWgmma;
  opt.block_m = block_m;
  return opt;
}

class MoeWgmmaLayerGpu : public ::testing::TestWithParam<LayerCase> {};

TEST_P(MoeWgmmaLayerGpu, MatchesCpuReference) {
  MOEBIUS_REQUIRE_WGMMA();
  const auto& c = GetParam();
  const cpu::MoeLayerReference L = make_layer(c.format, c.g, c.group, 17);
  for (int64_t T : c.tokens) {
    const auto x = random_x(T, c.g.H, 100 + T);
    auto layer = MoeLayerCuda::create(L, wgmma_options(static_cast<int>(T), c.block_m));
    ASSERT_TRUE(layer.ok()) << layer.error().what();
    ASSERT_EQ((*layer)->gemm_path(), MoeGemmPath::kPrefillWgmma);
    const LayerRun r = run_gpu(**layer, x, T);
    // The experts on the GPU's own routing (the router is tested in test_moe_layer.cu).
    expect_matches_oracle(L, x, T, r.ids, r.weights, r.out,
                          std::string(c.name) + " T=" + std::to_string(T) + " " + path_label(**layer));
    // Store mode: a rerun is bit-identical.
    const LayerRun again = run_gpu(**layer, x, T);
    EXPECT_EQ(0, std::memcmp(r.out.data(), again.out.data(), r.out.size() * 2)) << c.name << " T=" << T;
  }
}

// Qwen3-30B-A3B is H=2048, I=768, E=128, k=8; these keep its E and k with smaller H and I so the
// double-precision oracle stays fast.
INSTANTIATE_TEST_SUITE_P(
    MoeWgmma, MoeWgmmaLayerGpu,
    ::testing::Values(
        LayerCase{"bf16_E128_k8", WeightFormat::kBF16, 0, {256, 128, 128, 8}, {1, 3, 64, 256, 1000, 4096}, 0},
        LayerCase{"nvfp4_E128_k8", WeightFormat::kNvFp4, 16, {256, 128, 128, 8}, {1, 3, 64, 256, 1000, 4096}, 0},
        LayerCase{"int4_E128_k8", WeightFormat::kInt4, 128, {256, 128, 128, 8}, {1, 3, 64, 256, 1000, 4096}, 0},
        LayerCase{"int2_E128_k8", WeightFormat::kInt2, 128, {256, 128, 128, 8}, {1, 3, 64, 256, 1000, 4096}, 0},
        LayerCase{"bf16_E128_k8_bm64", WeightFormat::kBF16, 0, {256, 128, 128, 8}, {1000, 4096}, 64},
        LayerCase{"nvfp4_E128_k8_bm64", WeightFormat::kNvFp4, 16, {256, 128, 128, 8}, {1000, 4096}, 64},
        LayerCase{"nvfp4_E128_k8_bm128", WeightFormat::kNvFp4, 16, {256, 128, 128, 8}, {1, 3, 64, 256}, 128},
        LayerCase{"bf16_E8_k2", WeightFormat::kBF16, 0, {128, 64, 8, 2}, {1, 3, 64, 256, 1000, 4096}, 0},
        LayerCase{"nvfp4_E8_k2", WeightFormat::kNvFp4, 16, {128, 64, 8, 2}, {1, 3, 64, 256, 1000, 4096}, 0},
        LayerCase{"int4_E8_k2", WeightFormat::kInt4, 64, {128, 64, 8, 2}, {1, 3, 64, 256, 1000, 4096}, 0},
        LayerCase{"int2_E8_k2", WeightFormat::kInt2, 64, {128, 64, 8, 2}, {1, 3, 64, 256, 1000, 4096}, 0},
        LayerCase{"nvfp4_E8_k2_bm128", WeightFormat::kNvFp4, 16, {128, 64, 8, 2}, {1, 64, 1000, 4096}, 128},
        LayerCase{"int4_E8_k2_bm128", WeightFormat::kInt4, 64, {128, 64, 8, 2}, {1, 64, 1000, 4096}, 128},
        LayerCase{"int2_E8_k2_bm128", WeightFormat::kInt2, 64, {128, 64, 8, 2}, {1, 64, 1000, 4096}, 128},
        LayerCase{"int4_E128_k8_bm64", WeightFormat::kInt4, 128, {256, 128, 128, 8}, {4096}, 64},
        LayerCase{"bf16_E8_k2_bm128", WeightFormat::kBF16, 0, {128, 64, 8, 2}, {1, 64, 1000, 4096}, 128},
        LayerCase{"nvfp4_E8_k1", WeightFormat::kNvFp4, 16, {128, 64, 8, 1}, {1, 3, 1000}, 0},
        // Odd shapes. H=129: x rows are not 16-byte aligned, so the layer copies them to an
        // aligned stride before GEMM1.
        LayerCase{"bf16_odd_H129_I67", WeightFormat::kBF16, 0, {129, 67, 16, 4}, {1, 5, 100, 1000}, 0},
        LayerCase{"bf16_H200_I72", WeightFormat::kBF16, 0, {200, 72, 16, 4}, {1, 5, 1000}, 128},
        LayerCase{"nvfp4_H144_I80", WeightFormat::kNvFp4, 16, {144, 80, 16, 4}, {1, 7, 300, 1000}, 0},
        LayerCase{"int4_H200_I80_g48", WeightFormat::kInt4, 48, {200, 80, 8, 2}, {1, 5, 300}, 0},
        LayerCase{"int2_H176_I48_g32", WeightFormat::kInt2, 32, {176, 48, 8, 2}, {1, 5, 300}, 0},
        LayerCase{"int2_g16", WeightFormat::kInt2, 16, {128, 64, 16, 4}, {7, 500}, 0},
        LayerCase{"int4_g32", WeightFormat::kInt4, 32, {128, 96, 16, 2}, {1, 33, 1000}, 0},
        // Real K: Qwen3-30B-A3B's H for GEMM1 (32 stages of 64 k), a small I.
        LayerCase{"nvfp4_H2048", WeightFormat::kNvFp4, 16, {2048, 64, 16, 2}, {1, 600}, 0},
        LayerCase{"int4_H2048", WeightFormat::kInt4, 128, {2048, 64, 16, 2}, {600}, 0},
        LayerCase{"int2_E256_k8", WeightFormat::kInt2, 128, {256, 128, 256, 8}, {1, 64, 1000}, 0}),
    [](const auto& info) { return std::string(info.param.name); });

// Skewed routing through forward_routed: every token's slot 0 on expert 3; even experts only; every
// token on the same k experts; and (k = 1) every token on one expert.
TEST(MoeWgmmaLayerRouted, SkewedAndEmptyExperts) {
  MOEBIUS_REQUIRE_WGMMA();
  for (WeightFormat f : {WeightFormat::kNvFp4, WeightFormat::kInt4, WeightFormat::kInt2, WeightFormat::kBF16}) {
    for (const Geometry& g : {Geometry{256, 128, 64, 4}, Geometry{256, 128, 16, 1}}) {
      const cpu::MoeLayerReference L = make_layer(f, g, 128, 5);
      const int64_t T = 700;
      const auto x = random_x(T, g.H, 9);
      for (int pattern = 0; pattern < 3; ++pattern) {
        if (g.k == 1 && pattern != 2) continue;
        std::vector<int32_t> ids(static_cast<size_t>(T * g.k));
        std::vector<float> w(ids.size());
        std::mt19937 rng(pattern);
        for (int64_t t = 0; t < T; ++t)
          for (int j = 0; j < g.k; ++j) {
            ids[static_cast<size_t>(t * g.k + j)] = pattern == 0   ? (j == 0 ? 3 : (3 + j * 7 + static_cast<int>(t)) % g.E)
                               : pattern == 1 ? static_cast<int32_t>((2 * (t + j * 5)) % g.E)
                                              : (g.k == 1 ? 5 : j);
            w[static_cast<size_t>(t * g.k + j)] = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
          }
        const std::vector<float> ref = oracle_out(L, x, T, ids, w);
        const char* name = pattern == 0   ? " hot expert 3"
                           : pattern == 1 ? " odd experts empty"
                           : g.k == 1     ? " all on expert 5"
                                          : " all on experts 0-3";
        for (int bm : {64, 128}) {
          if (bm == 128 && f != WeightFormat::kBF16 && f != WeightFormat::kNvFp4) continue;  // int: 64 only
          auto layer = MoeLayerCuda::create(L, wgmma_options(static_cast<int>(T), bm));
          ASSERT_TRUE(layer.ok()) << layer.error().what();
          const LayerRun r = run_gpu(**layer, x, T, ids.data(), w.data());
          expect_close_to(ref, r.out, std::string(weight_format_name(f)) + name + " " + path_label(**layer));
        }
      }
    }
  }
}

TEST(MoeWgmmaLayerDeterminism, StoreModeIsBitIdenticalAndAtomicModeIsClose) {
  MOEBIUS_REQUIRE_WGMMA();
  const Geometry g{512, 256, 128, 8};
  for (WeightFormat f : {WeightFormat::kNvFp4, WeightFormat::kInt4}) {
    const cpu::MoeLayerReference L = make_layer(f, g, 128, 3);
    for (int64_t T : {200, 1000, 4096}) {
      const auto x = random_x(T, g.H, 4);
      MoeCudaOptions opt = wgmma_options(static_cast<int>(T), 0);
      auto layer = MoeLayerCuda::create(L, opt);
      ASSERT_TRUE(layer.ok());
      const LayerRun a = run_gpu(**layer, x, T), b = run_gpu(**layer, x, T);
      const std::string label = std::string(weight_format_name(f)) + " " + path_label(**layer) + " T=" + std::to_string(T);
      const std::vector<float> ref = oracle_out(L, x, T, a.ids, a.weights);
      EXPECT_EQ(0, std::memcmp(a.out.data(), b.out.data(), a.out.size() * 2)) << "store mode must be bit-identical (" << label << ")";
      // The same on a 5-block persistent grid: the schedule does not change a bit.
      kernels::moe_gemm_wgmma_set_grid_cap(5);
      const LayerRun few = run_gpu(**layer, x, T);
      kernels::moe_gemm_wgmma_set_grid_cap(0);
      EXPECT_EQ(0, std::memcmp(a.out.data(), few.out.data(), a.out.size() * 2)) << "5-block grid differs (" << label << ")";
      expect_close_to(ref, a.out, "store " + label);
      opt.combine = kernels::MoeCombineMode::kAtomic;
      auto atomic = MoeLayerCuda::create(L, opt);
      ASSERT_TRUE(atomic.ok());
      const LayerRun c = run_gpu(**atomic, x, T);
      ASSERT_EQ(c.ids, a.ids);  // the router does not depend on the combine mode
      expect_close_to(ref, c.out, "atomic combine " + label);
    }
  }
}

// [TAG_MOE_BF16_Y] GEMM2 storing bf16 y rows (MoeCudaOptions::bf16_y): each stored value is the
// fp32 layer's value rounded once to bf16 (the same GEMM, only the read-out converts), reruns are
// bit-identical, and the output stays within the oracle's bound; at block_m 64 and 128.
TEST(MoeWgmmaLayerBf16Y, RowsAreTheFp32RowsRoundedOnce) {
  MOEBIUS_REQUIRE_WGMMA();
  const Geometry g{512, 256, 128, 8};
  for (WeightFormat f : {WeightFormat::kNvFp4, WeightFormat::kBF16}) {
    const cpu::MoeLayerReference L = make_layer(f, g, 128, 21);
    for (int64_t T : {300, 2048}) {
      const auto x = random_x(T, g.H, 22);
      MoeCudaOptions opt = wgmma_options(static_cast<int>(T), 0);
      opt.bf16_y = 0;
      auto wide = MoeLayerCuda::create(L, opt);
      opt.bf16_y = 1;
      auto narrow = MoeLayerCuda::create(L, opt);
      ASSERT_TRUE(wide.ok() && narrow.ok());
      const std::string label = std::string(weight_format_name(f)) + " " + path_label(**narrow) + " T=" + std::to_string(T);
      const size_t n = static_cast<size_t>(T) * g.k * g.H;
      const LayerRun a = run_gpu(**wide, x, T);
      std::vector<float> y32(n);
      CUDA_CHECK(cudaMemcpy(y32.data(), (*wide)->expert_outputs(), n * 4, cudaMemcpyDeviceToHost));
      const LayerRun b = run_gpu(**narrow, x, T);
      std::vector<uint16_t> y16(n);
      CUDA_CHECK(cudaMemcpy(y16.data(), (*narrow)->expert_outputs_bf16(), n * 2, cudaMemcpyDeviceToHost));
      const LayerRun b2 = run_gpu(**narrow, x, T);
      ASSERT_EQ(a.ids, b.ids) << label;  // the same routing, so the same pairs
      size_t bad = 0;
      for (size_t i = 0; i < n; ++i) bad += y16[i] != float_to_bf16_bits(y32[i]);
      EXPECT_EQ(bad, 0u) << label << ": bf16 y rows that are not the fp32 rows rounded once";
      EXPECT_EQ(0, std::memcmp(b.out.data(), b2.out.data(), b.out.size() * 2)) << "rerun differs (" << label << ")";
      expect_close_to(oracle_out(L, x, T, b.ids, b.weights), b.out, "bf16 y " + label);
    }
  }
}

// The default (MoeCudaOptions::bf16_y = -1): bf16 y rows for 128-token wgmma tiles, fp32 rows for
// 64-token tiles and the other paths (run Z6 measured it faster only at block_m 128).
TEST(MoeWgmmaLayerBf16Y, OnByDefaultForTheWideTilesOnly) {
  MOEBIUS_REQUIRE_WGMMA();
  if (std::getenv("MOEBIUS_MOE_BF16_Y") != nullptr) GTEST_SKIP() << "MOEBIUS_MOE_BF16_Y overrides the default";
  const Geometry g{512, 256, 128, 8};
  const cpu::MoeLayerReference L = make_layer(WeightFormat::kNvFp4, g, 128, 23);
  auto wide = MoeLayerCuda::create(L, wgmma_options(2048, 128));
  auto narrow = MoeLayerCuda::create(L, wgmma_options(2048, 64));
  MoeCudaOptions decode;
  decode.capacity = 1;
  auto small = MoeLayerCuda::create(L, decode);
  ASSERT_TRUE(wide.ok() && narrow.ok() && small.ok());
  EXPECT_TRUE((*wide)->bf16_y());
  EXPECT_FALSE((*narrow)->bf16_y());
  EXPECT_FALSE((*small)->bf16_y());
}

// x whose rows are not 16-byte aligned (the caller's pointer, H % 8 == 0): the layer copies x to an
// aligned stride before the wgmma GEMM1 (the int formats at block_m 128 have no mma.sync kernel to
// fall back on); the result still matches, for both tile widths.
TEST(MoeWgmmaLayerUnaligned, UnalignedXIsCopiedForGemm1) {
  MOEBIUS_REQUIRE_WGMMA();
  const Geometry g{256, 128, 16, 4};
  const int64_t T = 500;
  for (WeightFormat f : {WeightFormat::kNvFp4, WeightFormat::kInt4}) {
    const cpu::MoeLayerReference L = make_layer(f, g, f == WeightFormat::kNvFp4 ? 16 : 128, 11);
    for (int bm : {64, 128}) {
      auto layer = MoeLayerCuda::create(L, wgmma_options(static_cast<int>(T), bm));
      ASSERT_TRUE(layer.ok()) << layer.error().what();
      const auto x = random_x(T, g.H, 12);
      CudaStream stream;
      DeviceBuffer<__nv_bfloat16> dx(static_cast<size_t>(T * g.H + 8)), dout(static_cast<size_t>(T * g.H));
      DeviceBuffer<int32_t> dn(1);
      CUDA_CHECK(cudaMemcpy(dx.data() + 1, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
      const int32_t n = static_cast<int32_t>(T);
      CUDA_CHECK(cudaMemcpy(dn.data(), &n, 4, cudaMemcpyHostToDevice));
      dout.poison(0xFF, stream);
      (*layer)->forward(dx.data() + 1, dn.data(), dout.data(), stream);
      stream.sync();
      std::vector<uint16_t> out(static_cast<size_t>(T * g.H));
      CUDA_CHECK(cudaMemcpy(out.data(), dout.data(), out.size() * 2, cudaMemcpyDeviceToHost));
      std::vector<int32_t> ids(static_cast<size_t>(T * g.k));
      std::vector<float> w(ids.size());
      CUDA_CHECK(cudaMemcpy(ids.data(), (*layer)->topk_ids(), 4 * ids.size(), cudaMemcpyDeviceToHost));
      CUDA_CHECK(cudaMemcpy(w.data(), (*layer)->topk_weights(), 4 * ids.size(), cudaMemcpyDeviceToHost));
      expect_matches_oracle(L, x, T, ids, w, out,
                            std::string(weight_format_name(f)) + " unaligned x bm " + std::to_string(bm) + " " +
                                path_label(**layer));
    }
  }
}

TEST(MoeWgmmaLayerGraph, OneCaptureServesEveryTokenCount) {
  MOEBIUS_REQUIRE_WGMMA();
  const Geometry g{256, 128, 128, 8};
  for (WeightFormat f : {WeightFormat::kInt4, WeightFormat::kNvFp4}) {
    const cpu::MoeLayerReference L = make_layer(f, g, 128, 8);
    const int cap = 2048;  // 128 tokens per expert: nvfp4 takes 128-token tiles
    auto layer = MoeLayerCuda::create(L, wgmma_options(cap, 0));
    ASSERT_TRUE(layer.ok());
    const auto x = random_x(cap, g.H, 12);
    replay_one_graph_per_token_count(**layer, x, {2048, 1, 777, 64, 3}, [&](int32_t T, const std::vector<uint16_t>& live) {
      expect_last_forward_matches_oracle(L, **layer, x, T, live,
                                         std::string(weight_format_name(f)) + " graph replay T=" + std::to_string(T) +
                                             " " + path_label(**layer));
    });
  }
}

// kAuto in the prefill regime takes wgmma here, with 128-token tiles from 128 tokens per expert
// (every format); an explicit request on a machine without the kernels is an error, not a silent
// fallback, and so is a block_m the kernels do not have.
TEST(MoeWgmmaLayerPath, AutoTakesWgmmaAndExplicitRequestIsChecked) {
  MOEBIUS_REQUIRE_GPU();
  const Geometry g{256, 128, 128, 8};
  const cpu::MoeLayerReference L = make_layer(WeightFormat::kNvFp4, g, 16, 21);
  MoeCudaOptions opt;
  opt.capacity = 4096;
  auto big = MoeLayerCuda::create(L, opt);
  ASSERT_TRUE(big.ok());
  auto wg = MoeLayerCuda::create(L, wgmma_options(4096, 0));
  if (!kernels::moe_gemm_wgmma_available()) {
    EXPECT_EQ((*big)->gemm_path(), MoeGemmPath::kPrefill);
    EXPECT_FALSE(wg.ok());
    return;
  }
  EXPECT_EQ((*big)->gemm_path(), MoeGemmPath::kPrefillWgmma);
  EXPECT_EQ((*big)->block_m(), 128);
  ASSERT_TRUE(wg.ok());
  EXPECT_EQ((*wg)->block_m(), 128);
  auto int4 = MoeLayerCuda::create(make_layer(WeightFormat::kInt4, g, 128, 22), wgmma_options(4096, 0));
  ASSERT_TRUE(int4.ok());
  EXPECT_EQ((*int4)->block_m(), 128);  // [TAG_INT_FOLDED_SCALE]
  auto bad = MoeLayerCuda::create(make_layer(WeightFormat::kInt4, g, 128, 22), wgmma_options(4096, 32));
  EXPECT_FALSE(bad.ok());  // the wgmma kernels take 64- and 128-token tiles
}

}  // namespace
}  // namespace moebius::moe
