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

#include <array>
#include <deque>
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
#include "common/membership.h"
#include "common/param_spec.h"
#include "common/protocol_limits.h"
#include "server/kv_waits.h"
#include "server/slow_ranks.h"

namespace shardopt {

// Bounds on what a client may send: common/protocol_limits.h.
// The window of recent step times behind RankState::step_seconds_p50/max:
// the last kStepWindowSteps steps received within kStepWindowAge.
inline constexpr int kStepWindowSteps = 200;
inline constexpr absl::Duration kStepWindowAge = absl::Seconds(60);
// Upper bounds (seconds) of the per-rank step-time histogram; one more
// bucket for +Inf.
inline constexpr std::array<double, 16> kStepSecondsBounds = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120};

// Why a job failed, for metrics (shardopt_job_aborts_total{cause=...}).
enum class AbortCause {
  kNone,
  kHeartbeatTimeout,  // a rank went silent
  kRankAbort,         // a rank reported a failure (collective timeout, non-finite loss, ...)
  kRequest,           // someone else asked (shardctl abort, an Abort RPC without a rank)
  kRankExit,          // shardrun saw a rank exit with an error or die
  kInterrupted,       // shardrun was interrupted (SIGINT, SIGTERM)
};
const char* AbortCauseName(AbortCause cause);
// Every cause but kNone, in a fixed order.
const std::vector<AbortCause>& AllAbortCauses();

struct CoordinatorOptions {
  std::string job_id = "job";
  int world_size = 1;
  // A rank that sends no heartbeat for this long is dead; the job fails.
  absl::Duration heartbeat_timeout = absl::Seconds(10);
  // When set (> 0), a rank whose session ends (SessionLost) without its
  // Finish and with no heartbeat within this grace is dead at once: its
  // process exited or its node is gone. For the coordinator that rank 0
  // serves under srun, where no launcher watches the ranks' processes
  // (shardrun's supervisor names an exit with its signal itself).
  absl::Duration session_loss_grace = absl::ZeroDuration();
  // Injectable clock for tests (heartbeat ages, step windows, slow-rank
  // windows; waits use the real clock).
  std::function<absl::Time()> now = [] { return absl::Now(); };
  // Slow ranks (see CheckSlowRanks): a rank whose busy time per step (step
  // time minus time blocked on collectives) has a median over one window of
  // slow_window more than slow_factor times the median of the other ranks'
  // (and at least slow_min_excess more), slow_windows windows in a row, is
  // named slow; as many windows in a row under the factor, and it recovers.
  double slow_factor = 1.5;
  int slow_windows = 3;
  absl::Duration slow_window = absl::Seconds(5);
  absl::Duration slow_min_excess = absl::Milliseconds(5);
  // Receives one line when a rank becomes slow and when it recovers
  // ("rank 2 is slow: ..."), called without the coordinator's lock held.
  std::function<void(const std::string&)> on_event;
  // shardrun --max-restarts: how many times the job was started again before
  // this coordinator, and why the last time (shown by shardctl status and
  // /metrics).
  int restarts = 0;
  std::string last_restart;
  // At most this many KvGets wait at once (more: ResourceExhausted). Raised
  // to 2 * world_size when that is more (every rank may wait for a key).
  int max_kv_waiters = 4096;
  // Elastic jobs (RequestResize): the most ranks a launcher here grows the
  // job to by starting them itself (shardrun on one node, which watches
  // pending_resize(): its --max-nproc); 0: no launcher here starts ranks, and
  // a grow is refused unless its caller starts them (external: shardrun
  // --join). A grow whose new ranks are not all ready within resize_timeout
  // of its request is cancelled (the job trains on); a resize announced but
  // not complete by then fails the job.
  int max_grow_world = 0;
  absl::Duration resize_timeout = absl::Minutes(5);
};

// One membership change of an elastic job (MembershipChange in the protocol).
struct MembershipChange {
  int64_t epoch = 0;  // the epoch it began
  int from_world = 0;
  int to_world = 0;
  int64_t step = 0;         // the step boundary it took effect at
  std::vector<int> left;    // ranks of the old epoch that left
  bool lost = false;        // ... because their process was lost (recovered from replicas)
  std::vector<int> joined;  // ranks of the new epoch that were not in the old one
  absl::Duration took;      // from the request to the last join of the new epoch
  absl::Time completed = absl::InfinitePast();
};
// "epoch 1 at step 40: 2 -> 3 ranks (rank 2 joined) in 0.8s"
std::string DescribeMembershipChange(const MembershipChange& c);

// A resize requested and not yet complete.
struct PendingResize {
  int64_t request = 0;
  int64_t epoch = 0;  // the epoch it moves to
  int from_world = 0;
  int to_world = 0;
  std::vector<int> leave;  // old ranks that leave (sorted)
  absl::Time requested;
  // A grow's new ranks have all said they are ready (ResizeReadyKey in
  // common/membership.h): the
  // ranks are told of the resize only then, so that the job trains on
  // while the new processes start.
  bool ready = false;
  bool begun = false;  // a rank joined the new epoch
  // A grow whose new ranks another launcher starts (shardrun --join): the
  // job's own shardrun leaves it alone.
  bool external = false;
  // The rank in `leave` was lost (RecoverLoss): the others go on from their
  // in-memory replicas.
  bool recovery = false;
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
  int64_t epoch = 0;         // membership epoch (see RequestResize)
  bool elastic = false;      // its trainer can resize live
  int64_t step = 0;          // the step it starts from
  int64_t pid = 0;           // its process id (0: not reported)
};

struct JoinResult {
  uint64_t layout_hash = 0;
  std::vector<std::string> peers;  // shard-owner "host:port" per rank
};

// What a rank measured (RankMetrics in the protocol). Seconds and bytes;
// counters since the rank started.
struct RankMetricsInfo {
  // Wall time of each step finished since the previous heartbeat (at most
  // kMaxStepTimesPerHeartbeat, each finite and >= 0).
  std::vector<double> step_seconds;
  double grad_norm = 0;          // last step, before clipping (any value: nan is reported as such)
  double comm_wait_seconds = 0;  // last step: blocked on collectives (exposed communication)
  double update_seconds = 0;     // last step: the fused optimizer update
  int64_t bytes_sent_total = 0;
  int64_t master_bytes = 0;  // memory by role, as shardctl memory shows it
  int64_t state_bytes = 0;
  int64_t grad_bytes = 0;
  int64_t param_bytes = 0;
  int64_t rss_bytes = 0;
  int64_t stalls_total = 0;
  int64_t checkpoints_total = 0;  // committed checkpoints this rank took part in
  int64_t last_checkpoint_step = 0;
  double last_checkpoint_seconds = 0;
  int64_t last_checkpoint_bytes = 0;
};
// InvalidArgument naming the field unless every time is finite and >= 0,
// every counter and size >= 0, and there are at most
// kMaxStepTimesPerHeartbeat step times.
absl::Status ValidateRankMetrics(const RankMetricsInfo& m);

struct HeartbeatInfo {
  int rank = -1;
  int64_t step = 0;
  double loss = 0;
  double samples_per_s = 0;
  int64_t progress = 0;
  double learning_rate = 0;  // what the rank trains with now, 0 = not reported
  bool has_metrics = false;  // old clients send none
  RankMetricsInfo metrics;
  int64_t epoch = 0;  // heartbeats of another epoch than the current are ignored
};

struct HeartbeatReply {
  bool abort = false;
  std::string abort_reason;
  double learning_rate = 0;  // > 0 when set by SetLearningRate
  int64_t hyper_params_version = 0;
  int64_t checkpoint_request = 0;
  // The pending (or last) resize: its request number, target epoch and
  // world, the ranks leaving.
  int64_t resize_request = 0;
  int64_t resize_epoch = 0;
  int resize_world = 0;
  std::vector<int> resize_leave;
  bool resize_recovery = false;  // a lost rank's replacement by replicas (RecoverLoss)
};

enum class JobState { kStarting, kRunning, kFailed, kFinished };
const char* JobStateName(JobState state);

struct RankState {
  int rank = -1;
  bool joined = false;
  int64_t pid = 0;      // its process (JoinInfo::pid)
  std::string address;  // shard owner
  int64_t step = 0;
  double loss = 0;
  double samples_per_s = 0;
  int64_t progress = 0;
  double learning_rate = 0;  // as last reported (join or heartbeat), 0 = never
  absl::Time last_heartbeat;
  bool finished = false;
  // When its session ended without a Finish (InfiniteFuture: it has not);
  // a heartbeat after it clears it.
  absl::Time session_lost = absl::InfiniteFuture();
  // Observability: the last metrics reported (step_seconds left empty).
  bool has_metrics = false;
  RankMetricsInfo metrics;
  // Over the window of recent steps (kStepWindowSteps within kStepWindowAge);
  // 0 when the window is empty.
  double step_seconds_p50 = 0;
  double step_seconds_max = 0;
  // Every step time received: a histogram (cumulative counts are made by
  // the reader: step_bucket_counts[i] counts steps in (bound[i-1], bound[i]],
  // the last entry those above every bound).
  std::array<uint64_t, kStepSecondsBounds.size() + 1> step_bucket_counts{};
  uint64_t step_count = 0;
  double step_seconds_sum = 0;
  // Slow-rank detection: the median busy time per step (step minus time
  // blocked on collectives) over the last evaluated window, and that over
  // the median of the other ranks' (0: no data yet).
  double busy_seconds_p50 = 0;
  double busy_ratio = 0;
  bool slow = false;
  std::string slow_reason;  // why it is slow ("" when not)
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
  absl::Time start;  // when the coordinator started
  absl::Time end;    // when the job failed or finished (InfiniteFuture while it runs)
  // From start to end (or now, while the job has not ended).
  absl::Duration duration() const { return (end < now ? end : now) - start; }
  AbortCause failure_cause = AbortCause::kNone;
  std::vector<int> slow_ranks;
  int restarts = 0;          // CoordinatorOptions::restarts
  std::string last_restart;  // CoordinatorOptions::last_restart
  // The job's checkpoints, as rank 0 reports them (0 / InfinitePast: none).
  int64_t checkpoints_total = 0;
  int64_t last_checkpoint_step = 0;
  double last_checkpoint_seconds = 0;
  int64_t last_checkpoint_bytes = 0;
  absl::Time last_checkpoint_time = absl::InfinitePast();  // when the coordinator learned of it
  // Elastic jobs: the membership epoch, its changes, a pending resize.
  int64_t epoch = 0;
  std::vector<MembershipChange> membership;
  std::optional<PendingResize> resize;
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
  // Rank `rank`'s session stream ended (closed or broken). With
  // session_loss_grace set, CheckHeartbeats fails the job once the grace
  // has passed without a Finish or a heartbeat from it.
  void SessionLost(int rank);
  // Marks the job failed if a joined rank missed heartbeats; returns whether
  // it did. Called periodically by the service's watchdog.
  bool CheckHeartbeats();
  // Slow-rank detection, while the job runs: once per options().slow_window
  // (of the injectable clock) compares each rank's median busy time per step
  // over the window (from its heartbeats: the last step's time minus its
  // time blocked on collectives; ranks with no step in the window are left
  // out) with the median of the other ranks'. Names a rank slow after
  // slow_windows windows in a row over slow_factor (and slow_min_excess),
  // and not slow after as many windows in a row under it; each change goes
  // to options().on_event as one line. Returns how many ranks changed.
  // Called periodically by the service's watchdog.
  int CheckSlowRanks();

  JobStatus GetJob();
  // The plan (of rank 0's model). FailedPrecondition before rank 0 joined.
  absl::StatusOr<std::shared_ptr<const Layout>> GetLayout();
  std::vector<std::string> ShardOwnerAddresses();

  // Applied by every rank at its next step boundary. Returns the new version.
  // InvalidArgument unless ValidateLearningRateChange(lr) (common/hyper_params.h) is ok.
  absl::StatusOr<int64_t> SetLearningRate(double lr);
  // Asks every rank to checkpoint at the next step boundary they agree on.
  // Returns the request number.
  absl::StatusOr<int64_t> RequestCheckpoint();
  // Asks the job to change to `to_world` ranks at the next step boundary
  // its ranks agree on: a grow starts new ranks (options().max_grow_world); a
  // shrink lets the ranks `leave` go (empty: the highest), after they handed
  // their optimizer state over. The ranks then join epoch epoch()+1 at the
  // new size. Errors (FailedPrecondition): the job is not running, a resize
  // is pending, a rank's trainer cannot resize live, a grow without a
  // launcher or beyond its max_grow_world; (InvalidArgument) a bad size or
  // leave list. `external`: a grow whose new ranks the caller starts
  // (shardrun --join), allowed without max_grow_world.
  absl::StatusOr<PendingResize> RequestResize(int to_world, std::vector<int> leave,
                                              bool external = false);
  // The process `pid` of a rank of this job died (its shardrun saw it,
  // shardrun --replicate-shards): instead of failing the job, the other
  // ranks drop it and go on from their in-memory replicas (a resize without
  // it, announced at once, HeartbeatReply::resize_recovery). Refused
  // (FailedPrecondition) when the job does not run, is resizing, cannot
  // resize live, would have no rank left, or when some other rank has no
  // replica yet in this epoch (ReplicaReadyKey); NotFound for an unknown pid.
  absl::StatusOr<PendingResize> RecoverLoss(int64_t pid, const std::string& why);
  // Fails the job: every rank learns it at its next heartbeat. The cause (for
  // metrics) is kRankAbort when a rank (>= 0) asks, kRequest otherwise.
  void Abort(const std::string& reason, int rank);
  void Abort(const std::string& reason, int rank, AbortCause cause);
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
  struct JoinWait {
    int rank = -1;
    absl::Time deadline;
    std::unique_ptr<JoinInfo> info;  // until admitted (rank 0's plan known)
    JoinCallback done;
  };

  // Per rank, what GetJob does not copy: recent step times.
  struct RankWindow {
    std::deque<std::pair<absl::Time, double>> steps;  // (received, seconds)
    bool dirty = false;                               // p50/max to recompute
  };

  absl::Status ValidateJoin(const JoinInfo& info) const;
  void FailLocked(const std::string& reason, AbortCause cause, Completions* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops steps older than kStepWindowAge and recomputes the rank's p50/max
  // when its window changed.
  void RefreshStepWindowLocked(int rank, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Heartbeat()'s part for reported metrics `m` of rank `rank`, received at
  // `now`: the rank's last metrics, its step-time histogram and window, the
  // slow-rank detector's busy sample.
  void RecordMetricsLocked(int rank, const RankMetricsInfo& m, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Admits the joins that waited for rank 0's plan; answers them all once
  // every rank has joined.
  void AdvanceJoinsLocked(Completions* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AdmitLocked(const JoinInfo& info) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  JoinResult JoinResultLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status JoinTimeoutLocked(const JoinWait& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  JoinWait TakeJoinLocked(std::map<WaitId, JoinWait>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends every pending wait with `status`.
  void EndAllWaitsLocked(const absl::Status& status, Completions* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Join of the first rank of a pending resize's epoch: the membership
  // tables start over at the new size.
  void BeginEpochLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A pending grow whose new ranks are all ready becomes the notice; true
  // when it did now.
  bool AnnounceResizeIfReadyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ValidateMembershipLocked(const JoinInfo& info) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const CoordinatorOptions options_;
  const absl::Time start_;
  // The current epoch's world size (options_.world_size until a resize).
  int world_ ABSL_GUARDED_BY(mu_);
  int64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  // The last epoch a resize request was given: a cancelled grow's epoch is
  // not reused (its new ranks' ready keys stay in the store).
  int64_t last_requested_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  bool all_elastic_ ABSL_GUARDED_BY(mu_) = true;  // every joined rank of this epoch
  std::optional<PendingResize> resize_ ABSL_GUARDED_BY(mu_);
  int64_t resize_request_ ABSL_GUARDED_BY(mu_) = 0;
  PendingResize last_resize_ ABSL_GUARDED_BY(mu_);  // for the notice after it completed
  int64_t epoch_step_ ABSL_GUARDED_BY(mu_) = 0;     // the step the epoch began at
  std::vector<MembershipChange> membership_ ABSL_GUARDED_BY(mu_);
  absl::Mutex mu_;
  JobState state_ ABSL_GUARDED_BY(mu_) = JobState::kStarting;
  std::string failure_ ABSL_GUARDED_BY(mu_);
  AbortCause failure_cause_ ABSL_GUARDED_BY(mu_) = AbortCause::kNone;
  absl::Time end_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  std::vector<RankState> ranks_ ABSL_GUARDED_BY(mu_);
  std::vector<RankWindow> windows_ ABSL_GUARDED_BY(mu_);
  absl::Time slow_window_start_ ABSL_GUARDED_BY(mu_);  // set when the job starts running
  SlowRankDetector slow_ranks_ ABSL_GUARDED_BY(mu_);
  absl::Time last_checkpoint_time_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int joined_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<JoinInfo> rank0_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const Layout> layout_ ABSL_GUARDED_BY(mu_);
  // The rendezvous store and the KvGets waiting in it (ids from next_wait_id_).
  KvWaits kv_ ABSL_GUARDED_BY(mu_);
  double learning_rate_ ABSL_GUARDED_BY(mu_) = 0;  // requested
  int64_t hyper_version_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t checkpoint_request_ ABSL_GUARDED_BY(mu_) = 0;
  std::function<void()> listener_ ABSL_GUARDED_BY(mu_);
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  WaitId next_wait_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<WaitId, JoinWait> join_waits_ ABSL_GUARDED_BY(mu_);
  std::vector<WaitId> joining_ ABSL_GUARDED_BY(mu_);  // per rank: its pending Join, or 0
  void Notify();                                      // calls listener_ without holding mu_
  HeartbeatReply NoticeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_COORDINATOR_H_
