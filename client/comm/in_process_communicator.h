// Communicators for ranks that are threads of one process, for tests: the
// same semantics as GlooCommunicator, computed directly in shared memory, with
// injectable delays, failures and stalls.
#ifndef SHARDOPT_CLIENT_COMM_IN_PROCESS_COMMUNICATOR_H_
#define SHARDOPT_CLIENT_COMM_IN_PROCESS_COMMUNICATOR_H_

#include <atomic>
#include <map>
#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/comm/communicator.h"

namespace shardopt {

// Faults injected into one rank.
struct InProcessFaults {
  absl::Duration delay_per_op = absl::ZeroDuration();  // sleep before every collective
  int64_t fail_at_op = -1;   // this collective (0-based) fails at once with Unavailable
  int64_t stall_at_op = -1;  // this rank never arrives at this collective (alive but silent)
};

// The shared state of one in-process job. Thread-safe.
class InProcessWorld {
 public:
  // `timeout` bounds every wait for the other ranks.
  InProcessWorld(int world_size, absl::Duration timeout);
  ~InProcessWorld();

  int world_size() const { return world_size_; }
  // The communicator of `rank`. Each rank may be connected once.
  std::unique_ptr<Communicator> Connect(int rank, InProcessFaults faults = InProcessFaults());

 private:
  friend class InProcessCommunicator;
  struct Arrival {
    CollectiveKind kind;
    void* buffer;
    int64_t count;
    DType type;
    ReduceOp op;
    int root;
    std::vector<char*> chunks;  // reduce-scatter: each rank's chunk
  };
  struct Pending {
    std::vector<bool> arrived;
    std::vector<Arrival> calls;
    int count = 0;
    bool done = false;
    absl::Status status;
  };
  // Called by rank `rank` for its collective number `seq`. Blocks until all
  // ranks arrived and the result is computed, the timeout passes, or
  // `*interrupted` becomes true.
  absl::Status Arrive(int rank, int64_t seq, const Arrival& call,
                      const std::atomic<bool>* interrupted);
  absl::Status Compute(Pending& p);
  void Wake();

  const int world_size_;
  const absl::Duration timeout_;
  absl::Mutex mu_;
  std::map<int64_t, Pending> pending_ ABSL_GUARDED_BY(mu_);
  int generation_ ABSL_GUARDED_BY(mu_) = 0;  // bumped to re-check interrupts
};

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_COMM_IN_PROCESS_COMMUNICATOR_H_
