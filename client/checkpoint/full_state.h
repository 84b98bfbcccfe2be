// The whole optimizer state in memory, on every rank: what torch.optim's
// state_dict() holds (Python's ShardedOptimizer.state_dict/load_state_dict).
// Collective; O(model) memory on every rank, like a consolidated checkpoint.
#ifndef SHARDOPT_CLIENT_CHECKPOINT_FULL_STATE_H_
#define SHARDOPT_CLIENT_CHECKPOINT_FULL_STATE_H_

#include <torch/types.h>

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "client/sharded_optimizer.h"

namespace shardopt {

struct FullState {
  int64_t step = 0;
  // Trainable parameter name -> {"param": fp32 values (the master copy for
  // bf16 models), "exp_avg": ..., ...}, each shaped like the parameter.
  std::map<std::string, std::map<std::string, torch::Tensor>> tensors;
  // Parameters whose update count (torch.optim's state['step']) is not
  // `step`: they missed steps without a gradient (0: never updated).
  std::map<std::string, int64_t> param_steps;
};

// Collective: all-gathers every owned slice.
absl::StatusOr<FullState> GatherFullState(ShardedOptimizer& optimizer);

// Collective: each rank takes its owned pieces of the optimizer state from
// `state` (every trainable parameter must have every state array of this
// optimizer, of its shape; "param" entries are ignored: parameters stay
// those of the model) and sets the step. Errors name the parameter; every
// rank fails together and nothing is changed then.
absl::Status LoadFullState(ShardedOptimizer& optimizer, const FullState& state);

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_CHECKPOINT_FULL_STATE_H_
