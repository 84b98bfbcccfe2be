// gRPC adapters (callback API) over Coordinator and over a rank's shard-owner
// information. They translate protobuf to domain types and back; no logic.
#ifndef SHARDOPT_SERVER_COORDINATOR_SERVICE_H_
#define SHARDOPT_SERVER_COORDINATOR_SERVICE_H_

#include <atomic>
#include <set>
#include <functional>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "proto/shardopt.grpc.pb.h"
#include "server/coordinator.h"

namespace shardopt {

class CoordinatorService final : public v1::Coordinator::CallbackService {
 public:
  // `coordinator` must outlive the service. `token`: required bearer token
  // ("" = none). A watchdog thread checks heartbeats every 20 ms.
  CoordinatorService(Coordinator* coordinator, std::string token);
  ~CoordinatorService() override;

  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* ctx, const v1::JoinRequest* req,
                                 v1::JoinResponse* resp) override;
  grpc::ServerUnaryReactor* KvSet(grpc::CallbackServerContext* ctx, const v1::KvSetRequest* req,
                                  v1::KvSetResponse* resp) override;
  grpc::ServerUnaryReactor* KvGet(grpc::CallbackServerContext* ctx, const v1::KvGetRequest* req,
                                  v1::KvGetResponse* resp) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx,
                                      const v1::HeartbeatRequest* req,
                                      v1::HeartbeatResponse* resp) override;
  grpc::ServerUnaryReactor* GetJob(grpc::CallbackServerContext* ctx, const v1::GetJobRequest* req,
                                   v1::GetJobResponse* resp) override;
  grpc::ServerUnaryReactor* GetLayout(grpc::CallbackServerContext* ctx,
                                      const v1::GetLayoutRequest* req,
                                      v1::GetLayoutResponse* resp) override;
  grpc::ServerUnaryReactor* GetMemory(grpc::CallbackServerContext* ctx,
                                      const v1::GetMemoryRequest* req,
                                      v1::GetMemoryResponse* resp) override;
  grpc::ServerUnaryReactor* SetHyperParams(grpc::CallbackServerContext* ctx,
                                           const v1::SetHyperParamsRequest* req,
                                           v1::SetHyperParamsResponse* resp) override;
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* ctx, const v1::AbortRequest* req,
                                  v1::AbortResponse* resp) override;
  grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* ctx, const v1::FinishRequest* req,
                                   v1::FinishResponse* resp) override;
  grpc::ServerUnaryReactor* RequestCheckpoint(grpc::CallbackServerContext* ctx,
                                              const v1::RequestCheckpointRequest* req,
                                              v1::RequestCheckpointResponse* resp) override;
  grpc::ServerBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse>* Session(
      grpc::CallbackServerContext* ctx) override;

  class SessionReactor;

 private:
  void PushToSessions();
  absl::Mutex sessions_mu_;
  std::set<SessionReactor*> sessions_ ABSL_GUARDED_BY(sessions_mu_);
  Coordinator* coordinator_;
  const std::string token_;
  std::atomic<bool> stop_{false};
  std::thread watchdog_;
};

// Serves GetShardInfo from a provider the trainer installs.
class ShardOwnerService final : public v1::ShardOwner::CallbackService {
 public:
  using Provider = std::function<v1::GetShardInfoResponse()>;
  ShardOwnerService(Provider provider, std::string token)
      : provider_(std::move(provider)), token_(std::move(token)) {}
  grpc::ServerUnaryReactor* GetShardInfo(grpc::CallbackServerContext* ctx,
                                         const v1::GetShardInfoRequest* req,
                                         v1::GetShardInfoResponse* resp) override;

 private:
  Provider provider_;
  const std::string token_;
};

// Resident set size of this process, from /proc/self/statm (0 if unknown).
int64_t ProcessRssBytes();

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_COORDINATOR_SERVICE_H_
