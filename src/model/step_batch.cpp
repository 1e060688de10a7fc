#include "model/step_batch.h"

#include <algorithm>
#include <limits>

namespace moebius::model {

Result<StepBatch> make_step_batch(std::span<const SequenceStep> seqs, int block_size, int max_blocks_per_seq,
                                  int32_t num_blocks, bool all_logits) {
  MOEBIUS_ASSERT(block_size > 0 && max_blocks_per_seq > 0, "block_size {} max_blocks_per_seq {}", block_size,
                 max_blocks_per_seq);
  if (seqs.empty()) return Error("a step needs at least one sequence");
  StepBatch b;
  b.block_size = block_size;
  b.max_blocks_per_seq = max_blocks_per_seq;
  b.num_seqs = static_cast<int>(seqs.size());
  b.cu_seqlens.push_back(0);
  b.block_tables.assign(seqs.size() * static_cast<size_t>(max_blocks_per_seq), 0);
  int64_t total = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const SequenceStep& q = seqs[s];
    const int64_t n = static_cast<int64_t>(q.tokens.size()), end = q.start + n;
    if (n == 0) return Error::format("sequence {} has no new tokens", s);
    if (q.start < 0) return Error::format("sequence {} starts at position {}", s, q.start);
    if (end > std::numeric_limits<int32_t>::max() / 2 || total + n > std::numeric_limits<int32_t>::max())
      return Error::format("sequence {} reaches position {}, too far", s, end);
    const int64_t need = (end + block_size - 1) / block_size;
    if (static_cast<int64_t>(q.block_table.size()) < need)
      return Error::format("sequence {} has {} tokens but its block table covers {} ({} blocks of {})", s, end,
                           static_cast<int64_t>(q.block_table.size()) * block_size, q.block_table.size(), block_size);
    if (static_cast<int64_t>(q.block_table.size()) > max_blocks_per_seq)
      return Error::format("sequence {} has {} blocks; at most {} per sequence", s, q.block_table.size(),
                           max_blocks_per_seq);
    for (int32_t blk : q.block_table)
      if (blk < 0 || blk >= num_blocks)
        return Error::format("sequence {} names block {}, outside the cache's [0, {})", s, blk, num_blocks);
    std::copy(q.block_table.begin(), q.block_table.end(),
              b.block_tables.begin() + static_cast<int64_t>(s) * max_blocks_per_seq);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = q.start + i;
      b.ids.push_back(q.tokens[static_cast<size_t>(i)]);
      b.positions.push_back(static_cast<int32_t>(pos));
      b.slot_mapping.push_back(q.block_table[static_cast<size_t>(pos / block_size)] * block_size +
                               static_cast<int32_t>(pos % block_size));
      if (all_logits || q.all_logits) b.logit_rows.push_back(static_cast<int32_t>(total + i));
    }
    total += n;
    if (!all_logits && !q.all_logits) b.logit_rows.push_back(static_cast<int32_t>(total - 1));
    b.cu_seqlens.push_back(static_cast<int32_t>(total));
    b.seq_lens.push_back(static_cast<int32_t>(end));
    b.max_q_len = std::max<int>(b.max_q_len, static_cast<int>(n));
    b.max_seq_len = std::max<int>(b.max_seq_len, static_cast<int>(end));
  }
  b.num_tokens = static_cast<int>(total);
  return b;
}

int pick_decode_graph(std::span<const DecodeGraphSlot> graphs, int num_seqs, int max_seq_len) {
  for (size_t g = 0; g < graphs.size(); ++g)
    if (graphs[g].batch >= num_seqs && graphs[g].max_context >= max_seq_len) return static_cast<int>(g);
  return -1;
}

void StepBatch::pad_decode_to(int rows) {
  MOEBIUS_ASSERT(is_decode() && num_tokens == num_seqs && rows >= num_seqs, "pad_decode_to({}) of T={} S={}", rows,
                 num_tokens, num_seqs);
  const size_t r = static_cast<size_t>(rows);
  ids.resize(r, 0);
  positions.resize(r, 0);
  slot_mapping.resize(r, -1);
  while (cu_seqlens.size() < r + 1) cu_seqlens.push_back(cu_seqlens.back());
  seq_lens.resize(r, 0);
  block_tables.resize(r * static_cast<size_t>(max_blocks_per_seq), 0);
  logit_rows.resize(r, -1);
}

}  // namespace moebius::model
