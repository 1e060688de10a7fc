#include "cli/geometry.h"

#include <charconv>
#include <vector>

namespace moebius::cli {

Result<std::vector<int64_t>> parse_int_list(const std::string& spec, const std::string& flag, int64_t max_value) {
  std::vector<int64_t> out;
  size_t pos = 0;
  while (pos <= spec.size()) {
    const size_t comma = spec.find(',', pos);
    const std::string item = spec.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (item.empty() || ec != std::errc() || end != item.data() + item.size())
      return Error::format("'{}' is not an integer in '{}'", item, spec).in_field(flag);
    if (v < 1 || v > max_value)
      return Error::format("{} is outside [1, {}]", v, max_value).in_field(flag);
    out.push_back(v);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

Result<MoeGeometry> parse_geometry(const std::string& spec) {
  // Qwen3-30B-A3B: H=2048, I=768, E=128, k=8 (config.json of Qwen/Qwen3-30B-A3B).
  if (spec == "qwen3-30b-a3b") return MoeGeometry{spec, 2048, 768, 128, 8};
  // Qwen3-235B-A22B: H=4096, I=1536, E=128, k=8.
  if (spec == "qwen3-235b-a22b") return MoeGeometry{spec, 4096, 1536, 128, 8};
  MOEBIUS_ASSIGN_OR_RETURN(auto v, parse_int_list(spec, "--geometry", int64_t{1} << 20));
  if (v.size() != 4)
    return Error::format("expected qwen3-30b-a3b, qwen3-235b-a22b or H,I,E,k; got '{}'", spec).in_field("--geometry");
  if (v[3] > v[2]) return Error::format("top-k {} exceeds the expert count {}", v[3], v[2]).in_field("--geometry");
  if (v[2] > 4096) return Error::format("expert count {} exceeds 4096", v[2]).in_field("--geometry");
  return MoeGeometry{spec, v[0], v[1], static_cast<int>(v[2]), static_cast<int>(v[3])};
}

}  // namespace moebius::cli
