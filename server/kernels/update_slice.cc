#include "server/kernels/update_slice.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace shardopt {

AdamScalars MakeAdamScalars(const AdamConfig& c, int64_t step) {
  AdamScalars s;
  const double bias_correction1 = 1.0 - std::pow(c.beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(c.beta2, static_cast<double>(step));
  s.grad_sign = c.maximize ? -1.0f : 1.0f;
  s.decoupled = c.decoupled_weight_decay;
  s.l2 = !c.decoupled_weight_decay && c.weight_decay != 0.0;
  s.weight_decay = static_cast<float>(c.weight_decay);
  s.decay = c.decoupled_weight_decay ? static_cast<float>(1.0 - c.lr * c.weight_decay) : 1.0f;
  s.beta1 = static_cast<float>(c.beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - c.beta1);
  s.beta2 = static_cast<float>(c.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - c.beta2);
  s.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  s.eps = static_cast<float>(c.eps);
  s.neg_step_size = static_cast<float>(-(c.lr / bias_correction1));
  return s;
}

SgdScalars MakeSgdScalars(const SgdConfig& c, int64_t step) {
  SgdScalars s;
  s.grad_sign = c.maximize ? -1.0f : 1.0f;
  s.weight_decay = static_cast<float>(c.weight_decay);
  s.l2 = c.weight_decay != 0.0;
  s.momentum_enabled = c.momentum != 0.0;
  s.first_step = step <= 1;
  s.nesterov = c.nesterov;
  s.momentum = static_cast<float>(c.momentum);
  s.one_minus_dampening = static_cast<float>(1.0 - c.dampening);
  s.neg_lr = static_cast<float>(-c.lr);
  return s;
}

absl::Status ValidateStep(int64_t step) {
  if (step < 1) return absl::InvalidArgumentError(absl::StrCat("step must be >= 1, got ", step));
  return absl::OkStatus();
}

absl::Status ValidateSlices(absl::Span<const UpdateSlice> slices, bool needs_state0,
                            bool needs_state1) {
  for (size_t i = 0; i < slices.size(); ++i) {
    const UpdateSlice& s = slices[i];
    if (s.size < 0) {
      return absl::InvalidArgumentError(absl::StrCat("slice ", i, ": negative size ", s.size));
    }
    if (s.size == 0) continue;
    if (s.param == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("slice ", i, ": no parameter array"));
    }
    if ((s.grad == nullptr) == (s.grad_bf16 == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("slice ", i, ": exactly one of grad and grad_bf16 must be set"));
    }
    if (needs_state0 && s.state0 == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("slice ", i, ": missing optimizer state 0"));
    }
    if (needs_state1 && s.state1 == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("slice ", i, ": missing optimizer state 1"));
    }
  }
  return absl::OkStatus();
}

}  // namespace shardopt
