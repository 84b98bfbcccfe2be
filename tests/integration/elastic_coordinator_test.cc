// Live resizes in the coordinator (membership epochs): what a resize request
// is refused for, when the ranks are told of it (a shrink at once, a grow
// once its new ranks are ready), how the ranks move to the next epoch
// (joins, heartbeats of the old epoch, the membership change it records),
// and the bound on a resize that never completes. And the in-memory file
// system the ranks' snapshots live in.
#include <algorithm>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "common/membership.h"
#include "common/memory_file_system.h"
#include "common/planner.h"
#include "gtest/gtest.h"
#include "server/coordinator.h"

namespace shardopt {
namespace {

struct FakeClock {
  absl::Time t = absl::FromUnixSeconds(1000);
};

std::vector<ParamSpec> Model() {
  ParamSpec w;
  w.name = "w";
  w.shape = {64, 64};
  ParamSpec b;
  b.name = "b";
  b.shape = {64};
  return {w, b};
}

JoinInfo Info(int rank, int world, int64_t epoch, bool elastic = true) {
  JoinInfo j;
  j.job_id = "job";
  j.rank = rank;
  j.world_size = world;
  j.host = "127.0.0.1";
  j.shard_owner_port = 1000 + rank;
  j.params = Model();
  j.layout_hash = Plan(j.params, world, j.plan)->hash();
  j.epoch = epoch;
  j.elastic = elastic;
  j.step = epoch * 10;
  return j;
}

CoordinatorOptions Options(int world, FakeClock* clock, bool can_grow = true) {
  CoordinatorOptions o;
  o.world_size = world;
  o.heartbeat_timeout = absl::Seconds(10);
  o.resize_timeout = absl::Seconds(60);
  o.max_grow_world = can_grow ? 8 : 0;
  o.now = [clock] { return clock->t; };
  return o;
}

// Every rank of `world` joins epoch `epoch` (concurrently, as ranks do).
void JoinEpoch(Coordinator* c, int world, int64_t epoch, bool elastic = true) {
  std::vector<std::thread> threads;
  std::vector<absl::Status> status(world);
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      status[r] = c->Join(Info(r, world, epoch, elastic), absl::Seconds(10)).status();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
}

HeartbeatInfo Beat(int rank, int64_t epoch, int64_t step) {
  HeartbeatInfo h;
  h.rank = rank;
  h.epoch = epoch;
  h.step = step;
  return h;
}

TEST(ElasticCoordinatorTest, BadRequestsAreRefused) {
  FakeClock clock;
  Coordinator c(Options(3, &clock, /*can_grow=*/false));
  EXPECT_EQ(c.RequestResize(2, {}).status().code(), absl::StatusCode::kFailedPrecondition)
      << "before the job runs";
  JoinEpoch(&c, 3, 0);
  auto code = [&](int to, std::vector<int> leave) { return c.RequestResize(to, leave).status(); };
  EXPECT_EQ(code(3, {}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(code(3, {}).message().find("3 ranks already"), std::string::npos);
  EXPECT_EQ(code(0, {}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(2, {0, 1}).code(), absl::StatusCode::kInvalidArgument);  // 1 must leave
  EXPECT_EQ(code(2, {3}).code(), absl::StatusCode::kInvalidArgument);     // no rank 3
  EXPECT_EQ(code(1, {1, 1}).code(), absl::StatusCode::kInvalidArgument);  // twice
  absl::Status grow = code(4, {});
  EXPECT_EQ(grow.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(grow.message().find("cannot grow"), std::string::npos) << grow;
  // One at a time.
  ASSERT_TRUE(c.RequestResize(2, {1}).ok());
  absl::Status again = code(1, {});
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(again.message().find("still in progress"), std::string::npos) << again;
}

TEST(ElasticCoordinatorTest, ATrainerThatCannotResizeLiveIsRefused) {
  FakeClock clock;
  Coordinator c(Options(2, &clock));
  JoinEpoch(&c, 2, 0, /*elastic=*/false);
  absl::Status s = c.RequestResize(1, {}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("cannot resize live"), std::string::npos) << s;
}

TEST(ElasticCoordinatorTest, ShrinkIsAnnouncedAtOnceAndTheRanksMoveToTheNextEpoch) {
  FakeClock clock;
  Coordinator c(Options(3, &clock));
  JoinEpoch(&c, 3, 0);
  auto r = c.RequestResize(2, {1});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->epoch, 1);
  HeartbeatReply n = c.Notice();
  EXPECT_EQ(n.resize_request, r->request);
  EXPECT_EQ(n.resize_epoch, 1);
  EXPECT_EQ(n.resize_world, 2);
  EXPECT_EQ(n.resize_leave, std::vector<int>{1});
  EXPECT_EQ(RankAfterResize(0, n.resize_leave), 0);
  EXPECT_EQ(RankAfterResize(1, n.resize_leave), -1);
  EXPECT_EQ(RankAfterResize(2, n.resize_leave), 1);
  // While the ranks move, silence is no failure (no heartbeats then).
  clock.t += absl::Seconds(30);
  EXPECT_FALSE(c.CheckHeartbeats());
  // A join of a wrong epoch is refused; the new epoch's joins form it.
  EXPECT_EQ(c.Join(Info(0, 2, 2), absl::Seconds(1)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  JoinEpoch(&c, 2, 1);
  JobStatus j = c.GetJob();
  EXPECT_EQ(j.epoch, 1);
  EXPECT_EQ(j.world_size, 2);
  EXPECT_EQ(j.ranks.size(), 2u);
  EXPECT_FALSE(j.resize.has_value());
  ASSERT_EQ(j.membership.size(), 1u);
  EXPECT_EQ(j.membership[0].from_world, 3);
  EXPECT_EQ(j.membership[0].to_world, 2);
  EXPECT_EQ(j.membership[0].left, std::vector<int>{1});
  EXPECT_TRUE(j.membership[0].joined.empty());
  EXPECT_EQ(j.membership[0].step, 10);  // as the ranks said when they joined
  EXPECT_EQ(j.membership[0].took, absl::Seconds(30));
  EXPECT_EQ(DescribeMembershipChange(j.membership[0]),
            "epoch 1 at step 10: 3 -> 2 ranks (rank 1 left) in 30.00s");
  // Heartbeats of the old epoch are ignored (rank 2 is no more); the new
  // epoch's count, and its silence fails the job again.
  ASSERT_TRUE(c.Heartbeat(Beat(2, 0, 99)).ok());
  ASSERT_TRUE(c.Heartbeat(Beat(1, 1, 12)).ok());
  EXPECT_EQ(c.GetJob().ranks[1].step, 12);
  EXPECT_EQ(c.Heartbeat(Beat(2, 1, 12)).status().code(), absl::StatusCode::kInvalidArgument);
  clock.t += absl::Seconds(11);
  EXPECT_TRUE(c.CheckHeartbeats());
}

TEST(ElasticCoordinatorTest, GrowIsAnnouncedOnceItsNewRanksAreReady) {
  FakeClock clock;
  Coordinator c(Options(2, &clock));
  JoinEpoch(&c, 2, 0);
  auto r = c.RequestResize(4, {});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(c.Notice().resize_request, 0) << "not before the new ranks are up";
  ASSERT_TRUE(c.GetJob().resize.has_value());  // (shardrun starts them from this)
  EXPECT_EQ(c.GetJob().resize->to_world, 4);
  // Until then the ranks train on and their heartbeats count.
  clock.t += absl::Seconds(11);
  EXPECT_TRUE(c.CheckHeartbeats()) << "a silent rank is still a failure before the announcement";
}

TEST(ElasticCoordinatorTest, GrowCompletesWithTheNewRanks) {
  FakeClock clock;
  Coordinator c(Options(2, &clock));
  JoinEpoch(&c, 2, 0);
  auto r = c.RequestResize(3, {});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(c.KvSet(ResizeReadyKey(r->epoch, 2), "1").ok());
  HeartbeatReply n = c.Notice();
  EXPECT_EQ(n.resize_request, r->request);
  EXPECT_EQ(n.resize_world, 3);
  EXPECT_TRUE(n.resize_leave.empty());
  JoinEpoch(&c, 3, 1);
  JobStatus j = c.GetJob();
  EXPECT_EQ(j.world_size, 3);
  ASSERT_EQ(j.membership.size(), 1u);
  EXPECT_EQ(j.membership[0].joined, std::vector<int>{2});
  EXPECT_EQ(j.state, JobState::kRunning);
  // The next resize goes to epoch 2.
  auto next = c.RequestResize(1, {});
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->epoch, 2);
  EXPECT_EQ(next->leave, (std::vector<int>{1, 2}));
}

// shardrun --join: a grow whose new ranks the caller starts, allowed where
// the job's own launcher cannot grow it. A grow whose ranks never get ready
// is cancelled (the job trains on), and its epoch is not given again.
TEST(ElasticCoordinatorTest, ExternalGrowAndACancelledGrow) {
  FakeClock clock;
  Coordinator c(Options(2, &clock, /*can_grow=*/false));
  JoinEpoch(&c, 2, 0);
  absl::Status own = c.RequestResize(3, {}).status();
  EXPECT_EQ(own.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(own.message().find("shardrun --join"), std::string::npos) << own;
  EXPECT_EQ(c.RequestResize(1, {}, /*external=*/true).status().code(),
            absl::StatusCode::kInvalidArgument)
      << "only a grow starts ranks";
  auto r = c.RequestResize(3, {}, /*external=*/true);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->epoch, 1);
  ASSERT_TRUE(c.GetJob().resize.has_value());
  EXPECT_TRUE(c.GetJob().resize->external);
  // Its new rank never says it is ready: after resize_timeout the grow is
  // cancelled, not the job.
  clock.t += absl::Seconds(61);
  ASSERT_TRUE(c.Heartbeat(Beat(0, 0, 50)).ok());
  ASSERT_TRUE(c.Heartbeat(Beat(1, 0, 50)).ok());
  EXPECT_FALSE(c.CheckHeartbeats());
  JobStatus j = c.GetJob();
  EXPECT_EQ(j.state, JobState::kRunning);
  EXPECT_FALSE(j.resize.has_value());
  EXPECT_EQ(j.world_size, 2);
  EXPECT_EQ(c.Notice().resize_request, 0);
  auto again = c.RequestResize(3, {}, /*external=*/true);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->epoch, 2) << "a cancelled grow's epoch is not reused";
  ASSERT_TRUE(c.KvSet(ResizeReadyKey(again->epoch, 2), "1").ok());
  EXPECT_EQ(c.Notice().resize_epoch, 2);
  JoinEpoch(&c, 3, 2);
  EXPECT_EQ(c.GetJob().epoch, 2);
  EXPECT_EQ(c.GetJob().world_size, 3);
}

// The job's own shardrun starts at most max_grow_world ranks (its
// --max-nproc): a larger grow is refused up front, with what to do instead,
// rather than starting that many processes. A grow whose caller starts the
// ranks (shardrun --join) is not bound by it.
TEST(ElasticCoordinatorTest, AGrowBeyondWhatTheLauncherStartsIsRefused) {
  FakeClock clock;
  Coordinator c(Options(2, &clock));  // max_grow_world 8
  JoinEpoch(&c, 2, 0);
  for (int to : {9, 100000}) {
    absl::Status s = c.RequestResize(to, {}).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << to;
    EXPECT_NE(s.message().find("starts at most 8 ranks on its node"), std::string::npos) << s;
    EXPECT_NE(s.message().find("shardrun --join"), std::string::npos) << s;
  }
  EXPECT_FALSE(c.GetJob().resize.has_value()) << "nothing pending after a refusal";
  EXPECT_TRUE(c.RequestResize(8, {}).ok());
  Coordinator other(Options(2, &clock));
  JoinEpoch(&other, 2, 0);
  EXPECT_TRUE(other.RequestResize(9, {}, /*external=*/true).ok());
}

// shardrun --replicate-shards: a rank's process died; the coordinator drops
// it (found by its pid) once every other rank holds replicas.
TEST(ElasticCoordinatorTest, ALostRankIsRecoveredFromReplicas) {
  FakeClock clock;
  Coordinator c(Options(3, &clock));
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      JoinInfo j = Info(r, 3, 0);
      j.pid = 100 + r;
      ASSERT_TRUE(c.Join(j, absl::Seconds(10)).ok());
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(c.RecoverLoss(999, "killed").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(c.KvSet(ReplicaReadyKey(0, 0), "1").ok());
  absl::Status early = c.RecoverLoss(101, "killed").status();
  EXPECT_EQ(early.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(early.message().find("rank 2 holds no replica yet"), std::string::npos) << early;
  ASSERT_TRUE(c.KvSet(ReplicaReadyKey(0, 2), "1").ok());  // (rank 1's own is not needed)
  auto r = c.RecoverLoss(101, "killed by signal 9");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->leave, std::vector<int>{1});
  EXPECT_EQ(r->to_world, 2);
  HeartbeatReply n = c.Notice();
  EXPECT_TRUE(n.resize_recovery);
  EXPECT_EQ(n.resize_epoch, 1);
  EXPECT_EQ(n.resize_leave, std::vector<int>{1});
  JoinEpoch(&c, 2, 1);
  JobStatus j = c.GetJob();
  EXPECT_EQ(j.world_size, 2);
  ASSERT_EQ(j.membership.size(), 1u);
  EXPECT_TRUE(j.membership[0].lost);
  EXPECT_NE(DescribeMembershipChange(j.membership[0]).find("rank 1 lost, recovered from replicas"),
            std::string::npos);
}

TEST(ElasticCoordinatorTest, AResizeThatNeverCompletesFailsTheJob) {
  FakeClock clock;
  Coordinator c(Options(2, &clock));
  JoinEpoch(&c, 2, 0);
  ASSERT_TRUE(c.RequestResize(1, {}).ok());
  ASSERT_TRUE(c.Join(Info(0, 1, 1), absl::ZeroDuration()).ok());  // (the only rank)
  EXPECT_EQ(c.GetJob().epoch, 1);
  // A second try, that the last rank of the new epoch never joins.
  Coordinator d(Options(2, &clock));
  JoinEpoch(&d, 2, 0);
  ASSERT_TRUE(d.RequestResize(1, {0}).ok());
  clock.t += absl::Seconds(61);
  EXPECT_TRUE(d.CheckHeartbeats());
  JobStatus j = d.GetJob();
  EXPECT_EQ(j.state, JobState::kFailed);
  EXPECT_NE(j.failure.find("the resize to 1 ranks did not complete"), std::string::npos)
      << j.failure;
}

TEST(MemoryFileSystemTest, FilesDirectoriesAndErrors) {
  MemoryFileSystem fs;
  ASSERT_TRUE(fs.MakeDirs("/a/b").ok());
  EXPECT_EQ(fs.Kind("/a"), EntryKind::kDirectory);
  EXPECT_EQ(fs.NewWritableFile("/nowhere/x").status().code(), absl::StatusCode::kNotFound);
  auto f = fs.NewWritableFile("/a/b/x.tmp");
  ASSERT_TRUE(f.ok());
  // Larger than one chunk, written in odd pieces.
  std::string data(MemoryFileSystem::Blob::kChunkBytes + 12345, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7 + i / 4096);
  for (size_t at = 0; at < data.size(); at += 1000003) {
    ASSERT_TRUE((*f)->Append(data.data() + at, std::min<size_t>(1000003, data.size() - at)).ok());
  }
  ASSERT_TRUE((*f)->Sync().ok());
  ASSERT_TRUE((*f)->Close().ok());
  ASSERT_TRUE(fs.Rename("/a/b/x.tmp", "/a/b/x").ok());
  EXPECT_EQ(fs.Kind("/a/b/x.tmp"), EntryKind::kMissing);
  EXPECT_EQ(*fs.FileSize("/a/b/x"), data.size());
  EXPECT_EQ(fs.bytes(), static_cast<int64_t>(data.size()));
  std::string back(100, '\0');
  const uint64_t across = MemoryFileSystem::Blob::kChunkBytes - 50;  // spans two chunks
  ASSERT_TRUE(fs.ReadAt("/a/b/x", across, back.size(), back.data()).ok());
  EXPECT_EQ(back, data.substr(across, 100));
  EXPECT_EQ(fs.ReadAt("/a/b/x", data.size() - 10, 11, back.data()).code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(fs.ReadAt("/a/b/y", 0, 1, back.data()).code(), absl::StatusCode::kNotFound);
  auto list = fs.ListDir("/a");
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(*list, std::vector<std::string>{"b"});
  EXPECT_EQ(*fs.ListDir("/a/b/"), std::vector<std::string>{"x"});
  EXPECT_EQ(fs.RemoveDir("/a/b").code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(fs.Remove("/a/b/x").ok());
  ASSERT_TRUE(fs.RemoveDir("/a/b").ok());
  EXPECT_EQ(fs.Kind("/a/b"), EntryKind::kMissing);
  EXPECT_EQ(fs.bytes(), 0);
}

}  // namespace
}  // namespace shardopt
