#include "server/shard_owner_service.h"

#include <unistd.h>

#include <fstream>
#include <utility>

namespace shardopt {

namespace {

grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx, const grpc::Status& s) {
  return FinishUnary(ctx, s);
}

}  // namespace

int64_t ProcessRssBytes() {
  std::ifstream f("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(f >> size >> resident)) return 0;
  return resident * sysconf(_SC_PAGESIZE);
}

v1::GetShardInfoResponse ShardInfoOf(const ShardOwnerService::Sources& sources) {
  v1::GetShardInfoResponse r;
  r.set_rank(sources.rank);
  r.set_step(sources.step ? sources.step() : 0);
  MemoryReport m;
  if (sources.memory) {
    m = sources.memory();
  } else if (sources.owner != nullptr) {
    m = sources.owner->memory();
  }
  if (sources.owner != nullptr) {
    r.set_owned_elements(sources.owner->owned_elements());
    r.set_optimizer(OptimizerKindName(sources.owner->kind()));
  }
  r.set_master_bytes(m.master_bytes);
  r.set_state_bytes(m.state_bytes);
  r.set_grad_bytes(m.grad_bytes);
  r.set_param_bytes(m.param_bytes);
  return r;
}

ShardOwnerService::ShardOwnerService(Sources sources, std::string token)
    : token_(std::move(token)), flight_(sources.flight) {
  provider_ = [sources = std::move(sources)] { return ShardInfoOf(sources); };
}

grpc::ServerUnaryReactor* ShardOwnerService::GetFlightRecord(grpc::CallbackServerContext* ctx,
                                                             const v1::GetFlightRecordRequest*,
                                                             v1::FlightRecord* resp) {
  if (auto s = CheckToken(ctx, token_); !s.ok()) return Done(ctx, s);
  if (!flight_) {
    return Done(
        ctx, grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "this rank keeps no flight recorder"));
  }
  *resp = flight_();
  return Done(ctx, grpc::Status::OK);
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
