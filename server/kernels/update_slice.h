// The unit of work of every optimizer kernel: one contiguous slice of owned
// parameters with its gradient and optimizer state, plus the per-step scalars
// derived from a config, shared by the reference and the fast kernels.
#ifndef SHARDOPT_SERVER_KERNELS_UPDATE_SLICE_H_
#define SHARDOPT_SERVER_KERNELS_UPDATE_SLICE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/bf16.h"  // (users rely on it)
#include "common/optimizer_config.h"
#include "server/kernels/optimizer_math.h"

namespace shardopt {

// Pointers are not owned. All arrays hold `size` elements and must not overlap.
struct UpdateSlice {
  // fp32 parameters, or the fp32 master copy of bf16 parameters. Updated in place.
  float* param = nullptr;
  // The gradient: exactly one of the two is set.
  const float* grad = nullptr;
  const uint16_t* grad_bf16 = nullptr;
  // Adam: exp_avg (state0) and exp_avg_sq (state1). SGD: momentum buffer
  // (state0; unused when momentum == 0).
  float* state0 = nullptr;
  float* state1 = nullptr;
  // Optional: receives the updated parameters rounded to bf16 (round to
  // nearest even), i.e. the model's bf16 copy.
  uint16_t* param_bf16 = nullptr;
  int64_t size = 0;
};

// Per-step scalars (their structs and the per-element math that uses them
// are in server/kernels/optimizer_math.h).
AdamScalars MakeAdamScalars(const AdamConfig& config, int64_t step);

SgdScalars MakeSgdScalars(const SgdConfig& config, int64_t step);

// InvalidArgument unless step >= 1 (steps are numbered from 1, as in PyTorch).
absl::Status ValidateStep(int64_t step);

// Checks slices against what the optimizer needs (non-null arrays, exactly one
// gradient, non-negative sizes). `needs_state0/1` say which state arrays are used.
absl::Status ValidateSlices(absl::Span<const UpdateSlice> slices, bool needs_state0,
                            bool needs_state1);

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_KERNELS_UPDATE_SLICE_H_
