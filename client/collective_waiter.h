// How the optimizer's parts wait for a collective: bounded by the options'
// timeout, the time blocked counted (a step's exposed communication), and on
// failure the communicator aborted (so every later collective fails fast)
// and the error naming the rank, what failed and the bucket.
#ifndef SHARDOPT_CLIENT_COLLECTIVE_WAITER_H_
#define SHARDOPT_CLIENT_COLLECTIVE_WAITER_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "client/comm/communicator.h"

namespace shardopt {

// Steady-clock nanoseconds.
int64_t NowNs();

class CollectiveWaiter {
 public:
  CollectiveWaiter(Communicator* comm, absl::Duration timeout) : comm_(comm), timeout_(timeout) {}

  // "rank R: <what>[ of bucket B] failed: <cause>" on failure (bucket -1: none).
  absl::Status Wait(const CommHandlePtr& handle, const char* what, int bucket = -1);
  // Time blocked in Wait (and what callers Add) since the last Reset.
  int64_t waited_ns() const { return waited_ns_; }
  void Add(int64_t ns) { waited_ns_ += ns; }
  void Reset(int64_t ns = 0) { waited_ns_ = ns; }

  Communicator* comm() const { return comm_; }
  absl::Duration timeout() const { return timeout_; }

 private:
  Communicator* const comm_;
  const absl::Duration timeout_;
  int64_t waited_ns_ = 0;
};

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_COLLECTIVE_WAITER_H_
