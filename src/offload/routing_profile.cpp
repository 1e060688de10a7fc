#include "offload/routing_profile.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/json_depth.h"
#include "core/memory.h"

namespace moebius::offload {

using nlohmann::json;

namespace {
constexpr const char* kFormat = "moebius-routing-profile";
}  // namespace

RoutingProfile make_profile(int num_experts, int top_k) {
  RoutingProfile p;
  p.num_experts = num_experts;
  p.top_k = top_k;
  return p;
}

const LayerRouting* RoutingProfile::find(int layer) const {
  for (const LayerRouting& l : layers)
    if (l.layer == layer) return &l;
  return nullptr;
}

void RoutingProfile::add(int layer, const int32_t* ids, const float* weights, int64_t num_tokens) {
  auto it = std::lower_bound(layers.begin(), layers.end(), layer,
                             [](const LayerRouting& a, int l) { return a.layer < l; });
  if (it == layers.end() || it->layer != layer) {
    LayerRouting r;
    r.layer = layer;
    r.counts.assign(static_cast<size_t>(num_experts), 0);
    r.mass.assign(static_cast<size_t>(num_experts), 0.0);
    it = layers.insert(it, std::move(r));
  }
  for (int64_t i = 0; i < num_tokens * top_k; ++i) {
    const int32_t e = ids[i];
    MOEBIUS_ASSERT(e >= 0 && e < num_experts, "routed expert {} outside [0, {})", e, num_experts);
    it->counts[static_cast<size_t>(e)] += 1;
    it->mass[static_cast<size_t>(e)] += static_cast<double>(weights[i]);
  }
  // `tokens` counts the tokens of one layer: the first MoE layer's adds define it.
  if (it == layers.begin()) tokens += static_cast<uint64_t>(num_tokens);
}

Status RoutingProfile::validate() const {
  if (num_experts < 1 || num_experts > kMaxProfileExperts)
    return Error::format("must be in [1, {}], got {}", kMaxProfileExperts, num_experts).in_field("num_experts");
  if (top_k < 1 || top_k > num_experts)
    return Error::format("must be in [1, num_experts {}], got {}", num_experts, top_k).in_field("top_k");
  if (layers.size() > static_cast<size_t>(kMaxProfileLayers))
    return Error::format("{} layers; at most {}", layers.size(), kMaxProfileLayers).in_field("layers");
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerRouting& l = layers[i];
    const std::string where = fmt::format("layers[{}]", i);
    if (l.layer < 0) return Error::format("layer index {} is negative", l.layer).in_field(where + ".layer");
    if (i > 0 && l.layer <= layers[i - 1].layer)
      return Error::format("layer {} follows layer {}: layers must be listed once, in ascending order", l.layer,
                           layers[i - 1].layer)
          .in_field(where + ".layer");
    if (l.counts.size() != static_cast<size_t>(num_experts))
      return Error::format("{} values for num_experts {}", l.counts.size(), num_experts).in_field(where + ".counts");
    if (l.mass.size() != static_cast<size_t>(num_experts))
      return Error::format("{} values for num_experts {}", l.mass.size(), num_experts).in_field(where + ".mass");
    for (size_t e = 0; e < l.mass.size(); ++e)
      if (!std::isfinite(l.mass[e]) || l.mass[e] < 0)
        return Error::format("expert {}: mass {} is not a finite non-negative number", e, l.mass[e])
            .in_field(where + ".mass");
  }
  return Ok{};
}

std::string profile_to_json(const RoutingProfile& p) {
  json layers = json::array();
  for (const LayerRouting& l : p.layers) layers.push_back({{"layer", l.layer}, {"counts", l.counts}, {"mass", l.mass}});
  json j = {{"format", kFormat},       {"version", 1},       {"num_experts", p.num_experts},
            {"top_k", p.top_k},        {"tokens", p.tokens}, {"layers", std::move(layers)}};
  return j.dump() + "\n";
}

Result<RoutingProfile> profile_from_json(const std::string& text, const std::string& source) {
  if (text.size() > kMaxProfileBytes)
    return Error::format("{} bytes; a routing profile is at most {}", text.size(), kMaxProfileBytes).in_file(source);
  // [TAG_JSON_DEPTH] Nothing below copies or dumps a nested value today; the check keeps it so.
  if (Status depth = check_json_depth(text); !depth.ok()) return std::move(depth).error().in_file(source);
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Error("not valid JSON").in_file(source);
  if (!j.is_object()) return Error("the top level is not an object").in_file(source);
  for (const auto& [key, v] : j.items()) {
    (void)v;
    if (key != "format" && key != "version" && key != "num_experts" && key != "top_k" && key != "tokens" &&
        key != "layers")
      return Error("unknown field").in_file(source).in_field(key);
  }
  auto need = [&](const char* key) -> Result<const json*> {
    auto it = j.find(key);
    if (it == j.end()) return Error("missing").in_file(source).in_field(key);
    return &*it;
  };
  auto integer = [&](const json& v, const std::string& field, int64_t lo, int64_t hi) -> Result<int64_t> {
    if (!v.is_number_integer()) return Error("not an integer").in_file(source).in_field(field);
    // nlohmann parses non-negative integers as unsigned: compare in the right type each way.
    const bool out = v.is_number_unsigned()
                         ? v.get<uint64_t>() > static_cast<uint64_t>(hi) ||
                               (lo > 0 && v.get<uint64_t>() < static_cast<uint64_t>(lo))
                         : (v.get<int64_t>() < lo || v.get<int64_t>() > hi);
    if (out)
      return Error::format("{} is outside [{}, {}]", v.dump(), lo, hi).in_file(source).in_field(field);
    return v.is_number_unsigned() ? static_cast<int64_t>(v.get<uint64_t>()) : v.get<int64_t>();
  };
  MOEBIUS_ASSIGN_OR_RETURN(const json* fmt_v, need("format"));
  if (!fmt_v->is_string() || fmt_v->get<std::string>() != kFormat)
    return Error::format("expected \"{}\"", kFormat).in_file(source).in_field("format");
  MOEBIUS_ASSIGN_OR_RETURN(const json* ver, need("version"));
  MOEBIUS_ASSIGN_OR_RETURN(int64_t version, integer(*ver, "version", 0, 1 << 20));
  if (version != 1) return Error::format("version {} is not supported (1 is)", version).in_file(source).in_field("version");
  RoutingProfile p;
  MOEBIUS_ASSIGN_OR_RETURN(const json* ne, need("num_experts"));
  MOEBIUS_ASSIGN_OR_RETURN(int64_t E, integer(*ne, "num_experts", 1, kMaxProfileExperts));
  p.num_experts = static_cast<int>(E);
  MOEBIUS_ASSIGN_OR_RETURN(const json* tk, need("top_k"));
  MOEBIUS_ASSIGN_OR_RETURN(int64_t k, integer(*tk, "top_k", 1, E));
  p.top_k = static_cast<int>(k);
  MOEBIUS_ASSIGN_OR_RETURN(const json* tok, need("tokens"));
  MOEBIUS_ASSIGN_OR_RETURN(int64_t tokens, integer(*tok, "tokens", 0, INT64_MAX));
  p.tokens = static_cast<uint64_t>(tokens);
  MOEBIUS_ASSIGN_OR_RETURN(const json* ls, need("layers"));
  if (!ls->is_array()) return Error("not an array").in_file(source).in_field("layers");
  if (ls->size() > static_cast<size_t>(kMaxProfileLayers))
    return Error::format("{} layers; at most {}", ls->size(), kMaxProfileLayers).in_file(source).in_field("layers");
  for (size_t i = 0; i < ls->size(); ++i) {
    const json& l = (*ls)[i];
    const std::string where = fmt::format("layers[{}]", i);
    if (!l.is_object()) return Error("not an object").in_file(source).in_field(where);
    for (const auto& [key, v] : l.items()) {
      (void)v;
      if (key != "layer" && key != "counts" && key != "mass")
        return Error("unknown field").in_file(source).in_field(where + "." + key);
    }
    if (!l.contains("layer") || !l.contains("counts") || !l.contains("mass"))
      return Error("needs \"layer\", \"counts\" and \"mass\"").in_file(source).in_field(where);
    LayerRouting r;
    MOEBIUS_ASSIGN_OR_RETURN(int64_t li, integer(l["layer"], where + ".layer", 0, 1 << 20));
    r.layer = static_cast<int>(li);
    const json& c = l["counts"];
    const json& m = l["mass"];
    if (!c.is_array() || c.size() != static_cast<size_t>(E))
      return Error::format("needs an array of num_experts = {} integers", E).in_file(source).in_field(where + ".counts");
    if (!m.is_array() || m.size() != static_cast<size_t>(E))
      return Error::format("needs an array of num_experts = {} numbers", E).in_file(source).in_field(where + ".mass");
    r.counts.resize(static_cast<size_t>(E));
    r.mass.resize(static_cast<size_t>(E));
    for (size_t e = 0; e < static_cast<size_t>(E); ++e) {
      MOEBIUS_ASSIGN_OR_RETURN(int64_t ce, integer(c[e], fmt::format("{}.counts[{}]", where, e), 0, INT64_MAX));
      r.counts[e] = static_cast<uint64_t>(ce);
      if (!m[e].is_number())
        return Error("not a number").in_file(source).in_field(fmt::format("{}.mass[{}]", where, e));
      r.mass[e] = m[e].get<double>();
    }
    p.layers.push_back(std::move(r));
  }
  if (auto st = p.validate(); !st.ok()) return std::move(st).error().in_file(source);
  return p;
}

Status write_profile(const RoutingProfile& p, const std::string& path) {
  MOEBIUS_TRY(p.validate());
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) return Error("cannot open for writing").in_file(tmp);
    f << profile_to_json(p);
    if (!f.flush()) return Error("write failed").in_file(tmp);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return Error::format("cannot rename {} over it: {}", tmp, ec.message()).in_file(path);
  return Ok{};
}

Result<RoutingProfile> read_profile(const std::string& path) {
  MOEBIUS_ASSIGN_OR_RETURN(std::string text, read_small_file(path, kMaxProfileBytes));
  return profile_from_json(text, path);
}

}  // namespace moebius::offload
