#include "common/hyper_params.h"

#include <cfloat>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace shardopt {
namespace {

struct Rule {
  HyperParameter p;
  const char* name;
  const char* alias;  // another accepted spelling, or nullptr
  double min;
  double max;
  bool max_exclusive;
};

constexpr double kFloatMax = static_cast<double>(FLT_MAX);

constexpr Rule kRules[] = {
    {HyperParameter::kLearningRate, "lr", "learning_rate", 0.0, kFloatMax, false},
    {HyperParameter::kBeta1, "betas[0]", "beta1", 0.0, 1.0, true},
    {HyperParameter::kBeta2, "betas[1]", "beta2", 0.0, 1.0, true},
    {HyperParameter::kEps, "eps", nullptr, 0.0, kFloatMax, false},
    {HyperParameter::kWeightDecay, "weight_decay", nullptr, 0.0, kFloatMax, false},
    {HyperParameter::kMomentum, "momentum", nullptr, 0.0, kFloatMax, false},
    {HyperParameter::kDampening, "dampening", nullptr, -kFloatMax, kFloatMax, false},
    {HyperParameter::kMaxGradNorm, "max_grad_norm", nullptr, 0.0, kFloatMax, false},
};

const Rule& RuleOf(HyperParameter p) {
  for (const Rule& r : kRules) {
    if (r.p == p) return r;
  }
  return kRules[0];  // unreachable: every enumerator has a rule
}

std::string Num(double v) { return absl::StrFormat("%.8g", v); }

}  // namespace

const std::vector<HyperParameter>& AllHyperParameters() {
  static const std::vector<HyperParameter> all = [] {
    std::vector<HyperParameter> v;
    for (const Rule& r : kRules) v.push_back(r.p);
    return v;
  }();
  return all;
}

const char* HyperParameterName(HyperParameter p) { return RuleOf(p).name; }

std::optional<HyperParameter> ParseHyperParameterName(std::string_view name) {
  for (const Rule& r : kRules) {
    if (name == r.name || (r.alias != nullptr && name == r.alias)) return r.p;
  }
  return std::nullopt;
}

std::string HyperParameterRange(HyperParameter p) {
  const Rule& r = RuleOf(p);
  return absl::StrCat("in [", Num(r.min), ", ", Num(r.max), r.max_exclusive ? ")" : "]");
}

absl::Status ValidateHyperParameter(HyperParameter p, double value) {
  const Rule& r = RuleOf(p);
  // NaN fails every comparison, so it is refused with the rest.
  const bool ok = value >= r.min && (r.max_exclusive ? value < r.max : value <= r.max);
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("invalid ", r.name, " ", Num(value), ": must be ", HyperParameterRange(p),
                   r.max == kFloatMax ? " (float32: the kernels compute in float32)" : ""));
}

absl::Status ValidateLearningRateChange(double lr) {
  if (absl::Status s = ValidateHyperParameter(HyperParameter::kLearningRate, lr); !s.ok()) {
    return s;
  }
  if (!(lr >= static_cast<double>(FLT_MIN))) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid lr ", Num(lr), " for a running job: must be in [", Num(FLT_MIN), ", ",
                     Num(kFloatMax),
                     "] (0 means 'no change' on the wire; smaller values are 0 or denormal as "
                     "float32)"));
  }
  return absl::OkStatus();
}

}  // namespace shardopt
