#include "server/kernels/optimizer_config.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace shardopt {

const char* OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdam: return "adam";
    case OptimizerKind::kAdamW: return "adamw";
    case OptimizerKind::kSgd: return "sgd";
  }
  return "unknown";
}

namespace {

absl::Status Bad(const char* field, double value, const char* want) {
  return absl::InvalidArgumentError(absl::StrCat("invalid ", field, " ", value, ": must be ", want));
}

}  // namespace

absl::Status ValidateAdamConfig(const AdamConfig& c) {
  if (!(c.lr >= 0.0) || !std::isfinite(c.lr)) return Bad("learning rate", c.lr, ">= 0 and finite");
  if (!(c.eps >= 0.0) || !std::isfinite(c.eps)) return Bad("eps", c.eps, ">= 0 and finite");
  if (!(c.beta1 >= 0.0 && c.beta1 < 1.0)) return Bad("beta1", c.beta1, "in [0, 1)");
  if (!(c.beta2 >= 0.0 && c.beta2 < 1.0)) return Bad("beta2", c.beta2, "in [0, 1)");
  if (!(c.weight_decay >= 0.0) || !std::isfinite(c.weight_decay)) {
    return Bad("weight_decay", c.weight_decay, ">= 0 and finite");
  }
  return absl::OkStatus();
}

absl::Status ValidateSgdConfig(const SgdConfig& c) {
  if (!(c.lr >= 0.0) || !std::isfinite(c.lr)) return Bad("learning rate", c.lr, ">= 0 and finite");
  if (!(c.momentum >= 0.0) || !std::isfinite(c.momentum)) {
    return Bad("momentum", c.momentum, ">= 0 and finite");
  }
  if (!std::isfinite(c.dampening)) return Bad("dampening", c.dampening, "finite");
  if (!(c.weight_decay >= 0.0) || !std::isfinite(c.weight_decay)) {
    return Bad("weight_decay", c.weight_decay, ">= 0 and finite");
  }
  if (c.nesterov && (c.momentum <= 0.0 || c.dampening != 0.0)) {
    return absl::InvalidArgumentError("Nesterov momentum requires a momentum and zero dampening");
  }
  return absl::OkStatus();
}

}  // namespace shardopt
