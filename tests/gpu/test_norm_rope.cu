// RMSNorm (src/kernels/norm.cu) and the fused QK-norm + RoPE + KV-cache write (src/kernels/rope.cu)
// against the CPU references cpu::rms_norm_reference and cpu::rope_neox_reference, on random bf16
// inputs with fixed seeds. Outputs are poisoned, rows past T must stay poisoned, cache slots not in
// the slot mapping must keep their poison, and guard bands must stay intact.
//
// Tolerances: the kernels compute in fp32 and round to bf16 once; the references compute in fp32
// (sums of squares in double). An output may differ from bf16(reference) by one bf16 ulp where the
// fp32 value sits near a rounding boundary, so elementwise |got - want| <= 2^-7 |want| + 1e-6
// (one bf16 ulp is at most 2^-7 relative), and nmse <= 1e-5 over the whole output.
// The residual stream of the fused add is checked the same way (bf16) or to 1e-6 relative (fp32).
//
// Shapes: Qwen3-30B-A3B H=2048, nh=32, nkv=4, hd=128, rope_theta=1e6, eps=1e-6; Qwen3-235B-A22B
// H=4096; the tiny fixture H=64, nh=4, nkv=2, hd=16.
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
#include "cpu/norm.h"
#include "cpu/rope.h"
#include "kernels/kv_cache.cuh"
#include "kernels/norm.cuh"
#include "kernels/rope.cuh"

namespace moebius {
namespace {

using testing::all_close;
using testing::bytes_are;
using testing::CudaStream;
using testing::DeviceBuffer;

constexpr double kRel = 1.0 / 128, kAbs = 1e-6, kMaxNmse = 1e-5;
constexpr uint8_t kPoison = 0xFF;
constexpr float kEps = 1e-6f;

float bf16_round(float x) { return static_cast<float>(bf16(x)); }

std::vector<float> random_bf16_values(size_t n, float lo, float hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = bf16_round(u(rng));
  return v;
}

template <typename T>
std::vector<T> convert(const std::vector<float>& v) {
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    if constexpr (sizeof(T) == 2) {
      const bf16 b(v[i]);
      std::memcpy(&out[i], &b, 2);
    } else {
      out[i] = v[i];
    }
  }
  return out;
}

std::vector<float> to_float(const std::vector<__nv_bfloat16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}
std::vector<float> to_float(const std::vector<float>& v) { return v; }

// ------------------------------------------------------------------------------------------------
// RMSNorm
// ------------------------------------------------------------------------------------------------

// X: residual / input type, W: weight type. add: the fused residual add.
template <typename X, typename W>
void check_norm(int T, int H, bool add, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "T=" << T << " H=" << H << " add=" << add << " x=" << (sizeof(X) == 2 ? "bf16" : "fp32")
                                    << " w=" << (sizeof(W) == 2 ? "bf16" : "fp32"));
  constexpr int kSlack = 3;  // rows past T: must stay untouched
  const size_t n = static_cast<size_t>(T) * H, cap = static_cast<size_t>(T + kSlack) * H;
  std::vector<float> x = random_bf16_values(cap, -3.0f, 3.0f, seed);  // bf16 values: exact in either X
  const std::vector<float> y = random_bf16_values(cap, -1.0f, 1.0f, seed + 1);
  const std::vector<float> w = random_bf16_values(static_cast<size_t>(H), 0.5f, 1.5f, seed + 2);

  CudaStream stream;
  DeviceBuffer<X> d_x(cap);
  DeviceBuffer<__nv_bfloat16> d_y(cap), d_out(cap);
  DeviceBuffer<W> d_w(static_cast<size_t>(H));
  d_x.upload(convert<X>(x));
  d_y.upload(convert<__nv_bfloat16>(y));
  d_w.upload(convert<W>(w));
  d_out.poison(kPoison, stream);
  if (add)
    kernels::launch_add_rms_norm<X, W>(d_x.data(), d_y.data(), d_w.data(), T, H, kEps, d_out.data(), stream);
  else
    kernels::launch_rms_norm<X, W>(d_x.data(), d_w.data(), T, H, kEps, d_out.data(), stream);
  stream.sync();

  // Reference: x (+ y, rounded like the residual's type), then the norm in fp32/double.
  std::vector<float> want_x(x.begin(), x.begin() + static_cast<int64_t>(n));
  if (add)
    for (size_t i = 0; i < n; ++i) want_x[i] = sizeof(X) == 2 ? bf16_round(x[i] + y[i]) : x[i] + y[i];
  std::vector<float> want(n);
  cpu::rms_norm_reference(want_x.data(), w.data(), T, H, kEps, want.data());
  for (float& v : want) v = bf16_round(v);

  const std::vector<__nv_bfloat16> raw = d_out.download();
  const std::vector<float> got = to_float(raw);
  EXPECT_TRUE(all_close(got.data(), want.data(), n, kRel, kAbs)) << "out";
  EXPECT_LE(testing::nmse(got.data(), want.data(), n), kMaxNmse);
  EXPECT_TRUE(bytes_are(raw.data() + n, cap - n, kPoison)) << "out rows past T";
  const std::vector<float> got_x = to_float(d_x.download());
  EXPECT_TRUE(all_close(got_x.data(), want_x.data(), n, sizeof(X) == 2 ? 0.0 : 1e-6, 0.0)) << "residual x";
  EXPECT_TRUE(std::equal(got_x.begin() + static_cast<int64_t>(n), got_x.end(), x.begin() + static_cast<int64_t>(n)))
      << "residual rows past T";
  EXPECT_TRUE(d_x.guards_intact() && d_out.guards_intact());
}

TEST(NormGpu, RmsNormMatchesCpu) {
  MOEBIUS_REQUIRE_GPU();
  // H: tiny fixture 64, Qwen3-30B-A3B 2048, Qwen3-235B-A22B 4096, and 8 / 2056 (odd chunk counts);
  // 6144 and 8192 (3 and 4 register chunks per thread), 8200 and 12288 (past the register path:
  // the looping kernel).
  for (int H : {8, 64, 2048, 2056, 4096, 6144, 8192, 8200, 12288})
    for (int T : {1, 7, 1000}) {
      const uint32_t seed = 7u * H + T;
      check_norm<__nv_bfloat16, __nv_bfloat16>(T, H, false, seed);
      check_norm<__nv_bfloat16, float>(T, H, false, seed + 3);
      check_norm<float, float>(T, H, false, seed + 5);
    }
}

TEST(NormGpu, FusedResidualAddMatchesCpu) {
  MOEBIUS_REQUIRE_GPU();
  for (int H : {64, 2048, 2056, 4096, 6144, 12288})
    for (int T : {1, 7, 1000}) {
      const uint32_t seed = 11u * H + T;
      check_norm<float, __nv_bfloat16>(T, H, true, seed);  // fp32 residual: the CPU backend's math
      check_norm<float, float>(T, H, true, seed + 3);
      check_norm<__nv_bfloat16, __nv_bfloat16>(T, H, true, seed + 5);  // bf16 residual (vLLM)
      check_norm<__nv_bfloat16, float>(T, H, true, seed + 7);
    }
}

// ------------------------------------------------------------------------------------------------
// QK-norm + RoPE + KV write
// ------------------------------------------------------------------------------------------------

struct RopeShape {
  const char* name;
  int nh, nkv, hd;
  double theta;
};

void check_qk_norm_rope_kv(const RopeShape& s, int T, bool with_norm, int block_size, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << s.name << " T=" << T << " norm=" << with_norm << " bs=" << block_size);
  const int nh = s.nh, nkv = s.nkv, hd = s.hd;
  const int64_t stride = int64_t{nh + 2 * nkv} * hd;  // one fused QKV row
  constexpr int kSlack = 2;
  const int cap = T + kSlack;
  std::mt19937 rng(seed);
  const std::vector<float> qkv = random_bf16_values(static_cast<size_t>(cap) * stride, -2.0f, 2.0f, seed);
  const std::vector<float> qn = random_bf16_values(static_cast<size_t>(hd), 0.5f, 1.5f, seed + 1);
  const std::vector<float> kn = random_bf16_values(static_cast<size_t>(hd), 0.5f, 1.5f, seed + 2);
  const std::vector<float> inv_freq = cpu::rope_inv_freq(s.theta, hd);
  // Positions: small, and up to 40960 (Qwen3's max_position_embeddings) where fp32 angle rounding
  // matters. Slots: a shuffled pool with room to spare; every 5th token is padding (slot -1).
  std::vector<int32_t> pos(static_cast<size_t>(cap)), slot(static_cast<size_t>(cap), -1);
  const int num_blocks = (T + block_size - 1) / block_size + 2;
  std::vector<int32_t> free_slots(static_cast<size_t>(num_blocks) * block_size);
  std::iota(free_slots.begin(), free_slots.end(), 0);
  std::shuffle(free_slots.begin(), free_slots.end(), rng);
  for (int t = 0; t < T; ++t) {
    pos[t] = t % 3 == 0 ? static_cast<int32_t>(rng() % 40960) : t;
    slot[t] = t % 5 == 4 ? -1 : free_slots[t];
  }

  CudaStream stream;
  DeviceBuffer<__nv_bfloat16> d_qkv(qkv.size());
  d_qkv.upload(convert<__nv_bfloat16>(qkv));
  DeviceBuffer<float> d_qn(qn.size()), d_kn(kn.size()), d_freq(inv_freq.size());
  d_qn.upload(qn);
  d_kn.upload(kn);
  d_freq.upload(inv_freq);
  DeviceBuffer<int32_t> d_pos(pos.size()), d_slot(slot.size());
  d_pos.upload(pos);
  d_slot.upload(slot);
  const size_t pool = static_cast<size_t>(kernels::kv_cache_pool_elems(num_blocks, nkv, block_size, hd));
  DeviceBuffer<__nv_bfloat16> d_kc(pool), d_vc(pool);
  d_kc.poison(kPoison, stream);
  d_vc.poison(kPoison, stream);
  __nv_bfloat16* q = d_qkv.data();
  kernels::launch_qk_norm_rope_kv(q, stride, q + int64_t{nh} * hd, stride, q + int64_t{nh + nkv} * hd, stride,
                                  with_norm ? d_qn.data() : nullptr, with_norm ? d_kn.data() : nullptr, d_pos.data(),
                                  d_freq.data(), d_slot.data(), d_kc.data(), d_vc.data(), T, nh, nkv, hd, block_size,
                                  kEps, stream);
  stream.sync();

  // Reference on [T, heads, hd] copies.
  std::vector<float> rq(static_cast<size_t>(T) * nh * hd), rk(static_cast<size_t>(T) * nkv * hd), rv(rk.size());
  for (int t = 0; t < T; ++t) {
    const float* row = qkv.data() + t * stride;
    std::copy_n(row, nh * hd, rq.begin() + static_cast<int64_t>(t) * nh * hd);
    std::copy_n(row + nh * hd, nkv * hd, rk.begin() + static_cast<int64_t>(t) * nkv * hd);
    std::copy_n(row + (nh + nkv) * hd, nkv * hd, rv.begin() + static_cast<int64_t>(t) * nkv * hd);
  }
  if (with_norm) {
    cpu::rms_norm_reference(rq.data(), qn.data(), int64_t{T} * nh, hd, kEps, rq.data());
    cpu::rms_norm_reference(rk.data(), kn.data(), int64_t{T} * nkv, hd, kEps, rk.data());
  }
  const std::vector<int64_t> pos64(pos.begin(), pos.begin() + T);
  cpu::rope_neox_reference(rq.data(), T, nh, hd, pos64.data(), inv_freq.data());
  cpu::rope_neox_reference(rk.data(), T, nkv, hd, pos64.data(), inv_freq.data());
  for (float& x : rq) x = bf16_round(x);
  for (float& x : rk) x = bf16_round(x);

  // q: in place in the fused buffer; k and v columns untouched; rows past T untouched.
  const std::vector<float> got = to_float(d_qkv.download());
  std::vector<float> got_q(rq.size());
  for (int t = 0; t < T; ++t)
    std::copy_n(got.begin() + t * stride, nh * hd, got_q.begin() + static_cast<int64_t>(t) * nh * hd);
  EXPECT_TRUE(all_close(got_q.data(), rq.data(), rq.size(), kRel, kAbs)) << "q";
  EXPECT_LE(testing::nmse(got_q.data(), rq.data(), rq.size()), kMaxNmse) << "q";
  bool kv_untouched = true;
  for (int t = 0; t < cap; ++t)
    for (int64_t i = (t < T ? int64_t{nh} * hd : 0); i < stride; ++i)
      kv_untouched &= got[static_cast<size_t>(t * stride + i)] == qkv[static_cast<size_t>(t * stride + i)];
  EXPECT_TRUE(kv_untouched) << "k/v inputs or rows past T were modified";

  // Cache: written slots hold k / v; every other slot keeps its poison.
  const std::vector<__nv_bfloat16> kc_raw = d_kc.download(), vc_raw = d_vc.download();
  std::vector<float> got_k, want_k, got_v, want_v;
  std::vector<char> written(pool, 0);
  for (int t = 0; t < T; ++t) {
    if (slot[t] < 0) continue;
    for (int h = 0; h < nkv; ++h) {
      const int64_t off = kernels::kv_cache_offset(slot[t] / block_size, h, slot[t] % block_size, nkv, block_size, hd);
      for (int i = 0; i < hd; ++i) {
        written[static_cast<size_t>(off + i)] = 1;
        got_k.push_back(__bfloat162float(kc_raw[static_cast<size_t>(off + i)]));
        got_v.push_back(__bfloat162float(vc_raw[static_cast<size_t>(off + i)]));
        want_k.push_back(rk[static_cast<size_t>((int64_t{t} * nkv + h) * hd + i)]);
        want_v.push_back(rv[static_cast<size_t>((int64_t{t} * nkv + h) * hd + i)]);
      }
    }
  }
  EXPECT_TRUE(all_close(got_k.data(), want_k.data(), got_k.size(), kRel, kAbs)) << "k cache";
  EXPECT_LE(testing::nmse(got_k.data(), want_k.data(), got_k.size()), kMaxNmse) << "k cache";
  EXPECT_TRUE(std::equal(got_v.begin(), got_v.end(), want_v.begin())) << "v cache (a copy: exact)";
  bool others_poisoned = true;
  for (size_t i = 0; i < pool; ++i) {
    uint16_t kb, vb;
    std::memcpy(&kb, &kc_raw[i], 2);
    std::memcpy(&vb, &vc_raw[i], 2);
    if (!written[i]) others_poisoned &= kb == 0xFFFF && vb == 0xFFFF;
  }
  EXPECT_TRUE(others_poisoned) << "a cache slot outside the slot mapping was written";
  EXPECT_TRUE(d_qkv.guards_intact() && d_kc.guards_intact() && d_vc.guards_intact());
}

TEST(RopeGpu, QkNormRopeKvMatchesCpu) {
  MOEBIUS_REQUIRE_GPU();
  const RopeShape shapes[] = {
      {"Qwen3-30B-A3B", 32, 4, 128, 1e6},  // Qwen3-30B-A3B
      {"tiny-qwen3-moe", 4, 2, 16, 1e6},   // tests/data/tiny-qwen3-moe
      {"hd64", 16, 2, 64, 1e4},
      {"hd256", 8, 1, 256, 1e4},
  };
  for (const RopeShape& s : shapes)
    for (int T : {1, 7, 63, 1000})
      for (bool norm : {true, false}) check_qk_norm_rope_kv(s, T, norm, 16, 17u * T + s.hd + norm);
  check_qk_norm_rope_kv(shapes[0], 100, true, 7, 5);  // odd block size
  check_qk_norm_rope_kv(shapes[0], 100, true, 1, 6);
}

}  // namespace
}  // namespace moebius
