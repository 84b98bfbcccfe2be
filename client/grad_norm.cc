#include "client/grad_norm.h"

#include <cmath>
#include <limits>

#include "common/status_macros.h"

namespace shardopt {

GradNorm::GradNorm(CollectiveWaiter* waiter, ShardOwner* owner, KernelBackend* backend,
                   torch::Device device, double max_grad_norm, bool on_device_values)
    : waiter_(waiter),
      comm_(waiter->comm()),
      owner_(owner),
      backend_(backend),
      device_(device),
      max_grad_norm_(max_grad_norm),
      async_(on_device_values),
      rank_(waiter->comm()->rank()),
      world_(waiter->comm()->world_size()) {
  if (async_) {
    parts_t_ = torch::zeros({world_}, torch::TensorOptions().device(device_).dtype(torch::kDouble));
    if (!device_.is_cpu()) {
      host_ = torch::zeros({2, 2}, torch::TensorOptions().dtype(torch::kFloat).pinned_memory(true));
    }
  }
}

GradNorm::~GradNorm() {
  if (handle_) (void)handle_->Wait(waiter_->timeout());
}

absl::Status GradNorm::Launch(double local_sq) {
  if (!device_.is_cpu()) {
    SHARDOPT_ASSIGN_OR_RETURN(local_sq, owner_->SquaredGradNorm());
  }
  // Each rank's double, gathered and summed in rank order on every rank (the
  // same bits everywhere; a float sum lost ~1e-7 relative per rank).
  parts_.assign(world_, 0.0);
  parts_[rank_] = local_sq;
  handle_ = comm_->AllGather(parts_.data(), sizeof(double), DType::kByte);
  return absl::OkStatus();
}

absl::StatusOr<double> GradNorm::Finish() {
  SHARDOPT_RETURN_IF_ERROR(waiter_->Wait(handle_, "gradient norm"));
  handle_ = nullptr;
  double sum = 0.0;
  for (double part : parts_) sum += part;
  return std::sqrt(sum);
}

bool GradNorm::Clip(double grad_norm) {
  // torch.nn.utils.clip_grad_norm_'s arithmetic, in float32 as it does it:
  // max_norm * reciprocal(total_norm + 1e-6), clamped to 1.
  const float denom = static_cast<float>(grad_norm) + 1e-6f;
  const float coef = (1.0f / denom) * static_cast<float>(max_grad_norm_);
  if (coef >= 1.0f) return false;
  owner_->ScaleGradients(coef);
  return true;
}

// device_async_step: the local squared norm goes into a device scalar (on
// the CPU: the per-bucket sum the caller made, as without the option), is
// all-gathered, and the clipping coefficient is computed with
// clip_grad_norm_'s float arithmetic, max_norm * reciprocal(norm + 1e-6)
// clamped to 1, and applied, all without the host reading a value.
absl::Status GradNorm::LaunchOnDevice(double local_sq) {
  // Each rank's squared norm in double, in its slot; all-gathered and summed
  // in rank order on the device (the same bits as the host path).
  parts_t_.zero_();
  if (device_.is_cpu()) {
    parts_t_.data_ptr<double>()[rank_] = local_sq;
  } else {
    SHARDOPT_RETURN_IF_ERROR(owner_->SquaredGradNormTo(parts_t_.data_ptr<double>() + rank_));
  }
  handle_ = comm_->AllGather(parts_t_.data_ptr(), sizeof(double), DType::kByte);
  return absl::OkStatus();
}

absl::Status GradNorm::FinishOnDevice(bool clip, int64_t step, DeferFn defer, double* grad_norm,
                                      bool* clipped, bool* pending) {
  CommHandlePtr h = std::move(handle_);
  handle_ = nullptr;
  if (!defer(h, "gradient norm")) SHARDOPT_RETURN_IF_ERROR(waiter_->Wait(h, "gradient norm"));
  torch::Tensor sum = parts_t_.narrow(0, 0, 1).clone();
  for (int r = 1; r < world_; ++r) sum.add_(parts_t_.narrow(0, r, 1));
  torch::Tensor norm = sum.sqrt_().reshape({});  // double
  torch::Tensor coef;
  if (clip) {
    // clip_grad_norm_'s float arithmetic on the float norm, as Clip.
    coef = (norm.to(torch::kFloat) + 1e-6).reciprocal_().mul_(max_grad_norm_).clamp_max_(1.0);
    owner_->ScaleGradients(coef);
  }
  RecordReading(step, norm, coef, grad_norm, clipped, pending);
  return absl::OkStatus();
}

// The norm (and coefficient): read at once on the CPU; on a GPU copied into
// a pinned slot behind a fence, read by Last() / Ready().
void GradNorm::RecordReading(int64_t step, const torch::Tensor& norm, const torch::Tensor& coef,
                             double* grad_norm, bool* clipped, bool* pending) {
  if (device_.is_cpu()) {  // the caller records it as last_, as without the option
    *grad_norm = norm.item<double>();
    *clipped = coef.defined() && !(coef.item<float>() >= 1.0f);
    return;
  }
  const int slot = static_cast<int>(step & 1);
  const torch::Tensor norm_f = norm.to(torch::kFloat);
  torch::Tensor both = torch::stack({norm_f, coef.defined() ? coef : torch::ones_like(norm_f)});
  host_.select(0, slot).copy_(both, /*non_blocking=*/true);
  fence_[slot] = backend_->RecordFence();
  fence_step_[slot] = step;
  *grad_norm = std::numeric_limits<double>::quiet_NaN();
  *clipped = false;
  *pending = true;
}

absl::StatusOr<GradNormReading> GradNorm::Last(int64_t step) {
  if (step == 0 || (last_.step != step && fence_step_[step & 1] != step)) {
    return absl::FailedPreconditionError(
        "LastGradNorm: no step has run since the optimizer was created or restored");
  }
  if (last_.step == step) return last_;
  const int slot = static_cast<int>(step & 1);
  if (fence_[slot] == nullptr) return absl::InternalError("LastGradNorm: no fence for the norm");
  SHARDOPT_RETURN_IF_ERROR(fence_[slot]->Wait(waiter_->timeout()));
  std::optional<GradNormReading> r = Ready(step);
  if (!r.has_value() || r->step != step) return absl::InternalError("LastGradNorm: norm not ready");
  return *r;
}

std::optional<GradNormReading> GradNorm::Ready(int64_t step) {
  if (step == 0) return std::nullopt;
  if (!async_ || device_.is_cpu()) {
    if (last_.step != step) return std::nullopt;  // restored since
    return last_;
  }
  for (int64_t s : {step, step - 1}) {
    if (s <= 0) break;
    if (last_.step == s) return last_;
    const int slot = static_cast<int>(s & 1);
    if (fence_step_[slot] != s || fence_[slot] == nullptr || !fence_[slot]->Ready()) continue;
    const float* v = host_.select(0, slot).data_ptr<float>();
    last_.step = s;
    last_.grad_norm = v[0];
    last_.clipped = !(v[1] >= 1.0f);  // NaN: scaled, as Clip does
    return last_;
  }
  return std::nullopt;
}

}  // namespace shardopt
