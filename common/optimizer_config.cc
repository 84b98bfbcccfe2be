#include "common/optimizer_config.h"

#include "absl/strings/str_cat.h"
#include "common/hyper_params.h"

namespace shardopt {

const char* OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdam: return "adam";
    case OptimizerKind::kAdamW: return "adamw";
    case OptimizerKind::kSgd: return "sgd";
  }
  return "unknown";
}

absl::Status ValidateAdamConfig(const AdamConfig& c) {
  for (auto [p, v] : {std::pair{HyperParameter::kLearningRate, c.lr},
                      {HyperParameter::kBeta1, c.beta1},
                      {HyperParameter::kBeta2, c.beta2},
                      {HyperParameter::kEps, c.eps},
                      {HyperParameter::kWeightDecay, c.weight_decay}}) {
    if (absl::Status s = ValidateHyperParameter(p, v); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ValidateSgdConfig(const SgdConfig& c) {
  for (auto [p, v] : {std::pair{HyperParameter::kLearningRate, c.lr},
                      {HyperParameter::kMomentum, c.momentum},
                      {HyperParameter::kDampening, c.dampening},
                      {HyperParameter::kWeightDecay, c.weight_decay}}) {
    if (absl::Status s = ValidateHyperParameter(p, v); !s.ok()) return s;
  }
  if (c.nesterov && (c.momentum <= 0.0 || c.dampening != 0.0)) {
    return absl::InvalidArgumentError("Nesterov momentum requires a momentum and zero dampening");
  }
  return absl::OkStatus();
}

}  // namespace shardopt
