#include "client/deferred_collectives.h"

#include <utility>

namespace shardopt {

absl::Status DeferredCollectives::WaitDue(bool all, int64_t step,
                                          absl::FunctionRef<absl::Status(const Entry&)> wait) {
  std::vector<Entry> taken;
  taken.swap(entries_);
  absl::Status first;
  for (Entry& e : taken) {
    if (!first.ok()) break;
    const bool done = e.handle->done();  // read once: the watcher may complete it meanwhile
    if (all || done || e.step < step - 1) {
      first = wait(e);
    } else {
      entries_.push_back(std::move(e));
    }
  }
  return first;
}

bool DeferredCollectives::AnyFailed() const {
  for (const Entry& e : entries_) {
    if (e.handle->done() && !e.handle->Wait(absl::ZeroDuration()).ok()) return true;
  }
  return false;
}

void DeferredCollectives::WaitAll(absl::Duration timeout) const {
  for (const Entry& e : entries_) (void)e.handle->Wait(timeout);
}

}  // namespace shardopt
