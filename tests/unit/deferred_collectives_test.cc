// device_async_step's deferred collectives (client/deferred_collectives.h),
// alone: which are due at a step, the order they are waited for, the first
// failure stopping the rest, and failures seen before they are waited for.
#include "client/deferred_collectives.h"

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace shardopt {
namespace {

CommHandlePtr Handle(bool done, absl::Status status = absl::OkStatus()) {
  auto h = std::make_shared<CommHandle>();
  if (done) h->Complete(std::move(status));
  return h;
}

std::vector<int> Waited(DeferredCollectives& d, bool all, int64_t step, absl::Status* result,
                        int fail_bucket = -2) {
  std::vector<int> waited;
  *result = d.WaitDue(all, step, [&](const DeferredCollectives::Entry& e) {
    waited.push_back(e.bucket);
    return e.bucket == fail_bucket ? absl::AbortedError(e.what) : absl::OkStatus();
  });
  return waited;
}

TEST(DeferredCollectivesTest, DueAreDoneOnesAndThoseOlderThanThePreviousStep) {
  DeferredCollectives d;
  d.Add({Handle(false), "all-gather", 0, 3});  // two steps old at step 5: due
  d.Add({Handle(false), "all-gather", 1, 4});  // the previous step's: may stay in flight
  d.Add({Handle(true), "all-gather", 2, 5});   // done: checked now
  d.Add({Handle(false), "gradient norm", -1, 5});
  absl::Status s;
  EXPECT_EQ(Waited(d, /*all=*/false, 5, &s), (std::vector<int>{0, 2}));
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(d.size(), 2u);
  EXPECT_EQ(Waited(d, /*all=*/true, 5, &s), (std::vector<int>{1, -1}));
  EXPECT_TRUE(d.empty());
}

TEST(DeferredCollectivesTest, TheFirstFailureStopsAndDropsTheRest) {
  DeferredCollectives d;
  for (int b = 0; b < 4; ++b) d.Add({Handle(false), "reduce-scatter", b, 1});
  absl::Status s;
  EXPECT_EQ(Waited(d, /*all=*/true, 1, &s, /*fail_bucket=*/1), (std::vector<int>{0, 1}));
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(std::string(s.message()), "reduce-scatter");
  EXPECT_TRUE(d.empty());  // 2 and 3 would only fail with "communicator aborted"
}

TEST(DeferredCollectivesTest, NotDueOnesBeforeAFailureAreKept) {
  DeferredCollectives d;
  d.Add({Handle(false), "all-gather", 0, 9});  // not due at step 9
  d.Add({Handle(true), "all-gather", 1, 9});   // due, fails
  d.Add({Handle(true), "all-gather", 2, 9});   // after the failure: dropped
  absl::Status s;
  EXPECT_EQ(Waited(d, /*all=*/false, 9, &s, /*fail_bucket=*/1), (std::vector<int>{1}));
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(d.size(), 1u);
}

TEST(DeferredCollectivesTest, AnyFailedSeesCompletedFailuresOnly) {
  DeferredCollectives d;
  d.Add({Handle(false), "all-gather", 0, 1});
  d.Add({Handle(true), "all-gather", 1, 1});
  EXPECT_FALSE(d.AnyFailed());
  d.Add({Handle(true, absl::DeadlineExceededError("slow peer")), "gradient norm", -1, 1});
  EXPECT_TRUE(d.AnyFailed());
}

TEST(DeferredCollectivesTest, WaitAllIsBoundedByItsTimeout) {
  DeferredCollectives d;
  d.Add({Handle(false), "all-gather", 0, 1});  // never completes
  const absl::Time t0 = absl::Now();
  d.WaitAll(absl::Milliseconds(50));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
}

}  // namespace
}  // namespace shardopt
