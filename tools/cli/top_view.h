// The frame of `shardctl top`: a pure function from a job's status (the
// coordinator's GetJobResponse) and a terminal size to the lines to show.
// No I/O and no clock: shardctl.cc owns the terminal, the refresh loop and the
// RPCs; tests/unit/top_view_test.cc checks the frames.
//
// A frame is
//   job J  running  2 ranks  step 40  lr 0.0001  up 47s  slow ranks: none
//   failure: ...                         (only when the job failed)
//   <status>                             (only when given, e.g. an unreachable coordinator)
//    rank    step  t p50  t max  samp/s   comm  optim    memory hb age  note
//   *   0      41  1.07s  2.55s    61.6  342ms 30.0ms 880.6 MiB   0.1s  slowest
//       1      40  1.07s  2.56s    61.7  105ms  116ms 880.6 MiB   0.7s
//   ... 1000 more ranks                  (when the ranks do not fit the height)
// Values a rank has not reported (0 in the protocol) show as "-". The slowest
// rank (highest step-time p50 over the coordinator's window; lowest samples/s
// when no rank reports window times) carries a '*' in the first column and the
// note "slowest", and with `highlight` its line is drawn in reverse video;
// ranks the coordinator names slow carry '!' and "SLOW: <reason>".
#ifndef SHARDOPT_TOOLS_CLI_TOP_VIEW_H_
#define SHARDOPT_TOOLS_CLI_TOP_VIEW_H_

#include <string>
#include <vector>

#include "proto/shardopt.pb.h"

namespace shardopt {

struct TopViewOptions {
  // Columns: every line is cut to this many characters (escape sequences not
  // counted). 0: no limit.
  int width = 80;
  // Rows: at most this many lines; ranks that do not fit are summarized in one
  // line "... N more ranks", always keeping the slowest, the slow-flagged and
  // the dead ranks on screen. 0: no limit.
  int height = 0;
  // Reverse video (ANSI SGR 7) on the slowest rank's line, padded to the
  // width. Off: plain text only (the '*' marker remains).
  bool highlight = false;
  // One line under the header, e.g. an unreachable coordinator; "" for none.
  std::string status;
};

// The slowest rank, or -1 when there is none to name: the highest
// step_seconds_p50 (then step_seconds_max, then the lowest rank) among ranks
// that report one, when at least two do and they differ; otherwise the lowest
// samples_per_s under the same conditions.
int SlowestRank(const v1::GetJobResponse& job);

// "membership: epoch 2; last change at step 268: 3 -> 2 ranks, left: 1, 0.03s" (and a pending
// resize), or "" for a job that never changed its ranks: shardctl status and top.
std::string MembershipLine(const v1::GetJobResponse& job);

// The frame's lines, without line terminators. `job` may be null (no answer
// from the coordinator yet): the frame is then the status line alone.
std::vector<std::string> RenderTopView(const v1::GetJobResponse* job,
                                       const TopViewOptions& options);

// Formatting used by the frame (exposed for tests). Each gives "-" for 0,
// negative or non-finite values (unknown in the protocol).
std::string TopSeconds(double seconds);   // "85us", "4.20ms", "41.3ms", "412ms", "1.23s", "812s"
std::string TopBytes(int64_t bytes);      // "812 B", "12.5 KiB", "812.9 MiB", "1.23 GiB"
std::string TopDuration(double seconds);  // "12s", "5m03s", "1h02m03s", "3d04h"

}  // namespace shardopt

#endif  // SHARDOPT_TOOLS_CLI_TOP_VIEW_H_
