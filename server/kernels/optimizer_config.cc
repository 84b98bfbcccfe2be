#include "server/kernels/optimizer_config.h"

#include <cfloat>
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
  return absl::InvalidArgumentError(
      absl::StrCat("invalid ", field, " ", value, ": must be ", want));
}

// The kernels compute in float32: a value past FLT_MAX would be inf there
// (lr=1e39 trained with an infinite step and saved a checkpoint that could
// not be loaded). One rule for every hyper-parameter, used by the Python API,
// the CLI flags, set-lr, the RPCs and the manifest reader through these
// functions.
bool NonNegativeFloat(double v) { return v >= 0.0 && v <= static_cast<double>(FLT_MAX); }
constexpr const char* kNonNegativeFloat = ">= 0 and at most 3.4028235e+38 (float32's largest)";

}  // namespace

absl::Status ValidateAdamConfig(const AdamConfig& c) {
  if (!NonNegativeFloat(c.lr)) return Bad("learning rate", c.lr, kNonNegativeFloat);
  if (!NonNegativeFloat(c.eps)) return Bad("eps", c.eps, kNonNegativeFloat);
  if (!(c.beta1 >= 0.0 && c.beta1 < 1.0)) return Bad("beta1", c.beta1, "in [0, 1)");
  if (!(c.beta2 >= 0.0 && c.beta2 < 1.0)) return Bad("beta2", c.beta2, "in [0, 1)");
  if (!NonNegativeFloat(c.weight_decay))
    return Bad("weight_decay", c.weight_decay, kNonNegativeFloat);
  return absl::OkStatus();
}

absl::Status ValidateSgdConfig(const SgdConfig& c) {
  if (!NonNegativeFloat(c.lr)) return Bad("learning rate", c.lr, kNonNegativeFloat);
  if (!NonNegativeFloat(c.momentum)) return Bad("momentum", c.momentum, kNonNegativeFloat);
  if (!(std::fabs(c.dampening) <= static_cast<double>(FLT_MAX))) {
    return Bad("dampening", c.dampening, "finite in float32");
  }
  if (!NonNegativeFloat(c.weight_decay))
    return Bad("weight_decay", c.weight_decay, kNonNegativeFloat);
  if (c.nesterov && (c.momentum <= 0.0 || c.dampening != 0.0)) {
    return absl::InvalidArgumentError("Nesterov momentum requires a momentum and zero dampening");
  }
  return absl::OkStatus();
}

}  // namespace shardopt
