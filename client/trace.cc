#include "client/trace.h"

#include <chrono>

namespace shardopt {

const char* TraceEventName(TraceEvent::Kind kind) {
  switch (kind) {
    case TraceEvent::kGradReady: return "grad_ready";
    case TraceEvent::kReduceScatterStart: return "reduce_scatter_start";
    case TraceEvent::kReduceScatterDone: return "reduce_scatter_done";
    case TraceEvent::kUpdateDone: return "update_done";
    case TraceEvent::kAllGatherStart: return "all_gather_start";
    case TraceEvent::kAllGatherDone: return "all_gather_done";
    case TraceEvent::kStepBegin: return "step_begin";
    case TraceEvent::kStepEnd: return "step_end";
  }
  return "unknown";
}

void Tracer::Add(TraceEvent::Kind kind, int bucket, int param) {
  if (!enabled_) return;
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  absl::MutexLock lock(&mu_);
  events_.push_back(TraceEvent{kind, bucket, param, now});
}

std::vector<TraceEvent> Tracer::Take() {
  absl::MutexLock lock(&mu_);
  std::vector<TraceEvent> out;
  out.swap(events_);
  return out;
}

}  // namespace shardopt
