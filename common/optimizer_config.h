// Hyper-parameters of the optimizers shardopt implements. The semantics are
// those of torch.optim of the same name (PyTorch 1.13), including defaults.
#ifndef SHARDOPT_COMMON_OPTIMIZER_CONFIG_H_
#define SHARDOPT_COMMON_OPTIMIZER_CONFIG_H_

#include <cstdint>

#include "absl/status/status.h"

namespace shardopt {

enum class OptimizerKind { kAdam, kAdamW, kSgd };
const char* OptimizerKindName(OptimizerKind kind);

// torch.optim.Adam (decoupled_weight_decay = false: weight decay is an L2 term
// added to the gradient) and torch.optim.AdamW (decoupled_weight_decay = true:
// parameters are multiplied by 1 - lr * weight_decay before the update).
// amsgrad is not supported.
struct AdamConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // AdamW's torch default is 1e-2: see AdamWConfig()
  bool decoupled_weight_decay = false;
  bool maximize = false;
};

// torch.optim.AdamW's defaults.
inline AdamConfig AdamWConfig() {
  AdamConfig c;
  c.weight_decay = 1e-2;
  c.decoupled_weight_decay = true;
  return c;
}

// torch.optim.SGD. The momentum buffer is initialised to the first gradient
// (no dampening on the first step), as in PyTorch.
struct SgdConfig {
  double lr = 1e-2;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool maximize = false;
};

// The hyper-parameters of one parameter group (torch.optim's param_groups):
// `adam` for Adam/AdamW, `sgd` for SGD.
struct HyperParameters {
  AdamConfig adam;
  SgdConfig sgd;
};

// InvalidArgument naming the first field outside its range
// (common/hyper_params.h: the one rule per hyper-parameter).
absl::Status ValidateAdamConfig(const AdamConfig& config);
absl::Status ValidateSgdConfig(const SgdConfig& config);

}  // namespace shardopt

#endif  // SHARDOPT_COMMON_OPTIMIZER_CONFIG_H_
