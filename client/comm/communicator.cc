#include "client/comm/communicator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace shardopt {

const char* CollectiveKindName(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kBarrier: return "barrier";
  }
  return "unknown";
}

int64_t ByteCounters::total_sent() const {
  int64_t t = 0;
  for (int64_t v : sent) t += v;
  return t;
}

int64_t ByteCounters::total_received() const {
  int64_t t = 0;
  for (int64_t v : received) t += v;
  return t;
}

absl::Status CommHandle::Wait(absl::Duration timeout) {
  std::shared_ptr<CommObserver> observer;
  int64_t id = 0;
  {
    absl::MutexLock lock(&mu_);
    if (mu_.AwaitWithTimeout(absl::Condition(&done_), timeout)) return status_;
    observer = observer_;
    id = observer_id_;
  }
  if (observer) observer->OnWaitTimeout(id);
  return absl::DeadlineExceededError(
      absl::StrCat("collective did not complete within ", absl::FormatDuration(timeout)));
}

bool CommHandle::done() const {
  absl::MutexLock lock(&mu_);
  return done_;
}

// The observer hears of the completion before any waiter wakes up (it is
// told under mu_; observers take no lock of a handle), so whoever returns
// from Wait sees the flight recorder's entry already final.
void CommHandle::Complete(absl::Status status) {
  std::shared_ptr<CommObserver> observer;
  {
    absl::MutexLock lock(&mu_);
    status_ = std::move(status);
    if (observer_) observer_->OnCollectiveDone(observer_id_, status_);
    observer = std::move(observer_);  // released outside the lock
    observer_ = nullptr;
    done_ = true;
  }
}

void CommHandle::Observe(std::shared_ptr<CommObserver> observer, int64_t id) {
  absl::MutexLock lock(&mu_);
  if (done_) {
    if (observer) observer->OnCollectiveDone(id, status_);
    return;
  }
  observer_ = std::move(observer);
  observer_id_ = id;
}

namespace {
thread_local int tls_collective_bucket = -1;
}  // namespace

int CurrentCollectiveBucket() { return tls_collective_bucket; }

CollectiveBucketScope::CollectiveBucketScope(int bucket) : saved_(tls_collective_bucket) {
  tls_collective_bucket = bucket;
}

CollectiveBucketScope::~CollectiveBucketScope() { tls_collective_bucket = saved_; }

QueuedCommunicator::QueuedCommunicator(int rank, int world_size)
    : rank_(rank), world_size_(world_size) {}

QueuedCommunicator::~QueuedCommunicator() { Stop(); }

void QueuedCommunicator::Start() {
  worker_ = std::thread([this] { WorkerLoop(); });
}

void QueuedCommunicator::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ && !worker_.joinable()) return;
    stopping_ = true;
  }
  if (worker_.joinable()) worker_.join();
  // Fail whatever is left (only possible if the worker never started).
  absl::MutexLock lock(&mu_);
  for (Op& op : queue_) op.handle->Complete(absl::CancelledError("communicator destroyed"));
  queue_.clear();
}

void QueuedCommunicator::WorkerLoop() {
  while (true) {
    Op op;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping and drained
      op = std::move(queue_.front());
      queue_.pop_front();
    }
    absl::Status status;
    if (aborted_.load()) {
      status = abort_status();
    } else {
      status = op.run();
    }
    op.handle->Complete(std::move(status));
  }
}

CommHandlePtr QueuedCommunicator::Enqueue(std::function<absl::Status()> run,
                                          absl::Status argument_error) {
  auto handle = std::make_shared<CommHandle>();
  if (!argument_error.ok()) {
    handle->Complete(std::move(argument_error));
    return handle;
  }
  if (aborted_.load()) {
    handle->Complete(abort_status());
    return handle;
  }
  absl::MutexLock lock(&mu_);
  if (stopping_) {
    handle->Complete(absl::CancelledError("communicator is shutting down"));
    return handle;
  }
  queue_.push_back(Op{std::move(run), handle});
  return handle;
}

absl::Status CheckCollectiveArgs(const void* buffer, int64_t count, DType type, bool reduces) {
  if (count < 0) return absl::InvalidArgumentError(absl::StrCat("negative count ", count));
  if (count > 0 && buffer == nullptr) return absl::InvalidArgumentError("null buffer");
  if (reduces && type != DType::kFloat32 && type != DType::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat(DTypeName(type), " buffers cannot be reduced (float32 and bfloat16 can)"));
  }
  return absl::OkStatus();
}

absl::Status CheckRoot(int root, int world_size) {
  if (root < 0 || root >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("broadcast root ", root, " out of range [0, ", world_size, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckChunks(const std::vector<void*>& chunks, int world_size, int64_t count,
                         DType type) {
  if (static_cast<int>(chunks.size()) != world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(chunks.size(), " chunk pointers for a world of ", world_size, " ranks"));
  }
  for (void* c : chunks) {
    absl::Status s = CheckCollectiveArgs(c, count, type, /*reduces=*/true);
    if (!s.ok()) return s;
  }
  // Overlapping chunks would be reduced into each other.
  std::vector<const char*> sorted(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) sorted[i] = static_cast<const char*>(chunks[i]);
  std::sort(sorted.begin(), sorted.end());
  const int64_t bytes = count * DTypeSize(type);
  for (size_t i = 1; i < sorted.size() && bytes > 0; ++i) {
    if (sorted[i] < sorted[i - 1] + bytes) {
      return absl::InvalidArgumentError("reduce-scatter chunks overlap");
    }
  }
  return absl::OkStatus();
}

bool ChunksAdjacent(const std::vector<void*>& chunks, int64_t count, DType type) {
  const int64_t bytes = count * DTypeSize(type);
  for (size_t i = 1; i < chunks.size(); ++i) {
    if (static_cast<char*>(chunks[i]) != static_cast<char*>(chunks[0]) + i * bytes) return false;
  }
  return true;
}

CommHandlePtr Communicator::ReduceScatterChunks(const std::vector<void*>& chunks, int64_t count,
                                                DType type, ReduceOp op) {
  absl::Status err = CheckChunks(chunks, world_size(), count, type);
  if (err.ok() && !ChunksAdjacent(chunks, count, type)) {
    err = absl::UnimplementedError("this communicator reduces adjacent chunks only");
  }
  if (err.ok()) return ReduceScatter(chunks.empty() ? nullptr : chunks[0], count, type, op);
  auto handle = std::make_shared<CommHandle>();
  handle->Complete(std::move(err));
  return handle;
}

CommHandlePtr QueuedCommunicator::ReduceScatter(void* buffer, int64_t count, DType type,
                                                ReduceOp op) {
  absl::Status err = CheckCollectiveArgs(buffer, count, type, /*reduces=*/true);
  std::vector<char*> chunks(world_size_);
  for (int i = 0; err.ok() && i < world_size_; ++i) {
    chunks[i] = static_cast<char*>(buffer) + i * count * DTypeSize(type);
  }
  return Enqueue([=] { return RunReduceScatter(chunks, count, type, op); }, err);
}

CommHandlePtr QueuedCommunicator::ReduceScatterChunks(const std::vector<void*>& chunks,
                                                      int64_t count, DType type, ReduceOp op) {
  absl::Status err = CheckChunks(chunks, world_size_, count, type);
  std::vector<char*> c(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) c[i] = static_cast<char*>(chunks[i]);
  return Enqueue([=] { return RunReduceScatter(c, count, type, op); }, err);
}

CommHandlePtr QueuedCommunicator::AllGather(void* buffer, int64_t count, DType type) {
  return Enqueue([=] { return RunAllGather(buffer, count, type); },
                 CheckCollectiveArgs(buffer, count, type, /*reduces=*/false));
}

CommHandlePtr QueuedCommunicator::AllReduce(void* buffer, int64_t count, DType type, ReduceOp op) {
  return Enqueue([=] { return RunAllReduce(buffer, count, type, op); },
                 CheckCollectiveArgs(buffer, count, type, /*reduces=*/true));
}

CommHandlePtr QueuedCommunicator::Broadcast(void* buffer, int64_t count, DType type, int root) {
  absl::Status err = CheckCollectiveArgs(buffer, count, type, /*reduces=*/false);
  if (err.ok()) err = CheckRoot(root, world_size_);
  return Enqueue([=] { return RunBroadcast(buffer, count, type, root); }, err);
}

CommHandlePtr QueuedCommunicator::Barrier() {
  return Enqueue([=] { return RunBarrier(); }, absl::OkStatus());
}

void QueuedCommunicator::Abort(const absl::Status& reason) {
  {
    absl::MutexLock lock(&mu_);
    if (aborted_.load()) return;
    abort_status_ = absl::AbortedError(
        absl::StrCat("communicator aborted: ", reason.ok() ? "by request" : reason.ToString()));
    aborted_.store(true);
  }
  Interrupt();
}

absl::Status QueuedCommunicator::abort_status() const {
  absl::MutexLock lock(&mu_);
  return abort_status_;
}

void QueuedCommunicator::CountSent(CollectiveKind kind, int64_t bytes) {
  sent_[static_cast<int>(kind)].fetch_add(bytes);
}

void QueuedCommunicator::CountReceived(CollectiveKind kind, int64_t bytes) {
  received_[static_cast<int>(kind)].fetch_add(bytes);
}

ByteCounters QueuedCommunicator::counters() const {
  ByteCounters c;
  for (int i = 0; i < kNumCollectiveKinds; ++i) {
    c.sent[i] = sent_[i].load();
    c.received[i] = received_[i].load();
  }
  return c;
}

absl::Status WaitSafely(Communicator* comm, const CommHandlePtr& handle, absl::Duration timeout,
                        std::shared_ptr<void> keepalive) {
  absl::Status s = handle->Wait(timeout);
  if (s.code() != absl::StatusCode::kDeadlineExceeded || handle->done()) return s;
  comm->Abort(s);
  new std::shared_ptr<void>(std::move(keepalive));  // never freed: see above
  return s;
}

}  // namespace shardopt
