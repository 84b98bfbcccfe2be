// gRPC plumbing shared by the coordinator and shard-owner services: a server
// with health checking and reflection, bearer-token checks, and the one place
// where absl::Status becomes grpc::Status.
#ifndef SHARDOPT_SERVER_RPC_SERVER_H_
#define SHARDOPT_SERVER_RPC_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace shardopt {

grpc::Status ToGrpc(const absl::Status& s);

// Checks "authorization: Bearer <token>" when `token` is non-empty.
grpc::Status CheckToken(const grpc::CallbackServerContext* ctx, const std::string& token);

struct RpcServerOptions {
  // host:port; port 0 lets the OS choose. Loopback unless told otherwise.
  std::string address = "127.0.0.1:0";
  // TLS: PEM files. Both set -> TLS; client_ca_file set too -> mutual TLS
  // (clients must present a certificate signed by that CA).
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
};

// Reads a whole (PEM) file; NotFound naming it otherwise.
absl::StatusOr<std::string> ReadPemFile(const std::string& path);

class RpcServer {
 public:
  // Starts serving `services` (not owned; must outlive the server) plus
  // grpc.health.v1.Health and server reflection.
  static absl::StatusOr<std::unique_ptr<RpcServer>> Start(const RpcServerOptions& options,
                                                          const std::vector<grpc::Service*>& services);
  ~RpcServer();
  int port() const { return port_; }
  std::string address() const { return address_; }
  // Stops accepting calls; in-flight calls get `deadline` to finish.
  void Shutdown(absl::Duration deadline = absl::Seconds(2));

 private:
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::string address_;
};

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_RPC_SERVER_H_
