// Communicator over NCCL for ranks whose buffers live on a GPU (issue 7).
//
// Collectives run on a communication stream of their own, after the compute
// stream given in the options has reached the point where they were called
// (an event, so bucket reduce-scatters overlap backward). Handles complete
// when the collective's event fires; a watcher thread bounds every wait by the
// timeout and then calls ncclCommAbort, failing every pending and future call.
// The NCCL unique id travels through the job's key-value store.
//
// Buffers may also be in host memory (small control values: the model check,
// the gradient norm, checkpoint agreement): they are staged through device
// memory and pinned host memory, so callers need not know which backend runs.
//
// Tested on one H200 (world size 1) by tools/gpu_check.sh; see docs/gpu.md.
#ifndef SHARDOPT_CLIENT_COMM_NCCL_COMMUNICATOR_H_
#define SHARDOPT_CLIENT_COMM_NCCL_COMMUNICATOR_H_

#include <deque>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/comm/communicator.h"
#include "client/comm/kv_store.h"

namespace shardopt {

struct NcclOptions {
  int device = 0;                  // CUDA device of this rank
  void* compute_stream = nullptr;  // cudaStream_t the buffers are produced on (nullptr: default)
  absl::Duration timeout = absl::Seconds(300);
  std::string store_prefix = "nccl";
};

class NcclCommunicator : public Communicator {
 public:
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(KeyValueStore* store, int rank,
                                                                  int world_size,
                                                                  const NcclOptions& options);
  ~NcclCommunicator() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  CommHandlePtr ReduceScatter(void* buffer, int64_t count, DType type, ReduceOp op) override;
  CommHandlePtr AllGather(void* buffer, int64_t count, DType type) override;
  CommHandlePtr AllReduce(void* buffer, int64_t count, DType type, ReduceOp op) override;
  CommHandlePtr Broadcast(void* buffer, int64_t count, DType type, int root) override;
  CommHandlePtr Barrier() override;
  void Abort(const absl::Status& reason) override;
  ByteCounters counters() const override;
  // cudaStreamWaitEvent on the collective's completion event, while it is
  // still pending (the watcher destroys the event only after it fired, under
  // the same lock).
  bool OrderStreamAfter(const CommHandlePtr& handle, void* stream) override;

 private:
  struct State;
  NcclCommunicator(int rank, int world, const NcclOptions& options);
  // Orders after the compute stream, runs `enqueue` on the comm stream, and
  // returns a handle completed by the watcher.
  // `buffer`/`bytes`: the memory the collective reads and writes; host
  // memory is staged through the device. enqueue(device_buffer, stream).
  template <typename Enqueue>
  CommHandlePtr Submit(CollectiveKind kind, int64_t sent, void* buffer, size_t bytes,
                       Enqueue enqueue);
  static bool IsHostMemory(const void* p);
  void Watch();
  // Watch()'s check of a pending collective whose event has not fired: true,
  // with its error in *status, when NCCL reported an asynchronous error or
  // `deadline` passed.
  bool PendingFailed(absl::Time deadline, absl::Status* status);

  const int rank_;
  const int world_;
  const NcclOptions options_;
  std::unique_ptr<State> state_;
  std::thread watcher_;
};

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_COMM_NCCL_COMMUNICATOR_H_
