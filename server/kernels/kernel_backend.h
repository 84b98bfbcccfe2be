// KernelBackend: where a ShardOwner's fused updates run. Chosen when the
// owner is built (server/shard_owner.h): the CPU backend below for parameters
// in host memory, the CUDA one (server/kernels/cuda/cuda_backend.h) for
// parameters on a GPU. There is no global registry: a binary that never
// names the CUDA backend carries no CUDA dependency.
#ifndef SHARDOPT_SERVER_KERNELS_KERNEL_BACKEND_H_
#define SHARDOPT_SERVER_KERNELS_KERNEL_BACKEND_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/optimizer_config.h"
#include "server/kernels/update_slice.h"

namespace shardopt {

class KernelBackend {
 public:
  virtual ~KernelBackend() = default;
  // "cpu" or "cuda".
  virtual const char* name() const = 0;
  // True when slices hold device pointers.
  virtual bool on_device() const = 0;
  // One step numbered `step` (>= 1) of optimizer `kind` over `slices`, all
  // with the hyper-parameters `hp`. On a device: enqueued on the backend's
  // stream (CUDA: the legacy default stream). Errors: invalid hyper-parameters
  // or slices; nothing is modified.
  virtual absl::Status Update(OptimizerKind kind, const HyperParameters& hp, int64_t step,
                              absl::Span<const UpdateSlice> slices) = 0;
  // Sum of squares of the gradients (`grad` or `grad_bf16`) of every slice.
  virtual absl::StatusOr<double> SquaredNorm(absl::Span<const UpdateSlice> slices) = 0;

  // The same sum written to `*out`, which is device memory for a device
  // backend (enqueued where Update runs; the host does not wait) and host
  // memory otherwise (this default: SquaredNorm, then a store).
  virtual absl::Status SquaredNormTo(absl::Span<const UpdateSlice> slices, double* out);

  // A point in this backend's work queue: Ready() once everything enqueued
  // before RecordFence() has run. On the CPU that is at once.
  class Fence {
   public:
    virtual ~Fence() = default;
    virtual bool Ready() = 0;
    // Blocks until Ready() (polling), up to `timeout`: DeadlineExceeded then.
    virtual absl::Status Wait(absl::Duration timeout) = 0;
  };
  virtual std::unique_ptr<Fence> RecordFence();
};

// The CPU implementation: server/kernels/cpu/cpu_backend.h; the CUDA one:
// server/kernels/cuda/cuda_backend.h.

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_KERNELS_KERNEL_BACKEND_H_
