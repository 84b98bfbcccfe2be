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

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <unordered_map>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/collective_waiter.h"
#include "client/comm/communicator.h"
#include "client/deferred_collectives.h"
#include "client/grad_norm.h"
#include "client/gradient_reducer.h"
#include "client/rank_agreement.h"
#include "client/trace.h"
#include "common/layout.h"
#include "common/optimizer_config.h"
#include "server/kernels/kernel_backend.h"
#include "server/shard_owner.h"

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
  // false: Create does not broadcast rank 0's values of the trainable
  // parameters (frozen ones still are), for a caller that restores every
  // parameter right after (a live resize, client/resize.h, whose restore
  // all-gathers them from their owners): one pass over the model saved.
  bool broadcast_initial_values = true;
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

  ShardedOptimizer(ShardedOptimizerOptions options, Communicator* comm, Layout layout);
  absl::Status Init(const std::vector<std::pair<std::string, torch::Tensor>>& params);
  ReducerSetup MakeReducerSetup();
  absl::Status BroadcastInitialValues();
  absl::Status CreateShardOwner();
  // Step()'s stages.
  absl::Status BeginStep();
  absl::Status AgreeIfNeeded(int bucket);
  absl::Status FinishReduce(int bucket, double* local_sq);
  absl::Status UpdateAndGather(int bucket, int64_t* update_ns);
  absl::Status AgreeLaunchOrder();
  absl::StatusOr<double> GlobalNorm(double local_sq);
  absl::Status FinishNormOnDevice(bool clip, StepResult* result);
  absl::Status GlobalNormOnDevice(double local_sq, bool clip, StepResult* result);
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
  void EndStep(int64_t step);

  ShardedOptimizerOptions options_;
  Communicator* comm_;
  Layout layout_;
  const int rank_;
  const int world_;
  torch::ScalarType dtype_;
  torch::Device device_ = torch::kCPU;
  // device_async_step, on a device that can use it.
  bool async_ = false;

  CollectiveWaiter waiter_;  // time blocked in this Step() (training thread)
  Tracer tracer_;
  RankAgreement agreement_;
  torch::Tensor param_flat_;  // model dtype, flat_size elements
  std::unique_ptr<GradientReducer> reducer_;
  std::unique_ptr<ShardOwner> owner_;
  std::unique_ptr<GradNorm> norm_;

  std::vector<torch::Tensor> params_;               // the model's parameters (views)
  std::vector<CommHandlePtr> ag_handles_;           // per bucket: its all-gather in flight
  std::unordered_map<const void*, int> bucket_of_;  // parameter (TensorImpl) -> bucket
  int64_t gather_wait_ns_ = 0;                      // gathers waited for outside Step()
  DeferredCollectives deferred_;                    // device_async_step
  int64_t step_ = 0;
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
