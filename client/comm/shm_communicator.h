// Communicator for ranks on one host, over POSIX shared memory.
//
// Why our own: Gloo (the library behind PyTorch's CPU process group) has no
// shared-memory transport, so ranks on one host talk over TCP loopback: every
// byte is copied into the kernel and out again, and the transport's own thread
// competes with the trainer's compute for the same cores. Here each rank owns
// one region (/dev/shm, mode 0600, unlinked as soon as its ring neighbours
// have mapped it) holding a ring channel of `slots` slots of `slot_bytes` from
// its left neighbour: a sender copies a segment into a free slot and the
// receiver reduces straight from it (reduce-scatter) or copies it into place
// (all-gather): one copy per byte instead of TCP's two plus the syscalls.
// bench_comm compares the two side by side.
//
// The algorithms are the same pipelined rings as GlooCommunicator (their byte
// counts are identical). Every slot carries a descriptor of the collective it
// belongs to, so ranks that issue different collectives get an error instead
// of each other's bytes. Waiting is a futex on a per-rank doorbell in shared
// memory (no spinning); while waiting, the neighbours' liveness is checked
// (pidfd: a rank that exits or is killed is noticed within ~50 ms), as is a
// neighbour that aborted its communicator (its reason is passed on). Every wait
// is bounded by `timeout` without progress (DeadlineExceeded, naming the rank
// waited for). Abort() wakes the worker at once.
#ifndef SHARDOPT_CLIENT_COMM_SHM_COMMUNICATOR_H_
#define SHARDOPT_CLIENT_COMM_SHM_COMMUNICATOR_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/comm/communicator.h"
#include "client/comm/kv_store.h"

namespace shardopt {

struct ShmOptions {
  // Bound on rendezvous, and on every wait inside a collective without
  // progress from the peer waited for.
  absl::Duration timeout = absl::Seconds(60);
  // Each rank's inbound channel: `slots` slots of `slot_bytes` (a multiple
  // of 64), i.e. 4 MiB of shared memory per rank by default.
  int64_t slot_bytes = 1 << 20;
  int slots = 4;
  // Keys in the store are prefixed with this (one communicator per prefix).
  std::string store_prefix = "shm";
};

// What identifies "the same host" for shared memory: host name, kernel boot
// id, the /dev/shm mount (containers on one kernel with separate /dev/shm
// mounts cannot share memory), the network namespace and the pid namespace
// (a neighbour's liveness is checked through its pid).
std::string ShmHostIdentity();

class ShmCommunicator : public QueuedCommunicator {
 public:
  // Creates this rank's region and maps its ring neighbours' through `store`
  // (must outlive the call). Errors: bad rank/world size/options, a rank on
  // another host (FailedPrecondition), rendezvous timeout, /dev/shm failures.
  static absl::StatusOr<std::unique_ptr<ShmCommunicator>> Create(KeyValueStore* store, int rank,
                                                                 int world_size,
                                                                 const ShmOptions& options);
  ~ShmCommunicator() override;

  struct Region;  // a mapped channel region (shm_communicator.cc)

 protected:
  absl::Status RunReduceScatter(const std::vector<char*>& chunks, int64_t count, DType type,
                                ReduceOp op) override;
  absl::Status RunAllGather(void* buffer, int64_t count, DType type) override;
  absl::Status RunAllReduce(void* buffer, int64_t count, DType type, ReduceOp op) override;
  absl::Status RunBroadcast(void* buffer, int64_t count, DType type, int root) override;
  absl::Status RunBarrier() override;
  void Interrupt() override;

 private:
  ShmCommunicator(int rank, int world_size, const ShmOptions& options);

  class Rendezvous;  // Create()'s side of the key-value store (shm_communicator.cc)
  // Maps the ring neighbours' regions and opens their pidfds. A failure has
  // gone through rv->Fail().
  absl::Status MapNeighbours(Rendezvous* rv);

  // One collective's messages on the ring: what this rank sends (some known
  // at the start, the rest forwarded as they arrive) and how each expected
  // incoming segment is consumed.
  struct Send {
    const char* data;
    int64_t bytes;
  };
  struct Recv {
    char* dst;
    int64_t bytes;
    bool reduce;   // reduce into dst (else copy)
    bool forward;  // then send dst onward to the right neighbour
  };
  struct OpDesc {
    uint64_t seq;      // the collective's number
    uint32_t sub;      // sub-operation within it
    uint32_t code;     // collective kind, phase and root
    uint32_t type_op;  // element type and reduce op
    uint64_t bytes;    // chunk size
  };
  OpDesc NextDesc(CollectiveKind kind, int phase, int root, DType type, ReduceOp op, int64_t bytes);
  void BeginCollective() {
    ++op_seq_;
    sub_ = 0;
  }
  absl::Status Exchange(const OpDesc& desc, std::deque<Send> sends, int64_t num_recvs,
                        const std::function<Recv(int64_t)>& recv, DType type, ReduceOp op);
  // Exchange()'s steps. Publishes what of `sends` fits in the right
  // neighbour's free slots; returns whether anything was sent.
  bool PublishSends(const OpDesc& desc, std::deque<Send>* sends);
  // Consumes the left neighbour's published segments (from the *next-th
  // expected one on), queueing those to forward on `sends`; returns whether
  // anything was consumed. A collective mismatch has gone through Fail().
  absl::StatusOr<bool> ConsumeRecvs(const OpDesc& desc, int64_t num_recvs,
                                    const std::function<Recv(int64_t)>& recv, DType type,
                                    ReduceOp op, int64_t* next, std::deque<Send>* sends);
  // Why the neighbours still waited for (the left one for data, the right one
  // for free slots) cannot act, or OK; *origin as PeerFailure's.
  absl::Status NeighbourFailure(bool want_data, bool want_slots, std::string* origin) const;
  // Fail(status), passing `origin` (if any) on as the reason of this abort.
  absl::Status FailRelaying(absl::Status status, const std::string& origin)
      ABSL_LOCKS_EXCLUDED(close_mu_);
  absl::Status TimeoutError(const OpDesc& desc, bool want_data, bool want_slots) const;
  // Waits on this rank's doorbell, unless it rang since it read `bell`.
  void WaitForBell(uint32_t bell, absl::Duration limit);
  absl::Status RingReduceScatter(const std::vector<char*>& chunks, int64_t chunk_bytes, DType type,
                                 ReduceOp op, CollectiveKind kind);
  absl::Status RingAllGather(char* buffer, int64_t chunk_bytes, DType type, CollectiveKind kind);
  absl::Status Fail(absl::Status status);
  // Why a wait cannot succeed (a neighbour exited or aborted), or OK. For a
  // neighbour that aborted, *origin gets the reason it passed on.
  absl::Status PeerFailure(int peer, std::string* origin) const;
  std::string Describe(uint32_t code, uint32_t type_op, uint64_t bytes) const;

  const ShmOptions options_;
  int left_ = 0, right_ = 0;
  std::unique_ptr<Region> own_;           // inbound channel, and this rank's doorbell
  std::unique_ptr<Region> left_region_;   // for the left neighbour's doorbell
  std::unique_ptr<Region> right_region_;  // outbound channel (n == 2: same rank as left)
  int left_pidfd_ = -1, right_pidfd_ = -1;
  int left_pid_ = 0, right_pid_ = 0;
  // Worker thread only.
  uint64_t sent_ = 0;      // messages published to the right neighbour
  uint64_t consumed_ = 0;  // messages consumed from the left neighbour
  uint64_t op_seq_ = 0;
  uint32_t sub_ = 0;
  std::vector<std::unique_ptr<std::vector<char>>> scratch_;  // padded buffers of failed ops

  // Interrupt() (any thread) against the destructor; the reason this rank
  // passes on to its neighbours when it aborts because one of them did.
  absl::Mutex close_mu_;
  bool released_ ABSL_GUARDED_BY(close_mu_) = false;
  std::string relayed_ ABSL_GUARDED_BY(close_mu_);
};

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_COMM_SHM_COMMUNICATOR_H_
