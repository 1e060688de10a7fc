// What the MoE autotuner keys its cache on, and what it stores (host code; the tuner itself is
// moe_autotuner.h).
//
// Key: one MoE geometry and numeric configuration at one capacity bucket. Its text form is the
// cache key, e.g.
//   moe.v9 H=2048 I=768 E=128 k=8 fmt=nvfp4 g=0 act=silu combine=store bucket=64
// The "v9" is kMoeTuneKeyVersion: bump it when the candidate set or the meaning of a choice
// changes, so old winners are ignored rather than misread.
//
// Choice: the knobs of MoeCudaOptions the tuner searches (GEMM path, tokens per tile, fused
// routing, decode rows per block and split-K warps), with the measured time of the winner and of
// the heuristic's choice.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moebius::tune {

// 2: decode rows per block joined the candidates. 3: the int formats run the wgmma kernels at
// block_m 128 too, with the group scale folded into the weight (other numerics than a v2 wgmma
// winner measured), and the heuristic the winners are timed against changed (session 14).
// 4: the decode GEMM1's split-K warps joined the candidates ([TAG_DECODE_SPLIT_K]).
// 5: 128-token wgmma candidates store bf16 y rows by default ([TAG_MOE_BF16_Y]): their times, and
// so the winners, changed (session 27).
// 6: the router runs on tensor-core tiles from capacity 2 and the layer fuses the routing for one
// and two tokens only (session 29): a fused-routing winner above 2 now resolves to the separate
// kernels, and every decode time from capacity 3 changed.
// 7: the separate routing runs top-k and align as one kernel up to capacity 8 (session 30): the
// separate-routing times at capacities 1-8, and so the fused/separate winners, changed.
// 8: the int2 decode GEMM2 at 6 chunks runs six warps on the row-tile kernel, so its rows per block
// is a real choice and every int2 decode time changed ([TAG_DECODE_INT2_DOWN_WARPS], session 38).
// 9: int2 joined the 8-warp GEMM1 candidate ([TAG_DECODE_SPLIT_K]) (session 39).
inline constexpr int kMoeTuneKeyVersion = 9;

struct MoeTuneKey {
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I
  int num_experts = 0;       // E
  int top_k = 0;             // k
  std::string format;        // kernel_format_name: bf16, nvfp4, int4, int2
  int group_size = 0;        // int formats' K elements per scale; 0 otherwise
  std::string activation;    // silu, silu_clamped(7), gptoss(7,1.702)
  std::string combine;       // store, atomic
  int bucket = 0;            // capacity bucket (tokens)

  std::string str() const;
  bool operator==(const MoeTuneKey&) const = default;
};

// A configuration of the MoE layer's knobs, as the layer resolved it (never "auto").
struct MoeTuneConfig {
  std::string gemm_path;  // moe_gemm_path_name: decode, prefill, ...
  int block_m = 0;
  bool fuse_routing = false;
  // MoeCudaOptions::decode_rows_per_block: 0 is the kernel's own heuristic (it differs between
  // GEMM1 and GEMM2), not "unresolved".
  int rows_per_block = 0;
  // MoeCudaOptions::decode_split_k_warps as the layer resolved it: 4 (the default), or 8.
  int split_k_warps = 4;

  std::string str() const;  // "decode bm=8 fused", "decode bm=8 rows=4", "decode bm=8 rows=4 warps=8"
  bool operator==(const MoeTuneConfig&) const = default;
};

struct MoeTuneChoice {
  MoeTuneConfig winner;
  MoeTuneConfig heuristic;
  double winner_us = 0;     // per forward at the bucket's token count
  double heuristic_us = 0;
  int candidates = 0;       // configurations timed

  nlohmann::json to_json() const;
  // Validates every field; an error names the first bad one.
  static Result<MoeTuneChoice> from_json(const nlohmann::json& j);
};

}  // namespace moebius::tune
