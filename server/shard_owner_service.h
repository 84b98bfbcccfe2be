// The shard owner's gRPC face (service ShardOwner in proto/shardopt.proto):
// what this rank owns, the bytes it holds by role and its step
// (GetShardInfo, which the coordinator's GetMemory fans out to), and its
// flight recorder's ring (GetFlightRecord).
//
// It reads the ShardOwner (server/shard_owner.h) directly for what the owner
// knows (owned elements, optimizer kind, its memory), and asks small
// callbacks for what only the trainer knows: the current step, the bytes of
// the whole rank (flat parameter and gradient buffers too) and the flight
// record. Each RPC is answered at once on gRPC's callback thread; the
// callbacks must be thread-safe and quick.
#ifndef SHARDOPT_SERVER_SHARD_OWNER_SERVICE_H_
#define SHARDOPT_SERVER_SHARD_OWNER_SERVICE_H_

#include <cstdint>
#include <functional>
#include <string>

#include "proto/shardopt.grpc.pb.h"
#include "server/rpc_server.h"
#include "server/shard_owner.h"

namespace shardopt {

class ShardOwnerService final : public v1::ShardOwner::CallbackService, public ManagedService {
 public:
  // What the service reports of one rank.
  struct Sources {
    int rank = 0;
    // Owned elements and optimizer kind. Must outlive the service.
    const ShardOwner* owner = nullptr;
    // The rank's bytes by role (ShardedOptimizer::memory(): the owner's
    // state plus the flat buffers). Null: owner->memory().
    std::function<MemoryReport()> memory;
    // The last finished step. Null: 0.
    std::function<int64_t()> step;
    // This rank's flight record. Null: GetFlightRecord is UNIMPLEMENTED.
    std::function<v1::FlightRecord()> flight;
  };
  // `token`: required bearer token ("" = none).
  ShardOwnerService(Sources sources, std::string token);

  // A service answering from `provider` (tests, and ranks without a
  // ShardOwner); rss_bytes is filled in by the service.
  using Provider = std::function<v1::GetShardInfoResponse()>;
  using FlightProvider = std::function<v1::FlightRecord()>;
  ShardOwnerService(Provider provider, std::string token, FlightProvider flight = nullptr)
      : provider_(std::move(provider)), token_(std::move(token)), flight_(std::move(flight)) {}

  bool RequiresToken() const override { return !token_.empty(); }
  grpc::ServerUnaryReactor* GetShardInfo(grpc::CallbackServerContext* ctx,
                                         const v1::GetShardInfoRequest* req,
                                         v1::GetShardInfoResponse* resp) override;
  grpc::ServerUnaryReactor* GetFlightRecord(grpc::CallbackServerContext* ctx,
                                            const v1::GetFlightRecordRequest* req,
                                            v1::FlightRecord* resp) override;

 private:
  Provider provider_;
  const std::string token_;
  FlightProvider flight_;
};

// GetShardInfo's answer for `sources` (without rss_bytes).
v1::GetShardInfoResponse ShardInfoOf(const ShardOwnerService::Sources& sources);

// Resident set size of this process, from /proc/self/statm (0 if unknown).
int64_t ProcessRssBytes();

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_SHARD_OWNER_SERVICE_H_
