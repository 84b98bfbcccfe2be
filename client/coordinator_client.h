// Client of the coordinator's gRPC API, with the deadlines documented in
// proto/shardopt.proto, and a KeyValueStore over it for Gloo's rendezvous.
// CoordinatorApi is the part a rank uses (so that it can be faked in tests);
// CoordinatorClient implements it over gRPC. Thread-safe (gRPC stubs are).
#ifndef SHARDOPT_CLIENT_COORDINATOR_CLIENT_H_
#define SHARDOPT_CLIENT_COORDINATOR_CLIENT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/comm/kv_store.h"
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
  virtual ~CoordinatorSession() = default;
  // False once the session is broken or closed.
  virtual bool Send(const v1::HeartbeatRequest& hb) = 0;
  // Blocks until a notice arrives (true) or the session ends (false).
  virtual bool Receive(v1::HeartbeatResponse* notice) = 0;
  virtual void Close() = 0;
};

// What a rank (client/rank_agent.h) and the rendezvous store need of the
// coordinator: the gRPC CoordinatorClient below, or a fake in tests
// (tests/testing/fake_coordinator.h). Implementations are thread-safe.
class CoordinatorApi {
 public:
  virtual ~CoordinatorApi() = default;
  virtual absl::StatusOr<v1::JoinResponse> Join(const v1::JoinRequest& req,
                                                absl::Duration deadline) = 0;
  virtual absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& req) = 0;
  // This rank's session; never null (a session that cannot connect fails its
  // first Send / Receive).
  virtual std::unique_ptr<CoordinatorSession> OpenSession() = 0;
  virtual absl::StatusOr<v1::GetJobResponse> GetJob(absl::Duration deadline = absl::Seconds(5)) = 0;
  virtual absl::Status Abort(const std::string& reason, int rank) = 0;
  virtual absl::Status Finish(int rank) = 0;
  virtual absl::Status ReportFlightRecord(const v1::FlightRecord& record) = 0;
  // The new hyper-parameter version; the checkpoint request number.
  virtual absl::StatusOr<int64_t> SetLearningRate(double lr) = 0;
  virtual absl::StatusOr<int64_t> RequestCheckpoint() = 0;
  // Rendezvous key-value store.
  virtual absl::Status KvSet(const std::string& key, const std::string& value) = 0;
  virtual absl::StatusOr<std::string> KvGet(const std::string& key, absl::Duration wait) = 0;
};

// The coordinator over gRPC.
class CoordinatorClient final : public CoordinatorApi {
 public:
  // Does not connect yet; `token` ("" = none) is sent as a bearer token.
  CoordinatorClient(const std::string& address, std::string token);
  CoordinatorClient(const std::string& address, std::string token,
                    std::shared_ptr<grpc::ChannelCredentials> credentials);

  const std::string& address() const { return address_; }
  absl::StatusOr<v1::JoinResponse> Join(const v1::JoinRequest& req,
                                        absl::Duration deadline) override;
  absl::Status KvSet(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> KvGet(const std::string& key, absl::Duration wait) override;
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& req) override;
  absl::StatusOr<v1::GetJobResponse> GetJob(absl::Duration deadline = absl::Seconds(5)) override;
  absl::StatusOr<v1::GetLayoutResponse> GetLayout();
  absl::StatusOr<v1::GetMemoryResponse> GetMemory();
  // Flight recorder: a failing rank's ring (5 s); every rank's ring and their
  // first divergence (10 s).
  absl::Status ReportFlightRecord(const v1::FlightRecord& record) override;
  absl::StatusOr<v1::GetFlightRecordsResponse> GetFlightRecords();
  absl::StatusOr<int64_t> SetLearningRate(double lr) override;
  absl::Status Abort(const std::string& reason, int rank) override;
  absl::Status Finish(int rank) override;
  absl::StatusOr<int64_t> RequestCheckpoint() override;
  // A live resize of the job to `to_world` ranks (`leave`: the ranks that go
  // in a shrink; empty: the highest).
  // external: a grow whose new ranks the caller starts (shardrun --join).
  absl::StatusOr<v1::ResizeResponse> Resize(int to_world, const std::vector<int>& leave,
                                            bool external = false);
  // Opens this rank's session. Broken connections are detected by keepalive
  // pings (every 5 s, 5 s timeout), so Send/Receive never block forever.
  std::unique_ptr<CoordinatorSession> OpenSession() override;
  // grpc.health.v1.Health/Check of the coordinator: "SERVING" or an error.
  absl::StatusOr<std::string> Health();
  // Until a connection to the coordinator is up, at most `timeout` (retried
  // every 0.1-1 s): ranks started by srun may start before the rank that
  // hosts the coordinator listens. Unavailable naming the address after it.
  absl::Status WaitUntilReachable(absl::Duration timeout);

 private:
  void Prepare(grpc::ClientContext* ctx, absl::Duration deadline) const;
  const std::string address_;
  const std::string token_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

class GrpcKeyValueStore : public KeyValueStore {
 public:
  explicit GrpcKeyValueStore(CoordinatorApi* client) : client_(client) {}
  absl::Status Set(const std::string& key, const std::string& value) override {
    return client_->KvSet(key, value);
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    return client_->KvGet(key, timeout);
  }

 private:
  CoordinatorApi* client_;
};

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_COORDINATOR_CLIENT_H_
