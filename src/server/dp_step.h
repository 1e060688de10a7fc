// Data-parallel serving over the expert-parallel ranks (`moebius serve --ep N`, DP = EP): rank 0's
// scheduler places each sequence on a rank and allocates its KV blocks from that rank's pool (the
// engine keeps one block allocator per rank, server/engine.h), every rank runs the dense layers and
// attention of its own sequences over its own pool, and all ranks meet in every MoE layer's
// dispatch and return (docs/EXPERT_PARALLEL.md). This file holds what travels around the forward
// of one step:
//   before the forward, rank 0 -> each rank: that rank's sequences of the step (id, cache start,
//     whether its logits are wanted, new tokens, block table into the rank's pool), or "stop" (the
//     server is going away). The block tables are the whole cache state, so a rank keeps nothing
//     per sequence between steps;
//   after the forward, each rank -> rank 0: the logits rows of its sequences that want them.
// Both are collectives over parallel::Communicator (host buffers: buffers_on_device() false), so
// every rank calls them once per step, in the same order, as it calls the model's forward.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/error.h"
#include "parallel/communicator.h"

namespace moebius::server {

struct DpSeq {
  int64_t id = 0;
  int64_t start = 0;           // tokens already in this sequence's cache on its rank
  bool want_logits = false;
  std::vector<int32_t> tokens;       // new tokens, at least one
  std::vector<int32_t> block_table;  // blocks of the rank's pool; covers start + tokens
  bool all_logits = false;           // every new token's logits (RunnerSeq::all_logits)
};

// One rank's part of one step.
struct DpStepMessage {
  bool stop = false;        // no more steps: a follower returns
  std::vector<DpSeq> seqs;  // in the step's order
};

// Wire form: little-endian fixed-width fields behind a magic and version word. decode_dp_step
// checks every count against the bytes that remain before it allocates (a corrupt message is an
// error, never an out-of-bounds read; what it allocates is a small multiple of the message's size).
std::vector<uint8_t> encode_dp_step(const DpStepMessage& m);
Result<DpStepMessage> decode_dp_step(std::span<const uint8_t> bytes);

// The step's messages from rank 0 to every rank: rank 0 passes one message per rank (its own
// included, returned as is without going over the wire), the others pass an empty span and get
// theirs. Two collectives: an all-gather of the encoded sizes, then an all-to-all of the bytes.
Result<DpStepMessage> dp_exchange_step(parallel::Communicator& comm, std::span<const DpStepMessage> per_rank);

// After the forward: each rank r >= 1 sends its `mine` ([rows_r, vocab] fp32, the wanted rows in
// its message's order) to rank 0. Rank 0 passes rows_per_rank (size() entries; its own entry is
// not sent) and receives, into `gathered`, ranks 1..N-1's rows in rank order. Other ranks pass an
// empty rows_per_rank and get `gathered` cleared.
Status dp_gather_logits(parallel::Communicator& comm, std::span<const float> mine, std::span<const int64_t> rows_per_rank,
                        int64_t vocab, std::vector<float>& gathered);

}  // namespace moebius::server
