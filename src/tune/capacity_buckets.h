// Capacity buckets: the token counts the MoE layers are built and tuned for. Powers of two up to
// the largest decode graph batch times the verify width (the tokens one decode step carries; the
// last bucket is that product rounded up to a power of two, or the prefill chunk if that is
// smaller), plus one bucket for the prefill chunk. A step of T tokens runs on the smallest bucket
// >= T (binary search); a T above the largest bucket is an error, never an out-of-bounds index.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "core/error.h"

namespace moebius::tune {

// The token count a bucket is tuned and cached at: the bucket rounded up to a power of two, so a
// prefill chunk sized by the prompt (generate) shares the tuning of its power of two instead of
// tuning anew for every length. The layer itself keeps the bucket's exact capacity.
int tuning_bucket(int bucket);

class CapacityBuckets {
 public:
  // max_decode_batch, verify_width, prefill_chunk >= 1; their product and the chunk <= 1 << 20.
  static Result<CapacityBuckets> make(int max_decode_batch, int verify_width, int prefill_chunk);

  // The smallest bucket >= tokens: the bucket's size / its index. tokens < 1 or above largest()
  // is an error naming both.
  Result<int> bucket_for(int tokens) const;
  Result<size_t> index_for(int tokens) const;

  std::span<const int> sizes() const { return sizes_; }
  size_t size() const { return sizes_.size(); }
  int largest() const { return sizes_.back(); }
  int prefill_chunk() const { return prefill_chunk_; }
  std::string describe() const;  // "1,2,4,...,64,2048 (decode x verify 64, prefill chunk 2048)"

 private:
  CapacityBuckets() = default;
  std::vector<int> sizes_;  // ascending, distinct, non-empty
  int decode_tokens_ = 1, prefill_chunk_ = 1;
};

}  // namespace moebius::tune
