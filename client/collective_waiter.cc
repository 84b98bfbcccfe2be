#include "client/collective_waiter.h"

#include <chrono>

#include "absl/strings/str_cat.h"

namespace shardopt {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

absl::Status CollectiveWaiter::Wait(const CommHandlePtr& handle, const char* what, int bucket) {
  const int64_t t0 = NowNs();
  absl::Status s = handle->Wait(timeout_);
  waited_ns_ += NowNs() - t0;
  if (s.ok()) return s;
  comm_->Abort(s);
  return absl::Status(s.code(), absl::StrCat("rank ", comm_->rank(), ": ", what,
                                             bucket >= 0 ? absl::StrCat(" of bucket ", bucket) : "",
                                             " failed: ", s.message()));
}

}  // namespace shardopt
