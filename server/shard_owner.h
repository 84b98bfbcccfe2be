// ShardOwner: the owner of this rank's partition of the optimizer.
//
// Rank r owns range r of every bucket of the Layout (common/layout.h). For
// those owned slices the ShardOwner holds the fp32 master copy (for bf16
// models; fp32 models are updated in place in the flat parameter buffer),
// the optimizer state (Adam's exp_avg/exp_avg_sq, SGD's momentum buffer),
// the hyper-parameters of every parameter group, and applies the fused update
// of a bucket's slice through the KernelBackend it was built with (CPU SIMD or
// CUDA). It also stages its slices to host memory for checkpoints and reports
// the bytes it holds. Its gRPC face is server/shard_owner_service.h.
//
// It owns no communication: client/sharded_optimizer.h reduce-scatters
// gradients into the owned slices, calls Update(bucket), and all-gathers.
//
// Not thread-safe; the trainer's thread drives it. `owned_elements()`,
// `memory()` and the hyper-parameter getters may be read from other threads
// (the gRPC service) since they only read values fixed at construction or
// guarded by an internal lock.
#ifndef SHARDOPT_SERVER_SHARD_OWNER_H_
#define SHARDOPT_SERVER_SHARD_OWNER_H_

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/layout.h"
#include "server/kernels/kernel_backend.h"
#include "common/optimizer_config.h"

namespace shardopt {

// Bytes a rank holds, by role.
struct MemoryReport {
  int64_t master_bytes = 0;  // fp32 master copy of owned bf16 parameters
  int64_t state_bytes = 0;   // optimizer state of owned slices
  int64_t grad_bytes = 0;    // gradient buffers (+ comm scratch)
  int64_t param_bytes = 0;   // flat parameter buffer
  int64_t total() const { return master_bytes + state_bytes + grad_bytes + param_bytes; }
};

struct ShardOwnerOptions {
  OptimizerKind kind = OptimizerKind::kAdam;
  // One entry per parameter group (at least one). For Adam/AdamW,
  // decoupled_weight_decay is set from `kind`.
  std::vector<HyperParameters> groups{HyperParameters{}};
  // Group of every parameter of the layout (by index); empty: all in group 0.
  std::vector<int> param_group;
  // false: `grad_flat` given to Create is a full flat buffer and the owner
  // reads its owned ranges. true (gradient sharding, ZeRO-2): it holds only
  // this rank's ranges, bucket after bucket (owned_elements() elements).
  bool owned_grads_only = false;
};

class ShardOwner {
 public:
  // Owns rank `rank`'s slices of `layout`'s buckets. `param_flat` and
  // `grad_flat` are the flat, bucket-ordered buffers (model dtype, float32 or
  // bfloat16, layout.flat_size() elements, on the backend's device; with
  // options.owned_grads_only `grad_flat` has only the owned ranges); they
  // must outlive the owner. Master copies are taken from `param_flat` now.
  // Errors: bad hyper-parameters or groups, buffers that do not match the
  // layout, a backend for another device.
  static absl::StatusOr<std::unique_ptr<ShardOwner>> Create(const Layout& layout, int rank,
                                                            ShardOwnerOptions options,
                                                            torch::Tensor param_flat,
                                                            torch::Tensor grad_flat,
                                                            std::shared_ptr<KernelBackend> backend);

  // The fused update of bucket `bucket`'s owned slice, step number `step`
  // (>= 1): reads the reduced gradient from the owned range of grad_flat,
  // writes parameters (the model copy too for bf16 models) and state.
  // Every owned parameter takes its step (see param_step()); all of them
  // must be at step - 1.
  absl::Status Update(int bucket, int64_t step);
  // The same with torch.optim's rule for missing gradients: only parameters
  // with active[param] != 0 (by layout index) are updated and their step
  // counts advanced; each is updated at its own count + 1 (Adam's bias
  // correction, SGD's first momentum step), as torch.optim keeps
  // state['step'] per parameter. When every parameter is active and at the
  // same count this is Update(bucket, count + 1).
  absl::Status Update(int bucket, const std::vector<uint8_t>& active);
  // True when every parameter with a piece in this rank's range of bucket
  // `bucket` has active[param] != 0.
  bool AllActive(int bucket, const std::vector<uint8_t>& active) const;
  // Zeroes the owned gradients of the inactive parameters of bucket
  // `bucket` (what no rank produced this step must not count in the norm).
  void ZeroInactiveGradients(int bucket, const std::vector<uint8_t>& active);
  // Updates the owned pieces of parameter `param` (layout index) received:
  // torch.optim's per-parameter state['step'].
  int64_t param_step(int param) const { return param_steps_[param]; }
  // Sets every parameter's count (a restore), or one parameter's.
  void SetParamSteps(int64_t step);
  void SetParamStep(int param, int64_t step) { param_steps_[param] = step; }
  // Sum of squares of the owned gradients of every bucket (this rank's part
  // of the global gradient norm).
  absl::StatusOr<double> SquaredGradNorm();
  // The same for one bucket's owned gradients.
  absl::StatusOr<double> SquaredGradNorm(int bucket);
  // The same sum written to `*out`: device memory for a device backend
  // (enqueued; the host does not wait), host memory otherwise.
  absl::Status SquaredGradNormTo(double* out);
  // Multiplies every owned gradient by `coef` (gradient clipping).
  void ScaleGradients(double coef);
  // The same by a one-element float32 tensor on the gradients' device (the
  // coefficient never visits the host).
  void ScaleGradients(const torch::Tensor& coef);
  // This rank's range of bucket `bucket` in a flat buffer.
  torch::Tensor OwnedRange(const torch::Tensor& flat, int bucket) const;
  // The reduced gradient of bucket `bucket`'s owned range (in grad_flat).
  torch::Tensor owned_grad(int bucket) const;

  // Hyper-parameters, by group. SetGroup validates; the optimizer kind, and
  // whether SGD keeps a momentum buffer, cannot change.
  OptimizerKind kind() const { return kind_; }
  int num_groups() const;
  HyperParameters group(int g) const;
  absl::Status SetGroup(int g, const HyperParameters& hp);
  // Sets the learning rate of every group. InvalidArgument (nothing changed)
  // unless ValidateHyperParameter(kLearningRate, lr) is ok.
  absl::Status SetLearningRate(double lr);
  // Group 0's learning rate.
  double learning_rate() const;
  const std::vector<int>& param_group() const { return param_group_; }

  // For checkpoints. This rank's slice of bucket `b`: fp32 parameter values
  // (the master copy for bf16 models) and optimizer state,
  // capacity_per_rank elements each (state arrays null if unused). Host
  // pointers while staged.
  struct OwnedSlice {
    float* master = nullptr;
    float* state0 = nullptr;
    float* state1 = nullptr;
    int64_t size = 0;
  };
  OwnedSlice owned_slice(int bucket);
  // Names of the state arrays as torch.optim calls them: {"exp_avg",
  // "exp_avg_sq"} for Adam/AdamW, {"momentum_buffer"} for SGD with momentum.
  std::vector<std::string> state_names() const;
  // Device-resident slices: StageToHost() copies master values and state into
  // host buffers, which owned_slice() returns until EndStaging(copy_back):
  // true writes them back (a restore), false drops them (a save).
  absl::Status StageToHost();
  absl::Status EndStaging(bool copy_back);
  // After owned slices were overwritten (a restore): rewrites the model's
  // bf16 copy of bucket `bucket`'s owned range from the master copy.
  void WriteModelCopy(int bucket);

  // Elements this rank owns (all buckets' ranges, padding included).
  int64_t owned_elements() const { return owned_elements_; }
  // Master copy and optimizer state bytes (the rest is the optimizer's).
  MemoryReport memory() const;
  const KernelBackend& backend() const { return *backend_; }

 private:
  // A run of a bucket's owned range updated with one group's hyper-parameters.
  struct Segment {
    int64_t begin = 0;  // offset within the owned range
    int64_t size = 0;
    int group = 0;
  };
  ShardOwner(const Layout& layout, int rank, OptimizerKind kind);
  absl::Status Init(ShardOwnerOptions options, torch::Tensor param_flat, torch::Tensor grad_flat);
  // Init's parts: the owned offsets, pieces and segments of every bucket and
  // the parameters' step counts; then the state, master copy and slices.
  void InitPieces(int num_params);
  void InitState(size_t num_groups, bool sgd_momentum);
  UpdateSlice SliceOf(int bucket, int64_t begin, int64_t size);
  std::vector<UpdateSlice> WholeSlices();
  torch::Tensor MasterOf(int bucket) const;

  const Layout layout_;  // a copy: immutable and small
  const int rank_;
  const OptimizerKind kind_;
  std::shared_ptr<KernelBackend> backend_;
  bool bf16_ = false;
  bool owned_grads_only_ = false;
  torch::Tensor param_flat_, grad_flat_;
  torch::Tensor master_;               // fp32 owned slices (bf16 models)
  torch::Tensor state0_, state1_;      // fp32 owned slices
  std::vector<int64_t> owned_offset_;  // per bucket: offset of its slice in master_/state
  int64_t owned_elements_ = 0;
  std::vector<std::vector<Segment>> segments_;                 // per bucket
  std::vector<std::vector<std::vector<UpdateSlice>>> slices_;  // [bucket][group]
  std::vector<int> param_group_;
  std::vector<std::vector<Piece>> pieces_;  // per bucket: this rank's pieces
  std::vector<int64_t> param_steps_;        // per parameter (layout index)
  mutable absl::Mutex mu_;
  std::vector<HyperParameters> groups_ ABSL_GUARDED_BY(mu_);
  bool staged_ = false;
  torch::Tensor host_master_, host_state0_, host_state1_;
};

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_SHARD_OWNER_H_
