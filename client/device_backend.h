// Fused updates for parameters that live on a GPU. A backend registers itself
// when its library is linked (//client:cuda_backend, alwayslink); the
// ShardedOptimizer uses it when its parameters are on a CUDA device, and
// refuses such parameters with a clear error when none is linked. This keeps
// every CUDA dependency out of CPU-only binaries.
//
// Tested on one H200 by tools/gpu_check.sh (tests/gpu_sharded_optimizer_test.cc).
#ifndef SHARDOPT_CLIENT_DEVICE_BACKEND_H_
#define SHARDOPT_CLIENT_DEVICE_BACKEND_H_

#include <cstdint>

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/optimizer_config.h"
#include "server/update_slice.h"

namespace shardopt {

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  // One step on a slice whose pointers are device pointers (same layout and
  // semantics as server/cpu_kernels.h), enqueued on the current stream.
  virtual absl::Status Update(OptimizerKind kind, const AdamConfig& adam, const SgdConfig& sgd,
                              int64_t step, const UpdateSlice& slice) = 0;
  // Sum of squares of the gradients (`grad` or `grad_bf16`) of every slice,
  // in one launch on the current stream; returns once that one value is on
  // the host.
  virtual absl::StatusOr<double> SquaredNorm(const std::vector<UpdateSlice>& slices) = 0;
};

// The registered CUDA backend, or nullptr.
DeviceBackend* CudaBackend();
void RegisterCudaBackend(DeviceBackend* backend);

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_DEVICE_BACKEND_H_
