// ShardedOptimizer: the trainer's API. Data-parallel training where each rank
// owns 1/N of the optimizer state.
//
// Parameters and gradients become views into two flat, bucket-ordered buffers
// (planned by common/planner.h). When the last gradient of a bucket has been
// accumulated in backward, that bucket's reduce-scatter starts at once,
// overlapping the rest of backward. Step() waits for them, optionally clips by
// the global gradient norm, has this rank's ShardOwner (server/shard_owner.h)
// run the fused update of its slices, and all-gathers every bucket as soon as
// its slice is updated.
//
// Usage per step:   opt->ZeroGrad(); loss.backward(); opt->Step();
// Gradient accumulation: SetGradientSync(false) for all but the last backward.
//
// Not thread-safe: call from the training thread. Backward hooks may run on
// autograd's threads; they take an internal lock.
#ifndef SHARDOPT_CLIENT_SHARDED_OPTIMIZER_H_
#define SHARDOPT_CLIENT_SHARDED_OPTIMIZER_H_

#include <torch/nn/module.h>
#include <torch/types.h>

#include <atomic>
#include <unordered_map>

#include <functional>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/comm/communicator.h"
#include "client/deferred_collectives.h"
#include "client/staging_arena.h"
#include "common/layout.h"
#include "server/kernels/kernel_backend.h"
#include "common/optimizer_config.h"
#include "server/shard_owner.h"

namespace torch {
namespace autograd {
struct Node;
}  // namespace autograd
}  // namespace torch

namespace shardopt {

struct ShardedOptimizerOptions {
  OptimizerKind kind = OptimizerKind::kAdam;
  // Adam and AdamW hyper-parameters (decoupled_weight_decay follows `kind`).
  AdamConfig adam;
  SgdConfig sgd;
  // Parameter groups (torch.optim's param_groups), each with its own
  // hyper-parameters. Empty: one group with `adam` / `sgd` above.
  std::vector<HyperParameters> groups;
  // Group of every parameter, in the order given to Create (empty: group 0).
  std::vector<int> param_group;
  // Where the fused updates run. Null: the CPU kernels for parameters in host
  // memory; parameters on a GPU need MakeCudaKernelBackend()
  // (server/kernels/cuda/cuda_backend.h).
  std::shared_ptr<KernelBackend> kernel_backend;
  // Bucket cap, alignment, whether tensors may be cut.
  PlanOptions plan;
  // > 0: clip gradients by their global L2 norm, as
  // torch.nn.utils.clip_grad_norm_(max_norm) does (coefficient max/(norm+1e-6)).
  double max_grad_norm = 0.0;
  // Type gradients travel in. kBFloat16 halves gradient traffic for fp32 models
  // (rounded once before the reduce-scatter; the sum is accumulated per ring
  // step in fp32 and rounded). Parameters always travel in their own dtype.
  DType grad_comm_type = DType::kFloat32;
  // Bound on every collective wait.
  absl::Duration timeout = absl::Seconds(300);
  // Threads for the fused update (0 = all hardware threads).
  int kernel_threads = 1;
  // Record TraceEvents (cheap; for tests and diagnosis).
  bool trace = false;
  // true: Step() launches the updates and all-gathers (first layers first)
  // and returns without waiting for the gathers, so they overlap the next
  // forward. The caller must then wait for a layer's parameters before it
  // reads them: WaitForParameters(module) (or of some tensors) before each
  // layer's forward, as Python's forward pre-hooks do. Checkpoints, restores,
  // the next Step() and the full-state gather wait by themselves.
  bool overlap_param_gather = false;
  // true (ZeRO-2): each rank keeps only the reduced gradient of the ranges it
  // owns (1/N of the model). Parameters have no .grad between steps: backward
  // hands each gradient to the optimizer, which writes the part in this
  // rank's chunk of its bucket into the owned gradients and the rest into
  // staging, and drops it; the bucket's reduce-scatter ends with the owned
  // chunk reduced in place (with a communicator that takes separate chunks;
  // otherwise the whole bucket is staged and the owned chunk copied out).
  // Gradient accumulation (SetGradientSync(false)) accumulates locally in a
  // full-size buffer that exists only until the step, as FSDP's no_sync does.
  // Smaller buckets mean less staging (bucket_cap_elements); tensors larger
  // than a bucket are reduced in pieces (reduce_large_gradients_in_pieces).
  bool shard_gradients = false;
  // With shard_gradients: the staging memory holds this many buckets of the
  // cap (and at least the largest bucket) while they are reduced; with Gloo,
  // shared memory or in-process communicators only the other ranks' chunks
  // are staged ((N-1)/N of a bucket). When it is full, backward waits for the
  // oldest bucket's reduction.
  int grad_staging_buffers = 2;
  // With shard_gradients and a communicator that takes separate chunks: a
  // tensor larger than a bucket of the cap (its own bucket) is reduced in
  // pieces of a bucket's share, staged in the arena while backward waits,
  // so staging stays two buckets of the cap however large the model's
  // largest tensor (else it holds (N-1)/N of that tensor). false: the whole
  // tensor is staged at once and backward does not wait for it.
  bool reduce_large_gradients_in_pieces = true;
  // true: Step() never blocks the host on a collective or a device value
  // where the device can order the work itself. With a GPU and a
  // communicator that can order streams (NcclCommunicator), the update of each
  // bucket waits on the device for its reduce-scatter, the gradient norm is
  // summed, all-reduced and turned into the clipping coefficient on the
  // device, and the next forward (and the next step's updates) wait on the
  // device for the all-gathers; StepResult::grad_norm is then pending (NaN):
  // read it with LastGradNorm() (blocks) or ReadyGradNorm() (does not).
  // Failures of collectives not waited for are reported by a later Step(),
  // WaitForParameters() or LastGradNorm() (the communicator aborts on them,
  // so the next collective fails too). With shard_gradients the reduce-
  // scatters are still waited for on the host (their staging is reused).
  // On the CPU, and with host-memory communicators (Gloo,
  // in-process), collectives are waited for on the host as without the option
  // and the norm is known at once: results are bitwise those of the default.
  // Precondition on a GPU: the training step runs on the legacy default
  // stream (LibTorch's default; no CUDAStreamGuard around backward or Step()),
  // where the CUDA kernel backend and the device waits are enqueued.
  bool device_async_step = false;
  // Set: the fused kernels do not run; after the reductions (and clipping)
  // of a step this is called once, with the agreed mask of parameters that
  // have a gradient (by layout index), to update this rank's owned
  // parameters in place (the flat parameter buffer's owned ranges) from the
  // reduced gradients (the flat gradient buffer's owned ranges), and the
  // all-gathers follow. For optimizers without fused kernels (Python runs
  // the torch.optim class's own step on the owned whole tensors: plan with
  // allow_cut = false). Not with shard_gradients or bf16 parameters.
  std::function<absl::Status(const std::vector<uint8_t>& active)> external_update;
};

struct StepResult {
  int64_t step = 0;        // number of this step (1 for the first)
  double grad_norm = 0.0;  // global L2 norm of the averaged gradient, before clipping
  bool clipped = false;
  // device_async_step on a GPU: grad_norm (NaN) and clipped are not known
  // yet; ShardedOptimizer::LastGradNorm() / ReadyGradNorm() read them.
  bool grad_norm_pending = false;
  // Where Step() spent its time: blocked on collectives (exposed
  // communication), and in the fused update.
  double comm_wait_seconds = 0.0;
  double update_seconds = 0.0;
};

// A step's gradient norm as read back from the device.
struct GradNormReading {
  int64_t step = 0;
  double grad_norm = 0.0;
  bool clipped = false;
};

struct TraceEvent {
  enum Kind {
    kGradReady,           // a parameter's gradient was accumulated (param set)
    kReduceScatterStart,  // bucket set
    kReduceScatterDone,
    kUpdateDone,
    kAllGatherStart,
    kAllGatherDone,
    kStepBegin,
    kStepEnd,
  };
  Kind kind;
  int bucket = -1;
  int param = -1;
  int64_t time_ns = 0;  // steady clock
};
const char* TraceEventName(TraceEvent::Kind kind);

class ShardedOptimizer {
 public:
  // `named_parameters` in registration order (module->named_parameters());
  // parameters with requires_grad == false are frozen. `comm` must outlive the
  // optimizer. Collective: every rank calls Create with the same model.
  // Parameters are replaced by views of the flat buffer and rank 0's values
  // are broadcast to every rank.
  // Errors: empty model, duplicate or empty names, non-contiguous parameters,
  // parameters on another device or of an unsupported dtype, bad options,
  // a model that differs between ranks (the message names the first
  // parameter that differs), communication failures.
  static absl::StatusOr<std::unique_ptr<ShardedOptimizer>> Create(
      const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters,
      const ShardedOptimizerOptions& options, Communicator* comm);
  ~ShardedOptimizer();

  // One optimizer step. Errors: no backward since the last step, gradients
  // accumulated without ZeroGrad() after the previous step, communication
  // failures or timeouts (the communicator is aborted then).
  absl::StatusOr<StepResult> Step();
  // Zeroes the flat gradient buffer (gradients stay views of it). With
  // shard_gradients: ends any reduction still in flight and drops what a
  // backward accumulated since the last step. set_to_none: also forgets
  // which parameters had a gradient, as torch.optim's zero_grad(set_to_none=
  // True) does: a parameter that no rank's backward reaches before the next
  // Step() is then not updated (its state and step count stay).
  void ZeroGrad(bool set_to_none = false);
  // false: backward only accumulates locally (gradient accumulation, like
  // DDP's no_sync()); true (default): buckets are reduced during backward.
  void SetGradientSync(bool enabled);
  // Gradient accumulation without SetGradientSync(false), as DDP allows it:
  // call before the forward of a micro-batch that follows a backward whose
  // gradients were reduced. Finishes those reductions, keeps this rank's
  // reduced gradients aside and zeroes the buffers, so the next backward is
  // reduced on its own and Step() sees the sum of the reduced micro-batches
  // (DDP: avg(g1) + avg(g2)). A no-op when no backward reduced anything since
  // the last ZeroGrad()/Step(), and with shard_gradients (where the second
  // backward is refused at Step()). The Python API calls it from a forward
  // pre-hook of `module=`. Errors: a reduction failed.
  absl::Status FoldReducedGradients();
  // Sets every group's learning rate; takes effect at the next Step().
  // InvalidArgument (nothing changed) unless ValidateHyperParameter accepts it.
  absl::Status SetLearningRate(double lr);
  // Group 0's learning rate.
  double learning_rate() const;
  // Replaces the hyper-parameters of every group (lr, betas, eps, weight
  // decay; SGD momentum, dampening, nesterov), e.g. those a checkpoint saved.
  // The kind, and whether SGD keeps a momentum buffer, cannot change.
  absl::Status SetHyperParameters(const AdamConfig& adam, const SgdConfig& sgd);
  // One group's hyper-parameters (takes effect at the next Step()).
  int num_groups() const { return owner_->num_groups(); }
  HyperParameters group(int g) const { return owner_->group(g); }
  absl::Status SetGroup(int g, const HyperParameters& hp);

  int64_t step_count() const { return step_; }

  // The last step's gradient norm and whether it was clipped; with
  // device_async_step on a GPU it blocks until the value is on the host (and
  // every collective left to the device has finished).
  // Errors: no step since creation or restore; a deferred collective failed;
  // a timeout.
  absl::StatusOr<GradNormReading> LastGradNorm();
  // The newest of the last two steps' norms that is on the host without
  // blocking (none before the first step or since a restore, while both are
  // in flight, or once a collective left to the device has failed).
  std::optional<GradNormReading> ReadyGradNorm();

  // With overlap_param_gather: waits until the parameters of bucket
  // `bucket` / of these tensors / of this module (recursively) / of every
  // bucket have been all-gathered. Cheap when they have. Errors: the
  // all-gather failed (the communicator is aborted then).
  absl::Status WaitForBucket(int bucket);
  absl::Status WaitForParameters(const std::vector<torch::Tensor>& params);
  absl::Status WaitForParameters(const torch::nn::Module& module);
  absl::Status WaitForParameters();
  // Buckets holding these parameters (frozen ones have none).
  std::vector<int> BucketsOf(const std::vector<torch::Tensor>& params) const;

  // This rank's partition: owned slices, optimizer state, hyper-parameters.
  ShardOwner& shard_owner() { return *owner_; }
  const ShardOwner& shard_owner() const { return *owner_; }
  using OwnedSlice = ShardOwner::OwnedSlice;
  std::vector<std::string> state_names() const { return owner_->state_names(); }
  Communicator* communicator() const { return comm_; }
  // True when parameters and state live on a GPU.
  bool on_device() const { return !device_.is_cpu(); }
  // (What checkpoints write and restore goes through OptimizerStateAccess.)
  const Layout& layout() const { return layout_; }
  const ShardedOptimizerOptions& options() const { return options_; }
  // Bytes this rank holds, by role (the owner's state plus flat buffers).
  // With shard_gradients, grad_bytes is the owned gradients, the staging
  // arena once allocated, the most held at once in buffers of their own
  // (buckets that found no room; since the first step, whose buckets are
  // reduced in bucket order, not yet backward's), and the accumulation buffer
  // while SetGradientSync(false) micro-batches are being summed.
  MemoryReport memory() const;
  std::vector<TraceEvent> TakeTrace();

 private:
  friend class OptimizerStateAccess;
  OwnedSlice owned_slice(int bucket) { return owner_->owned_slice(bucket); }
  // After owned slices were overwritten (a restore): rewrites the bf16 copy,
  // all-gathers every bucket and sets the step count. Collective.
  absl::Status FinishRestore(int64_t step);
  absl::Status StageToHost() { return owner_->StageToHost(); }
  absl::Status EndStaging(bool copy_back) { return owner_->EndStaging(copy_back); }

  // What backward's hooks share with the optimizer: one lock for everything
  // they touch (members marked ABSL_GUARDED_BY(hook_state_->mu)), and the
  // optimizer they call while it lives (the destructor clears owner under mu,
  // so a hook never runs on a destroyed optimizer).
  struct HookState {
    absl::Mutex mu;
    ShardedOptimizer* owner ABSL_GUARDED_BY(mu) = nullptr;
  };
  // For hooks, which lock their own copy of the shared_ptr: says that it is
  // the same mutex (checked at run time).
  void AssertHookLockHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK(hook_state_->mu) {
    hook_state_->mu.AssertHeld();
  }
  using Region = StagingArena::Region;  // of the shard_gradients staging arena
  ShardedOptimizer(ShardedOptimizerOptions options, Communicator* comm, Layout layout);
  absl::Status Init(const std::vector<std::pair<std::string, torch::Tensor>>& params);
  absl::Status CheckSameModelOnAllRanks();
  absl::Status BroadcastInitialValues();
  absl::Status CreateShardOwner();
  absl::Status InstallHooks(const std::vector<std::pair<std::string, torch::Tensor>>& params);
  void OnGradReady(int param) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  void BeforeGradLocked(int param) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  absl::Status LaunchHyperAgreement();
  absl::Status FinishHyperAgreement(int64_t step);
  absl::Status BroadcastText(const std::string& mine, const char* what, std::string* theirs);
  absl::StatusOr<std::string> ShareDetail(const std::string& mine, const char* what);
  void BucketCompleteLocked(int bucket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  void LaunchReadyBucketsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  absl::Status AgreeLaunchOrder();
  void SizeStagingAfterSecondStepLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  void LaunchReduceScatterLocked(int bucket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  // shard_gradients (all with hook_state_->mu held).
  void PrepareShardedGradients();
  void OnShardedGradReadyLocked(int param, torch::Tensor grad)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  void AcquireStagingLocked(int bucket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  std::vector<torch::Tensor> StagedChunks(int bucket, const torch::Tensor& buf);
  void CompactStagingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  int64_t StageLength(int bucket) const;
  bool PlaceLocked(int64_t length, int64_t* begin) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  std::vector<Region> PieceRegionsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  void FreeStagingLocked(int bucket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  // Calls fn(chunk slice, offset into the range, length) for each chunk that
  // elements [offset, offset + length) of bucket `b` span.
  template <typename Fn>
  void ForChunks(int bucket, int64_t offset, int64_t length, Fn fn)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  void WriteGradLocked(int bucket, int64_t offset, const torch::Tensor& flat)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  void ZeroGradRangeLocked(int bucket, int64_t offset, int64_t length)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  void LaunchShardedLocked(int bucket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  bool PiecewiseLocked(int bucket) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  void LaunchPiecesLocked(int bucket, const torch::Tensor& flat_grad)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  struct StagedPiece;
  void LaunchPieceLocked(const std::vector<void*>& chunks, int64_t count, StagedPiece piece)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  absl::Status TakeHookErrorLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  // Gives a staged collective `length` elements: a region of the arena
  // (waiting for reductions in flight while there is no room, compacting
  // filling buckets when nothing is in flight), else a buffer of its own
  // (counted). Returns the buffer; *region is set when it is in the arena.
  // in_arena false: a buffer of its own at once.
  torch::Tensor StageLocked(int64_t length, Region* region, torch::Tensor* own_buffer,
                            bool in_arena) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  void ReleaseOwnBufferLocked(torch::Tensor* own_buffer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  absl::Status WaitPieceLocked(size_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  absl::Status FailStagingLocked(const absl::Status& s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  void AbandonChunksLocked(int bucket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  absl::Status ReclaimLocked(int bucket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  void ReclaimFinishedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  void ResetBackwardStateLocked(bool needs_zero_grad)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  void ReclaimOldestLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  void ReleaseShardedBuffersLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  void UpdateGradBytesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  torch::Tensor AccumView(int param) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  void Trace(TraceEvent::Kind kind, int bucket, int param)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  // order_agreed_, read under the lock (the training thread writes it).
  bool OrderAgreed() const;
  absl::Status WaitOrAbort(const CommHandlePtr& handle, const char* what, int bucket);
  // Step()'s stages.
  absl::Status BeginStep();
  // Marks the parameters this rank has a gradient for (torch.optim updates
  // a parameter iff its .grad is not None); agreed in LaunchHyperAgreement.
  void MarkActiveLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hook_state_->mu);
  // active_ from the agreement's result.
  void ReadActive();
  // Waits for the step's agreement unless bucket `bucket` (-1: none) can be
  // updated on this rank's own marks (every owned parameter has a gradient
  // here); fails on a disagreement.
  absl::Status AgreeIfNeeded(int bucket);
  absl::Status FinishReduce(int bucket, double* local_sq);
  absl::Status UpdateAndGather(int bucket, int64_t step, int64_t* update_ns);
  absl::StatusOr<double> GlobalNorm(double local_sq);
  absl::Status LaunchGlobalNorm(double local_sq);
  absl::StatusOr<double> FinishGlobalNorm();
  bool ClipGradients(double grad_norm);
  // device_async_step: the norm and clipping as device values.
  absl::Status GlobalNormOnDevice(double local_sq, bool clip, StepResult* result);
  absl::Status LaunchNormOnDevice(double local_sq);
  absl::Status FinishNormOnDevice(bool clip, StepResult* result);
  void RecordNormReading(int64_t step, const torch::Tensor& norm, const torch::Tensor& coef,
                         StepResult* result);
  // Orders the device after `handle` (device_async_step) and remembers it,
  // to check its outcome later; false: the caller waits on the host.
  bool Defer(const CommHandlePtr& handle, const char* what, int bucket);
  // Checks the collectives Defer() took: finished ones now, and waits for
  // those older than the previous step (all of them when `all`).
  absl::Status CheckDeferred(bool all);
  // The previous step's gathers before this step's updates write the buffer.
  absl::Status OrderPreviousGathers();
  absl::Status StepOverlapped(StepResult* result, int64_t* update_ns);
  absl::Status StepNormFirst(StepResult* result, int64_t* update_ns);
  absl::Status StepBucketByBucket(StepResult* result, int64_t* update_ns);
  absl::Status RunExternalUpdate(int64_t* update_ns);
  // Offset of bucket `bucket`'s owned range among this rank's ranges.
  int64_t OwnedOffset(int bucket) const;
  void EndStep(int64_t step);

  ShardedOptimizerOptions options_;
  Communicator* comm_;
  Layout layout_;
  const int rank_;
  const int world_;
  torch::ScalarType dtype_;
  torch::Device device_ = torch::kCPU;

  torch::Tensor param_flat_;    // model dtype, flat_size elements
  torch::Tensor grad_flat_;     // model dtype
  torch::Tensor comm_scratch_;  // bf16 gradients for communication, if converting
  std::unique_ptr<ShardOwner> owner_;

  std::vector<torch::Tensor> params_;      // the model's parameters (views)
  std::vector<torch::Tensor> grad_views_;  // their gradients: views of grad_flat_
  std::vector<std::shared_ptr<torch::autograd::Node>> grad_accumulators_;
  const std::shared_ptr<HookState> hook_state_;

  // Guarded by hook_state_->mu (written by backward hooks).
  std::vector<bool> ready_ ABSL_GUARDED_BY(hook_state_->mu);
  // Per parameter: a gradient arrived since the last ZeroGrad(set_to_none).
  std::vector<uint8_t> has_grad_ ABSL_GUARDED_BY(hook_state_->mu);
  std::vector<int> bucket_ready_count_ ABSL_GUARDED_BY(hook_state_->mu);
  std::vector<int> bucket_size_;
  std::vector<CommHandlePtr> rs_handles_ ABSL_GUARDED_BY(hook_state_->mu);
  std::vector<CommHandlePtr> ag_handles_;           // training thread only
  std::unordered_map<const void*, int> bucket_of_;  // parameter (TensorImpl) -> bucket
  CommHandlePtr norm_handle_;
  std::vector<double> norm_parts_;  // per rank: squared norm of its owned gradients
  int64_t grad_version_ ABSL_GUARDED_BY(hook_state_->mu) =
      -1;  // grad_flat_'s version after the last gradient arrived
  // Hash of the groups, its negation, then local_active_ (max over ranks).
  std::vector<float> hyper_buf_;
  std::string hyper_text_;  // what was hashed
  CommHandlePtr hyper_handle_;
  std::string detail_buf_;      // ShareDetail's all-gather (a member: it may outlive a timeout)
  int64_t gather_wait_ns_ = 0;  // gathers waited for outside Step()
  int next_launch_ ABSL_GUARDED_BY(hook_state_->mu) = 0;  // position in launch_order_
  // The order buckets are reduced in, the same on every rank: bucket order in
  // the first step, then the order rank 0's first backward completed them
  // (AgreeLaunchOrder). ready_order_ records it until then.
  std::vector<int> launch_order_ ABSL_GUARDED_BY(hook_state_->mu);
  std::vector<int> ready_order_ ABSL_GUARDED_BY(hook_state_->mu);
  bool order_agreed_ ABSL_GUARDED_BY(hook_state_->mu) =
      false;  // written by the training thread with mu held
  bool arena_sized_ ABSL_GUARDED_BY(hook_state_->mu) =
      false;  // shard_gradients: staging grown after the second step
  int64_t grads_seen_ ABSL_GUARDED_BY(hook_state_->mu) = 0;
  bool sync_ ABSL_GUARDED_BY(hook_state_->mu) = true;
  bool needs_zero_grad_ ABSL_GUARDED_BY(hook_state_->mu) = false;
  bool grad_after_step_ ABSL_GUARDED_BY(hook_state_->mu) = false;
  bool accumulated_while_syncing_ ABSL_GUARDED_BY(hook_state_->mu) = false;
  // FoldReducedGradients: a backward with sync on since the last fold /
  // ZeroGrad / Step (guarded by hook_state_->mu); the reduced owned
  // gradients kept aside (owned_elements(), the model's dtype) and whether
  // they count in this step.
  bool synced_backward_ ABSL_GUARDED_BY(hook_state_->mu) = false;
  torch::Tensor folded_;
  std::atomic<int64_t> folded_bytes_{0};  // read by memory() from other threads
  bool folded_pending_ = false;
  std::vector<TraceEvent> trace_ ABSL_GUARDED_BY(hook_state_->mu);

  // shard_gradients; guarded by hook_state_->mu.
  torch::Tensor owned_grad_flat_
      ABSL_GUARDED_BY(hook_state_->mu);  // this rank's ranges, bucket after bucket
  torch::Tensor accum_flat_
      ABSL_GUARDED_BY(hook_state_->mu);  // full size, only while accumulating (no_sync)
  DType comm_type_ = DType::kFloat32;    // type gradients travel in
  std::vector<std::vector<std::pair<int64_t, int64_t>>> gaps_;  // per bucket: padding runs
  bool split_own_ = false;  // this rank's chunk reduced in place in owned_grad_flat_
  torch::Tensor staging_
      ABSL_GUARDED_BY(hook_state_->mu);  // the arena, in comm_type_ (allocated at first use)
  StagingArena arena_ ABSL_GUARDED_BY(hook_state_->mu);  // the regions of staging_
  // A bucket of one tensor whose reduce-scatter does not fit a staging piece
  // is reduced in pieces of piece_elements_ of every rank's chunk, staged in
  // the arena while backward waits (PiecewiseLocked); pieces_ are those
  // launched and not yet waited for, oldest first.
  struct StagedPiece {
    int bucket = -1;
    Region region;      // in the arena, or
    torch::Tensor own;  // a buffer of its own (counted)
    CommHandlePtr handle;
  };
  std::deque<StagedPiece> pieces_ ABSL_GUARDED_BY(hook_state_->mu);
  int64_t piece_elements_ = 0;  // per rank; 0: no bucket is reduced in pieces
  std::vector<torch::Tensor> overflow_buf_
      ABSL_GUARDED_BY(hook_state_->mu);                          // per bucket: a buffer of its own
  int64_t overflow_bytes_ ABSL_GUARDED_BY(hook_state_->mu) = 0;  // held by overflow_buf_ now
  int64_t overflow_peak_bytes_ ABSL_GUARDED_BY(hook_state_->mu) = 0;  // the most ever held at once
  int64_t overflow_shortfall_ ABSL_GUARDED_BY(hook_state_->mu) =
      0;  // elements the arena's end lacked for one
  std::vector<std::vector<torch::Tensor>> chunks_
      ABSL_GUARDED_BY(hook_state_->mu);  // per bucket: its reduce-scatter's chunks
  std::vector<bool> in_accum_
      ABSL_GUARDED_BY(hook_state_->mu);  // chunks_[b] are accum_flat_'s (else chunks_[b][rank_] is
                                         // the owned gradient when split_own_)
  std::vector<bool> reclaimed_
      ABSL_GUARDED_BY(hook_state_->mu);  // reduced; owned range holds the result
  std::vector<int> in_flight_
      ABSL_GUARDED_BY(hook_state_->mu);  // launched, not reclaimed, in launch order
  std::vector<torch::Tensor> abandoned_
      ABSL_GUARDED_BY(hook_state_->mu);  // buffers of collectives that failed
  absl::Status hook_error_ ABSL_GUARDED_BY(hook_state_->mu);
  int64_t hook_wait_ns_ ABSL_GUARDED_BY(hook_state_->mu) =
      0;  // backward blocked on a reduction (exposed)
  std::atomic<int64_t> sharded_grad_bytes_{0};

  // device_async_step (training thread only).
  bool async_ = false;          // the option, on a device that can use it
  torch::Tensor norm_parts_t_;  // float64 [world] on device_: each rank's squared norm
  torch::Tensor norm_host_;     // pinned float32 [2 slots][norm, coef] (GPU)
  std::unique_ptr<KernelBackend::Fence> norm_fence_[2];
  int64_t norm_step_[2] = {0, 0};
  GradNormReading last_norm_;  // the newest reading on the host
  DeferredCollectives deferred_;

  // This step's agreement on which parameters are updated (training thread).
  std::vector<float> local_active_;  // per parameter: 1 if this rank has a gradient
  std::vector<uint8_t> active_;      // the agreed result (some rank has one), or this rank's
  bool agreed_ = true;               // active_ is the agreed result
  bool all_active_ = true;

  int64_t step_ = 0;
  int64_t wait_ns_ = 0;  // training thread only: time blocked in this Step()
};

// For checkpoint code only (client/checkpoint/): this rank's owned slices
// (master copies and optimizer state, written in place by a restore), the
// staging of GPU-resident state on the host around a save or restore
// (ShardOwner::StageToHost), and the collective that ends a restore. Kept out
// of ShardedOptimizer's public API: a trainer has no business with them.
class OptimizerStateAccess {
 public:
  explicit OptimizerStateAccess(ShardedOptimizer& opt) : opt_(opt) {}
  ShardedOptimizer::OwnedSlice owned_slice(int bucket) { return opt_.owned_slice(bucket); }
  absl::Status StageToHost() { return opt_.StageToHost(); }
  absl::Status EndStaging(bool copy_back) { return opt_.EndStaging(copy_back); }
  // Rewrites the model's copy from the restored master, all-gathers every
  // bucket and sets the step count. Collective.
  absl::Status FinishRestore(int64_t step) { return opt_.FinishRestore(step); }

 private:
  ShardedOptimizer& opt_;
};

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_SHARDED_OPTIMIZER_H_
