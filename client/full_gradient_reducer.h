// FullGradientReducer: every rank keeps the full flat gradient buffer, in
// bucket order; the parameters' .grad are views of it, so autograd
// accumulates straight into it, and each bucket's reduce-scatter leaves the
// average in this rank's owned range (in place, or through a bf16 copy when
// gradients travel as bf16). Supports gradient accumulation as DDP does
// (FoldReducedGradients) and the ways PyTorch code zeroes gradients
// (model.zero_grad(), p.grad = None).
#ifndef SHARDOPT_CLIENT_FULL_GRADIENT_REDUCER_H_
#define SHARDOPT_CLIENT_FULL_GRADIENT_REDUCER_H_

#include <atomic>
#include <vector>

#include "client/gradient_reducer.h"

namespace shardopt {

class FullGradientReducer : public GradientReducer {
 public:
  explicit FullGradientReducer(const ReducerSetup& setup);

  torch::Tensor owner_grads() override { return grad_flat_; }
  void Attach(std::vector<torch::Tensor> params) override;
  bool wants_pre_hook() const override { return true; }
  void BeforeGradLocked(int param) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void OnGradReadyLocked(int param) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void ZeroGrad(bool set_to_none) override;
  absl::Status FoldReducedGradients(WaitFn wait) override;
  absl::Status FinishBucket(int b, WaitFn wait, CollectiveWaiter* waiter) override;
  int64_t grad_bytes() const override;

 private:
  void LaunchLocked(int b) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  absl::Status CheckGradsUnchangedLocked() override ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  bool HasFoldedLocked() const override ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu) {
    return folded_pending_;
  }
  bool DropStaleLocked(int p) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void ResetBackwardStateLocked(bool needs_zero_grad) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void ReleaseAfterStepLocked() override ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu) {
    folded_pending_ = false;
  }
  // Offset of bucket `bucket`'s owned range among this rank's ranges.
  int64_t OwnedOffset(int bucket) const;

  torch::Tensor grad_flat_;                // model dtype, flat_size elements
  torch::Tensor comm_scratch_;             // bf16 gradients for communication, if converting
  std::vector<torch::Tensor> grad_views_;  // the parameters' gradients: views of grad_flat_
  // grad_flat_'s version after the last gradient arrived (BeginStep checks
  // nothing wrote to it since).
  int64_t grad_version_ ABSL_GUARDED_BY(hooks_->mu) = -1;
  // FoldReducedGradients: the reduced owned gradients kept aside
  // (owned_elements(), the model's dtype) and whether they count in this
  // step.
  torch::Tensor folded_;
  std::atomic<int64_t> folded_bytes_{0};  // read by grad_bytes() from other threads
  bool folded_pending_ ABSL_GUARDED_BY(hooks_->mu) = false;
};

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_FULL_GRADIENT_REDUCER_H_
