// GradientReducer: how backward's gradients become this rank's averaged
// owned gradients. Backward's hooks hand each parameter's gradient to the
// reducer; when every gradient of a bucket has arrived, the bucket's
// reduce-scatter starts at once (overlapping the rest of backward), in an
// order that is the same on every rank (bucket order in the first step, then
// the order rank 0's first backward completed them). Step() waits for each
// bucket (FinishBucket), after which the ShardOwner's owned gradient of that
// bucket holds the average.
//
// Two implementations share this launch queue and the checks for misuse
// (gradients accumulated after a step, several backward passes with sync on,
// gradients changed between backward and step):
// - FullGradientReducer (client/full_gradient_reducer.h): every rank keeps
//   the full flat gradient buffer (the parameters' .grad are views of it);
// - ShardedGradientReducer (client/sharded_gradient_reducer.h, ZeRO-2): each
//   rank keeps only its owned gradients, staging the rest while it is reduced.
//
// Locking: the hooks run on autograd's threads and take mu() (shared with
// them through HookState, which may outlive the reducer); every member marked
// ABSL_GUARDED_BY(hooks_->mu) is touched only with it held. The public
// methods below take it themselves unless their name ends in Locked.
#ifndef SHARDOPT_CLIENT_GRADIENT_REDUCER_H_
#define SHARDOPT_CLIENT_GRADIENT_REDUCER_H_

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/collective_waiter.h"
#include "client/comm/communicator.h"
#include "client/trace.h"
#include "common/dtype.h"
#include "common/layout.h"
#include "server/shard_owner.h"

namespace torch {
namespace autograd {
struct Node;
}  // namespace autograd
}  // namespace torch

namespace shardopt {

class GradientReducer;

// The element types tensors of the optimizer's buffers have (float32 or
// bfloat16) as the communicators name them, and back.
inline DType DTypeOf(torch::ScalarType t) {
  return t == torch::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
}
inline torch::ScalarType ScalarTypeOf(DType t) {
  return t == DType::kBFloat16 ? torch::kBFloat16 : torch::kFloat;
}

// What backward's hooks share with the reducer: the lock, and the reducer
// they call while it is attached (Detach clears it under mu, so a hook never
// runs on a destroyed reducer).
struct HookState {
  absl::Mutex mu;
  GradientReducer* reducer ABSL_GUARDED_BY(mu) = nullptr;
};

struct ReducerSetup {
  const Layout* layout = nullptr;
  Communicator* comm = nullptr;
  Tracer* tracer = nullptr;
  torch::TensorOptions options;       // the model's dtype and device
  DType comm_type = DType::kFloat32;  // the type gradients travel in
  absl::Duration timeout = absl::Seconds(300);
  // ShardedGradientReducer: ShardedOptimizerOptions' grad_staging_buffers
  // and reduce_large_gradients_in_pieces.
  int staging_buffers = 2;
  bool reduce_in_pieces = true;
};

class GradientReducer {
 public:
  // Waits for a bucket's reduce-scatter handle (the optimizer's way: bounded,
  // aborting, or ordering the device after it).
  using WaitFn = absl::FunctionRef<absl::Status(const CommHandlePtr& handle, int bucket)>;

  virtual ~GradientReducer() = default;

  absl::Mutex& mu() const ABSL_LOCK_RETURNED(hooks_->mu) { return hooks_->mu; }
  // For hooks, which lock their own copy of the shared_ptr: says that it is
  // the same mutex (checked at run time).
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK(hooks_->mu) { hooks_->mu.AssertHeld(); }

  // ---- Setup, in this order ----
  // The gradients the ShardOwner updates from: the full flat buffer, or this
  // rank's owned ranges bucket after bucket.
  virtual torch::Tensor owner_grads() = 0;
  // The model's parameters (registration order; their data already views of
  // the flat parameter buffer): their .grad become what the reducer needs.
  virtual void Attach(std::vector<torch::Tensor> params);
  // Hooks on every trainable parameter's gradient accumulator. `names` for
  // errors.
  absl::Status InstallHooks(ShardOwner* owner, const std::vector<std::string>& names);
  // Stops the hooks from calling in and waits (bounded) for reductions in
  // flight, which use the reducer's buffers. Call before destroying it.
  void Detach();

  // ---- Backward (hooks, on autograd's threads) ----
  // Whether BeforeGradLocked must run before each gradient is accumulated.
  virtual bool wants_pre_hook() const { return false; }
  virtual void BeforeGradLocked(int /*param*/) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu) {}
  virtual void OnGradReadyLocked(int param) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu) = 0;

  // ---- Training thread ----
  // false: backward only accumulates locally (no_sync).
  void SetGradientSync(bool enabled);
  // ShardedOptimizer::ZeroGrad.
  virtual void ZeroGrad(bool set_to_none) = 0;
  // ShardedOptimizer::FoldReducedGradients (full gradients only).
  virtual absl::Status FoldReducedGradients(WaitFn /*wait*/) { return absl::OkStatus(); }
  // Checks what backward did (the misuse errors Step() reports), marks the
  // parameters this rank has a gradient for (returned: 1 per such parameter,
  // by layout index) and launches the reductions of buckets no gradient
  // reached (unused parameters are reduced as zeros, as DDP's
  // find_unused_parameters does).
  absl::StatusOr<std::vector<float>> BeginStep();
  // Waits for bucket `b`'s reduction; the owner's owned gradient of `b` then
  // holds the average. Time blocked is added to `waiter`.
  virtual absl::Status FinishBucket(int b, WaitFn wait, CollectiveWaiter* waiter) = 0;
  // After the step's updates: forgets this backward; gradients that arrive
  // before ZeroGrad() are then reported by the next BeginStep().
  void EndStep();
  // The launch order: agreed after the first step (ShardedOptimizer asks
  // rank 0's proposal and broadcasts it).
  bool order_agreed() const;
  std::vector<int32_t> ProposedLaunchOrder() const;
  void SetLaunchOrder(const std::vector<int32_t>& order);
  // After a step that ran in the agreed order.
  virtual void OnStepInAgreedOrder() {}
  // Time backward was blocked on a reduction since the last call (exposed).
  int64_t TakeHookWaitNs();
  // Bytes of gradients held now (MemoryReport::grad_bytes). Any thread.
  virtual int64_t grad_bytes() const = 0;

 protected:
  explicit GradientReducer(const ReducerSetup& setup);

  // The launch queue: bucket `b`'s last gradient arrived; launches every
  // complete bucket whose turn it is.
  void BucketCompleteLocked(int b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void LaunchReadyBucketsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  // Launches bucket `b`'s reduce-scatter (into rs_handles_[b]).
  virtual void LaunchLocked(int b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu) = 0;
  // BeginStep's checks and marks that differ between the two.
  virtual absl::Status CheckGradsUnchangedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu) {
    return absl::OkStatus();
  }
  virtual bool HasFoldedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu) { return false; }
  // Parameter `p` was marked as having a gradient but its .grad is gone
  // (p.grad = None since): true when it must count as having none.
  virtual bool DropStaleLocked(int /*p*/) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu) {
    return false;
  }
  // Forgets what backward passes recorded since the last ZeroGrad()/Step().
  virtual void ResetBackwardStateLocked(bool needs_zero_grad)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  virtual void ReleaseAfterStepLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu) {}
  virtual void OnOrderAgreedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu) {}
  absl::Status TakeHookErrorLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hooks_->mu);
  void ClearHasGrad();
  int num_buckets() const { return static_cast<int>(layout_.buckets().size()); }

  const ReducerSetup setup_;
  const Layout& layout_;
  Communicator* const comm_;
  Tracer* const tracer_;
  const int rank_;
  const int world_;
  std::vector<torch::Tensor> params_;  // the model's parameters (registration order)
  ShardOwner* owner_ = nullptr;
  const std::shared_ptr<HookState> hooks_;
  std::vector<std::shared_ptr<torch::autograd::Node>> grad_accumulators_;
  std::vector<int> bucket_size_;  // parameters per bucket

  std::vector<bool> ready_ ABSL_GUARDED_BY(hooks_->mu);  // reached by this backward
  // Per parameter: a gradient arrived since the last ZeroGrad(set_to_none).
  std::vector<uint8_t> has_grad_ ABSL_GUARDED_BY(hooks_->mu);
  std::vector<int> bucket_ready_count_ ABSL_GUARDED_BY(hooks_->mu);
  std::vector<CommHandlePtr> rs_handles_ ABSL_GUARDED_BY(hooks_->mu);
  int next_launch_ ABSL_GUARDED_BY(hooks_->mu) = 0;  // position in launch_order_
  // The order buckets are reduced in, the same on every rank; ready_order_
  // records backward's order until it is agreed.
  std::vector<int> launch_order_ ABSL_GUARDED_BY(hooks_->mu);
  std::vector<int> ready_order_ ABSL_GUARDED_BY(hooks_->mu);
  bool order_agreed_ ABSL_GUARDED_BY(hooks_->mu) = false;
  int64_t grads_seen_ ABSL_GUARDED_BY(hooks_->mu) = 0;
  bool sync_ ABSL_GUARDED_BY(hooks_->mu) = true;
  bool needs_zero_grad_ ABSL_GUARDED_BY(hooks_->mu) = false;
  bool grad_after_step_ ABSL_GUARDED_BY(hooks_->mu) = false;
  bool accumulated_while_syncing_ ABSL_GUARDED_BY(hooks_->mu) = false;
  // A backward with sync on since the last fold / ZeroGrad / Step.
  bool synced_backward_ ABSL_GUARDED_BY(hooks_->mu) = false;
  absl::Status hook_error_ ABSL_GUARDED_BY(hooks_->mu);   // a reduction failed in backward
  int64_t hook_wait_ns_ ABSL_GUARDED_BY(hooks_->mu) = 0;  // backward blocked (exposed)
};

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_GRADIENT_REDUCER_H_
