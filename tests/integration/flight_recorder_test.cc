// Flight recorder: the ring (sequence numbers, wrap-around, states, no
// allocation per record), the recording communicator over the in-process
// backend (same sequence numbers on every rank, buckets, steps, timed-out
// waits, aborts), the divergence analysis on hand-made rings (a stalled rank,
// a dead rank, all equal, failed waits, mismatched collectives, rings that
// wrapped), validation, and the RPCs (ReportFlightRecord, GetFlightRecords
// over live shard owners, falling back to reported rings).
#include "client/comm/flight_recorder.h"

#include <atomic>
#include <cstdlib>
#include <new>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/coordinator_client.h"
#include "client/join_request.h"
#include "client/comm/in_process_communicator.h"
#include "common/planner.h"
#include "gtest/gtest.h"
#include "server/coordinator.h"
#include "server/coordinator_service.h"
#include "server/shard_owner_service.h"
#include "client/comm/flight_record_proto.h"
#include "server/flight_records.h"
#include "server/rpc_server.h"

// Counts heap allocations while g_count_allocations is set (this binary
// only; not under AddressSanitizer, which owns operator new there).
static std::atomic<bool> g_count_allocations{false};
static std::atomic<int64_t> g_allocations{0};
#if defined(__SANITIZE_ADDRESS__)
#define SHARDOPT_COUNTS_ALLOCATIONS 0
#else
#define SHARDOPT_COUNTS_ALLOCATIONS 1
void* operator new(size_t n) {
  if (g_count_allocations.load(std::memory_order_relaxed)) g_allocations.fetch_add(1);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
#endif

namespace shardopt {
namespace {

TEST(FlightRecorderTest, RecordsInOrderAndWrapsAround) {
  FlightRecorder rec(4);
  EXPECT_EQ(rec.recorded(), 0);
  EXPECT_TRUE(rec.Snapshot().empty());
  rec.set_step(3);
  const int64_t a = rec.Begin(CollectiveKind::kReduceScatter, 0, 400);
  const int64_t b = rec.Begin(CollectiveKind::kAllGather, 0, 400);
  EXPECT_EQ(a, 1);
  EXPECT_EQ(b, 2);
  rec.End(a, true);
  rec.End(b, false);
  auto s = rec.Snapshot();
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].seq, 1);
  EXPECT_EQ(s[0].op, CollectiveKind::kReduceScatter);
  EXPECT_EQ(s[0].bucket, 0);
  EXPECT_EQ(s[0].bytes, 400);
  EXPECT_EQ(s[0].step, 3);
  EXPECT_EQ(s[0].state, FlightState::kDone);
  EXPECT_GT(s[0].start_unix_ns, 0);
  EXPECT_GE(s[0].end_unix_ns, s[0].start_unix_ns);
  EXPECT_EQ(s[1].state, FlightState::kFailed);

  for (int i = 0; i < 8; ++i) rec.Begin(CollectiveKind::kAllReduce, -1, 4);  // seqs 3..10
  s = rec.Snapshot();
  ASSERT_EQ(s.size(), 4u);  // the last 4, oldest first
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(s[i].seq, 7 + i);
    EXPECT_EQ(s[i].state, FlightState::kRunning);
    EXPECT_EQ(s[i].end_unix_ns, 0);
  }
  rec.End(2, true);  // left the ring: ignored
  rec.End(9, true);
  s = rec.Snapshot();
  EXPECT_EQ(s[2].seq, 9);
  EXPECT_EQ(s[2].state, FlightState::kDone);
  EXPECT_EQ(rec.recorded(), 10);
  EXPECT_EQ(rec.capacity(), 4);
}

TEST(FlightRecorderTest, NoAllocationPerRecord) {
  if (!SHARDOPT_COUNTS_ALLOCATIONS)
    GTEST_SKIP() << "allocations are not counted under AddressSanitizer";
  FlightRecorder rec(64);
  for (int i = 0; i < 100; ++i)
    rec.End(rec.Begin(CollectiveKind::kAllGather, i % 3, 8), true);  // warm-up
  g_allocations = 0;
  g_count_allocations = true;
  for (int i = 0; i < 10000; ++i) {
    const int64_t s = rec.Begin(CollectiveKind::kReduceScatter, i % 7, 1 << 20);
    rec.set_step(i);
    rec.End(s, i % 2 == 0);
  }
  g_count_allocations = false;
  EXPECT_EQ(g_allocations.load(), 0);
  EXPECT_EQ(rec.recorded(), 10100);
}

TEST(FlightRecorderTest, ConcurrentRecordingKeepsEverySeq) {
  FlightRecorder rec(1 << 16);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 5000; ++i) rec.End(rec.Begin(CollectiveKind::kBarrier, -1, 0), true);
    });
  }
  std::thread reader([&] {
    for (int i = 0; i < 50; ++i) (void)rec.Snapshot();
  });
  for (auto& t : threads) t.join();
  reader.join();
  auto s = rec.Snapshot();
  ASSERT_EQ(s.size(), 20000u);
  for (size_t i = 0; i < s.size(); ++i) {
    EXPECT_EQ(s[i].seq, static_cast<int64_t>(i) + 1);
    EXPECT_EQ(s[i].state, FlightState::kDone);
  }
}

// Two in-process ranks, each through a FlightRecordingCommunicator.
struct RecordedJob {
  InProcessWorld world;
  std::vector<std::shared_ptr<FlightRecorder>> recorders;
  std::vector<std::unique_ptr<Communicator>> comms;
  explicit RecordedJob(int n, absl::Duration timeout = absl::Seconds(10),
                       std::vector<InProcessFaults> faults = {})
      : world(n, timeout) {
    for (int r = 0; r < n; ++r) {
      recorders.push_back(std::make_shared<FlightRecorder>(16));
      comms.push_back(std::make_unique<FlightRecordingCommunicator>(
          world.Connect(r, r < static_cast<int>(faults.size()) ? faults[r] : InProcessFaults()),
          recorders.back()));
    }
  }
};

TEST(FlightRecordingCommunicatorTest, SameSeqOnEveryRankWithBucketsAndSteps) {
  RecordedJob job(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Communicator* c = job.comms[r].get();
      std::vector<float> buf(8, 1.0f);
      job.recorders[r]->set_step(7);
      {
        CollectiveBucketScope tag(3);
        EXPECT_TRUE(c->ReduceScatter(buf.data(), 4, DType::kFloat32, ReduceOp::kSum)
                        ->Wait(absl::Seconds(10))
                        .ok());
        EXPECT_TRUE(c->AllGather(buf.data(), 4, DType::kFloat32)->Wait(absl::Seconds(10)).ok());
      }
      EXPECT_EQ(CurrentCollectiveBucket(), -1);
      job.recorders[r]->set_step(8);
      EXPECT_TRUE(c->AllReduce(buf.data(), 2, DType::kFloat32, ReduceOp::kMax)
                      ->Wait(absl::Seconds(10))
                      .ok());
      EXPECT_TRUE(c->Broadcast(buf.data(), 8, DType::kByte, 0)->Wait(absl::Seconds(10)).ok());
      EXPECT_TRUE(c->Barrier()->Wait(absl::Seconds(10)).ok());
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    auto s = job.recorders[r]->Snapshot();
    ASSERT_EQ(s.size(), 5u) << "rank " << r;
    const CollectiveKind ops[] = {CollectiveKind::kReduceScatter, CollectiveKind::kAllGather,
                                  CollectiveKind::kAllReduce, CollectiveKind::kBroadcast,
                                  CollectiveKind::kBarrier};
    const int buckets[] = {3, 3, -1, -1, -1};
    const int64_t bytes[] = {32, 32, 8, 8, 0};
    const int64_t steps[] = {7, 7, 8, 8, 8};
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(s[i].seq, i + 1);
      EXPECT_EQ(s[i].op, ops[i]);
      EXPECT_EQ(s[i].bucket, buckets[i]);
      EXPECT_EQ(s[i].bytes, bytes[i]);
      EXPECT_EQ(s[i].step, steps[i]);
      EXPECT_EQ(s[i].state, FlightState::kDone);
    }
  }
  // The counters and identity are the inner communicator's.
  EXPECT_EQ(job.comms[1]->rank(), 1);
  EXPECT_EQ(job.comms[1]->world_size(), 2);
}

// Reduce-scatters of separate chunks (ZeRO-2's) pass through, recorded as
// reduce-scatters: a wrapper that lost the capability would silently make
// ShardedOptimizer stage whole buckets.
TEST(FlightRecordingCommunicatorTest, SeparateChunksPassThroughAndAreRecorded) {
  RecordedJob job(2);
  std::vector<std::vector<float>> own = {{1, 2}, {3, 4}}, other = {{10, 20}, {30, 40}};
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(job.comms[r]->SupportsSeparateChunks());
    threads.emplace_back([&, r] {
      CollectiveBucketScope tag(5);
      std::vector<void*> chunks = r == 0 ? std::vector<void*>{own[0].data(), other[0].data()}
                                         : std::vector<void*>{other[1].data(), own[1].data()};
      absl::Status s = job.comms[r]
                           ->ReduceScatterChunks(chunks, 2, DType::kFloat32, ReduceOp::kSum)
                           ->Wait(absl::Seconds(10));
      EXPECT_TRUE(s.ok()) << s;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(own[0], (std::vector<float>{31, 42}));  // rank 0's chunk: its own + rank 1's other
  EXPECT_EQ(own[1], (std::vector<float>{13, 24}));
  for (int r = 0; r < 2; ++r) {
    auto s = job.recorders[r]->Snapshot();
    ASSERT_EQ(s.size(), 1u);
    EXPECT_EQ(s[0].op, CollectiveKind::kReduceScatter);
    EXPECT_EQ(s[0].bucket, 5);
    EXPECT_EQ(s[0].bytes, 16);
    EXPECT_EQ(s[0].state, FlightState::kDone);
  }
}

TEST(FlightRecordingCommunicatorTest, TimedOutWaitIsAStallAndAbortFailsIt) {
  RecordedJob job(2, absl::Seconds(30));
  std::vector<float> buf(4, 1.0f);
  // Rank 0 calls an all-reduce that rank 1 never joins.
  CommHandlePtr h = job.comms[0]->AllReduce(buf.data(), 4, DType::kFloat32, ReduceOp::kSum);
  EXPECT_EQ(h->Wait(absl::Milliseconds(20)).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(h->Wait(absl::Milliseconds(20)).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(job.recorders[0]->stalls(), 1);  // one stalled collective, however often waited on
  EXPECT_EQ(job.recorders[0]->Snapshot()[0].state, FlightState::kRunning);
  EXPECT_TRUE(job.recorders[0]->Snapshot()[0].timed_out);
  job.comms[0]->Abort(absl::DeadlineExceededError("test"));
  EXPECT_FALSE(h->Wait(absl::Seconds(10)).ok());
  auto s = job.recorders[0]->Snapshot();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].state, FlightState::kFailed);
  EXPECT_GT(s[0].end_unix_ns, 0);
  EXPECT_EQ(job.recorders[0]->stalls(), 1);
  // Calls after the abort fail at once and are recorded as failed.
  job.comms[0]->Barrier()->Wait(absl::Seconds(1)).IgnoreError();
  s = job.recorders[0]->Snapshot();
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[1].state, FlightState::kFailed);
  EXPECT_TRUE(job.recorders[1]->Snapshot().empty());
  // An argument error is recorded as failed too.
  job.comms[1]
      ->AllReduce(nullptr, 4, DType::kFloat32, ReduceOp::kSum)
      ->Wait(absl::Seconds(1))
      .IgnoreError();
  ASSERT_EQ(job.recorders[1]->Snapshot().size(), 1u);
  EXPECT_EQ(job.recorders[1]->Snapshot()[0].state, FlightState::kFailed);
}

TEST(FlightRecorderTest, CollectivesThatTimeOutAreStalls) {
  FlightRecorder rec(2);
  const int64_t a = rec.Begin(CollectiveKind::kAllReduce, -1, 4);
  rec.OnCollectiveDone(
      a, absl::DeadlineExceededError("backend timeout"));  // the backend's own timeout
  EXPECT_EQ(rec.stalls(), 1);
  EXPECT_EQ(rec.Snapshot()[0].state, FlightState::kFailed);
  const int64_t b = rec.Begin(CollectiveKind::kAllReduce, -1, 4);
  rec.OnWaitTimeout(b);
  rec.OnCollectiveDone(b, absl::DeadlineExceededError("and then the backend's"));  // the same stall
  EXPECT_EQ(rec.stalls(), 2);
  rec.OnCollectiveDone(rec.Begin(CollectiveKind::kBarrier, -1, 0), absl::AbortedError("aborted"));
  EXPECT_EQ(rec.stalls(), 2);
}

// Whoever returns from Wait finds the entry final: the observer is told
// before waiters wake up (the trainer snapshots its ring right after a
// failed wait).
TEST(FlightRecordingCommunicatorTest, EntryIsFinalWhenWaitReturns) {
  RecordedJob job(1);
  float x = 1;
  for (int i = 0; i < 2000; ++i) {
    ASSERT_TRUE(job.comms[0]
                    ->AllReduce(&x, 1, DType::kFloat32, ReduceOp::kSum)
                    ->Wait(absl::Seconds(10))
                    .ok());
    ASSERT_EQ(job.recorders[0]->Snapshot().back().state, FlightState::kDone) << "collective " << i;
  }
}

// --- the divergence analysis, on hand-made rings -------------------------

constexpr double kNow = 1.8e9;  // "now": the rings' capture time

v1::CollectiveRecord* Add(v1::FlightRecord* f, int64_t seq, const char* op, int bucket,
                          int64_t step, const char* state, double start_ago, double end_ago = 0) {
  v1::CollectiveRecord* c = f->add_records();
  c->set_seq(seq);
  c->set_op(op);
  c->set_bucket(bucket);
  c->set_bytes(1 << 20);
  c->set_step(step);
  c->set_state(state);
  c->set_start_unix(kNow - start_ago);
  c->set_end_unix(std::string(state) == "running" ? 0 : kNow - end_ago);
  return c;
}

v1::FlightRecord Ring(int rank) {
  v1::FlightRecord f;
  f.set_rank(rank);
  f.set_captured_unix(kNow);
  return f;
}

// A rank that finished seq 1..last (a step's pattern: RS b3, RS b2, AG b3, AG b2, AR).
v1::FlightRecord Finished(int rank, int64_t last) {
  v1::FlightRecord f = Ring(rank);
  const char* ops[] = {"reduce_scatter", "reduce_scatter", "all_gather", "all_gather",
                       "all_reduce"};
  const int buckets[] = {3, 2, 3, 2, -1};
  for (int64_t s = std::max<int64_t>(1, last - 30); s <= last; ++s) {
    const int k = static_cast<int>((s - 1) % 5);
    Add(&f, s, ops[k], buckets[k], 1 + (s - 1) / 5, "done", 100.0 - s * 0.01, 41.0 + (last - s));
  }
  return f;
}

TEST(FirstDivergenceTest, StalledRank) {
  // Ranks 0, 2, 3 wait in seq 1141 (the all-gather of bucket 3 of step 229);
  // rank 1 stopped after seq 1140.
  std::vector<v1::FlightRecord> rings;
  for (int r = 0; r < 4; ++r) {
    v1::FlightRecord f = Finished(r, 1140);
    if (r != 1) {
      Add(&f, 1141, "reduce_scatter", 3, 229, "running", 40.0);
      Add(&f, 1142, "reduce_scatter", 2, 229, "running", 39.9);  // queued behind it
    }
    rings.push_back(f);
  }
  EXPECT_EQ(FirstDivergence(rings, 4),
            "step 229: ranks 0, 2, 3 wait in reduce-scatter of bucket 3 (seq 1141, for 40.0 s); "
            "rank 1 never started it (last: all-reduce, seq 1140, finished 41.0 s ago)");
}

TEST(FirstDivergenceTest, StalledRankWithTimedOutWaits) {
  std::vector<v1::FlightRecord> rings;
  for (int r = 0; r < 2; ++r) rings.push_back(Finished(r, 22));
  Add(&rings[0], 23, "all_gather", 3, 5, "failed", 3.5, 0.5);
  EXPECT_EQ(
      FirstDivergence(rings, 2),
      "step 5: rank 0 waited in all-gather of bucket 3 (seq 23) and failed after 3.0 s; "
      "rank 1 never started it (last: reduce-scatter of bucket 2, seq 22, finished 41.0 s ago)");
}

TEST(FirstDivergenceTest, DeadRank) {
  std::vector<v1::FlightRecord> rings;
  for (int r : {0, 2}) {
    v1::FlightRecord f = Finished(r, 40);
    Add(&f, 41, "reduce_scatter", 3, 9, "failed", 2.0, 1.5);
    rings.push_back(f);
  }
  EXPECT_EQ(
      FirstDivergence(rings, 3),
      "step 9: ranks 0, 2 waited in reduce-scatter of bucket 3 (seq 41) and failed after 0.5 s; "
      "rank 1 sent no record (dead?)");
  EXPECT_EQ(
      FirstDivergence(rings, 3, {{1, "last heartbeat 4.2 s ago, at step 8"}, {0, "unused"}}),
      "step 9: ranks 0, 2 waited in reduce-scatter of bucket 3 (seq 41) and failed after 0.5 s; "
      "rank 1 sent no record (dead? last heartbeat 4.2 s ago, at step 8)");
  // A live query that got an error from rank 1.
  v1::FlightRecord err;
  err.set_rank(1);
  err.set_error("shard owner at 127.0.0.1:5: failed to connect");
  rings.push_back(err);
  EXPECT_EQ(
      FirstDivergence(rings, 3),
      "step 9: ranks 0, 2 waited in reduce-scatter of bucket 3 (seq 41) and failed after 0.5 s; "
      "rank 1 sent no record (dead? shard owner at 127.0.0.1:5: failed to connect)");
  // Everyone else idle, one dead.
  std::vector<v1::FlightRecord> idle = {Finished(0, 40), Finished(2, 40)};
  EXPECT_EQ(
      FirstDivergence(idle, 3),
      "step 8: rank 1 sent no record (dead?); ranks 0, 2 are in no collective (last: all-reduce, "
      "seq 40, finished 41.0 s ago)");
  EXPECT_EQ(FirstDivergence({}, 2), "ranks 0, 1 sent no records (dead?)");
}

TEST(FirstDivergenceTest, AllEqual) {
  std::vector<v1::FlightRecord> rings;
  for (int r = 0; r < 4; ++r) rings.push_back(Finished(r, 100));
  EXPECT_EQ(
      FirstDivergence(rings, 4),
      "no divergence: all 4 ranks finished seq 100 (all-reduce, step 20) and are in no collective");
  for (auto& f : rings) Add(&f, 101, "reduce_scatter", 3, 21, "running", 0.25);
  EXPECT_EQ(
      FirstDivergence(rings, 4),
      "no divergence: all 4 ranks are in reduce-scatter of bucket 3 (seq 101, step 21, for 0.2 s)");
  // Some finished it, the others are still in it (a live query mid-collective).
  v1::CollectiveRecord* last = rings[0].mutable_records(rings[0].records_size() - 1);
  last->set_state("done");
  last->set_end_unix(kNow - 0.1);
  EXPECT_EQ(
      FirstDivergence(rings, 4),
      "no divergence: the ranks are making progress (seq 101, step 21; no rank has waited 1.0 s)");
  // ... and rank 0 is one further (a live query of a healthy job).
  Add(&rings[0], 102, "reduce_scatter", 2, 21, "running", 0.05);
  EXPECT_EQ(FirstDivergence(rings, 4),
            "no divergence: the ranks are making progress (seq 101-102, step 21; no rank has "
            "waited 1.0 s)");
  // The same after 1.5 s: a divergence.
  for (auto& f : rings) {
    for (auto& c : *f.mutable_records()) {
      c.set_start_unix(c.start_unix() - 1.5);
      if (c.end_unix() > 0) c.set_end_unix(c.end_unix() - 1.5);
    }
  }
  EXPECT_EQ(FirstDivergence(rings, 4),
            "step 21: ranks 1-3 wait in reduce-scatter of bucket 3 (seq 101, for 1.8 s); rank 0 "
            "finished it");
  // Every rank was in the same collective when the job was aborted.
  std::vector<v1::FlightRecord> aborted = {Finished(0, 7), Finished(1, 7)};
  for (auto& f : aborted) Add(&f, 8, "all_reduce", -1, 2, "failed", 0.5, 0.4);
  EXPECT_EQ(
      FirstDivergence(aborted, 2),
      "no divergence: both ranks were in all-reduce (seq 8, step 2) when it failed (after 0.1 s)");
}

TEST(FirstDivergenceTest, MismatchedCollectivesAreNamed) {
  std::vector<v1::FlightRecord> rings = {Finished(0, 10), Finished(1, 10)};
  Add(&rings[0], 11, "all_gather", 3, 3, "running", 5);
  Add(&rings[1], 11, "all_reduce", -1, 3, "running", 5);
  EXPECT_EQ(FirstDivergence(rings, 2),
            "step 3: rank 0 waits in all-gather of bucket 3 (seq 11, for 5.0 s); rank 1 waits in "
            "all-reduce "
            "(seq 11, for 5.0 s); the ranks issued different collectives as seq 11 (their "
            "collective order "
            "differs)");
}

TEST(FirstDivergenceTest, ManyRanksAreListedAsRanges) {
  std::vector<v1::FlightRecord> rings;
  for (int r = 0; r < 64; ++r) {
    v1::FlightRecord f = Finished(r, 50);
    if (r != 6 && r != 40) Add(&f, 51, "reduce_scatter", 3, 11, "running", 7);
    rings.push_back(f);
  }
  rings.erase(rings.begin() + 40);  // rank 40: no record
  EXPECT_EQ(FirstDivergence(rings, 64),
            "step 11: ranks 0-5, 7-39, 41-63 wait in reduce-scatter of bucket 3 (seq 51, for 7.0 "
            "s); rank 6 "
            "never started it (last: all-reduce, seq 50, finished 41.0 s ago); rank 40 sent no "
            "record (dead?)");
}

TEST(FirstDivergenceTest, RingsThatWrappedAndStartUp) {
  // Rank 1 is far behind: its seq 5 is older than rank 0's ring.
  v1::FlightRecord a = Ring(0), b = Ring(1);
  for (int s = 100; s < 110; ++s) Add(&a, s, "all_reduce", -1, 20, "done", 10, 9);
  Add(&b, 4, "broadcast", 0, 0, "done", 50, 49);
  Add(&b, 5, "broadcast", 1, 0, "running", 49);
  EXPECT_EQ(FirstDivergence({a, b}, 2),
            "at start-up: rank 1 waits in broadcast of bucket 1 (seq 5, for 49.0 s); rank 0: seq 5 "
            "is older "
            "than its ring");
}

TEST(FlightRecordsTest, ValidateAndStore) {
  FlightRecords store;
  EXPECT_TRUE(store.empty());
  v1::FlightRecord f = Finished(1, 5);
  EXPECT_TRUE(store.Report(f, 2).ok());
  EXPECT_EQ(store.Report(f, 1).code(), absl::StatusCode::kInvalidArgument);  // rank 1 of 1
  v1::FlightRecord bad = f;
  bad.mutable_records(0)->set_op("all gather; rm -rf");
  EXPECT_EQ(store.Report(bad, 2).code(), absl::StatusCode::kInvalidArgument);
  bad = f;
  bad.mutable_records(0)->set_state("sleeping");
  EXPECT_EQ(store.Report(bad, 2).code(), absl::StatusCode::kInvalidArgument);
  bad = f;
  bad.mutable_records(0)->set_start_unix(std::nan(""));
  EXPECT_EQ(store.Report(bad, 2).code(), absl::StatusCode::kInvalidArgument);
  bad = f;
  bad.mutable_records(0)->set_seq(-3);
  EXPECT_EQ(store.Report(bad, 2).code(), absl::StatusCode::kInvalidArgument);
  bad = f;
  bad.set_reason(std::string(kMaxFlightReasonBytes + 1, 'x'));
  EXPECT_EQ(store.Report(bad, 2).code(), absl::StatusCode::kInvalidArgument);
  bad = f;
  for (int i = 0; i <= kMaxFlightRecords; ++i) bad.add_records();
  EXPECT_EQ(store.Report(bad, 2).code(), absl::StatusCode::kInvalidArgument);
  v1::FlightRecord g = Finished(0, 7);
  g.set_reason("timed out");
  EXPECT_TRUE(store.Report(g, 2).ok());
  f.set_reason("replaced");
  EXPECT_TRUE(store.Report(f, 2).ok());
  auto all = store.Reported();
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].rank(), 0);
  EXPECT_EQ(all[1].reason(), "replaced");
  EXPECT_TRUE(store.Has(1));
  EXPECT_FALSE(store.Has(2));
}

TEST(FlightRecordsTest, ToFlightRecordAndBack) {
  FlightRecorder rec(8);
  rec.set_step(4);
  rec.End(rec.Begin(CollectiveKind::kReduceScatter, 2, 4096), true);
  rec.Begin(CollectiveKind::kAllGather, 2, 4096);
  v1::FlightRecord f = ToFlightRecord(3, rec.Snapshot(), absl::FromUnixSeconds(1800000000), "why");
  EXPECT_EQ(f.rank(), 3);
  EXPECT_EQ(f.reason(), "why");
  EXPECT_EQ(f.captured_unix(), 1800000000.0);
  ASSERT_EQ(f.records_size(), 2);
  EXPECT_EQ(f.records(0).op(), "reduce_scatter");
  EXPECT_EQ(f.records(0).state(), "done");
  EXPECT_EQ(f.records(1).op(), "all_gather");
  EXPECT_EQ(f.records(1).state(), "running");
  EXPECT_EQ(f.records(1).end_unix(), 0);
  EXPECT_EQ(f.records(1).bucket(), 2);
  EXPECT_EQ(f.records(1).bytes(), 4096);
  EXPECT_EQ(f.records(1).step(), 4);
  EXPECT_GT(f.records(1).start_unix(), 1.7e9);
  EXPECT_TRUE(ValidateFlightRecord(f, 4).ok());
}

// The whole path in one process: two recorded in-process ranks, rank 1 stops
// taking part, rank 0 times out; their rings say so.
TEST(FlightRecordsTest, InProcessStallIsFound) {
  RecordedJob job(2, absl::Seconds(30));
  std::vector<std::thread> threads;
  std::vector<float> bufs[2] = {std::vector<float>(8, 1), std::vector<float>(8, 1)};
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Communicator* c = job.comms[r].get();
      for (int step = 1; step <= 3; ++step) {
        if (r == 1 && step == 3) return;  // stalls before step 3
        job.recorders[r]->set_step(step);
        CollectiveBucketScope tag(0);
        CommHandlePtr h = c->ReduceScatter(bufs[r].data(), 4, DType::kFloat32, ReduceOp::kSum);
        absl::Status s = h->Wait(absl::Milliseconds(r == 0 && step == 3 ? 200 : 10000));
        if (!s.ok()) {
          c->Abort(s);
          (void)h->Wait(absl::Seconds(10));  // completes (failed) once aborted
          return;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  std::vector<v1::FlightRecord> rings;
  for (int r = 0; r < 2; ++r)
    rings.push_back(ToFlightRecord(r, job.recorders[r]->Snapshot(), absl::Now(), ""));
  const std::string d = FirstDivergence(rings, 2);
  EXPECT_NE(
      d.find("step 3: rank 0 waited in reduce-scatter of bucket 0 (seq 3) and failed after 0."),
      std::string::npos)
      << d;
  EXPECT_NE(d.find("rank 1 never started it (last: reduce-scatter of bucket 0, seq 2, finished"),
            std::string::npos)
      << d;
  EXPECT_EQ(job.recorders[0]->stalls(), 1);
}

// --- the RPCs --------------------------------------------------------------

v1::JoinRequest JoinRequestFor(int rank, int world, int owner_port) {
  ParamSpec spec;
  spec.name = "w";
  spec.shape = {64};
  JoinRequestInfo info;
  info.rank = rank;
  info.shard_owner_port = owner_port;
  return MakeJoinRequest(*Plan({spec}, world), info);
}

TEST(FlightRecordsRpcTest, ReportAndLiveQuery) {
  CoordinatorOptions copt;
  copt.world_size = 2;
  Coordinator coordinator(copt);
  CoordinatorService service(&coordinator, "sesame");
  auto server = RpcServer::Start(RpcServerOptions(), {&service});
  ASSERT_TRUE(server.ok()) << server.status();
  CoordinatorClient client((*server)->address(), "sesame");

  // Before anyone joined: no ring, both "not joined".
  auto none = client.GetFlightRecords();
  ASSERT_TRUE(none.ok()) << none.status();
  ASSERT_EQ(none->records_size(), 2);
  EXPECT_EQ(none->records(1).error(), "never joined");
  EXPECT_EQ(
      none->divergence(),
      "rank 0 sent no record (dead? never joined); rank 1 sent no record (dead? never joined)");

  // Two shard owners with rings: rank 1 stopped one collective earlier.
  std::vector<v1::FlightRecord> live = {Finished(0, 20), Finished(1, 19)};
  std::vector<std::unique_ptr<ShardOwnerService>> owners;
  std::vector<std::unique_ptr<RpcServer>> owner_servers;
  for (int r = 0; r < 2; ++r) {
    owners.push_back(std::make_unique<ShardOwnerService>([] { return v1::GetShardInfoResponse(); },
                                                         "sesame", [&live, r] { return live[r]; }));
    auto s = RpcServer::Start(RpcServerOptions(), {owners.back().get()});
    ASSERT_TRUE(s.ok());
    owner_servers.push_back(std::move(*s));
  }
  std::vector<std::thread> joins;
  for (int r = 0; r < 2; ++r) {
    joins.emplace_back([&, r] {
      auto j = client.Join(JoinRequestFor(r, 2, owner_servers[r]->port()), absl::Seconds(10));
      EXPECT_TRUE(j.ok()) << j.status();
    });
  }
  for (auto& t : joins) t.join();
  auto f = client.GetFlightRecords();
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(f->records_size(), 2);
  EXPECT_EQ(f->records(0).records_size(), 20);
  EXPECT_EQ(f->records(1).records_size(), 19);
  EXPECT_EQ(
      f->divergence(),
      "step 4: rank 0 finished all-reduce (seq 20); rank 1 never started it (last: all-gather of "
      "bucket 2, seq 19, finished 41.0 s ago)");

  // Rank 1's shard owner goes away: its reported ring stands in for it, or
  // the error when it reported none.
  owner_servers[1]->Shutdown();
  f = client.GetFlightRecords();
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_NE(f->records(1).error().find("shard owner at"), std::string::npos)
      << f->records(1).error();
  EXPECT_NE(f->divergence().find("rank 1 sent no record (dead? last heartbeat"), std::string::npos)
      << f->divergence();
  v1::FlightRecord reported = Finished(1, 19);
  reported.set_reason("stalled on purpose");
  ASSERT_TRUE(client.ReportFlightRecord(reported).ok());
  f = client.GetFlightRecords();
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->records(1).reason(), "stalled on purpose");
  EXPECT_TRUE(f->records(1).error().empty());
  EXPECT_NE(f->divergence().find("rank 1 never started it"), std::string::npos) << f->divergence();
  // What shardrun prints: the reported rings only.
  const std::string post_mortem = ReportedDivergence(service.flight_records(), coordinator);
  EXPECT_EQ(post_mortem.rfind("step 4: rank 0 sent no record (dead? last heartbeat ", 0), 0u)
      << post_mortem;
  EXPECT_NE(post_mortem.find(
                " s ago, at step 0); rank 1 is in no collective (last: all-gather of bucket 2, "
                "seq 19, finished 41.0 s ago)"),
            std::string::npos)
      << post_mortem;

  // Bad reports and missing tokens are refused.
  v1::FlightRecord bad = Finished(2, 3);  // rank 2 of 2
  EXPECT_EQ(client.ReportFlightRecord(bad).code(), absl::StatusCode::kInvalidArgument);
  CoordinatorClient anonymous((*server)->address(), "");
  EXPECT_EQ(anonymous.ReportFlightRecord(reported).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(anonymous.GetFlightRecords().status().code(), absl::StatusCode::kUnauthenticated);

  for (auto& s : owner_servers) s->Shutdown();
  (*server)->Shutdown();
}

}  // namespace
}  // namespace shardopt
