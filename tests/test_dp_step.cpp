// [TAG_SERVE_DP] The data-parallel step protocol of `serve --ep N` (server/dp_step.h): the message
// wire format (round trips; every truncation and corruption refused, never read past the end),
// and the two collectives over in-process ranks. (Placement is the engine's: test_engine.cpp.)
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "parallel/in_process_communicator.h"
#include "server/dp_step.h"

namespace moebius::server {
namespace {

DpStepMessage sample_message() {
  DpStepMessage m;
  m.seqs.push_back(DpSeq{11, 0, true, {1, 2, 3, 4, 5}, {3, 9}});
  m.seqs.push_back(DpSeq{12, 37, false, {151643}, {0, 1, 2}});
  m.seqs.push_back(DpSeq{-5, 9, true, {0}, {1 << 30}});
  m.seqs.push_back(DpSeq{13, 0, false, {5, 6, 7}, {4}, /*all_logits=*/true});  // a prompt's logprobs
  return m;
}

void expect_same(const DpStepMessage& a, const DpStepMessage& b) {
  EXPECT_EQ(a.stop, b.stop);
  ASSERT_EQ(a.seqs.size(), b.seqs.size());
  for (size_t i = 0; i < a.seqs.size(); ++i) {
    EXPECT_EQ(a.seqs[i].id, b.seqs[i].id);
    EXPECT_EQ(a.seqs[i].start, b.seqs[i].start);
    EXPECT_EQ(a.seqs[i].want_logits, b.seqs[i].want_logits);
    EXPECT_EQ(a.seqs[i].all_logits, b.seqs[i].all_logits);
    EXPECT_EQ(a.seqs[i].tokens, b.seqs[i].tokens);
    EXPECT_EQ(a.seqs[i].block_table, b.seqs[i].block_table);
  }
}

TEST(DpStepMessage, RoundTripsAndRefusesEveryTruncation) {
  const DpStepMessage m = sample_message();
  const std::vector<uint8_t> bytes = encode_dp_step(m);
  auto back = decode_dp_step(bytes);
  ASSERT_TRUE(back.ok()) << back.error().what();
  expect_same(m, *back);
  DpStepMessage stop;
  stop.stop = true;
  auto stop_back = decode_dp_step(encode_dp_step(stop));
  ASSERT_TRUE(stop_back.ok());
  EXPECT_TRUE(stop_back->stop);
  DpStepMessage empty;  // a rank with nothing to do this step
  auto empty_back = decode_dp_step(encode_dp_step(empty));
  ASSERT_TRUE(empty_back.ok());
  EXPECT_TRUE(empty_back->seqs.empty() && !empty_back->stop);
  // Every prefix is refused, and so is a trailing byte.
  for (size_t n = 0; n < bytes.size(); ++n)
    EXPECT_FALSE(decode_dp_step(std::span<const uint8_t>(bytes.data(), n)).ok()) << "prefix of " << n << " bytes";
  std::vector<uint8_t> longer = bytes;
  longer.push_back(0);
  EXPECT_THAT(decode_dp_step(longer).error().what(), ::testing::HasSubstr("trailing"));
}

TEST(DpStepMessage, RefusesCorruptFields) {
  const std::vector<uint8_t> good = encode_dp_step(sample_message());
  auto with = [&](size_t at, const void* v, size_t n) {
    std::vector<uint8_t> b = good;
    std::memcpy(b.data() + at, v, n);
    return decode_dp_step(b);
  };
  const uint32_t huge = 0xFFFFFFFFu;
  const uint8_t two = 2;
  const int64_t negative = -1;
  const uint32_t zero = 0;
  EXPECT_THAT(with(0, &huge, 4).error().what(), ::testing::HasSubstr("magic"));
  EXPECT_THAT(with(4, &two, 1).error().what(), ::testing::HasSubstr("stop flag"));
  const size_t seqs_at = 5;
  EXPECT_THAT(with(seqs_at, &huge, 4).error().what(), ::testing::HasSubstr("sequence count"));  // never allocated
  const size_t seq0 = seqs_at + 4;  // id, start, want, token count, 5 tokens, block count, 2 blocks
  EXPECT_THAT(with(seq0 + 8, &negative, 8).error().what(), ::testing::HasSubstr("starts at -1"));
  const uint8_t four = 4;  // logits flags: bits 0 and 1 only
  EXPECT_THAT(with(seq0 + 16, &four, 1).error().what(), ::testing::HasSubstr("truncated sequence header"));
  EXPECT_THAT(with(seq0 + 17, &zero, 4).error().what(), ::testing::HasSubstr("token count"));
  EXPECT_THAT(with(seq0 + 17, &huge, 4).error().what(), ::testing::HasSubstr("token count"));
  const size_t blocks0 = seq0 + 21 + 5 * 4;
  EXPECT_THAT(with(blocks0, &zero, 4).error().what(), ::testing::HasSubstr("block count"));
  EXPECT_THAT(with(blocks0, &huge, 4).error().what(), ::testing::HasSubstr("block count"));
  const int32_t bad_block = -2;
  EXPECT_THAT(with(blocks0 + 4, &bad_block, 4).error().what(), ::testing::HasSubstr("block -2"));
  // A stop flag on a message that carries work.
  std::vector<uint8_t> b = good;
  b[4] = 1;
  EXPECT_THAT(decode_dp_step(b).error().what(), ::testing::HasSubstr("stop message carries work"));
}

// Random bytes and random single-byte edits of a valid message: an error or a message, never a
// crash (run under the sanitizers in the debug preset).
TEST(DpStepMessage, FuzzedBytesNeverCrash) {
  std::mt19937_64 rng(5);
  const std::vector<uint8_t> good = encode_dp_step(sample_message());
  int decoded = 0;
  for (int i = 0; i < 20000; ++i) {
    std::vector<uint8_t> b;
    if (i % 2 == 0) {
      b = good;
      b[rng() % b.size()] = static_cast<uint8_t>(rng());
      if (i % 4 == 0) b.resize(rng() % (b.size() + 1));
    } else {
      b.resize(rng() % 64);
      for (auto& v : b) v = static_cast<uint8_t>(rng());
      if (b.size() >= 4) std::memcpy(b.data(), good.data(), 4);  // past the magic check
    }
    decoded += decode_dp_step(b).ok() ? 1 : 0;
  }
  EXPECT_GT(decoded, 0);  // some edits (token ids, ids, starts) stay valid
}

TEST(DpStepExchange, RankZeroReachesEveryRankAndGathersTheirRows) {
  for (int N : {1, 2, 4}) {
    std::vector<DpStepMessage> got(static_cast<size_t>(N));
    std::vector<float> gathered;
    const int64_t V = 3;
    auto st = parallel::run_ranks(N, [&](parallel::Communicator& c) -> Status {
      std::vector<DpStepMessage> out;
      if (c.rank() == 0)
        for (int r = 0; r < N; ++r) {
          DpStepMessage m;
          for (int s = 0; s < r; ++s) m.seqs.push_back(DpSeq{100 * r + s, s, s % 2 == 0, {r, s}, {s, 42}});
          out.push_back(m);
        }
      MOEBIUS_ASSIGN_OR_RETURN(DpStepMessage mine, dp_exchange_step(c, out));
      got[static_cast<size_t>(c.rank())] = mine;
      // Each rank sends one row per wanted sequence: values rank * 100 + row * 10 + column.
      std::vector<float> rows;
      int64_t wanted = 0;
      for (const DpSeq& s : mine.seqs)
        if (s.want_logits) {
          for (int v = 0; v < V; ++v) rows.push_back(static_cast<float>(c.rank() * 100 + wanted * 10 + v));
          ++wanted;
        }
      std::vector<int64_t> counts;
      if (c.rank() == 0)
        for (int r = 0; r < N; ++r) counts.push_back((r + 1) / 2);  // wanted rows of r sequences s = 0, 2, ...
      std::vector<float> g;
      MOEBIUS_TRY(dp_gather_logits(c, rows, counts, V, g));
      if (c.rank() == 0) gathered = g;
      else if (!g.empty()) return Error("a follower received logits");
      return Ok{};
    });
    for (auto& s : st) ASSERT_TRUE(s.ok()) << s.error().what();
    for (int r = 0; r < N; ++r) {
      ASSERT_EQ(got[static_cast<size_t>(r)].seqs.size(), static_cast<size_t>(r)) << "N=" << N;
      for (int s = 0; s < r; ++s) {
        EXPECT_EQ(got[static_cast<size_t>(r)].seqs[static_cast<size_t>(s)].tokens, (std::vector<int32_t>{r, s}));
        EXPECT_EQ(got[static_cast<size_t>(r)].seqs[static_cast<size_t>(s)].block_table, (std::vector<int32_t>{s, 42}));
      }
    }
    std::vector<float> want;
    for (int r = 1; r < N; ++r)
      for (int i = 0; i < (r + 1) / 2; ++i)
        for (int v = 0; v < V; ++v) want.push_back(static_cast<float>(r * 100 + i * 10 + v));
    EXPECT_EQ(gathered, want) << "N=" << N;
  }
}

TEST(DpStepExchange, MismatchedCallsAreErrorsNotHangs) {
  // Rank 0 with the wrong number of messages fails alone; run_ranks aborts the group, so the
  // others' collectives return errors instead of waiting forever.
  auto st = parallel::run_ranks(2, [&](parallel::Communicator& c) -> Status {
    std::vector<DpStepMessage> one(1);
    auto m = dp_exchange_step(c, c.rank() == 0 ? std::span<const DpStepMessage>(one) : std::span<const DpStepMessage>());
    if (!m.ok()) return m.error();
    return Ok{};
  });
  EXPECT_FALSE(st[0].ok());
  EXPECT_FALSE(st[1].ok());
}

}  // namespace
}  // namespace moebius::server
