// gRPC plumbing shared by the coordinator and shard-owner services: a server
// with health checking and reflection, bearer-token checks, and the one place
// where absl::Status becomes grpc::Status.
//
// Access policy. A service given a token (CheckToken) refuses every one of its
// RPCs without it (UNAUTHENTICATED). Two services are gRPC's own:
//   grpc.health.v1.Health          always open: probes (load balancers,
//                                  Kubernetes) carry no token, and it tells
//                                  nothing but SERVING / NOT_SERVING.
//   grpc.reflection.v1alpha.ServerReflection
//                                  served only when no service on the server
//                                  requires a token (it cannot check one, and
//                                  it describes every method): on a server
//                                  with a token it is absent (UNIMPLEMENTED).
#ifndef SHARDOPT_SERVER_RPC_SERVER_H_
#define SHARDOPT_SERVER_RPC_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace shardopt {

grpc::Status ToGrpc(const absl::Status& s);

// Ends a unary callback RPC with `s` (its default reactor).
grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* ctx, const grpc::Status& s);

// Checks "authorization: Bearer <token>" when `token` is non-empty.
grpc::Status CheckToken(const grpc::CallbackServerContext* ctx, const std::string& token);

// What RpcServer needs to know of the services it serves; services given to
// RpcServer::Start that implement it take part in the access policy and in
// shutdown.
class ManagedService {
 public:
  virtual ~ManagedService() = default;
  // Whether the service's RPCs require a bearer token.
  virtual bool RequiresToken() const = 0;
  // Called by RpcServer::Shutdown before gRPC's: end waiting calls now (gRPC
  // waits for every call to finish). Must be idempotent.
  virtual void BeginShutdown() {}
};

struct RpcServerOptions {
  // host:port; port 0 lets the OS choose. Loopback unless told otherwise.
  std::string address = "127.0.0.1:0";
  // TLS: PEM files. Both set -> TLS; client_ca_file set too -> mutual TLS
  // (clients must present a certificate signed by that CA).
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  // Server reflection, when no service requires a token (see above).
  bool reflection = true;
};

// Reads a whole (PEM) file; NotFound naming it otherwise.
absl::StatusOr<std::string> ReadPemFile(const std::string& path);

class RpcServer {
 public:
  // Starts serving `services` (not owned; must outlive the server) plus
  // grpc.health.v1.Health and (see the access policy above) server reflection.
  static absl::StatusOr<std::unique_ptr<RpcServer>> Start(
      const RpcServerOptions& options, const std::vector<grpc::Service*>& services);
  ~RpcServer();
  int port() const { return port_; }
  std::string address() const { return address_; }
  // Stops accepting calls: ManagedService::BeginShutdown first (waiting calls
  // end at once), then in-flight calls get `deadline` to finish.
  void Shutdown(absl::Duration deadline = absl::Seconds(2));
  bool serves_reflection() const { return reflection_; }

 private:
  std::unique_ptr<grpc::Server> server_;
  std::vector<ManagedService*> managed_;
  bool reflection_ = false;
  int port_ = 0;
  std::string address_;
};

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_RPC_SERVER_H_
