// Scalar reference implementations of Adam, AdamW and SGD: the oracle every
// fast path (SIMD, CUDA) is tested against. Plain loops, one element at a
// time, compiled without floating-point contraction so the operation order is
// exactly the one written, which is PyTorch's.
#ifndef SHARDOPT_SERVER_KERNELS_REFERENCE_OPTIMIZER_H_
#define SHARDOPT_SERVER_KERNELS_REFERENCE_OPTIMIZER_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/optimizer_config.h"
#include "server/kernels/update_slice.h"

namespace shardopt {

// One optimizer step numbered `step` (1 for the first step) over every slice.
// Errors: invalid config, step < 1, malformed slices; nothing is modified then.
absl::Status ReferenceAdamStep(const AdamConfig& config, int64_t step,
                               absl::Span<const UpdateSlice> slices);
absl::Status ReferenceSgdStep(const SgdConfig& config, int64_t step,
                              absl::Span<const UpdateSlice> slices);

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_KERNELS_REFERENCE_OPTIMIZER_H_
