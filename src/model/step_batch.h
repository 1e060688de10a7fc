// One forward step of a batch of sequences, flattened the way the CUDA model runner consumes it
// (vLLM/FlashInfer style, see kernels/attention.cuh): the new tokens of every sequence back to
// back, their absolute positions and KV-cache slots, per-sequence query offsets (cu_seqlens) and
// context lengths, the block tables, and which rows want logits. Host-only, so it is unit-tested
// without a GPU; Qwen3MoeCuda uploads it in one copy.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/error.h"

namespace moebius::model {

// One sequence's part of a step.
struct SequenceStep {
  std::span<const int32_t> tokens;       // new tokens, at least one
  int64_t start = 0;                     // tokens of this sequence already in the cache: tokens[0]'s position
  std::span<const int32_t> block_table;  // physical blocks covering start + tokens.size() tokens (or more)
  bool all_logits = false;               // a logit row for every new token (prompt logprobs), not only the last
};

struct StepBatch {
  int num_tokens = 0;     // T: rows of the flat token list
  int num_seqs = 0;       // S
  int max_q_len = 0;      // the longest sequence's new tokens; 1 for a pure decode step
  int max_seq_len = 0;    // the longest context, new tokens included
  int block_size = 0;
  int max_blocks_per_seq = 0;  // the row length of block_tables
  std::vector<int32_t> ids;           // [T]
  std::vector<int32_t> positions;     // [T] absolute positions
  std::vector<int32_t> slot_mapping;  // [T] block * block_size + offset; -1 for padding rows
  std::vector<int32_t> cu_seqlens;    // [S + 1] query rows of sequence s are [cu[s], cu[s + 1])
  std::vector<int32_t> seq_lens;      // [S] context of s including its new tokens
  std::vector<int32_t> block_tables;  // [S, max_blocks_per_seq]; entries past a table's length are 0
  std::vector<int32_t> logit_rows;    // rows of the flat list whose logits are wanted, in order

  bool is_decode() const { return max_q_len == 1; }
  // Pads a decode step to `rows` sequences of one token (a CUDA-graph bucket): padding tokens have
  // id 0, position 0, slot -1 (no cache write), padding sequences an empty context and logit row
  // -1. num_tokens/num_seqs keep the live counts; the vectors grow to `rows`.
  void pad_decode_to(int rows);
};

// Flattens `seqs`. all_logits: a logit row for every token (tests compare whole prefills), else
// the last token of each sequence (every token of a sequence with SequenceStep::all_logits). Errors for an empty sequence, a block table too short for its
// tokens or longer than max_blocks_per_seq, a block id outside [0, num_blocks), or positions past
// int32.
Result<StepBatch> make_step_batch(std::span<const SequenceStep> seqs, int block_size, int max_blocks_per_seq,
                                  int32_t num_blocks, bool all_logits = false);

// A captured decode graph as the runner lists them: its rows and the longest context its attention
// plan was made for ([TAG_ATTN_CLUSTER_MERGE]: a batch size may have a short-context graph, listed
// before its full one).
struct DecodeGraphSlot {
  int batch = 0;
  int max_context = 0;
};
// The graph a pure decode step of num_seqs sequences, the longest max_seq_len tokens, replays: the
// first slot with batch >= num_seqs and max_context >= max_seq_len; -1 when none fits (the step
// runs eagerly).
int pick_decode_graph(std::span<const DecodeGraphSlot> graphs, int num_seqs, int max_seq_len);

}  // namespace moebius::model
