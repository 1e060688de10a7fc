#include "offload/placement.h"

#include <algorithm>
#include <numeric>

namespace moebius::offload {

int Placement::resident_count(size_t i) const {
  return static_cast<int>(std::count(resident[i].begin(), resident[i].end(), uint8_t{1}));
}

int64_t Placement::total_resident() const {
  int64_t n = 0;
  for (size_t i = 0; i < resident.size(); ++i) n += resident_count(i);
  return n;
}

double Placement::resident_mass_fraction(const RoutingProfile& profile) const {
  double all = 0, hit = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerRouting* r = profile.find(layers[i]);
    if (r == nullptr) continue;
    for (size_t e = 0; e < r->mass.size() && e < resident[i].size(); ++e) {
      all += r->mass[e];
      if (resident[i][e]) hit += r->mass[e];
    }
  }
  return all > 0 ? hit / all : 0.0;
}

std::vector<int> per_layer_counts(int64_t resident_total, int num_layers, int num_experts) {
  std::vector<int> c(static_cast<size_t>(std::max(num_layers, 0)), 0);
  if (num_layers <= 0) return c;
  const int64_t cap = int64_t{num_layers} * num_experts;
  const int64_t n = std::clamp<int64_t>(resident_total, 0, cap);
  const int64_t base = n / num_layers, rem = n % num_layers;
  for (int i = 0; i < num_layers; ++i) c[static_cast<size_t>(i)] = static_cast<int>(base + (i < rem ? 1 : 0));
  return c;
}

Placement place_uniform(const std::vector<int>& moe_layers, int num_experts, const std::vector<int>& counts) {
  MOEBIUS_ASSERT(counts.size() == moe_layers.size());
  Placement p;
  p.num_experts = num_experts;
  p.layers = moe_layers;
  p.resident.assign(moe_layers.size(), std::vector<uint8_t>(static_cast<size_t>(num_experts), 0));
  for (size_t i = 0; i < moe_layers.size(); ++i) {
    const int n = std::clamp(counts[i], 0, num_experts);
    // floor(j * E / n) is strictly increasing in j for n <= E: n distinct ids.
    for (int j = 0; j < n; ++j)
      p.resident[i][static_cast<size_t>(int64_t{j} * num_experts / n)] = 1;
  }
  return p;
}

Result<Placement> place_hottest(const RoutingProfile& profile, const std::vector<int>& moe_layers, int num_experts,
                                const std::vector<int>& counts, const std::string& source) {
  MOEBIUS_ASSERT(counts.size() == moe_layers.size());
  if (profile.num_experts != num_experts)
    return Error::format("the profile has {} experts per layer, the model {}", profile.num_experts, num_experts)
        .in_file(source)
        .in_field("num_experts");
  Placement p;
  p.num_experts = num_experts;
  p.layers = moe_layers;
  p.from_profile = true;
  p.resident.assign(moe_layers.size(), std::vector<uint8_t>(static_cast<size_t>(num_experts), 0));
  std::vector<int> order(static_cast<size_t>(num_experts));
  for (size_t i = 0; i < moe_layers.size(); ++i) {
    const LayerRouting* r = profile.find(moe_layers[i]);
    if (r == nullptr)
      return Error::format("no entry for MoE layer {} (profiled on another model?)", moe_layers[i])
          .in_file(source)
          .in_field("layers");
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      const size_t ua = static_cast<size_t>(a), ub = static_cast<size_t>(b);
      if (r->mass[ua] != r->mass[ub]) return r->mass[ua] > r->mass[ub];
      return r->counts[ua] > r->counts[ub];  // stable: lower id first on a full tie
    });
    const int n = std::clamp(counts[i], 0, num_experts);
    for (int j = 0; j < n; ++j) p.resident[i][static_cast<size_t>(order[static_cast<size_t>(j)])] = 1;
  }
  return p;
}

}  // namespace moebius::offload
