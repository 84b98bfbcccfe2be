// The JoinRequest a rank sends the coordinator (v1::Coordinator.Join): who it
// is and where its shard owner listens, plus the parameters, planner options
// and layout hash the coordinator checks every rank agrees on.
//
// Needs only the layout and the proto, so that tests, benchmarks and
// simulated ranks describe a real layout the same way RankAgent does.
#ifndef SHARDOPT_CLIENT_JOIN_REQUEST_H_
#define SHARDOPT_CLIENT_JOIN_REQUEST_H_

#include <string>

#include "common/layout.h"
#include "proto/shardopt.pb.h"

namespace shardopt {

// What a JoinRequest says besides the layout (the coordinator's JoinInfo,
// server/coordinator.h, is the request as it receives it).
struct JoinRequestInfo {
  std::string job_id = "job";
  int rank = 0;
  std::string host = "127.0.0.1";  // where the shard-owner service listens
  int shard_owner_port = 0;        // 0: no shard-owner service
  std::string device = "cpu";      // "cpu" or "cuda:N"
  double learning_rate = 0;        // 0: not reported
};

// The JoinRequest of rank info.rank for `layout`: job, rank, world size
// (layout.world_size()), shard-owner address, device, learning rate, every
// parameter (name, shape, dtype, trainable), the plan options and the layout
// hash.
v1::JoinRequest MakeJoinRequest(const Layout& layout, const JoinRequestInfo& info);

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_JOIN_REQUEST_H_
