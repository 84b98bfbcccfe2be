#include "client/sharded_optimizer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <chrono>
#include <cmath>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/planner.h"
#include "common/status_macros.h"
#include "client/device_backend.h"
#include "server/cpu_kernels.h"

namespace shardopt {

const char* TraceEventName(TraceEvent::Kind kind) {
  switch (kind) {
    case TraceEvent::kGradReady: return "grad_ready";
    case TraceEvent::kReduceScatterStart: return "reduce_scatter_start";
    case TraceEvent::kReduceScatterDone: return "reduce_scatter_done";
    case TraceEvent::kUpdateDone: return "update_done";
    case TraceEvent::kAllGatherStart: return "all_gather_start";
    case TraceEvent::kAllGatherDone: return "all_gather_done";
    case TraceEvent::kStepBegin: return "step_begin";
    case TraceEvent::kStepEnd: return "step_end";
  }
  return "unknown";
}

// Shared with the backward hooks, which may outlive the optimizer (autograd
// keeps them on the parameters' gradient accumulators).
struct ShardedOptimizer::HookState {
  absl::Mutex mu;
  ShardedOptimizer* owner ABSL_GUARDED_BY(mu) = nullptr;
};

namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

ElementType ElementTypeOf(torch::ScalarType t) {
  return t == torch::kBFloat16 ? ElementType::kBFloat16 : ElementType::kFloat32;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// One line per fact that must agree across ranks; the first differing line
// names what differs.
std::string DescribeModel(const Layout& layout, const ShardedOptimizerOptions& o) {
  std::string out = absl::StrCat("options optimizer=", OptimizerKindName(o.kind),
                                 " bucket_cap=", o.plan.bucket_cap_elements,
                                 " alignment=", o.plan.alignment_elements,
                                 " allow_cut=", o.plan.allow_cut,
                                 " grad_comm=", ElementTypeName(o.grad_comm_type),
                                 " max_grad_norm=", o.max_grad_norm, "\n");
  for (const ParamSpec& p : layout.params()) {
    absl::StrAppend(&out, "param ", p.name, "\t", ShapeString(p.shape), " ", DTypeName(p.dtype),
                    p.trainable ? " trainable" : " frozen", "\n");
  }
  absl::StrAppend(&out, "count ", layout.params().size(), "\n");
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShardedOptimizer>> ShardedOptimizer::Create(
    const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters,
    const ShardedOptimizerOptions& options, Communicator* comm) {
  if (comm == nullptr) return absl::InvalidArgumentError("no communicator");
  ShardedOptimizerOptions opt = options;
  if (opt.kind == OptimizerKind::kSgd) {
    SHARDOPT_RETURN_IF_ERROR(ValidateSgdConfig(opt.sgd));
  } else {
    opt.adam.decoupled_weight_decay = opt.kind == OptimizerKind::kAdamW;
    SHARDOPT_RETURN_IF_ERROR(ValidateAdamConfig(opt.adam));
  }
  if (!(opt.max_grad_norm >= 0.0) || !std::isfinite(opt.max_grad_norm)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_grad_norm must be >= 0 and finite, got ", opt.max_grad_norm));
  }
  if (opt.kernel_threads < 0) return absl::InvalidArgumentError("kernel_threads must be >= 0");
  if (opt.timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("timeout must be > 0");
  if (opt.grad_comm_type == ElementType::kByte) {
    return absl::InvalidArgumentError("gradients travel as float32 or bfloat16");
  }
  if (named_parameters.empty()) return absl::InvalidArgumentError("the model has no parameters");

  std::vector<ParamSpec> specs;
  torch::ScalarType dtype = torch::kFloat;
  bool have_dtype = false;
  for (const auto& [name, t] : named_parameters) {
    if (!t.defined()) {
      return absl::InvalidArgumentError(absl::StrCat("parameter '", name, "' is undefined"));
    }
    if (!t.device().is_cpu() && !t.device().is_cuda()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", name, "' is on device ", t.device().str(),
          "; supported: cpu, cuda (all parameters on one device)"));
    }
    if (t.device().is_cuda() && CudaBackend() == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", name, "' is on ", t.device().str(),
          " but no CUDA backend is linked (link //client:cuda_backend)"));
    }
    if (t.device() != named_parameters.front().second.device()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", name, "' is on ", t.device().str(), ", the first on ",
          named_parameters.front().second.device().str(), ": all parameters must share a device"));
    }
    if (t.scalar_type() != torch::kFloat && t.scalar_type() != torch::kBFloat16) {
      return absl::InvalidArgumentError(absl::StrCat("parameter '", name, "' has dtype ",
                                                      c10::toString(t.scalar_type()),
                                                      "; supported: float32, bfloat16"));
    }
    if (!t.is_contiguous()) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", name, "' is not contiguous (call .contiguous() on it "
                       "before building the optimizer)"));
    }
    ParamSpec s;
    s.name = name;
    s.shape = t.sizes().vec();
    s.dtype = t.scalar_type() == torch::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
    s.trainable = t.requires_grad();
    if (s.trainable) {
      if (have_dtype && t.scalar_type() != dtype) {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter '", name, "' is ", c10::toString(t.scalar_type()),
                         " but earlier ones are ", c10::toString(dtype),
                         "; all trainable parameters must share one dtype"));
      }
      dtype = t.scalar_type();
      have_dtype = true;
    }
    specs.push_back(std::move(s));
  }
  if (dtype == torch::kBFloat16 && opt.grad_comm_type != ElementType::kBFloat16) {
    opt.grad_comm_type = ElementType::kBFloat16;  // bf16 gradients travel as they are
  }
  auto layout = Plan(specs, comm->world_size(), opt.plan);
  if (!layout.ok()) {
    return absl::Status(layout.status().code(),
                        absl::StrCat("cannot partition the model: ", layout.status().message()));
  }
  std::unique_ptr<ShardedOptimizer> o(new ShardedOptimizer(opt, comm, std::move(*layout)));
  o->dtype_ = dtype;
  o->device_ = named_parameters.front().second.device();
  SHARDOPT_RETURN_IF_ERROR(o->Init(named_parameters));
  return o;
}

ShardedOptimizer::ShardedOptimizer(ShardedOptimizerOptions options, Communicator* comm,
                                   Layout layout)
    : options_(std::move(options)),
      comm_(comm),
      layout_(std::move(layout)),
      rank_(comm->rank()),
      world_(comm->world_size()),
      hook_state_(std::make_shared<HookState>()) {}

ShardedOptimizer::~ShardedOptimizer() {
  {
    absl::MutexLock lock(&hook_state_->mu);
    hook_state_->owner = nullptr;
  }
  // Reductions still in flight use our buffers: let them finish (bounded).
  for (const auto& h : rs_handles_) {
    if (h) (void)h->Wait(options_.timeout);
  }
}

absl::Status ShardedOptimizer::WaitOrAbort(const CommHandlePtr& handle, const char* what,
                                           int bucket) {
  const int64_t t0 = NowNs();
  absl::Status s = handle->Wait(options_.timeout);
  wait_ns_ += NowNs() - t0;
  if (s.ok()) return s;
  comm_->Abort(s);
  return absl::Status(s.code(), absl::StrCat("rank ", rank_, ": ", what,
                                             bucket >= 0 ? absl::StrCat(" of bucket ", bucket) : "",
                                             " failed: ", s.message()));
}

absl::Status ShardedOptimizer::CheckSameModelOnAllRanks() {
  const std::string mine = DescribeModel(layout_, options_);
  int64_t len = static_cast<int64_t>(mine.size());
  // Host buffers: the communicator stages them where it moves device memory (NCCL).
  SHARDOPT_RETURN_IF_ERROR(
      WaitOrAbort(comm_->Broadcast(&len, sizeof(len), ElementType::kByte, 0), "model check", -1));
  if (len < 0 || len > (int64_t{1} << 30)) {
    return absl::DataLossError("model check: rank 0 sent a corrupt description length");
  }
  std::string theirs = rank_ == 0 ? mine : std::string(static_cast<size_t>(len), '\0');
  SHARDOPT_RETURN_IF_ERROR(WaitOrAbort(
      comm_->Broadcast(theirs.data(), len, ElementType::kByte, 0), "model check", -1));
  std::string detail;
  if (theirs != mine) {
    std::vector<std::string> a = absl::StrSplit(theirs, '\n');
    std::vector<std::string> b = absl::StrSplit(mine, '\n');
    for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
      const std::string x = i < a.size() ? a[i] : "(nothing)";
      const std::string y = i < b.size() ? b[i] : "(nothing)";
      if (x == y) continue;
      if (absl::StartsWith(x, "param ") || absl::StartsWith(y, "param ")) {
        const std::string name = (absl::StartsWith(x, "param ") ? x : y).substr(6);
        detail = absl::StrCat("model differs from rank 0's at parameter '",
                              name.substr(0, name.find('\t')), "': rank 0 has '", x,
                              "', rank ", rank_, " has '", y, "'");
      } else {
        detail = absl::StrCat("rank 0 has '", x, "', rank ", rank_, " has '", y, "'");
      }
      break;
    }
  }
  // Every rank learns whether any rank differs, so all fail together.
  float flag = detail.empty() ? 0.0f : 1.0f;
  SHARDOPT_RETURN_IF_ERROR(WaitOrAbort(
      comm_->AllReduce(&flag, 1, ElementType::kFloat32, ReduceOp::kMax), "model check", -1));
  if (!detail.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("layout hash mismatch, refusing to train: ", detail));
  }
  if (flag > 0.0f) {
    return absl::FailedPreconditionError(
        "layout hash mismatch, refusing to train: another rank's model differs from rank 0's "
        "(its error names the parameter)");
  }
  return absl::OkStatus();
}

absl::Status ShardedOptimizer::Init(
    const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters) {
  SHARDOPT_RETURN_IF_ERROR(CheckSameModelOnAllRanks());
  at::NoGradGuard no_grad;
  const int64_t flat = layout_.flat_size();
  const auto on_device = torch::TensorOptions().device(device_);
  param_flat_ = torch::zeros({flat}, on_device.dtype(dtype_));
  grad_flat_ = torch::zeros({flat}, on_device.dtype(dtype_));
  if (dtype_ == torch::kFloat && options_.grad_comm_type == ElementType::kBFloat16) {
    comm_scratch_ = torch::zeros({flat}, on_device.dtype(torch::kBFloat16));
  }
  const int nb = static_cast<int>(layout_.buckets().size());
  for (size_t i = 0; i < named_parameters.size(); ++i) {
    torch::Tensor p = named_parameters[i].second;
    params_.push_back(p);
    const ParamPlacement& pl = layout_.placement(static_cast<int>(i));
    if (pl.bucket < 0) continue;
    const int64_t off = layout_.buckets()[pl.bucket].flat_offset + pl.bucket_offset;
    torch::Tensor view = param_flat_.narrow(0, off, pl.numel).view(p.sizes());
    view.copy_(p);
    p.set_data(view);
    p.mutable_grad() = grad_flat_.narrow(0, off, pl.numel).view(p.sizes());
  }
  // Every rank starts from rank 0's values, as DDP does.
  const ElementType ptype = ElementTypeOf(dtype_);
  const int elem = ElementSize(ptype);
  char* pbase = static_cast<char*>(param_flat_.data_ptr());
  for (const Bucket& b : layout_.buckets()) {
    CollectiveBucketScope tag(b.index);  // for the flight recorder
    SHARDOPT_RETURN_IF_ERROR(WaitOrAbort(
        comm_->Broadcast(pbase + b.flat_offset * elem, b.capacity_per_rank * world_, ptype, 0),
        "initial parameter broadcast", b.index));
  }
  // Frozen parameters too (they are part of the model every rank must share).
  for (size_t i = 0; i < params_.size(); ++i) {
    if (layout_.placement(static_cast<int>(i)).bucket >= 0 || params_[i].numel() == 0) continue;
    torch::Tensor& p = params_[i];
    SHARDOPT_RETURN_IF_ERROR(WaitOrAbort(
        comm_->Broadcast(p.data_ptr(), p.numel(), ElementTypeOf(p.scalar_type()), 0),
        "initial broadcast of a frozen parameter", -1));
  }
  // Owned slices: rank r's range of every bucket.
  for (const Bucket& b : layout_.buckets()) {
    owned_offset_.push_back(owned_elements_);
    owned_elements_ += b.capacity_per_rank;
  }
  const auto f32 = torch::TensorOptions().device(device_).dtype(torch::kFloat);
  const bool adam = options_.kind != OptimizerKind::kSgd;
  if (adam || options_.sgd.momentum != 0.0) state0_ = torch::zeros({owned_elements_}, f32);
  if (adam) state1_ = torch::zeros({owned_elements_}, f32);
  if (dtype_ == torch::kBFloat16) {
    master_ = torch::empty({owned_elements_}, f32);
    for (int b = 0; b < nb; ++b) {
      const Bucket& bk = layout_.buckets()[b];
      master_.narrow(0, owned_offset_[b], bk.capacity_per_rank)
          .copy_(param_flat_.narrow(0, bk.flat_offset + rank_ * bk.capacity_per_rank,
                                    bk.capacity_per_rank));
    }
  }
  // Bookkeeping for the backward hooks.
  ready_.assign(params_.size(), false);
  bucket_ready_count_.assign(nb, 0);
  bucket_size_.assign(nb, 0);
  for (int b = 0; b < nb; ++b) bucket_size_[b] = static_cast<int>(layout_.buckets()[b].params.size());
  rs_handles_.assign(nb, nullptr);
  {
    absl::MutexLock lock(&hook_state_->mu);
    hook_state_->owner = this;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (layout_.placement(static_cast<int>(i)).bucket < 0) continue;
    std::shared_ptr<torch::autograd::Node> acc = torch::autograd::impl::grad_accumulator(params_[i]);
    if (!acc) {
      return absl::InternalError(
          absl::StrCat("no gradient accumulator for parameter '", named_parameters[i].first, "'"));
    }
    std::shared_ptr<HookState> state = hook_state_;
    const int index = static_cast<int>(i);
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [state, index](const torch::autograd::variable_list& outputs,
                       const torch::autograd::variable_list&) {
          absl::MutexLock lock(&state->mu);
          if (state->owner != nullptr) state->owner->OnGradReady(index);
          return outputs;
        }));
    grad_accumulators_.push_back(std::move(acc));
  }
  return absl::OkStatus();
}

void ShardedOptimizer::Trace(TraceEvent::Kind kind, int bucket, int param) {
  if (!options_.trace) return;
  trace_.push_back(TraceEvent{kind, bucket, param, NowNs()});
}

std::vector<TraceEvent> ShardedOptimizer::TakeTrace() {
  absl::MutexLock lock(&hook_state_->mu);
  std::vector<TraceEvent> out;
  out.swap(trace_);
  return out;
}

void ShardedOptimizer::OnGradReady(int param) {
  const int b = layout_.placement(param).bucket;
  Trace(TraceEvent::kGradReady, b, param);
  ++grads_seen_;
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
  if (++bucket_ready_count_[b] == bucket_size_[b]) LaunchReadyBucketsLocked();
}

void ShardedOptimizer::LaunchReadyBucketsLocked() {
  // Buckets are reduced in bucket order on every rank, so collectives match
  // even when ranks finish buckets in different orders.
  const int nb = static_cast<int>(bucket_size_.size());
  while (next_launch_ < nb && bucket_ready_count_[next_launch_] == bucket_size_[next_launch_]) {
    LaunchReduceScatterLocked(next_launch_++);
  }
}

void ShardedOptimizer::LaunchReduceScatterLocked(int b) {
  const Bucket& bk = layout_.buckets()[b];
  const int64_t size = bk.capacity_per_rank * world_;
  Trace(TraceEvent::kReduceScatterStart, b, -1);
  CollectiveBucketScope tag(b);  // for the flight recorder
  if (comm_scratch_.defined()) {
    torch::Tensor dst = comm_scratch_.narrow(0, bk.flat_offset, size);
    dst.copy_(grad_flat_.narrow(0, bk.flat_offset, size));
    rs_handles_[b] = comm_->ReduceScatter(dst.data_ptr(), bk.capacity_per_rank,
                                          ElementType::kBFloat16, ReduceOp::kAverage);
    return;
  }
  const ElementType t = ElementTypeOf(dtype_);
  char* base = static_cast<char*>(grad_flat_.data_ptr()) + bk.flat_offset * ElementSize(t);
  rs_handles_[b] = comm_->ReduceScatter(base, bk.capacity_per_rank, t, ReduceOp::kAverage);
}

void ShardedOptimizer::SetGradientSync(bool enabled) {
  absl::MutexLock lock(&hook_state_->mu);
  sync_ = enabled;
}

void ShardedOptimizer::SetLearningRate(double lr) {
  if (options_.kind == OptimizerKind::kSgd) {
    options_.sgd.lr = lr;
  } else {
    options_.adam.lr = lr;
  }
}

absl::Status ShardedOptimizer::SetHyperParameters(const AdamConfig& adam, const SgdConfig& sgd) {
  if (options_.kind == OptimizerKind::kSgd) {
    SHARDOPT_RETURN_IF_ERROR(ValidateSgdConfig(sgd));
    if ((sgd.momentum != 0.0) != (options_.sgd.momentum != 0.0)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "SGD momentum ", sgd.momentum, " cannot replace ", options_.sgd.momentum,
          ": one keeps a momentum buffer and the other does not"));
    }
    SgdConfig c = sgd;
    c.maximize = options_.sgd.maximize;
    options_.sgd = c;
  } else {
    SHARDOPT_RETURN_IF_ERROR(ValidateAdamConfig(adam));
    AdamConfig c = adam;
    c.decoupled_weight_decay = options_.adam.decoupled_weight_decay;
    c.maximize = options_.adam.maximize;
    options_.adam = c;
  }
  return absl::OkStatus();
}

double ShardedOptimizer::learning_rate() const {
  return options_.kind == OptimizerKind::kSgd ? options_.sgd.lr : options_.adam.lr;
}

void ShardedOptimizer::ZeroGrad() {
  std::vector<CommHandlePtr> in_flight;
  {
    absl::MutexLock lock(&hook_state_->mu);
    in_flight = rs_handles_;
  }
  // A reduction launched by a backward whose step never came must finish
  // before its buffer is cleared.
  for (const auto& h : in_flight) {
    if (h) (void)h->Wait(options_.timeout);
  }
  absl::MutexLock lock(&hook_state_->mu);
  {
    at::NoGradGuard no_grad;
    grad_flat_.zero_();
  }
  std::fill(ready_.begin(), ready_.end(), false);
  std::fill(bucket_ready_count_.begin(), bucket_ready_count_.end(), 0);
  std::fill(rs_handles_.begin(), rs_handles_.end(), nullptr);
  next_launch_ = 0;
  grads_seen_ = 0;
  needs_zero_grad_ = false;
  grad_after_step_ = false;
  accumulated_while_syncing_ = false;
}

absl::StatusOr<StepResult> ShardedOptimizer::Step() {
  at::NoGradGuard no_grad;
  const int nb = static_cast<int>(layout_.buckets().size());
  std::vector<CommHandlePtr> rs;
  {
    absl::MutexLock lock(&hook_state_->mu);
    Trace(TraceEvent::kStepBegin, -1, -1);
    if (grad_after_step_) {
      return absl::FailedPreconditionError(
          "gradients were accumulated on top of the previous step's reduced gradients: call "
          "ZeroGrad() after Step() and before the next backward");
    }
    if (accumulated_while_syncing_) {
      return absl::FailedPreconditionError(
          "several backward passes ran with gradient sync on, so buckets were reduced before "
          "all gradients were accumulated: call SetGradientSync(false) before all but the last "
          "backward");
    }
    if (grads_seen_ == 0) {
      return absl::FailedPreconditionError(
          "Step() called without a backward pass since the last step (no gradient arrived)");
    }
    // Buckets whose parameters got no gradient (unused in this step) are
    // reduced now with zero gradients, as DDP's find_unused_parameters does.
    while (next_launch_ < nb) LaunchReduceScatterLocked(next_launch_++);
    rs = rs_handles_;
  }
  const ElementType ptype = ElementTypeOf(dtype_);
  const int elem = ElementSize(ptype);
  char* pbase = static_cast<char*>(param_flat_.data_ptr());
  char* gbase = static_cast<char*>(grad_flat_.data_ptr());
  const int64_t step = step_ + 1;
  int64_t update_ns = 0;
  KernelOptions ko;
  ko.num_threads = options_.kernel_threads;

  auto owned_grad = [&](int b) {
    const Bucket& bk = layout_.buckets()[b];
    return grad_flat_.narrow(0, bk.flat_offset + rank_ * bk.capacity_per_rank,
                             bk.capacity_per_rank);
  };
  double local_sq = 0.0;
  const bool on_gpu = device_.is_cuda();
  auto finish_reduce = [&](int b) -> absl::Status {
    SHARDOPT_RETURN_IF_ERROR(WaitOrAbort(rs[b], "reduce-scatter", b));
    {
      absl::MutexLock lock(&hook_state_->mu);
      Trace(TraceEvent::kReduceScatterDone, b, -1);
    }
    torch::Tensor g = owned_grad(b);
    if (comm_scratch_.defined()) {
      const Bucket& bk = layout_.buckets()[b];
      g.copy_(comm_scratch_.narrow(0, bk.flat_offset + rank_ * bk.capacity_per_rank,
                                   bk.capacity_per_rank));
    }
    if (!on_gpu) {  // on a GPU one kernel takes the norm of every bucket (global_norm)
      const double norm = g.norm().item<double>();
      local_sq += norm * norm;
    }
    return absl::OkStatus();
  };
  // This rank's slice of bucket `b`: parameters (or master), gradients, state.
  auto owned_update_slice = [&](int b) {
    const Bucket& bk = layout_.buckets()[b];
    const int64_t off = bk.flat_offset + rank_ * bk.capacity_per_rank;
    UpdateSlice s;
    s.size = bk.capacity_per_rank;
    s.state0 = state0_.defined() ? state0_.data_ptr<float>() + owned_offset_[b] : nullptr;
    s.state1 = state1_.defined() ? state1_.data_ptr<float>() + owned_offset_[b] : nullptr;
    if (dtype_ == torch::kBFloat16) {
      s.param = master_.data_ptr<float>() + owned_offset_[b];
      s.grad_bf16 = reinterpret_cast<const uint16_t*>(gbase) + off;
      s.param_bf16 = reinterpret_cast<uint16_t*>(pbase) + off;
    } else {
      s.param = reinterpret_cast<float*>(pbase) + off;
      s.grad = reinterpret_cast<const float*>(gbase) + off;
    }
    return s;
  };
  std::vector<CommHandlePtr> ag(nb);
  auto update = [&](int b) -> absl::Status {
    const Bucket& bk = layout_.buckets()[b];
    UpdateSlice s = owned_update_slice(b);
    const int64_t t0 = NowNs();
    absl::Status st =
        on_gpu ? CudaBackend()->Update(options_.kind, options_.adam, options_.sgd, step, s)
        : options_.kind == OptimizerKind::kSgd ? SgdStep(options_.sgd, step, {&s, 1}, ko)
                                               : AdamStep(options_.adam, step, {&s, 1}, ko);
    update_ns += NowNs() - t0;
    if (!st.ok()) return st;
    {
      absl::MutexLock lock(&hook_state_->mu);
      Trace(TraceEvent::kUpdateDone, b, -1);
      Trace(TraceEvent::kAllGatherStart, b, -1);
    }
    CollectiveBucketScope tag(b);  // for the flight recorder
    ag[b] = comm_->AllGather(pbase + bk.flat_offset * elem, bk.capacity_per_rank, ptype);
    return absl::OkStatus();
  };
  auto global_norm = [&]() -> absl::StatusOr<double> {
    if (on_gpu) {
      std::vector<UpdateSlice> slices;
      for (int b = 0; b < nb; ++b) slices.push_back(owned_update_slice(b));
      SHARDOPT_ASSIGN_OR_RETURN(local_sq, CudaBackend()->SquaredNorm(slices));
    }
    float sq = static_cast<float>(local_sq);
    SHARDOPT_RETURN_IF_ERROR(WaitOrAbort(
        comm_->AllReduce(&sq, 1, ElementType::kFloat32, ReduceOp::kSum), "gradient norm", -1));
    return std::sqrt(static_cast<double>(sq));
  };

  StepResult result;
  result.step = step;
  wait_ns_ = 0;
  if (options_.max_grad_norm > 0.0) {
    for (int b = 0; b < nb; ++b) SHARDOPT_RETURN_IF_ERROR(finish_reduce(b));
    SHARDOPT_ASSIGN_OR_RETURN(result.grad_norm, global_norm());
    const double coef = options_.max_grad_norm / (result.grad_norm + 1e-6);
    if (coef < 1.0) {
      result.clipped = true;
      for (int b = 0; b < nb; ++b) owned_grad(b).mul_(coef);
    }
    for (int b = 0; b < nb; ++b) SHARDOPT_RETURN_IF_ERROR(update(b));
  } else {
    for (int b = 0; b < nb; ++b) {
      SHARDOPT_RETURN_IF_ERROR(finish_reduce(b));
      SHARDOPT_RETURN_IF_ERROR(update(b));
    }
    SHARDOPT_ASSIGN_OR_RETURN(result.grad_norm, global_norm());
  }
  for (int b = 0; b < nb; ++b) {
    SHARDOPT_RETURN_IF_ERROR(WaitOrAbort(ag[b], "all-gather", b));
    absl::MutexLock lock(&hook_state_->mu);
    Trace(TraceEvent::kAllGatherDone, b, -1);
  }
  result.comm_wait_seconds = wait_ns_ * 1e-9;
  result.update_seconds = update_ns * 1e-9;
  absl::MutexLock lock(&hook_state_->mu);
  std::fill(ready_.begin(), ready_.end(), false);
  std::fill(bucket_ready_count_.begin(), bucket_ready_count_.end(), 0);
  std::fill(rs_handles_.begin(), rs_handles_.end(), nullptr);
  next_launch_ = 0;
  grads_seen_ = 0;
  needs_zero_grad_ = true;
  step_ = step;
  Trace(TraceEvent::kStepEnd, -1, -1);
  return result;
}

absl::Status ShardedOptimizer::StageToHost() {
  if (staged_) return absl::FailedPreconditionError("owned slices are already staged");
  at::NoGradGuard no_grad;
  const auto cpu = torch::TensorOptions().dtype(torch::kFloat);
  host_master_ = torch::empty({owned_elements_}, cpu);
  for (const Bucket& b : layout_.buckets()) {
    torch::Tensor src =
        dtype_ == torch::kBFloat16
            ? master_.narrow(0, owned_offset_[b.index], b.capacity_per_rank)
            : param_flat_.narrow(0, b.flat_offset + rank_ * b.capacity_per_rank, b.capacity_per_rank);
    host_master_.narrow(0, owned_offset_[b.index], b.capacity_per_rank).copy_(src);
  }
  if (state0_.defined()) host_state0_ = state0_.to(torch::kCPU);
  if (state1_.defined()) host_state1_ = state1_.to(torch::kCPU);
  staged_ = true;
  return absl::OkStatus();
}

absl::Status ShardedOptimizer::EndStaging(bool copy_back) {
  if (!staged_) return absl::FailedPreconditionError("owned slices are not staged");
  at::NoGradGuard no_grad;
  if (copy_back) {
    for (const Bucket& b : layout_.buckets()) {
      torch::Tensor dst =
          dtype_ == torch::kBFloat16
              ? master_.narrow(0, owned_offset_[b.index], b.capacity_per_rank)
              : param_flat_.narrow(0, b.flat_offset + rank_ * b.capacity_per_rank, b.capacity_per_rank);
      dst.copy_(host_master_.narrow(0, owned_offset_[b.index], b.capacity_per_rank));
    }
    if (state0_.defined()) state0_.copy_(host_state0_);
    if (state1_.defined()) state1_.copy_(host_state1_);
  }
  host_master_ = host_state0_ = host_state1_ = torch::Tensor();
  staged_ = false;
  return absl::OkStatus();
}

ShardedOptimizer::OwnedSlice ShardedOptimizer::owned_slice(int b) {
  const Bucket& bk = layout_.buckets()[b];
  OwnedSlice s;
  s.size = bk.capacity_per_rank;
  if (staged_) {
    s.master = host_master_.data_ptr<float>() + owned_offset_[b];
    s.state0 = host_state0_.defined() ? host_state0_.data_ptr<float>() + owned_offset_[b] : nullptr;
    s.state1 = host_state1_.defined() ? host_state1_.data_ptr<float>() + owned_offset_[b] : nullptr;
    return s;
  }
  s.master = dtype_ == torch::kBFloat16
                 ? master_.data_ptr<float>() + owned_offset_[b]
                 : param_flat_.data_ptr<float>() + bk.flat_offset + rank_ * bk.capacity_per_rank;
  s.state0 = state0_.defined() ? state0_.data_ptr<float>() + owned_offset_[b] : nullptr;
  s.state1 = state1_.defined() ? state1_.data_ptr<float>() + owned_offset_[b] : nullptr;
  return s;
}

std::vector<std::string> ShardedOptimizer::state_names() const {
  if (options_.kind != OptimizerKind::kSgd) return {"exp_avg", "exp_avg_sq"};
  if (options_.sgd.momentum != 0.0) return {"momentum_buffer"};
  return {};
}

absl::Status ShardedOptimizer::FinishRestore(int64_t step) {
  at::NoGradGuard no_grad;
  const ElementType ptype = ElementTypeOf(dtype_);
  const int elem = ElementSize(ptype);
  char* pbase = static_cast<char*>(param_flat_.data_ptr());
  for (const Bucket& b : layout_.buckets()) {
    if (dtype_ == torch::kBFloat16) {
      param_flat_.narrow(0, b.flat_offset + rank_ * b.capacity_per_rank, b.capacity_per_rank)
          .copy_(master_.narrow(0, owned_offset_[b.index], b.capacity_per_rank));
    }
    CollectiveBucketScope tag(b.index);  // for the flight recorder
    SHARDOPT_RETURN_IF_ERROR(WaitOrAbort(
        comm_->AllGather(pbase + b.flat_offset * elem, b.capacity_per_rank, ptype),
        "all-gather after restore", b.index));
  }
  step_ = step;
  return absl::OkStatus();
}

MemoryReport ShardedOptimizer::memory() const {
  MemoryReport m;
  auto bytes = [](const torch::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; };
  m.master_bytes = bytes(master_);
  m.state_bytes = bytes(state0_) + bytes(state1_);
  m.grad_bytes = bytes(grad_flat_) + bytes(comm_scratch_);
  m.param_bytes = bytes(param_flat_);
  return m;
}

}  // namespace shardopt
