// How ranks are renumbered by a live resize (docs/elastic.md): the ranks that
// stay keep their order, ranks that join come after them.
#ifndef SHARDOPT_COMMON_MEMBERSHIP_H_
#define SHARDOPT_COMMON_MEMBERSHIP_H_

#include <cstdint>
#include <string>
#include <vector>

namespace shardopt {

// The rank in the new epoch of rank `old_rank` of the old one, or -1 when it
// is one of `leave` (the old ranks that leave).
inline int RankAfterResize(int old_rank, const std::vector<int>& leave) {
  int below = 0;
  for (int l : leave) {
    if (l == old_rank) return -1;
    if (l < old_rank) ++below;
  }
  return old_rank - below;
}

// The key a rank started to grow a job sets in the coordinator's store once
// it is ready to join epoch `epoch` as rank `rank` (its process and model are
// up): the coordinator announces the resize to the job's ranks only when
// every new rank has, so that they train on while the new processes start.
inline std::string ResizeReadyKey(int64_t epoch, int rank) {
  return "resize/" + std::to_string(epoch) + "/ready/" + std::to_string(rank);
}

// The key a rank of epoch `epoch` sets once it holds a complete generation of
// in-memory replicas (its own owned state and its neighbour's, shardrun
// --replicate-shards): a lost rank is recovered from them only when every
// other rank has.
inline std::string ReplicaReadyKey(int64_t epoch, int rank) {
  return "replica/" + std::to_string(epoch) + "/ready/" + std::to_string(rank);
}

// The rank that holds a replica of `rank`'s owned state: its predecessor.
inline int ReplicaHolder(int rank, int world) { return (rank + world - 1) % world; }

}  // namespace shardopt

#endif  // SHARDOPT_COMMON_MEMBERSHIP_H_
