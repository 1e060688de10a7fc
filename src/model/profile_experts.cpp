#include "model/profile_experts.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace moebius::model {

Result<std::vector<std::string>> read_prompt_lines(const std::string& path) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) return Error::format("cannot read: {}", ec.message()).in_file(path);
  if (size > kMaxPromptsFileBytes)
    return Error::format("{} bytes; a prompts file is at most {}", size, kMaxPromptsFileBytes).in_file(path);
  std::ifstream f(path, std::ios::binary);
  if (!f) return Error("cannot open").in_file(path);
  std::vector<std::string> lines;
  std::string line;
  while (std::getline(f, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    if (lines.size() == kMaxPrompts) return Error::format("more than {} prompts", kMaxPrompts).in_file(path);
    lines.push_back(std::move(line));
  }
  if (lines.empty()) return Error("holds no prompt (one per line)").in_file(path);
  return lines;
}

Result<std::vector<int32_t>> parse_prompt_ids(const std::string& line, const std::string& where) {
  std::vector<int32_t> ids;
  const char* p = line.data();
  const char* end = p + line.size();
  while (p < end) {
    while (p < end && *p == ' ') ++p;
    int32_t v = 0;
    auto [q, err] = std::from_chars(p, end, v);
    if (err != std::errc() || v < 0)
      return Error::format("'{}' is not a list of non-negative token ids, e.g. 1,2,3", line).in_field(where);
    ids.push_back(v);
    p = q;
    while (p < end && *p == ' ') ++p;
    if (p < end) {
      if (*p != ',') return Error::format("'{}': expected ',' after id {}", line, v).in_field(where);
      ++p;
    }
  }
  if (ids.empty()) return Error("no token ids").in_field(where);
  return ids;
}

Result<offload::RoutingProfile> profile_experts(Qwen3MoeCpu& model, const std::vector<std::vector<int32_t>>& prompts,
                                                RoutingTrace* trace) {
  const Qwen3MoeConfig& c = model.config();
  offload::RoutingProfile prof = offload::make_profile(c.num_experts, c.num_experts_per_tok);
  for (size_t i = 0; i < prompts.size(); ++i)
    if (prompts[i].empty() || static_cast<int64_t>(prompts[i].size()) > c.context_limit())
      return Error::format("prompt {} has {} tokens; each needs 1 to the model's {} positions", i,
                           prompts[i].size(), c.context_limit());
  std::vector<int> moe_layers;
  for (int l = 0; l < c.num_hidden_layers; ++l)
    if (c.is_moe_layer(l)) moe_layers.push_back(l);
  if (trace != nullptr) trace->assign(moe_layers.size(), {});
  const int k = c.num_experts_per_tok;
  model.set_routing_observer([&](int layer, const int32_t* ids, const float* w, int64_t n) {
    prof.add(layer, ids, w, n);
    if (trace == nullptr) return;
    const size_t i = static_cast<size_t>(std::find(moe_layers.begin(), moe_layers.end(), layer) - moe_layers.begin());
    auto& steps = (*trace)[i];
    for (int64_t t = 0; t < n && static_cast<int64_t>(steps.size()) < kMaxTraceTokens; ++t)
      steps.emplace_back(ids + t * k, ids + (t + 1) * k);
  });
  Status st = Ok{};
  std::vector<float> logits;
  for (size_t i = 0; i < prompts.size() && st.ok(); ++i) {
    KvCache cache = model.make_cache(static_cast<int64_t>(prompts[i].size()));
    logits.resize(prompts[i].size() * static_cast<size_t>(c.vocab_size));
    st = model.forward(prompts[i].data(), static_cast<int>(prompts[i].size()), cache, logits.data());
    if (!st.ok()) st = std::move(st).error().with_context(fmt::format("prompt {}", i));
  }
  model.set_routing_observer({});
  MOEBIUS_TRY(st);
  return prof;
}

}  // namespace moebius::model
