#include "server/dp_step.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

namespace moebius::server {
namespace {

constexpr uint32_t kDpStepMagic = 0x33535044u;  // "DPS3" little-endian: version 3 of the layout below

// Layout: magic u32, stop u8, seqs u32, then per sequence: id i64, start i64, logits flags u8 (bit
// 0: want_logits, bit 1: all_logits), tokens u32, token ids i32 x n, blocks u32, block ids i32 x n.
class Writer {
 public:
  template <typename T>
  void put(T v) {
    const size_t at = out.size();
    out.resize(at + sizeof(T));
    std::memcpy(out.data() + at, &v, sizeof(T));
  }
  std::vector<uint8_t> out;
};

class Reader {
 public:
  explicit Reader(std::span<const uint8_t> b) : b_(b) {}
  template <typename T>
  bool get(T& v) {
    if (b_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  // Whether `count` items of `item_bytes` each can still be read (checked before any allocation).
  bool holds(uint64_t count, size_t item_bytes) const { return count <= (b_.size() - pos_) / item_bytes; }
  size_t left() const { return b_.size() - pos_; }

 private:
  std::span<const uint8_t> b_;
  size_t pos_ = 0;
};

Error malformed(const std::string& what) { return Error("malformed DP step message: " + what); }

}  // namespace

std::vector<uint8_t> encode_dp_step(const DpStepMessage& m) {
  Writer w;
  w.put<uint32_t>(kDpStepMagic);
  w.put<uint8_t>(m.stop ? 1 : 0);
  w.put<uint32_t>(static_cast<uint32_t>(m.seqs.size()));
  for (const DpSeq& s : m.seqs) {
    w.put<int64_t>(s.id);
    w.put<int64_t>(s.start);
    w.put<uint8_t>(static_cast<uint8_t>((s.want_logits ? 1 : 0) | (s.all_logits ? 2 : 0)));
    w.put<uint32_t>(static_cast<uint32_t>(s.tokens.size()));
    for (int32_t t : s.tokens) w.put<int32_t>(t);
    w.put<uint32_t>(static_cast<uint32_t>(s.block_table.size()));
    for (int32_t b : s.block_table) w.put<int32_t>(b);
  }
  return std::move(w.out);
}

Result<DpStepMessage> decode_dp_step(std::span<const uint8_t> bytes) {
  Reader r(bytes);
  uint32_t magic = 0, n = 0;
  uint8_t flag = 0;
  if (!r.get(magic) || magic != kDpStepMagic) return malformed("bad magic or version");
  DpStepMessage m;
  if (!r.get(flag) || flag > 1) return malformed("bad stop flag");
  m.stop = flag == 1;
  if (!r.get(n)) return malformed("missing sequence count");
  // A sequence takes at least 8 + 8 + 1 + 4 + 4 + 4 + 4 bytes (one token, one block).
  if (!r.holds(n, 33)) return malformed("sequence count past the end");
  m.seqs.resize(n);
  for (DpSeq& s : m.seqs) {
    uint32_t t = 0;
    if (!r.get(s.id) || !r.get(s.start) || !r.get(flag) || flag > 3 || !r.get(t))
      return malformed("truncated sequence header");
    s.want_logits = (flag & 1) != 0;
    s.all_logits = (flag & 2) != 0;
    if (s.start < 0) return malformed(fmt::format("sequence {} starts at {}", s.id, s.start));
    if (t == 0 || !r.holds(t, sizeof(int32_t))) return malformed(fmt::format("sequence {}: bad token count {}", s.id, t));
    s.tokens.resize(t);
    for (int32_t& tok : s.tokens) r.get(tok);
    if (!r.get(t) || t == 0 || !r.holds(t, sizeof(int32_t)))
      return malformed(fmt::format("sequence {}: bad block count", s.id));
    s.block_table.resize(t);
    for (int32_t& b : s.block_table) {
      r.get(b);
      if (b < 0) return malformed(fmt::format("sequence {}: block {}", s.id, b));
    }
  }
  if (m.stop && !m.seqs.empty()) return malformed("a stop message carries work");
  if (r.left() != 0) return malformed(fmt::format("{} trailing bytes", r.left()));
  return m;
}

Result<DpStepMessage> dp_exchange_step(parallel::Communicator& comm, std::span<const DpStepMessage> per_rank) {
  const int N = comm.size(), me = comm.rank();
  const size_t n = static_cast<size_t>(N);
  if (me == 0 && per_rank.size() != n)
    return Error::format("rank 0 has {} DP step messages for {} ranks", per_rank.size(), N);
  if (me != 0 && !per_rank.empty()) return Error::format("rank {} passed DP step messages; only rank 0 sends", me);
  // Sizes first, 8 bytes from rank 0 to each rank (an all-to-all: no rank receives the N x N
  // matrix an all-gather would make).
  std::vector<std::vector<uint8_t>> wire(me == 0 ? n : 0);
  std::vector<uint64_t> sizes(n, 0);
  uint64_t incoming = 0;
  {
    std::vector<size_t> sb(n, 0), so(n, 0), rb(n, 0), ro(n, 0);
    if (me == 0) {
      for (size_t d = 1; d < n; ++d) {
        wire[d] = encode_dp_step(per_rank[d]);
        sizes[d] = wire[d].size();
        sb[d] = sizeof(uint64_t);
        so[d] = d * sizeof(uint64_t);
      }
    } else {
      rb[0] = sizeof(uint64_t);
    }
    MOEBIUS_TRY(comm.all_to_all_v(sizes.data(), sb, so, &incoming, rb, ro));
  }
  // A step message is tokens and ids, far below this; a larger size is a corrupt exchange, not an
  // allocation to make.
  constexpr uint64_t kMaxMessageBytes = uint64_t{1} << 30;
  if (incoming > kMaxMessageBytes) return Error::format("rank {}: a DP step message of {} bytes", me, incoming);
  std::vector<uint8_t> send, recv(static_cast<size_t>(incoming));
  std::vector<size_t> send_bytes(n, 0), send_offsets(n, 0), recv_bytes(n, 0), recv_offsets(n, 0);
  if (me == 0) {
    for (size_t d = 1; d < n; ++d) {
      send_offsets[d] = send.size();
      send_bytes[d] = wire[d].size();
      send.insert(send.end(), wire[d].begin(), wire[d].end());
    }
  } else {
    recv_bytes[0] = static_cast<size_t>(incoming);
  }
  MOEBIUS_TRY(comm.all_to_all_v(send.data(), send_bytes, send_offsets, recv.data(), recv_bytes, recv_offsets));
  if (me == 0) return per_rank[0];
  return decode_dp_step(recv);
}

Status dp_gather_logits(parallel::Communicator& comm, std::span<const float> mine, std::span<const int64_t> rows_per_rank,
                        int64_t vocab, std::vector<float>& gathered) {
  const int N = comm.size(), me = comm.rank();
  const size_t n = static_cast<size_t>(N);
  if (vocab < 1) return Error::format("vocab {} is not >= 1", vocab);
  if (mine.size() % static_cast<size_t>(vocab) != 0)
    return Error::format("rank {}: {} logits are not whole rows of {}", me, mine.size(), vocab);
  if (me == 0 && rows_per_rank.size() != n) return Error::format("rank 0 has {} row counts for {} ranks", rows_per_rank.size(), N);
  const size_t row_bytes = static_cast<size_t>(vocab) * sizeof(float);
  std::vector<size_t> send_bytes(n, 0), send_offsets(n, 0), recv_bytes(n, 0), recv_offsets(n, 0);
  gathered.clear();
  if (me == 0) {
    size_t total = 0;
    for (size_t s = 1; s < n; ++s) {
      if (rows_per_rank[s] < 0) return Error::format("rank {} has {} logits rows", s, rows_per_rank[s]);
      recv_offsets[s] = total;
      recv_bytes[s] = static_cast<size_t>(rows_per_rank[s]) * row_bytes;
      total += recv_bytes[s];
    }
    gathered.resize(total / sizeof(float));
  } else {
    send_bytes[0] = mine.size() * sizeof(float);
  }
  return comm.all_to_all_v(mine.data(), send_bytes, send_offsets, gathered.data(), recv_bytes, recv_offsets);
}

}  // namespace moebius::server
