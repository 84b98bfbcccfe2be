#include "client/sharded_optimizer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/full_gradient_reducer.h"
#include "client/sharded_gradient_reducer.h"
#include "common/hyper_params.h"
#include "common/planner.h"
#include "common/status_macros.h"
#include "server/kernels/cpu/cpu_backend.h"

namespace shardopt {
namespace {

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// One line per fact that must agree across ranks; the first differing line
// names what differs.
std::string DescribeModel(const Layout& layout, const ShardedOptimizerOptions& o) {
  std::string out = absl::StrCat(
      "options optimizer=", OptimizerKindName(o.kind), " bucket_cap=", o.plan.bucket_cap_elements,
      " alignment=", o.plan.alignment_elements, " allow_cut=", o.plan.allow_cut,
      " grad_comm=", DTypeName(o.grad_comm_type), " max_grad_norm=", o.max_grad_norm,
      " shard_gradients=", o.shard_gradients, "\n");
  absl::StrAppend(&out, "groups ", std::max<size_t>(1, o.groups.size()), "\n");
  absl::StrAppend(
      &out, DescribeGroups(o.kind, o.groups.empty() ? std::vector<HyperParameters>{{o.adam, o.sgd}}
                                                    : o.groups));
  for (size_t i = 0; i < layout.params().size(); ++i) {
    const ParamSpec& p = layout.params()[i];
    absl::StrAppend(&out, "param ", p.name, "\t", ShapeString(p.shape), " ", DTypeName(p.dtype),
                    p.trainable ? " trainable" : " frozen", " group ",
                    o.param_group.empty() ? 0 : o.param_group[i], "\n");
  }
  absl::StrAppend(&out, "count ", layout.params().size(), "\n");
  return out;
}

// Checks the options and fills in what follows from them.
absl::Status ValidateOptions(ShardedOptimizerOptions& opt, size_t num_params) {
  if (opt.kind == OptimizerKind::kSgd) {
    SHARDOPT_RETURN_IF_ERROR(ValidateSgdConfig(opt.sgd));
  } else {
    opt.adam.decoupled_weight_decay = opt.kind == OptimizerKind::kAdamW;
    SHARDOPT_RETURN_IF_ERROR(ValidateAdamConfig(opt.adam));
  }
  SHARDOPT_RETURN_IF_ERROR(ValidateHyperParameter(HyperParameter::kMaxGradNorm, opt.max_grad_norm));
  if (opt.shard_gradients && opt.grad_staging_buffers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("grad_staging_buffers must be >= 1, got ", opt.grad_staging_buffers));
  }
  if (opt.external_update && (opt.shard_gradients || opt.device_async_step)) {
    return absl::InvalidArgumentError(
        "an external update (an optimizer without fused kernels) needs the full gradients: not "
        "with shard_gradients or device_async_step");
  }
  if (opt.kernel_threads < 0) return absl::InvalidArgumentError("kernel_threads must be >= 0");
  if (opt.timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("timeout must be > 0");
  if (opt.grad_comm_type == DType::kByte) {
    return absl::InvalidArgumentError("gradients travel as float32 or bfloat16");
  }
  if (num_params == 0) return absl::InvalidArgumentError("the model has no parameters");
  if (!opt.param_group.empty() && opt.param_group.size() != num_params) {
    return absl::InvalidArgumentError(absl::StrCat("param_group has ", opt.param_group.size(),
                                                   " entries for ", num_params, " parameters"));
  }
  return absl::OkStatus();
}

// Checks one parameter (its device, dtype, layout) and describes it for the
// planner; *dtype / *have_dtype: the trainable parameters' shared dtype.
absl::StatusOr<ParamSpec> SpecOf(const std::string& name, const torch::Tensor& t,
                                 const torch::Tensor& first, const ShardedOptimizerOptions& opt,
                                 torch::ScalarType* dtype, bool* have_dtype) {
  if (!t.defined()) {
    return absl::InvalidArgumentError(absl::StrCat("parameter '", name, "' is undefined"));
  }
  if (!t.device().is_cpu() && !t.device().is_cuda()) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter '", name, "' is on device ", t.device().str(),
                     "; supported: cpu, cuda (all parameters on one device)"));
  }
  if (t.device().is_cuda() && (opt.kernel_backend == nullptr || !opt.kernel_backend->on_device())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parameter '", name, "' is on ", t.device().str(),
        " but the options name no CUDA kernel backend (link "
        "//server/kernels/cuda:cuda_backend and set kernel_backend = MakeCudaKernelBackend())"));
  }
  if (t.device() != first.device()) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter '", name, "' is on ", t.device().str(), ", the first on ",
                     first.device().str(), ": all parameters must share a device"));
  }
  if (opt.external_update && t.scalar_type() != torch::kFloat) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter '", name,
                     "' is not float32: an optimizer without fused kernels updates the "
                     "parameters themselves (no float32 master copy)"));
  }
  if (t.scalar_type() != torch::kFloat && t.scalar_type() != torch::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat("parameter '", name, "' has dtype ",
                                                   c10::toString(t.scalar_type()),
                                                   "; supported: float32, bfloat16"));
  }
  if (!t.is_contiguous()) {
    return absl::InvalidArgumentError(absl::StrCat("parameter '", name,
                                                   "' is not contiguous (call .contiguous() on it "
                                                   "before building the optimizer)"));
  }
  ParamSpec s;
  s.name = name;
  s.shape = t.sizes().vec();
  s.dtype = DTypeOf(t.scalar_type());
  s.trainable = t.requires_grad();
  if (s.trainable) {
    if (*have_dtype && t.scalar_type() != *dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", name, "' is ", c10::toString(t.scalar_type()), " but earlier ones are ",
          c10::toString(*dtype), "; all trainable parameters must share one dtype"));
    }
    *dtype = t.scalar_type();
    *have_dtype = true;
  }
  return s;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShardedOptimizer>> ShardedOptimizer::Create(
    const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters,
    const ShardedOptimizerOptions& options, Communicator* comm) {
  if (comm == nullptr) return absl::InvalidArgumentError("no communicator");
  ShardedOptimizerOptions opt = options;
  SHARDOPT_RETURN_IF_ERROR(ValidateOptions(opt, named_parameters.size()));
  std::vector<ParamSpec> specs;
  torch::ScalarType dtype = torch::kFloat;
  bool have_dtype = false;
  for (const auto& [name, t] : named_parameters) {
    auto spec = SpecOf(name, t, named_parameters.front().second, opt, &dtype, &have_dtype);
    if (!spec.ok()) return spec.status();
    specs.push_back(*std::move(spec));
  }
  if (dtype == torch::kBFloat16 && opt.grad_comm_type != DType::kBFloat16) {
    opt.grad_comm_type = DType::kBFloat16;  // bf16 gradients travel as they are
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
      waiter_(comm, options_.timeout),
      tracer_(options_.trace),
      agreement_(&waiter_, &layout_) {}

ShardedOptimizer::~ShardedOptimizer() {
  if (reducer_ != nullptr) reducer_->Detach();  // hooks stop; reductions in flight end
  for (const auto& h : ag_handles_) {
    if (h) (void)h->Wait(options_.timeout);
  }
  deferred_.WaitAll(options_.timeout);
  // (The agreement and the norm wait for theirs as they are destroyed.)
}

ReducerSetup ShardedOptimizer::MakeReducerSetup() {
  ReducerSetup s;
  s.layout = &layout_;
  s.comm = comm_;
  s.tracer = &tracer_;
  s.options = torch::TensorOptions().device(device_).dtype(dtype_);
  s.comm_type = options_.grad_comm_type;
  s.timeout = options_.timeout;
  s.staging_buffers = options_.grad_staging_buffers;
  s.reduce_in_pieces = options_.reduce_large_gradients_in_pieces;
  return s;
}

absl::Status ShardedOptimizer::Init(
    const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters) {
  SHARDOPT_RETURN_IF_ERROR(agreement_.CheckSameModel(DescribeModel(layout_, options_)));
  at::NoGradGuard no_grad;
  param_flat_ =
      torch::zeros({layout_.flat_size()}, torch::TensorOptions().device(device_).dtype(dtype_));
  if (options_.shard_gradients) {
    reducer_ = std::make_unique<ShardedGradientReducer>(MakeReducerSetup());
  } else {
    reducer_ = std::make_unique<FullGradientReducer>(MakeReducerSetup());
  }
  std::vector<std::string> names;
  for (size_t i = 0; i < named_parameters.size(); ++i) {
    torch::Tensor p = named_parameters[i].second;
    names.push_back(named_parameters[i].first);
    params_.push_back(p);
    const ParamPlacement& pl = layout_.placement(static_cast<int>(i));
    if (pl.bucket < 0) continue;
    const int64_t off = layout_.buckets()[pl.bucket].flat_offset + pl.bucket_offset;
    torch::Tensor view = param_flat_.narrow(0, off, pl.numel).view(p.sizes());
    view.copy_(p);
    p.set_data(view);
    bucket_of_[p.unsafeGetTensorImpl()] = pl.bucket;
  }
  reducer_->Attach(params_);
  ag_handles_.assign(layout_.buckets().size(), nullptr);
  agreement_.set_all_active(static_cast<int>(params_.size()));
  async_ = options_.device_async_step;
  SHARDOPT_RETURN_IF_ERROR(BroadcastInitialValues());
  SHARDOPT_RETURN_IF_ERROR(CreateShardOwner());
  norm_ = std::make_unique<GradNorm>(&waiter_, owner_.get(), options_.kernel_backend.get(), device_,
                                     options_.max_grad_norm, async_);
  return reducer_->InstallHooks(owner_.get(), names);
}

absl::Status ShardedOptimizer::BroadcastInitialValues() {
  // Every rank starts from rank 0's values, as DDP does.
  const DType ptype = DTypeOf(dtype_);
  const int elem = DTypeSize(ptype);
  char* pbase = static_cast<char*>(param_flat_.data_ptr());
  for (const Bucket& b : layout_.buckets()) {
    if (!options_.broadcast_initial_values) break;
    CollectiveBucketScope tag(b.index);  // for the flight recorder
    SHARDOPT_RETURN_IF_ERROR(waiter_.Wait(
        comm_->Broadcast(pbase + b.flat_offset * elem, b.capacity_per_rank * world_, ptype, 0),
        "initial parameter broadcast", b.index));
  }
  // Frozen parameters too (they are part of the model every rank must share).
  for (size_t i = 0; i < params_.size(); ++i) {
    if (layout_.placement(static_cast<int>(i)).bucket >= 0 || params_[i].numel() == 0) continue;
    torch::Tensor& p = params_[i];
    SHARDOPT_RETURN_IF_ERROR(
        waiter_.Wait(comm_->Broadcast(p.data_ptr(), p.numel(), DTypeOf(p.scalar_type()), 0),
                     "initial broadcast of a frozen parameter", -1));
  }
  return absl::OkStatus();
}

absl::Status ShardedOptimizer::CreateShardOwner() {
  ShardOwnerOptions o;
  o.kind = options_.kind;
  if (options_.groups.empty()) {
    o.groups = {HyperParameters{options_.adam, options_.sgd}};
  } else {
    o.groups = options_.groups;
  }
  o.param_group = options_.param_group;
  o.owned_grads_only = options_.shard_gradients;
  std::shared_ptr<KernelBackend> backend = options_.kernel_backend;
  if (backend == nullptr) backend = MakeCpuKernelBackend(options_.kernel_threads);
  SHARDOPT_ASSIGN_OR_RETURN(
      owner_, ShardOwner::Create(layout_, rank_, std::move(o), param_flat_, reducer_->owner_grads(),
                                 std::move(backend)));
  return absl::OkStatus();
}

std::vector<TraceEvent> ShardedOptimizer::TakeTrace() { return tracer_.Take(); }

absl::Status ShardedOptimizer::FoldReducedGradients() {
  return reducer_->FoldReducedGradients(
      [this](const CommHandlePtr& h, int b) { return waiter_.Wait(h, "reduce-scatter", b); });
}

void ShardedOptimizer::SetGradientSync(bool enabled) { reducer_->SetGradientSync(enabled); }

void ShardedOptimizer::ZeroGrad(bool set_to_none) { reducer_->ZeroGrad(set_to_none); }

absl::Status ShardedOptimizer::SetLearningRate(double lr) {
  SHARDOPT_RETURN_IF_ERROR(owner_->SetLearningRate(lr));
  options_.sgd.lr = lr;
  options_.adam.lr = lr;
  return absl::OkStatus();
}

absl::Status ShardedOptimizer::SetHyperParameters(const AdamConfig& adam, const SgdConfig& sgd) {
  for (int g = 0; g < owner_->num_groups(); ++g) {
    SHARDOPT_RETURN_IF_ERROR(owner_->SetGroup(g, HyperParameters{adam, sgd}));
  }
  const HyperParameters applied = owner_->group(0);
  options_.adam = applied.adam;
  options_.sgd = applied.sgd;
  return absl::OkStatus();
}

absl::Status ShardedOptimizer::SetGroup(int g, const HyperParameters& hp) {
  SHARDOPT_RETURN_IF_ERROR(owner_->SetGroup(g, hp));
  if (g == 0) {  // options() reports group 0 (checkpoints, status lines)
    options_.adam = owner_->group(0).adam;
    options_.sgd = owner_->group(0).sgd;
  }
  return absl::OkStatus();
}

double ShardedOptimizer::learning_rate() const { return owner_->learning_rate(); }

// Checks the backward state, launches the reductions of buckets no gradient
// reached, and the step's agreement on hyper-parameters and on which
// parameters are updated.
absl::Status ShardedOptimizer::BeginStep() {
  std::vector<float> local_active;
  SHARDOPT_ASSIGN_OR_RETURN(local_active, reducer_->BeginStep());
  std::vector<HyperParameters> groups;
  for (int g = 0; g < owner_->num_groups(); ++g) groups.push_back(owner_->group(g));
  return agreement_.Launch(options_.kind, groups, std::move(local_active));
}

absl::Status ShardedOptimizer::AgreeIfNeeded(int bucket) {
  return agreement_.AgreeIfNeeded(
      bucket, step_ + 1, [this](int b) { return owner_->AllActive(b, agreement_.active()); });
}

// Waits for bucket `b`'s reduce-scatter; its owned gradient then holds the
// average. On the CPU, adds its squared norm to *local_sq (on a GPU one
// kernel takes the norm of every bucket, in GlobalNorm).
absl::Status ShardedOptimizer::FinishReduce(int b, double* local_sq) {
  SHARDOPT_RETURN_IF_ERROR(reducer_->FinishBucket(
      b,
      [this](const CommHandlePtr& handle, int bucket) {
        if (Defer(handle, "reduce-scatter", bucket)) return absl::OkStatus();
        return waiter_.Wait(handle, "reduce-scatter", bucket);
      },
      &waiter_));
  if (!agreement_.all_active()) {
    SHARDOPT_RETURN_IF_ERROR(AgreeIfNeeded(b));
    if (!agreement_.all_active()) owner_->ZeroInactiveGradients(b, agreement_.active());
  }
  if (device_.is_cpu()) {
    SHARDOPT_ASSIGN_OR_RETURN(const double sq, owner_->SquaredGradNorm(b));
    *local_sq += sq;
  }
  return absl::OkStatus();
}

// The fused update of bucket `b`'s owned slice, then its all-gather.
absl::Status ShardedOptimizer::UpdateAndGather(int b, int64_t* update_ns) {
  const int64_t t0 = NowNs();
  if (!options_.external_update) {
    SHARDOPT_RETURN_IF_ERROR(AgreeIfNeeded(b));
    SHARDOPT_RETURN_IF_ERROR(owner_->Update(b, agreement_.active()));
  }
  *update_ns += NowNs() - t0;
  tracer_.Add(TraceEvent::kUpdateDone, b);
  tracer_.Add(TraceEvent::kAllGatherStart, b);
  const Bucket& bk = layout_.buckets()[b];
  const DType ptype = DTypeOf(dtype_);
  char* pbase = static_cast<char*>(param_flat_.data_ptr());
  CollectiveBucketScope tag(b);  // for the flight recorder
  ag_handles_[b] =
      comm_->AllGather(pbase + bk.flat_offset * DTypeSize(ptype), bk.capacity_per_rank, ptype);
  return absl::OkStatus();
}

absl::StatusOr<double> ShardedOptimizer::GlobalNorm(double local_sq) {
  SHARDOPT_RETURN_IF_ERROR(norm_->Launch(local_sq));
  return norm_->Finish();
}

absl::Status ShardedOptimizer::FinishNormOnDevice(bool clip, StepResult* result) {
  return norm_->FinishOnDevice(
      clip, result->step,
      [this](const CommHandlePtr& h, const char* what) { return Defer(h, what, -1); },
      &result->grad_norm, &result->clipped, &result->grad_norm_pending);
}

absl::Status ShardedOptimizer::GlobalNormOnDevice(double local_sq, bool clip, StepResult* result) {
  SHARDOPT_RETURN_IF_ERROR(norm_->LaunchOnDevice(local_sq));
  return FinishNormOnDevice(clip, result);
}

absl::StatusOr<GradNormReading> ShardedOptimizer::LastGradNorm() {
  // Every collective left to the device must have succeeded for the norm to
  // mean anything.
  SHARDOPT_RETURN_IF_ERROR(CheckDeferred(/*all=*/true));
  return norm_->Last(step_);
}

std::optional<GradNormReading> ShardedOptimizer::ReadyGradNorm() {
  if (deferred_.AnyFailed()) return std::nullopt;
  return norm_->Ready(step_);
}

bool ShardedOptimizer::Defer(const CommHandlePtr& handle, const char* what, int bucket) {
  if (!async_ || handle == nullptr || !comm_->OrderStreamAfter(handle, nullptr)) return false;
  deferred_.Add({handle, what, bucket, step_});
  return true;
}

// The first failure is reported (and the communicator aborted).
// Time blocked here is exposed communication of the next step.
absl::Status ShardedOptimizer::CheckDeferred(bool all) {
  const int64_t before = waiter_.waited_ns();
  absl::Status first = deferred_.WaitDue(all, step_, [this](const DeferredCollectives::Entry& e) {
    return waiter_.Wait(e.handle, e.what, e.bucket);
  });
  gather_wait_ns_ += waiter_.waited_ns() - before;
  return first;
}

absl::Status ShardedOptimizer::OrderPreviousGathers() {
  for (int b = static_cast<int>(ag_handles_.size()) - 1; b >= 0; --b) {
    SHARDOPT_RETURN_IF_ERROR(WaitForBucket(b));
  }
  return CheckDeferred(/*all=*/false);
}

// overlap_param_gather: every reduction is finished and the norm's
// all-gather queued before any all-gather of parameters (collectives run in
// order, so it never waits behind them); buckets are updated and gathered
// first layers first (buckets hold layers in reverse order); Step() returns
// with the gathers in flight.
absl::Status ShardedOptimizer::StepOverlapped(StepResult* result, int64_t* update_ns) {
  const int nb = static_cast<int>(layout_.buckets().size());
  double local_sq = 0.0;
  for (int b = 0; b < nb; ++b) SHARDOPT_RETURN_IF_ERROR(FinishReduce(b, &local_sq));
  const bool clip = options_.max_grad_norm > 0.0;
  if (async_) {
    SHARDOPT_RETURN_IF_ERROR(norm_->LaunchOnDevice(local_sq));
    if (clip) SHARDOPT_RETURN_IF_ERROR(FinishNormOnDevice(/*clip=*/true, result));
  } else {
    SHARDOPT_RETURN_IF_ERROR(norm_->Launch(local_sq));
    if (clip) {
      SHARDOPT_ASSIGN_OR_RETURN(result->grad_norm, norm_->Finish());
      result->clipped = norm_->Clip(result->grad_norm);
    }
  }
  SHARDOPT_RETURN_IF_ERROR(RunExternalUpdate(update_ns));
  for (int b = nb - 1; b >= 0; --b) SHARDOPT_RETURN_IF_ERROR(UpdateAndGather(b, update_ns));
  if (!clip) {
    if (async_) {
      SHARDOPT_RETURN_IF_ERROR(FinishNormOnDevice(/*clip=*/false, result));
    } else {
      SHARDOPT_ASSIGN_OR_RETURN(result->grad_norm, norm_->Finish());
    }
  }
  return absl::OkStatus();
}

absl::Status ShardedOptimizer::RunExternalUpdate(int64_t* update_ns) {
  if (!options_.external_update) return absl::OkStatus();
  SHARDOPT_RETURN_IF_ERROR(AgreeIfNeeded(-1));  // the whole mask
  const int64_t t0 = NowNs();
  absl::Status s = options_.external_update(agreement_.active());
  *update_ns += NowNs() - t0;
  return s;
}

absl::Status ShardedOptimizer::WaitForBucket(int b) {
  if (b < 0 || b >= static_cast<int>(ag_handles_.size())) {
    return absl::OutOfRangeError(absl::StrCat("no bucket ", b));
  }
  if (ag_handles_[b] == nullptr) return absl::OkStatus();
  if (Defer(ag_handles_[b], "all-gather", b)) {  // device_async_step: ordered on the device
    ag_handles_[b] = nullptr;
    tracer_.Add(TraceEvent::kAllGatherDone, b);
    return absl::OkStatus();
  }
  const int64_t before = waiter_.waited_ns();
  absl::Status s = waiter_.Wait(ag_handles_[b], "all-gather", b);
  gather_wait_ns_ += waiter_.waited_ns() - before;
  ag_handles_[b] = nullptr;
  SHARDOPT_RETURN_IF_ERROR(s);
  tracer_.Add(TraceEvent::kAllGatherDone, b);
  return absl::OkStatus();
}

absl::Status ShardedOptimizer::WaitForParameters() {
  for (int b = static_cast<int>(ag_handles_.size()) - 1; b >= 0; --b) {
    SHARDOPT_RETURN_IF_ERROR(WaitForBucket(b));
  }
  // Callers read parameters on the host (checkpoints, the full state): every
  // collective left to the device must have succeeded.
  return async_ ? CheckDeferred(/*all=*/true) : absl::OkStatus();
}

absl::Status ShardedOptimizer::WaitForParameters(const std::vector<torch::Tensor>& params) {
  for (const torch::Tensor& p : params) {
    auto it = bucket_of_.find(p.unsafeGetTensorImpl());
    if (it != bucket_of_.end()) SHARDOPT_RETURN_IF_ERROR(WaitForBucket(it->second));
  }
  return absl::OkStatus();
}

absl::Status ShardedOptimizer::WaitForParameters(const torch::nn::Module& module) {
  return WaitForParameters(module.parameters(/*recurse=*/true));
}

std::vector<int> ShardedOptimizer::BucketsOf(const std::vector<torch::Tensor>& params) const {
  std::vector<int> out;
  for (const torch::Tensor& p : params) {
    auto it = bucket_of_.find(p.unsafeGetTensorImpl());
    if (it != bucket_of_.end() && std::find(out.begin(), out.end(), it->second) == out.end()) {
      out.push_back(it->second);
    }
  }
  return out;
}

// Clipping needs the global norm before any update (and an external update
// runs once, after every reduction).
absl::Status ShardedOptimizer::StepNormFirst(StepResult* result, int64_t* update_ns) {
  const int nb = static_cast<int>(layout_.buckets().size());
  const bool clip = options_.max_grad_norm > 0.0;
  double local_sq = 0.0;
  for (int b = 0; b < nb; ++b) SHARDOPT_RETURN_IF_ERROR(FinishReduce(b, &local_sq));
  if (async_) {
    SHARDOPT_RETURN_IF_ERROR(GlobalNormOnDevice(local_sq, clip, result));
  } else {
    SHARDOPT_ASSIGN_OR_RETURN(result->grad_norm, GlobalNorm(local_sq));
    if (clip) result->clipped = norm_->Clip(result->grad_norm);
  }
  SHARDOPT_RETURN_IF_ERROR(RunExternalUpdate(update_ns));
  for (int b = 0; b < nb; ++b) SHARDOPT_RETURN_IF_ERROR(UpdateAndGather(b, update_ns));
  return absl::OkStatus();
}

// Each bucket updated and gathered as soon as its reduction is in; the norm
// (reported, not applied) after.
absl::Status ShardedOptimizer::StepBucketByBucket(StepResult* result, int64_t* update_ns) {
  const int nb = static_cast<int>(layout_.buckets().size());
  double local_sq = 0.0;
  for (int b = 0; b < nb; ++b) {
    SHARDOPT_RETURN_IF_ERROR(FinishReduce(b, &local_sq));
    SHARDOPT_RETURN_IF_ERROR(UpdateAndGather(b, update_ns));
  }
  if (async_) return GlobalNormOnDevice(local_sq, /*clip=*/false, result);
  SHARDOPT_ASSIGN_OR_RETURN(result->grad_norm, GlobalNorm(local_sq));
  return absl::OkStatus();
}

// After the first step: rank 0's order of completed buckets becomes every
// rank's launch order (GradientReducer::ProposedLaunchOrder says why).
absl::Status ShardedOptimizer::AgreeLaunchOrder() {
  if (reducer_->order_agreed()) return absl::OkStatus();
  std::vector<int32_t> order = reducer_->ProposedLaunchOrder();
  SHARDOPT_RETURN_IF_ERROR(agreement_.BroadcastLaunchOrder(&order));
  reducer_->SetLaunchOrder(order);
  return absl::OkStatus();
}

absl::StatusOr<StepResult> ShardedOptimizer::Step() {
  at::NoGradGuard no_grad;
  waiter_.Reset();
  const bool in_agreed_order = reducer_->order_agreed();
  // The previous step's gathers (overlap_param_gather) end before this
  // step's updates write the same buffer (device_async_step: on the device,
  // and the outcome of what the last steps left to the device is checked).
  SHARDOPT_RETURN_IF_ERROR(async_ ? OrderPreviousGathers() : WaitForParameters());
  SHARDOPT_RETURN_IF_ERROR(BeginStep());
  StepResult result;
  result.step = step_ + 1;
  // Gathers waited for since the last step (forward pre-hooks), and backward
  // waiting for a staging buffer (shard_gradients), are exposed
  // communication of this step.
  waiter_.Reset(gather_wait_ns_ + reducer_->TakeHookWaitNs());
  gather_wait_ns_ = 0;
  int64_t update_ns = 0;
  if (options_.overlap_param_gather) {
    SHARDOPT_RETURN_IF_ERROR(StepOverlapped(&result, &update_ns));
  } else if (options_.max_grad_norm > 0.0 || options_.external_update) {
    SHARDOPT_RETURN_IF_ERROR(StepNormFirst(&result, &update_ns));
  } else {
    SHARDOPT_RETURN_IF_ERROR(StepBucketByBucket(&result, &update_ns));
  }
  if (!options_.overlap_param_gather) {
    for (size_t b = 0; b < ag_handles_.size(); ++b) {
      SHARDOPT_RETURN_IF_ERROR(WaitForBucket(static_cast<int>(b)));
    }
    gather_wait_ns_ = 0;  // counted in this step's wait already
  }
  result.comm_wait_seconds = waiter_.waited_ns() * 1e-9;
  result.update_seconds = update_ns * 1e-9;
  if (!result.grad_norm_pending) norm_->set_last({result.step, result.grad_norm, result.clipped});
  // The agreement, if no update had to wait for it: it hid behind the step.
  SHARDOPT_RETURN_IF_ERROR(agreement_.FinishIfPending(result.step));
  SHARDOPT_RETURN_IF_ERROR(AgreeLaunchOrder());
  EndStep(result.step);
  if (in_agreed_order) reducer_->OnStepInAgreedOrder();
  return result;
}

void ShardedOptimizer::EndStep(int64_t step) {
  reducer_->EndStep();
  step_ = step;
  tracer_.Add(TraceEvent::kStepEnd);
}

absl::Status ShardedOptimizer::FinishRestore(int64_t step) {
  at::NoGradGuard no_grad;
  SHARDOPT_RETURN_IF_ERROR(WaitForParameters());
  const DType ptype = DTypeOf(dtype_);
  const int elem = DTypeSize(ptype);
  char* pbase = static_cast<char*>(param_flat_.data_ptr());
  for (const Bucket& b : layout_.buckets()) {
    owner_->WriteModelCopy(b.index);
    CollectiveBucketScope tag(b.index);  // for the flight recorder
    SHARDOPT_RETURN_IF_ERROR(
        waiter_.Wait(comm_->AllGather(pbase + b.flat_offset * elem, b.capacity_per_rank, ptype),
                     "all-gather after restore", b.index));
  }
  owner_->SetParamSteps(step);
  step_ = step;
  return absl::OkStatus();
}

MemoryReport ShardedOptimizer::memory() const {
  MemoryReport m = owner_->memory();
  auto bytes = [](const torch::Tensor& t) {
    return t.defined() ? t.numel() * t.element_size() : 0;
  };
  m.grad_bytes = reducer_->grad_bytes();
  m.param_bytes = bytes(param_flat_);
  return m;
}

}  // namespace shardopt
