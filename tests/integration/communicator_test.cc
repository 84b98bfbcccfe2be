// Collectives of GlooCommunicator (TCP on 127.0.0.1, ranks as threads),
// ShmCommunicator (shared memory; ranks as threads, and as processes for a
// peer's death) and the in-process communicator against reference
// computations; timeouts, abort, injected faults, byte counters, mismatches.
#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <cstdlib>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/comm/gloo_communicator.h"
#include "client/comm/host_communicator.h"
#include "client/comm/shm_communicator.h"
#include "client/comm/in_process_communicator.h"
#include "client/comm/kv_store.h"
#include "gtest/gtest.h"
#include "tests/testing/forwarding_communicator.h"
#include "server/kernels/update_slice.h"

namespace shardopt {
namespace {

enum class Impl { kGloo, kShm, kInProcess };

const char* ImplName(Impl impl) {
  return impl == Impl::kGloo ? "gloo" : impl == Impl::kShm ? "shm" : "inprocess";
}

// A job of `n` ranks; Gloo ranks connect concurrently over loopback.
struct Job {
  std::unique_ptr<InProcessWorld> world;
  InMemoryKeyValueStore store;
  std::vector<std::unique_ptr<Communicator>> comms;

  Job(Impl impl, int n, absl::Duration timeout = absl::Seconds(30), int64_t segment_bytes = 256,
      std::vector<InProcessFaults> faults = {}) {
    comms.resize(n);
    if (impl == Impl::kInProcess) {
      world = std::make_unique<InProcessWorld>(n, timeout);
      for (int r = 0; r < n; ++r) {
        comms[r] =
            world->Connect(r, r < static_cast<int>(faults.size()) ? faults[r] : InProcessFaults());
      }
      return;
    }
    GlooOptions opt;
    opt.timeout = timeout;
    opt.segment_bytes = segment_bytes;
    ShmOptions sopt;
    sopt.timeout = timeout;
    sopt.slot_bytes = std::max<int64_t>(64, segment_bytes / 64 * 64);
    std::vector<std::thread> threads;
    std::vector<absl::Status> errors(n);
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        absl::Status status;
        if (impl == Impl::kShm) {
          auto c = ShmCommunicator::Create(&store, r, n, sopt);
          if (c.ok()) comms[r] = std::move(*c);
          status = c.status();
        } else {
          auto c = GlooCommunicator::Create(&store, r, n, opt);
          if (c.ok()) comms[r] = std::move(*c);
          status = c.status();
        }
        errors[r] = status;
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < n; ++r) EXPECT_TRUE(errors[r].ok()) << errors[r];
  }
  // Runs fn(rank) on every rank concurrently.
  void Parallel(const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < static_cast<int>(comms.size()); ++r) threads.emplace_back(fn, r);
    for (auto& t : threads) t.join();
  }
};

// Values that sum exactly in any order, in fp32 and in bf16.
float Value(int rank, int64_t i) { return static_cast<float>((rank * 7 + i * 3) % 17) - 8.0f; }

struct Typed {
  DType type;
  std::vector<char> bytes;
  Typed(DType t, int64_t count) : type(t), bytes(count * DTypeSize(t)) {}
  void Set(int64_t i, float v) {
    if (type == DType::kFloat32) {
      std::memcpy(&bytes[i * 4], &v, 4);
    } else {
      uint16_t h = FloatToBf16(v);
      std::memcpy(&bytes[i * 2], &h, 2);
    }
  }
  float Get(int64_t i) const {
    if (type == DType::kFloat32) {
      float v;
      std::memcpy(&v, &bytes[i * 4], 4);
      return v;
    }
    uint16_t h;
    std::memcpy(&h, &bytes[i * 2], 2);
    return Bf16ToFloat(h);
  }
  void* data() { return bytes.data(); }
};

using Param = std::tuple<Impl, int, DType>;

class CollectiveTest : public ::testing::TestWithParam<Param> {};

const std::vector<int64_t> kCounts = {0, 1, 7, 64, 65, 1000, 12345};

TEST_P(CollectiveTest, ReduceScatter) {
  // (Not a structured binding: lambdas below capture them, which C++17 and
  // clang do not allow for bindings.)
  const Impl impl = std::get<0>(GetParam());
  const int n = std::get<1>(GetParam());
  const DType type = std::get<2>(GetParam());
  Job job(impl, n);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage, ReduceOp::kMax}) {
    for (int64_t count : kCounts) {
      std::vector<Typed> bufs;
      for (int r = 0; r < n; ++r) {
        bufs.emplace_back(type, n * count);
        for (int64_t i = 0; i < n * count; ++i) bufs[r].Set(i, Value(r, i));
      }
      job.Parallel([&](int r) {
        EXPECT_TRUE(job.comms[r]
                        ->ReduceScatter(bufs[r].data(), count, type, op)
                        ->Wait(absl::Seconds(30))
                        .ok());
      });
      for (int r = 0; r < n; ++r) {
        for (int64_t i = r * count; i < (r + 1) * count; ++i) {
          float want = op == ReduceOp::kMax ? -1e30f : 0.0f;
          for (int q = 0; q < n; ++q) {
            want = op == ReduceOp::kMax ? std::max(want, Value(q, i)) : want + Value(q, i);
          }
          if (op == ReduceOp::kAverage) want *= 1.0f / n;
          if (type == DType::kBFloat16) want = Bf16ToFloat(FloatToBf16(want));
          ASSERT_EQ(bufs[r].Get(i), want) << "rank " << r << " element " << i << " count " << count;
        }
      }
    }
  }
}

// ReduceScatterChunks: every chunk a separate allocation (as ShardedOptimizer's
// gradient sharding gives: this rank's chunk in its owned gradients, the
// others in staging), in reverse order in memory; only this rank's chunk is
// specified afterwards.
TEST_P(CollectiveTest, ReduceScatterOfSeparateChunks) {
  // (Not a structured binding: lambdas below capture them, which C++17 and
  // clang do not allow for bindings.)
  const Impl impl = std::get<0>(GetParam());
  const int n = std::get<1>(GetParam());
  const DType type = std::get<2>(GetParam());
  Job job(impl, n);
  for (int r = 0; r < n; ++r) EXPECT_TRUE(job.comms[r]->SupportsSeparateChunks());
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
    for (int64_t count : kCounts) {
      // chunks[r][i]: rank r's copy of chunk i, one allocation each, with 8
      // guard elements on either side that must stay untouched.
      constexpr int64_t kGuard = 8;
      constexpr float kGuardValue = 1024.0f;  // exact in bf16 too
      std::vector<std::vector<Typed>> chunks(n);
      for (int r = 0; r < n; ++r) {
        for (int i = 0; i < n; ++i) {
          chunks[r].emplace_back(type, count + 2 * kGuard);
          for (int64_t e = 0; e < count + 2 * kGuard; ++e) chunks[r][i].Set(e, kGuardValue);
          for (int64_t e = 0; e < count; ++e) chunks[r][i].Set(kGuard + e, Value(r, i * count + e));
        }
      }
      job.Parallel([&](int r) {
        std::vector<void*> ptrs;
        for (int i = 0; i < n; ++i) {
          ptrs.push_back(chunks[r][i].bytes.data() + kGuard * DTypeSize(type));
        }
        absl::Status s =
            job.comms[r]->ReduceScatterChunks(ptrs, count, type, op)->Wait(absl::Seconds(30));
        EXPECT_TRUE(s.ok()) << s;
      });
      for (int r = 0; r < n; ++r) {
        for (int64_t e = 0; e < count; ++e) {
          float want = 0.0f;
          for (int q = 0; q < n; ++q) want += Value(q, r * count + e);
          if (op == ReduceOp::kAverage) want *= 1.0f / n;
          if (type == DType::kBFloat16) want = Bf16ToFloat(FloatToBf16(want));
          ASSERT_EQ(chunks[r][r].Get(kGuard + e), want)
              << "rank " << r << " element " << e << " count " << count;
        }
        for (int i = 0; i < n; ++i) {
          for (int64_t e = 0; e < kGuard; ++e) {
            ASSERT_EQ(chunks[r][i].Get(e), kGuardValue) << "before chunk " << i << ", rank " << r;
            ASSERT_EQ(chunks[r][i].Get(kGuard + count + e), kGuardValue)
                << "after chunk " << i << ", rank " << r;
          }
        }
      }
    }
  }
}

TEST_P(CollectiveTest, AllGather) {
  // (Not a structured binding: lambdas below capture them, which C++17 and
  // clang do not allow for bindings.)
  const Impl impl = std::get<0>(GetParam());
  const int n = std::get<1>(GetParam());
  const DType type = std::get<2>(GetParam());
  Job job(impl, n);
  for (int64_t count : kCounts) {
    std::vector<Typed> bufs;
    for (int r = 0; r < n; ++r) {
      bufs.emplace_back(type, n * count);
      for (int64_t i = 0; i < n * count; ++i)
        bufs[r].Set(i, i / std::max<int64_t>(count, 1) == r ? Value(r, i) : 99.0f);
    }
    job.Parallel([&](int r) {
      EXPECT_TRUE(
          job.comms[r]->AllGather(bufs[r].data(), count, type)->Wait(absl::Seconds(30)).ok());
    });
    for (int r = 0; r < n; ++r) {
      for (int64_t i = 0; i < n * count; ++i) {
        ASSERT_EQ(bufs[r].Get(i), Value(static_cast<int>(i / count), i))
            << "rank " << r << " i " << i;
      }
    }
  }
}

TEST_P(CollectiveTest, AllReduceBroadcastBarrier) {
  // (Not a structured binding: lambdas below capture them, which C++17 and
  // clang do not allow for bindings.)
  const Impl impl = std::get<0>(GetParam());
  const int n = std::get<1>(GetParam());
  const DType type = std::get<2>(GetParam());
  Job job(impl, n);
  for (int64_t count : kCounts) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      std::vector<Typed> bufs;
      for (int r = 0; r < n; ++r) {
        bufs.emplace_back(type, count);
        for (int64_t i = 0; i < count; ++i) bufs[r].Set(i, Value(r, i));
      }
      job.Parallel([&](int r) {
        EXPECT_TRUE(
            job.comms[r]->AllReduce(bufs[r].data(), count, type, op)->Wait(absl::Seconds(30)).ok());
      });
      for (int r = 0; r < n; ++r) {
        for (int64_t i = 0; i < count; ++i) {
          float want = op == ReduceOp::kMax ? -1e30f : 0.0f;
          for (int q = 0; q < n; ++q) {
            want = op == ReduceOp::kMax ? std::max(want, Value(q, i)) : want + Value(q, i);
          }
          ASSERT_EQ(bufs[r].Get(i), want);
        }
      }
    }
    for (int root = 0; root < n; ++root) {
      std::vector<Typed> bufs;
      for (int r = 0; r < n; ++r) {
        bufs.emplace_back(type, count);
        for (int64_t i = 0; i < count; ++i) bufs[r].Set(i, r == root ? Value(r, i) : 77.0f);
      }
      job.Parallel([&](int r) {
        EXPECT_TRUE(job.comms[r]
                        ->Broadcast(bufs[r].data(), count, type, root)
                        ->Wait(absl::Seconds(30))
                        .ok());
      });
      for (int r = 0; r < n; ++r) {
        for (int64_t i = 0; i < count; ++i) ASSERT_EQ(bufs[r].Get(i), Value(root, i));
      }
    }
  }
  job.Parallel([&](int r) { EXPECT_TRUE(job.comms[r]->Barrier()->Wait(absl::Seconds(30)).ok()); });
}

TEST_P(CollectiveTest, ByteCountersMatchTheRing) {
  // (Not a structured binding: lambdas below capture them, which C++17 and
  // clang do not allow for bindings.)
  const Impl impl = std::get<0>(GetParam());
  const int n = std::get<1>(GetParam());
  const DType type = std::get<2>(GetParam());
  Job job(impl, n);
  const int64_t count = 1000;
  std::vector<Typed> bufs;
  for (int r = 0; r < n; ++r) bufs.emplace_back(type, n * count);
  job.Parallel([&](int r) {
    EXPECT_TRUE(job.comms[r]
                    ->ReduceScatter(bufs[r].data(), count, type, ReduceOp::kSum)
                    ->Wait(absl::Seconds(30))
                    .ok());
    EXPECT_TRUE(job.comms[r]->AllGather(bufs[r].data(), count, type)->Wait(absl::Seconds(30)).ok());
  });
  const int64_t chunk = count * DTypeSize(type);
  for (int r = 0; r < n; ++r) {
    ByteCounters c = job.comms[r]->counters();
    EXPECT_EQ(c.sent[static_cast<int>(CollectiveKind::kReduceScatter)], (n - 1) * chunk);
    EXPECT_EQ(c.sent[static_cast<int>(CollectiveKind::kAllGather)], (n - 1) * chunk);
    EXPECT_EQ(c.total_received(), 2 * (n - 1) * chunk);
  }
}

INSTANTIATE_TEST_SUITE_P(All, CollectiveTest,
                         ::testing::Combine(::testing::Values(Impl::kGloo, Impl::kShm,
                                                              Impl::kInProcess),
                                            ::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16)),
                         [](const auto& info) {
                           return absl::StrCat(ImplName(std::get<0>(info.param)), "_",
                                               std::get<1>(info.param), "ranks_",
                                               DTypeName(std::get<2>(info.param)));
                         });

class FailureTest : public ::testing::TestWithParam<Impl> {};

TEST_P(FailureTest, TimeoutFiresWhenAPeerNeverCalls) {
  Job job(GetParam(), 2, absl::Milliseconds(700));
  std::vector<float> buf(4, 1.0f);
  const absl::Time start = absl::Now();
  absl::Status s = job.comms[0]
                       ->AllReduce(buf.data(), 4, DType::kFloat32, ReduceOp::kSum)
                       ->Wait(absl::Seconds(20));
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  // The communicator is unusable afterwards: later calls fail at once.
  EXPECT_FALSE(job.comms[0]->Barrier()->Wait(absl::Seconds(5)).ok());
}

TEST_P(FailureTest, AbortUnblocksAWaitingRankAndFailsLaterCalls) {
  Job job(GetParam(), 2, absl::Seconds(60));
  std::vector<float> buf(4, 1.0f);
  CommHandlePtr h = job.comms[0]->AllReduce(buf.data(), 4, DType::kFloat32, ReduceOp::kSum);
  // Rank 1 never calls. Abort from another thread while rank 0 waits.
  std::thread aborter([&] { job.comms[0]->Abort(absl::UnavailableError("rank 1 died")); });
  const absl::Time start = absl::Now();
  absl::Status s = h->Wait(absl::Seconds(20));
  aborter.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("rank 1 died"), absl::string_view::npos) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  absl::Status later = job.comms[0]->Barrier()->Wait(absl::Seconds(1));
  EXPECT_EQ(later.code(), absl::StatusCode::kAborted);
}

TEST_P(FailureTest, BadArgumentsAreErrors) {
  Job job(GetParam(), 2);
  std::vector<float> buf(4);
  EXPECT_EQ(job.comms[0]
                ->AllReduce(buf.data(), -1, DType::kFloat32, ReduceOp::kSum)
                ->Wait(absl::Seconds(1))
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(job.comms[0]
                ->AllReduce(nullptr, 4, DType::kFloat32, ReduceOp::kSum)
                ->Wait(absl::Seconds(1))
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      job.comms[0]->Broadcast(buf.data(), 4, DType::kFloat32, 2)->Wait(absl::Seconds(1)).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(job.comms[0]
                ->ReduceScatter(buf.data(), 2, DType::kByte, ReduceOp::kSum)
                ->Wait(absl::Seconds(1))
                .code(),
            absl::StatusCode::kInvalidArgument);
  // Separate chunks: one pointer per rank, none null.
  absl::Status s = job.comms[0]
                       ->ReduceScatterChunks({buf.data()}, 2, DType::kFloat32, ReduceOp::kSum)
                       ->Wait(absl::Seconds(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("1 chunk pointers for a world of 2"), absl::string_view::npos) << s;
  EXPECT_EQ(job.comms[0]
                ->ReduceScatterChunks({buf.data(), nullptr}, 2, DType::kFloat32, ReduceOp::kSum)
                ->Wait(absl::Seconds(1))
                .code(),
            absl::StatusCode::kInvalidArgument);
  s = job.comms[0]
          ->ReduceScatterChunks({buf.data() + 1, buf.data()}, 2, DType::kFloat32, ReduceOp::kSum)
          ->Wait(absl::Seconds(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("overlap"), absl::string_view::npos) << s;
}

// Without separate-chunk support (as NCCL's communicator), the default
// ReduceScatterChunks takes adjacent chunks as one ReduceScatter and refuses
// separate ones instead of reducing wrongly.
TEST(SeparateChunksTest, WithoutSupportAdjacentChunksWorkAndSeparateOnesAreRefused) {
  Job job(Impl::kInProcess, 2);
  ForwardingCommunicator f0(job.comms[0].get()), f1(job.comms[1].get());
  ForwardingCommunicator* fwd[2] = {&f0, &f1};
  EXPECT_FALSE(fwd[0]->SupportsSeparateChunks());
  std::vector<std::vector<float>> buf = {{1, 2, 3, 4}, {10, 20, 30, 40}};
  job.Parallel([&](int r) {
    float* b = buf[r].data();
    absl::Status s = fwd[r]
                         ->ReduceScatterChunks({b, b + 2}, 2, DType::kFloat32, ReduceOp::kSum)
                         ->Wait(absl::Seconds(10));
    EXPECT_TRUE(s.ok()) << s;
  });
  EXPECT_EQ(buf[0][0], 11.0f);
  EXPECT_EQ(buf[0][1], 22.0f);
  EXPECT_EQ(buf[1][2], 33.0f);
  EXPECT_EQ(buf[1][3], 44.0f);
  float x[6] = {1, 2, 0, 0, 3, 4};  // chunks at x and x + 4: not adjacent
  absl::Status s = fwd[0]
                       ->ReduceScatterChunks({x, x + 4}, 2, DType::kFloat32, ReduceOp::kSum)
                       ->Wait(absl::Seconds(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
}

INSTANTIATE_TEST_SUITE_P(All, FailureTest,
                         ::testing::Values(Impl::kGloo, Impl::kShm, Impl::kInProcess),
                         [](const auto& info) { return ImplName(info.param); });

TEST(InProcessFaultsTest, InjectedFailureAndStallNameTheRank) {
  std::vector<InProcessFaults> faults(3);
  faults[2].stall_at_op = 0;
  Job job(Impl::kInProcess, 3, absl::Milliseconds(500), 256, faults);
  std::vector<std::vector<float>> bufs(3, std::vector<float>(3, 1.0f));
  std::vector<absl::Status> st(3);
  job.Parallel([&](int r) {
    st[r] = job.comms[r]
                ->AllReduce(bufs[r].data(), 3, DType::kFloat32, ReduceOp::kSum)
                ->Wait(r == 2 ? absl::Milliseconds(200) : absl::Seconds(10));
  });
  EXPECT_EQ(st[0].code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(st[0].message().find("waiting for rank(s) 2"), absl::string_view::npos) << st[0];
  EXPECT_EQ(st[2].code(), absl::StatusCode::kDeadlineExceeded);  // still stalled
  job.comms[2]->Abort(absl::CancelledError("test over"));
  EXPECT_EQ(job.comms[2]->Barrier()->Wait(absl::Seconds(5)).code(), absl::StatusCode::kAborted);

  std::vector<InProcessFaults> fail(2);
  fail[1].fail_at_op = 0;
  Job job2(Impl::kInProcess, 2, absl::Milliseconds(300), 256, fail);
  job2.Parallel([&](int r) { st[r] = job2.comms[r]->Barrier()->Wait(absl::Seconds(10)); });
  EXPECT_EQ(st[1].code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(st[0].code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(InProcessFaultsTest, MismatchedCollectivesAreAnError) {
  Job job(Impl::kInProcess, 2, absl::Seconds(5));
  std::vector<float> a(4), b(4);
  std::vector<absl::Status> st(2);
  job.Parallel([&](int r) {
    st[r] = r == 0
                ? job.comms[0]
                      ->AllReduce(a.data(), 4, DType::kFloat32, ReduceOp::kSum)
                      ->Wait(absl::Seconds(5))
                : job.comms[1]->Broadcast(b.data(), 4, DType::kFloat32, 0)->Wait(absl::Seconds(5));
  });
  EXPECT_EQ(st[0].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st[1].message().find("collective mismatch"), absl::string_view::npos) << st[1];
}

// Names this process left in /dev/shm.
std::vector<std::string> OurShmFiles() {
  std::vector<std::string> out;
  const std::string prefix = absl::StrCat("shardopt-", getpid(), "-");
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) {
      if (std::string(e->d_name).rfind(prefix, 0) == 0) out.push_back(e->d_name);
    }
    closedir(d);
  }
  return out;
}

TEST(ShmTest, MismatchedCollectivesAreAnErrorOnBothRanks) {
  Job job(Impl::kShm, 2, absl::Seconds(10));
  std::vector<float> a(8, 1.0f), b(8, 1.0f);
  std::vector<absl::Status> st(2);
  job.Parallel([&](int r) {
    st[r] = r == 0
                ? job.comms[0]
                      ->AllReduce(a.data(), 8, DType::kFloat32, ReduceOp::kSum)
                      ->Wait(absl::Seconds(10))
                : job.comms[1]->Broadcast(b.data(), 8, DType::kFloat32, 0)->Wait(absl::Seconds(10));
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(st[r].ok());
    EXPECT_NE(st[r].message().find("collective mismatch"), absl::string_view::npos) << st[r];
  }
  // Sizes are checked too.
  Job job2(Impl::kShm, 2, absl::Seconds(10));
  job2.Parallel([&](int r) {
    st[r] = job2.comms[r]
                ->AllGather(a.data(), r == 0 ? 4 : 2, DType::kFloat32)
                ->Wait(absl::Seconds(10));
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(st[r].message().find("collective mismatch"), absl::string_view::npos) << st[r];
  }
  // Element types, and an empty collective on one rank only (it sends nothing
  // but still counts, so the next one no longer lines up).
  Job job3(Impl::kShm, 2, absl::Seconds(10));
  job3.Parallel([&](int r) {
    st[r] = job3.comms[r]
                ->AllGather(a.data(), r == 0 ? 4 : 8, r == 0 ? DType::kFloat32 : DType::kBFloat16)
                ->Wait(absl::Seconds(10));
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(st[r].message().find("collective mismatch"), absl::string_view::npos) << st[r];
  }
  Job job4(Impl::kShm, 2, absl::Seconds(10));
  job4.Parallel([&](int r) {
    if (r == 0) {
      EXPECT_TRUE(job4.comms[0]
                      ->AllReduce(a.data(), 0, DType::kFloat32, ReduceOp::kSum)
                      ->Wait(absl::Seconds(10))
                      .ok());
    }
    st[r] = job4.comms[r]
                ->AllReduce(a.data(), 8, DType::kFloat32, ReduceOp::kSum)
                ->Wait(absl::Seconds(10));
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(st[r].message().find("collective mismatch"), absl::string_view::npos) << st[r];
  }
}

TEST(ShmTest, APeerThatAbortsFailsItsNeighboursPromptlyWithItsReason) {
  Job job(Impl::kShm, 3, absl::Seconds(60));
  std::vector<std::vector<float>> bufs(3, std::vector<float>(3000, 1.0f));
  std::vector<CommHandlePtr> h(3);
  for (int r : {0, 1}) {
    h[r] = job.comms[r]->AllReduce(bufs[r].data(), 3000, DType::kFloat32, ReduceOp::kSum);
  }
  const absl::Time start = absl::Now();
  job.comms[2]->Abort(absl::UnavailableError("rank 2 ran out of memory"));
  for (int r : {0, 1}) {
    absl::Status s = h[r]->Wait(absl::Seconds(20));
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_NE(s.message().find("rank 2 ran out of memory"), absl::string_view::npos) << s;
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(ShmTest, ANeighbourThatFinishedAndClosedIsNoFailure) {
  // Broadcast from rank 2 along 2 -> 0 -> 1: rank 2 is done once its data is
  // in rank 0's slots and closes its communicator, while rank 1 still waits
  // for rank 0 (late); rank 1's other neighbour being closed must not fail it.
  Job job(Impl::kShm, 3, absl::Seconds(20));
  std::vector<std::vector<float>> bufs(3, std::vector<float>(100, 0.0f));
  bufs[2].assign(100, 5.0f);
  CommHandlePtr h1 = job.comms[1]->Broadcast(bufs[1].data(), 100, DType::kFloat32, 2);
  ASSERT_TRUE(job.comms[2]
                  ->Broadcast(bufs[2].data(), 100, DType::kFloat32, 2)
                  ->Wait(absl::Seconds(10))
                  .ok());
  job.comms[2].reset();
  // On purpose, not a wait: rank 1 polls its neighbours meanwhile (and must
  // not take rank 2's close for a failure).
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(h1->done());
  EXPECT_TRUE(job.comms[0]
                  ->Broadcast(bufs[0].data(), 100, DType::kFloat32, 2)
                  ->Wait(absl::Seconds(10))
                  .ok());
  absl::Status s = h1->Wait(absl::Seconds(10));
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(bufs[1], std::vector<float>(100, 5.0f));
  EXPECT_EQ(bufs[0], bufs[1]);
}

TEST(ShmTest, APeerKilledMidJobIsNoticedInMillisecondsNotAtTheTimeout) {
  char dir[] = "/tmp/shm_test_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    FileKeyValueStore store(dir);
    ShmOptions o;
    o.timeout = absl::Seconds(30);
    auto c = ShmCommunicator::Create(&store, 1, 2, o);
    if (!c.ok()) _exit(3);
    std::vector<float> buf(4, 1.0f);
    if (!(*c)->AllReduce(buf.data(), 4, DType::kFloat32, ReduceOp::kSum)
             ->Wait(absl::Seconds(30))
             .ok()) {
      _exit(4);
    }
    // On purpose: rank 0 is already waiting in the next all-reduce when
    // this rank dies.
    absl::SleepFor(absl::Milliseconds(300));
    raise(SIGKILL);  // in the middle of the job, with no chance to say so
  }
  FileKeyValueStore store(dir);
  ShmOptions o;
  o.timeout = absl::Seconds(30);
  auto c = ShmCommunicator::Create(&store, 0, 2, o);
  ASSERT_TRUE(c.ok()) << c.status();
  std::vector<float> buf(1 << 20, 1.0f);
  ASSERT_TRUE((*c)->AllReduce(buf.data(), 4, DType::kFloat32, ReduceOp::kSum)
                  ->Wait(absl::Seconds(30))
                  .ok());
  EXPECT_EQ(buf[0], 2.0f);
  // Rank 1 never joins this one: it is killed while rank 0 waits.
  const absl::Time start = absl::Now();
  absl::Status s = (*c)->AllReduce(buf.data(), 1 << 20, DType::kFloat32, ReduceOp::kSum)
                       ->Wait(absl::Seconds(30));
  int wstatus = 0;
  waitpid(child, &wstatus, 0);
  EXPECT_TRUE(WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGKILL) << wstatus;
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("rank 1 (pid " + std::to_string(child) + ") exited"),
            absl::string_view::npos)
      << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // Nothing of either rank is left in /dev/shm.
  EXPECT_TRUE(OurShmFiles().empty());
  std::system(absl::StrCat("rm -rf ", dir).c_str());
}

TEST(ShmTest, RegionsAreUnlinkedOnceMappedAndAfterAFailedRendezvous) {
  {
    Job job(Impl::kShm, 3);
    EXPECT_TRUE(OurShmFiles().empty());
  }
  InMemoryKeyValueStore store;
  ShmOptions o;
  o.timeout = absl::Milliseconds(300);
  auto c = ShmCommunicator::Create(&store, 0, 2, o);  // rank 1 never comes
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded) << c.status();
  EXPECT_NE(c.status().message().find("shared-memory rendezvous of rank 0 of 2"),
            absl::string_view::npos)
      << c.status();
  EXPECT_TRUE(OurShmFiles().empty());
}

TEST(ShmTest, BadOptionsAndMismatchedSlotsAreErrors) {
  InMemoryKeyValueStore store;
  ShmOptions o;
  o.slot_bytes = 100;
  EXPECT_EQ(ShmCommunicator::Create(&store, 0, 2, o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o = ShmOptions();
  o.slots = 1;
  EXPECT_EQ(ShmCommunicator::Create(&store, 0, 2, o).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmCommunicator::Create(&store, 2, 2, ShmOptions()).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Ranks that disagree on the channel size fail at rendezvous, not later.
  std::vector<absl::Status> st(2);
  std::vector<std::thread> threads;
  const absl::Time start = absl::Now();
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      ShmOptions so;
      so.timeout = absl::Seconds(30);
      so.slots = r == 0 ? 4 : 8;
      st[r] = ShmCommunicator::Create(&store, r, 2, so).status();
    });
  }
  for (auto& t : threads) t.join();
  // Both fail at once, and both name the cause (a rank that finds the
  // other's region gone reads the failure the other published).
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(st[r].ok());
    EXPECT_NE(st[r].message().find("same slots and slot_bytes"), absl::string_view::npos) << st[r];
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));  // not at the 30 s timeout
}

TEST(ShmTest, LargeBuffersAtTheDefaultSlotSize) {
  for (int n : {2, 3}) {
    InMemoryKeyValueStore store;
    std::vector<std::unique_ptr<Communicator>> comms(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        auto c = ShmCommunicator::Create(&store, r, n, ShmOptions());
        ASSERT_TRUE(c.ok()) << c.status();
        comms[r] = std::move(*c);
      });
    }
    for (auto& t : threads) t.join();
    const int64_t count = (5 << 20) + 3;  // 20 MiB of floats: many slot wraps, a ragged end
    std::vector<std::vector<float>> bufs(n, std::vector<float>(count));
    for (int r = 0; r < n; ++r) {
      for (int64_t i = 0; i < count; ++i) bufs[r][i] = Value(r, i);
    }
    threads.clear();
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        EXPECT_TRUE(comms[r]
                        ->AllReduce(bufs[r].data(), count, DType::kFloat32, ReduceOp::kSum)
                        ->Wait(absl::Seconds(60))
                        .ok());
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < n; ++r) {
      for (int64_t i = 0; i < count; i += 997) {
        float want = 0;
        for (int q = 0; q < n; ++q) want += Value(q, i);
        ASSERT_EQ(bufs[r][i], want) << "n " << n << " rank " << r << " i " << i;
      }
      ASSERT_EQ(bufs[r][count - 1], [&] {
        float w = 0;
        for (int q = 0; q < n; ++q) w += Value(q, count - 1);
        return w;
      }());
    }
  }
}

TEST(CpuTransportTest, AutoPicksSharedMemoryOnOneHostAndNamesAreParsed) {
  InMemoryKeyValueStore store;
  std::vector<absl::StatusOr<CpuComm>> comms(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back(
        [&, r] { comms[r] = CreateCpuCommunicator(&store, r, 2, CpuCommOptions()); });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(comms[r].ok()) << comms[r].status();
    EXPECT_EQ(comms[r]->transport, CpuTransport::kShm);
  }
  std::vector<float> a(5, 1.0f), b(5, 2.0f);
  threads.clear();
  threads.emplace_back([&] {
    EXPECT_TRUE(comms[0]
                    ->comm->AllReduce(a.data(), 5, DType::kFloat32, ReduceOp::kSum)
                    ->Wait(absl::Seconds(10))
                    .ok());
  });
  EXPECT_TRUE(comms[1]
                  ->comm->AllReduce(b.data(), 5, DType::kFloat32, ReduceOp::kSum)
                  ->Wait(absl::Seconds(10))
                  .ok());
  threads[0].join();
  EXPECT_EQ(a, std::vector<float>(5, 3.0f));
  EXPECT_EQ(b, a);
  EXPECT_EQ(*ParseCpuTransport("gloo"), CpuTransport::kGloo);
  EXPECT_EQ(*ParseCpuTransport("shm"), CpuTransport::kShm);
  EXPECT_EQ(*ParseCpuTransport("auto"), CpuTransport::kAuto);
  absl::Status bad = ParseCpuTransport("tcp").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("auto"), absl::string_view::npos) << bad;
}

TEST(CpuTransportTest, AutoFallsBackToGlooTogetherWhenSharedMemoryFails) {
  // Ranks whose channels disagree (as if one rank's /dev/shm could not hold
  // them) fail the shared-memory rendezvous; with auto every rank then uses
  // Gloo, and says why. With shm forced it is an error.
  for (CpuTransport t : {CpuTransport::kAuto, CpuTransport::kShm}) {
    InMemoryKeyValueStore store;
    std::vector<absl::StatusOr<CpuComm>> comms(2);
    std::vector<std::thread> threads;
    const absl::Time start = absl::Now();
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        CpuCommOptions o;
        o.transport = t;
        o.timeout = absl::Seconds(30);
        o.shm.slots = r == 0 ? 4 : 8;
        comms[r] = CreateCpuCommunicator(&store, r, 2, o);
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    if (t == CpuTransport::kShm) {
      for (int r = 0; r < 2; ++r) EXPECT_FALSE(comms[r].ok());
      continue;
    }
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(comms[r].ok()) << comms[r].status();
      EXPECT_EQ(comms[r]->transport, CpuTransport::kGloo);
      EXPECT_NE(comms[r]->fallback_reason.find("shared memory failed"), std::string::npos)
          << comms[r]->fallback_reason;
      EXPECT_NE(comms[r]->fallback_reason.find("same slots and slot_bytes"), std::string::npos)
          << comms[r]->fallback_reason;
    }
    std::vector<float> a(5, 1.0f), b(5, 2.0f);
    std::thread other([&] {
      EXPECT_TRUE(comms[0]
                      ->comm->AllReduce(a.data(), 5, DType::kFloat32, ReduceOp::kSum)
                      ->Wait(absl::Seconds(10))
                      .ok());
    });
    EXPECT_TRUE(comms[1]
                    ->comm->AllReduce(b.data(), 5, DType::kFloat32, ReduceOp::kSum)
                    ->Wait(absl::Seconds(10))
                    .ok());
    other.join();
    EXPECT_EQ(a, std::vector<float>(5, 3.0f));
    EXPECT_EQ(b, a);
  }
}

TEST(KeyValueStoreTest, GetWaitsAndTimesOut) {
  InMemoryKeyValueStore store;
  EXPECT_EQ(store.Get("k", absl::Milliseconds(10)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  std::thread setter([&] { EXPECT_TRUE(store.Set("k", "v").ok()); });
  auto v = store.Get("k", absl::Seconds(10));
  setter.join();
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, "v");
  const std::string dir = ::testing::TempDir();
  FileKeyValueStore files(dir);
  EXPECT_TRUE(files.Set("job/a", std::string("x\0y", 3)).ok());
  auto f = files.Get("job/a", absl::Seconds(1));
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(*f, std::string("x\0y", 3));
  EXPECT_EQ(files.Get("job/missing", absl::Milliseconds(20)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace shardopt
