// One rule per hyper-parameter. Every place a value enters shardopt checks it
// here: the optimizer's constructor and setters (C++ and, through the
// extension, Python), the CLI flags, `shardctl set-lr`, the coordinator's RPCs
// and the checkpoint manifest reader. tests/fixtures/hyper_parameters.tsv is
// the table of values every one of those paths is tested with.
//
// The ranges are torch.optim's (PyTorch 1.13) restricted to what float32
// holds: the kernels compute in float32, so a value past FLT_MAX would be inf
// there (lr=1e39 once trained with an infinite step and saved a checkpoint
// that could not be loaded).
#ifndef SHARDOPT_COMMON_HYPER_PARAMS_H_
#define SHARDOPT_COMMON_HYPER_PARAMS_H_

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace shardopt {

enum class HyperParameter {
  kLearningRate,  // lr:            [0, FLT_MAX]
  kBeta1,         // betas[0]:      [0, 1)
  kBeta2,         // betas[1]:      [0, 1)
  kEps,           // eps:           [0, FLT_MAX]
  kWeightDecay,   // weight_decay:  [0, FLT_MAX]
  kMomentum,      // momentum:      [0, FLT_MAX]
  kDampening,     // dampening:     [-FLT_MAX, FLT_MAX] (torch accepts any)
  kMaxGradNorm,   // max_grad_norm: [0, FLT_MAX] (0: no clipping)
};

// Every hyper-parameter, in the order above.
const std::vector<HyperParameter>& AllHyperParameters();

// The name torch.optim gives it ("lr", "betas[0]", "weight_decay", ...).
const char* HyperParameterName(HyperParameter p);
// The inverse of HyperParameterName (also "beta1"/"beta2"); nullopt if unknown.
std::optional<HyperParameter> ParseHyperParameterName(std::string_view name);
// The allowed range in words, e.g. "in [0, 3.4028235e+38]".
std::string HyperParameterRange(HyperParameter p);

// OK if `value` is allowed for `p`; otherwise InvalidArgument
// "invalid lr 1e+39: must be in [0, 3.4028235e+38] (float32: the kernels compute in float32)".
absl::Status ValidateHyperParameter(HyperParameter p, double value);

// A learning rate sent to a running job (`shardctl set-lr`, the coordinator's
// SetHyperParams RPC): a valid learning rate that is also a normal float32
// (>= FLT_MIN), because 0 means "no change" on the wire and in the ranks'
// float agreement buffer, where a denormal would round to it.
absl::Status ValidateLearningRateChange(double lr);

}  // namespace shardopt

#endif  // SHARDOPT_COMMON_HYPER_PARAMS_H_
