// The coordinator's rendezvous key-value store and the KvGets waiting for a
// key, without the coordinator around it: the values with their byte
// accounting (at most `max_bytes` of keys and values), and the waits indexed
// by id and by key (at most `max_waiters` at once).
//
// Runs no callback: whatever settles waits (Set, Take, TakeExpired, TakeAll)
// moves them out for the caller to run once it has released its lock.
// Not thread-safe (the coordinator calls it under its lock).
#ifndef SHARDOPT_SERVER_KV_WAITS_H_
#define SHARDOPT_SERVER_KV_WAITS_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/protocol_limits.h"

namespace shardopt {

class KvWaits {
 public:
  using WaitId = uint64_t;
  using Callback = std::function<void(absl::StatusOr<std::string>)>;

  // A wait taken out of the store, for the caller to settle (call `done`).
  struct Wait {
    WaitId id = 0;
    std::string key;
    absl::Time deadline;
    absl::Duration wait;  // deadline minus when it began, for the timeout message
    Callback done;
    // DeadlineExceeded "key '<key>' not set within <wait>".
    absl::Status TimeoutError() const;
  };

  explicit KvWaits(int max_waiters, size_t max_bytes = kMaxStoreBytes)
      : max_waiters_(max_waiters), max_bytes_(max_bytes) {}

  // Sets (or overwrites) `key`. ResourceExhausted "rendezvous store is full"
  // (and nothing changes) when the store's keys and values would exceed
  // max_bytes; otherwise the waits for `key`, in the order they were added,
  // taken out: the caller runs their `done` with `value`. Keys and values
  // are not checked here (the coordinator bounds them).
  absl::StatusOr<std::vector<Wait>> Set(const std::string& key, const std::string& value);
  // The value of `key`, or null (valid until the next Set).
  const std::string* Find(const std::string& key) const;

  // Registers wait `id` (new; unique among the waits) for `key`, begun at
  // `now`, until `deadline`, taking `*done`. Errors, checked in this order
  // (`*done` is then left to the caller): DeadlineExceeded "key '<key>' not
  // set within 0" when deadline <= now, ResourceExhausted "<n> KvGet calls
  // are already waiting (the limit); try again later" when max_waiters wait.
  // Does not look at the store: the caller answers a key that is there.
  absl::Status AddWait(WaitId id, const std::string& key, absl::Time deadline, absl::Time now,
                       Callback* done);
  // Takes wait `id` out (its caller went away); nullopt when there is none.
  std::optional<Wait> Take(WaitId id);
  // Takes out the waits whose deadline is <= now, by id.
  std::vector<Wait> TakeExpired(absl::Time now);
  // Takes out every wait, by id.
  std::vector<Wait> TakeAll();

  // How many waits are pending.
  size_t size() const { return waits_.size(); }
  // Keys and values stored, in bytes.
  size_t bytes() const { return bytes_; }
  int max_waiters() const { return max_waiters_; }
  size_t max_bytes() const { return max_bytes_; }

 private:
  struct Pending {
    Wait wait;
    std::multimap<std::string, WaitId>::iterator index;  // into by_key_
  };
  Wait TakeAt(std::map<WaitId, Pending>::iterator it);

  const int max_waiters_;
  const size_t max_bytes_;
  std::map<std::string, std::string> values_;
  size_t bytes_ = 0;
  std::map<WaitId, Pending> waits_;
  // Equal keys keep their insertion order: Set answers the oldest wait first.
  std::multimap<std::string, WaitId> by_key_;
};

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_KV_WAITS_H_
