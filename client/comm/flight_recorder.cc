#include "client/comm/flight_recorder.h"

#include <algorithm>

#include "absl/time/clock.h"

namespace shardopt {

const char* FlightStateName(FlightState state) {
  switch (state) {
    case FlightState::kRunning: return "running";
    case FlightState::kDone: return "done";
    case FlightState::kFailed: return "failed";
  }
  return "unknown";
}

FlightRecorder::FlightRecorder(int capacity)
    : capacity_(std::max(1, capacity)), ring_(static_cast<size_t>(capacity_)) {}

int64_t FlightRecorder::Begin(CollectiveKind op, int bucket, int64_t bytes) {
  const int64_t now = absl::GetCurrentTimeNanos();
  const int64_t step = step_.load(std::memory_order_relaxed);
  absl::MutexLock lock(&mu_);
  const int64_t seq = ++last_seq_;
  FlightEntry& e = ring_[static_cast<size_t>(seq % static_cast<int64_t>(ring_.size()))];
  e.seq = seq;
  e.op = op;
  e.bucket = bucket;
  e.bytes = bytes;
  e.start_unix_ns = now;
  e.end_unix_ns = 0;
  e.state = FlightState::kRunning;
  e.timed_out = false;
  e.step = step;
  return seq;
}

void FlightRecorder::End(int64_t seq, bool ok, bool timed_out) {
  const int64_t now = absl::GetCurrentTimeNanos();
  absl::MutexLock lock(&mu_);
  if (seq <= 0) return;
  FlightEntry& e = ring_[static_cast<size_t>(seq % static_cast<int64_t>(ring_.size()))];
  if (e.seq != seq) {  // overwritten by a newer collective
    if (timed_out) stalls_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  e.end_unix_ns = now;
  e.state = ok ? FlightState::kDone : FlightState::kFailed;
  if (timed_out && !e.timed_out) {
    e.timed_out = true;
    stalls_.fetch_add(1, std::memory_order_relaxed);
  }
}

void FlightRecorder::WaitTimedOut(int64_t seq) {
  absl::MutexLock lock(&mu_);
  if (seq <= 0) return;
  FlightEntry& e = ring_[static_cast<size_t>(seq % static_cast<int64_t>(ring_.size()))];
  if (e.seq == seq) {
    if (e.timed_out) return;  // counted already
    e.timed_out = true;
  }
  stalls_.fetch_add(1, std::memory_order_relaxed);
}

int64_t FlightRecorder::recorded() const {
  absl::MutexLock lock(&mu_);
  return last_seq_;
}

std::vector<FlightEntry> FlightRecorder::Snapshot() const {
  std::vector<FlightEntry> out;
  absl::MutexLock lock(&mu_);
  const int64_t cap = static_cast<int64_t>(ring_.size());
  const int64_t first = std::max<int64_t>(1, last_seq_ - cap + 1);
  out.reserve(static_cast<size_t>(last_seq_ - first + 1));
  for (int64_t s = first; s <= last_seq_; ++s) out.push_back(ring_[static_cast<size_t>(s % cap)]);
  return out;
}

FlightRecordingCommunicator::FlightRecordingCommunicator(std::unique_ptr<Communicator> inner,
                                                         std::shared_ptr<FlightRecorder> recorder)
    : owned_(std::move(inner)), inner_(owned_.get()), recorder_(std::move(recorder)) {}

FlightRecordingCommunicator::FlightRecordingCommunicator(Communicator* inner,
                                                         std::shared_ptr<FlightRecorder> recorder)
    : inner_(inner), recorder_(std::move(recorder)) {}

template <typename Issue>
CommHandlePtr FlightRecordingCommunicator::Record(CollectiveKind kind, int64_t bytes, Issue issue) {
  absl::MutexLock lock(&issue_mu_);
  const int64_t seq = recorder_->Begin(kind, CurrentCollectiveBucket(), bytes);
  CommHandlePtr handle = issue();
  handle->Observe(recorder_, seq);
  return handle;
}

CommHandlePtr FlightRecordingCommunicator::ReduceScatter(void* buffer, int64_t count, DType type,
                                                         ReduceOp op) {
  const int64_t bytes = count * DTypeSize(type) * inner_->world_size();
  return Record(CollectiveKind::kReduceScatter, bytes,
                [&] { return inner_->ReduceScatter(buffer, count, type, op); });
}

CommHandlePtr FlightRecordingCommunicator::ReduceScatterChunks(const std::vector<void*>& chunks,
                                                               int64_t count, DType type,
                                                               ReduceOp op) {
  const int64_t bytes = count * DTypeSize(type) * inner_->world_size();
  return Record(CollectiveKind::kReduceScatter, bytes,
                [&] { return inner_->ReduceScatterChunks(chunks, count, type, op); });
}

CommHandlePtr FlightRecordingCommunicator::AllGather(void* buffer, int64_t count, DType type) {
  const int64_t bytes = count * DTypeSize(type) * inner_->world_size();
  return Record(CollectiveKind::kAllGather, bytes,
                [&] { return inner_->AllGather(buffer, count, type); });
}

CommHandlePtr FlightRecordingCommunicator::AllReduce(void* buffer, int64_t count, DType type,
                                                     ReduceOp op) {
  return Record(CollectiveKind::kAllReduce, count * DTypeSize(type),
                [&] { return inner_->AllReduce(buffer, count, type, op); });
}

CommHandlePtr FlightRecordingCommunicator::Broadcast(void* buffer, int64_t count, DType type,
                                                     int root) {
  return Record(CollectiveKind::kBroadcast, count * DTypeSize(type),
                [&] { return inner_->Broadcast(buffer, count, type, root); });
}

CommHandlePtr FlightRecordingCommunicator::Barrier() {
  return Record(CollectiveKind::kBarrier, 0, [&] { return inner_->Barrier(); });
}

}  // namespace shardopt
