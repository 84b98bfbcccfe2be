// The job coordinator: membership, rendezvous key-value store, the plan and
// its check across ranks, heartbeats and failure detection, job state and
// step, hyper-parameter changes, abort. No gRPC here: server/
// coordinator_service.h adapts it. Thread-safe.
#ifndef SHARDOPT_SERVER_COORDINATOR_H_
#define SHARDOPT_SERVER_COORDINATOR_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
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

struct CoordinatorOptions {
  std::string job_id = "job";
  int world_size = 1;
  // A rank that sends no heartbeat for this long is dead; the job fails.
  absl::Duration heartbeat_timeout = absl::Seconds(10);
  // Injectable clock for tests.
  std::function<absl::Time()> now = [] { return absl::Now(); };
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
  double learning_rate = 0;
  absl::Time now;
};

class Coordinator {
 public:
  explicit Coordinator(CoordinatorOptions options);

  // Registers a rank. Waits up to `wait` for rank 0 (whose model defines the
  // plan) and then for every rank. Errors: bad fields (InvalidArgument), a
  // model that differs from rank 0's (FailedPrecondition naming the first
  // differing parameter), a rank joining twice (AlreadyExists), a failed job
  // (Aborted), timeout (DeadlineExceeded).
  absl::StatusOr<JoinResult> Join(const JoinInfo& info, absl::Duration wait);

  absl::Status KvSet(const std::string& key, const std::string& value);
  // Waits up to `wait` for the key.
  absl::StatusOr<std::string> KvGet(const std::string& key, absl::Duration wait);

  absl::StatusOr<HeartbeatReply> Heartbeat(const HeartbeatInfo& info);
  // Marks the job failed if a joined rank missed heartbeats; returns whether
  // it did. Called periodically by the service's watchdog.
  bool CheckHeartbeats();

  JobStatus GetJob();
  // The plan (of rank 0's model). FailedPrecondition before rank 0 joined.
  absl::StatusOr<std::shared_ptr<const Layout>> GetLayout();
  std::vector<std::string> ShardOwnerAddresses();

  // Applied by every rank at its next step boundary. Returns the new version.
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
  absl::Status ValidateJoin(const JoinInfo& info) const;
  void FailLocked(const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

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
  double learning_rate_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t hyper_version_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t checkpoint_request_ ABSL_GUARDED_BY(mu_) = 0;
  std::function<void()> listener_ ABSL_GUARDED_BY(mu_);
  void Notify();  // calls listener_ without holding mu_
  HeartbeatReply NoticeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_COORDINATOR_H_
