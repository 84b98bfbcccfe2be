#include "client/gradient_reducer.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <functional>

#include "absl/strings/str_cat.h"

namespace shardopt {
namespace {

// Runs `fn` before autograd accumulates a parameter's gradient.
class LambdaPreHook : public torch::autograd::FunctionPreHook {
 public:
  explicit LambdaPreHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    fn_();
    return grads;
  }

 private:
  std::function<void()> fn_;
};

}  // namespace

GradientReducer::GradientReducer(const ReducerSetup& setup)
    : setup_(setup),
      layout_(*setup.layout),
      comm_(setup.comm),
      tracer_(setup.tracer),
      rank_(setup.comm->rank()),
      world_(setup.comm->world_size()),
      hooks_(std::make_shared<HookState>()) {}

void GradientReducer::Attach(std::vector<torch::Tensor> params) {
  params_ = std::move(params);
  const int nb = num_buckets();
  bucket_size_.assign(nb, 0);
  for (int b = 0; b < nb; ++b) {
    bucket_size_[b] = static_cast<int>(layout_.buckets()[b].params.size());
  }
  absl::MutexLock lock(&hooks_->mu);  // (no hook yet: for the analysis)
  ready_.assign(params_.size(), false);
  has_grad_.assign(params_.size(), 0);
  bucket_ready_count_.assign(nb, 0);
  launch_order_.resize(nb);
  for (int b = 0; b < nb; ++b) launch_order_[b] = b;
  rs_handles_.assign(nb, nullptr);
}

absl::Status GradientReducer::InstallHooks(ShardOwner* owner,
                                           const std::vector<std::string>& names) {
  owner_ = owner;
  const bool pre_hooks = wants_pre_hook();
  absl::MutexLock lock(&hooks_->mu);
  hooks_->reducer = this;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (layout_.placement(static_cast<int>(i)).bucket < 0) continue;
    std::shared_ptr<torch::autograd::Node> acc =
        torch::autograd::impl::grad_accumulator(params_[i]);
    if (!acc) {
      return absl::InternalError(
          absl::StrCat("no gradient accumulator for parameter '", names[i], "'"));
    }
    std::shared_ptr<HookState> state = hooks_;
    const int index = static_cast<int>(i);
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [state, index](const torch::autograd::variable_list& outputs,
                       const torch::autograd::variable_list&) {
          absl::MutexLock lock(&state->mu);
          if (state->reducer != nullptr) {
            state->reducer->AssertHeld();  // state is its hooks_
            state->reducer->OnGradReadyLocked(index);
          }
          return outputs;
        }));
    if (pre_hooks) {
      acc->add_pre_hook(std::make_unique<LambdaPreHook>([state, index] {
        absl::MutexLock lock(&state->mu);
        if (state->reducer == nullptr) return;
        state->reducer->AssertHeld();  // state is its hooks_
        state->reducer->BeforeGradLocked(index);
      }));
    }
    grad_accumulators_.push_back(std::move(acc));
  }
  return absl::OkStatus();
}

void GradientReducer::Detach() {
  std::vector<CommHandlePtr> in_flight;
  {
    absl::MutexLock lock(&hooks_->mu);
    hooks_->reducer = nullptr;
    in_flight = rs_handles_;
  }
  // Reductions still in flight use our buffers: let them finish (bounded).
  for (const auto& h : in_flight) {
    if (h) (void)h->Wait(setup_.timeout);
  }
}

void GradientReducer::SetGradientSync(bool enabled) {
  absl::MutexLock lock(&hooks_->mu);
  sync_ = enabled;
}

void GradientReducer::ClearHasGrad() {
  absl::MutexLock lock(&hooks_->mu);
  std::fill(has_grad_.begin(), has_grad_.end(), 0);
}

void GradientReducer::BucketCompleteLocked(int b) {
  if (!order_agreed_) ready_order_.push_back(b);
  LaunchReadyBucketsLocked();
}

void GradientReducer::LaunchReadyBucketsLocked() {
  // Buckets are reduced in launch_order_ on every rank, so collectives match
  // even when ranks finish buckets in different orders.
  const int nb = num_buckets();
  while (next_launch_ < nb) {
    const int b = launch_order_[next_launch_];
    if (bucket_ready_count_[b] != bucket_size_[b]) break;
    ++next_launch_;
    LaunchLocked(b);
  }
}

void GradientReducer::ResetBackwardStateLocked(bool needs_zero_grad) {
  std::fill(ready_.begin(), ready_.end(), false);
  std::fill(bucket_ready_count_.begin(), bucket_ready_count_.end(), 0);
  std::fill(rs_handles_.begin(), rs_handles_.end(), nullptr);
  next_launch_ = 0;
  grads_seen_ = 0;
  needs_zero_grad_ = needs_zero_grad;
  synced_backward_ = false;
  if (!needs_zero_grad) {
    grad_after_step_ = false;
    accumulated_while_syncing_ = false;
  }
}

absl::Status GradientReducer::TakeHookErrorLocked() {
  absl::Status s = hook_error_;
  hook_error_ = absl::OkStatus();
  return s;
}

// torch.optim skips a parameter whose .grad is None: never reached by a
// backward, or set to None (zero_grad(set_to_none=True), p.grad = None) and
// not reached since. DistributedDataParallel leaves the gradient of a
// parameter no rank used untouched, and gives one that some rank used the
// average (the others contributing zeros). So a parameter is updated iff
// some rank has a gradient for it: each rank marks its own here (before the
// remaining reductions are launched, so that what it contributes for the
// others is zeros), and the ranks take the maximum (RankAgreement).
absl::StatusOr<std::vector<float>> GradientReducer::BeginStep() {
  absl::MutexLock lock(&hooks_->mu);
  tracer_->Add(TraceEvent::kStepBegin);
  if (absl::Status s = TakeHookErrorLocked(); !s.ok()) return s;
  if (grad_after_step_) {
    return absl::FailedPreconditionError(
        "gradients were accumulated on top of the previous step's reduced gradients: zero "
        "them after step() and before the next backward (optimizer.zero_grad(), "
        "model.zero_grad() or p.grad = None; ZeroGrad() in C++)");
  }
  if (absl::Status s = CheckGradsUnchangedLocked(); !s.ok()) return s;
  if (accumulated_while_syncing_) {
    return absl::FailedPreconditionError(
        "several backward passes ran with gradient sync on, so buckets were reduced before "
        "all gradients were accumulated: run all micro-batches but the last inside "
        "`with optimizer.no_sync():` (SetGradientSync(false) in C++), or pass module= (Python; "
        "FoldReducedGradients() before each forward in C++) to accumulate as DDP does");
  }
  if (grads_seen_ == 0 && !HasFoldedLocked()) {
    return absl::FailedPreconditionError(
        "Step() called without a backward pass since the last step (no gradient arrived)");
  }
  const int n = static_cast<int>(params_.size());
  std::vector<float> local_active(n, 0.0f);
  for (int p = 0; p < n; ++p) {
    if (layout_.placement(p).bucket < 0) continue;  // frozen
    const bool has = has_grad_[p] != 0 && !DropStaleLocked(p);
    local_active[p] = has ? 1.0f : 0.0f;
  }
  const int nb = num_buckets();
  while (next_launch_ < nb) LaunchLocked(launch_order_[next_launch_++]);
  // A reduction failed while a launch waited for staging.
  if (absl::Status s = TakeHookErrorLocked(); !s.ok()) return s;
  return local_active;
}

void GradientReducer::EndStep() {
  absl::MutexLock lock(&hooks_->mu);
  ReleaseAfterStepLocked();
  ResetBackwardStateLocked(/*needs_zero_grad=*/true);
}

bool GradientReducer::order_agreed() const {
  absl::MutexLock lock(&hooks_->mu);
  return order_agreed_;
}

// Rank 0's proposal: the buckets its backward completed, in that order, then
// the rest in bucket order. Bucket order is reverse registration order, which
// is not backward's when parameters come in groups (weight decay / none) or a
// module registers layers out of forward order; reduced in bucket order, a
// bucket backward completes early would wait for one it completes last, and
// nothing would overlap backward (with shard_gradients, every such bucket
// would hold staging until then). DDP rebuilds its buckets after the first
// iteration for the same reason; here the layout stays and only the order of
// the reduce-scatters changes (results are the same bit for bit).
std::vector<int32_t> GradientReducer::ProposedLaunchOrder() const {
  const int nb = num_buckets();
  std::vector<int32_t> order;
  std::vector<bool> seen(nb, false);
  absl::MutexLock lock(&hooks_->mu);
  for (int b : ready_order_) {
    if (b >= 0 && b < nb && !seen[b]) {
      seen[b] = true;
      order.push_back(b);
    }
  }
  for (int b = 0; b < nb; ++b) {
    if (!seen[b]) order.push_back(b);
  }
  return order;
}

void GradientReducer::SetLaunchOrder(const std::vector<int32_t>& order) {
  absl::MutexLock lock(&hooks_->mu);
  launch_order_.assign(order.begin(), order.end());
  ready_order_.clear();
  order_agreed_ = true;
  OnOrderAgreedLocked();
}

int64_t GradientReducer::TakeHookWaitNs() {
  absl::MutexLock lock(&hooks_->mu);
  const int64_t ns = hook_wait_ns_;
  hook_wait_ns_ = 0;
  return ns;
}

}  // namespace shardopt
