#include "client/full_gradient_reducer.h"

#include <ATen/ATen.h>

#include "common/status_macros.h"

namespace shardopt {
namespace {

bool IsAllZero(const torch::Tensor& t) {
  if (t.scalar_type() == torch::kFloat && t.is_contiguous() && t.is_cpu()) {
    const float* d = t.data_ptr<float>();
    const int64_t n = t.numel();
    for (int64_t i = 0; i < n; ++i) {
      if (d[i] != 0.0f) return false;
    }
    return true;
  }
  return !t.ne(0).any().item<bool>();
}

}  // namespace

FullGradientReducer::FullGradientReducer(const ReducerSetup& setup) : GradientReducer(setup) {
  const int64_t flat = layout_.flat_size();
  grad_flat_ = torch::zeros({flat}, setup_.options);
  if (c10::typeMetaToScalarType(setup_.options.dtype()) == torch::kFloat &&
      setup_.comm_type == DType::kBFloat16) {
    comm_scratch_ = torch::zeros({flat}, setup_.options.dtype(torch::kBFloat16));
  }
}

void FullGradientReducer::Attach(std::vector<torch::Tensor> params) {
  grad_views_.assign(params.size(), torch::Tensor());
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamPlacement& pl = layout_.placement(static_cast<int>(i));
    if (pl.bucket < 0) continue;
    const int64_t off = layout_.buckets()[pl.bucket].flat_offset + pl.bucket_offset;
    params[i].mutable_grad() = grad_flat_.narrow(0, off, pl.numel).view(params[i].sizes());
    grad_views_[i] = params[i].grad();
  }
  GradientReducer::Attach(std::move(params));
}

// The first gradient after a step that zero_grad() through the optimizer
// did not follow. model.zero_grad() (zeroes in place or sets None), or
// `p.grad = None` for every parameter, is a zero_grad() too: if every
// gradient is None or zero, this backward starts from zero as after
// ZeroGrad() (views left stale by None are zeroed). Otherwise gradients
// would be accumulated on top of the last step's, and Step() says so.
void FullGradientReducer::BeforeGradLocked(int /*param*/) {
  if (!needs_zero_grad_) return;
  std::vector<size_t> stale;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!grad_views_[i].defined()) continue;
    const torch::Tensor& g = params_[i].grad();
    if (!g.defined()) {
      stale.push_back(i);
    } else if (!IsAllZero(g)) {
      return;
    } else if (!g.is_same(grad_views_[i])) {
      stale.push_back(i);  // replaced by a zero tensor: as None
    }
  }
  at::NoGradGuard no_grad;
  for (size_t i : stale) grad_views_[i].zero_();
  ResetBackwardStateLocked(/*needs_zero_grad=*/false);
}

void FullGradientReducer::OnGradReadyLocked(int param) {
  const int b = layout_.placement(param).bucket;
  torch::Tensor& grad = params_[param].mutable_grad();
  if (!grad.is_same(grad_views_[param])) {
    // The gradient was set to None (module.zero_grad(set_to_none=True)) or
    // replaced, so autograd accumulated into a tensor of its own: it holds
    // exactly this backward's gradient. Take it into the flat buffer and make
    // the parameter's gradient the view again.
    at::NoGradGuard no_grad;
    if (grad.defined()) grad_views_[param].copy_(grad);
    grad = grad_views_[param];
  }
  has_grad_[param] = 1;
  tracer_->Add(TraceEvent::kGradReady, b, param);
  ++grads_seen_;
  grad_version_ = grad_flat_._version();
  if (needs_zero_grad_) {
    grad_after_step_ = true;
    return;
  }
  if (!sync_) return;
  if (ready_[param]) {
    // A second backward while this bucket may already be in reduction.
    accumulated_while_syncing_ = true;
    return;
  }
  ready_[param] = true;
  synced_backward_ = true;
  if (++bucket_ready_count_[b] == bucket_size_[b]) BucketCompleteLocked(b);
}

void FullGradientReducer::LaunchLocked(int b) {
  const Bucket& bk = layout_.buckets()[b];
  const int64_t size = bk.capacity_per_rank * world_;
  tracer_->Add(TraceEvent::kReduceScatterStart, b);
  CollectiveBucketScope tag(b);  // for the flight recorder
  if (comm_scratch_.defined()) {
    torch::Tensor dst = comm_scratch_.narrow(0, bk.flat_offset, size);
    dst.copy_(grad_flat_.narrow(0, bk.flat_offset, size));
    rs_handles_[b] = comm_->ReduceScatter(dst.data_ptr(), bk.capacity_per_rank, DType::kBFloat16,
                                          ReduceOp::kAverage);
    return;
  }
  const DType t = DTypeOf(grad_flat_.scalar_type());
  char* base = static_cast<char*>(grad_flat_.data_ptr()) + bk.flat_offset * DTypeSize(t);
  rs_handles_[b] = comm_->ReduceScatter(base, bk.capacity_per_rank, t, ReduceOp::kAverage);
}

absl::Status FullGradientReducer::CheckGradsUnchangedLocked() {
  if (grad_version_ >= 0 && grad_flat_._version() != grad_version_) {
    return absl::FailedPreconditionError(
        "the gradients were changed between backward and step() (torch.nn.utils."
        "clip_grad_norm_, GradScaler.unscale_, a DistributedDataParallel wrapper, or other code "
        "writing to .grad): shardopt reduces each gradient during backward, so the change is "
        "lost or applied twice; clip with max_grad_norm= and do not wrap the model in DDP");
  }
  return absl::OkStatus();
}

bool FullGradientReducer::DropStaleLocked(int p) {
  if (params_[p].grad().defined()) return false;
  // p.grad = None and no backward reached it since: what the flat buffer
  // holds is stale; contribute zeros, as DDP does for it.
  at::NoGradGuard no_grad;
  grad_views_[p].zero_();
  grad_version_ = grad_flat_._version();
  return true;
}

void FullGradientReducer::ResetBackwardStateLocked(bool needs_zero_grad) {
  GradientReducer::ResetBackwardStateLocked(needs_zero_grad);
  grad_version_ = -1;
}

int64_t FullGradientReducer::OwnedOffset(int bucket) const {
  int64_t at = 0;
  for (int b = 0; b < bucket; ++b) at += layout_.buckets()[b].capacity_per_rank;
  return at;
}

void FullGradientReducer::ZeroGrad(bool set_to_none) {
  if (set_to_none) ClearHasGrad();
  std::vector<CommHandlePtr> in_flight;
  {
    absl::MutexLock lock(&hooks_->mu);
    in_flight = rs_handles_;
  }
  // A reduction launched by a backward whose step never came must finish
  // before its buffer is cleared.
  for (const auto& h : in_flight) {
    if (h) (void)h->Wait(setup_.timeout);
  }
  absl::MutexLock lock(&hooks_->mu);
  {
    at::NoGradGuard no_grad;
    grad_flat_.zero_();
  }
  ResetBackwardStateLocked(/*needs_zero_grad=*/false);
  folded_pending_ = false;
}

absl::Status FullGradientReducer::FoldReducedGradients(WaitFn wait) {
  at::NoGradGuard no_grad;
  const int nb = num_buckets();
  std::vector<CommHandlePtr> handles;
  bool pending = false;
  {
    absl::MutexLock lock(&hooks_->mu);
    if (!synced_backward_ || needs_zero_grad_) return absl::OkStatus();
    SHARDOPT_RETURN_IF_ERROR(TakeHookErrorLocked());
    // Buckets the backward did not complete (unused parameters) are reduced
    // now, in the agreed order, as BeginStep would.
    while (next_launch_ < nb) LaunchLocked(launch_order_[next_launch_++]);
    handles = rs_handles_;
    pending = folded_pending_;
  }
  if (!folded_.defined()) {
    folded_ = torch::zeros({owner_->owned_elements()}, grad_flat_.options());
    folded_bytes_ = folded_.numel() * folded_.element_size();
  } else if (!pending) {
    folded_.zero_();
  }
  for (int b = 0; b < nb; ++b) {
    if (handles[b] != nullptr) SHARDOPT_RETURN_IF_ERROR(wait(handles[b], b));
    torch::Tensor g = owner_->owned_grad(b);
    if (comm_scratch_.defined()) g.copy_(owner_->OwnedRange(comm_scratch_, b));
    folded_.narrow(0, OwnedOffset(b), g.numel()).add_(g);
  }
  absl::MutexLock lock(&hooks_->mu);
  grad_flat_.zero_();
  ResetBackwardStateLocked(/*needs_zero_grad=*/false);
  if (!order_agreed_) ready_order_.clear();  // the next backward records it again
  folded_pending_ = true;
  return absl::OkStatus();
}

// Its owned range of grad_flat_ then holds the averaged gradient (plus what
// FoldReducedGradients kept aside).
absl::Status FullGradientReducer::FinishBucket(int b, WaitFn wait, CollectiveWaiter* /*waiter*/) {
  CommHandlePtr handle;
  {
    absl::MutexLock lock(&hooks_->mu);
    handle = rs_handles_[b];
  }
  SHARDOPT_RETURN_IF_ERROR(wait(handle, b));
  bool pending = false;
  {
    absl::MutexLock lock(&hooks_->mu);
    tracer_->Add(TraceEvent::kReduceScatterDone, b);
    pending = folded_pending_;
  }
  torch::Tensor g = owner_->owned_grad(b);
  if (comm_scratch_.defined()) g.copy_(owner_->OwnedRange(comm_scratch_, b));
  if (pending) g.add_(folded_.narrow(0, OwnedOffset(b), g.numel()));
  return absl::OkStatus();
}

int64_t FullGradientReducer::grad_bytes() const {
  auto bytes = [](const torch::Tensor& t) {
    return t.defined() ? t.numel() * t.element_size() : 0;
  };
  return bytes(grad_flat_) + bytes(comm_scratch_) + folded_bytes_.load();
}

}  // namespace shardopt
