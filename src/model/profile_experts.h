// `moebius profile-experts`: routing counts and mass per MoE layer and expert over a set of
// prompts (offload/routing_profile.h), from the prefill of each prompt on the CPU model. The
// profile feeds `--placement FILE` (offload/placement.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/qwen3_moe_cpu.h"
#include "offload/routing_profile.h"

namespace moebius::model {

// Prompts files are bounded: at most this many bytes and prompts.
inline constexpr uint64_t kMaxPromptsFileBytes = 64ull << 20;
inline constexpr size_t kMaxPrompts = 100000;

// One prompt per line, empty lines skipped. Errors name the file (missing, too large, too many
// lines, no prompt at all).
Result<std::vector<std::string>> read_prompt_lines(const std::string& path);
// A line of comma-separated token ids ("1,2,3"); errors name the file and the line.
Result<std::vector<int32_t>> parse_prompt_ids(const std::string& line, const std::string& where);

// Token-by-token routing of the profiled prompts, per MoE layer (in layer order): trace[i][t] is
// the k experts token t routed to in the i-th MoE layer. At most kMaxTraceTokens tokens are kept.
inline constexpr int64_t kMaxTraceTokens = 1 << 16;
using RoutingTrace = std::vector<std::vector<std::vector<int32_t>>>;

// Prefills each prompt in its own KV cache (prompts longer than max_position_embeddings are
// refused with the prompt's index) and accumulates the routing of every MoE layer; `trace`, when
// given, receives the token-by-token routing (the dynamic cache's simulation input).
Result<offload::RoutingProfile> profile_experts(Qwen3MoeCpu& model, const std::vector<std::vector<int32_t>>& prompts,
                                                RoutingTrace* trace = nullptr);

}  // namespace moebius::model
