// The global L2 norm of the averaged gradient, and clipping by it as
// torch.nn.utils.clip_grad_norm_(max_norm) does. Each rank's squared norm of
// its owned gradients is all-gathered in double and summed in rank order
// (the same bits on every rank). On the host by default; with
// device_async_step as device values (norm, coefficient, scaling) that the
// host reads later, behind a fence, without blocking the step.
// Training thread only.
#ifndef SHARDOPT_CLIENT_GRAD_NORM_H_
#define SHARDOPT_CLIENT_GRAD_NORM_H_

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "client/collective_waiter.h"
#include "server/kernels/kernel_backend.h"
#include "server/shard_owner.h"

namespace shardopt {

// A step's gradient norm as read back from the device.
struct GradNormReading {
  int64_t step = 0;
  double grad_norm = 0.0;
  bool clipped = false;
};

class GradNorm {
 public:
  // Orders the device after a collective instead of waiting for it on the
  // host (device_async_step); false: the caller must wait.
  using DeferFn = absl::FunctionRef<bool(const CommHandlePtr& handle, const char* what)>;

  // `owner` holds the owned gradients; `backend` records fences (GPU);
  // `on_device_values`: device_async_step (norm and clipping as device values).
  GradNorm(CollectiveWaiter* waiter, ShardOwner* owner, KernelBackend* backend,
           torch::Device device, double max_grad_norm, bool on_device_values);
  ~GradNorm();  // waits (bounded) for a norm in flight

  // Host path: launches the all-gather of this rank's squared norm
  // (`local_sq`; on a GPU the owner computes it) and finishes it.
  absl::Status Launch(double local_sq);
  absl::StatusOr<double> Finish();
  // clip_grad_norm_'s float arithmetic: scales the owned gradients when the
  // coefficient is below 1; returns whether it did.
  bool Clip(double grad_norm);

  // Device path (device_async_step).
  absl::Status LaunchOnDevice(double local_sq);
  // Sums the parts, takes the root, clips if `clip`; the reading for step
  // `step` is then known at once (CPU: *grad_norm, *clipped) or pending (GPU).
  absl::Status FinishOnDevice(bool clip, int64_t step, DeferFn defer, double* grad_norm,
                              bool* clipped, bool* pending);

  // The newest reading on the host (host path: every step's).
  void set_last(const GradNormReading& r) { last_ = r; }
  // The reading of step `step` (blocks on its fence), or nullopt if it was
  // never taken (LastGradNorm's errors).
  absl::StatusOr<GradNormReading> Last(int64_t step);
  // The newest of steps `step` and `step` - 1 already on the host.
  std::optional<GradNormReading> Ready(int64_t step);

 private:
  void RecordReading(int64_t step, const torch::Tensor& norm, const torch::Tensor& coef,
                     double* grad_norm, bool* clipped, bool* pending);

  CollectiveWaiter* const waiter_;
  Communicator* const comm_;
  ShardOwner* const owner_;
  KernelBackend* const backend_;
  const torch::Device device_;
  const double max_grad_norm_;
  const bool async_;
  const int rank_;
  const int world_;
  CommHandlePtr handle_;
  // Per rank: squared norm of its owned gradients. A member: a collective
  // that timed out may still write into it.
  std::vector<double> parts_;
  torch::Tensor parts_t_;  // device_async_step: float64 [world] on device_
  torch::Tensor host_;     // pinned float32 [2 slots][norm, coef] (GPU)
  std::unique_ptr<KernelBackend::Fence> fence_[2];
  int64_t fence_step_[2] = {0, 0};
  GradNormReading last_;  // the newest reading on the host
};

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_GRAD_NORM_H_
