// The one poll helper of the C++ tests: wait on a condition, not for a time.
// A test that needs something to happen in another thread or process polls
// for it with PollUntil and asserts on the result; a fixed sleep stays only
// where a test needs a delay on purpose (a slow peer, a window for a late
// write), with a comment saying why.
#ifndef SHARDOPT_TESTS_TESTING_POLL_H_
#define SHARDOPT_TESTS_TESTING_POLL_H_

#include <algorithm>

#include "absl/functional/function_ref.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace shardopt {

// Calls `cond` until it returns true, sleeping `interval` between calls, for
// at most `timeout`: true as soon as `cond` holds, false if it still does not
// at the deadline. `cond` is called at least once (at once, without a sleep)
// and once more at the deadline, so a timeout of zero is a single check.
inline bool PollUntil(absl::FunctionRef<bool()> cond, absl::Duration timeout,
                      absl::Duration interval = absl::Milliseconds(5)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (cond()) return true;
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    absl::SleepFor(std::min(interval, left));
  }
}

}  // namespace shardopt

#endif  // SHARDOPT_TESTS_TESTING_POLL_H_
