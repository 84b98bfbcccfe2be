// What the optimizer did when: gradients arriving, collectives starting and
// ending, step boundaries. Recorded only when asked for
// (ShardedOptimizerOptions::trace); cheap, for tests and diagnosis.
#ifndef SHARDOPT_CLIENT_TRACE_H_
#define SHARDOPT_CLIENT_TRACE_H_

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace shardopt {

struct TraceEvent {
  enum Kind {
    kGradReady,           // a parameter's gradient was accumulated (param set)
    kReduceScatterStart,  // bucket set
    kReduceScatterDone,
    kUpdateDone,
    kAllGatherStart,
    kAllGatherDone,
    kStepBegin,
    kStepEnd,
  };
  Kind kind;
  int bucket = -1;
  int param = -1;
  int64_t time_ns = 0;  // steady clock
};
const char* TraceEventName(TraceEvent::Kind kind);

// Thread-safe: backward's hooks record from autograd's threads. Its lock is
// taken last (callers may hold the gradient reducer's).
class Tracer {
 public:
  explicit Tracer(bool enabled) : enabled_(enabled) {}
  // Nothing (and no lock) when disabled.
  void Add(TraceEvent::Kind kind, int bucket = -1, int param = -1);
  std::vector<TraceEvent> Take();

 private:
  const bool enabled_;
  absl::Mutex mu_;
  std::vector<TraceEvent> events_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_TRACE_H_
