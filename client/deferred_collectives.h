// device_async_step: collectives the device was ordered after (the host did
// not wait for them), whose outcome the host checks later. Each entry says
// what it was and in which step it was taken; WaitDue() waits for those whose
// time has come, oldest first, and stops at the first failure.
#ifndef SHARDOPT_CLIENT_DEFERRED_COLLECTIVES_H_
#define SHARDOPT_CLIENT_DEFERRED_COLLECTIVES_H_

#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "client/comm/communicator.h"

namespace shardopt {

class DeferredCollectives {
 public:
  struct Entry {
    CommHandlePtr handle;
    const char* what;  // "all-gather", "reduce-scatter", "gradient norm"
    int bucket;        // -1: not a bucket's
    int64_t step;      // the step it was taken in
  };

  void Add(Entry entry) { entries_.push_back(std::move(entry)); }
  bool empty() const { return entries_.empty(); }
  size_t size() const { return entries_.size(); }

  // Calls wait(entry) for each entry that is due, in the order they were
  // added: every one when `all`, else those already done and those taken
  // before step - 1 (a step may leave the previous step's in flight, no
  // more). The others are kept. Stops at the first failure and returns it;
  // the entries after it are dropped (they can only fail with "communicator
  // aborted" too).
  absl::Status WaitDue(bool all, int64_t step, absl::FunctionRef<absl::Status(const Entry&)> wait);
  // Whether one that has completed failed (what it fed may be garbage; the
  // next WaitDue reports it).
  bool AnyFailed() const;
  // Waits up to `timeout` for each (their buffers are about to be freed).
  void WaitAll(absl::Duration timeout) const;

 private:
  std::vector<Entry> entries_;
};

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_DEFERRED_COLLECTIVES_H_
