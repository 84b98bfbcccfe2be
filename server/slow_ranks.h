// Slow-rank detection, without the coordinator around it: one busy-time
// sample per heartbeat (the rank's last step time minus its time blocked on
// collectives: a slow rank makes the others wait there, so their step times
// equal its own); at the end of each window, each rank's median is compared
// with the median of the other ranks'. A rank is named slow after `windows`
// windows in a row more than `factor` times that median (and at least
// `min_excess` more), and not slow after as many windows in a row under it.
// Not thread-safe (the coordinator calls it under its lock).
#ifndef SHARDOPT_SERVER_SLOW_RANKS_H_
#define SHARDOPT_SERVER_SLOW_RANKS_H_

#include <string>
#include <vector>

#include "absl/time/time.h"

namespace shardopt {

struct SlowRankOptions {
  double factor = 1.5;
  int windows = 3;
  absl::Duration window = absl::Seconds(5);
  absl::Duration min_excess = absl::Milliseconds(5);
};

class SlowRankDetector {
 public:
  explicit SlowRankDetector(SlowRankOptions options = {}) : options_(options) {}

  // `world_size` ranks, none slow, no sample.
  void Reset(int world_size);
  // One busy sample of `rank` (seconds; negative values count as 0).
  void AddBusy(int rank, double step_seconds, double comm_wait_seconds);

  // What one window says of a rank that finished a step in it.
  struct Verdict {
    int rank = 0;
    double busy_p50 = 0;   // its median busy time over the window
    double ratio = 0;      // busy_p50 / the others' median (inf when theirs is 0)
    bool changed = false;  // it became slow, or stopped being slow
    bool slow = false;     // its state after this window
    std::string reason;    // why it is slow ("" when not)
    std::string event;     // when changed: "rank 2 is slow: ..." / "... is no longer slow: ..."
  };
  // Ends the window. `eligible[r]`: rank r is in the job and has not
  // finished (others are left out, and their samples dropped). Needs two
  // ranks with samples; returns a verdict for each rank that has some.
  std::vector<Verdict> EndWindow(const std::vector<bool>& eligible);

  bool slow(int rank) const { return ranks_[rank].slow; }

 private:
  struct Rank {
    std::vector<double> busy;  // this window's samples
    int streak = 0;            // windows in a row that argue for changing `slow`
    bool slow = false;
  };
  SlowRankOptions options_;
  std::vector<Rank> ranks_;
};

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_SLOW_RANKS_H_
