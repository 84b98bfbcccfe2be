// The bookkeeping of the shard_gradients staging arena (no tensors, no
// locks): one buffer of size() elements in which buckets waiting for their
// reduce-scatter hold a region each (first fit), beside the regions of the
// pieces a large bucket is reduced in (which the caller passes in). The
// optimizer owns the memory and does what this decides: it copies the data
// when Compact() moves regions, and allocates a buffer of a bucket's own when
// Place() finds no room.
#ifndef SHARDOPT_CLIENT_STAGING_ARENA_H_
#define SHARDOPT_CLIENT_STAGING_ARENA_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/types/span.h"

namespace shardopt {

class StagingArena {
 public:
  struct Region {
    int64_t begin = 0;
    int64_t length = 0;  // 0: none
    int64_t end() const { return begin + length; }
  };
  // A region Compact() moved: copy `length` elements from `from` to `to`
  // (in this order: each move's destination is below every later source).
  struct Move {
    int bucket;
    int64_t from, to, length;
  };

  // `num_buckets` buckets, none holding a region; the size stays.
  void Reset(int num_buckets);

  int64_t size() const { return size_; }
  void set_size(int64_t elements) { size_ = elements; }

  // The lowest start at which `length` elements fit between the regions
  // held (the buckets' and `others`), or nullopt when they do not fit before
  // size().
  std::optional<int64_t> Place(int64_t length, absl::Span<const Region> others = {}) const;
  // Bucket `bucket` holds `region` (from Place()).
  void Hold(int bucket, Region region);
  // Bucket `bucket` holds nothing any more (a no-op if it held nothing).
  void Free(int bucket);
  // Every region dropped (the arena's memory was abandoned).
  void Clear();

  const Region& region(int bucket) const { return regions_[bucket]; }
  // Buckets holding a region, in the order they got it.
  const std::vector<int>& held() const { return held_; }
  // The end of the highest region held (0 when none).
  int64_t End(absl::Span<const Region> others = {}) const;
  // Moves the buckets' regions to the arena's start, in their current order,
  // so the free room is one region after them. Returns what moved (their
  // data must be copied by the caller, in the returned order). Only valid
  // when no other region (piece) is live.
  std::vector<Move> Compact();

 private:
  int64_t size_ = 0;
  std::vector<Region> regions_;  // per bucket
  std::vector<int> held_;
};

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_STAGING_ARENA_H_
