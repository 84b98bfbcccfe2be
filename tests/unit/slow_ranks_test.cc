// Slow-rank detection (server/slow_ranks.h) alone: the comparison with the
// others' median, the streak of windows before a change, recovery, and the
// ranks left out.
#include "server/slow_ranks.h"

#include <vector>

#include "gtest/gtest.h"

namespace shardopt {
namespace {

SlowRankOptions Options() {
  SlowRankOptions o;
  o.factor = 1.5;
  o.windows = 2;
  o.window = absl::Seconds(1);
  o.min_excess = absl::Milliseconds(5);
  return o;
}

// One window in which rank r's steps took busy[r] seconds (no waiting).
std::vector<SlowRankDetector::Verdict> Window(SlowRankDetector& d, const std::vector<double>& busy,
                                              std::vector<bool> eligible = {}) {
  if (eligible.empty()) eligible.assign(busy.size(), true);
  for (int r = 0; r < static_cast<int>(busy.size()); ++r) {
    for (int i = 0; i < 3; ++i) d.AddBusy(r, busy[r], 0);
  }
  return d.EndWindow(eligible);
}

TEST(SlowRankDetectorTest, SlowAfterTheStreakAndBackAfterAsMany) {
  SlowRankDetector d(Options());
  d.Reset(3);
  auto v = Window(d, {0.1, 0.1, 0.3});
  ASSERT_EQ(v.size(), 3u);
  EXPECT_FALSE(v[2].changed);  // one window over: not yet
  EXPECT_DOUBLE_EQ(v[2].ratio, 3.0);
  v = Window(d, {0.1, 0.1, 0.3});
  EXPECT_TRUE(v[2].changed);
  EXPECT_TRUE(v[2].slow);
  EXPECT_NE(v[2].event.find("rank 2 is slow: "), std::string::npos) << v[2].event;
  EXPECT_NE(v[2].reason.find("3.0x the median of the others"), std::string::npos) << v[2].reason;
  EXPECT_FALSE(v[0].slow);
  v = Window(d, {0.1, 0.1, 0.1});
  EXPECT_FALSE(v[2].changed);
  EXPECT_TRUE(d.slow(2));
  v = Window(d, {0.1, 0.1, 0.1});
  EXPECT_TRUE(v[2].changed);
  EXPECT_FALSE(v[2].slow);
  EXPECT_NE(v[2].event.find("rank 2 is no longer slow"), std::string::npos) << v[2].event;
}

TEST(SlowRankDetectorTest, AnInterruptedStreakStartsAgain) {
  SlowRankDetector d(Options());
  d.Reset(2);
  Window(d, {0.1, 0.3});
  Window(d, {0.1, 0.1});  // back under: the streak ends
  auto v = Window(d, {0.1, 0.3});
  EXPECT_FALSE(v[1].changed);
}

TEST(SlowRankDetectorTest, SmallDifferencesAndLoneRanksGiveNoVerdict) {
  SlowRankDetector d(Options());
  d.Reset(2);
  for (int i = 0; i < 4; ++i) {
    auto v = Window(d, {0.001, 0.004});  // 4x, but only 3 ms more (min_excess 5 ms)
    EXPECT_FALSE(v[1].slow);
  }
  // A rank that finished (or has no step) is left out: one rank alone, no verdict.
  EXPECT_TRUE(Window(d, {0.1, 0.9}, {true, false}).empty());
}

TEST(SlowRankDetectorTest, WaitingOnCollectivesIsNotBusyTime) {
  SlowRankDetector d(Options());
  d.Reset(2);
  for (int w = 0; w < 2; ++w) {
    d.AddBusy(0, 0.5, 0.4);  // waited for rank 1 most of its step
    d.AddBusy(1, 0.5, 0.0);
    auto v = d.EndWindow({true, true});
    ASSERT_EQ(v.size(), 2u);
    EXPECT_NEAR(v[0].busy_p50, 0.1, 1e-12);
    if (w == 1) EXPECT_TRUE(v[1].slow);
  }
}

}  // namespace
}  // namespace shardopt
