// The timeout paths of the checkpoint's collective helpers (GatherStrings,
// AgreeOnSuccess: client/checkpoint/checkpoint.cc) and of the optimizer's
// full-state gather must not leave a collective writing into, or reading
// from, freed memory when the peer arrives after the waiter gave up. Built
// with AddressSanitizer (copts below): a late peer touching a freed buffer
// is a heap-use-after-free report and a failed test.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <string>
#include <thread>

#include "absl/time/time.h"
#include "client/checkpoint/checkpoint.h"
#include "client/checkpoint/full_state.h"
#include "client/comm/in_process_communicator.h"
#include "tools/models/models.h"
#include "client/sharded_optimizer.h"

namespace shardopt {
namespace {

struct Rank {
  std::unique_ptr<TrainModel> model;
  std::unique_ptr<ShardedOptimizer> opt;
};

// Two in-process ranks with optimizers whose collectives time out after
// `timeout`; every collective of the world may take up to 30 s.
void MakeRanks(InProcessWorld& world, std::vector<std::unique_ptr<Communicator>>& comms,
               Rank ranks[2], absl::Duration timeout) {
  for (int r = 0; r < 2; ++r) comms.push_back(world.Connect(r));
  std::thread t[2];
  for (int r = 0; r < 2; ++r) {
    t[r] = std::thread([&, r] {
      auto m = MakeModel("tiny", 7);
      ASSERT_TRUE(m.ok());
      ranks[r].model = std::move(*m);
      ShardedOptimizerOptions o;
      o.timeout = timeout;
      auto opt = ShardedOptimizer::Create(ranks[r].model->NamedParameters(), o, comms[r].get());
      ASSERT_TRUE(opt.ok()) << opt.status();
      ranks[r].opt = std::move(*opt);
    });
  }
  for (auto& th : t) th.join();
}

void OneStep(Rank ranks[2]) {
  std::thread t[2];
  for (int r = 0; r < 2; ++r) {
    t[r] = std::thread([&, r] {
      ranks[r].opt->ZeroGrad();
      ranks[r].model->Loss(0, r * 8, (r + 1) * 8).backward();
      ASSERT_TRUE(ranks[r].opt->Step().ok());
    });
  }
  for (auto& th : t) th.join();
}

TEST(CollectiveTimeoutTest, LateRankAfterASaveTimedOutTouchesNoFreedMemory) {
  InProcessWorld world(2, absl::Seconds(30));
  std::vector<std::unique_ptr<Communicator>> comms;
  Rank ranks[2];
  MakeRanks(world, comms, ranks, absl::Seconds(1));
  ASSERT_TRUE(ranks[0].opt && ranks[1].opt);
  OneStep(ranks);
  const std::string root = ::testing::TempDir() + "/late_rank_ckpt";
  absl::StatusOr<std::string> saved0 = absl::UnknownError("not run");
  std::thread late([&] {
    // A slow peer on purpose: arrives 2.5 s after rank 0, which waits 1 s
    // per collective.
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    (void)SaveCheckpoint(*ranks[1].opt, root);
  });
  saved0 = SaveCheckpoint(*ranks[0].opt, root);
  // Rank 0 is back (its buffers would be out of scope now) before rank 1
  // arrives at the collective it gave up on.
  late.join();
  // On purpose, not a wait: a window for a late write into rank 0's freed
  // buffers (by a collective still finishing) to happen while ASan watches.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ASSERT_FALSE(saved0.ok());
  EXPECT_TRUE(saved0.status().code() == absl::StatusCode::kDeadlineExceeded ||
              saved0.status().code() == absl::StatusCode::kAborted)
      << saved0.status();
  EXPECT_FALSE(ResolveCheckpoint(PosixFileSystem(), root).ok()) << "nothing may be committed";
}

TEST(CollectiveTimeoutTest, LateRankAfterAFullStateGatherTimedOutTouchesNoFreedMemory) {
  InProcessWorld world(2, absl::Seconds(30));
  std::vector<std::unique_ptr<Communicator>> comms;
  Rank ranks[2];
  MakeRanks(world, comms, ranks, absl::Seconds(1));
  ASSERT_TRUE(ranks[0].opt && ranks[1].opt);
  OneStep(ranks);
  std::thread late([&] {
    // A slow peer on purpose: arrives 2.5 s after rank 0, which waits 1 s.
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    (void)GatherFullState(*ranks[1].opt);
  });
  auto full0 = GatherFullState(*ranks[0].opt);
  late.join();
  // On purpose, not a wait: a window for a late write into rank 0's freed
  // buffers (by a collective still finishing) to happen while ASan watches.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ASSERT_FALSE(full0.ok());
  EXPECT_EQ(full0.status().code(), absl::StatusCode::kDeadlineExceeded) << full0.status();
}

}  // namespace
}  // namespace shardopt
