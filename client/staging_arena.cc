#include "client/staging_arena.h"

#include <algorithm>

namespace shardopt {

void StagingArena::Reset(int num_buckets) {
  regions_.assign(static_cast<size_t>(num_buckets), Region());
  held_.clear();
}

std::optional<int64_t> StagingArena::Place(int64_t length, absl::Span<const Region> others) const {
  std::vector<Region> live;  // a few: the buckets filling or in flight
  live.reserve(held_.size() + others.size());
  for (int b : held_) live.push_back(regions_[b]);
  for (const Region& r : others) {
    if (r.length > 0) live.push_back(r);
  }
  std::sort(live.begin(), live.end(),
            [](const Region& a, const Region& b) { return a.begin < b.begin; });
  int64_t at = 0;
  for (const Region& r : live) {
    if (r.begin - at >= length) break;
    at = std::max(at, r.end());
  }
  if (size_ - at < length) return std::nullopt;
  return at;
}

void StagingArena::Hold(int bucket, Region region) {
  if (region.length <= 0) return;
  if (regions_[bucket].length == 0) held_.push_back(bucket);
  regions_[bucket] = region;
}

void StagingArena::Free(int bucket) {
  if (regions_[bucket].length > 0) held_.erase(std::find(held_.begin(), held_.end(), bucket));
  regions_[bucket] = Region();
}

void StagingArena::Clear() {
  std::fill(regions_.begin(), regions_.end(), Region());
  held_.clear();
}

int64_t StagingArena::End(absl::Span<const Region> others) const {
  int64_t end = 0;
  for (int b : held_) end = std::max(end, regions_[b].end());
  for (const Region& r : others) end = std::max(end, r.end());
  return end;
}

std::vector<StagingArena::Move> StagingArena::Compact() {
  std::vector<int> order = held_;
  std::sort(order.begin(), order.end(),
            [this](int a, int b) { return regions_[a].begin < regions_[b].begin; });
  std::vector<Move> moves;
  int64_t at = 0;
  for (int b : order) {
    Region& r = regions_[b];
    if (r.begin != at) {
      moves.push_back(Move{b, r.begin, at, r.length});
      r.begin = at;
    }
    at += r.length;
  }
  return moves;
}

}  // namespace shardopt
