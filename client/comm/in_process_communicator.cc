#include "client/comm/in_process_communicator.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/comm/reduce_ops.h"

namespace shardopt {

class InProcessCommunicator : public QueuedCommunicator {
 public:
  InProcessCommunicator(InProcessWorld* world, int rank, InProcessFaults faults)
      : QueuedCommunicator(rank, world->world_size()), world_(world), faults_(faults) {
    Start();
  }
  ~InProcessCommunicator() override {
    Abort(absl::CancelledError("communicator destroyed"));
    Stop();
  }

 protected:
  absl::Status RunReduceScatter(const std::vector<char*>& chunks, int64_t count, DType t,
                                ReduceOp op) override {
    return Run({CollectiveKind::kReduceScatter, chunks[0], count, t, op, 0, chunks});
  }
  absl::Status RunAllGather(void* b, int64_t count, DType t) override {
    return Run({CollectiveKind::kAllGather, b, count, t, ReduceOp::kSum, 0});
  }
  absl::Status RunAllReduce(void* b, int64_t count, DType t, ReduceOp op) override {
    return Run({CollectiveKind::kAllReduce, b, count, t, op, 0});
  }
  absl::Status RunBroadcast(void* b, int64_t count, DType t, int root) override {
    return Run({CollectiveKind::kBroadcast, b, count, t, ReduceOp::kSum, root});
  }
  absl::Status RunBarrier() override {
    return Run({CollectiveKind::kBarrier, nullptr, 0, DType::kByte, ReduceOp::kSum, 0});
  }
  void Interrupt() override {
    interrupted_ = true;
    world_->Wake();
  }

 private:
  absl::Status Run(const InProcessWorld::Arrival& call) {
    const int64_t seq = seq_++;
    if (faults_.delay_per_op > absl::ZeroDuration()) absl::SleepFor(faults_.delay_per_op);
    if (seq == faults_.fail_at_op) {
      return absl::UnavailableError(
          absl::StrCat("rank ", rank(), ": injected failure at op ", seq));
    }
    if (seq == faults_.stall_at_op) {
      // Alive but silent: never arrives; returns only when aborted.
      while (!interrupted_) absl::SleepFor(absl::Milliseconds(5));
      return abort_status();
    }
    absl::Status s = world_->Arrive(rank(), seq, call, &interrupted_);
    if (!s.ok() && aborted()) return abort_status();
    if (s.ok()) Count(call);
    return s;
  }

  void Count(const InProcessWorld::Arrival& c) {
    // What a ring implementation would move.
    const int n = world_size();
    const int64_t bytes = c.count * DTypeSize(c.type);
    switch (c.kind) {
      case CollectiveKind::kReduceScatter:
      case CollectiveKind::kAllGather:
        CountSent(c.kind, (n - 1) * bytes);
        CountReceived(c.kind, (n - 1) * bytes);
        break;
      case CollectiveKind::kAllReduce:
        CountSent(c.kind, 2 * (n - 1) * ((bytes + n - 1) / n));
        CountReceived(c.kind, 2 * (n - 1) * ((bytes + n - 1) / n));
        break;
      case CollectiveKind::kBroadcast:
        if ((rank() - c.root + n) % n < n - 1) CountSent(c.kind, bytes);
        if (rank() != c.root) CountReceived(c.kind, bytes);
        break;
      case CollectiveKind::kBarrier: break;
    }
  }

  InProcessWorld* world_;
  const InProcessFaults faults_;
  int64_t seq_ = 0;  // worker thread only
  std::atomic<bool> interrupted_{false};
};

InProcessWorld::InProcessWorld(int world_size, absl::Duration timeout)
    : world_size_(world_size), timeout_(timeout) {}

InProcessWorld::~InProcessWorld() = default;

std::unique_ptr<Communicator> InProcessWorld::Connect(int rank, InProcessFaults faults) {
  return std::make_unique<InProcessCommunicator>(this, rank, faults);
}

void InProcessWorld::Wake() {
  absl::MutexLock lock(&mu_);
  ++generation_;
}

absl::Status InProcessWorld::Arrive(int rank, int64_t seq, const Arrival& call,
                                    const std::atomic<bool>* interrupted) {
  absl::MutexLock lock(&mu_);
  Pending& p = pending_[seq];
  if (p.calls.empty()) {
    p.calls.resize(world_size_);
    p.arrived.assign(world_size_, false);
  }
  p.calls[rank] = call;
  p.arrived[rank] = true;
  ++p.count;
  if (p.count == world_size_) {
    p.status = Compute(p);
    p.done = true;
  }
  const int64_t key = seq;
  auto ready = [this, key, interrupted]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    (void)generation_;
    return pending_[key].done || interrupted->load();
  };
  const bool ok = mu_.AwaitWithTimeout(absl::Condition(&ready), timeout_);
  Pending& q = pending_[seq];
  if (!q.done) {
    std::string missing;
    for (int r = 0; r < world_size_; ++r) {
      if (!q.arrived[r]) absl::StrAppend(&missing, missing.empty() ? "" : ", ", r);
    }
    if (interrupted->load()) return absl::AbortedError("aborted");
    (void)ok;
    return absl::DeadlineExceededError(
        absl::StrCat("rank ", rank, ": collective #", seq, " timed out after ",
                     absl::FormatDuration(timeout_), " waiting for rank(s) ", missing));
  }
  absl::Status status = q.status;
  if (--q.count == 0) pending_.erase(seq);
  return status;
}

absl::Status InProcessWorld::Compute(Pending& p) {
  const Arrival& a = p.calls[0];
  for (int r = 1; r < world_size_; ++r) {
    const Arrival& b = p.calls[r];
    if (b.kind != a.kind || b.count != a.count || b.type != a.type || b.op != a.op ||
        b.root != a.root) {
      return absl::InvalidArgumentError(
          absl::StrCat("collective mismatch: rank 0 called ", CollectiveKindName(a.kind), "(",
                       a.count, " x ", DTypeName(a.type), ") but rank ", r, " called ",
                       CollectiveKindName(b.kind), "(", b.count, " x ", DTypeName(b.type), ")"));
    }
  }
  const int n = world_size_;
  const int elem = DTypeSize(a.type);
  const int64_t bytes = a.count * elem;
  switch (a.kind) {
    case CollectiveKind::kReduceScatter: {
      // Chunk by chunk: reduce every rank's copy of chunk c into a temporary,
      // then hand it to rank c.
      std::vector<char> acc(bytes);
      for (int c = 0; c < n; ++c) {
        if (bytes == 0) break;
        std::memcpy(acc.data(), p.calls[0].chunks[c], bytes);
        for (int r = 1; r < n; ++r)
          ReduceInto(acc.data(), p.calls[r].chunks[c], a.count, a.type, a.op);
        if (a.op == ReduceOp::kAverage) Scale(acc.data(), a.count, a.type, 1.0f / n);
        std::memcpy(p.calls[c].chunks[c], acc.data(), bytes);
      }
      break;
    }
    case CollectiveKind::kAllReduce: {
      // Reduce into a temporary, then hand out.
      std::vector<char> acc(static_cast<const char*>(p.calls[0].buffer),
                            static_cast<const char*>(p.calls[0].buffer) + bytes);
      for (int r = 1; r < n; ++r) ReduceInto(acc.data(), p.calls[r].buffer, a.count, a.type, a.op);
      if (a.op == ReduceOp::kAverage) Scale(acc.data(), a.count, a.type, 1.0f / n);
      for (int r = 0; r < n; ++r) std::memcpy(p.calls[r].buffer, acc.data(), bytes);
      break;
    }
    case CollectiveKind::kAllGather:
      for (int r = 0; r < n; ++r) {
        for (int src = 0; src < n; ++src) {
          if (src == r) continue;
          std::memcpy(static_cast<char*>(p.calls[r].buffer) + src * bytes,
                      static_cast<const char*>(p.calls[src].buffer) + src * bytes, bytes);
        }
      }
      break;
    case CollectiveKind::kBroadcast:
      for (int r = 0; r < n; ++r) {
        if (r != a.root) std::memcpy(p.calls[r].buffer, p.calls[a.root].buffer, bytes);
      }
      break;
    case CollectiveKind::kBarrier: break;
  }
  return absl::OkStatus();
}

}  // namespace shardopt
