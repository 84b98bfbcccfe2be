// Communicator over libgloo's TCP transport (the library behind PyTorch's CPU
// process group), with its own pipelined ring reduce-scatter / all-gather over
// Gloo's point-to-point pairs (PyTorch 1.13's Gloo process group has no
// reduce-scatter; Gloo's ReduceScatterHalvingDoubling was 1.76x slower than
// its all-reduce on 176 MB in our probe).
#ifndef SHARDOPT_CLIENT_COMM_GLOO_COMMUNICATOR_H_
#define SHARDOPT_CLIENT_COMM_GLOO_COMMUNICATOR_H_

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/comm/communicator.h"
#include "client/comm/kv_store.h"

namespace gloo {
class Context;
namespace transport {
class UnboundBuffer;
}  // namespace transport
}  // namespace gloo

namespace shardopt {

struct GlooOptions {
  // Address this rank listens on (port chosen by the OS).
  std::string hostname = "127.0.0.1";
  // Bound on rendezvous and on every wait inside a collective.
  absl::Duration timeout = absl::Seconds(60);
  // Ring messages are cut into segments of this many bytes, so receiving the
  // next segment overlaps reducing the current one.
  int64_t segment_bytes = 4 << 20;
  // Keys in the store are prefixed with this (one communicator per prefix).
  std::string store_prefix = "gloo";
};

class GlooCommunicator : public QueuedCommunicator {
 public:
  // Connects to every other rank through `store` (must outlive the call).
  // Errors: bad rank/world size, rendezvous timeout, network failure.
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> Create(KeyValueStore* store, int rank,
                                                                  int world_size,
                                                                  const GlooOptions& options);
  ~GlooCommunicator() override;

 protected:
  absl::Status RunReduceScatter(const std::vector<char*>& chunks, int64_t count, DType type,
                                ReduceOp op) override;
  absl::Status RunAllGather(void* buffer, int64_t count, DType type) override;
  absl::Status RunAllReduce(void* buffer, int64_t count, DType type, ReduceOp op) override;
  absl::Status RunBroadcast(void* buffer, int64_t count, DType type, int root) override;
  absl::Status RunBarrier() override;
  void Interrupt() override;

 private:
  GlooCommunicator(int rank, int world_size, const GlooOptions& options,
                   std::shared_ptr<gloo::Context> context);

  // An unbound buffer registered for Interrupt(); unregistered on destruction.
  class Registered;
  std::unique_ptr<Registered> Register(void* ptr, size_t bytes);
  absl::Status WaitFailure(const char* what, absl::Duration waited, const char* error) const;
  absl::Status WaitRecv(Registered& buffer);
  absl::Status WaitSend(Registered& buffer);
  // Waits for the sends[i] sends posted on chunks[i], chunk after chunk; the
  // first error.
  absl::Status WaitSends(const std::vector<std::unique_ptr<Registered>>& chunks,
                         const std::vector<int64_t>& sends);
  absl::Status RingReduceScatter(const std::vector<char*>& chunks, int64_t chunk_bytes, DType type,
                                 ReduceOp op, CollectiveKind kind);
  absl::Status RingAllGather(char* buffer, int64_t chunk_bytes, CollectiveKind kind);
  uint64_t NextSlotBase();
  // The slot bases of an operation's `steps` ring steps, a NextSlotBase() each.
  std::vector<uint64_t> SlotBases(int steps);

  const GlooOptions options_;
  std::shared_ptr<gloo::Context> context_;
  uint64_t op_seq_ = 0;  // worker thread only

  absl::Mutex registry_mu_;
  std::set<gloo::transport::UnboundBuffer*> active_ ABSL_GUARDED_BY(registry_mu_);
  // Buffers with operations possibly still pending in Gloo after an abort or a
  // failure; kept alive until the context is gone.
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> graveyard_;
  std::vector<std::unique_ptr<std::vector<char>>> scratch_graveyard_;
};

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_COMM_GLOO_COMMUNICATOR_H_
