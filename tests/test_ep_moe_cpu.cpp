// Expert parallelism on the CPU backend (threads as ranks over the in-process communicator): the
// EP MoE layer and the EP model on the tiny fixture against the single-process results. With an
// fp32 payload every rank's output is bit-identical to the single-process layer/model; with the
// bf16 payload (the GPU wire format) EP = 2 and 4 are bit-identical to EP = 1.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <random>

#include "core/dtype.h"
#include "cpu/ep_pack.h"
#include "model/generate.h"
#include "model/qwen3_moe_cpu.h"
#include "moe/ep_moe_cpu.h"
#include "parallel/in_process_communicator.h"
#include "server/step_runner.h"
#include "tiny_fixture.h"

namespace moebius::moe {
namespace {

using parallel::Communicator;

// Qwen3-MoE-like toy layer: H=64, I=32, E=16, k=4, experts in `format`.
cpu::MoeLayerReference random_layer(WeightFormat format, uint32_t seed) {
  cpu::MoeLayerReference m;
  const int64_t H = 64, I = 32;
  const int E = 16, k = 4;
  m.shape = cpu::MoeShape{H, I, E, k};
  m.router.num_experts = E;
  m.router.top_k = k;
  m.router.renormalize = true;
  m.options.round_intermediate_to_bf16 = true;
  m.router_weight = testing::random_normal(E * H, seed, 0.5f);
  const int group = format == WeightFormat::kNvFp4 ? 16 : is_int_format(format) ? 32 : 0;
  for (int e = 0; e < E; ++e) {
    auto mk = [&](int64_t r, int64_t c, uint32_t s) {
      auto w = testing::random_normal(r * c, s, 0.2f);
      auto q = quantize(format, w.data(), r, c, group);
      EXPECT_TRUE(q.ok()) << q.error().what();
      return std::move(q).value();
    };
    m.experts.push_back({mk(I, H, seed + 3 * e + 1), mk(I, H, seed + 3 * e + 2), mk(H, I, seed + 3 * e + 3)});
  }
  EXPECT_TRUE(m.validate().ok());
  return m;
}

// The layer as rank `rank` of `size` holds it: the full router, its own experts.
cpu::MoeLayerReference local_layer(const cpu::MoeLayerReference& full, int size, int rank) {
  cpu::MoeLayerReference m = full;
  const auto r = parallel::expert_range(full.shape.num_experts, size, rank);
  m.experts.assign(full.experts.begin() + r.begin, full.experts.begin() + r.end);
  return m;
}

// Tokens per rank: zero-token ranks and very uneven counts.
std::vector<int64_t> token_split(int size) {
  switch (size) {
    case 1: return {96};
    case 2: return {0, 96};
    case 4: return {1, 0, 88, 7};
    default: return {};
  }
}

// Runs the EP layer over `size` thread ranks; rank r's tokens are rows [off_r, off_r + T_r) of x.
std::vector<float> run_ep_layer(const cpu::MoeLayerReference& full, int size, EpPayload payload,
                                const std::vector<float>& x) {
  const int64_t H = full.shape.hidden;
  const auto split = token_split(size);
  std::vector<float> out(x.size(), std::nanf(""));
  auto st = parallel::run_ranks(size, [&](Communicator& c) -> Status {
    int64_t off = 0;
    for (int r = 0; r < c.rank(); ++r) off += split[static_cast<size_t>(r)];
    const int64_t T = split[static_cast<size_t>(c.rank())];
    const cpu::MoeLayerReference mine = local_layer(full, size, c.rank());
    for (int rep = 0; rep < 2; ++rep)  // two steps: nothing carries over between them
      MOEBIUS_TRY(ep_moe_layer_cpu(c, mine, payload, x.data() + off * H, T, out.data() + off * H));
    return Ok{};
  });
  for (auto& s : st) EXPECT_TRUE(s.ok()) << s.error().what();
  return out;
}

TEST(EpMoeCpu, EveryRankCountEqualsTheSingleProcessLayerBitExactly) {
  for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kNvFp4, WeightFormat::kInt4}) {
    const cpu::MoeLayerReference full = random_layer(f, 11);
    const auto x = testing::random_normal(96 * 64, 5);
    std::vector<float> want(x.size());
    ASSERT_TRUE(full.forward(x.data(), 96, want.data()).ok());
    for (int n : {1, 2, 4}) {
      const auto got = run_ep_layer(full, n, EpPayload::kF32, x);
      EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * 4)) << weight_format_name(f) << " EP=" << n;
    }
  }
}

TEST(EpMoeCpu, Bf16PayloadEp2AndEp4EqualEp1BitExactly) {
  const cpu::MoeLayerReference full = random_layer(WeightFormat::kNvFp4, 21);
  const auto x = testing::random_normal(96 * 64, 9);
  const auto ep1 = run_ep_layer(full, 1, EpPayload::kBF16, x);
  for (int n : {2, 4}) {
    const auto got = run_ep_layer(full, n, EpPayload::kBF16, x);
    EXPECT_EQ(0, std::memcmp(got.data(), ep1.data(), ep1.size() * 4)) << "EP=" << n;
  }
  // And close to the fp32 layer: only the input rows were rounded to bf16.
  std::vector<float> f32(x.size());
  ASSERT_TRUE(full.forward(x.data(), 96, f32.data()).ok());
  double num = 0, den = 0;
  for (size_t i = 0; i < f32.size(); ++i) {
    num += (ep1[i] - f32[i]) * double(ep1[i] - f32[i]);
    den += double(f32[i]) * f32[i];
  }
  EXPECT_LT(num / den, 1e-4);
}

TEST(EpMoeCpu, SkewedRoutingAllToOneRank) {
  // Every pair of every rank goes to experts 12..15 (rank 3 of 4): ranks 0-2 serve nothing, rank
  // 3 serves all 4 * T * k pairs.
  const cpu::MoeLayerReference full = random_layer(WeightFormat::kBF16, 31);
  const int64_t T = 9, H = 64;
  const int k = 4, N = 4;
  const auto x = testing::random_normal(N * T * H, 2);
  std::vector<int32_t> ids(static_cast<size_t>(N * T * k));
  std::vector<float> w(ids.size());
  std::mt19937 rng(3);
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = 12 + static_cast<int32_t>(i % 4);
    w[i] = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
  }
  std::vector<float> want(x.size()), got(x.size());
  ASSERT_TRUE(cpu::moe_experts_reference(full.shape, full.experts, full.options, x.data(), N * T, ids.data(), w.data(),
                                         want.data())
                  .ok());
  auto st = parallel::run_ranks(N, [&](Communicator& c) -> Status {
    const int64_t off = c.rank() * T;
    const auto mine = local_layer(full, N, c.rank());
    return ep_moe_experts_cpu(c, full.shape, mine.experts, full.options, EpPayload::kF32, x.data() + off * H, T,
                              ids.data() + off * k, w.data() + off * k, got.data() + off * H);
  });
  for (auto& s : st) ASSERT_TRUE(s.ok()) << s.error().what();
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * 4));
}

// The GPU layer's capacity-padded protocol ([TAG_EP_CAPACITY_SLOTS], the CPU references of its
// kernels) over threads as ranks: fixed-size all-to-alls of `slots` rows per peer, compaction,
// local experts, return, unpack, combine. Must equal ep_moe_experts_cpu with the bf16 payload
// bit for bit (same rows, same expert arithmetic, same fp32 combine).
Status padded_protocol_rank(Communicator& c, const cpu::MoeLayerReference& full, int64_t capacity, const float* x,
                            int64_t T, const int32_t* ids, const float* w, float* out) {
  const int N = c.size(), me = c.rank(), k = full.shape.top_k, E = full.shape.num_experts;
  const int64_t H = full.shape.hidden, slots = capacity * k, region = slots * H;
  const auto mine = local_layer(full, N, me);
  std::vector<uint16_t> xb(static_cast<size_t>(T * H));
  for (size_t i = 0; i < xb.size(); ++i) xb[i] = float_to_bf16_bits(x[i]);
  std::vector<int32_t> send_pos(static_cast<size_t>(slots)), send_counts(static_cast<size_t>(N)),
      send_meta(static_cast<size_t>(N * slots), -7), counts(static_cast<size_t>(N * N));
  cpu::ep_plan_reference(ids, T, k, E, N, slots, send_pos.data(), send_counts.data(), send_meta.data());
  std::vector<uint16_t> send_x(static_cast<size_t>(N * region), 0xFFFF), recv_x(send_x.size());
  cpu::ep_pack_rows_reference(xb.data(), T, H, k, ids, E, N, send_pos.data(), slots, send_x.data());
  MOEBIUS_TRY(c.all_gather(send_counts.data(), counts.data(), static_cast<size_t>(N) * 4));
  std::vector<size_t> xb_sz(static_cast<size_t>(N), static_cast<size_t>(region) * 2), xb_off(xb_sz.size());
  std::vector<size_t> mb_sz(xb_sz.size(), static_cast<size_t>(slots) * 4), mb_off(xb_sz.size());
  std::vector<size_t> yb_sz(xb_sz.size(), static_cast<size_t>(region) * 4), yb_off(xb_sz.size());
  for (int r = 0; r < N; ++r) {
    xb_off[static_cast<size_t>(r)] = static_cast<size_t>(r) * xb_sz[0];
    mb_off[static_cast<size_t>(r)] = static_cast<size_t>(r) * mb_sz[0];
    yb_off[static_cast<size_t>(r)] = static_cast<size_t>(r) * yb_sz[0];
  }
  std::vector<int32_t> recv_meta(send_meta.size());
  MOEBIUS_TRY(c.all_to_all_v(send_x.data(), xb_sz, xb_off, recv_x.data(), xb_sz, xb_off));
  MOEBIUS_TRY(c.all_to_all_v(send_meta.data(), mb_sz, mb_off, recv_meta.data(), mb_sz, mb_off));
  std::vector<uint16_t> x_local(static_cast<size_t>(N * region));
  std::vector<int32_t> local_ids(static_cast<size_t>(N * slots));
  int32_t R = -1;
  cpu::ep_compact_reference(recv_x.data(), recv_meta.data(), counts.data(), me, N, slots, H, x_local.data(),
                            local_ids.data(), &R);
  std::vector<float> xf(static_cast<size_t>(R * H)), ones(static_cast<size_t>(R), 1.0f),
      y_local(static_cast<size_t>(N * region));
  for (size_t i = 0; i < xf.size(); ++i) xf[i] = bf16_bits_to_float(x_local[i]);
  if (R > 0) {
    const cpu::MoeShape ls{H, full.shape.intermediate, E / N, 1};
    MOEBIUS_TRY(cpu::moe_experts_reference(ls, mine.experts, full.options, xf.data(), R, local_ids.data(), ones.data(),
                                           y_local.data()));
  }
  std::vector<float> ret_send(static_cast<size_t>(N * region), std::nanf("")), ret_recv(ret_send.size());
  cpu::ep_return_pack_reference(y_local.data(), counts.data(), me, N, slots, H, ret_send.data());
  MOEBIUS_TRY(c.all_to_all_v(ret_send.data(), yb_sz, yb_off, ret_recv.data(), yb_sz, yb_off));
  std::vector<float> y_pairs(static_cast<size_t>(region));
  cpu::ep_unpack_return_reference(ret_recv.data(), ids, send_pos.data(), T, k, E, N, slots, H, y_pairs.data());
  for (int64_t t = 0; t < T; ++t) {
    float* o = out + t * H;
    for (int64_t h = 0; h < H; ++h) o[h] = 0.0f;
    for (int s = 0; s < k; ++s)
      for (int64_t h = 0; h < H; ++h) o[h] += w[t * k + s] * y_pairs[static_cast<size_t>((t * k + s) * H + h)];
  }
  return Ok{};
}

TEST(EpMoeCpu, CapacityPaddedProtocolEqualsTheVariableOne) {
  const cpu::MoeLayerReference full = random_layer(WeightFormat::kNvFp4, 51);
  const int64_t H = 64, cap = 40;
  const int k = 4;
  for (int n : {1, 2, 4}) {
    const auto split = n == 1 ? std::vector<int64_t>{40} : n == 2 ? std::vector<int64_t>{0, 40}
                                                                  : std::vector<int64_t>{3, 0, 40, 1};
    int64_t total = 0;
    for (auto t : split) total += t;
    const auto x = testing::random_normal(total * H, 77);
    // Routing: the layer's router, then skewed below.
    std::vector<float> logits(static_cast<size_t>(total * 16));
    cpu::router_logits_reference(full.router_weight.data(), x.data(), total, H, 16, logits.data());
    std::vector<int32_t> ids(static_cast<size_t>(total * k));
    std::vector<float> w(ids.size());
    ASSERT_TRUE(cpu::route_reference(full.router, logits.data(), total, ids.data(), w.data()).ok());
    // The 40-token rank sends every pair to experts 12..15 (the last rank): one peer region full.
    int64_t big = 0;
    for (size_t r = 0; split[r] != 40; ++r) big += split[r];
    for (int64_t p = big * k; p < (big + 40) * k; ++p) ids[static_cast<size_t>(p)] = 15 - static_cast<int32_t>(p % k);
    std::vector<float> want(x.size()), got(x.size());
    auto st = parallel::run_ranks(n, [&](Communicator& c) -> Status {
      int64_t off = 0;
      for (int r = 0; r < c.rank(); ++r) off += split[static_cast<size_t>(r)];
      const int64_t T = split[static_cast<size_t>(c.rank())];
      const auto mine = local_layer(full, n, c.rank());
      MOEBIUS_TRY(ep_moe_experts_cpu(c, full.shape, mine.experts, full.options, EpPayload::kBF16, x.data() + off * H,
                                     T, ids.data() + off * k, w.data() + off * k, want.data() + off * H));
      return padded_protocol_rank(c, full, cap, x.data() + off * H, T, ids.data() + off * k, w.data() + off * k,
                                  got.data() + off * H);
    });
    for (auto& s : st) ASSERT_TRUE(s.ok()) << s.error().what();
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * 4)) << "EP=" << n;
  }
}

TEST(EpMoeCpu, ExpertsThatDoNotSplitAreRefused) {
  cpu::MoeLayerReference full = random_layer(WeightFormat::kBF16, 41);
  auto st = parallel::run_ranks(3, [&](Communicator& c) -> Status {
    float x[64] = {}, out[64];
    return ep_moe_layer_cpu(c, full, EpPayload::kF32, x, 1, out);
  });
  ASSERT_FALSE(st[0].ok());
  EXPECT_THAT(st[0].error().what(), ::testing::HasSubstr("does not split evenly over 3"));
}

}  // namespace
}  // namespace moebius::moe

namespace moebius::model {
namespace {

// The tiny fixture (E = 16, k = 4, layers 0 and 2 MoE) with EP = 1, 2, 4 ranks as threads: each
// rank runs its own prompts (rank 1 of 4 has none and only serves its experts), prefill then
// decode steps; every rank's logits equal the single-process model's for the same prompts.
struct RankWork {
  std::vector<std::vector<int32_t>> prompts;
};

std::vector<RankWork> split_prompts(const std::vector<std::vector<int32_t>>& prompts, int size) {
  std::vector<RankWork> w(static_cast<size_t>(size));
  if (size == 1) {
    w[0].prompts = prompts;
  } else if (size == 2) {
    w[0].prompts = {prompts[0]};
    w[1].prompts = {prompts[1], prompts[2], prompts[3]};
  } else {
    w[0].prompts = {prompts[0], prompts[1]};
    w[2].prompts = {prompts[2]};
    w[3].prompts = {prompts[3]};
  }
  return w;
}

constexpr int kDecodeSteps = 3;

// Per prompt: the logits of its prefill step's last token, then of each decode step (greedy from
// the single-process run, so every run feeds the same tokens), [1 + kDecodeSteps, V].
std::map<size_t, std::vector<float>> run_model(int size, moe::EpPayload payload,
                                               const std::vector<std::vector<int32_t>>& prompts,
                                               const std::vector<std::vector<int32_t>>& decode_ids) {
  const auto work = split_prompts(prompts, size);
  std::map<size_t, std::vector<float>> result;
  std::mutex mu;
  auto st = parallel::run_ranks(size, [&](parallel::Communicator& c) -> Status {
    Qwen3MoeLoadOptions opt;
    opt.ep_payload = payload;
    // The model keeps a shared_ptr; this rank's communicator outlives it (a no-op deleter).
    opt.ep_comm = std::shared_ptr<parallel::Communicator>(&c, [](parallel::Communicator*) {});
    MOEBIUS_ASSIGN_OR_RETURN(Qwen3MoeCpu m, Qwen3MoeCpu::load(testing::tiny_fixture_dir(), opt));
    const int64_t V = m.config().vocab_size;
    const auto& mine = work[static_cast<size_t>(c.rank())].prompts;
    std::vector<KvCache> caches;
    for (size_t i = 0; i < mine.size(); ++i) caches.push_back(m.make_cache(64, 4));
    std::vector<std::vector<float>> out(mine.size());
    for (int step = 0; step <= kDecodeSteps; ++step) {
      std::vector<Qwen3MoeCpu::BatchSeq> seqs;
      std::vector<int32_t> next(mine.size());
      for (size_t i = 0; i < mine.size(); ++i) {
        size_t global = 0;
        while (prompts[global] != mine[i]) ++global;
        if (step == 0) {
          seqs.push_back({std::span<const int32_t>(mine[i]), &caches[i], true});
        } else {
          next[i] = decode_ids[global][static_cast<size_t>(step - 1)];
          seqs.push_back({std::span<const int32_t>(&next[i], 1), &caches[i], true});
        }
      }
      std::vector<float> logits(mine.size() * static_cast<size_t>(V));
      MOEBIUS_TRY(m.forward_batch(seqs, logits.data()));
      for (size_t i = 0; i < mine.size(); ++i)
        out[i].insert(out[i].end(), logits.begin() + static_cast<ptrdiff_t>(i * V),
                      logits.begin() + static_cast<ptrdiff_t>((i + 1) * V));
    }
    std::lock_guard<std::mutex> lock(mu);
    for (size_t i = 0; i < mine.size(); ++i) {
      size_t global = 0;
      while (prompts[global] != mine[i]) ++global;
      result[global] = out[i];
    }
    return Ok{};
  });
  for (auto& s : st) EXPECT_TRUE(s.ok()) << s.error().what();
  return result;
}

TEST(EpQwen3MoeCpu, Ep2AndEp4LogitsEqualTheSingleProcessModel) {
  auto single = Qwen3MoeCpu::load(testing::tiny_fixture_dir());
  ASSERT_TRUE(single.ok()) << single.error().what();
  const int64_t V = single->config().vocab_size;
  const auto ref = testing::load_tiny_reference();
  ASSERT_GE(ref.ids.size(), 20u);
  const std::vector<std::vector<int32_t>> prompts = {
      {ref.ids.begin(), ref.ids.begin() + 9}, {ref.ids.begin() + 3, ref.ids.begin() + 4},
      {ref.ids.begin() + 5, ref.ids.begin() + 20}, {ref.ids.begin() + 1, ref.ids.begin() + 4}};
  // The single-process model: greedy decode ids and the logits to match.
  std::vector<std::vector<int32_t>> decode_ids(prompts.size());
  std::map<size_t, std::vector<float>> want;
  for (size_t p = 0; p < prompts.size(); ++p) {
    KvCache cache = single->make_cache(64, 4);
    std::vector<float> all(prompts[p].size() * static_cast<size_t>(V));
    ASSERT_TRUE(single->forward(prompts[p].data(), static_cast<int>(prompts[p].size()), cache, all.data()).ok());
    std::vector<float> row(all.end() - V, all.end());
    want[p] = row;
    for (int s = 0; s < kDecodeSteps; ++s) {
      const int32_t id = static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
      decode_ids[p].push_back(id);
      ASSERT_TRUE(single->forward(&id, 1, cache, row.data()).ok());
      want[p].insert(want[p].end(), row.begin(), row.end());
    }
  }
  for (int n : {1, 2, 4}) {
    const auto got = run_model(n, moe::EpPayload::kF32, prompts, decode_ids);
    ASSERT_EQ(got.size(), prompts.size()) << "EP=" << n;
    for (size_t p = 0; p < prompts.size(); ++p)
      EXPECT_EQ(0, std::memcmp(got.at(p).data(), want[p].data(), want[p].size() * 4)) << "EP=" << n << " prompt " << p;
  }
  // bf16 payload: EP = 2 and 4 bit-identical to EP = 1.
  const auto ep1 = run_model(1, moe::EpPayload::kBF16, prompts, decode_ids);
  ASSERT_EQ(ep1.size(), prompts.size());
  for (int n : {2, 4}) {
    const auto got = run_model(n, moe::EpPayload::kBF16, prompts, decode_ids);
    ASSERT_EQ(got.size(), prompts.size());
    for (size_t p = 0; p < prompts.size(); ++p)
      EXPECT_EQ(0, std::memcmp(got.at(p).data(), ep1.at(p).data(), ep1.at(p).size() * 4)) << "bf16 EP=" << n;
  }
}

TEST(EpQwen3MoeCpu, RanksHoldOnlyTheirExperts) {
  auto st = parallel::run_ranks(4, [&](parallel::Communicator& c) -> Status {
    Qwen3MoeLoadOptions opt;
    opt.ep_comm = std::shared_ptr<parallel::Communicator>(&c, [](parallel::Communicator*) {});
    MOEBIUS_ASSIGN_OR_RETURN(Qwen3MoeCpu m, Qwen3MoeCpu::load(testing::tiny_fixture_dir(), opt));
    for (const auto& l : m.layers())
      if (l.is_moe && l.moe.experts.size() != 4) return Error::format("{} experts", l.moe.experts.size());
    return Ok{};
  });
  for (auto& s : st) EXPECT_TRUE(s.ok()) << s.error().what();
  auto bad = parallel::run_ranks(3, [&](parallel::Communicator& c) -> Status {
    Qwen3MoeLoadOptions opt;
    opt.ep_comm = std::shared_ptr<parallel::Communicator>(&c, [](parallel::Communicator*) {});
    return Qwen3MoeCpu::load(testing::tiny_fixture_dir(), opt).ok() ? Status(Ok{}) : Status(Error("load failed"));
  });
  EXPECT_FALSE(bad[0].ok());
}

// `moebius generate --ep N` on the CPU: rank 0 generates, the other threads serve their experts
// and idle until rank 0 is done; the tokens and the logits hash equal the single process's.
TEST(EpGenerateCpu, SameTokensAndLogitsHashAtEveryRankCount) {
  GenerateOptions o;
  o.model_dir = testing::tiny_fixture_dir();
  o.prompt_ids = {1, 2, 3, 4, 5};
  o.max_tokens = 6;
  o.temperature = 0.0f;
  o.eos_token_ids = std::vector<int32_t>{};
  auto want = run_generate(o, nullptr);
  ASSERT_TRUE(want.ok()) << want.error().what();
  ASSERT_EQ(want->generated.size(), 6u);
  for (int n : {2, 4, 16}) {
    o.ep = n;
    std::vector<int32_t> streamed;
    auto got = run_generate(o, [&](int32_t id) { streamed.push_back(id); });
    ASSERT_TRUE(got.ok()) << "EP=" << n << ": " << got.error().what();
    EXPECT_EQ(got->generated, want->generated) << "EP=" << n;
    EXPECT_EQ(streamed, want->generated) << "EP=" << n;
    EXPECT_EQ(got->logits_hash, want->logits_hash) << "EP=" << n;
  }
  o.ep = 3;  // 16 experts do not split over 3 ranks: the error names the field, no hang
  auto bad = run_generate(o, nullptr);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.error().what(), ::testing::HasSubstr("num_experts"));
  EXPECT_THAT(bad.error().what(), ::testing::Not(::testing::HasSubstr("aborted")));
  o.ep = 2;
  o.backend = "cuda";
  auto cuda = run_generate(o, nullptr);  // cuda --ep needs the worker processes' communicator
  ASSERT_FALSE(cuda.ok());
#ifdef MOEBIUS_HAS_CUDA
  EXPECT_THAT(cuda.error().what(), ::testing::HasSubstr("--ep"));
#endif
}

}  // namespace
}  // namespace moebius::model

namespace moebius::server {
namespace {

// The CPU runner of `serve` over the tiny fixture.
Result<std::unique_ptr<StepRunner>> load_tiny_runner(int ep, int max_seqs, int max_step_tokens) {
  RunnerOptions o;
  o.source.model_dir = testing::tiny_fixture_dir();
  o.max_seqs = max_seqs;
  o.max_step_tokens = max_step_tokens;
  o.ep = ep;
  return load_runner(o);
}

// run(ep) gives a script's logits; EP = 2 and 4 must give the single-process run's bits.
void expect_ep_runs_equal(const std::function<std::vector<float>(int)>& run) {
  const auto want = run(1);
  ASSERT_FALSE(want.empty());
  for (int n : {2, 4}) {
    const auto got = run(n);
    ASSERT_EQ(got.size(), want.size()) << "EP=" << n;
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * 4)) << "EP=" << n;
  }
}

// `moebius serve --ep N` on the CPU: the runner's steps (a prefill of two sequences, then a
// decode step) give the same logits as without EP; the follower ranks exit when the runner goes.
TEST(EpCpuRunner, StepsEqualTheSingleProcessRunner) {
  auto run = [](int ep) -> std::vector<float> {
    auto runner = load_tiny_runner(ep, 4, 64);
    EXPECT_TRUE(runner.ok()) << runner.error().what();
    if (!runner.ok()) return {};
    const std::vector<int32_t> a = {1, 2, 3, 4, 5}, b = {7, 8}, a1 = {9}, b1 = {10};
    // Each sequence its own blocks: the single-process runner keeps the KV in the pool blocks the
    // tables list (with --ep the tables are only accounting).
    const std::vector<int32_t> ta = {0, 1}, tb = {2, 3};
    std::vector<float> all, logits;
    RunnerSeq s0{1, a, 0, ta, true}, s1{2, b, 0, tb, true};
    const RunnerSeq step1[] = {s0, s1};
    EXPECT_TRUE((*runner)->step(step1, logits).ok());
    all.insert(all.end(), logits.begin(), logits.end());
    RunnerSeq d0{1, a1, 5, ta, true}, d1{2, b1, 2, tb, true};
    const RunnerSeq step2[] = {d0, d1};
    EXPECT_TRUE((*runner)->step(step2, logits).ok());
    all.insert(all.end(), logits.begin(), logits.end());
    if (ep > 1) {
      auto staged = (*runner)->stage_weights(testing::tiny_fixture_dir());
      EXPECT_FALSE(staged.ok());  // not with --ep yet: refused, nothing changes
    }
    return all;  // the runner (and with it the follower ranks) goes here
  };
  expect_ep_runs_equal(run);
  RunnerOptions bad;
  bad.source.model_dir = testing::tiny_fixture_dir();
  bad.ep = 3;
  auto r = load_runner(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.error().what(), ::testing::HasSubstr("num_experts"));
}

// A prompt's logprobs (RunnerSeq::all_logits): a step returns a row for every new token of such a
// sequence, in the step's order among the other sequences' rows, bit-identical to computing the
// prompt one token at a time; with --ep 2 too, on either rank.
TEST(EpCpuRunner, AllLogitsRowsEqualTokenByTokenLogits) {
  const std::vector<int32_t> prompt = {5, 17, 2, 99, 41, 7}, other = {3, 4};
  const std::vector<int32_t> ta = {0}, tb = {1};
  auto one_by_one = [&]() -> std::vector<float> {
    auto runner = load_tiny_runner(1, 4, 64);
    EXPECT_TRUE(runner.ok()) << runner.error().what();
    if (!runner.ok()) return {};
    std::vector<float> rows, logits;
    for (size_t i = 0; i < prompt.size(); ++i) {
      const RunnerSeq s{1, std::span<const int32_t>(prompt.data() + i, 1), static_cast<int64_t>(i), ta, true};
      EXPECT_TRUE((*runner)->step(std::span<const RunnerSeq>(&s, 1), logits).ok());
      rows.insert(rows.end(), logits.begin(), logits.end());
    }
    return rows;
  };
  const std::vector<float> want = one_by_one();
  ASSERT_FALSE(want.empty());
  const size_t V = want.size() / prompt.size();
  for (int ep : {1, 2}) {
    auto runner = load_tiny_runner(ep, 4, 64);
    ASSERT_TRUE(runner.ok()) << runner.error().what();
    EXPECT_EQ((*runner)->limits().max_all_logits_rows, 64 * 1);
    std::vector<float> logits;
    // The prompt in two chunks (4 + 2 tokens), beside another sequence that wants its last row.
    const RunnerSeq first[] = {{2, other, 0, tb, true, 0}, {1, std::span<const int32_t>(prompt.data(), 4), 0, ta, false, ep - 1, true}};
    ASSERT_TRUE((*runner)->step(first, logits).ok());
    ASSERT_EQ(logits.size(), 5 * V) << "EP=" << ep;
    EXPECT_EQ(0, std::memcmp(logits.data() + V, want.data(), 4 * V * sizeof(float))) << "EP=" << ep;
    const RunnerSeq second[] = {{1, std::span<const int32_t>(prompt.data() + 4, 2), 4, ta, true, ep - 1, true}};
    ASSERT_TRUE((*runner)->step(second, logits).ok());
    ASSERT_EQ(logits.size(), 2 * V);
    EXPECT_EQ(0, std::memcmp(logits.data(), want.data() + 4 * V, 2 * V * sizeof(float))) << "EP=" << ep;
  }
}

// A sequence starting past the context (inside its block table) is refused, on one rank and on a
// follower rank, rather than stopping the process on the KV view's assertion.
TEST(EpCpuRunner, AStepPastTheContextIsRefused) {
  for (int ep : {1, 2}) {
    RunnerOptions o;
    o.source.model_dir = testing::tiny_fixture_dir();
    o.max_seqs = 2;
    o.max_step_tokens = 20;
    o.num_blocks = 8;
    o.max_context = 20;
    o.ep = ep;
    auto runner = load_runner(o);
    ASSERT_TRUE(runner.ok()) << runner.error().what();
    const std::vector<int32_t> table = {0, 1}, t = {4};
    std::vector<float> logits;
    const RunnerSeq past[] = {{1, t, 25, table, true, ep - 1}};
    const Status st = (*runner)->step(past, logits);
    ASSERT_FALSE(st.ok()) << "EP=" << ep;
    if (ep == 1) {
      EXPECT_THAT(st.error().what(), ::testing::HasSubstr("past the context of 20"));
    }
    EXPECT_FALSE((*runner)->failed());
  }
}

// [TAG_SERVE_DP] `serve --ep N` is data parallel: the runner sends each sequence to the rank of its
// pool (each rank runs over its own KV pool) and collects their logits in the step's order. A
// script of steps with prefills, decodes, a chunk without logits, a new sequence and a preempted
// one starting over gives logits bit-identical to `--ep 1`; the engine may run N times as many
// sequences a step. (Placement is the engine's: test_engine.cpp.)
TEST(EpCpuRunner, DataParallelStepsEqualTheSingleProcessRunner) {
  auto run = [](int ep) -> std::vector<float> {
    auto runner = load_tiny_runner(ep, 4, 64);
    EXPECT_TRUE(runner.ok()) << runner.error().what();
    if (!runner.ok()) return {};
    EXPECT_EQ((*runner)->limits().max_seqs, 4 * ep);
    EXPECT_EQ((*runner)->limits().kv_pools, ep);
    std::vector<float> all, logits;
    auto step = [&](std::vector<RunnerSeq> seqs, size_t want_rows) {
      const Status st = (*runner)->step(seqs, logits);
      EXPECT_TRUE(st.ok()) << st.error().what();
      EXPECT_EQ(logits.size(), want_rows * static_cast<size_t>((*runner)->config().vocab_size));
      all.insert(all.end(), logits.begin(), logits.end());
    };
    // Sequence k's blocks: 2k and 2k + 1 of its pool, which the engine would choose; here k - 1
    // modulo the ranks, so with EP 4 sequence 4 has rank 3 to itself and ranks share no sequence.
    const std::vector<std::vector<int32_t>> tables = {{}, {2, 3}, {4, 5}, {6, 7}, {8, 9}};
    auto pool = [&](int k) { return (k - 1) % ep; };
    const std::vector<int32_t> p1 = {1, 2, 3, 4, 5}, p2 = {7, 8}, p3 = {3, 9, 27}, p4 = {11, 12, 13, 14};
    const std::vector<int32_t> t1 = {9}, t2 = {10}, t3 = {21}, t4 = {6}, c1 = {30, 31}, t5 = {40};
    auto seq = [&](int k, const std::vector<int32_t>& tokens, int64_t start, bool want) {
      return RunnerSeq{k, tokens, start, tables[static_cast<size_t>(k)], want, pool(k)};
    };
    step({seq(1, p1, 0, true), seq(2, p2, 0, true), seq(3, p3, 0, true)}, 3);
    step({seq(1, t1, 5, true), seq(2, t2, 2, true), seq(3, t3, 3, true)}, 3);
    step({seq(4, p4, 0, true), seq(1, t4, 6, true), seq(3, t2, 4, false)}, 2);
    // Sequence 3 preempted as the engine does it: started over from its first token, and a
    // prefill chunk without logits.
    const std::vector<int32_t> p3_again = {3, 9, 27, 21, 10};
    step({seq(3, p3_again, 0, true), seq(1, c1, 7, false), seq(4, t5, 4, true)}, 2);
    step({seq(4, t1, 5, true), seq(3, t4, 5, true), seq(1, t5, 9, true)}, 3);
    step({seq(3, t3, 6, true), seq(4, t4, 6, true)}, 2);
    step({seq(4, t2, 7, true)}, 1);
    return all;
  };
  expect_ep_runs_equal(run);
}

// A step one rank cannot run (a sequence starting past its block table, a block outside the pool)
// is refused by every rank before any forward (no rank waits in a collective the others skipped):
// the step is an error naming the rank and its reason, the runner has not failed, and the next step
// runs.
TEST(EpCpuRunner, ARefusedDataParallelStepLeavesTheRanksInStep) {
  auto runner = load_tiny_runner(2, 2, 16);
  ASSERT_TRUE(runner.ok()) << runner.error().what();
  const std::vector<int32_t> t1 = {0, 1}, t2 = {2, 3}, p = {1, 2, 3}, t = {4};
  std::vector<float> logits;
  const RunnerSeq first[] = {{1, p, 0, t1, true, 0}, {2, p, 0, t2, true, 1}};
  ASSERT_TRUE((*runner)->step(first, logits).ok());
  // Sequence 2 lives on rank 1: rank 0 only learns that rank 1 refused (its reason is logged).
  const RunnerSeq wrong[] = {{1, t, 3, t1, true, 0}, {2, t, 40, t2, true, 1}};  // 2 blocks: 32 tokens
  const Status st = (*runner)->step(wrong, logits);
  ASSERT_FALSE(st.ok());
  EXPECT_THAT(st.error().what(), ::testing::HasSubstr("rank(s) 1 could not run"));
  EXPECT_FALSE((*runner)->failed());
  // Rank 0's own refusal names the reason; nothing ran on either rank, so both continue.
  const std::vector<int32_t> outside = {0, 100000};
  const RunnerSeq wrong0[] = {{1, t, 3, outside, true, 0}, {2, t, 3, t2, true, 1}};
  const Status st0 = (*runner)->step(wrong0, logits);
  ASSERT_FALSE(st0.ok());
  EXPECT_THAT(st0.error().what(), ::testing::HasSubstr("rank 0: sequence 1's block table lists block 100000"));
  const RunnerSeq bad_pool[] = {{1, t, 3, t1, true, 2}};
  EXPECT_THAT((*runner)->step(bad_pool, logits).error().what(), ::testing::HasSubstr("pool 2"));
  const RunnerSeq next[] = {{1, t, 3, t1, true, 0}, {2, t, 3, t2, true, 1}};
  const Status after = (*runner)->step(next, logits);
  ASSERT_TRUE(after.ok()) << after.error().what();
  EXPECT_EQ(logits.size(), 2 * static_cast<size_t>((*runner)->config().vocab_size));
  EXPECT_FALSE((*runner)->failed());
}

}  // namespace
}  // namespace moebius::server
