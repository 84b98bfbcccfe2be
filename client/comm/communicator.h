// Collective communication between the ranks of a job.
//
// Every collective is asynchronous: it is queued and executed in call order on
// the communicator's own worker thread (all ranks must issue the same
// collectives in the same order, as with NCCL and Gloo), and returns a handle
// to wait on with a timeout. Buffers must stay valid and untouched until the
// handle completes. Abort() makes every pending and future call fail promptly.
#ifndef SHARDOPT_CLIENT_COMM_COMMUNICATOR_H_
#define SHARDOPT_CLIENT_COMM_COMMUNICATOR_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/dtype.h"

namespace shardopt {

// kAverage is a sum followed by a division by the world size.
enum class ReduceOp { kSum, kAverage, kMax };

enum class CollectiveKind { kReduceScatter = 0, kAllGather, kAllReduce, kBroadcast, kBarrier };
inline constexpr int kNumCollectiveKinds = 5;
const char* CollectiveKindName(CollectiveKind kind);

// Bytes this rank sent and received, per collective kind.
struct ByteCounters {
  std::array<int64_t, kNumCollectiveKinds> sent{};
  std::array<int64_t, kNumCollectiveKinds> received{};
  int64_t total_sent() const;
  int64_t total_received() const;
};

// Told when an observed collective completes and when a wait on it times
// out (the flight recorder, client/comm/flight_recorder.h, is one). Called on the
// thread that completes the handle (a communicator's worker or watcher;
// before any waiter returns, with the handle's lock held) or that waits:
// must be quick, must not block and must not touch the handle.
class CommObserver {
 public:
  virtual ~CommObserver() = default;
  virtual void OnCollectiveDone(int64_t id, const absl::Status& status) = 0;
  virtual void OnWaitTimeout(int64_t id) = 0;
};

// Completion of one queued collective. Thread-safe.
class CommHandle {
 public:
  // Waits up to `timeout` for completion. Returns the collective's status, or
  // DeadlineExceeded if it is still running (it keeps running: abort the
  // communicator before freeing its buffers).
  absl::Status Wait(absl::Duration timeout);
  bool done() const;

  // For implementations.
  void Complete(absl::Status status);

  // Reports this collective's completion to `observer` as `id` (at once when
  // it has completed already), and every Wait that times out. One observer
  // per handle; a later call replaces it.
  void Observe(std::shared_ptr<CommObserver> observer, int64_t id);

 private:
  mutable absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<CommObserver> observer_ ABSL_GUARDED_BY(mu_);
  int64_t observer_id_ ABSL_GUARDED_BY(mu_) = 0;
};

// The bucket that the collectives this thread issues belong to, while a
// CollectiveBucketScope is alive (-1 otherwise). ShardedOptimizer tags its
// per-bucket reduce-scatters and all-gathers so; the flight recorder reads it.
int CurrentCollectiveBucket();
class CollectiveBucketScope {
 public:
  explicit CollectiveBucketScope(int bucket);
  ~CollectiveBucketScope();
  CollectiveBucketScope(const CollectiveBucketScope&) = delete;
  CollectiveBucketScope& operator=(const CollectiveBucketScope&) = delete;

 private:
  int saved_;
};
using CommHandlePtr = std::shared_ptr<CommHandle>;

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // `buffer` holds world_size * count elements. On completion, this rank's
  // chunk [rank * count, (rank + 1) * count) holds the reduction over ranks of
  // that chunk; the other chunks hold unspecified values.
  virtual CommHandlePtr ReduceScatter(void* buffer, int64_t count, DType type, ReduceOp op) = 0;
  // As ReduceScatter, with rank i's chunk of `count` elements at chunks[i]
  // (world_size pointers; the chunks need not be adjacent). On completion
  // chunks[rank] holds the reduction. ShardedOptimizer's gradient sharding
  // uses it to reduce a bucket's owned chunk in place in the owned gradients,
  // so it stages only the other ranks' chunks. Where SupportsSeparateChunks()
  // is false, non-adjacent chunks fail the handle (Unimplemented).
  virtual CommHandlePtr ReduceScatterChunks(const std::vector<void*>& chunks, int64_t count,
                                            DType type, ReduceOp op);
  virtual bool SupportsSeparateChunks() const { return false; }
  // In place: `buffer` holds world_size * count elements; this rank's chunk is
  // its contribution. On completion every chunk holds its owner's data.
  virtual CommHandlePtr AllGather(void* buffer, int64_t count, DType type) = 0;
  // `buffer` holds `count` elements, reduced in place on every rank.
  virtual CommHandlePtr AllReduce(void* buffer, int64_t count, DType type, ReduceOp op) = 0;
  // `count` elements from `root` to every rank, in place.
  virtual CommHandlePtr Broadcast(void* buffer, int64_t count, DType type, int root) = 0;
  virtual CommHandlePtr Barrier() = 0;

  // Fails every pending and future collective with `reason` (Aborted). Safe
  // from any thread, idempotent. The communicator cannot be used afterwards.
  virtual void Abort(const absl::Status& reason) = 0;
  virtual ByteCounters counters() const = 0;

  // For buffers in device memory: makes work enqueued on `stream` (a
  // cudaStream_t; nullptr: the legacy default stream, the one LibTorch and the
  // CUDA kernel backend use) after this call wait on the device until
  // `handle`'s collective has finished, without blocking the host. Returns
  // false when it cannot (every host-memory communicator; a collective that
  // already ended, failed, or was staged through host memory; an aborted
  // communicator): the caller must then Wait() on the host, which also reports
  // the collective's status. A true return says nothing about success: check
  // the handle later (it completes, with the status, as usual).
  virtual bool OrderStreamAfter(const CommHandlePtr& handle, void* stream) {
    (void)handle;
    (void)stream;
    return false;
  }
};

// Argument checks every implementation applies before it starts a collective
// (InvalidArgument, naming what is wrong): `reduces` for reduce-scatter and
// all-reduce; CheckRoot for broadcasts.
absl::Status CheckCollectiveArgs(const void* buffer, int64_t count, DType type, bool reduces);
// For ReduceScatterChunks: world_size non-null chunk pointers (when count > 0).
absl::Status CheckChunks(const std::vector<void*>& chunks, int world_size, int64_t count,
                         DType type);
// chunks[i] == chunks[0] + i * count elements for every i.
bool ChunksAdjacent(const std::vector<void*>& chunks, int64_t count, DType type);
absl::Status CheckRoot(int root, int world_size);

// Shared machinery for implementations: the queue, the worker thread, handles,
// abort, argument checks and byte counters. Subclasses implement Run*(), which
// execute one collective synchronously on the worker thread.
class QueuedCommunicator : public Communicator {
 public:
  QueuedCommunicator(int rank, int world_size);
  ~QueuedCommunicator() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  CommHandlePtr ReduceScatter(void* buffer, int64_t count, DType type, ReduceOp op) override;
  CommHandlePtr ReduceScatterChunks(const std::vector<void*>& chunks, int64_t count, DType type,
                                    ReduceOp op) override;
  bool SupportsSeparateChunks() const override { return true; }
  CommHandlePtr AllGather(void* buffer, int64_t count, DType type) override;
  CommHandlePtr AllReduce(void* buffer, int64_t count, DType type, ReduceOp op) override;
  CommHandlePtr Broadcast(void* buffer, int64_t count, DType type, int root) override;
  CommHandlePtr Barrier() override;
  void Abort(const absl::Status& reason) override;
  ByteCounters counters() const override;

 protected:
  // Subclass constructors call Start() once they are ready; destructors of
  // subclasses must call Stop() first (the worker calls their virtuals).
  void Start();
  void Stop();

  // chunks: world_size pointers to `count` elements each (ReduceScatter's
  // buffer gives adjacent ones).
  virtual absl::Status RunReduceScatter(const std::vector<char*>& chunks, int64_t count, DType type,
                                        ReduceOp op) = 0;
  virtual absl::Status RunAllGather(void* buffer, int64_t count, DType type) = 0;
  virtual absl::Status RunAllReduce(void* buffer, int64_t count, DType type, ReduceOp op) = 0;
  virtual absl::Status RunBroadcast(void* buffer, int64_t count, DType type, int root) = 0;
  virtual absl::Status RunBarrier() = 0;
  // Called (from any thread) by Abort(): wake up whatever Run*() is blocked on.
  virtual void Interrupt() = 0;

  // For Run*() implementations.
  void CountSent(CollectiveKind kind, int64_t bytes);
  void CountReceived(CollectiveKind kind, int64_t bytes);
  bool aborted() const { return aborted_.load(); }
  absl::Status abort_status() const;

 private:
  CommHandlePtr Enqueue(std::function<absl::Status()> run, absl::Status argument_error);
  void WorkerLoop();

  const int rank_;
  const int world_size_;
  std::atomic<bool> aborted_{false};
  std::array<std::atomic<int64_t>, kNumCollectiveKinds> sent_{};
  std::array<std::atomic<int64_t>, kNumCollectiveKinds> received_{};

  mutable absl::Mutex mu_;
  struct Op {
    std::function<absl::Status()> run;
    CommHandlePtr handle;
  };
  std::deque<Op> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status abort_status_ ABSL_GUARDED_BY(mu_);
  std::thread worker_;
};

// Waits for a collective on buffers the caller is about to free. On a
// timeout the collective may still be running, and a peer that arrives late
// may still read or write this rank's buffers (the in-process world keeps
// pointers to them even after an abort: AddressSanitizer showed it). So the
// communicator is aborted (every pending collective fails promptly) and
// `keepalive`, which owns the buffers, is deliberately leaked: a few bytes,
// once, on a path that ends the communicator anyway.
absl::Status WaitSafely(Communicator* comm, const CommHandlePtr& handle, absl::Duration timeout,
                        std::shared_ptr<void> keepalive);

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_COMM_COMMUNICATOR_H_
