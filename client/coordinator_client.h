// Client of the coordinator's gRPC API, with the deadlines documented in
// proto/shardopt.proto, and a KeyValueStore over it for Gloo's rendezvous.
// Thread-safe (gRPC stubs are).
#ifndef SHARDOPT_CLIENT_COORDINATOR_CLIENT_H_
#define SHARDOPT_CLIENT_COORDINATOR_CLIENT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/kv_store.h"
#include <grpcpp/security/credentials.h>

#include "proto/shardopt.grpc.pb.h"

namespace shardopt {

// grpc::Status -> absl::Status, prefixed with `what`; an unreachable server
// becomes one clear sentence.
absl::Status FromGrpc(const grpc::Status& s, const std::string& what);

// Client-side TLS: PEM files. ca_file set -> TLS, verifying the server against
// it; cert_file + key_file too -> mutual TLS.
struct ClientTls {
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
};

// Channel credentials for `tls` (insecure when tls.ca_file is empty).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ClientTls& tls);

// A rank's session (see the Session RPC): heartbeats go out with Send, the
// coordinator's notices come back through Receive. One thread may Send while
// another Receives. Close() ends it; Receive then returns false.
class CoordinatorSession {
 public:
  CoordinatorSession(std::unique_ptr<grpc::ClientContext> ctx,
                     std::unique_ptr<grpc::ClientReaderWriter<v1::HeartbeatRequest, v1::HeartbeatResponse>> stream)
      : ctx_(std::move(ctx)), stream_(std::move(stream)) {}
  bool Send(const v1::HeartbeatRequest& hb) { return stream_->Write(hb); }
  bool Receive(v1::HeartbeatResponse* notice) { return stream_->Read(notice); }
  void Close() { ctx_->TryCancel(); }

 private:
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::HeartbeatRequest, v1::HeartbeatResponse>> stream_;
};

class CoordinatorClient {
 public:
  // Does not connect yet; `token` ("" = none) is sent as a bearer token.
  CoordinatorClient(const std::string& address, std::string token);
  CoordinatorClient(const std::string& address, std::string token,
                    std::shared_ptr<grpc::ChannelCredentials> credentials);

  const std::string& address() const { return address_; }
  absl::StatusOr<v1::JoinResponse> Join(const v1::JoinRequest& req, absl::Duration deadline);
  absl::Status KvSet(const std::string& key, const std::string& value);
  absl::StatusOr<std::string> KvGet(const std::string& key, absl::Duration wait);
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& req);
  absl::StatusOr<v1::GetJobResponse> GetJob(absl::Duration deadline = absl::Seconds(5));
  absl::StatusOr<v1::GetLayoutResponse> GetLayout();
  absl::StatusOr<v1::GetMemoryResponse> GetMemory();
  // Flight recorder: a failing rank's ring (5 s); every rank's ring and their
  // first divergence (10 s).
  absl::Status ReportFlightRecord(const v1::FlightRecord& record);
  absl::StatusOr<v1::GetFlightRecordsResponse> GetFlightRecords();
  absl::StatusOr<int64_t> SetLearningRate(double lr);
  absl::Status Abort(const std::string& reason, int rank);
  absl::Status Finish(int rank);
  absl::StatusOr<int64_t> RequestCheckpoint();
  // Opens this rank's session. Broken connections are detected by keepalive
  // pings (every 5 s, 5 s timeout), so Send/Receive never block forever.
  std::unique_ptr<CoordinatorSession> OpenSession();
  // grpc.health.v1.Health/Check of the coordinator: "SERVING" or an error.
  absl::StatusOr<std::string> Health();

 private:
  void Prepare(grpc::ClientContext* ctx, absl::Duration deadline) const;
  const std::string address_;
  const std::string token_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

class GrpcKeyValueStore : public KeyValueStore {
 public:
  explicit GrpcKeyValueStore(CoordinatorClient* client) : client_(client) {}
  absl::Status Set(const std::string& key, const std::string& value) override {
    return client_->KvSet(key, value);
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    return client_->KvGet(key, timeout);
  }

 private:
  CoordinatorClient* client_;
};

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_COORDINATOR_CLIENT_H_
