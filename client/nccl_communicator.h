// Communicator over NCCL for ranks whose buffers live on a GPU (issue 7).
//
// Collectives run on a communication stream of their own, after the compute
// stream given in the options has reached the point where they were called
// (an event, so bucket reduce-scatters overlap backward). Handles complete
// when the collective's event fires; a watcher thread bounds every wait by the
// timeout and then calls ncclCommAbort, failing every pending and future call.
// The NCCL unique id travels through the job's key-value store.
//
// UNTESTED: no GPU was available when this was written; tools/gpu_check.sh and
// a CUDA LibTorch are needed to exercise it. It compiles in the normal build.
#ifndef SHARDOPT_CLIENT_NCCL_COMMUNICATOR_H_
#define SHARDOPT_CLIENT_NCCL_COMMUNICATOR_H_

#include <deque>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/communicator.h"
#include "client/kv_store.h"

namespace shardopt {

struct NcclOptions {
  int device = 0;                 // CUDA device of this rank
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
  CommHandlePtr ReduceScatter(void* buffer, int64_t count, ElementType type, ReduceOp op) override;
  CommHandlePtr AllGather(void* buffer, int64_t count, ElementType type) override;
  CommHandlePtr AllReduce(void* buffer, int64_t count, ElementType type, ReduceOp op) override;
  CommHandlePtr Broadcast(void* buffer, int64_t count, ElementType type, int root) override;
  CommHandlePtr Barrier() override;
  void Abort(const absl::Status& reason) override;
  ByteCounters counters() const override;

 private:
  struct State;
  NcclCommunicator(int rank, int world, const NcclOptions& options);
  // Orders after the compute stream, runs `enqueue` on the comm stream, and
  // returns a handle completed by the watcher.
  template <typename Enqueue>
  CommHandlePtr Submit(CollectiveKind kind, int64_t sent, Enqueue enqueue);
  void Watch();

  const int rank_;
  const int world_;
  const NcclOptions options_;
  std::unique_ptr<State> state_;
  std::thread watcher_;
};

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_NCCL_COMMUNICATOR_H_
