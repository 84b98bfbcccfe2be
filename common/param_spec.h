// Description of one model parameter, as the planner and checkpoints see it.
#ifndef SHARDOPT_COMMON_PARAM_SPEC_H_
#define SHARDOPT_COMMON_PARAM_SPEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"

namespace shardopt {

// One named parameter tensor in registration order (the order of
// `module->named_parameters()`). Frozen parameters (trainable == false) are
// listed so that indices match the model, but the planner gives them no space.
struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::kFloat32;
  bool trainable = true;
};

}  // namespace shardopt

#endif  // SHARDOPT_COMMON_PARAM_SPEC_H_
