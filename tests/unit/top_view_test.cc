// The frame of `shardctl top` (tools/cli/top_view.h): header, one line per rank,
// the slowest rank marked and highlighted, truncation to the terminal's width
// and height, "-" for values a rank has not reported.
#include "tools/cli/top_view.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"

namespace shardopt {
namespace {

// A running job whose ranks report everything; rank r's step time p50 is
// 0.1 + 0.01 r s unless overridden.
v1::GetJobResponse Job(int world) {
  v1::GetJobResponse job;
  job.set_job_id("job");
  job.set_state("running");
  job.set_world_size(world);
  job.set_step(120);
  job.set_learning_rate(1e-4);
  job.set_duration_seconds(65);
  for (int r = 0; r < world; ++r) {
    v1::RankStatus* rs = job.add_ranks();
    rs->set_rank(r);
    rs->set_address(absl::StrCat("127.0.0.1:", 5000 + r));
    rs->set_step(120 + r % 2);
    rs->set_seconds_since_heartbeat(0.4);
    rs->set_alive(true);
    rs->set_samples_per_s(150.0 - r);
    rs->set_step_seconds_p50(0.1 + 0.01 * r);
    rs->set_step_seconds_max(0.2 + 0.01 * r);
    v1::RankMetrics* m = rs->mutable_metrics();
    m->set_comm_wait_seconds(0.012);
    m->set_update_seconds(0.0031);
    m->set_rss_bytes(int64_t{812} << 20);
  }
  return job;
}

// The line of rank r ("" when not shown): marker, then the rank in 4 columns.
std::string RankLine(const std::vector<std::string>& lines, int r) {
  for (const auto& l : lines) {
    const std::string plain = absl::StartsWith(l, "\x1b[7m") ? l.substr(4) : l;
    if (plain.size() > 6 && plain.substr(1, 4) == absl::StrFormat("%4d", r)) return l;
  }
  return "";
}

std::string Joined(const std::vector<std::string>& lines) {
  std::string s;
  for (const auto& l : lines) absl::StrAppend(&s, l, "\n");
  return s;
}

TEST(TopViewTest, HeaderAndOneLinePerRank) {
  v1::GetJobResponse job = Job(2);
  TopViewOptions o;
  o.width = 120;
  auto lines = RenderTopView(&job, o);
  ASSERT_EQ(lines.size(), 4u) << Joined(lines);
  EXPECT_EQ(lines[0], "job job  running  2 ranks  step 120  lr 0.0001  up 1m05s  slow ranks: none");
  EXPECT_EQ(lines[1], " rank    step  t p50  t max  samp/s   comm  optim    memory hb age  note");
  EXPECT_EQ(lines[2], "    0     120  100ms  200ms   150.0 12.0ms 3.10ms 812.0 MiB   0.4s");
  EXPECT_EQ(lines[3],
            "*   1     121  110ms  210ms   149.0 12.0ms 3.10ms 812.0 MiB   0.4s  slowest");
}

// An elastic job's membership: the last change (a drain, a lost rank) and a
// pending resize, under the header (as in shardctl status).
TEST(TopViewTest, MembershipChangesAreShown) {
  v1::GetJobResponse job = Job(2);
  EXPECT_EQ(MembershipLine(job), "") << "a job that never changed its ranks";
  job.set_epoch(2);
  v1::MembershipChange* grow = job.add_membership();
  grow->set_epoch(1);
  grow->set_from_world(2);
  grow->set_to_world(3);
  grow->set_step(40);
  grow->add_joined(2);
  grow->set_seconds(0.8);
  v1::MembershipChange* lost = job.add_membership();
  lost->set_epoch(2);
  lost->set_from_world(3);
  lost->set_to_world(2);
  lost->set_step(95);
  lost->add_left(1);
  lost->set_lost(true);
  lost->set_seconds(0.02);
  EXPECT_EQ(MembershipLine(job),
            "membership: epoch 2; last change at step 95: 3 -> 2 ranks, lost (recovered from "
            "replicas): 1, 0.02s");
  job.set_resize_pending_world(4);
  TopViewOptions o;
  o.width = 200;
  auto lines = RenderTopView(&job, o);
  ASSERT_GE(lines.size(), 2u);
  EXPECT_EQ(lines[1],
            "membership: epoch 2; last change at step 95: 3 -> 2 ranks, lost (recovered from "
            "replicas): 1, 0.02s; resize to 4 ranks pending");
}

TEST(TopViewTest, SlowestIsMarkedAndHighlighted) {
  v1::GetJobResponse job = Job(4);
  job.mutable_ranks(2)->set_step_seconds_p50(0.9);  // clearly the slowest
  job.mutable_ranks(2)->set_slow(true);
  job.mutable_ranks(2)->set_slow_reason("step time 0.9s > 1.5x median 0.11s");
  job.add_slow_ranks(2);
  EXPECT_EQ(SlowestRank(job), 2);
  TopViewOptions o;
  o.width = 140;
  o.highlight = true;
  auto lines = RenderTopView(&job, o);
  EXPECT_NE(lines[0].find("slow ranks: 2"), std::string::npos) << lines[0];
  int highlighted = 0;
  for (const auto& l : lines) {
    if (absl::StartsWith(l, "\x1b[7m")) {
      ++highlighted;
      EXPECT_TRUE(absl::EndsWith(l, "\x1b[0m")) << l;
      const std::string plain = l.substr(4, l.size() - 8);
      EXPECT_EQ(plain.size(), 140u) << "padded to the width";
      EXPECT_EQ(plain[0], '*');
      EXPECT_EQ(plain.substr(1, 4), "   2");
      EXPECT_NE(plain.find("900ms"), std::string::npos);
      EXPECT_NE(plain.find("slowest, SLOW: step time 0.9s > 1.5x median 0.11s"), std::string::npos)
          << plain;
    }
  }
  EXPECT_EQ(highlighted, 1) << Joined(lines);
  // Without highlighting: plain text, the marker stays.
  o.highlight = false;
  lines = RenderTopView(&job, o);
  for (const auto& l : lines) EXPECT_EQ(l.find('\x1b'), std::string::npos) << l;
  EXPECT_EQ(RankLine(lines, 2)[0], '*');
  EXPECT_EQ(RankLine(lines, 1)[0], ' ');

  // A slow-flagged rank that is not the slowest: '!'.
  job.mutable_ranks(2)->set_slow(false);
  job.mutable_ranks(3)->set_slow(true);
  lines = RenderTopView(&job, o);
  EXPECT_EQ(RankLine(lines, 3)[0], '!');
  EXPECT_NE(RankLine(lines, 3).find("SLOW"), std::string::npos);
}

TEST(TopViewTest, SlowestFallsBackToThroughputAndNeedsADifference) {
  v1::GetJobResponse job = Job(3);
  for (auto& r : *job.mutable_ranks()) {
    r.set_step_seconds_p50(0);
    r.set_step_seconds_max(0);
  }
  job.mutable_ranks(0)->set_samples_per_s(90);
  EXPECT_EQ(SlowestRank(job), 0);
  for (auto& r : *job.mutable_ranks()) r.set_samples_per_s(100);
  EXPECT_EQ(SlowestRank(job), -1) << "all equal: no slowest";
  for (auto& r : *job.mutable_ranks()) r.set_samples_per_s(0);
  EXPECT_EQ(SlowestRank(job), -1) << "nothing known";
  v1::GetJobResponse one = Job(1);
  EXPECT_EQ(SlowestRank(one), -1) << "one rank is not slower than anyone";
  auto lines = RenderTopView(&one, TopViewOptions());
  for (const auto& l : lines) EXPECT_EQ(l.find("slowest"), std::string::npos) << l;
}

TEST(TopViewTest, UnknownValuesShowAsDash) {
  // What a coordinator (or trainer) that does not fill the new fields sends.
  v1::GetJobResponse job;
  job.set_job_id("j");
  job.set_state("starting");
  job.set_world_size(3);
  v1::RankStatus* r0 = job.add_ranks();
  r0->set_rank(0);
  r0->set_address("127.0.0.1:1");
  r0->set_seconds_since_heartbeat(1.25);
  r0->set_alive(true);
  v1::RankStatus* r1 = job.add_ranks();
  r1->set_rank(1);
  r1->set_seconds_since_heartbeat(-1);
  v1::RankStatus* r2 = job.add_ranks();  // joined, silent past the timeout
  r2->set_rank(2);
  r2->set_address("127.0.0.1:2");
  r2->set_seconds_since_heartbeat(30);
  auto lines = RenderTopView(&job, TopViewOptions());
  ASSERT_EQ(lines.size(), 5u) << Joined(lines);
  EXPECT_EQ(lines[0], "job j  starting  3 ranks  step 0  lr -  up -  slow ranks: none");
  EXPECT_EQ(lines[2], "    0       0      -      -       -      -      -         -   1.2s");
  EXPECT_EQ(lines[3],
            "    1       -      -      -       -      -      -         -      -  not joined");
  EXPECT_EQ(lines[4], "    2       0      -      -       -      -      -         -   DEAD");
  // A finished job's ranks stop beating: not dead.
  job.set_state("finished");
  lines = RenderTopView(&job, TopViewOptions());
  EXPECT_EQ(lines[4].find("DEAD"), std::string::npos) << lines[4];
  EXPECT_NE(lines[4].find("30.0s"), std::string::npos) << lines[4];
  // Memory: RSS, else the optimizer's bytes by role.
  job.mutable_ranks(0)->mutable_metrics()->set_state_bytes(1 << 20);
  job.mutable_ranks(0)->mutable_metrics()->set_grad_bytes(1 << 20);
  EXPECT_NE(RenderTopView(&job, TopViewOptions())[2].find("2.0 MiB"), std::string::npos);
  // No rank yet; no answer yet.
  v1::GetJobResponse empty;
  empty.set_world_size(2);
  lines = RenderTopView(&empty, TopViewOptions());
  EXPECT_EQ(lines.back(), "(no rank has joined yet; 2 expected)");
  TopViewOptions o;
  o.status = "status: cannot reach the coordinator (connection refused) [127.0.0.1:9]";
  lines = RenderTopView(nullptr, o);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0], o.status);
}

TEST(TopViewTest, LinesAreCutToTheWidth) {
  v1::GetJobResponse job = Job(2);
  job.set_failure("rank 1 was killed by signal 9 and this is a long explanation of it");
  TopViewOptions o;
  o.status = "status: cannot reach the coordinator (failed to connect to all addresses)";
  o.highlight = true;
  for (int width : {1, 10, 40, 79, 80, 200}) {
    o.width = width;
    auto lines = RenderTopView(&job, o);
    ASSERT_EQ(lines.size(), 6u);
    EXPECT_EQ(lines[1].substr(0, std::min(width, 9)),
              std::string("failure: ").substr(0, std::min(width, 9)));
    EXPECT_EQ(lines[2].substr(0, std::min(width, 7)),
              std::string("status:").substr(0, std::min(width, 7)));
    for (std::string l : lines) {
      if (absl::StartsWith(l, "\x1b[7m")) {
        l = l.substr(4, l.size() - 8);
        EXPECT_EQ(l.size(), static_cast<size_t>(width)) << "highlight spans the width";
      }
      EXPECT_LE(l.size(), static_cast<size_t>(width)) << l;
    }
  }
  // Width 0: no limit.
  o.width = 0;
  o.highlight = false;
  auto lines = RenderTopView(&job, o);
  EXPECT_EQ(lines[0], "job job  running  2 ranks  step 120  lr 0.0001  up 1m05s  slow ranks: none");
  // Control characters from the network never reach the terminal.
  job.set_job_id("evil\x1b[2J\n");
  lines = RenderTopView(&job, o);
  EXPECT_EQ(lines[0].find('\x1b'), std::string::npos);
  EXPECT_EQ(lines[0].find('\n'), std::string::npos);
  EXPECT_TRUE(absl::StartsWith(lines[0], "job evil?[2J?  running")) << lines[0];
}

TEST(TopViewTest, ManyRanksAreSummarizedKeepingTheOnesThatMatter) {
  v1::GetJobResponse job = Job(1024);
  for (auto& r : *job.mutable_ranks()) r.set_step_seconds_p50(0.1);
  job.mutable_ranks(700)->set_step_seconds_p50(0.5);  // the slowest
  job.mutable_ranks(900)->set_slow(true);             // named slow by the coordinator
  job.mutable_ranks(1000)->set_alive(false);          // dead
  TopViewOptions o;
  o.width = 80;
  o.height = 24;
  auto lines = RenderTopView(&job, o);
  ASSERT_EQ(lines.size(), 24u) << Joined(lines);
  EXPECT_EQ(lines.back(),
            "... 1003 more ranks");  // 24 - header - column header - summary = 21 shown
  EXPECT_NE(RankLine(lines, 700), "");
  EXPECT_NE(RankLine(lines, 900), "");
  EXPECT_NE(RankLine(lines, 1000), "");
  EXPECT_NE(RankLine(lines, 0), "");
  EXPECT_NE(RankLine(lines, 17), "");
  EXPECT_EQ(RankLine(lines, 18), "") << "three slots went to ranks 700, 900, 1000";
  // Shown in rank order.
  int last = -1;
  for (size_t i = 2; i + 1 < lines.size(); ++i) {
    const int r = std::stoi(lines[i].substr(1, 4));
    EXPECT_GT(r, last);
    last = r;
  }
  EXPECT_EQ(last, 1000);

  // All fit exactly: no summary.
  v1::GetJobResponse small = Job(22);
  lines = RenderTopView(&small, o);
  EXPECT_EQ(lines.size(), 24u);
  EXPECT_EQ(lines.back().find("more"), std::string::npos);
  // One too many: 21 ranks and the summary.
  small = Job(23);
  lines = RenderTopView(&small, o);
  EXPECT_EQ(lines.size(), 24u);
  EXPECT_EQ(lines.back(), "... 2 more ranks");
  // Tiny terminals: never more lines than rows.
  for (int h = 1; h <= 4; ++h) {
    o.height = h;
    lines = RenderTopView(&job, o);
    EXPECT_EQ(lines.size(), static_cast<size_t>(h));
  }
  o.height = 3;
  EXPECT_EQ(RenderTopView(&job, o).back(), "... 1024 more ranks");
}

TEST(TopViewTest, Formats) {
  EXPECT_EQ(TopSeconds(0), "-");
  EXPECT_EQ(TopSeconds(-1), "-");
  EXPECT_EQ(TopSeconds(std::nan("")), "-");
  EXPECT_EQ(TopSeconds(85e-6), "85us");
  EXPECT_EQ(TopSeconds(0.0042), "4.20ms");
  EXPECT_EQ(TopSeconds(0.0413), "41.3ms");
  EXPECT_EQ(TopSeconds(0.412), "412ms");
  EXPECT_EQ(TopSeconds(1.234), "1.23s");
  EXPECT_EQ(TopSeconds(812.4), "812s");
  EXPECT_EQ(TopBytes(0), "-");
  EXPECT_EQ(TopBytes(812), "812 B");
  EXPECT_EQ(TopBytes(int64_t{3} << 29), "1.50 GiB");
  EXPECT_EQ(TopDuration(0), "-");
  EXPECT_EQ(TopDuration(12.7), "12s");
  EXPECT_EQ(TopDuration(303), "5m03s");
  EXPECT_EQ(TopDuration(3723), "1h02m03s");
  EXPECT_EQ(TopDuration(3 * 86400 + 4 * 3600 + 5), "3d04h");
}

}  // namespace
}  // namespace shardopt
