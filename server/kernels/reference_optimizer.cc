#include "server/kernels/reference_optimizer.h"

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
      AdamElementAny(k, p, Grad(s, i), s.state0[i], s.state1[i]);
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
      float unused = 0;
      SgdElementAny(k, p, Grad(s, i), k.momentum_enabled ? s.state0[i] : unused);
      s.param[i] = p;
      if (s.param_bf16 != nullptr) s.param_bf16[i] = FloatToBf16(p);
    }
  }
  return absl::OkStatus();
}

}  // namespace shardopt
