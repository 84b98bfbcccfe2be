// The rendezvous key-value store and its waiting KvGets, without the
// coordinator (server/kv_waits.h).
#include "server/kv_waits.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace shardopt {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1000);

// What a wait's callback received, in order.
struct Answers {
  std::vector<absl::StatusOr<std::string>> got;
  KvWaits::Callback Callback() {
    return [this](absl::StatusOr<std::string> r) { got.push_back(std::move(r)); };
  }
};

// Adds wait `id` for `key`, from kT0 for `wait`; expects it accepted.
void Add(KvWaits* kv, KvWaits::WaitId id, const std::string& key, absl::Duration wait,
         Answers* answers) {
  KvWaits::Callback done = answers->Callback();
  ASSERT_TRUE(kv->AddWait(id, key, kT0 + wait, kT0, &done).ok());
  EXPECT_FALSE(done) << "an accepted wait takes the callback";
}

std::vector<KvWaits::WaitId> Ids(const std::vector<KvWaits::Wait>& waits) {
  std::vector<KvWaits::WaitId> ids;
  for (const KvWaits::Wait& w : waits) ids.push_back(w.id);
  return ids;
}

TEST(KvWaitsTest, SetThenFind) {
  KvWaits kv(16);
  EXPECT_EQ(kv.Find("k"), nullptr);
  auto set = kv.Set("k", "value");
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_TRUE(set->empty());
  ASSERT_NE(kv.Find("k"), nullptr);
  EXPECT_EQ(*kv.Find("k"), "value");
  EXPECT_EQ(kv.Find("other"), nullptr);
  EXPECT_EQ(kv.bytes(), 1u + 5u);
  EXPECT_EQ(kv.size(), 0u);
}

TEST(KvWaitsTest, TheDefaultLimitIsTheProtocols) {
  KvWaits kv(16);
  EXPECT_EQ(kv.max_bytes(), kMaxStoreBytes);
  EXPECT_EQ(kv.max_waiters(), 16);
}

TEST(KvWaitsTest, AnOverwriteCountsOnlyTheNewValue) {
  KvWaits kv(16, /*max_bytes=*/10);
  ASSERT_TRUE(kv.Set("k", "12345").ok());
  EXPECT_EQ(kv.bytes(), 6u);
  ASSERT_TRUE(kv.Set("k", "12").ok());
  EXPECT_EQ(kv.bytes(), 3u);
  EXPECT_EQ(*kv.Find("k"), "12");
  // Replacing the value by one that fills the store exactly: fits, as the
  // old value no longer counts.
  ASSERT_TRUE(kv.Set("k", "123456789").ok());
  EXPECT_EQ(kv.bytes(), 10u);
}

TEST(KvWaitsTest, TheStoreIsBounded) {
  KvWaits kv(16, /*max_bytes=*/10);
  ASSERT_TRUE(kv.Set("a", "1234").ok());  // 5 bytes
  ASSERT_TRUE(kv.Set("b", "123").ok());   // 4 more: 9
  auto full = kv.Set("c", "1");           // 2 more: 11 > 10
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(full.status().message(), "rendezvous store is full");
  // Nothing changed.
  EXPECT_EQ(kv.Find("c"), nullptr);
  EXPECT_EQ(kv.bytes(), 9u);
  // An overwrite that grows past the limit is refused and keeps the old value.
  auto grown = kv.Set("a", "123456");  // 7 instead of 5: 11
  EXPECT_EQ(grown.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(*kv.Find("a"), "1234");
  EXPECT_EQ(kv.bytes(), 9u);
  // One that fits exactly is not.
  ASSERT_TRUE(kv.Set("a", "12345").status().ok());
  EXPECT_EQ(kv.bytes(), 10u);
}

TEST(KvWaitsTest, ASetSettlesTheWaitForItsKey) {
  KvWaits kv(16);
  Answers a, other;
  Add(&kv, 7, "k", absl::Seconds(30), &a);
  Add(&kv, 8, "other", absl::Seconds(30), &other);
  EXPECT_EQ(kv.size(), 2u);
  auto set = kv.Set("k", "v");
  ASSERT_TRUE(set.ok()) << set.status();
  ASSERT_EQ(set->size(), 1u);
  KvWaits::Wait& w = (*set)[0];
  EXPECT_EQ(w.id, 7u);
  EXPECT_EQ(w.key, "k");
  EXPECT_EQ(w.deadline, kT0 + absl::Seconds(30));
  EXPECT_EQ(w.wait, absl::Seconds(30));
  // Set runs no callback: the caller does, after unlocking.
  EXPECT_TRUE(a.got.empty());
  w.done("v");
  ASSERT_EQ(a.got.size(), 1u);
  EXPECT_EQ(*a.got[0], "v");
  EXPECT_EQ(kv.size(), 1u);
  EXPECT_TRUE(other.got.empty());
  // Settled: a later Set of the key finds no wait.
  auto again = kv.Set("k", "v2");
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->empty());
}

TEST(KvWaitsTest, EveryWaitOnAKeyIsSettledOldestFirst) {
  KvWaits kv(16);
  Answers a;
  // Ids out of order: the order is that of AddWait, not of the ids.
  Add(&kv, 5, "k", absl::Seconds(30), &a);
  Add(&kv, 2, "k", absl::Seconds(10), &a);
  Add(&kv, 9, "j", absl::Seconds(30), &a);
  Add(&kv, 3, "k", absl::Seconds(20), &a);
  auto set = kv.Set("k", "v");
  ASSERT_TRUE(set.ok());
  EXPECT_EQ(Ids(*set), (std::vector<KvWaits::WaitId>{5, 2, 3}));
  EXPECT_EQ(kv.size(), 1u);
  ASSERT_TRUE(kv.Take(9).has_value());
  EXPECT_EQ(kv.size(), 0u);
}

TEST(KvWaitsTest, WaitsAreBounded) {
  KvWaits kv(2);
  Answers a;
  Add(&kv, 1, "a", absl::Seconds(30), &a);
  Add(&kv, 2, "b", absl::Seconds(30), &a);
  Answers over;
  KvWaits::Callback done = over.Callback();
  absl::Status s = kv.AddWait(3, "c", kT0 + absl::Seconds(30), kT0, &done);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), "2 KvGet calls are already waiting (the limit); try again later");
  // Refused: the callback stays the caller's, and nothing was added.
  ASSERT_TRUE(done);
  EXPECT_EQ(kv.size(), 2u);
  EXPECT_FALSE(kv.Take(3).has_value());
  // A settled wait frees its slot.
  ASSERT_TRUE(kv.Set("a", "1").ok());
  EXPECT_TRUE(kv.AddWait(3, "c", kT0 + absl::Seconds(30), kT0, &done).ok());
  EXPECT_EQ(kv.size(), 2u);
}

TEST(KvWaitsTest, ADeadlineThatHasPassedIsRefused) {
  KvWaits kv(16);
  Answers a;
  KvWaits::Callback done = a.Callback();
  absl::Status s = kv.AddWait(1, "k", kT0, kT0, &done);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(s.message(), "key 'k' not set within 0");
  ASSERT_TRUE(done);
  EXPECT_EQ(kv.size(), 0u);
  // Checked before the limit.
  KvWaits none(0);
  EXPECT_EQ(none.AddWait(1, "k", kT0 - absl::Seconds(1), kT0, &done).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(none.AddWait(1, "k", kT0 + absl::Seconds(1), kT0, &done).code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(KvWaitsTest, TakeRemovesAWaitFromBothIndexes) {
  KvWaits kv(16);
  Answers a;
  Add(&kv, 1, "k", absl::Seconds(30), &a);
  Add(&kv, 2, "k", absl::Seconds(30), &a);
  std::optional<KvWaits::Wait> w = kv.Take(1);
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->id, 1u);
  EXPECT_EQ(w->key, "k");
  EXPECT_TRUE(w->done);
  EXPECT_EQ(kv.size(), 1u);
  EXPECT_FALSE(kv.Take(1).has_value());   // by id: gone
  EXPECT_FALSE(kv.Take(42).has_value());  // never there
  // By key: gone too, so a Set settles only the other one.
  auto set = kv.Set("k", "v");
  ASSERT_TRUE(set.ok());
  EXPECT_EQ(Ids(*set), (std::vector<KvWaits::WaitId>{2}));
  EXPECT_EQ(kv.size(), 0u);
  EXPECT_TRUE(a.got.empty());  // Take runs no callback either
}

TEST(KvWaitsTest, TakeExpiredTakesThoseWhoseDeadlineHasCome) {
  KvWaits kv(16);
  Answers a;
  Add(&kv, 4, "late", absl::Seconds(30), &a);
  Add(&kv, 1, "k", absl::Seconds(20), &a);
  Add(&kv, 2, "k", absl::Seconds(10), &a);
  Add(&kv, 3, "j", absl::Milliseconds(1500), &a);
  EXPECT_TRUE(kv.TakeExpired(kT0 + absl::Seconds(1)).empty());
  // Deadline <= now, by id.
  std::vector<KvWaits::Wait> expired = kv.TakeExpired(kT0 + absl::Seconds(20));
  EXPECT_EQ(Ids(expired), (std::vector<KvWaits::WaitId>{1, 2, 3}));
  EXPECT_EQ(kv.size(), 1u);
  ASSERT_EQ(expired.size(), 3u);
  absl::Status timeout = expired[2].TimeoutError();
  EXPECT_EQ(timeout.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(timeout.message(), "key 'j' not set within 1.5s");
  EXPECT_EQ(expired[0].TimeoutError().message(), "key 'k' not set within 20s");
  EXPECT_TRUE(a.got.empty());
  // Gone from the key index as well.
  auto set = kv.Set("k", "v");
  ASSERT_TRUE(set.ok());
  EXPECT_TRUE(set->empty());
  EXPECT_EQ(Ids(kv.TakeExpired(absl::InfiniteFuture())), (std::vector<KvWaits::WaitId>{4}));
}

TEST(KvWaitsTest, TakeAllTakesEveryWaitById) {
  KvWaits kv(16);
  Answers a;
  Add(&kv, 3, "k", absl::Seconds(30), &a);
  Add(&kv, 1, "j", absl::Seconds(30), &a);
  Add(&kv, 2, "k", absl::Seconds(30), &a);
  std::vector<KvWaits::Wait> all = kv.TakeAll();
  EXPECT_EQ(Ids(all), (std::vector<KvWaits::WaitId>{1, 2, 3}));
  EXPECT_EQ(kv.size(), 0u);
  EXPECT_TRUE(kv.TakeAll().empty());
  // The caller settles them, with whatever it says.
  for (KvWaits::Wait& w : all) w.done(absl::UnavailableError("coordinator shutting down"));
  ASSERT_EQ(a.got.size(), 3u);
  for (const auto& r : a.got) EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  // The store is kept.
  ASSERT_TRUE(kv.Set("k", "v").ok());
  auto set = kv.Set("k", "w");
  ASSERT_TRUE(set.ok());
  EXPECT_TRUE(set->empty());
  EXPECT_EQ(*kv.Find("k"), "w");
}

}  // namespace
}  // namespace shardopt
