// RankAgreement alone (torch-free, in-process ranks): a rank that differs in
// its model, its hyper-parameters or the launch order fails loudly on every
// rank, naming what differs; the mask of updated parameters is the maximum
// over ranks (a parameter some rank has a gradient for is updated).
#include "client/rank_agreement.h"

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/comm/in_process_communicator.h"
#include "common/planner.h"

namespace shardopt {
namespace {

constexpr int kWorld = 2;

Layout TwoParams() {
  std::vector<ParamSpec> specs = {{"w", {4, 4}, DType::kFloat32, true},
                                  {"b", {4}, DType::kFloat32, true},
                                  {"frozen", {3}, DType::kFloat32, false}};
  auto layout = Plan(specs, kWorld, PlanOptions());
  EXPECT_TRUE(layout.ok()) << layout.status();
  return *layout;
}

// Runs fn(rank, agreement) on every rank at once; returns each rank's status.
std::vector<absl::Status> OnEveryRank(const std::function<absl::Status(int, RankAgreement&)>& fn) {
  InProcessWorld world(kWorld, absl::Seconds(30));
  const Layout layout = TwoParams();
  std::vector<absl::Status> out(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r, comm = std::shared_ptr<Communicator>(world.Connect(r))] {
      CollectiveWaiter waiter(comm.get(), absl::Seconds(30));
      RankAgreement agreement(&waiter, &layout);
      out[r] = fn(r, agreement);
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

std::vector<HyperParameters> Groups(double lr) {
  HyperParameters h;
  h.adam.lr = lr;
  return {h, h};
}

auto kNever = [](int) { return false; };

TEST(RankAgreementTest, SameModelPasses) {
  for (const absl::Status& s : OnEveryRank([](int, RankAgreement& a) {
         return a.CheckSameModel("options x\nparam w\t[4, 4]\nparam b\t[4]\n");
       })) {
    EXPECT_TRUE(s.ok()) << s;
  }
}

TEST(RankAgreementTest, DifferentModelFailsOnEveryRankNamingTheParameter) {
  for (const absl::Status& s : OnEveryRank([](int r, RankAgreement&a) {
         return a.CheckSameModel(
             absl::StrCat("options x\nparam w\t[4, 4]\nparam b\t[", r == 0 ? 4 : 5, "]\n"));
       })) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("at parameter 'b'"), std::string::npos) << s;
    EXPECT_NE(s.message().find("rank 0 has 'param b\t[4]', rank 1 has 'param b\t[5]'"),
              std::string::npos)
        << s;
  }
}

TEST(RankAgreementTest, UpdatedParametersAreTheMaximumOverRanks) {
  std::vector<std::vector<uint8_t>> active(kWorld);
  std::vector<bool> all(kWorld);
  auto status = OnEveryRank([&](int r, RankAgreement& a) {
    // Rank 0 has a gradient for w only, rank 1 for none: until the agreement
    // arrives, rank 1 must wait before updating any bucket.
    std::vector<float> local = {r == 0 ? 1.0f : 0.0f, 0.0f, 0.0f};
    absl::Status s = a.Launch(OptimizerKind::kAdam, Groups(1e-3), local);
    if (!s.ok()) return s;
    if (r == 1 && a.all_active()) return absl::InternalError("rank 1 has no gradient at all");
    s = a.AgreeIfNeeded(0, 1, kNever);
    if (!s.ok()) return s;
    s = a.FinishIfPending(1);
    active[r] = a.active();
    all[r] = a.all_active();
    return s;
  });
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r];
    EXPECT_EQ(active[r], (std::vector<uint8_t>{1, 0, 0})) << "rank " << r;
    EXPECT_FALSE(all[r]);
  }
}

TEST(RankAgreementTest, DifferentLearningRatesFailOnEveryRankWithBothValues) {
  auto status = OnEveryRank([](int r, RankAgreement& a) {
    absl::Status s = a.Launch(OptimizerKind::kAdam, Groups(r == 0 ? 1e-3 : 2e-3), {1, 1, 0});
    if (!s.ok()) return s;
    return a.FinishIfPending(7);
  });
  for (const absl::Status& s : status) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("ranks disagree on hyper-parameters at step 7"), std::string::npos)
        << s;
    EXPECT_NE(s.message().find("lr=0.001"), std::string::npos) << s;
    EXPECT_NE(s.message().find("lr=0.002"), std::string::npos) << s;
  }
}

TEST(RankAgreementTest, AnUpdateOnThisRanksOwnMarksDoesNotWait) {
  // Every parameter has a gradient here: AgreeIfNeeded returns at once and
  // the agreement finishes at the step's end.
  for (const absl::Status& s : OnEveryRank([](int, RankAgreement& a) {
         absl::Status st = a.Launch(OptimizerKind::kSgd, Groups(0.1), {1, 1, 0});
         if (!st.ok()) return st;
         if (!a.all_active()) return absl::InternalError("expected every parameter active");
         st = a.AgreeIfNeeded(0, 1, kNever);
         if (!st.ok()) return st;
         return a.FinishIfPending(1);
       })) {
    EXPECT_TRUE(s.ok()) << s;
  }
}

TEST(RankAgreementTest, LaunchOrderIsRankZeros) {
  std::vector<std::vector<int32_t>> got(kWorld);
  auto status = OnEveryRank([&](int r, RankAgreement& a) {
    got[r] = r == 0 ? std::vector<int32_t>{2, 0, 1} : std::vector<int32_t>{0, 1, 2};
    return a.BroadcastLaunchOrder(&got[r]);
  });
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r];
    EXPECT_EQ(got[r], (std::vector<int32_t>{2, 0, 1}));
  }
}

TEST(RankAgreementTest, ALaunchOrderThatIsNoPermutationIsRefused) {
  for (const absl::Status& s : OnEveryRank([](int r, RankAgreement&a) {
         std::vector<int32_t> order =
             r == 0 ? std::vector<int32_t>{1, 1, 0} : std::vector<int32_t>{0, 1, 2};
         return a.BroadcastLaunchOrder(&order);
       })) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  }
}

}  // namespace
}  // namespace shardopt
