#include "server/reference_optimizer.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace shardopt {

namespace {

float Grad(const UpdateSlice& s, int64_t i) {
  return s.grad != nullptr ? s.grad[i] : Bf16ToFloat(s.grad_bf16[i]);
}


}  // namespace

absl::Status ReferenceAdamStep(const AdamConfig& config, int64_t step,
                               absl::Span<const UpdateSlice> slices) {
  SHARDOPT_RETURN_IF_ERROR(ValidateAdamConfig(config));
  SHARDOPT_RETURN_IF_ERROR(ValidateStep(step));
  SHARDOPT_RETURN_IF_ERROR(ValidateSlices(slices, true, true));
  const AdamScalars k = MakeAdamScalars(config, step);
  for (const UpdateSlice& s : slices) {
    for (int64_t i = 0; i < s.size; ++i) {
      float p = s.param[i];
      float g = Grad(s, i) * k.grad_sign;
      if (k.l2) g = g + k.weight_decay * p;       // grad.add(param, alpha=wd)
      if (k.decoupled) p = p * k.decay;           // param.mul_(1 - lr * wd)
      float m = s.state0[i] * k.beta1 + k.one_minus_beta1 * g;       // mul_(b1).add_(g, 1-b1)
      float v = s.state1[i] * k.beta2 + k.one_minus_beta2 * g * g;   // addcmul_(g, g, 1-b2)
      const float denom = std::sqrt(v) / k.bias_correction2_sqrt + k.eps;
      p = p + k.neg_step_size * m / denom;        // addcdiv_(m, denom, -step_size)
      s.state0[i] = m;
      s.state1[i] = v;
      s.param[i] = p;
      if (s.param_bf16 != nullptr) s.param_bf16[i] = FloatToBf16(p);
    }
  }
  return absl::OkStatus();
}

absl::Status ReferenceSgdStep(const SgdConfig& config, int64_t step,
                              absl::Span<const UpdateSlice> slices) {
  SHARDOPT_RETURN_IF_ERROR(ValidateSgdConfig(config));
  SHARDOPT_RETURN_IF_ERROR(ValidateStep(step));
  const SgdScalars k = MakeSgdScalars(config, step);
  SHARDOPT_RETURN_IF_ERROR(ValidateSlices(slices, k.momentum_enabled, false));
  for (const UpdateSlice& s : slices) {
    for (int64_t i = 0; i < s.size; ++i) {
      float p = s.param[i];
      float d = Grad(s, i) * k.grad_sign;
      if (k.l2) d = d + k.weight_decay * p;
      if (k.momentum_enabled) {
        float buf = k.first_step ? d : s.state0[i] * k.momentum + k.one_minus_dampening * d;
        s.state0[i] = buf;
        d = k.nesterov ? d + k.momentum * buf : buf;
      }
      p = p + k.neg_lr * d;
      s.param[i] = p;
      if (s.param_bf16 != nullptr) s.param_bf16[i] = FloatToBf16(p);
    }
  }
  return absl::OkStatus();
}

}  // namespace shardopt
