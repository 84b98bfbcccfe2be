// gRPC adapters (callback API) over Coordinator and over a rank's shard-owner
// information. They translate protobuf to domain types and back; no logic.
//
// No RPC holds a thread while it waits: a Join or KvGet waiting for other
// ranks is a pending callback in the Coordinator (completed by whatever
// settles it, or by the watchdog at its deadline, or by shutdown), a
// GetMemory asks every shard owner at once with asynchronous calls, a
// session is a reactor. Bounds: one waiting Join per rank, at most
// CoordinatorOptions::max_kv_waiters waiting KvGets and kMaxMemoryCalls
// GetMemory calls at once (more: RESOURCE_EXHAUSTED).
#ifndef SHARDOPT_SERVER_COORDINATOR_SERVICE_H_
#define SHARDOPT_SERVER_COORDINATOR_SERVICE_H_

#include <atomic>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "proto/shardopt.grpc.pb.h"
#include "server/coordinator.h"
#include "server/flight_records.h"
#include "server/rpc_server.h"

namespace shardopt {

class CoordinatorService final : public v1::Coordinator::CallbackService, public ManagedService {
 public:
  static constexpr int kMaxMemoryCalls = 32;

  // `coordinator` must outlive the service. `token`: required bearer token
  // ("" = none). A watchdog thread checks heartbeats and expires waits every
  // 20 ms.
  CoordinatorService(Coordinator* coordinator, std::string token);
  // BeginShutdown(), then waits (at most 10 s) for calls still running;
  // the server should have been shut down first.
  ~CoordinatorService() override;

  bool RequiresToken() const override { return !token_.empty(); }
  // How the coordinator connects to the ranks' shard-owner services (layout
  // and memory queries): insecure by default; TLS credentials when the job
  // serves them over TLS (shardrun --tls-cert). Call before serving.
  void SetOwnerCredentials(std::shared_ptr<grpc::ChannelCredentials> credentials);
  // Shuts the coordinator down (waiting Join/KvGet calls end at once with
  // UNAVAILABLE "coordinator shutting down", later ones are refused so),
  // ends every session the same way and cancels GetMemory's calls to the
  // shard owners. RpcServer::Shutdown calls it; idempotent.
  void BeginShutdown() override;
  // Calls (unary ones and sessions) that have not completed yet.
  int calls_in_flight();

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
  grpc::ServerUnaryReactor* Resize(grpc::CallbackServerContext* ctx, const v1::ResizeRequest* req,
                                   v1::ResizeResponse* resp) override;
  grpc::ServerBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse>* Session(
      grpc::CallbackServerContext* ctx) override;
  // Flight recorder: a rank's ring, sent when the job fails; the rings of
  // every rank (asked of the shard owners at once, like GetMemory; a rank
  // that does not answer is represented by the ring it reported, if any) and
  // their first divergence. At most kMaxMemoryCalls GetFlightRecords at once.
  grpc::ServerUnaryReactor* ReportFlightRecord(grpc::CallbackServerContext* ctx,
                                               const v1::ReportFlightRecordRequest* req,
                                               v1::ReportFlightRecordResponse* resp) override;
  grpc::ServerUnaryReactor* GetFlightRecords(grpc::CallbackServerContext* ctx,
                                             const v1::GetFlightRecordsRequest* req,
                                             v1::GetFlightRecordsResponse* resp) override;
  // The rings ranks reported (shardrun prints their divergence when a job fails).
  const FlightRecords& flight_records() const { return flight_records_; }

  class SessionReactor;
  class WaitingCall;
  class FanOutCall;
  class MemoryCall;
  class FlightCall;

 private:
  void PushToSessions();
  void CallStarted();
  void CallDone();
  // A cached stub for a shard owner's address.
  v1::ShardOwner::Stub* OwnerStub(const std::string& address);

  Coordinator* coordinator_;
  const std::string token_;
  absl::Mutex sessions_mu_;
  std::set<SessionReactor*> sessions_ ABSL_GUARDED_BY(sessions_mu_);
  absl::Mutex calls_mu_;
  int calls_ ABSL_GUARDED_BY(calls_mu_) = 0;
  std::set<MemoryCall*> memory_calls_ ABSL_GUARDED_BY(calls_mu_);
  std::set<FlightCall*> flight_calls_ ABSL_GUARDED_BY(calls_mu_);
  FlightRecords flight_records_;
  absl::Mutex stubs_mu_;
  std::shared_ptr<grpc::ChannelCredentials> owner_credentials_ ABSL_GUARDED_BY(stubs_mu_);
  std::map<std::string, std::unique_ptr<v1::ShardOwner::Stub>> owner_stubs_
      ABSL_GUARDED_BY(stubs_mu_);
  // Set once; read under sessions_mu_ / calls_mu_ where registration races.
  std::atomic<bool> shutting_down_{false};
  std::atomic<bool> stop_{false};
  std::thread watchdog_;
};

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_COORDINATOR_SERVICE_H_
