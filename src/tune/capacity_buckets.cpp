#include "tune/capacity_buckets.h"

#include <algorithm>
#include <cstdint>

namespace moebius::tune {

namespace {
constexpr int64_t kMaxBucket = int64_t{1} << 20;
}

Result<CapacityBuckets> CapacityBuckets::make(int max_decode_batch, int verify_width, int prefill_chunk) {
  if (max_decode_batch < 1) return Error::format("must be >= 1, got {}", max_decode_batch).in_field("max_decode_batch");
  if (verify_width < 1) return Error::format("must be >= 1, got {}", verify_width).in_field("verify_width");
  if (prefill_chunk < 1 || prefill_chunk > kMaxBucket)
    return Error::format("must be in [1, {}], got {}", kMaxBucket, prefill_chunk).in_field("prefill_chunk");
  const int64_t decode = int64_t{max_decode_batch} * verify_width;
  if (decode > kMaxBucket)
    return Error::format("decode batch {} x verify width {} exceeds {}", max_decode_batch, verify_width, kMaxBucket)
        .in_field("max_decode_batch");
  CapacityBuckets b;
  b.decode_tokens_ = static_cast<int>(decode);
  b.prefill_chunk_ = prefill_chunk;
  int64_t p = 1;
  for (; p < decode; p *= 2) b.sizes_.push_back(static_cast<int>(p));
  // decode rounded up to a power of two, unless the prefill chunk (also a bucket) is smaller.
  b.sizes_.push_back(static_cast<int>(std::min<int64_t>(p, std::max<int64_t>(decode, prefill_chunk))));
  b.sizes_.push_back(prefill_chunk);
  std::sort(b.sizes_.begin(), b.sizes_.end());
  b.sizes_.erase(std::unique(b.sizes_.begin(), b.sizes_.end()), b.sizes_.end());
  return b;
}

Result<size_t> CapacityBuckets::index_for(int tokens) const {
  if (tokens < 1) return Error::format("a step of {} tokens; the MoE buckets start at 1", tokens);
  const auto it = std::lower_bound(sizes_.begin(), sizes_.end(), tokens);
  if (it == sizes_.end())
    return Error::format("{} tokens exceed the largest MoE capacity bucket {} (decode batch x verify width {}, "
                         "prefill chunk {})",
                         tokens, sizes_.back(), decode_tokens_, prefill_chunk_);
  return static_cast<size_t>(it - sizes_.begin());
}

Result<int> CapacityBuckets::bucket_for(int tokens) const {
  MOEBIUS_ASSIGN_OR_RETURN(size_t i, index_for(tokens));
  return sizes_[i];
}

int tuning_bucket(int bucket) {
  int p = 1;
  while (p < bucket && p < (1 << 30)) p *= 2;
  return p;
}

std::string CapacityBuckets::describe() const {
  std::string s;
  for (int v : sizes_) {
    if (!s.empty()) s += ",";
    s += std::to_string(v);
  }
  return s + fmt::format(" (decode x verify {}, prefill chunk {})", decode_tokens_, prefill_chunk_);
}

}  // namespace moebius::tune
