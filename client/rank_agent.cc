#include "client/rank_agent.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include <google/protobuf/util/json_util.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/checkpoint/checkpoint.h"
#include "common/file_system.h"
#include "common/hyper_params.h"
#include "common/protocol_limits.h"
#include "client/comm/flight_record_proto.h"
#include "server/rpc_server.h"
#include "server/shard_owner_service.h"

namespace shardopt {

namespace {

constexpr absl::Duration kSignalPoll = absl::Milliseconds(100);

std::string EnvStr(const char* name, const std::string& def) {
  const char* v = std::getenv(name);
  return v == nullptr ? def : std::string(v);
}

}  // namespace

v1::JoinRequest MakeJoinRequest(const Layout& layout, const RankAgentOptions& options,
                                int shard_owner_port, double learning_rate) {
  JoinRequestInfo info;
  info.job_id = options.job_id;
  info.rank = options.rank;
  info.host = options.host;
  info.shard_owner_port = shard_owner_port;
  info.device = options.device;
  info.learning_rate = learning_rate;
  return MakeJoinRequest(layout, info);
}

// ---------------------------------------------------------------- start, stop

RankAgent::RankAgent(CoordinatorApi* client, ShardedOptimizer* optimizer, RankAgentOptions options)
    : client_(client),
      opt_(optimizer),
      comm_(optimizer->communicator()),
      options_(std::move(options)) {
  done_request_ = options_.checkpoint_requests_done;
  applied_version_ = options_.lr_versions_done;
  done_resize_ = options_.resize_requests_done;
  step_now_ = options_.start_step;
  {
    absl::MutexLock l(&mu_);
    wanted_.checkpoint_request = done_request_;
    wanted_.lr_version = applied_version_;
    wanted_.resize.request = done_resize_;
    recovery_.request = done_resize_;
  }
  if (auto* fr = dynamic_cast<FlightRecordingCommunicator*>(comm_); fr != nullptr) {
    recorder_ = fr->recorder();
  }
  lr_applied_ = opt_->learning_rate();
  metrics_.step_seconds.reserve(kMaxStepTimesPerHeartbeat);
}

absl::StatusOr<std::unique_ptr<RankAgent>> RankAgent::Start(CoordinatorApi* client,
                                                            ShardedOptimizer* optimizer,
                                                            RankAgentOptions options) {
  if (client == nullptr || optimizer == nullptr) {
    return absl::InvalidArgumentError("RankAgent needs a coordinator client and an optimizer");
  }
  const Communicator* comm = optimizer->communicator();
  if (options.rank != comm->rank() || optimizer->layout().world_size() != comm->world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("RankAgent: rank ", options.rank, " given, but the communicator is rank ",
                     comm->rank(), " of ", comm->world_size(), " (the layout is for ",
                     optimizer->layout().world_size(), " ranks)"));
  }
  std::unique_ptr<RankAgent> agent(new RankAgent(client, optimizer, std::move(options)));
  if (absl::Status s = agent->StartService(); !s.ok()) return s;
  if (absl::Status s = agent->Join(); !s.ok()) return s;
  agent->StartThreads();
  return agent;
}

absl::Status RankAgent::StartService() {
  if (!options_.serve_shard_owner) return absl::OkStatus();
  ShardOwnerService::Sources sources;
  sources.rank = options_.rank;
  sources.owner = &opt_->shard_owner();
  ShardedOptimizer* opt = opt_;
  sources.memory = [opt] { return opt->memory(); };
  sources.step = [this] { return step_now_.load(); };
  const int rank = options_.rank;
  std::shared_ptr<FlightRecorder> recorder = recorder_;
  if (recorder != nullptr) {
    sources.flight = [rank, recorder] {
      return ToFlightRecord(rank, recorder->Snapshot(), absl::Now(), "");
    };
  }
  service_ = std::make_unique<ShardOwnerService>(std::move(sources), options_.token);
  RpcServerOptions sopt;
  sopt.address = options_.host + ":0";
  auto or_env = [](const std::string& v, const char* name) {
    const char* e = std::getenv(name);
    return !v.empty() || e == nullptr ? v : std::string(e);
  };
  sopt.tls_cert_file = or_env(options_.owner_tls_cert_file, "SHARDOPT_OWNER_TLS_CERT");
  sopt.tls_key_file = or_env(options_.owner_tls_key_file, "SHARDOPT_OWNER_TLS_KEY");
  sopt.tls_client_ca_file =
      or_env(options_.owner_tls_client_ca_file, "SHARDOPT_OWNER_TLS_CLIENT_CA");
  auto server = RpcServer::Start(sopt, {service_.get()});
  if (!server.ok()) return server.status();
  server_ = *std::move(server);
  shard_owner_port_ = server_->port();
  return absl::OkStatus();
}

absl::Status RankAgent::Join() {
  v1::JoinRequest join =
      MakeJoinRequest(opt_->layout(), options_, shard_owner_port_, opt_->learning_rate());
  join.set_epoch(options_.epoch);
  join.set_elastic(options_.elastic);
  join.set_pid(getpid());
  join.set_step(options_.start_step);
  auto joined =
      client_->Join(join, std::max(options_.min_join_timeout, options_.collective_timeout));
  if (!joined.ok()) return joined.status();
  joined_ = *std::move(joined);
  return absl::OkStatus();
}

void RankAgent::StartThreads() {
  session_ = client_->OpenSession();
  session_reader_ = std::thread([this] { SessionLoop(); });
  heartbeat_ = std::thread([this] { HeartbeatLoop(); });
}

RankAgent::~RankAgent() { Stop(); }

void RankAgent::Stop() {
  if (stopped_) return;
  stopped_ = true;
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  if (heartbeat_.joinable()) heartbeat_.join();
  if (session_ != nullptr) session_->Close();
  if (session_reader_.joinable()) session_reader_.join();
  if (server_ != nullptr) server_->Shutdown();
}

int RankAgent::Finish() {
  // The last step this rank took, so that a rank still waiting in a
  // collective is told where this one left (FinishedRanks).
  (void)client_->Heartbeat(MakeHeartbeat());
  (void)client_->Finish(options_.rank);
  Stop();
  return 0;
}

int RankAgent::Fail(const std::string& message,
                    const std::optional<std::string>& coordinator_reason) {
  const std::string& reason = coordinator_reason.has_value() ? *coordinator_reason : message;
  // The step this rank reached and its last checkpoint, for whoever reads
  // the job's end (shardrun --max-restarts says how many steps were lost).
  (void)client_->Heartbeat(MakeHeartbeat());
  if (!reason.empty()) (void)client_->Abort(reason, options_.rank);
  failure_ = message;
  PrintError(message);
  if (!stopped_) ReportFlight();
  Stop();
  return 1;
}

// ---------------------------------------------------------------- heartbeats

std::string RankAgent::abort_reason() const {
  absl::MutexLock l(&mu_);
  return abort_reason_;
}

std::optional<ResizeOrder> RankAgent::AwaitRecovery(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    {
      absl::MutexLock l(&mu_);
      if (recovery_.epoch > 0) return recovery_;
    }
    if (absl::Now() >= deadline) return std::nullopt;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

std::string RankAgent::WaitForAbort(absl::Duration timeout) {
  absl::MutexLock l(&mu_);
  mu_.AwaitWithTimeout(absl::Condition(
                           +[](std::string* reason) { return !reason->empty(); }, &abort_reason_),
                       std::max(timeout, absl::ZeroDuration()));
  return abort_reason_;
}

void RankAgent::SetAbort(const std::string& reason) {
  {
    absl::MutexLock l(&mu_);
    if (!abort_reason_.empty() || aborting_) return;
    aborting_ = true;
  }
  // The communicator first: whoever sees the reason may rely on collectives
  // failing from then on.
  comm_->Abort(absl::AbortedError(reason));
  {
    absl::MutexLock l(&mu_);
    abort_reason_ = reason;
  }
}

// One handler for the coordinator's notices, pushed on the session or
// returned by a unary heartbeat: "" or the reason the job was aborted.
std::string RankAgent::HandleNotice(const v1::HeartbeatResponse& r) {
  std::string lost;
  {
    absl::MutexLock l(&mu_);
    if (r.resize_recovery() && r.resize_request() > recovery_.request &&
        r.resize_leave_size() == 1) {
      recovery_.request = r.resize_request();
      recovery_.epoch = r.resize_epoch();
      recovery_.from_world = comm_->world_size();
      recovery_.to_world = r.resize_world();
      recovery_.leave.assign(r.resize_leave().begin(), r.resize_leave().end());
      lost = absl::StrCat("rank ", r.resize_leave(0), " was lost; the job goes on from the ",
                          "in-memory replicas");
    }
  }
  // Collectives with the lost rank would wait for it until their timeout.
  if (!lost.empty()) comm_->Abort(absl::AbortedError(lost));
  absl::MutexLock l(&mu_);
  if (r.hyper_params_version() > wanted_.lr_version && r.learning_rate() > 0) {
    wanted_.lr = r.learning_rate();
    wanted_.lr_version = r.hyper_params_version();
  }
  wanted_.checkpoint_request = std::max(wanted_.checkpoint_request, r.checkpoint_request());
  if (r.resize_request() > wanted_.resize.request) {
    ResizeOrder& o = wanted_.resize;
    o.request = r.resize_request();
    o.epoch = r.resize_epoch();
    o.to_world = r.resize_world();
    o.leave.assign(r.resize_leave().begin(), r.resize_leave().end());
  }
  return r.abort() ? "job aborted: " + r.abort_reason() : "";
}

void RankAgent::SessionLoop() {
  v1::HeartbeatResponse notice;
  while (session_->Receive(&notice)) {
    const std::string reason = HandleNotice(notice);
    if (!reason.empty()) SetAbort(reason);
  }
  session_ok_ = false;
}

void RankAgent::FillMetrics(v1::RankMetrics* m) {
  {
    absl::MutexLock l(&mu_);
    for (double v : metrics_.step_seconds) m->add_step_seconds(v);
    metrics_.step_seconds.clear();
    m->set_grad_norm(metrics_.grad_norm);
    m->set_comm_wait_seconds(metrics_.comm_wait_seconds);
    m->set_update_seconds(metrics_.update_seconds);
    m->set_checkpoints_total(metrics_.checkpoints_total);
    m->set_last_checkpoint_step(metrics_.last_checkpoint_step);
    m->set_last_checkpoint_seconds(metrics_.last_checkpoint_seconds);
    m->set_last_checkpoint_bytes(metrics_.last_checkpoint_bytes);
  }
  m->set_bytes_sent_total(comm_->counters().total_sent());
  const MemoryReport mem = opt_->memory();
  m->set_master_bytes(mem.master_bytes);
  m->set_state_bytes(mem.state_bytes);
  m->set_grad_bytes(mem.grad_bytes);
  m->set_param_bytes(mem.param_bytes);
  m->set_rss_bytes(ProcessRssBytes());
  m->set_stalls_total(recorder_ != nullptr ? recorder_->stalls() : 0);
}

v1::HeartbeatRequest RankAgent::MakeHeartbeat() {
  v1::HeartbeatRequest hb;
  hb.set_rank(options_.rank);
  hb.set_epoch(options_.epoch);
  hb.set_step(step_now_.load());
  hb.set_loss(loss_now_.load());
  hb.set_samples_per_s(sps_now_.load());
  hb.set_progress(progress_.load());
  hb.set_learning_rate(lr_applied_.load());
  FillMetrics(hb.mutable_metrics());
  return hb;
}

// Heartbeats: report progress, learn of aborts and learning-rate changes
// (from unary heartbeats' answers once the session is gone).
void RankAgent::HeartbeatLoop() {
  absl::Time last_ok = absl::Now();
  while (true) {
    {
      absl::MutexLock l(&mu_);
      if (stop_) return;
    }
    const v1::HeartbeatRequest hb = MakeHeartbeat();
    std::string reason;
    if (const int sig = StopSignal(); sig != 0) {
      reason = absl::StrCat(
          "stopped by signal ", sig,
          " (the launcher is stopping the job: shardrun, srun or scancel; or shardrun died)");
    } else if (session_ok_.load() && session_->Send(hb)) {
      last_ok = absl::Now();
    } else {
      // No session: plain heartbeats, until the coordinator is lost.
      auto r = client_->Heartbeat(hb);
      if (r.ok()) {
        last_ok = absl::Now();
        reason = HandleNotice(*r);
      } else if (absl::Now() - last_ok > options_.coordinator_lost_after) {
        reason = options_.coordinator_rank >= 0
                     ? absl::StrCat("lost the coordinator, which rank ", options_.coordinator_rank,
                                    "'s process served (it ended, or its node or the network "
                                    "went down): ",
                                    r.status().message())
                     : "lost the coordinator: " + std::string(r.status().message());
      }
    }
    if (!reason.empty()) {
      SetAbort(reason);
      return;
    }
    // The next heartbeat, unless stopped (checking for a signal meanwhile).
    const absl::Time until = absl::Now() + options_.heartbeat_interval;
    absl::MutexLock l(&mu_);
    while (!stop_ && absl::Now() < until && StopSignal() == 0) {
      mu_.AwaitWithTimeout(absl::Condition(&stop_), std::min(kSignalPoll, until - absl::Now()));
    }
  }
}

// ---------------------------------------------------------------- steps

void RankAgent::Resumed(int64_t step) { step_now_ = step; }

void RankAgent::BeforeStep(int64_t step) {
  step_start_ = absl::Now();
  if (recorder_ != nullptr) recorder_->set_step(step);  // the step the next collectives belong to
  ++progress_;
}

absl::StatusOr<AgreedStep> RankAgent::AfterStep(int64_t step, const StepResult& result,
                                                double loss) {
  ++progress_;
  const absl::Time agree_start = absl::Now();
  auto agreed = Agree(step, !std::isfinite(loss));
  if (!agreed.ok()) return agreed.status();
  agreed->agree_seconds = absl::ToDoubleSeconds(absl::Now() - agree_start);
  if (agreed->nonfinite_rank >= 0) return agreed;
  RecordStep(result, agreed->agree_seconds);
  step_now_ = step;
  loss_now_ = loss;
  return agreed;
}

absl::StatusOr<AgreedStep> RankAgent::AgreeBeforeUpdate(int64_t step, double loss) {
  ++progress_;
  const absl::Time agree_start = absl::Now();
  auto agreed = Agree(step, !std::isfinite(loss));
  if (!agreed.ok()) return agreed.status();
  agreed->agree_seconds = absl::ToDoubleSeconds(absl::Now() - agree_start);
  last_agree_seconds_ = agreed->agree_seconds;
  return agreed;
}

void RankAgent::FinishStep(int64_t step, const StepResult& result, double loss) {
  RecordStep(result, last_agree_seconds_);
  step_now_ = step;
  loss_now_ = loss;
}

void RankAgent::RecordStep(const StepResult& result, double agree_seconds) {
  absl::MutexLock l(&mu_);
  if (metrics_.step_seconds.size() == static_cast<size_t>(kMaxStepTimesPerHeartbeat))
    metrics_.step_seconds.erase(metrics_.step_seconds.begin());
  metrics_.step_seconds.push_back(absl::ToDoubleSeconds(absl::Now() - step_start_));
  // device_async_step on a GPU: the norm is read later (LastGradNorm()); the
  // metric keeps the last one known.
  if (!result.grad_norm_pending) metrics_.grad_norm = result.grad_norm;
  // The agreement is communication too: a rank slow after Step() makes the
  // others wait there, and that must not count as their busy time.
  metrics_.comm_wait_seconds = result.comm_wait_seconds + agree_seconds;
  metrics_.update_seconds = result.update_seconds;
}

absl::Status RankAgent::AllReduceMax(int count) {
  CommHandlePtr h = comm_->AllReduce(agree_buf_.data(), count, DType::kFloat32, ReduceOp::kMax);
  absl::Status s = h->Wait(options_.collective_timeout);
  if (!s.ok()) {
    // A timed-out collective still runs on agree_buf_: abort it, and let it
    // end before the buffer is reused.
    comm_->Abort(s);
    if (!h->done()) (void)h->Wait(absl::Seconds(10));
  }
  return s;
}

// Control actions (learning-rate changes, requested checkpoints) reach ranks
// at different heartbeats, and a loss is known only to its rank: one 12-byte
// all-reduce (max) makes every rank act on them at the same step, and stop
// together when any rank's loss is not finite.
absl::StatusOr<AgreedStep> RankAgent::Agree(int64_t step, bool nonfinite_loss) {
  AgreedStep a;
  lr_applied_ = opt_->learning_rate();  // (a resumed run restores its own)
  Wanted wanted;
  {
    absl::MutexLock l(&mu_);
    wanted = wanted_;
  }
  agree_buf_ = {static_cast<float>(wanted.lr_version),
                static_cast<float>(wanted.checkpoint_request),
                nonfinite_loss ? static_cast<float>(options_.rank + 1) : 0.0f,
                static_cast<float>(wanted.resize.request)};
  if (absl::Status s = AllReduceMax(4); !s.ok()) return s;
  const std::array<float, 4> ctl = agree_buf_;
  if (ctl[2] > 0) {
    a.nonfinite_rank = static_cast<int>(ctl[2]) - 1;
    return a;
  }
  if (static_cast<int64_t>(ctl[0]) > applied_version_) {
    if (absl::Status s = AgreeOnLearningRate(step, static_cast<int64_t>(ctl[0]), wanted, &a);
        !s.ok()) {
      return s;
    }
  }
  if (static_cast<int64_t>(ctl[1]) > done_request_) {
    done_request_ = static_cast<int64_t>(ctl[1]);
    if (options_.ckpt_dir.empty()) {
      if (options_.rank == 0) Print("checkpoint requested, but no --ckpt-dir was given: skipped");
    } else {
      a.checkpoint = true;
    }
  }
  if (static_cast<int64_t>(ctl[3]) > done_resize_) {
    const int64_t request = static_cast<int64_t>(ctl[3]);
    done_resize_ = request;
    if (wanted.resize.request < request) {
      // Another rank heard of it first: ask the coordinator (the notice
      // holds the newest resize).
      auto r = client_->Heartbeat(MakeHeartbeat());
      if (!r.ok()) return r.status();
      (void)HandleNotice(*r);
      absl::MutexLock l(&mu_);
      wanted.resize = wanted_.resize;
    }
    if (wanted.resize.request != request) {
      return absl::InternalError(absl::StrCat(
          "resize request ", request, " agreed, but the coordinator's is ", wanted.resize.request));
    }
    if (options_.elastic) {
      a.resize = wanted.resize;
      a.resize->from_world = comm_->world_size();
    }
  }
  return a;
}

// The learning rate of the newest version `version`, from a rank that has it.
absl::Status RankAgent::AgreeOnLearningRate(int64_t step, int64_t version, const Wanted& wanted,
                                            AgreedStep* out) {
  agree_buf_[0] = wanted.lr_version == version ? static_cast<float>(wanted.lr) : 0.0f;
  if (absl::Status s = AllReduceMax(1); !s.ok()) return s;
  const float lr_new = agree_buf_[0];
  applied_version_ = version;
  if (ValidateLearningRateChange(lr_new).ok()) {
    if (absl::Status s = opt_->SetLearningRate(lr_new); !s.ok()) return s;
    lr_applied_ = lr_new;
    out->new_lr = lr_new;
    if (options_.rank == 0) {
      Print(absl::StrFormat("learning rate set to %g at step %lld", lr_new,
                            static_cast<long long>(step)));
    }
  } else if (options_.rank == 0) {
    Print(absl::StrFormat("learning rate %g requested at step %lld: not a positive float, ignored",
                          wanted.lr, static_cast<long long>(step)));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------- diagnosis

// A peer's death usually shows up first as a broken connection (Gloo:
// UNAVAILABLE "... failed after 0.2s, before its timeout"), which names no
// rank; the control plane names it, so its diagnosis wins.
std::string RankAgent::Diagnose(const absl::Status& status, absl::Time since) {
  // A peer that left its training loop (called Finish) while this rank
  // still waits in a collective: no verdict is coming, say so at once.
  if (auto finished = FinishedRanks(status)) return *finished;
  if (auto host = CoordinatorHostGone(status)) return *host;
  std::string reason = WaitForAbort(options_.verdict_wait);
  if (!reason.empty()) return reason;
  if (auto silent = SilentRanks(status)) return *silent;
  if (status.code() == absl::StatusCode::kDeadlineExceeded) {
    if (auto stalled = StalledRanks(status, since)) return *stalled;
  }
  // Failing well before its timeout: a broken connection.
  const absl::Duration took = absl::Now() - since;
  if (took >= options_.collective_timeout * 0.9) return status.ToString();
  return absl::StrCat("a collective failed after ",
                      absl::FormatDuration(absl::Trunc(took, absl::Milliseconds(1))),
                      ", before its ", absl::FormatDuration(options_.collective_timeout),
                      " timeout (a peer's connection broke) [", status.message(), "]");
}

std::optional<std::string> RankAgent::CoordinatorHostGone(const absl::Status& status) {
  if (options_.coordinator_rank < 0 || options_.coordinator_rank == options_.rank) {
    return std::nullopt;
  }
  auto job = client_->GetJob(absl::Seconds(2));
  if (job.ok() || job.status().code() != absl::StatusCode::kUnavailable) return std::nullopt;
  const std::string& a = options_.coordinator_address;
  return absl::StrCat("rank ", options_.coordinator_rank,
                      a.empty() ? "" : absl::StrCat(" (on host ", a.substr(0, a.rfind(':')), ")"),
                      ", whose process served the job's coordinator, is gone: its process ended "
                      "or its node went down [",
                      status.message(), "]");
}

std::optional<std::string> RankAgent::FinishedRanks(const absl::Status& status) {
  auto job = client_->GetJob();
  if (!job.ok() || !job->failure().empty()) return std::nullopt;
  std::vector<std::string> left;
  for (const auto& r : job->ranks()) {
    if (r.rank() != options_.rank && r.finished()) {
      left.push_back(absl::StrCat("rank ", r.rank(), " finished its loop at step ", r.step()));
    }
  }
  if (left.empty()) return std::nullopt;
  return absl::StrCat(absl::StrJoin(left, ", "), " while rank ", options_.rank, " waited for step ",
                      step_now_.load() + 1, ": every rank must run the same number of steps [",
                      status.message(), "]");
}

// The coordinator's failure verdict, or ranks that went silent: the
// coordinator declares them dead after its heartbeat timeout; wait for that
// verdict a while (silent_wait).
std::optional<std::string> RankAgent::SilentRanks(const absl::Status& status) {
  std::string silent;
  const absl::Time deadline = absl::Now() + options_.silent_wait;
  while (true) {
    auto job = client_->GetJob();
    if (!job.ok()) break;
    if (!job->failure().empty()) return "job failed: " + job->failure();
    std::vector<std::string> quiet;
    for (const auto& r : job->ranks()) {
      if (r.rank() != options_.rank &&
          r.seconds_since_heartbeat() > options_.silent_after_seconds) {
        quiet.push_back(
            absl::StrFormat("%d (no heartbeat for %.1f s)", r.rank(), r.seconds_since_heartbeat()));
      }
    }
    if (quiet.empty()) {  // heartbeats came back (a loaded machine): nobody is lost
      silent.clear();
      break;
    }
    silent = absl::StrJoin(quiet, ", ");
    if (absl::Now() >= deadline) break;
    // A verdict pushed meanwhile wins.
    if (std::string reason = WaitForAbort(options_.poll_interval); !reason.empty()) return reason;
  }
  if (silent.empty()) return std::nullopt;
  return absl::StrCat("lost rank(s) ", silent, ", probably dead [", status.message(), "]");
}

// A timeout: the ranks behind this one in progress (alive, but stalled).
// A rank whose last heartbeat is older than the failed phase (`since`)
// reported its progress before this rank got there, so it may be waiting in
// the same collective: it is named only when no rank with a newer report is
// behind (on a loaded machine heartbeats arrive late).
std::optional<std::string> RankAgent::StalledRanks(const absl::Status& status, absl::Time since) {
  auto job = client_->GetJob();
  if (!job.ok()) return std::nullopt;
  const double phase_seconds = absl::ToDoubleSeconds(absl::Now() - since);
  std::vector<std::string> behind, behind_fresh;
  for (const auto& r : job->ranks()) {
    if (r.rank() != options_.rank && r.progress() < progress_.load()) {
      behind.push_back(absl::StrCat(r.rank(), " (at step ", r.step(), ")"));
      if (r.seconds_since_heartbeat() < phase_seconds) behind_fresh.push_back(behind.back());
    }
  }
  if (!behind_fresh.empty()) behind = std::move(behind_fresh);
  if (behind.empty()) return std::nullopt;
  return absl::StrCat("collective timed out at step ", step_now_.load() + 1,
                      "; stalled rank(s): ", absl::StrJoin(behind, ", "), " [", status.message(),
                      "]");
}

// ---------------------------------------------------------------- checkpoints

void RankAgent::RecordCheckpoint(int64_t step, const std::string& dir, double seconds) {
  FileSystem* fs = PosixFileSystem();
  int64_t bytes = 0;  // the whole checkpoint: every shard and the manifest
  if (auto files = fs->ListDir(dir); files.ok()) {
    for (const std::string& name : *files) {
      if (auto size = fs->FileSize(absl::StrCat(dir, "/", name)); size.ok())
        bytes += static_cast<int64_t>(*size);
    }
  }
  absl::MutexLock l(&mu_);
  ++metrics_.checkpoints_total;
  metrics_.last_checkpoint_step = step;
  metrics_.last_checkpoint_seconds = seconds;
  metrics_.last_checkpoint_bytes = bytes;
}

CheckpointOutcome RankAgent::Checkpoint(int64_t step) {
  if (step == last_saved_) return CheckpointOutcome();
  FileSystem* fs = PosixFileSystem();
  const std::string expected = absl::StrCat(options_.ckpt_dir, "/step-", step);
  auto before = ResolveCheckpoint(fs, options_.ckpt_dir);
  const bool was_latest = before.ok() && *before == expected;
  CheckpointOptions co;
  if (options_.samples_per_step > 0) {
    co.user_metadata["data_position"] = std::to_string(step * options_.samples_per_step);
  }
  const absl::Time t0 = absl::Now();
  auto dir = SaveCheckpoint(*opt_, options_.ckpt_dir, co);
  if (!dir.ok()) return SaveFailed(step, dir.status(), was_latest, t0);
  last_saved_ = step;
  const double took = absl::ToDoubleSeconds(absl::Now() - t0);
  RecordCheckpoint(step, *dir, took);
  if (options_.rank == 0) {
    Print(absl::StrFormat("checkpoint %s written in %.2f s", *dir,
                          absl::ToDoubleSeconds(absl::Now() - t0)));
    if (options_.ckpt_keep > 0) {
      absl::Status p = PruneCheckpoints(fs, options_.ckpt_dir, options_.ckpt_keep);
      if (!p.ok()) Print("pruning old checkpoints failed: " + p.ToString());
    }
  }
  return CheckpointOutcome();
}

// What a failed save left: whether the ranks can still talk, and whether
// rank 0 committed the checkpoint before a later collective failed.
CheckpointOutcome RankAgent::SaveFailed(int64_t step, const absl::Status& s, bool was_latest,
                                        absl::Time t0) {
  CheckpointOutcome out;
  // A wait that timed out leaves its collective running on buffers that are
  // gone now: stop it. Then ask whether the ranks can still talk: an error
  // they agreed on leaves the communicator healthy, a broken collective has
  // aborted it (this fails at once then).
  if (s.code() == absl::StatusCode::kDeadlineExceeded) comm_->Abort(s);
  agree_buf_[0] = 0;
  if (absl::Status p = AllReduceMax(1); !p.ok()) {
    comm_->Abort(p);
    out.fatal = true;
  }
  const std::string expected = absl::StrCat(options_.ckpt_dir, "/step-", step);
  auto after = ResolveCheckpoint(PosixFileSystem(), options_.ckpt_dir);
  out.committed = !was_latest && after.ok() && *after == expected;
  const std::string cause = out.fatal ? Diagnose(s, t0) : s.ToString();
  if (out.committed) {
    last_saved_ = step;
    out.status = absl::Status(
        s.code(),
        absl::StrCat(
            "checkpoint ", expected,
            " was committed (LATEST names it), but a rank failed after the commit: ", cause));
  } else {
    out.status =
        absl::Status(s.code(), absl::StrCat("checkpoint at step ", step, " failed: ", cause));
  }
  return out;
}

absl::Status RankAgent::CheckpointDuringTraining(int64_t step) {
  CheckpointOutcome sv = Checkpoint(step);
  if (sv.status.ok() || sv.fatal) return sv.status;
  // The rank that saw the error says so; rank 0 always does.
  if (options_.rank == 0 || !absl::StrContains(sv.status.message(), "on another rank")) {
    Print(absl::StrCat(sv.status.message(), " (training continues)"));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------- failure

// A failing rank sends its flight record (its last collectives) to the
// coordinator, which shows where the ranks diverged; if that fails, it
// writes it as JSON and says where.
void RankAgent::ReportFlight() {
  std::string reason = failure_;
  if (reason.empty()) reason = abort_reason();
  if (reason.empty()) reason = "the rank failed";
  if (reason.size() > kMaxFlightReasonBytes) reason.resize(kMaxFlightReasonBytes);
  std::vector<FlightEntry> ring;
  if (recorder_ != nullptr) ring = recorder_->Snapshot();
  const v1::FlightRecord record = ToFlightRecord(options_.rank, ring, absl::Now(), reason);
  const absl::Status sent = client_->ReportFlightRecord(record);
  if (!sent.ok()) WriteFlightRecord(record, sent);
}

void RankAgent::WriteFlightRecord(const v1::FlightRecord& record, const absl::Status& not_sent) {
  std::string json;
  google::protobuf::util::JsonPrintOptions jo;
  jo.add_whitespace = true;
  jo.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(record, &json, jo);
  std::string dir =
      !options_.flight_record_dir.empty() ? options_.flight_record_dir : options_.ckpt_dir;
  std::string path;
  if (!dir.empty()) {
    (void)PosixFileSystem()->MakeDirs(dir);
    path = absl::StrCat(dir, "/flight-record-rank-", options_.rank, ".json");
  } else {
    const std::string tmp = EnvStr("TMPDIR", "/tmp");
    path = absl::StrCat(tmp.empty() ? "/tmp" : tmp, "/shardopt-flight-record-", options_.job_id,
                        "-rank-", options_.rank, "-", getpid(), ".json");
  }
  FILE* f = std::fopen(path.c_str(), "w");
  bool written = f != nullptr && std::fwrite(json.data(), 1, json.size(), f) == json.size();
  if (f != nullptr && std::fclose(f) != 0) written = false;
  PrintError(absl::StrCat("could not send the flight record to the coordinator (",
                          not_sent.message(), "); ",
                          written ? "wrote it to " : "could not write it to ", path));
}

void RankAgent::Print(const std::string& line) {
  if (options_.print) {
    options_.print(line);
    return;
  }
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

void RankAgent::PrintError(const std::string& line) {
  if (options_.print_error) {
    options_.print_error(line);
    return;
  }
  std::fprintf(stderr, "%s[rank %d]: %s\n", options_.log_name.c_str(), options_.rank, line.c_str());
}

}  // namespace shardopt
