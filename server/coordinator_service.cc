#include "server/coordinator_service.h"

#include <algorithm>
#include <functional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/planner.h"
#include "server/rpc_server.h"

namespace shardopt {

namespace {

constexpr char kShuttingDown[] = "coordinator shutting down";

grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx, const grpc::Status& s) {
  return FinishUnary(ctx, s);
}

DType ParseDType(const std::string& s, bool* ok) {
  *ok = true;
  if (s == "float32") return DType::kFloat32;
  if (s == "bfloat16") return DType::kBFloat16;
  if (s == "float16") return DType::kFloat16;
  *ok = false;
  return DType::kFloat32;
}

HeartbeatInfo FromProto(const v1::HeartbeatRequest& r) {
  HeartbeatInfo info{r.rank(), r.step(), r.loss(), r.samples_per_s(), r.progress()};
  info.learning_rate = r.learning_rate();
  info.epoch = r.epoch();
  info.has_metrics = r.has_metrics();
  if (info.has_metrics) {
    const v1::RankMetrics& m = r.metrics();
    RankMetricsInfo& o = info.metrics;
    // More than the limit is refused by the coordinator; copy one more than
    // it at most, so that a huge list costs nothing here.
    const int n = std::min(m.step_seconds_size(), kMaxStepTimesPerHeartbeat + 1);
    o.step_seconds.assign(m.step_seconds().begin(), m.step_seconds().begin() + n);
    o.grad_norm = m.grad_norm();
    o.comm_wait_seconds = m.comm_wait_seconds();
    o.update_seconds = m.update_seconds();
    o.bytes_sent_total = m.bytes_sent_total();
    o.master_bytes = m.master_bytes();
    o.state_bytes = m.state_bytes();
    o.grad_bytes = m.grad_bytes();
    o.param_bytes = m.param_bytes();
    o.rss_bytes = m.rss_bytes();
    o.stalls_total = m.stalls_total();
    o.checkpoints_total = m.checkpoints_total();
    o.last_checkpoint_step = m.last_checkpoint_step();
    o.last_checkpoint_seconds = m.last_checkpoint_seconds();
    o.last_checkpoint_bytes = m.last_checkpoint_bytes();
  }
  return info;
}

void ToProto(const RankMetricsInfo& m, v1::RankMetrics* o) {
  o->set_grad_norm(m.grad_norm);
  o->set_comm_wait_seconds(m.comm_wait_seconds);
  o->set_update_seconds(m.update_seconds);
  o->set_bytes_sent_total(m.bytes_sent_total);
  o->set_master_bytes(m.master_bytes);
  o->set_state_bytes(m.state_bytes);
  o->set_grad_bytes(m.grad_bytes);
  o->set_param_bytes(m.param_bytes);
  o->set_rss_bytes(m.rss_bytes);
  o->set_stalls_total(m.stalls_total);
  o->set_checkpoints_total(m.checkpoints_total);
  o->set_last_checkpoint_step(m.last_checkpoint_step);
  o->set_last_checkpoint_seconds(m.last_checkpoint_seconds);
  o->set_last_checkpoint_bytes(m.last_checkpoint_bytes);
}

void FillReply(const HeartbeatReply& r, v1::HeartbeatResponse* resp) {
  resp->set_abort(r.abort);
  resp->set_abort_reason(r.abort_reason);
  resp->set_learning_rate(r.learning_rate);
  resp->set_hyper_params_version(r.hyper_params_version);
  resp->set_checkpoint_request(r.checkpoint_request);
  resp->set_resize_request(r.resize_request);
  resp->set_resize_epoch(r.resize_epoch);
  resp->set_resize_world(r.resize_world);
  resp->clear_resize_leave();  // (a session's message is filled again for every notice)
  for (int l : r.resize_leave) resp->add_resize_leave(l);
  resp->set_resize_recovery(r.resize_recovery);
}

}  // namespace

// One rank's session: reads its heartbeats, answers the first, and pushes the
// job's notice whenever it changes. At most one write is outstanding; a newer
// notice replaces one that has not been written yet.
class CoordinatorService::SessionReactor
    : public grpc::ServerBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse> {
 public:
  SessionReactor(CoordinatorService* service, grpc::Status auth) : service_(service) {
    service_->CallStarted();
    if (auth.ok()) {
      absl::MutexLock l(&service_->sessions_mu_);
      if (service_->shutting_down_.load()) {
        auth = grpc::Status(grpc::StatusCode::UNAVAILABLE, kShuttingDown);
      } else {
        service_->sessions_.insert(this);
        registered_ = true;
      }
    }
    if (!auth.ok()) {
      done_reading_ = true;
      Finish(auth);
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the rank closed its side, or the connection broke
      if (rank_ >= 0) service_->coordinator_->SessionLost(rank_);
      Close(grpc::Status::OK);
      return;
    }
    auto r = service_->coordinator_->Heartbeat(FromProto(request_));
    if (r.ok()) rank_ = request_.rank();
    if (!r.ok()) {
      Close(ToGrpc(r.status()));
      return;
    }
    if (first_) {
      first_ = false;
      Push(*r);
    }
    absl::MutexLock l(&mu_);
    if (closing_) return;  // ended meanwhile (shutdown): no reads after Finish
    StartRead(&request_);
  }

  void Push(const HeartbeatReply& notice) {
    absl::MutexLock l(&mu_);
    if (closing_) return;
    FillReply(notice, &pending_);
    have_pending_ = true;
    if (!writing_) WriteLocked();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock l(&mu_);
    writing_ = false;
    if (closing_) {
      if (!finished_) {
        finished_ = true;
        Finish(final_status_);
      }
      return;
    }
    if (ok && have_pending_) WriteLocked();
  }

  void OnDone() override {
    CoordinatorService* service = service_;
    if (registered_) {
      absl::MutexLock l(&service->sessions_mu_);
      service->sessions_.erase(this);
    }
    delete this;
    service->CallDone();
  }

  // Ends the session now (the coordinator is shutting down).
  void End(const grpc::Status& status) { Close(status); }

 private:
  void WriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    writing_ = true;
    have_pending_ = false;
    writing_msg_ = pending_;
    StartWrite(&writing_msg_);
  }
  void Close(const grpc::Status& status) {
    absl::MutexLock l(&mu_);
    if (closing_) return;
    closing_ = true;
    final_status_ = status;
    if (!writing_ && !finished_) {
      finished_ = true;
      Finish(status);
    }
  }

  CoordinatorService* service_;
  v1::HeartbeatRequest request_;  // reads only, one at a time
  bool first_ = true;
  int rank_ = -1;  // the rank whose heartbeats this session carries (-1: none yet)
  bool registered_ = false;
  bool done_reading_ = false;
  absl::Mutex mu_;
  v1::HeartbeatResponse pending_ ABSL_GUARDED_BY(mu_), writing_msg_ ABSL_GUARDED_BY(mu_);
  bool have_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status final_status_ ABSL_GUARDED_BY(mu_);
};

grpc::ServerBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse>* CoordinatorService::Session(
    grpc::CallbackServerContext* ctx) {
  return new SessionReactor(this, CheckToken(ctx, token_));  // refused after shutdown
}

void CoordinatorService::PushToSessions() {
  const HeartbeatReply notice = coordinator_->Notice();
  absl::MutexLock l(&sessions_mu_);
  for (SessionReactor* s : sessions_) s->Push(notice);
}

// A unary call that waits in the Coordinator (Join, KvGet). The
// coordinator's callback finishes it; if the client goes away first (or its
// deadline passes), OnCancel withdraws the wait.
class CoordinatorService::WaitingCall : public grpc::ServerUnaryReactor {
 public:
  explicit WaitingCall(CoordinatorService* service) : service_(service) { service_->CallStarted(); }
  // Before the handler returns (gRPC calls OnCancel only after that).
  void set_wait(Coordinator::WaitId id) { id_ = id; }
  void OnCancel() override {
    if (id_ != 0 && service_->coordinator_->CancelWait(id_)) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the call was cancelled while waiting"));
    }
  }
  void OnDone() override {
    CoordinatorService* service = service_;
    delete this;
    service->CallDone();
  }

 private:
  CoordinatorService* const service_;
  Coordinator::WaitId id_ = 0;
};

// A call that asks every joined rank's shard owner at once (asynchronous
// calls with the job's token, each bounded by `deadline`) and finishes when
// the last one answered. Subclasses say which RPC to send (CallOwner), what
// a rank that never joined means (NotJoinedLocked), what to do with each
// answer (AnswerLocked) and at the end (Finished), and how to leave the
// service's set of such calls (Unregister).
class CoordinatorService::FanOutCall : public grpc::ServerUnaryReactor {
 public:
  explicit FanOutCall(CoordinatorService* service) : service_(service) { service_->CallStarted(); }

  void Start(const std::vector<std::string>& addresses, absl::Time deadline) {
    const size_t n = addresses.size();
    contexts_.resize(n);
    Prepare(n);
    {
      absl::MutexLock l(&mu_);
      for (size_t r = 0; r < n; ++r) {
        if (addresses[r].empty()) {
          NotJoinedLocked(r);
          continue;
        }
        auto ctx = std::make_unique<grpc::ClientContext>();
        ctx->set_deadline(absl::ToChronoTime(deadline));
        if (!service_->token_.empty()) {
          ctx->AddMetadata("authorization", "Bearer " + service_->token_);
        }
        if (cancelled_) ctx->TryCancel();  // takes effect when the call starts
        contexts_[r] = std::move(ctx);
        ++pending_;
      }
    }
    for (size_t r = 0; r < n; ++r) {
      if (!contexts_[r]) continue;
      const std::string address = addresses[r];
      CallOwner(service_->OwnerStub(address), contexts_[r].get(), r,
                [this, r, address](grpc::Status s) { Answer(r, address, s); });
    }
    Release();  // Start's own hold
  }

  // Ends the outstanding calls to shard owners (they answer CANCELLED).
  void CancelOutgoing() {
    absl::MutexLock l(&mu_);
    cancelled_ = true;
    for (auto& c : contexts_) {
      if (c) c->TryCancel();
    }
  }

  void OnCancel() override { CancelOutgoing(); }

  void OnDone() override {
    CoordinatorService* service = service_;
    Unregister();
    delete this;
    service->CallDone();
  }

 protected:
  virtual ~FanOutCall() = default;
  virtual void Prepare(size_t n) = 0;
  virtual void CallOwner(v1::ShardOwner::Stub* stub, grpc::ClientContext* ctx, size_t r,
                         std::function<void(grpc::Status)> done) = 0;
  virtual void NotJoinedLocked(size_t r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) = 0;
  virtual void AnswerLocked(size_t r, const std::string& address, const grpc::Status& s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) = 0;
  virtual void Finished() = 0;
  virtual void Unregister() = 0;

  CoordinatorService* const service_;
  absl::Mutex mu_;

 private:
  void Answer(size_t r, const std::string& address, const grpc::Status& s) {
    {
      absl::MutexLock l(&mu_);
      AnswerLocked(r, address, s);
    }
    Release();
  }
  void Release() {
    bool last;
    {
      absl::MutexLock l(&mu_);
      last = --pending_ == 0;
    }
    if (last) Finished();
  }

  std::vector<std::unique_ptr<grpc::ClientContext>> contexts_;
  int pending_ ABSL_GUARDED_BY(mu_) = 1;  // Start's hold
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

// GetMemory: every shard owner's GetShardInfo, 5 s each at most.
class CoordinatorService::MemoryCall : public FanOutCall {
 public:
  MemoryCall(CoordinatorService* service, v1::GetMemoryResponse* resp)
      : FanOutCall(service), resp_(resp) {}

 private:
  void Prepare(size_t n) override {
    infos_.resize(n);
    for (size_t r = 0; r < n; ++r) resp_->add_ranks()->set_rank(static_cast<int>(r));
  }
  void CallOwner(v1::ShardOwner::Stub* stub, grpc::ClientContext* ctx, size_t r,
                 std::function<void(grpc::Status)> done) override {
    stub->async()->GetShardInfo(ctx, &request_, &infos_[r], std::move(done));
  }
  void NotJoinedLocked(size_t r) override {
    resp_->mutable_ranks(static_cast<int>(r))->set_error("not joined");
  }
  void AnswerLocked(size_t r, const std::string& address, const grpc::Status& s) override {
    v1::RankMemory* m = resp_->mutable_ranks(static_cast<int>(r));
    if (!s.ok()) {
      m->set_error(absl::StrCat("shard owner at ", address, ": ", s.error_message()));
      return;
    }
    const v1::GetShardInfoResponse& info = infos_[r];
    m->set_master_bytes(info.master_bytes());
    m->set_state_bytes(info.state_bytes());
    m->set_grad_bytes(info.grad_bytes());
    m->set_param_bytes(info.param_bytes());
    m->set_rss_bytes(info.rss_bytes());
  }
  void Finished() override { Finish(grpc::Status::OK); }
  void Unregister() override {
    absl::MutexLock l(&service_->calls_mu_);
    service_->memory_calls_.erase(this);
  }

  v1::GetMemoryResponse* const resp_;
  const v1::GetShardInfoRequest request_;
  std::vector<v1::GetShardInfoResponse> infos_;
};

// GetFlightRecords: every shard owner's ring, 5 s each at most; a rank that
// did not answer is represented by the ring it reported (if any), and the
// first divergence is computed.
class CoordinatorService::FlightCall : public FanOutCall {
 public:
  FlightCall(CoordinatorService* service, v1::GetFlightRecordsResponse* resp)
      : FanOutCall(service), resp_(resp) {}

 private:
  void Prepare(size_t n) override {
    rings_.resize(n);
    errors_.resize(n);
  }
  void CallOwner(v1::ShardOwner::Stub* stub, grpc::ClientContext* ctx, size_t r,
                 std::function<void(grpc::Status)> done) override {
    stub->async()->GetFlightRecord(ctx, &request_, &rings_[r], std::move(done));
  }
  void NotJoinedLocked(size_t r) override { errors_[r] = "never joined"; }
  void AnswerLocked(size_t r, const std::string& address, const grpc::Status& s) override {
    if (!s.ok()) errors_[r] = absl::StrCat("shard owner at ", address, ": ", s.error_message());
  }
  void Finished() override {
    std::map<int, v1::FlightRecord> reported;
    for (v1::FlightRecord& f : service_->flight_records_.Reported())
      reported[f.rank()] = std::move(f);
    for (size_t r = 0; r < rings_.size(); ++r) {
      v1::FlightRecord* out = resp_->add_records();
      if (errors_[r].empty()) {
        *out = std::move(rings_[r]);
      } else if (reported.count(static_cast<int>(r))) {
        *out = std::move(reported[static_cast<int>(r)]);
      } else {
        out->set_error(errors_[r]);
      }
      out->set_rank(static_cast<int>(r));
    }
    resp_->set_divergence(FirstDivergence({resp_->records().begin(), resp_->records().end()},
                                          static_cast<int>(rings_.size()),
                                          HeartbeatNotes(*service_->coordinator_)));
    Finish(grpc::Status::OK);
  }
  void Unregister() override {
    absl::MutexLock l(&service_->calls_mu_);
    service_->flight_calls_.erase(this);
  }

  v1::GetFlightRecordsResponse* const resp_;
  const v1::GetFlightRecordRequest request_;
  std::vector<v1::FlightRecord> rings_;
  std::vector<std::string> errors_;  // written before the calls start or by their Answer
};

CoordinatorService::CoordinatorService(Coordinator* coordinator, std::string token)
    : coordinator_(coordinator), token_(std::move(token)) {
  coordinator_->SetListener([this] { PushToSessions(); });
  watchdog_ = std::thread([this] {
    while (!stop_.load()) {
      coordinator_->CheckHeartbeats();
      coordinator_->CheckSlowRanks();
      coordinator_->ExpireWaits(absl::Now());
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
}

CoordinatorService::~CoordinatorService() {
  coordinator_->SetListener(nullptr);
  BeginShutdown();
  stop_ = true;
  watchdog_.join();
  // Normally none: the server (shut down first) waits for every call.
  absl::MutexLock l(&calls_mu_);
  auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(calls_mu_) { return calls_ == 0; };
  calls_mu_.AwaitWithTimeout(absl::Condition(&idle), absl::Seconds(10));
}

void CoordinatorService::BeginShutdown() {
  if (shutting_down_.exchange(true)) return;
  coordinator_->Shutdown();
  const grpc::Status unavailable(grpc::StatusCode::UNAVAILABLE, kShuttingDown);
  {
    absl::MutexLock l(&sessions_mu_);
    for (SessionReactor* s : sessions_) s->End(unavailable);
  }
  absl::MutexLock l(&calls_mu_);
  for (MemoryCall* m : memory_calls_) m->CancelOutgoing();
  for (FlightCall* f : flight_calls_) f->CancelOutgoing();
}

void CoordinatorService::CallStarted() {
  absl::MutexLock l(&calls_mu_);
  ++calls_;
}

void CoordinatorService::CallDone() {
  absl::MutexLock l(&calls_mu_);
  --calls_;
}

int CoordinatorService::calls_in_flight() {
  absl::MutexLock l(&calls_mu_);
  return calls_;
}

void CoordinatorService::SetOwnerCredentials(
    std::shared_ptr<grpc::ChannelCredentials> credentials) {
  absl::MutexLock l(&stubs_mu_);
  owner_credentials_ = std::move(credentials);
  owner_stubs_.clear();
}

v1::ShardOwner::Stub* CoordinatorService::OwnerStub(const std::string& address) {
  absl::MutexLock l(&stubs_mu_);
  auto& stub = owner_stubs_[address];
  if (!stub) {
    stub = v1::ShardOwner::NewStub(grpc::CreateChannel(
        address, owner_credentials_ ? owner_credentials_ : grpc::InsecureChannelCredentials()));
  }
  return stub.get();
}

grpc::ServerUnaryReactor* CoordinatorService::Join(grpc::CallbackServerContext* ctx,
                                                   const v1::JoinRequest* req,
                                                   v1::JoinResponse* resp) {
  if (auto s = CheckToken(ctx, token_); !s.ok()) return Done(ctx, s);
  JoinInfo info;
  info.job_id = req->job_id();
  info.rank = req->rank();
  info.world_size = req->world_size();
  info.host = req->host();
  info.shard_owner_port = req->shard_owner_port();
  info.device = req->device();
  info.layout_hash = req->layout_hash();
  info.learning_rate = req->learning_rate();
  info.epoch = req->epoch();
  info.elastic = req->elastic();
  info.step = req->step();
  info.pid = req->pid();
  if (req->params_size() > kMaxParams) {
    return Done(ctx, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "too many parameters"));
  }
  for (const v1::ParamInfo& p : req->params()) {
    ParamSpec s;
    s.name = p.name();
    s.shape.assign(p.shape().begin(), p.shape().end());
    bool ok = true;
    s.dtype = ParseDType(p.dtype(), &ok);
    if (!ok) {
      return Done(ctx, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                    "unknown dtype '" + p.dtype().substr(0, 32) + "'"));
    }
    s.trainable = p.trainable();
    info.params.push_back(std::move(s));
  }
  info.plan.bucket_cap_elements = req->plan().bucket_cap_elements();
  info.plan.alignment_elements = req->plan().alignment_elements();
  info.plan.allow_cut = req->plan().allow_cut();
  // Wait for the other ranks at most until the client's deadline (<= 10 min).
  const absl::Time now = absl::Now();
  const absl::Duration wait = std::min(
      absl::Minutes(10), absl::FromChrono(ctx->deadline()) - now - absl::Milliseconds(200));
  auto* call = new WaitingCall(this);
  call->set_wait(coordinator_->JoinAsync(std::move(info),
                                         now + std::max(wait, absl::ZeroDuration()),
                                         [call, resp](absl::StatusOr<JoinResult> r) {
                                           if (r.ok()) {
                                             resp->set_layout_hash(r->layout_hash);
                                             for (const auto& p : r->peers) resp->add_peers(p);
                                           }
                                           call->Finish(ToGrpc(r.status()));
                                         }));
  return call;
}

grpc::ServerUnaryReactor* CoordinatorService::KvSet(grpc::CallbackServerContext* ctx,
                                                    const v1::KvSetRequest* req,
                                                    v1::KvSetResponse*) {
  if (auto s = CheckToken(ctx, token_); !s.ok()) return Done(ctx, s);
  return Done(ctx, ToGrpc(coordinator_->KvSet(req->key(), req->value())));
}

grpc::ServerUnaryReactor* CoordinatorService::KvGet(grpc::CallbackServerContext* ctx,
                                                    const v1::KvGetRequest* req,
                                                    v1::KvGetResponse* resp) {
  if (auto s = CheckToken(ctx, token_); !s.ok()) return Done(ctx, s);
  if (req->wait_ms() < 0 || req->wait_ms() > 600000) {
    return Done(ctx, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "wait_ms out of range"));
  }
  const absl::Time deadline =
      std::min(absl::Now() + absl::Milliseconds(req->wait_ms()), absl::FromChrono(ctx->deadline()));
  auto* call = new WaitingCall(this);
  call->set_wait(
      coordinator_->KvGetAsync(req->key(), deadline, [call, resp](absl::StatusOr<std::string> v) {
        if (v.ok()) resp->set_value(*std::move(v));
        call->Finish(ToGrpc(v.status()));
      }));
  return call;
}

grpc::ServerUnaryReactor* CoordinatorService::Heartbeat(grpc::CallbackServerContext* ctx,
                                                        const v1::HeartbeatRequest* req,
                                                        v1::HeartbeatResponse* resp) {
  if (auto s = CheckToken(ctx, token_); !s.ok()) return Done(ctx, s);
  auto r = coordinator_->Heartbeat(FromProto(*req));
  if (r.ok()) FillReply(*r, resp);
  return Done(ctx, ToGrpc(r.status()));
}

grpc::ServerUnaryReactor* CoordinatorService::GetJob(grpc::CallbackServerContext* ctx,
                                                     const v1::GetJobRequest*,
                                                     v1::GetJobResponse* resp) {
  if (auto s = CheckToken(ctx, token_); !s.ok()) return Done(ctx, s);
  JobStatus j = coordinator_->GetJob();
  resp->set_job_id(j.job_id);
  resp->set_state(JobStateName(j.state));
  resp->set_world_size(j.world_size);
  resp->set_step(j.step);
  resp->set_failure(j.failure);
  resp->set_layout_hash(j.layout_hash);
  resp->set_learning_rate(j.learning_rate);
  resp->set_requested_learning_rate(j.requested_learning_rate);
  for (int r : j.slow_ranks) resp->add_slow_ranks(r);
  resp->set_duration_seconds(absl::ToDoubleSeconds(j.duration()));
  resp->set_restarts(j.restarts);
  resp->set_last_restart(j.last_restart);
  resp->set_epoch(j.epoch);
  for (const MembershipChange& c : j.membership) {
    v1::MembershipChange* m = resp->add_membership();
    m->set_epoch(c.epoch);
    m->set_from_world(c.from_world);
    m->set_to_world(c.to_world);
    m->set_step(c.step);
    for (int r : c.left) m->add_left(r);
    for (int r : c.joined) m->add_joined(r);
    m->set_lost(c.lost);
    m->set_seconds(absl::ToDoubleSeconds(c.took));
    m->set_unix_time(absl::ToUnixMicros(c.completed) / 1e6);
  }
  if (j.resize) resp->set_resize_pending_world(j.resize->to_world);
  for (const RankState& r : j.ranks) {
    v1::RankStatus* rs = resp->add_ranks();
    rs->set_rank(r.rank);
    rs->set_address(r.address);
    rs->set_step(r.step);
    rs->set_seconds_since_heartbeat(r.joined ? absl::ToDoubleSeconds(j.now - r.last_heartbeat)
                                             : -1);
    rs->set_alive(r.joined &&
                  j.now - r.last_heartbeat <= coordinator_->options().heartbeat_timeout);
    rs->set_loss(r.loss);
    rs->set_samples_per_s(r.samples_per_s);
    rs->set_progress(r.progress);
    rs->set_learning_rate(r.learning_rate);
    rs->set_step_seconds_p50(r.step_seconds_p50);
    rs->set_step_seconds_max(r.step_seconds_max);
    if (r.has_metrics) ToProto(r.metrics, rs->mutable_metrics());
    rs->set_slow(r.slow);
    rs->set_slow_reason(r.slow_reason);
    rs->set_finished(r.finished);
  }
  return Done(ctx, grpc::Status::OK);
}

grpc::ServerUnaryReactor* CoordinatorService::GetLayout(grpc::CallbackServerContext* ctx,
                                                        const v1::GetLayoutRequest*,
                                                        v1::GetLayoutResponse* resp) {
  if (auto s = CheckToken(ctx, token_); !s.ok()) return Done(ctx, s);
  auto layout = coordinator_->GetLayout();
  if (!layout.ok()) return Done(ctx, ToGrpc(layout.status()));
  const Layout& l = **layout;
  resp->set_world_size(l.world_size());
  resp->set_layout_hash(l.hash());
  resp->set_num_elements(l.num_elements());
  resp->set_padding_elements(l.padding_elements());
  resp->set_imbalance(l.imbalance());
  resp->set_cut_tensors(l.num_cut_tensors());
  for (int64_t o : l.owned_elements()) resp->add_owned_elements(o);
  for (const Bucket& b : l.buckets()) resp->add_bucket_capacity(b.capacity_per_rank);
  for (const ParamSpec& p : l.params()) {
    v1::ParamInfo* info = resp->add_params();
    info->set_name(p.name);
    for (int64_t d : p.shape) info->add_shape(d);
    info->set_dtype(DTypeName(p.dtype));
    info->set_trainable(p.trainable);
  }
  // One row per (bucket, rank) with the pieces it holds.
  std::map<std::pair<int, int>, v1::BucketRank*> rows;
  for (const Bucket& b : l.buckets()) {
    for (int r = 0; r < l.world_size(); ++r) {
      v1::BucketRank* row = resp->add_ranges();
      row->set_bucket(b.index);
      row->set_rank(r);
      rows[{b.index, r}] = row;
    }
  }
  for (const Piece& p : l.AllPieces()) {
    v1::BucketRank* row = rows[{p.bucket, p.rank}];
    row->set_elements(row->elements() + p.length);
    const ParamPlacement& pl = l.placement(p.param);
    const std::string& name = l.params()[p.param].name;
    row->add_params(p.length == pl.numel ? name
                                         : absl::StrCat(name, "[", p.param_offset, ":",
                                                        p.param_offset + p.length, "]"));
  }
  return Done(ctx, grpc::Status::OK);
}

grpc::ServerUnaryReactor* CoordinatorService::GetMemory(grpc::CallbackServerContext* ctx,
                                                        const v1::GetMemoryRequest*,
                                                        v1::GetMemoryResponse* resp) {
  if (auto s = CheckToken(ctx, token_); !s.ok()) return Done(ctx, s);
  auto* call = new MemoryCall(this, resp);
  grpc::Status refused;
  {
    absl::MutexLock l(&calls_mu_);
    if (shutting_down_.load()) {
      refused = grpc::Status(grpc::StatusCode::UNAVAILABLE, kShuttingDown);
    } else if (memory_calls_.size() >= static_cast<size_t>(kMaxMemoryCalls)) {
      refused = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                             absl::StrCat(memory_calls_.size(),
                                          " GetMemory calls are in progress (the limit); try again "
                                          "later"));
    } else {
      memory_calls_.insert(call);
    }
  }
  if (!refused.ok()) {
    call->Finish(refused);
    return call;
  }
  const absl::Time deadline =
      std::min(absl::Now() + absl::Seconds(5), absl::FromChrono(ctx->deadline()));
  call->Start(coordinator_->ShardOwnerAddresses(), deadline);
  return call;
}

grpc::ServerUnaryReactor* CoordinatorService::SetHyperParams(grpc::CallbackServerContext* ctx,
                                                             const v1::SetHyperParamsRequest* req,
                                                             v1::SetHyperParamsResponse* resp) {
  if (auto s = CheckToken(ctx, token_); !s.ok()) return Done(ctx, s);
  auto v = coordinator_->SetLearningRate(req->learning_rate());
  if (v.ok()) resp->set_version(*v);
  return Done(ctx, ToGrpc(v.status()));
}

grpc::ServerUnaryReactor* CoordinatorService::Abort(grpc::CallbackServerContext* ctx,
                                                    const v1::AbortRequest* req,
                                                    v1::AbortResponse*) {
  if (auto s = CheckToken(ctx, token_); !s.ok()) return Done(ctx, s);
  if (req->reason().size() > 4096) {
    return Done(ctx, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "reason too long"));
  }
  coordinator_->Abort(req->reason().empty() ? "aborted by request" : req->reason(), req->rank());
  return Done(ctx, grpc::Status::OK);
}

grpc::ServerUnaryReactor* CoordinatorService::Finish(grpc::CallbackServerContext* ctx,
                                                     const v1::FinishRequest* req,
                                                     v1::FinishResponse*) {
  if (auto s = CheckToken(ctx, token_); !s.ok()) return Done(ctx, s);
  return Done(ctx, ToGrpc(coordinator_->Finish(req->rank())));
}

grpc::ServerUnaryReactor* CoordinatorService::RequestCheckpoint(
    grpc::CallbackServerContext* ctx, const v1::RequestCheckpointRequest*,
    v1::RequestCheckpointResponse* resp) {
  if (auto s = CheckToken(ctx, token_); !s.ok()) return Done(ctx, s);
  auto r = coordinator_->RequestCheckpoint();
  if (r.ok()) resp->set_request(*r);
  return Done(ctx, ToGrpc(r.status()));
}

grpc::ServerUnaryReactor* CoordinatorService::Resize(grpc::CallbackServerContext* ctx,
                                                     const v1::ResizeRequest* req,
                                                     v1::ResizeResponse* resp) {
  if (auto s = CheckToken(ctx, token_); !s.ok()) return Done(ctx, s);
  if (req->leave_size() > kMaxWorldSize) {
    return Done(ctx, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "too many ranks to leave"));
  }
  auto r = coordinator_->RequestResize(
      req->to_world(), std::vector<int>(req->leave().begin(), req->leave().end()), req->external());
  if (r.ok()) {
    resp->set_request(r->request);
    resp->set_epoch(r->epoch);
    resp->set_from_world(r->from_world);
    resp->set_to_world(r->to_world);
  }
  return Done(ctx, ToGrpc(r.status()));
}

grpc::ServerUnaryReactor* CoordinatorService::ReportFlightRecord(
    grpc::CallbackServerContext* ctx, const v1::ReportFlightRecordRequest* req,
    v1::ReportFlightRecordResponse*) {
  if (auto s = CheckToken(ctx, token_); !s.ok()) return Done(ctx, s);
  return Done(ctx,
              ToGrpc(flight_records_.Report(req->record(), coordinator_->GetJob().world_size)));
}

grpc::ServerUnaryReactor* CoordinatorService::GetFlightRecords(grpc::CallbackServerContext* ctx,
                                                               const v1::GetFlightRecordsRequest*,
                                                               v1::GetFlightRecordsResponse* resp) {
  if (auto s = CheckToken(ctx, token_); !s.ok()) return Done(ctx, s);
  auto* call = new FlightCall(this, resp);
  grpc::Status refused;
  {
    absl::MutexLock l(&calls_mu_);
    if (shutting_down_.load()) {
      refused = grpc::Status(grpc::StatusCode::UNAVAILABLE, kShuttingDown);
    } else if (flight_calls_.size() >= static_cast<size_t>(kMaxMemoryCalls)) {
      refused = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                             absl::StrCat(flight_calls_.size(),
                                          " GetFlightRecords calls are in progress (the limit); "
                                          "try again later"));
    } else {
      flight_calls_.insert(call);
    }
  }
  if (!refused.ok()) {
    call->Finish(refused);
    return call;
  }
  const absl::Time deadline =
      std::min(absl::Now() + absl::Seconds(5), absl::FromChrono(ctx->deadline()));
  call->Start(coordinator_->ShardOwnerAddresses(), deadline);
  return call;
}

}  // namespace shardopt
