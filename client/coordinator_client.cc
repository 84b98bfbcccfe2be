#include "client/coordinator_client.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <condition_variable>
#include <fstream>
#include <sstream>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/file_system.h"

namespace shardopt {

absl::Status FromGrpc(const grpc::Status& s, const std::string& what) {
  if (s.ok()) return absl::OkStatus();
  const auto code = static_cast<absl::StatusCode>(s.error_code());
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
    return absl::UnavailableError(
        absl::StrCat(what, ": cannot reach the coordinator (", s.error_message(), ")"));
  }
  return absl::Status(code, absl::StrCat(what, ": ", s.error_message()));
}

CoordinatorClient::CoordinatorClient(const std::string& address, std::string token)
    : CoordinatorClient(address, std::move(token), grpc::InsecureChannelCredentials()) {}

namespace {
grpc::ChannelArguments KeepaliveArgs() {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // A coordinator not listening yet (srun starts every task at once) is
  // retried soon, not after gRPC's default backoff of up to two minutes.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return args;
}
}  // namespace

CoordinatorClient::CoordinatorClient(const std::string& address, std::string token,
                                     std::shared_ptr<grpc::ChannelCredentials> credentials)
    : address_(address),
      token_(std::move(token)),
      channel_(grpc::CreateCustomChannel(address, credentials, KeepaliveArgs())),
      stub_(v1::Coordinator::NewStub(channel_)) {}

namespace {
// The Session RPC's stream.
class GrpcCoordinatorSession final : public CoordinatorSession {
 public:
  GrpcCoordinatorSession(
      std::unique_ptr<grpc::ClientContext> ctx,
      std::unique_ptr<grpc::ClientReaderWriter<v1::HeartbeatRequest, v1::HeartbeatResponse>> stream)
      : ctx_(std::move(ctx)), stream_(std::move(stream)) {}
  bool Send(const v1::HeartbeatRequest& hb) override { return stream_->Write(hb); }
  bool Receive(v1::HeartbeatResponse* notice) override { return stream_->Read(notice); }
  void Close() override { ctx_->TryCancel(); }

 private:
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::HeartbeatRequest, v1::HeartbeatResponse>> stream_;
};
}  // namespace

absl::Status CoordinatorClient::WaitUntilReachable(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    const grpc_connectivity_state st = channel_->GetState(/*try_to_connect=*/true);
    if (st == GRPC_CHANNEL_READY) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (now >= deadline) break;
    // Wakes on any state change (a failed attempt too), at most 1 s later.
    channel_->WaitForStateChange(st,
                                 absl::ToChronoTime(std::min(deadline, now + absl::Seconds(1))));
  }
  return absl::UnavailableError(absl::StrCat("cannot reach the coordinator at ", address_,
                                             " within ", absl::FormatDuration(timeout)));
}

std::unique_ptr<CoordinatorSession> CoordinatorClient::OpenSession() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  if (!token_.empty()) ctx->AddMetadata("authorization", "Bearer " + token_);
  auto stream = stub_->Session(ctx.get());
  return std::make_unique<GrpcCoordinatorSession>(std::move(ctx), std::move(stream));
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ClientTls& tls) {
  if (tls.ca_file.empty()) {
    if (!tls.cert_file.empty() || !tls.key_file.empty()) {
      return absl::InvalidArgumentError("a client certificate needs --tls-ca as well");
    }
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions o;
  auto ca = ReadConfigFile(tls.ca_file);
  if (!ca.ok()) return ca.status();
  o.pem_root_certs = *ca;
  if (!tls.cert_file.empty() || !tls.key_file.empty()) {
    auto cert = ReadConfigFile(tls.cert_file);
    if (!cert.ok()) return cert.status();
    auto key = ReadConfigFile(tls.key_file);
    if (!key.ok()) return key.status();
    o.pem_cert_chain = *cert;
    o.pem_private_key = *key;
  }
  return grpc::SslCredentials(o);
}

void CoordinatorClient::Prepare(grpc::ClientContext* ctx, absl::Duration deadline) const {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(absl::ToInt64Milliseconds(deadline)));
  if (!token_.empty()) ctx->AddMetadata("authorization", "Bearer " + token_);
}

absl::StatusOr<v1::JoinResponse> CoordinatorClient::Join(const v1::JoinRequest& req,
                                                         absl::Duration deadline) {
  grpc::ClientContext ctx;
  Prepare(&ctx, deadline);
  v1::JoinResponse resp;
  grpc::Status s = stub_->Join(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s, "join");
  return resp;
}

absl::Status CoordinatorClient::KvSet(const std::string& key, const std::string& value) {
  grpc::ClientContext ctx;
  Prepare(&ctx, absl::Seconds(10));
  v1::KvSetRequest req;
  req.set_key(key);
  req.set_value(value);
  v1::KvSetResponse resp;
  return FromGrpc(stub_->KvSet(&ctx, req, &resp), "rendezvous set");
}

absl::StatusOr<std::string> CoordinatorClient::KvGet(const std::string& key, absl::Duration wait) {
  grpc::ClientContext ctx;
  Prepare(&ctx, wait + absl::Seconds(5));
  v1::KvGetRequest req;
  req.set_key(key);
  req.set_wait_ms(absl::ToInt64Milliseconds(wait));
  v1::KvGetResponse resp;
  grpc::Status s = stub_->KvGet(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s, "rendezvous get");
  return resp.value();
}

absl::StatusOr<v1::HeartbeatResponse> CoordinatorClient::Heartbeat(
    const v1::HeartbeatRequest& req) {
  grpc::ClientContext ctx;
  Prepare(&ctx, absl::Seconds(5));
  v1::HeartbeatResponse resp;
  grpc::Status s = stub_->Heartbeat(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s, "heartbeat");
  return resp;
}

absl::StatusOr<v1::GetJobResponse> CoordinatorClient::GetJob(absl::Duration deadline) {
  grpc::ClientContext ctx;
  Prepare(&ctx, deadline);
  v1::GetJobResponse resp;
  grpc::Status s = stub_->GetJob(&ctx, v1::GetJobRequest(), &resp);
  if (!s.ok()) return FromGrpc(s, "status");
  return resp;
}

absl::StatusOr<v1::GetLayoutResponse> CoordinatorClient::GetLayout() {
  grpc::ClientContext ctx;
  Prepare(&ctx, absl::Seconds(5));
  v1::GetLayoutResponse resp;
  grpc::Status s = stub_->GetLayout(&ctx, v1::GetLayoutRequest(), &resp);
  if (!s.ok()) return FromGrpc(s, "layout");
  return resp;
}

absl::StatusOr<v1::GetMemoryResponse> CoordinatorClient::GetMemory() {
  grpc::ClientContext ctx;
  Prepare(&ctx, absl::Seconds(10));
  v1::GetMemoryResponse resp;
  grpc::Status s = stub_->GetMemory(&ctx, v1::GetMemoryRequest(), &resp);
  if (!s.ok()) return FromGrpc(s, "memory");
  return resp;
}

absl::Status CoordinatorClient::ReportFlightRecord(const v1::FlightRecord& record) {
  grpc::ClientContext ctx;
  Prepare(&ctx, absl::Seconds(5));
  v1::ReportFlightRecordRequest req;
  *req.mutable_record() = record;
  v1::ReportFlightRecordResponse resp;
  grpc::Status s = stub_->ReportFlightRecord(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s, "flight record");
  return absl::OkStatus();
}

absl::StatusOr<v1::GetFlightRecordsResponse> CoordinatorClient::GetFlightRecords() {
  grpc::ClientContext ctx;
  Prepare(&ctx, absl::Seconds(10));
  v1::GetFlightRecordsResponse resp;
  grpc::Status s = stub_->GetFlightRecords(&ctx, v1::GetFlightRecordsRequest(), &resp);
  if (!s.ok()) return FromGrpc(s, "flight-recorder");
  return resp;
}

absl::StatusOr<int64_t> CoordinatorClient::SetLearningRate(double lr) {
  grpc::ClientContext ctx;
  Prepare(&ctx, absl::Seconds(5));
  v1::SetHyperParamsRequest req;
  req.set_learning_rate(lr);
  v1::SetHyperParamsResponse resp;
  grpc::Status s = stub_->SetHyperParams(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s, "set-lr");
  return resp.version();
}

absl::Status CoordinatorClient::Abort(const std::string& reason, int rank) {
  grpc::ClientContext ctx;
  Prepare(&ctx, absl::Seconds(5));
  v1::AbortRequest req;
  req.set_reason(reason);
  req.set_rank(rank);
  v1::AbortResponse resp;
  return FromGrpc(stub_->Abort(&ctx, req, &resp), "abort");
}

absl::Status CoordinatorClient::Finish(int rank) {
  grpc::ClientContext ctx;
  Prepare(&ctx, absl::Seconds(5));
  v1::FinishRequest req;
  req.set_rank(rank);
  v1::FinishResponse resp;
  return FromGrpc(stub_->Finish(&ctx, req, &resp), "finish");
}

absl::StatusOr<int64_t> CoordinatorClient::RequestCheckpoint() {
  grpc::ClientContext ctx;
  Prepare(&ctx, absl::Seconds(5));
  v1::RequestCheckpointResponse resp;
  grpc::Status s = stub_->RequestCheckpoint(&ctx, v1::RequestCheckpointRequest(), &resp);
  if (!s.ok()) return FromGrpc(s, "checkpoint");
  return resp.request();
}

absl::StatusOr<v1::ResizeResponse> CoordinatorClient::Resize(int to_world,
                                                             const std::vector<int>& leave,
                                                             bool external) {
  grpc::ClientContext ctx;
  Prepare(&ctx, absl::Seconds(5));
  v1::ResizeRequest req;
  req.set_to_world(to_world);
  for (int r : leave) req.add_leave(r);
  req.set_external(external);
  v1::ResizeResponse resp;
  grpc::Status s = stub_->Resize(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s, "resize");
  return resp;
}

absl::StatusOr<std::string> CoordinatorClient::Health() {
  // grpc.health.v1 without its generated code: the request is an empty
  // message (service ""), the response field 1 is the enum status.
  grpc::ClientContext ctx;
  Prepare(&ctx, absl::Seconds(5));
  grpc::ByteBuffer request_buf;  // empty HealthCheckRequest
  grpc::Slice empty("");
  request_buf = grpc::ByteBuffer(&empty, 1);
  grpc::GenericStub generic(channel_);
  grpc::ByteBuffer response_buf;
  grpc::Status status;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request_buf,
                    &response_buf, [&](grpc::Status s) {
                      std::lock_guard<std::mutex> l(mu);
                      status = std::move(s);
                      done = true;
                      cv.notify_one();
                    });
  std::unique_lock<std::mutex> l(mu);
  cv.wait(l, [&] { return done; });  // bounded by the context's deadline
  if (!status.ok()) return FromGrpc(status, "health");
  std::vector<grpc::Slice> slices;
  (void)response_buf.Dump(&slices);
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  // Field 1, varint: tag 0x08 then the value (1 = SERVING, 2 = NOT_SERVING).
  if (bytes.size() >= 2 && bytes[0] == 0x08) {
    return bytes[1] == 1 ? std::string("SERVING")
                         : absl::StrCat("NOT_SERVING(", int(bytes[1]), ")");
  }
  return std::string("UNKNOWN");
}

}  // namespace shardopt
