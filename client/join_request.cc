#include "client/join_request.h"

#include <cstdint>

#include "common/param_spec.h"

namespace shardopt {

v1::JoinRequest MakeJoinRequest(const Layout& layout, const JoinRequestInfo& info) {
  v1::JoinRequest join;
  join.set_job_id(info.job_id);
  join.set_rank(info.rank);
  join.set_world_size(layout.world_size());
  join.set_host(info.host);
  join.set_shard_owner_port(info.shard_owner_port);
  join.set_device(info.device);
  join.set_layout_hash(layout.hash());
  join.set_learning_rate(info.learning_rate);
  v1::PlanOptionsProto* plan = join.mutable_plan();
  plan->set_bucket_cap_elements(layout.options().bucket_cap_elements);
  plan->set_alignment_elements(layout.options().alignment_elements);
  plan->set_allow_cut(layout.options().allow_cut);
  for (const ParamSpec& p : layout.params()) {
    v1::ParamInfo* pi = join.add_params();
    pi->set_name(p.name);
    for (int64_t d : p.shape) pi->add_shape(d);
    pi->set_dtype(DTypeName(p.dtype));
    pi->set_trainable(p.trainable);
  }
  return join;
}

}  // namespace shardopt
