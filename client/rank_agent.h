// RankAgent: everything one rank of a job does with the control plane, for
// any trainer (tools/cli/shardopt_train.cc, the C++ example, the Python API).
//
//   - serves its shard owner (server/shard_owner_service.h) and joins the job
//     with MakeJoinRequest(layout);
//   - keeps a session with the coordinator: a heartbeat every second (step,
//     loss, progress, learning rate, RankMetrics) and the coordinator's
//     notices pushed back (abort, learning-rate change, checkpoint request);
//     falls back to unary heartbeats when the session breaks;
//   - agrees on control actions at one step on all ranks: one 12-byte
//     all-reduce per step (AfterStep) makes every rank apply a learning-rate
//     change and take a requested checkpoint at the same step, and stop
//     together when any rank's loss is not finite;
//   - diagnoses a failed collective (Diagnose): the coordinator's verdict,
//     else ranks that stopped heartbeating, else ranks behind in progress;
//   - saves checkpoints with the analysis of what a failed save left on disk;
//   - on failure (Fail) tells the coordinator and reports its flight record
//     (or writes it as JSON when the coordinator cannot be reached).
//
// The caller owns no thread: per step it calls
//
//   agent->BeforeStep(step);                 // step: 1 for the first
//   ... forward, backward; auto r = opt->Step();
//   if (!r.ok()) return agent->Fail(agent->Diagnose(r.status()));
//   auto agreed = agent->AfterStep(step, *r, loss);
//   if (!agreed.ok()) return agent->Fail(agent->Diagnose(agreed.status()));
//   if (agreed->new_lr) ...;                 // already applied to the optimizer
//   if (agreed->checkpoint) agent->CheckpointDuringTraining(step);
//
// and agent->Finish() at the end. The agent's threads (session reader,
// heartbeats) only read the optimizer's memory report and write atomics;
// every collective is issued from the caller's thread.
#ifndef SHARDOPT_CLIENT_RANK_AGENT_H_
#define SHARDOPT_CLIENT_RANK_AGENT_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/comm/flight_recorder.h"
#include "client/coordinator_client.h"
#include "client/join_request.h"
#include "client/resize.h"
#include "client/sharded_optimizer.h"
#include "common/layout.h"
#include "proto/shardopt.pb.h"

namespace shardopt {

class RpcServer;
class ShardOwnerService;

struct RankAgentOptions {
  std::string job_id = "job";
  int rank = 0;  // must be the optimizer's communicator's rank
  // Where this rank's shard-owner service listens (port chosen by the OS),
  // as the coordinator and shardctl reach it.
  std::string host = "127.0.0.1";
  std::string device = "cpu";  // "cpu" or "cuda:N", as the job reports it
  // Bearer token the shard-owner service requires ("" = none).
  std::string token;
  // TLS for the shard-owner service (PEM files): certificate and key (both:
  // TLS), and a CA whose certificates clients must present (mutual TLS).
  // Empty: taken from SHARDOPT_OWNER_TLS_CERT / _KEY / _CLIENT_CA, which
  // shardrun --tls-cert/--tls-key/--tls-client-ca sets for its ranks.
  std::string owner_tls_cert_file;
  std::string owner_tls_key_file;
  std::string owner_tls_client_ca_file;
  // false: no shard-owner service (port 0 in the JoinRequest).
  bool serve_shard_owner = true;

  // Bound on the agent's collectives (the per-step agreement, the probe
  // after a failed checkpoint), and on joining (at least 2 minutes: ranks
  // start at different speeds).
  absl::Duration collective_timeout = absl::Seconds(120);
  absl::Duration min_join_timeout = absl::Seconds(120);

  // Checkpoints: requested ones are skipped when ckpt_dir is empty. Rank 0
  // keeps the newest ckpt_keep (0: all).
  std::string ckpt_dir;
  int ckpt_keep = 0;
  // Samples of one step over all ranks: a checkpoint's data_position
  // (step * samples_per_step); 0: not recorded.
  int64_t samples_per_step = 0;

  // Polled by the heartbeat thread (every 100 ms): non-zero (a signal
  // number) aborts the job from this rank. Null: never.
  std::function<int()> stop_signal;

  // Output. `print`: lines of the job's log (the agent decides which rank
  // prints what; rank 0 for most); null: stdout. `print_error`: this rank's
  // failure and warnings; null: stderr, as "<log_name>[rank R]: <line>".
  std::string log_name = "shardopt";
  std::function<void(const std::string&)> print;
  std::function<void(const std::string&)> print_error;
  // Where the flight record goes when the coordinator cannot take it: ""
  // means ckpt_dir, else $TMPDIR (or /tmp).
  std::string flight_record_dir;

  // The rank whose process serves the coordinator (0 under srun or an
  // Indexed Job; -1: another process, shardrun's). When the coordinator
  // cannot be reached, Diagnose names that rank as gone.
  int coordinator_rank = -1;
  std::string coordinator_address;  // host:port, for that message

  // Elastic jobs (docs/elastic.md). The membership epoch this agent's rank
  // is in (its Join and heartbeats carry it), whether the trainer makes the
  // live resizes AgreedStep::resize asks for (the coordinator refuses a
  // resize unless every rank's does), the step the rank starts from, and the
  // control requests already acted on before this epoch (ResizeContext).
  int64_t epoch = 0;
  bool elastic = false;
  int64_t start_step = 0;
  int64_t checkpoint_requests_done = 0;
  int64_t lr_versions_done = 0;
  int64_t resize_requests_done = 0;

  // Timing of heartbeats and of the diagnosis.
  absl::Duration heartbeat_interval = absl::Seconds(1);
  // Without a session and without an answered heartbeat for this long, the
  // coordinator is lost: the rank aborts.
  absl::Duration coordinator_lost_after = absl::Seconds(15);
  // Diagnose: how long to wait for the coordinator's verdict to be pushed,
  // when a rank counts as silent (seconds since its last heartbeat), how
  // long to wait for the coordinator to declare silent ranks dead, and the
  // polling interval of GetJob meanwhile.
  absl::Duration verdict_wait = absl::Seconds(3);
  double silent_after_seconds = 2.5;
  absl::Duration silent_wait = absl::Seconds(15);
  absl::Duration poll_interval = absl::Milliseconds(500);
};

// The JoinRequest of rank options.rank for `layout` (job, world size,
// address of its shard owner, parameters, plan options, layout hash):
// MakeJoinRequest(layout, JoinRequestInfo) (client/join_request.h) with the
// options' job, rank, host and device.
v1::JoinRequest MakeJoinRequest(const Layout& layout, const RankAgentOptions& options,
                                int shard_owner_port, double learning_rate);

// What every rank agreed on at the end of a step (AfterStep).
struct AgreedStep {
  // >= 0: the highest rank whose loss was not finite; every rank must stop.
  int nonfinite_rank = -1;
  // A requested checkpoint is due now (only when ckpt_dir is set).
  bool checkpoint = false;
  // The learning rate applied to the optimizer at this step, if it changed.
  std::optional<double> new_lr;
  // Time in the agreement (it is communication: a slower rank makes the
  // others wait here).
  double agree_seconds = 0;
  // A live resize is due after this step (only with options.elastic): the
  // trainer moves to the new epoch (client/resize.h).
  std::optional<ResizeOrder> resize;
};

// What a checkpoint save did. A failed save either leaves the ranks able to
// go on (an I/O error, agreed between the ranks) or not (`fatal`: a
// collective failed or timed out; the communicator is aborted). `committed`:
// rank 0 committed it (LATEST names it) although a later collective failed.
struct CheckpointOutcome {
  absl::Status status;
  bool fatal = false;
  bool committed = false;
};

class RankAgent {
 public:
  // Starts the shard-owner service, joins the job (waiting for every rank)
  // and starts the session and heartbeats. `client` and `optimizer` must
  // outlive the agent; its collectives go through optimizer->communicator()
  // (whose FlightRecorder, if it is a FlightRecordingCommunicator, is the
  // flight record reported on failure).
  static absl::StatusOr<std::unique_ptr<RankAgent>> Start(CoordinatorApi* client,
                                                          ShardedOptimizer* optimizer,
                                                          RankAgentOptions options);
  // Stop() (no Finish sent).
  ~RankAgent();
  RankAgent(const RankAgent&) = delete;
  RankAgent& operator=(const RankAgent&) = delete;

  // A checkpoint of step `step` the trainer saved itself at `dir` (Python's
  // save_checkpoint), taking `seconds`: counted and reported as the agent's
  // own (shardctl status, /metrics, shardrun --max-restarts' restart line).
  void RecordCheckpoint(int64_t step, const std::string& dir, double seconds);

  // Training resumes after step `step` (a restored checkpoint).
  void Resumed(int64_t step);
  // Step `step` (1 for the first) begins now: before its forward pass (its
  // wall time, heartbeats' step_seconds, is measured from here).
  void BeforeStep(int64_t step);
  // After opt->Step() of step `step` succeeded, with this rank's loss:
  // agrees on control actions with every rank (collective) and records the
  // step's metrics. Errors: the agreement failed (the communicator is
  // aborted; Diagnose it).
  absl::StatusOr<AgreedStep> AfterStep(int64_t step, const StepResult& result, double loss);
  // The same agreement split around opt->Step(), for optimizers whose
  // all-gathers overlap the next forward (overlap_param_gather): issued
  // after backward and before Step(), the agreement's all-reduce does not
  // queue behind the step's all-gathers. A learning-rate change then applies
  // to this step's update. FinishStep records the step (no collective).
  absl::StatusOr<AgreedStep> AgreeBeforeUpdate(int64_t step, double loss);
  void FinishStep(int64_t step, const StepResult& result, double loss);
  // Throughput the heartbeats report (samples/s of this rank).
  void SetSamplesPerSecond(double samples_per_s) { sps_now_ = samples_per_s; }

  // Why a collective failed, in one line, naming ranks where the control
  // plane can: the coordinator's verdict (pushed, or in its job status),
  // else ranks that stopped heartbeating, else (a timeout) ranks behind this
  // one in progress, else how the collective failed. `since`: when the
  // failed phase began. Bounded: verdict_wait + silent_wait, plus the
  // GetJob calls (5 s deadline each).
  std::string Diagnose(const absl::Status& status, absl::Time since);
  // ... since the last BeforeStep.
  std::string Diagnose(const absl::Status& status) { return Diagnose(status, step_start_); }

  // Collective: a sharded checkpoint of step `step` under ckpt_dir (rank 0
  // prints it and prunes). A step already saved is not saved twice.
  CheckpointOutcome Checkpoint(int64_t step);
  // Checkpoint() during training: an error is returned only when it is
  // fatal; otherwise it is printed "(training continues)" and OK returned.
  absl::Status CheckpointDuringTraining(int64_t step);

  // Ends this rank's part in failure: tells the coordinator (which stops the
  // other ranks at once) `coordinator_reason` (nullopt: `message`; "": tell
  // it nothing), prints `message` as this rank's error, reports the flight
  // record, stops. Returns 1 (an exit status).
  int Fail(const std::string& message,
           const std::optional<std::string>& coordinator_reason = std::nullopt);
  // Ends this rank's part in success: Finish to the coordinator, then
  // Stop(). Returns 0.
  int Finish();
  // Stops heartbeats, the session and the shard-owner service. Idempotent.
  void Stop();

  // The reason the job was aborted (pushed by the coordinator, a signal, the
  // coordinator lost); "" while it runs.
  std::string abort_reason() const;
  // Waits up to `timeout` for abort_reason() to be set; returns it.
  std::string WaitForAbort(absl::Duration timeout);
  // A rank of this epoch was lost and the job recovers from in-memory
  // replicas (HeartbeatResponse::resize_recovery; the communicator is
  // aborted when it arrives): the resize that drops it. Waits up to
  // `timeout` for one (a collective may fail before the notice arrives).
  std::optional<ResizeOrder> AwaitRecovery(absl::Duration timeout);

  int rank() const { return options_.rank; }
  int shard_owner_port() const { return shard_owner_port_; }
  const v1::JoinResponse& join_response() const { return joined_; }
  // The control requests acted on so far (a resize passes them on).
  ResizeContext Context(int64_t step) const {
    return ResizeContext{step, opt_->communicator()->world_size(), done_request_, applied_version_,
                         done_resize_};
  }
  // Collective phases entered (two per step), as heartbeats report them.
  int64_t progress() const { return progress_.load(); }
  // The last finished step.
  int64_t step() const { return step_now_.load(); }

 private:
  // What the heartbeats report besides progress (RankMetrics): the training
  // thread writes it, the heartbeat thread takes it.
  struct Metrics {
    std::vector<double> step_seconds;  // finished since the last heartbeat (the newest 256)
    double grad_norm = 0, comm_wait_seconds = 0, update_seconds = 0;
    int64_t checkpoints_total = 0, last_checkpoint_step = 0, last_checkpoint_bytes = 0;
    double last_checkpoint_seconds = 0;
  };
  // Control state from the coordinator's notices (newest seen).
  struct Wanted {
    int64_t lr_version = 0;
    double lr = 0;
    int64_t checkpoint_request = 0;
    ResizeOrder resize;  // the newest resize notice
  };

  RankAgent(CoordinatorApi* client, ShardedOptimizer* optimizer, RankAgentOptions options);
  absl::Status StartService();
  absl::Status Join();
  void StartThreads();

  // Threads.
  void SessionLoop();
  void HeartbeatLoop();
  v1::HeartbeatRequest MakeHeartbeat();
  void FillMetrics(v1::RankMetrics* m);
  std::string HandleNotice(const v1::HeartbeatResponse& notice);
  void SetAbort(const std::string& reason);
  int StopSignal() const { return options_.stop_signal ? options_.stop_signal() : 0; }

  // The agreement.
  absl::StatusOr<AgreedStep> Agree(int64_t step, bool nonfinite_loss);
  absl::Status AgreeOnLearningRate(int64_t step, int64_t version, const Wanted& wanted,
                                   AgreedStep* out);
  // All-reduce (max) of `count` floats of agree_buf_, bounded; on failure
  // the communicator is aborted and the collective waited for.
  absl::Status AllReduceMax(int count);
  void RecordStep(const StepResult& result, double agree_seconds);

  // Diagnosis.
  std::optional<std::string> FinishedRanks(const absl::Status& status);
  // The rank that served the coordinator (options_.coordinator_rank), when
  // the coordinator no longer answers.
  std::optional<std::string> CoordinatorHostGone(const absl::Status& status);
  std::optional<std::string> SilentRanks(const absl::Status& status);
  std::optional<std::string> StalledRanks(const absl::Status& status, absl::Time since);

  // Checkpoints and failure.
  CheckpointOutcome SaveFailed(int64_t step, const absl::Status& status, bool was_latest,
                               absl::Time t0);
  void ReportFlight();
  void WriteFlightRecord(const v1::FlightRecord& record, const absl::Status& not_sent);
  void Print(const std::string& line);
  void PrintError(const std::string& line);

  CoordinatorApi* const client_;
  ShardedOptimizer* const opt_;
  Communicator* const comm_;
  std::shared_ptr<FlightRecorder> recorder_;  // may be null
  const RankAgentOptions options_;

  std::unique_ptr<ShardOwnerService> service_;
  std::unique_ptr<RpcServer> server_;
  int shard_owner_port_ = 0;
  v1::JoinResponse joined_;

  std::atomic<int64_t> step_now_{0};
  std::atomic<int64_t> progress_{0};
  std::atomic<double> loss_now_{0};
  std::atomic<double> sps_now_{0};
  std::atomic<double> lr_applied_{0};

  mutable absl::Mutex mu_;
  Wanted wanted_ ABSL_GUARDED_BY(mu_);
  Metrics metrics_ ABSL_GUARDED_BY(mu_);
  std::string abort_reason_ ABSL_GUARDED_BY(mu_);
  // SetAbort in progress (the communicator is being aborted).
  bool aborting_ ABSL_GUARDED_BY(mu_) = false;
  ResizeOrder recovery_ ABSL_GUARDED_BY(mu_);  // epoch 0: none
  bool stop_ ABSL_GUARDED_BY(mu_) = false;

  // Training thread only.
  double last_agree_seconds_ = 0;
  int64_t applied_version_ = 0;
  int64_t done_request_ = 0;
  int64_t last_saved_ = -1;
  absl::Time step_start_ = absl::Now();
  std::string failure_;  // Fail()'s message: the flight record's reason
  bool stopped_ = false;
  // The agent's collective buffers: members, so that a collective that
  // outlives its wait writes into live memory.
  std::array<float, 4> agree_buf_{};
  int64_t done_resize_ = 0;

  std::unique_ptr<CoordinatorSession> session_;
  std::atomic<bool> session_ok_{true};
  std::thread session_reader_;
  std::thread heartbeat_;
};

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_RANK_AGENT_H_
