// The greedy partition planner (docs/design.md, "Partition").
#ifndef SHARDOPT_COMMON_PLANNER_H_
#define SHARDOPT_COMMON_PLANNER_H_

#include <vector>

#include "absl/status/statusor.h"
#include "common/layout.h"
#include "common/param_spec.h"

namespace shardopt {

// Limits beyond which input is refused as absurd rather than planned.
inline constexpr int kMaxWorldSize = 1 << 20;
inline constexpr int64_t kMaxParamElements = int64_t{1} << 40;
inline constexpr int64_t kMaxTotalElements = int64_t{1} << 44;
inline constexpr int64_t kMaxAlignment = int64_t{1} << 20;
inline constexpr size_t kMaxNameLength = 1024;

// Partitions the trainable parameters of `params` (registration order) over
// `world_size` ranks:
//  - buckets take tensors in reverse registration order up to the bucket cap;
//  - every rank gets the same capacity in a bucket: ceil(elements / N) rounded
//    up to the alignment;
//  - tensors are placed largest first, whole, onto the rank with the most free
//    capacity that can hold them;
//  - tensors that fit whole nowhere are streamed through the remaining free
//    space in rank order, cut only at rank boundaries, so every parameter is
//    one contiguous span of its bucket (a rank whose whole tensors would break
//    that contiguity gives them back to the stream);
//  - with options.allow_cut == false: whole-tensor greedy, padded to the
//    largest share.
// Deterministic. Returns InvalidArgument for bad input (world size out of
// range, no trainable parameters, zero-size or absurdly large tensors,
// duplicate or empty names, bad options); never crashes on input.
absl::StatusOr<Layout> Plan(const std::vector<ParamSpec>& params, int world_size,
                            const PlanOptions& options = PlanOptions());

}  // namespace shardopt

#endif  // SHARDOPT_COMMON_PLANNER_H_
