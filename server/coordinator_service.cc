#include "server/coordinator_service.h"

#include <unistd.h>

#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/planner.h"
#include "server/rpc_server.h"

namespace shardopt {

namespace {

// Handlers that may wait (Join, KvGet, GetMemory) run on their own thread so
// they never block gRPC's callback threads. Counted, so the service can wait
// for them on destruction.
std::atomic<int> g_in_flight{0};

template <typename Fn>
void RunDetached(Fn fn) {
  ++g_in_flight;
  std::thread([fn = std::move(fn)]() mutable {
    fn();
    --g_in_flight;
  }).detach();
}

grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx, const grpc::Status& s) {
  auto* r = ctx->DefaultReactor();
  r->Finish(s);
  return r;
}

DType ParseDType(const std::string& s, bool* ok) {
  *ok = true;
  if (s == "float32") return DType::kFloat32;
  if (s == "bfloat16") return DType::kBFloat16;
  if (s == "float16") return DType::kFloat16;
  *ok = false;
  return DType::kFloat32;
}

}  // namespace

int64_t ProcessRssBytes() {
  std::ifstream f("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(f >> size >> resident)) return 0;
  return resident * sysconf(_SC_PAGESIZE);
}

namespace {

void FillReply(const HeartbeatReply& r, v1::HeartbeatResponse* resp) {
  resp->set_abort(r.abort);
  resp->set_abort_reason(r.abort_reason);
  resp->set_learning_rate(r.learning_rate);
  resp->set_hyper_params_version(r.hyper_params_version);
  resp->set_checkpoint_request(r.checkpoint_request);
}

}  // namespace

// One rank's session: reads its heartbeats, answers the first, and pushes the
// job's notice whenever it changes. At most one write is outstanding; a newer
// notice replaces one that has not been written yet.
class CoordinatorService::SessionReactor
    : public grpc::ServerBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse> {
 public:
  SessionReactor(CoordinatorService* service, grpc::Status auth) : service_(service) {
    if (!auth.ok()) {
      done_reading_ = true;
      Finish(auth);
      return;
    }
    {
      absl::MutexLock l(&service_->sessions_mu_);
      service_->sessions_.insert(this);
      registered_ = true;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the rank closed its side, or the connection broke
      Close(grpc::Status::OK);
      return;
    }
    HeartbeatInfo info{request_.rank(), request_.step(), request_.loss(), request_.samples_per_s(),
                       request_.progress()};
    auto r = service_->coordinator_->Heartbeat(info);
    if (!r.ok()) {
      Close(ToGrpc(r.status()));
      return;
    }
    if (first_) {
      first_ = false;
      Push(*r);
    }
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
    if (registered_) {
      absl::MutexLock l(&service_->sessions_mu_);
      service_->sessions_.erase(this);
    }
    delete this;
  }

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
  return new SessionReactor(this, CheckToken(ctx, token_));
}

void CoordinatorService::PushToSessions() {
  const HeartbeatReply notice = coordinator_->Notice();
  absl::MutexLock l(&sessions_mu_);
  for (SessionReactor* s : sessions_) s->Push(notice);
}

CoordinatorService::CoordinatorService(Coordinator* coordinator, std::string token)
    : coordinator_(coordinator), token_(std::move(token)) {
  coordinator_->SetListener([this] { PushToSessions(); });
  watchdog_ = std::thread([this] {
    while (!stop_.load()) {
      coordinator_->CheckHeartbeats();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
}

CoordinatorService::~CoordinatorService() {
  coordinator_->SetListener(nullptr);
  stop_ = true;
  watchdog_.join();
  for (int i = 0; i < 7000 && g_in_flight.load() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
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
  auto* reactor = ctx->DefaultReactor();
  // Wait for the other ranks at most until the client's deadline (<= 10 min).
  const absl::Duration wait = std::min(
      absl::Minutes(10), absl::FromChrono(ctx->deadline()) - absl::Now() - absl::Milliseconds(200));
  Coordinator* c = coordinator_;
  RunDetached([c, info = std::move(info), wait, reactor, resp] {
    auto r = c->Join(info, std::max(wait, absl::ZeroDuration()));
    if (r.ok()) {
      resp->set_layout_hash(r->layout_hash);
      for (const auto& p : r->peers) resp->add_peers(p);
    }
    reactor->Finish(ToGrpc(r.status()));
  });
  return reactor;
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
  auto* reactor = ctx->DefaultReactor();
  Coordinator* c = coordinator_;
  RunDetached([c, key = req->key(), wait = absl::Milliseconds(req->wait_ms()), reactor, resp] {
    auto v = c->KvGet(key, wait);
    if (v.ok()) resp->set_value(*v);
    reactor->Finish(ToGrpc(v.status()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* CoordinatorService::Heartbeat(grpc::CallbackServerContext* ctx,
                                                        const v1::HeartbeatRequest* req,
                                                        v1::HeartbeatResponse* resp) {
  if (auto s = CheckToken(ctx, token_); !s.ok()) return Done(ctx, s);
  HeartbeatInfo info{req->rank(), req->step(), req->loss(), req->samples_per_s(), req->progress()};
  auto r = coordinator_->Heartbeat(info);
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
  for (const RankState& r : j.ranks) {
    v1::RankStatus* rs = resp->add_ranks();
    rs->set_rank(r.rank);
    rs->set_address(r.address);
    rs->set_step(r.step);
    rs->set_seconds_since_heartbeat(r.joined ? absl::ToDoubleSeconds(j.now - r.last_heartbeat)
                                             : -1);
    rs->set_alive(r.joined && j.now - r.last_heartbeat <=
                                  coordinator_->options().heartbeat_timeout);
    rs->set_loss(r.loss);
    rs->set_samples_per_s(r.samples_per_s);
    rs->set_progress(r.progress);
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
    row->add_params(p.length == pl.numel
                        ? name
                        : absl::StrCat(name, "[", p.param_offset, ":", p.param_offset + p.length,
                                       "]"));
  }
  return Done(ctx, grpc::Status::OK);
}

grpc::ServerUnaryReactor* CoordinatorService::GetMemory(grpc::CallbackServerContext* ctx,
                                                        const v1::GetMemoryRequest*,
                                                        v1::GetMemoryResponse* resp) {
  if (auto s = CheckToken(ctx, token_); !s.ok()) return Done(ctx, s);
  auto* reactor = ctx->DefaultReactor();
  RunDetached([addresses = coordinator_->ShardOwnerAddresses(), token = token_, reactor, resp] {
    for (size_t r = 0; r < addresses.size(); ++r) {
      v1::RankMemory* m = resp->add_ranks();
      m->set_rank(static_cast<int>(r));
      if (addresses[r].empty()) {
        m->set_error("not joined");
        continue;
      }
      auto stub = v1::ShardOwner::NewStub(
          grpc::CreateChannel(addresses[r], grpc::InsecureChannelCredentials()));
      grpc::ClientContext cctx;
      cctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      if (!token.empty()) cctx.AddMetadata("authorization", "Bearer " + token);
      v1::GetShardInfoResponse info;
      grpc::Status s = stub->GetShardInfo(&cctx, v1::GetShardInfoRequest(), &info);
      if (!s.ok()) {
        m->set_error(absl::StrCat("shard owner at ", addresses[r], ": ", s.error_message()));
        continue;
      }
      m->set_master_bytes(info.master_bytes());
      m->set_state_bytes(info.state_bytes());
      m->set_grad_bytes(info.grad_bytes());
      m->set_param_bytes(info.param_bytes());
      m->set_rss_bytes(info.rss_bytes());
    }
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
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

grpc::ServerUnaryReactor* ShardOwnerService::GetShardInfo(grpc::CallbackServerContext* ctx,
                                                          const v1::GetShardInfoRequest*,
                                                          v1::GetShardInfoResponse* resp) {
  if (auto s = CheckToken(ctx, token_); !s.ok()) return Done(ctx, s);
  *resp = provider_();
  resp->set_rss_bytes(ProcessRssBytes());
  return Done(ctx, grpc::Status::OK);
}

}  // namespace shardopt
