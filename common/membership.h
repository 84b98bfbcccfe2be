// How ranks are renumbered by a live resize (docs/elastic.md): the ranks that
// stay keep their order, ranks that join come after them.
#ifndef SHARDOPT_COMMON_MEMBERSHIP_H_
#define SHARDOPT_COMMON_MEMBERSHIP_H_

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

}  // namespace shardopt

#endif  // SHARDOPT_COMMON_MEMBERSHIP_H_
