// The job coordinator: membership, rendezvous key-value store, the plan and
// its check across ranks, heartbeats and failure detection, job state and
// step, hyper-parameter changes, abort. No gRPC here: server/
// coordinator_service.h adapts it. Thread-safe.
//
// Waiting (Join for the other ranks, KvGet for a key) costs no thread: the
// *Async calls register a callback that whatever settles the wait runs (a
// Join, a KvSet, a failure, Shutdown, ExpireWaits). The blocking Join/KvGet
// wrap them for callers that have a thread to spare.
#ifndef SHARDOPT_SERVER_COORDINATOR_H_
#define SHARDOPT_SERVER_COORDINATOR_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/layout.h"
#include "common/param_spec.h"

namespace shardopt {

// Bounds on what a client may send.
inline constexpr int kMaxParams = 1 << 20;
inline constexpr size_t kMaxKeyBytes = 512;
inline constexpr size_t kMaxValueBytes = 1 << 20;
inline constexpr size_t kMaxStoreBytes = 256 << 20;

// What the optimizer kernels can use as a learning rate: they compute in
// float, so the value as a float must be finite, > 0 and normal (1e39 becomes
// inf, 1e-46 becomes 0, 1e-40 a denormal). InvalidArgument saying why
// otherwise. Checked where a value enters (SetLearningRate) and by the ranks.
absl::Status ValidateLearningRate(double lr);

struct CoordinatorOptions {
  std::string job_id = "job";
  int world_size = 1;
  // A rank that sends no heartbeat for this long is dead; the job fails.
  absl::Duration heartbeat_timeout = absl::Seconds(10);
  // Injectable clock for tests (heartbeat ages only; waits use the real clock).
  std::function<absl::Time()> now = [] { return absl::Now(); };
  // At most this many KvGets wait at once (more: ResourceExhausted). Raised
  // to 2 * world_size when that is more (every rank may wait for a key).
  int max_kv_waiters = 4096;
};

struct JoinInfo {
  std::string job_id;
  int rank = -1;
  int world_size = 0;
  std::string host;
  int shard_owner_port = 0;
  std::string device = "cpu";
  std::vector<ParamSpec> params;
  PlanOptions plan;
  uint64_t layout_hash = 0;
  double learning_rate = 0;  // the rank's, 0 = not reported
};

struct JoinResult {
  uint64_t layout_hash = 0;
  std::vector<std::string> peers;  // shard-owner "host:port" per rank
};

struct HeartbeatInfo {
  int rank = -1;
  int64_t step = 0;
  double loss = 0;
  double samples_per_s = 0;
  int64_t progress = 0;
  double learning_rate = 0;  // what the rank trains with now, 0 = not reported
};

struct HeartbeatReply {
  bool abort = false;
  std::string abort_reason;
  double learning_rate = 0;   // > 0 when set by SetLearningRate
  int64_t hyper_params_version = 0;
  int64_t checkpoint_request = 0;
};

enum class JobState { kStarting, kRunning, kFailed, kFinished };
const char* JobStateName(JobState state);

struct RankState {
  int rank = -1;
  bool joined = false;
  std::string address;  // shard owner
  int64_t step = 0;
  double loss = 0;
  double samples_per_s = 0;
  int64_t progress = 0;
  double learning_rate = 0;  // as last reported (join or heartbeat), 0 = never
  absl::Time last_heartbeat;
  bool finished = false;
};

struct JobStatus {
  std::string job_id;
  JobState state = JobState::kStarting;
  int world_size = 0;
  int64_t step = 0;  // minimum over ranks
  std::vector<RankState> ranks;
  std::string failure;
  uint64_t layout_hash = 0;
  // What the ranks train with: reported by the lowest joined rank that
  // reports it; the last requested one when none does.
  double learning_rate = 0;
  double requested_learning_rate = 0;  // the last SetLearningRate, 0 = none
  absl::Time now;
};

class Coordinator {
 public:
  using WaitId = uint64_t;
  using JoinCallback = std::function<void(absl::StatusOr<JoinResult>)>;
  using KvCallback = std::function<void(absl::StatusOr<std::string>)>;

  explicit Coordinator(CoordinatorOptions options);
  // Shutdown(): pending waits end with Unavailable.
  ~Coordinator();

  // Registers a rank. Waits up to `wait` for rank 0 (whose model defines the
  // plan) and then for every rank. Errors: bad fields (InvalidArgument), a
  // model that differs from rank 0's (FailedPrecondition naming the first
  // differing parameter), a rank joining twice or while another Join for it
  // waits (AlreadyExists), a failed job (Aborted), timeout
  // (DeadlineExceeded), shutdown (Unavailable).
  absl::StatusOr<JoinResult> Join(const JoinInfo& info, absl::Duration wait);
  // Join without a waiting thread: `done` gets what Join would return. See
  // "Asynchronous waits" below.
  WaitId JoinAsync(JoinInfo info, absl::Time deadline, JoinCallback done);

  absl::Status KvSet(const std::string& key, const std::string& value);
  // Waits up to `wait` for the key. Errors: a bad key (InvalidArgument),
  // timeout (DeadlineExceeded), a failed job (Aborted), too many waiting
  // (ResourceExhausted), shutdown (Unavailable).
  absl::StatusOr<std::string> KvGet(const std::string& key, absl::Duration wait);
  WaitId KvGetAsync(const std::string& key, absl::Time deadline, KvCallback done);

  // Asynchronous waits: `done` runs exactly once, never with the
  // coordinator's lock held: before the *Async call returns when the answer
  // is known at once (it then returns 0), otherwise on the thread that
  // settles the wait: a Join, KvSet, Abort, a missed heartbeat, Shutdown, or
  // ExpireWaits once `deadline` has passed (someone must call it: the service's
  // watchdog does, every 20 ms).
  // Forgets a pending wait (its caller went away): true when `done` had not
  // run; it never will.
  bool CancelWait(WaitId id);
  // Ends the waits whose deadline is <= now with DeadlineExceeded. Returns
  // how many.
  int ExpireWaits(absl::Time now);
  // Ends every pending wait with Unavailable "coordinator shutting down" and
  // refuses new ones the same way; everything else keeps working. Idempotent.
  void Shutdown();
  int pending_waits();

  absl::StatusOr<HeartbeatReply> Heartbeat(const HeartbeatInfo& info);
  // Marks the job failed if a joined rank missed heartbeats; returns whether
  // it did. Called periodically by the service's watchdog.
  bool CheckHeartbeats();

  JobStatus GetJob();
  // The plan (of rank 0's model). FailedPrecondition before rank 0 joined.
  absl::StatusOr<std::shared_ptr<const Layout>> GetLayout();
  std::vector<std::string> ShardOwnerAddresses();

  // Applied by every rank at its next step boundary. Returns the new version.
  // InvalidArgument unless ValidateLearningRate(lr) is ok.
  absl::StatusOr<int64_t> SetLearningRate(double lr);
  // Asks every rank to checkpoint at the next step boundary they agree on.
  // Returns the request number.
  absl::StatusOr<int64_t> RequestCheckpoint();
  // Fails the job: every rank learns it at its next heartbeat.
  void Abort(const std::string& reason, int rank);
  absl::Status Finish(int rank);

  const CoordinatorOptions& options() const { return options_; }

  // What every rank should know now (abort, learning rate, checkpoint request).
  HeartbeatReply Notice();
  // Called (without the coordinator's lock held) whenever Notice() changes:
  // the job fails, the learning rate changes, a checkpoint is requested.
  void SetListener(std::function<void()> listener);

 private:
  // Callbacks to run once the lock is released.
  using Completions = std::vector<std::function<void()>>;
  struct KvWait {
    std::string key;
    absl::Time deadline;
    absl::Duration wait;  // for the timeout message
    KvCallback done;
    std::multimap<std::string, WaitId>::iterator index;
  };
  struct JoinWait {
    int rank = -1;
    absl::Time deadline;
    std::unique_ptr<JoinInfo> info;  // until admitted (rank 0's plan known)
    JoinCallback done;
  };

  absl::Status ValidateJoin(const JoinInfo& info) const;
  void FailLocked(const std::string& reason, Completions* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Admits the joins that waited for rank 0's plan; answers them all once
  // every rank has joined.
  void AdvanceJoinsLocked(Completions* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AdmitLocked(const JoinInfo& info) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  JoinResult JoinResultLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status JoinTimeoutLocked(const JoinWait& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  KvWait TakeKvLocked(std::map<WaitId, KvWait>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  JoinWait TakeJoinLocked(std::map<WaitId, JoinWait>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends every pending wait with `status`.
  void EndAllWaitsLocked(const absl::Status& status, Completions* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int MaxKvWaiters() const;

  const CoordinatorOptions options_;
  absl::Mutex mu_;
  JobState state_ ABSL_GUARDED_BY(mu_) = JobState::kStarting;
  std::string failure_ ABSL_GUARDED_BY(mu_);
  std::vector<RankState> ranks_ ABSL_GUARDED_BY(mu_);
  int joined_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<JoinInfo> rank0_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const Layout> layout_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> kv_ ABSL_GUARDED_BY(mu_);
  size_t kv_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  double learning_rate_ ABSL_GUARDED_BY(mu_) = 0;  // requested
  int64_t hyper_version_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t checkpoint_request_ ABSL_GUARDED_BY(mu_) = 0;
  std::function<void()> listener_ ABSL_GUARDED_BY(mu_);
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  WaitId next_wait_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<WaitId, KvWait> kv_waits_ ABSL_GUARDED_BY(mu_);
  std::multimap<std::string, WaitId> kv_waits_by_key_ ABSL_GUARDED_BY(mu_);
  std::map<WaitId, JoinWait> join_waits_ ABSL_GUARDED_BY(mu_);
  std::vector<WaitId> joining_ ABSL_GUARDED_BY(mu_);  // per rank: its pending Join, or 0
  void Notify();  // calls listener_ without holding mu_
  HeartbeatReply NoticeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_COORDINATOR_H_
