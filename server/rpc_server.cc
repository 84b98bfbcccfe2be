#include "server/rpc_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/impl/service_type.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/file_system.h"

namespace shardopt {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  // absl's canonical codes are gRPC's, one to one.
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* ctx, const grpc::Status& s) {
  auto* r = ctx->DefaultReactor();
  r->Finish(s);
  return r;
}

grpc::Status CheckToken(const grpc::CallbackServerContext* ctx, const std::string& token) {
  if (token.empty()) return grpc::Status::OK;
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing bearer token");
  }
  const std::string got(it->second.data(), it->second.size());
  if (got != "Bearer " + token) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "wrong bearer token");
  }
  return grpc::Status::OK;
}

absl::StatusOr<std::string> ReadPemFile(const std::string& path) {
  auto pem = ReadConfigFile(path);
  if (!pem.ok()) return pem.status();
  if (pem->find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "' is not a PEM file"));
  }
  return pem;
}

namespace {

// Adds server reflection to one builder (InitProtoReflectionServerBuilderPlugin
// would add it to every server of the process), or removes it.
class ReflectionOption : public grpc::ServerBuilderOption {
 public:
  explicit ReflectionOption(bool on) : on_(on) {}
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    const std::string name = grpc::reflection::ProtoServerReflectionPlugin().name();
    auto is_reflection = [&](const std::unique_ptr<grpc::ServerBuilderPlugin>& p) {
      return p->name() == name;
    };
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(), is_reflection), plugins->end());
    if (on_) plugins->push_back(std::make_unique<grpc::reflection::ProtoServerReflectionPlugin>());
  }

 private:
  const bool on_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<RpcServer>> RpcServer::Start(
    const RpcServerOptions& options, const std::vector<grpc::Service*>& services) {
  static const bool init = [] {
    grpc::EnableDefaultHealthCheckService(true);
    return true;
  }();
  (void)init;
  std::vector<ManagedService*> managed;
  bool token_required = false;
  for (grpc::Service* s : services) {
    if (auto* m = dynamic_cast<ManagedService*>(s)) {
      managed.push_back(m);
      token_required = token_required || m->RequiresToken();
    }
  }
  const bool reflection = options.reflection && !token_required;
  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default: a second server on a taken port would
  // start and silently share its connections (two jobs' coordinators on one
  // node under srun). A taken port must be an error.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Our clients ping every 5 s, with calls in flight or without
  // (client/coordinator_client.cc): allow it. gRPC's default policy (a ping
  // without calls is a strike, at most one per 5 minutes without data)
  // answers the third with GOAWAY "too_many_pings", and a rank waiting in a
  // rendezvous after an idle spell failed UNAVAILABLE.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 4000);
  builder.SetOption(std::make_unique<ReflectionOption>(reflection));
  int port = 0;
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (!options.tls_cert_file.empty() || !options.tls_key_file.empty()) {
    auto cert = ReadPemFile(options.tls_cert_file);
    if (!cert.ok()) return cert.status();
    auto key = ReadPemFile(options.tls_key_file);
    if (!key.ok()) return key.status();
    grpc::SslServerCredentialsOptions ssl(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    ssl.pem_key_cert_pairs.push_back({*key, *cert});
    if (!options.tls_client_ca_file.empty()) {
      auto ca = ReadPemFile(options.tls_client_ca_file);
      if (!ca.ok()) return ca.status();
      ssl.pem_root_certs = *ca;
      ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
    }
    creds = grpc::SslServerCredentials(ssl);
  }
  builder.AddListeningPort(options.address, creds, &port);
  for (grpc::Service* s : services) builder.RegisterService(s);
  std::unique_ptr<RpcServer> out(new RpcServer);
  out->server_ = builder.BuildAndStart();
  if (!out->server_ || port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.address, " (address in use or invalid?)"));
  }
  out->port_ = port;
  out->managed_ = std::move(managed);
  out->reflection_ = reflection;
  const std::string host = options.address.substr(0, options.address.rfind(':'));
  out->address_ = absl::StrCat(host, ":", port);
  return out;
}

RpcServer::~RpcServer() { Shutdown(); }

void RpcServer::Shutdown(absl::Duration deadline) {
  if (!server_) return;
  for (ManagedService* m : managed_) m->BeginShutdown();
  server_->Shutdown(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(absl::ToInt64Milliseconds(deadline)));
  server_->Wait();
  server_.reset();
}

}  // namespace shardopt
