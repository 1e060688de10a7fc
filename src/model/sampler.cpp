#include "model/sampler.h"

#include "model/softmax_weights.h"

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <utility>

namespace moebius::model {

Status validate_sampler_params(const SamplerParams& p) {
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature))
    return Error::format("must be a finite number >= 0 (0 = greedy), got {}", p.temperature).in_field("--temperature");
  // Sampling multiplies by 1 / T: a temperature so small that it overflows (a denormal) would
  // scale a logit of 0 to NaN.
  if (p.temperature > 0.0f && !std::isfinite(1.0f / p.temperature))
    return Error::format("must be 0 (greedy) or at least {:g}, got {:g}", FLT_MIN, p.temperature).in_field("--temperature");
  if (p.top_k < 0) return Error::format("must be >= 0 (0 = off), got {}", p.top_k).in_field("--top-k");
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f))
    return Error::format("must be in (0, 1] (1 = off), got {}", p.top_p).in_field("--top-p");
  if (!(p.min_p >= 0.0f && p.min_p < 1.0f))
    return Error::format("must be in [0, 1) (0 = off), got {}", p.min_p).in_field("--min-p");
  if (!(p.repetition_penalty > 0.0f) || !std::isfinite(p.repetition_penalty))
    return Error::format("must be a finite number > 0 (1 = off), got {}", p.repetition_penalty)
        .in_field("--repetition-penalty");
  if (!(std::fabs(p.presence_penalty) <= kMaxOpenAiPenalty))
    return Error::format("must be in [-2, 2] (0 = off), got {}", p.presence_penalty).in_field("--presence-penalty");
  if (!(std::fabs(p.frequency_penalty) <= kMaxOpenAiPenalty))
    return Error::format("must be in [-2, 2] (0 = off), got {}", p.frequency_penalty).in_field("--frequency-penalty");
  for (const auto& [id, bias] : p.logit_bias) {
    if (id < 0) return Error::format("token id {} is negative", id).in_field("logit_bias");
    if (!(std::fabs(bias) <= kMaxLogitBias))
      return Error::format("the bias of token {} must be in [-100, 100], got {}", id, bias).in_field("logit_bias");
  }
  return Ok{};
}

int32_t argmax(std::span<const float> logits) {
  int32_t best = 0;
  bool found = false;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (std::isnan(logits[i])) continue;
    if (!found || logits[i] > logits[static_cast<size_t>(best)]) {  // strict: first max wins
      best = static_cast<int32_t>(i);
      found = true;
    }
  }
  return best;
}

Result<Sampler> Sampler::create(const SamplerParams& params) {
  MOEBIUS_TRY(validate_sampler_params(params));
  return Sampler(params);
}

void Sampler::observe_prompt(std::span<const int32_t> ids) {
  if (params_.repetition_penalty != 1.0f) prompt_ids_.insert(ids.begin(), ids.end());
}

Result<std::span<const float>> Sampler::adjusted(std::span<const float> logits) {
  const size_t V = logits.size();
  for (const auto& [id, bias] : params_.logit_bias)
    if (static_cast<size_t>(id) >= V)
      return Error::format("token id {} is outside the vocabulary [0, {})", id, V).in_field("logit_bias");
  const bool repetition = params_.repetition_penalty != 1.0f && (!prompt_ids_.empty() || !output_counts_.empty());
  const bool openai = (params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) && !output_counts_.empty();
  if (!repetition && !openai && params_.logit_bias.empty()) return logits;
  adjusted_.assign(logits.begin(), logits.end());
  if (repetition) {
    // Each seen id once, whether the prompt, the output or both saw it.
    const float p = params_.repetition_penalty;
    // A finite logit stays finite: a penalty near 0 (1e-39 is > 0) would divide a positive logit
    // to +inf, and inf - inf in the softmax is NaN.
    const auto penalize = [&](int32_t id) {
      if (id < 0 || static_cast<size_t>(id) >= V) return;
      float& l = adjusted_[static_cast<size_t>(id)];
      if (!std::isfinite(l)) return;  // -inf stays masked
      l = std::clamp(l > 0.0f ? l / p : l * p, -FLT_MAX, FLT_MAX);
    };
    for (int32_t id : prompt_ids_) penalize(id);
    for (const auto& [id, count] : output_counts_)
      if (!prompt_ids_.contains(id)) penalize(id);
  }
  if (openai) {
    for (const auto& [id, count] : output_counts_) {
      if (id < 0 || static_cast<size_t>(id) >= V) continue;
      adjusted_[static_cast<size_t>(id)] -=
          static_cast<float>(count) * params_.frequency_penalty + params_.presence_penalty;
    }
  }
  for (const auto& [id, bias] : params_.logit_bias) adjusted_[static_cast<size_t>(id)] += bias;
  return std::span<const float>(adjusted_);
}

namespace {

using Scaled = ScaledLogit;
// The sampling order: most probable first, equal scaled logits by ascending id, so it is total.
bool before(const Scaled& a, const Scaled& b) { return a.s > b.s || (a.s == b.s && a.id < b.id); }

double weight(float s, float mx) { return static_cast<double>(exp_weight(s - mx)); }

// Large sets are put in order by a stable LSD radix sort instead of std::sort: a flat row (a high
// temperature, or random weights) puts most of Qwen3's 151,936 ids into one band of the sampling
// order and into top-p's nucleus, and sorting ~140k candidates took ~14 ms a row (docs/PERF.md,
// session 23) against ~1 ms in five counting passes. Below this size std::sort is as fast.
constexpr size_t kRadixMinSize = 2048;

// One scratch per thread whatever the key (a row's worth of candidates at most).
std::vector<Scaled>& radix_scratch() {
  thread_local std::vector<Scaled> tmp;
  return tmp;
}

// Stable sort of v[from, end) by key(c) ascending, `bits` wide, 11 bits a pass (a 2048-entry
// count fits in L1); a pass whose digit is the same for every element is skipped.
template <typename Key>
void radix_sort(std::vector<Scaled>& v, size_t from, Key key, int bits) {
  constexpr int kDigit = 11;
  constexpr size_t kBuckets = size_t{1} << kDigit;
  std::vector<Scaled>& tmp = radix_scratch();
  const size_t n = v.size() - from;
  tmp.resize(n);
  Scaled* src = v.data() + from;
  Scaled* dst = tmp.data();
  for (int shift = 0; shift < bits; shift += kDigit) {
    size_t count[kBuckets] = {};
    for (size_t i = 0; i < n; ++i) ++count[(key(src[i]) >> shift) & (kBuckets - 1)];
    if (count[(key(src[0]) >> shift) & (kBuckets - 1)] == n) continue;
    size_t at = 0;
    for (size_t& c : count) at += std::exchange(c, at);
    for (size_t i = 0; i < n; ++i) dst[count[(key(src[i]) >> shift) & (kBuckets - 1)]++] = src[i];
    std::swap(src, dst);
  }
  if (src != v.data() + from) std::copy(src, src + n, v.data() + from);
}

// Bits of the largest id in v[from, end).
int id_bits(const std::vector<Scaled>& v, size_t from) {
  uint32_t all = 0;
  for (size_t i = from; i < v.size(); ++i) all |= static_cast<uint32_t>(v[i].id);
  return std::max(1, static_cast<int>(std::bit_width(all)));
}

// v[from, end) by ascending id (ids are unique, so any sort is the same order).
void sort_by_id(std::vector<Scaled>& v, size_t from) {
  const auto by_id = [](const Scaled& a, const Scaled& b) { return a.id < b.id; };
  const auto first = v.begin() + static_cast<std::ptrdiff_t>(from);
  if (v.size() - from < kRadixMinSize) std::sort(first, v.end(), by_id);
  else if (!std::is_sorted(first, v.end(), by_id))
    radix_sort(v, from, [](const Scaled& c) { return static_cast<uint32_t>(c.id); }, id_bits(v, from));
}

// v[from, end) in the sampling order (`before`): by id, then stably by a key that orders the
// floats descending (+0 and -0 equal, as `before` has them; no NaN reaches here).
void sort_sampling_order(std::vector<Scaled>& v, size_t from) {
  if (v.size() - from < kRadixMinSize) {
    std::sort(v.begin() + static_cast<std::ptrdiff_t>(from), v.end(), before);
    return;
  }
  sort_by_id(v, from);
  radix_sort(
      v, from,
      [](const Scaled& c) {
        uint32_t u;
        std::memcpy(&u, &c.s, sizeof u);
        if (c.s == 0.0f) u = 0;
        const uint32_t ascending = (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
        return ~ascending;
      },
      32);
}

// The sum over `set` (reordered by id).
double weight_sum_by_id(std::vector<Scaled>& set, float mx) {
  sort_by_id(set, 0);
  double part[8] = {};
  for (const Scaled& c : set) part[c.id & 7] += weight(c.s, mx);
  return combine_partial_sums(part);
}


// The row checks of both paths: an error names the first bad logit (the adjustments never make
// one: their factors and terms are finite, a penalized logit is clamped finite, -inf stays -inf).
Status check_raw_row(std::span<const float> raw) {
  if (raw.empty()) return Error("empty logits row");
  // A NaN or +inf means a broken forward pass: refuse it rather than sample around it (+inf would
  // make every weight e^(x - inf) NaN). First a branch-free pass on the bits (exponent all ones:
  // NaN or +-inf; -inf, a masked token, is fine), then the first culprit for the message.
  uint32_t bad = 0;
  for (const float x : raw) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    bad |= static_cast<uint32_t>((u & 0x7fffffffu) >= 0x7f800000u) & static_cast<uint32_t>(u != 0xff800000u);
  }
  if (bad == 0) return Ok{};
  for (size_t i = 0; i < raw.size(); ++i) {
    if (std::isnan(raw[i]))
      return Error::format("logit {} is NaN: the model's logits are not finite (a NaN or Inf in the checkpoint's "
                           "weights or scales?)",
                           i);
    if (raw[i] == INFINITY)
      return Error::format("logit {} is +inf: the model's logits are not finite (an Inf in the checkpoint's "
                           "weights or scales, or an overflow?)",
                           i);
  }
  return Ok{};
}

// A finite logit that the temperature scales past float's range (|x| / T > 3.4e38): its weight
// would be 0 or NaN. Only absurd rows or temperatures reach it.
Error overflow_error(size_t i, float t) {
  return Error::format("logit {} overflows float at temperature {}", i, t);
}

// The band depths below the largest scaled logit by which sample() extends the sampling order
// when top-k is off (the last band is everything below the deepest).
constexpr float kBandDepth[] = {4.0f, 8.0f, 16.0f, 32.0f, 64.0f};

// sample()'s one pass over the row: the largest scaled logit, the count of live (not -inf)
// logits, the first live one the temperature scales to +-inf (`overflow`, else the row's size),
// and the first candidates of the sampling order, unsorted:
//   top_k > 0: the top_k best (all live ones when there are no more), kept in a buffer of
//     2 top_k (at least 256) that nth_element compacts whenever it fills; after the first
//     compaction only a logit above the k-th best so far can enter (a later id that ties it comes
//     after it in the order);
//   top_k == 0: the first band, s >= max - kBandDepth[0], collected against the running maximum
//     (a rising maximum only raises the bar) and trimmed to the final one at the end.
// One pass instead of three because the passes, not the sorting, are the cost at Qwen3's 151,936
// ids; the branch that collects is rarely taken, so the loop runs at about a cycle per id.
struct RowScan {
  float mx = -INFINITY;
  size_t live = 0;
  size_t overflow;
};
RowScan first_pass(std::span<const float> logits, float inv_t, size_t top_k, std::vector<Scaled>& out) {
  RowScan r{.overflow = logits.size()};
  out.clear();
  float mx = -INFINITY;
  size_t live = 0;
  const size_t cap = std::max<size_t>(2 * top_k, 256);
  float bar = -INFINITY;  // a candidate must scale at least this (top-k: above it once full)
  bool full = false;
  // The row in blocks of 256 ids whose candidates go to a local array first: the inner loop calls
  // nothing, so the maximum, the count and the bar stay in registers (a push_back in the loop
  // kept them in memory: a store and a load per id).
  constexpr size_t kBlock = 256;
  Scaled found[kBlock];
  for (size_t b = 0; b < logits.size(); b += kBlock) {
    const size_t e = std::min(logits.size(), b + kBlock);
    size_t nf = 0;
    for (size_t i = b; i < e; ++i) {
      const float x = logits[i];
      if (x == -INFINITY) continue;
      const float s = x * inv_t;
      if (std::isinf(s)) {
        r.overflow = i;
        return r;
      }
      ++live;
      if (top_k > 0) {
        // The maximum is taken from the k best at the end (the largest always enters, or an
        // equal one with a smaller id already has): a max per id here was a store and a load
        // per id, GCC keeping it in memory.
        if (!full || s > bar) found[nf++] = {s, static_cast<int32_t>(i)};
      } else if (s >= bar) {
        found[nf++] = {s, static_cast<int32_t>(i)};
        if (s > mx) {
          mx = s;
          bar = mx - kBandDepth[0];
        }
      }
    }
    for (size_t j = 0; j < nf; ++j) {
      // top-k: the block's candidates were checked against the bar of its start; a compaction
      // inside the block raises it, so they are checked again as they enter.
      if (top_k > 0 && full && !(found[j].s > bar)) continue;
      out.push_back(found[j]);
      if (top_k > 0 && out.size() == cap) {
        std::nth_element(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(top_k - 1), out.end(), before);
        out.resize(top_k);
        bar = out[top_k - 1].s;
        full = true;
      }
    }
  }
  if (top_k > 0 && out.size() > top_k) {
    std::nth_element(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(top_k - 1), out.end(), before);
    out.resize(top_k);
  }
  if (top_k > 0)
    for (const Scaled& c : out) mx = std::max(mx, c.s);
  if (top_k == 0) std::erase_if(out, [&](const Scaled& c) { return !(c.s >= bar); });
  r.mx = mx;
  r.live = live;
  return r;
}

}  // namespace

// The steps of sampler.h written out literally: every candidate scaled and sorted. Tests compare
// sample()'s fast path (below) against this, draw for draw.
Result<std::vector<std::pair<int32_t, float>>> Sampler::candidates(std::span<const float> raw) {
  MOEBIUS_TRY(check_raw_row(raw));
  MOEBIUS_ASSIGN_OR_RETURN(std::span<const float> logits, adjusted(raw));
  std::vector<std::pair<int32_t, float>> out;
  if (greedy()) {
    const int32_t id = argmax(logits);
    if (logits[static_cast<size_t>(id)] == -INFINITY) return Error("every logit is -inf");
    out.emplace_back(id, 1.0f);
    return out;
  }
  // 1. temperature. -inf logits (masked tokens) stay out.
  std::vector<Scaled> all;
  const float inv_t = 1.0f / params_.temperature;
  for (size_t i = 0; i < logits.size(); ++i) {
    const float x = logits[i];
    if (x == -INFINITY) continue;
    all.push_back({x * inv_t, static_cast<int32_t>(i)});
    if (std::isinf(all.back().s)) return overflow_error(i, params_.temperature);
  }
  if (all.empty()) return Error("every logit is -inf");
  // 2. top-k.
  size_t n = all.size();
  if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < n) n = static_cast<size_t>(params_.top_k);
  std::sort(all.begin(), all.end(), before);
  all.resize(n);
  // 3. softmax, then top-p: the walk in sampling order, the sums by id.
  const float mx = all[0].s;
  std::vector<Scaled> set = all;
  const double total = weight_sum_by_id(set, mx);
  size_t keep = n;
  if (params_.top_p < 1.0f) {
    double cum = 0.0;
    for (size_t i = 0; i < n; ++i) {
      cum += weight(all[i].s, mx) / total;
      if (cum >= params_.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  // 4. min-p, relative to the largest weight (1).
  if (params_.min_p > 0.0f) {
    size_t m = 1;
    while (m < keep && weight(all[m].s, mx) >= static_cast<double>(params_.min_p)) ++m;
    keep = m;
  }
  set.assign(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(keep));
  const double kept = keep == n ? total : weight_sum_by_id(set, mx);
  out.reserve(keep);
  for (size_t i = 0; i < keep; ++i) out.emplace_back(all[i].id, static_cast<float>(weight(all[i].s, mx) / kept));
  return out;
}

double Sampler::next_uniform() {
  // u in [0, 1) from the top 53 bits (drawn even for one candidate, so the RNG stream does not
  // depend on the filters' outcome).
  return static_cast<double>(rng_() >> 11) * 0x1.0p-53;
}

void Sampler::record(int32_t id) {
  if (tracks_output()) ++output_counts_[id];
}

Result<int32_t> Sampler::sample_reference(std::span<const float> logits) {
  MOEBIUS_ASSIGN_OR_RETURN(auto cands, candidates(logits));
  int32_t chosen = cands.back().first;  // if rounding leaves u just above the float sum
  if (greedy()) {
    chosen = cands[0].first;
  } else {
    // 5. walk the cumulative distribution of the candidates' float probabilities.
    const double u = next_uniform();
    double cum = 0.0;
    for (const auto& [id, p] : cands) {
      cum += p;
      if (u < cum) {
        chosen = id;
        break;
      }
    }
  }
  record(chosen);
  return chosen;
}

// The same arithmetic as candidates() + the draw, without sorting the row. A row of Qwen3's
// 151,936 logits took 17.7 ms with top-k off (a sort of the whole row) and 0.52 ms with top-k 20
// (docs/PERF.md); sampling runs on the serving engine's thread for every sequence of every step.
//   top-k on: one pass keeps the k best in a buffer of 2k (compacted with nth_element whenever it
//     fills; then only a logit above the k-th best can enter), then the k are sorted.
//   top-k off: the sampling order is extended band by band, [max - 4, max], then down to max - 8,
//     16, 32, 64, then the rest (one pass over the row each), and the walks of top-p, min-p and
//     the draw stop in the first band that settles them: a language model's row rarely leaves
//     the first. The extracted prefix is always exactly the order's first elements (everything not
//     yet extracted scales below the band's floor).
// The one pass over the whole row that stays is the weight sum (an exp per live logit).
Result<int32_t> Sampler::sample(std::span<const float> raw) {
  MOEBIUS_TRY(check_raw_row(raw));
  MOEBIUS_ASSIGN_OR_RETURN(std::span<const float> logits, adjusted(raw));
  if (greedy()) {
    const int32_t id = argmax(logits);
    if (logits[static_cast<size_t>(id)] == -INFINITY) return Error("every logit is -inf");
    record(id);
    return id;
  }
  const size_t V = logits.size();
  const float inv_t = 1.0f / params_.temperature;
  std::vector<Scaled>& order = scratch_;  // the sampling order's first `order.size()` elements
  const size_t top_k = static_cast<size_t>(params_.top_k);
  const RowScan scan = first_pass(logits, inv_t, top_k, order);
  if (scan.overflow < V) return overflow_error(scan.overflow, params_.temperature);
  if (scan.live == 0) return Error("every logit is -inf");
  const float mx = scan.mx;
  sort_sampling_order(order, 0);
  double total = 0.0;
  size_t n = scan.live;
  bool whole = top_k > 0;  // `order` holds all n candidates (top-k's, or every live one)
  size_t band = 1;         // the next band to extract
  float ceiling = mx - kBandDepth[0];  // every extracted candidate scales at least this; the rest below
  if (top_k > 0) {
    n = std::min(n, top_k);
    id_scratch_ = order;
    total = weight_sum_by_id(id_scratch_, mx);
  } else {
    total = exp_weight_sum(logits, inv_t, mx);
  }

  // Extends `order` by the next band of the sampling order; false when it already holds all n.
  const auto extend = [&]() -> bool {
    if (whole) return false;
    const bool last = band == std::size(kBandDepth);
    const float floor_s = last ? -INFINITY : mx - kBandDepth[band];
    const size_t from = order.size();
    for (size_t i = 0; i < V; ++i) {
      const float x = logits[i];
      if (x == -INFINITY) continue;
      const float s = x * inv_t;
      if (s < ceiling && (last || s >= floor_s)) order.push_back({s, static_cast<int32_t>(i)});
    }
    sort_sampling_order(order, from);
    ceiling = floor_s;
    ++band;
    whole = last;
    return true;
  };
  // The i-th candidate of the sampling order (i < n), extending as needed.
  const auto at = [&](size_t i) -> const Scaled& {
    while (i >= order.size()) MOEBIUS_ASSERT(extend(), "sampling order exhausted at {} of {} candidates", i, n);
    return order[i];
  };

  // 3. top-p, 4. min-p: as candidates().
  size_t keep = n;
  if (params_.top_p < 1.0f) {
    double cum = 0.0;
    for (size_t i = 0; i < n; ++i) {
      cum += weight(at(i).s, mx) / total;
      if (cum >= params_.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  if (params_.min_p > 0.0f) {
    size_t m = 1;
    while (m < keep && weight(at(m).s, mx) >= static_cast<double>(params_.min_p)) ++m;
    keep = m;
  }
  double kept = total;
  if (keep < n) {
    id_scratch_.assign(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep));
    kept = weight_sum_by_id(id_scratch_, mx);
  }
  // 5. the draw over the kept prefix.
  const double u = next_uniform();
  double cum = 0.0;
  int32_t chosen = -1;
  for (size_t i = 0; i < keep; ++i) {
    const Scaled& c = at(i);
    cum += static_cast<float>(weight(c.s, mx) / kept);
    if (u < cum) {
      chosen = c.id;
      break;
    }
  }
  if (chosen < 0) chosen = at(keep - 1).id;
  record(chosen);
  return chosen;
}

}  // namespace moebius::model
