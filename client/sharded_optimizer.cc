#include "client/sharded_optimizer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <limits>
#include <chrono>
#include <cmath>
#include <cstring>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/hyper_params.h"
#include "server/kernels/cpu/cpu_backend.h"
#include "common/planner.h"
#include "common/status_macros.h"

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
namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

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

DType DTypeOf(torch::ScalarType t) {
  return t == torch::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// One line per fact that must agree across ranks; the first differing line
// names what differs.
// One line per parameter group with every hyper-parameter the update uses
// (%.17g: equal text means equal doubles).
std::string DescribeGroups(OptimizerKind kind, const std::vector<HyperParameters>& groups) {
  std::string out;
  for (size_t g = 0; g < groups.size(); ++g) {
    const HyperParameters& h = groups[g];
    if (kind == OptimizerKind::kSgd) {
      absl::StrAppendFormat(&out,
                            "group %d: lr=%.17g momentum=%.17g dampening=%.17g "
                            "weight_decay=%.17g nesterov=%d\n",
                            g, h.sgd.lr, h.sgd.momentum, h.sgd.dampening, h.sgd.weight_decay,
                            h.sgd.nesterov ? 1 : 0);
    } else {
      absl::StrAppendFormat(&out,
                            "group %d: lr=%.17g betas=(%.17g, %.17g) eps=%.17g "
                            "weight_decay=%.17g\n",
                            g, h.adam.lr, h.adam.beta1, h.adam.beta2, h.adam.eps,
                            h.adam.weight_decay);
    }
  }
  return out;
}

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// The first lines where two descriptions differ (false: none).
bool FirstDifferentLines(const std::string& theirs, const std::string& mine, std::string* x,
                         std::string* y) {
  std::vector<std::string> a = absl::StrSplit(theirs, '\n');
  std::vector<std::string> b = absl::StrSplit(mine, '\n');
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    *x = i < a.size() ? a[i] : "(nothing)";
    *y = i < b.size() ? b[i] : "(nothing)";
    if (*x != *y) return true;
  }
  return false;
}

// "rank 0 has 'X', rank R has 'Y'" for the first difference, or "".
std::string FirstDifference(const std::string& theirs, const std::string& mine, int rank) {
  std::string x, y;
  if (!FirstDifferentLines(theirs, mine, &x, &y)) return "";
  return absl::StrCat("rank 0 has '", x, "', rank ", rank, " has '", y, "'");
}

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
  s.dtype = t.scalar_type() == torch::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
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
  for (const auto& h : ag_handles_) {
    if (h) (void)h->Wait(options_.timeout);
  }
  deferred_.WaitAll(options_.timeout);
  if (hyper_handle_) (void)hyper_handle_->Wait(options_.timeout);
  if (norm_handle_) (void)norm_handle_->Wait(options_.timeout);
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

// Rank 0's `mine` into *theirs on every rank.
absl::Status ShardedOptimizer::BroadcastText(const std::string& mine, const char* what,
                                             std::string* theirs) {
  int64_t len = static_cast<int64_t>(mine.size());
  // Host buffers: the communicator stages them where it moves device memory (NCCL).
  SHARDOPT_RETURN_IF_ERROR(
      WaitOrAbort(comm_->Broadcast(&len, sizeof(len), DType::kByte, 0), what, -1));
  if (len < 0 || len > (int64_t{1} << 30)) {
    return absl::DataLossError(absl::StrCat(what, ": rank 0 sent a corrupt description length"));
  }
  *theirs = rank_ == 0 ? mine : std::string(static_cast<size_t>(len), '\0');
  return WaitOrAbort(comm_->Broadcast(theirs->data(), len, DType::kByte, 0), what, -1);
}

// Every step: the ranks agree on a hash of every group's hyper-parameters
// (schedulers and param_groups edits happen on each rank on its own; a rank
// with other values would update its shard with them and nothing would
// show). Launched before the step's updates, waited for at its end, so it
// costs one small all-reduce that hides behind the reductions.
absl::Status ShardedOptimizer::LaunchHyperAgreement() {
  std::vector<HyperParameters> groups;
  for (int g = 0; g < owner_->num_groups(); ++g) groups.push_back(owner_->group(g));
  hyper_text_ = DescribeGroups(options_.kind, groups);
  const uint64_t h = Fnv1a(hyper_text_);
  // [hash (3 floats), -hash, which parameters this rank has a gradient for]:
  // the maximum over ranks shows a difference in the hash, and is 1 for a
  // parameter some rank has a gradient for.
  hyper_buf_.assign(6 + local_active_.size(), 0.0f);
  for (int i = 0; i < 3; ++i) {
    hyper_buf_[i] = static_cast<float>((h >> (21 * i)) & 0x1FFFFF);  // exact in a float
    hyper_buf_[i + 3] = -hyper_buf_[i];
  }
  std::copy(local_active_.begin(), local_active_.end(), hyper_buf_.begin() + 6);
  if (world_ == 1) {
    hyper_handle_ = nullptr;
    ReadActive();
    agreed_ = true;
    return absl::OkStatus();
  }
  // Until the agreement arrives, this rank's own marks: a parameter it has
  // a gradient for is updated whatever the others say (the maximum), so
  // only a bucket with an owned parameter this rank has no gradient for
  // waits for it (AgreeIfNeeded); the usual step never does, and its
  // updates overlap the last reductions.
  active_.assign(local_active_.size(), 0);
  all_active_ = true;
  for (size_t p = 0; p < local_active_.size(); ++p) {
    active_[p] = local_active_[p] > 0.5f ? 1 : 0;
    if (active_[p] == 0 && layout_.placement(static_cast<int>(p)).bucket >= 0) all_active_ = false;
  }
  agreed_ = false;
  hyper_handle_ = comm_->AllReduce(hyper_buf_.data(), static_cast<int64_t>(hyper_buf_.size()),
                                   DType::kFloat32, ReduceOp::kMax);
  return absl::OkStatus();
}

void ShardedOptimizer::ReadActive() {
  all_active_ = true;
  active_.assign(local_active_.size(), 0);
  for (size_t p = 0; p < local_active_.size(); ++p) {
    active_[p] = hyper_buf_[6 + p] > 0.5f ? 1 : 0;
    if (active_[p] == 0 && layout_.placement(static_cast<int>(p)).bucket >= 0) all_active_ = false;
  }
}

absl::Status ShardedOptimizer::AgreeIfNeeded(int bucket) {
  if (agreed_) return absl::OkStatus();
  if (bucket >= 0 && (all_active_ || owner_->AllActive(bucket, active_))) return absl::OkStatus();
  agreed_ = true;
  return FinishHyperAgreement(step_ + 1);
}

absl::Status ShardedOptimizer::FinishHyperAgreement(int64_t step) {
  if (hyper_handle_ == nullptr) return absl::OkStatus();
  CommHandlePtr handle = std::move(hyper_handle_);
  hyper_handle_ = nullptr;
  const int64_t t0 = NowNs();
  absl::Status waited = WaitOrAbort(handle, "hyper-parameter agreement", -1);
  wait_ns_ += NowNs() - t0;
  SHARDOPT_RETURN_IF_ERROR(waited);
  ReadActive();
  bool same = true;
  for (int i = 0; i < 3; ++i) same = same && hyper_buf_[i] == -hyper_buf_[i + 3];
  if (same) return absl::OkStatus();
  // Every rank saw the difference: rank 0's values go to all, each names its own.
  std::string theirs;
  SHARDOPT_RETURN_IF_ERROR(BroadcastText(hyper_text_, "hyper-parameter agreement", &theirs));
  std::string detail;
  SHARDOPT_ASSIGN_OR_RETURN(detail, ShareDetail(FirstDifference(theirs, hyper_text_, rank_),
                                                "hyper-parameter agreement"));
  if (detail.empty()) detail = "their hashes differ";
  return absl::FailedPreconditionError(absl::StrCat(
      "ranks disagree on hyper-parameters at step ", step, ": ", detail,
      ". Every rank must build the optimizer with the same values and change them (schedulers, "
      "param_groups edits) the same way at the same step"));
}

absl::Status ShardedOptimizer::CheckSameModelOnAllRanks() {
  const std::string mine = DescribeModel(layout_, options_);
  std::string theirs;
  SHARDOPT_RETURN_IF_ERROR(BroadcastText(mine, "model check", &theirs));
  std::string detail, x, y;
  if (FirstDifferentLines(theirs, mine, &x, &y)) {
    detail = absl::StrCat("rank 0 has '", x, "', rank ", rank_, " has '", y, "'");
    if (absl::StartsWith(x, "param ") || absl::StartsWith(y, "param ")) {
      const std::string name = (absl::StartsWith(x, "param ") ? x : y).substr(6);
      detail = absl::StrCat("model differs from rank 0's at parameter '",
                            name.substr(0, name.find('\t')), "': ", detail);
    }
  }
  // Every rank learns the first difference any rank found, so all fail
  // together and each names the parameter or group and both values.
  SHARDOPT_ASSIGN_OR_RETURN(detail, ShareDetail(detail, "model check"));
  if (!detail.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("layout hash mismatch, refusing to train: ", detail));
  }
  return absl::OkStatus();
}

// Every rank's `mine` (at most kDetailBytes, empty: nothing to say) to all;
// returns the lowest rank's non-empty one, or "".
absl::StatusOr<std::string> ShardedOptimizer::ShareDetail(const std::string& mine,
                                                          const char* what) {
  constexpr int64_t kDetailBytes = 1024;
  detail_buf_.assign(static_cast<size_t>(kDetailBytes * world_), '\0');
  std::memcpy(&detail_buf_[kDetailBytes * rank_], mine.data(),
              std::min<size_t>(mine.size(), kDetailBytes - 1));
  SHARDOPT_RETURN_IF_ERROR(
      WaitOrAbort(comm_->AllGather(detail_buf_.data(), kDetailBytes, DType::kByte), what, -1));
  for (int r = 0; r < world_; ++r) {
    const char* d = &detail_buf_[kDetailBytes * r];
    const size_t n = strnlen(d, kDetailBytes);
    if (n > 0) return std::string(d, n);
  }
  return std::string();
}

absl::Status ShardedOptimizer::Init(
    const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters) {
  SHARDOPT_RETURN_IF_ERROR(CheckSameModelOnAllRanks());
  at::NoGradGuard no_grad;
  const int64_t flat = layout_.flat_size();
  const auto on_device = torch::TensorOptions().device(device_);
  param_flat_ = torch::zeros({flat}, on_device.dtype(dtype_));
  comm_type_ = options_.grad_comm_type;
  if (options_.shard_gradients) {
    int64_t owned = 0;
    for (const Bucket& b : layout_.buckets()) owned += b.capacity_per_rank;
    absl::MutexLock lock(&hook_state_->mu);  // (no hook yet: for the analysis)
    owned_grad_flat_ = torch::zeros({owned}, on_device.dtype(dtype_));
  } else {
    grad_flat_ = torch::zeros({flat}, on_device.dtype(dtype_));
    if (dtype_ == torch::kFloat && comm_type_ == DType::kBFloat16) {
      comm_scratch_ = torch::zeros({flat}, on_device.dtype(torch::kBFloat16));
    }
  }
  for (size_t i = 0; i < named_parameters.size(); ++i) {
    torch::Tensor p = named_parameters[i].second;
    params_.push_back(p);
    const ParamPlacement& pl = layout_.placement(static_cast<int>(i));
    if (pl.bucket < 0) continue;
    const int64_t off = layout_.buckets()[pl.bucket].flat_offset + pl.bucket_offset;
    torch::Tensor view = param_flat_.narrow(0, off, pl.numel).view(p.sizes());
    view.copy_(p);
    p.set_data(view);
    if (options_.shard_gradients) {
      p.mutable_grad() = torch::Tensor();  // backward's gradients are handed over
    } else {
      p.mutable_grad() = grad_flat_.narrow(0, off, pl.numel).view(p.sizes());
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const int b = layout_.placement(static_cast<int>(i)).bucket;
    if (b >= 0) bucket_of_[params_[i].unsafeGetTensorImpl()] = b;
  }
  grad_views_.assign(params_.size(), torch::Tensor());
  for (size_t i = 0; i < params_.size(); ++i) {
    if (layout_.placement(static_cast<int>(i)).bucket >= 0 && !options_.shard_gradients) {
      grad_views_[i] = params_[i].grad();
    }
  }
  if (options_.shard_gradients) PrepareShardedGradients();
  async_ = options_.device_async_step;
  if (async_) {
    norm_parts_t_ = torch::zeros({world_}, on_device.dtype(torch::kDouble));
    if (!device_.is_cpu()) {
      norm_host_ =
          torch::zeros({2, 2}, torch::TensorOptions().dtype(torch::kFloat).pinned_memory(true));
    }
  }
  SHARDOPT_RETURN_IF_ERROR(BroadcastInitialValues());
  SHARDOPT_RETURN_IF_ERROR(CreateShardOwner());
  return InstallHooks(named_parameters);
}

absl::Status ShardedOptimizer::BroadcastInitialValues() {
  // Every rank starts from rank 0's values, as DDP does.
  const DType ptype = DTypeOf(dtype_);
  const int elem = DTypeSize(ptype);
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
    SHARDOPT_RETURN_IF_ERROR(
        WaitOrAbort(comm_->Broadcast(p.data_ptr(), p.numel(), DTypeOf(p.scalar_type()), 0),
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
      owner_, ShardOwner::Create(layout_, rank_, std::move(o), param_flat_,
                                 options_.shard_gradients ? owned_grad_flat_ : grad_flat_,
                                 std::move(backend)));
  return absl::OkStatus();
}

absl::Status ShardedOptimizer::InstallHooks(
    const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters) {
  const int nb = static_cast<int>(layout_.buckets().size());
  absl::MutexLock lock(&hook_state_->mu);  // (no hook yet: for the analysis)
  ready_.assign(params_.size(), false);
  has_grad_.assign(params_.size(), 0);
  active_.assign(params_.size(), 1);
  bucket_ready_count_.assign(nb, 0);
  bucket_size_.assign(nb, 0);
  launch_order_.resize(nb);
  for (int b = 0; b < nb; ++b) launch_order_[b] = b;
  for (int b = 0; b < nb; ++b)
    bucket_size_[b] = static_cast<int>(layout_.buckets()[b].params.size());
  rs_handles_.assign(nb, nullptr);
  ag_handles_.assign(nb, nullptr);
  hook_state_->owner = this;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (layout_.placement(static_cast<int>(i)).bucket < 0) continue;
    std::shared_ptr<torch::autograd::Node> acc =
        torch::autograd::impl::grad_accumulator(params_[i]);
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
          if (state->owner != nullptr) {
            state->owner->AssertHookLockHeld();  // state is its hook_state_
            state->owner->OnGradReady(index);
          }
          return outputs;
        }));
    if (!options_.shard_gradients) {
      acc->add_pre_hook(std::make_unique<LambdaPreHook>([state, index] {
        absl::MutexLock lock(&state->mu);
        if (state->owner == nullptr) return;
        state->owner->AssertHookLockHeld();  // state is its hook_state_
        state->owner->BeforeGradLocked(index);
      }));
    }
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

// The first gradient after a step that zero_grad() through the optimizer
// did not follow. model.zero_grad() (zeroes in place or sets None), or
// `p.grad = None` for every parameter, is a zero_grad() too: if every
// gradient is None or zero, this backward starts from zero as after
// ZeroGrad() (views left stale by None are zeroed). Otherwise gradients
// would be accumulated on top of the last step's, and Step() says so.
void ShardedOptimizer::BeforeGradLocked(int /*param*/) {
  if (!needs_zero_grad_ || options_.shard_gradients) return;
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

void ShardedOptimizer::OnGradReady(int param) {
  const int b = layout_.placement(param).bucket;
  torch::Tensor& grad = params_[param].mutable_grad();
  if (options_.shard_gradients) {
    torch::Tensor taken = std::move(grad);
    grad = torch::Tensor();
    OnShardedGradReadyLocked(param, std::move(taken));
    return;
  }
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
  Trace(TraceEvent::kGradReady, b, param);
  ++grads_seen_;
  grad_version_ = grad_flat_._version();  // Step() checks nothing wrote to them since
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

void ShardedOptimizer::BucketCompleteLocked(int b) {
  if (!order_agreed_) ready_order_.push_back(b);
  LaunchReadyBucketsLocked();
}

void ShardedOptimizer::LaunchReadyBucketsLocked() {
  // Buckets are reduced in launch_order_ on every rank, so collectives match
  // even when ranks finish buckets in different orders.
  const int nb = static_cast<int>(bucket_size_.size());
  while (next_launch_ < nb) {
    const int b = launch_order_[next_launch_];
    if (bucket_ready_count_[b] != bucket_size_[b]) break;
    ++next_launch_;
    LaunchReduceScatterLocked(b);
  }
}

// After the first step: rank 0's order of completed buckets (those its
// backward completed, then the rest in bucket order) becomes every rank's
// launch order. Bucket order is reverse registration order, which is not
// backward's when parameters come in groups (weight decay / none) or a
// module registers layers out of forward order; reduced in bucket order, a
// bucket backward completes early would wait for one it completes last, and
// nothing would overlap backward (with shard_gradients, every such bucket
// would hold staging until then). DDP rebuilds its buckets after the first
// iteration for the same reason; here the layout stays and only the order
// of the reduce-scatters changes (results are the same bit for bit).
absl::Status ShardedOptimizer::AgreeLaunchOrder() {
  const int nb = static_cast<int>(layout_.buckets().size());
  std::vector<int32_t> order;
  {
    absl::MutexLock lock(&hook_state_->mu);
    if (order_agreed_) return absl::OkStatus();
    std::vector<bool> seen(nb, false);
    for (int b : ready_order_) {
      if (b >= 0 && b < nb && !seen[b]) {
        seen[b] = true;
        order.push_back(b);
      }
    }
    for (int b = 0; b < nb; ++b) {
      if (!seen[b]) order.push_back(b);
    }
  }
  SHARDOPT_RETURN_IF_ERROR(
      WaitOrAbort(comm_->Broadcast(order.data(), nb * 4, DType::kByte, 0), "launch order", -1));
  std::vector<bool> seen(nb, false);
  for (int32_t b : order) {
    if (b < 0 || b >= nb || seen[b]) {
      return absl::InternalError("rank 0's bucket launch order is not a permutation");
    }
    seen[b] = true;
  }
  absl::MutexLock lock(&hook_state_->mu);
  launch_order_.assign(order.begin(), order.end());
  ready_order_.clear();
  order_agreed_ = true;
  if (options_.shard_gradients) {
    // Buffers of their own that buckets took while waiting for earlier ones
    // in bucket order were the first step's; the report is the steady state.
    overflow_peak_bytes_ = overflow_bytes_;
    overflow_shortfall_ = 0;
    UpdateGradBytesLocked();
  }
  return absl::OkStatus();
}

void ShardedOptimizer::LaunchReduceScatterLocked(int b) {
  if (options_.shard_gradients) return LaunchShardedLocked(b);
  const Bucket& bk = layout_.buckets()[b];
  const int64_t size = bk.capacity_per_rank * world_;
  Trace(TraceEvent::kReduceScatterStart, b, -1);
  CollectiveBucketScope tag(b);  // for the flight recorder
  if (comm_scratch_.defined()) {
    torch::Tensor dst = comm_scratch_.narrow(0, bk.flat_offset, size);
    dst.copy_(grad_flat_.narrow(0, bk.flat_offset, size));
    rs_handles_[b] = comm_->ReduceScatter(dst.data_ptr(), bk.capacity_per_rank, DType::kBFloat16,
                                          ReduceOp::kAverage);
    return;
  }
  const DType t = DTypeOf(dtype_);
  char* base = static_cast<char*>(grad_flat_.data_ptr()) + bk.flat_offset * DTypeSize(t);
  rs_handles_[b] = comm_->ReduceScatter(base, bk.capacity_per_rank, t, ReduceOp::kAverage);
}

int64_t ShardedOptimizer::OwnedOffset(int bucket) const {
  int64_t at = 0;
  for (int b = 0; b < bucket; ++b) at += layout_.buckets()[b].capacity_per_rank;
  return at;
}

absl::Status ShardedOptimizer::FoldReducedGradients() {
  if (options_.shard_gradients) return absl::OkStatus();
  at::NoGradGuard no_grad;
  const int nb = static_cast<int>(layout_.buckets().size());
  std::vector<CommHandlePtr> handles;
  {
    absl::MutexLock lock(&hook_state_->mu);
    if (!synced_backward_ || needs_zero_grad_) return absl::OkStatus();
    SHARDOPT_RETURN_IF_ERROR(TakeHookErrorLocked());
    // Buckets the backward did not complete (unused parameters) are reduced
    // now, in the agreed order, as BeginStep would.
    while (next_launch_ < nb) LaunchReduceScatterLocked(launch_order_[next_launch_++]);
    handles = rs_handles_;
  }
  if (!folded_.defined()) {
    folded_ = torch::zeros({owner_->owned_elements()}, grad_flat_.options());
    folded_bytes_ = folded_.numel() * folded_.element_size();
  } else if (!folded_pending_) {
    folded_.zero_();
  }
  for (int b = 0; b < nb; ++b) {
    if (handles[b] != nullptr) {
      SHARDOPT_RETURN_IF_ERROR(WaitOrAbort(handles[b], "reduce-scatter", b));
    }
    torch::Tensor g = owner_->owned_grad(b);
    if (comm_scratch_.defined()) g.copy_(owner_->OwnedRange(comm_scratch_, b));
    folded_.narrow(0, OwnedOffset(b), g.numel()).add_(g);
  }
  absl::MutexLock lock(&hook_state_->mu);
  grad_flat_.zero_();
  ResetBackwardStateLocked(/*needs_zero_grad=*/false);
  if (!order_agreed_) ready_order_.clear();  // the next backward records it again
  folded_pending_ = true;
  return absl::OkStatus();
}

void ShardedOptimizer::SetGradientSync(bool enabled) {
  absl::MutexLock lock(&hook_state_->mu);
  sync_ = enabled;
}

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

void ShardedOptimizer::ZeroGrad(bool set_to_none) {
  if (set_to_none) {
    absl::MutexLock lock(&hook_state_->mu);
    std::fill(has_grad_.begin(), has_grad_.end(), 0);
  }
  if (options_.shard_gradients) {
    absl::MutexLock lock(&hook_state_->mu);
    // Reductions launched by a backward whose step never came end before
    // their buffers are reused.
    while (!in_flight_.empty()) (void)ReclaimLocked(in_flight_.front());
    ReleaseShardedBuffersLocked();
    ResetBackwardStateLocked(/*needs_zero_grad=*/false);
    hook_error_ = absl::OkStatus();
    return;
  }
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
  ResetBackwardStateLocked(/*needs_zero_grad=*/false);
  folded_pending_ = false;
}

// Forgets what backward passes recorded since the last ZeroGrad()/Step().
// After a step (needs_zero_grad), gradients that arrive before ZeroGrad()
// are reported as misuse by the next Step().
void ShardedOptimizer::ResetBackwardStateLocked(bool needs_zero_grad) {
  std::fill(ready_.begin(), ready_.end(), false);
  std::fill(bucket_ready_count_.begin(), bucket_ready_count_.end(), 0);
  std::fill(rs_handles_.begin(), rs_handles_.end(), nullptr);
  next_launch_ = 0;
  grads_seen_ = 0;
  grad_version_ = -1;
  needs_zero_grad_ = needs_zero_grad;
  synced_backward_ = false;
  if (!needs_zero_grad) {
    grad_after_step_ = false;
    accumulated_while_syncing_ = false;
  }
}

// Checks the backward state and launches the reductions of buckets no
// gradient reached (unused parameters are reduced as zeros, as DDP's
// find_unused_parameters does).
absl::Status ShardedOptimizer::BeginStep() {
  absl::MutexLock lock(&hook_state_->mu);
  Trace(TraceEvent::kStepBegin, -1, -1);
  SHARDOPT_RETURN_IF_ERROR(TakeHookErrorLocked());
  if (grad_after_step_) {
    return absl::FailedPreconditionError(
        "gradients were accumulated on top of the previous step's reduced gradients: zero "
        "them after step() and before the next backward (optimizer.zero_grad(), "
        "model.zero_grad() or p.grad = None; ZeroGrad() in C++)");
  }
  if (grad_version_ >= 0 && grad_flat_.defined() && grad_flat_._version() != grad_version_) {
    return absl::FailedPreconditionError(
        "the gradients were changed between backward and step() (torch.nn.utils."
        "clip_grad_norm_, GradScaler.unscale_, a DistributedDataParallel wrapper, or other code "
        "writing to .grad): shardopt reduces each gradient during backward, so the change is "
        "lost or applied twice; clip with max_grad_norm= and do not wrap the model in DDP");
  }
  if (accumulated_while_syncing_) {
    return absl::FailedPreconditionError(
        "several backward passes ran with gradient sync on, so buckets were reduced before "
        "all gradients were accumulated: run all micro-batches but the last inside "
        "`with optimizer.no_sync():` (SetGradientSync(false) in C++), or pass module= (Python; "
        "FoldReducedGradients() before each forward in C++) to accumulate as DDP does");
  }
  if (grads_seen_ == 0 && !folded_pending_) {
    return absl::FailedPreconditionError(
        "Step() called without a backward pass since the last step (no gradient arrived)");
  }
  MarkActiveLocked();
  const int nb = static_cast<int>(layout_.buckets().size());
  while (next_launch_ < nb) LaunchReduceScatterLocked(launch_order_[next_launch_++]);
  return TakeHookErrorLocked();  // a reduction failed while a launch waited for staging room
}

// torch.optim skips a parameter whose .grad is None: never reached by a
// backward, or set to None (zero_grad(set_to_none=True), p.grad = None) and
// not reached since. DistributedDataParallel leaves the gradient of a
// parameter no rank used untouched, and gives one that some rank used the
// average (the others contributing zeros). So a parameter is updated iff
// some rank has a gradient for it: each rank marks its own here (before the
// remaining reductions are launched, so that what it contributes for the
// others is zeros), and the ranks take the maximum in the step's agreement
// all-reduce (LaunchHyperAgreement).
void ShardedOptimizer::MarkActiveLocked() {
  const int n = static_cast<int>(params_.size());
  local_active_.assign(n, 0.0f);
  bool zeroed = false;
  for (int p = 0; p < n; ++p) {
    if (layout_.placement(p).bucket < 0) continue;  // frozen
    bool has = has_grad_[p] != 0;
    if (!options_.shard_gradients && has && !params_[p].grad().defined()) {
      // p.grad = None and no backward reached it since: what the flat
      // buffer holds is stale; contribute zeros, as DDP does for it.
      at::NoGradGuard no_grad;
      grad_views_[p].zero_();
      zeroed = true;
      has = false;
    }
    local_active_[p] = has ? 1.0f : 0.0f;
  }
  if (zeroed) grad_version_ = grad_flat_._version();
}

absl::Status ShardedOptimizer::TakeHookErrorLocked() {
  absl::Status s = hook_error_;
  hook_error_ = absl::OkStatus();
  return s;
}

// Waits for bucket `b`'s reduce-scatter; its owned range of grad_flat_ then
// holds the averaged gradient. On the CPU, adds its squared norm to *local_sq
// (on a GPU one kernel takes the norm of every bucket, in GlobalNorm).
absl::Status ShardedOptimizer::FinishReduce(int b, double* local_sq) {
  if (options_.shard_gradients) {
    absl::MutexLock lock(&hook_state_->mu);
    if (!reclaimed_[b]) {
      const int64_t t0 = NowNs();
      absl::Status s = ReclaimLocked(b);
      wait_ns_ += NowNs() - t0;
      SHARDOPT_RETURN_IF_ERROR(s);
    }
  } else {
    CommHandlePtr handle;
    {
      absl::MutexLock lock(&hook_state_->mu);
      handle = rs_handles_[b];
    }
    if (!Defer(handle, "reduce-scatter", b)) {
      SHARDOPT_RETURN_IF_ERROR(WaitOrAbort(handle, "reduce-scatter", b));
    }
    absl::MutexLock lock(&hook_state_->mu);
    Trace(TraceEvent::kReduceScatterDone, b, -1);
  }
  torch::Tensor g = owner_->owned_grad(b);
  if (comm_scratch_.defined()) g.copy_(owner_->OwnedRange(comm_scratch_, b));
  if (folded_pending_) g.add_(folded_.narrow(0, OwnedOffset(b), g.numel()));
  if (!all_active_) {
    SHARDOPT_RETURN_IF_ERROR(AgreeIfNeeded(b));
    if (!all_active_) owner_->ZeroInactiveGradients(b, active_);
  }
  if (device_.is_cpu()) {
    SHARDOPT_ASSIGN_OR_RETURN(const double sq, owner_->SquaredGradNorm(b));
    *local_sq += sq;
  }
  return absl::OkStatus();
}

// The fused update of bucket `b`'s owned slice, then its all-gather.
absl::Status ShardedOptimizer::UpdateAndGather(int b, int64_t step, int64_t* update_ns) {
  const int64_t t0 = NowNs();
  (void)step;  // each parameter is at its own count (ShardOwner::param_step)
  if (!options_.external_update) {
    SHARDOPT_RETURN_IF_ERROR(AgreeIfNeeded(b));
    SHARDOPT_RETURN_IF_ERROR(owner_->Update(b, active_));
  }
  *update_ns += NowNs() - t0;
  {
    absl::MutexLock lock(&hook_state_->mu);
    Trace(TraceEvent::kUpdateDone, b, -1);
    Trace(TraceEvent::kAllGatherStart, b, -1);
  }
  const Bucket& bk = layout_.buckets()[b];
  const DType ptype = DTypeOf(dtype_);
  char* pbase = static_cast<char*>(param_flat_.data_ptr());
  CollectiveBucketScope tag(b);  // for the flight recorder
  ag_handles_[b] =
      comm_->AllGather(pbase + bk.flat_offset * DTypeSize(ptype), bk.capacity_per_rank, ptype);
  return absl::OkStatus();
}

absl::Status ShardedOptimizer::LaunchGlobalNorm(double local_sq) {
  if (!device_.is_cpu()) {
    SHARDOPT_ASSIGN_OR_RETURN(local_sq, owner_->SquaredGradNorm());
  }
  // Each rank's double, gathered and summed in rank order on every rank (the
  // same bits everywhere; a float sum lost ~1e-7 relative per rank). A
  // member: a collective that timed out may still write into it.
  norm_parts_.assign(world_, 0.0);
  norm_parts_[rank_] = local_sq;
  norm_handle_ = comm_->AllGather(norm_parts_.data(), sizeof(double), DType::kByte);
  return absl::OkStatus();
}

absl::StatusOr<double> ShardedOptimizer::FinishGlobalNorm() {
  SHARDOPT_RETURN_IF_ERROR(WaitOrAbort(norm_handle_, "gradient norm", -1));
  norm_handle_ = nullptr;
  double sum = 0.0;
  for (double part : norm_parts_) sum += part;
  return std::sqrt(sum);
}

absl::StatusOr<double> ShardedOptimizer::GlobalNorm(double local_sq) {
  SHARDOPT_RETURN_IF_ERROR(LaunchGlobalNorm(local_sq));
  return FinishGlobalNorm();
}

bool ShardedOptimizer::ClipGradients(double grad_norm) {
  // torch.nn.utils.clip_grad_norm_'s arithmetic, in float32 as it does it:
  // max_norm * reciprocal(total_norm + 1e-6), clamped to 1.
  const float denom = static_cast<float>(grad_norm) + 1e-6f;
  const float coef = (1.0f / denom) * static_cast<float>(options_.max_grad_norm);
  if (coef >= 1.0f) return false;
  owner_->ScaleGradients(coef);
  return true;
}

// device_async_step: the local squared norm goes into a device scalar (on
// the CPU: the per-bucket sum FinishReduce made, as without the option), is
// all-reduced in place, and the clipping coefficient is computed with
// clip_grad_norm_'s float arithmetic, max_norm * reciprocal(norm + 1e-6)
// clamped to 1, and applied, all without the host reading a value.
absl::Status ShardedOptimizer::LaunchNormOnDevice(double local_sq) {
  // Each rank's squared norm in double, in its slot; all-gathered and summed
  // in rank order on the device (the same bits as the host path).
  norm_parts_t_.zero_();
  if (device_.is_cpu()) {
    norm_parts_t_.data_ptr<double>()[rank_] = local_sq;
  } else {
    SHARDOPT_RETURN_IF_ERROR(owner_->SquaredGradNormTo(norm_parts_t_.data_ptr<double>() + rank_));
  }
  norm_handle_ = comm_->AllGather(norm_parts_t_.data_ptr(), sizeof(double), DType::kByte);
  return absl::OkStatus();
}

absl::Status ShardedOptimizer::GlobalNormOnDevice(double local_sq, bool clip, StepResult* result) {
  SHARDOPT_RETURN_IF_ERROR(LaunchNormOnDevice(local_sq));
  return FinishNormOnDevice(clip, result);
}

absl::Status ShardedOptimizer::FinishNormOnDevice(bool clip, StepResult* result) {
  CommHandlePtr h = std::move(norm_handle_);
  norm_handle_ = nullptr;
  if (!Defer(h, "gradient norm", -1)) SHARDOPT_RETURN_IF_ERROR(WaitOrAbort(h, "gradient norm", -1));
  torch::Tensor sum = norm_parts_t_.narrow(0, 0, 1).clone();
  for (int r = 1; r < world_; ++r) sum.add_(norm_parts_t_.narrow(0, r, 1));
  torch::Tensor norm = sum.sqrt_().reshape({});  // double
  torch::Tensor coef;
  if (clip) {
    // clip_grad_norm_'s float arithmetic on the float norm, as ClipGradients.
    coef =
        (norm.to(torch::kFloat) + 1e-6).reciprocal_().mul_(options_.max_grad_norm).clamp_max_(1.0);
    owner_->ScaleGradients(coef);
  }
  RecordNormReading(result->step, norm, coef, result);
  return absl::OkStatus();
}

// The norm (and coefficient) for StepResult: read at once on the CPU; on a GPU
// copied into a pinned slot behind a fence, read by LastGradNorm().
void ShardedOptimizer::RecordNormReading(int64_t step, const torch::Tensor& norm,
                                         const torch::Tensor& coef, StepResult* result) {
  if (device_.is_cpu()) {  // Step() records it as last_norm_, as without the option
    result->grad_norm = norm.item<double>();
    result->clipped = coef.defined() && !(coef.item<float>() >= 1.0f);
    return;
  }
  const int slot = static_cast<int>(step & 1);
  const torch::Tensor norm_f = norm.to(torch::kFloat);
  torch::Tensor both = torch::stack({norm_f, coef.defined() ? coef : torch::ones_like(norm_f)});
  norm_host_.select(0, slot).copy_(both, /*non_blocking=*/true);
  norm_fence_[slot] = options_.kernel_backend->RecordFence();
  norm_step_[slot] = step;
  result->grad_norm = std::numeric_limits<double>::quiet_NaN();
  result->clipped = false;
  result->grad_norm_pending = true;
}

absl::StatusOr<GradNormReading> ShardedOptimizer::LastGradNorm() {
  // Every collective left to the device must have succeeded for the norm to
  // mean anything.
  SHARDOPT_RETURN_IF_ERROR(CheckDeferred(/*all=*/true));
  if (step_ == 0 || (last_norm_.step != step_ && norm_step_[step_ & 1] != step_)) {
    return absl::FailedPreconditionError(
        "LastGradNorm: no step has run since the optimizer was created or restored");
  }
  if (last_norm_.step == step_) return last_norm_;
  const int slot = static_cast<int>(step_ & 1);
  if (norm_fence_[slot] == nullptr)
    return absl::InternalError("LastGradNorm: no fence for the norm");
  SHARDOPT_RETURN_IF_ERROR(norm_fence_[slot]->Wait(options_.timeout));
  std::optional<GradNormReading> r = ReadyGradNorm();
  if (!r.has_value() || r->step != step_)
    return absl::InternalError("LastGradNorm: norm not ready");
  return *r;
}

std::optional<GradNormReading> ShardedOptimizer::ReadyGradNorm() {
  if (step_ == 0 || deferred_.AnyFailed()) return std::nullopt;
  if (!async_ || device_.is_cpu()) {
    if (last_norm_.step != step_) return std::nullopt;  // restored since
    return last_norm_;
  }
  for (int64_t s : {step_, step_ - 1}) {
    if (s <= 0) break;
    if (last_norm_.step == s) return last_norm_;
    const int slot = static_cast<int>(s & 1);
    if (norm_step_[slot] != s || norm_fence_[slot] == nullptr || !norm_fence_[slot]->Ready())
      continue;
    const float* v = norm_host_.select(0, slot).data_ptr<float>();
    last_norm_.step = s;
    last_norm_.grad_norm = v[0];
    last_norm_.clipped = !(v[1] >= 1.0f);  // NaN: scaled, as ClipGradients does
    return last_norm_;
  }
  return std::nullopt;
}

bool ShardedOptimizer::Defer(const CommHandlePtr& handle, const char* what, int bucket) {
  if (!async_ || handle == nullptr || !comm_->OrderStreamAfter(handle, nullptr)) return false;
  deferred_.Add({handle, what, bucket, step_});
  return true;
}

// The first failure is reported (and the communicator aborted).
// Time blocked here is exposed communication of the next step.
absl::Status ShardedOptimizer::CheckDeferred(bool all) {
  const int64_t before = wait_ns_;
  absl::Status first = deferred_.WaitDue(all, step_, [this](const DeferredCollectives::Entry& e) {
    return WaitOrAbort(e.handle, e.what, e.bucket);
  });
  gather_wait_ns_ += wait_ns_ - before;
  return first;
}

absl::Status ShardedOptimizer::OrderPreviousGathers() {
  for (int b = static_cast<int>(ag_handles_.size()) - 1; b >= 0; --b) {
    SHARDOPT_RETURN_IF_ERROR(WaitForBucket(b));
  }
  return CheckDeferred(/*all=*/false);
}

// overlap_param_gather: every reduction is finished and the norm's
// all-reduce queued before any all-gather (collectives run in order, so it
// never waits behind them); buckets are updated and gathered first layers
// first (buckets hold layers in reverse order); Step() returns with the
// gathers in flight.
absl::Status ShardedOptimizer::StepOverlapped(StepResult* result, int64_t* update_ns) {
  const int nb = static_cast<int>(layout_.buckets().size());
  double local_sq = 0.0;
  for (int b = 0; b < nb; ++b) SHARDOPT_RETURN_IF_ERROR(FinishReduce(b, &local_sq));
  const bool clip = options_.max_grad_norm > 0.0;
  if (async_) {
    SHARDOPT_RETURN_IF_ERROR(LaunchNormOnDevice(local_sq));
    if (clip) SHARDOPT_RETURN_IF_ERROR(FinishNormOnDevice(/*clip=*/true, result));
  } else {
    SHARDOPT_RETURN_IF_ERROR(LaunchGlobalNorm(local_sq));
    if (clip) {
      SHARDOPT_ASSIGN_OR_RETURN(result->grad_norm, FinishGlobalNorm());
      result->clipped = ClipGradients(result->grad_norm);
    }
  }
  SHARDOPT_RETURN_IF_ERROR(RunExternalUpdate(update_ns));
  for (int b = nb - 1; b >= 0; --b) {
    SHARDOPT_RETURN_IF_ERROR(UpdateAndGather(b, result->step, update_ns));
  }
  if (!clip) {
    if (async_) {
      SHARDOPT_RETURN_IF_ERROR(FinishNormOnDevice(/*clip=*/false, result));
    } else {
      SHARDOPT_ASSIGN_OR_RETURN(result->grad_norm, FinishGlobalNorm());
    }
  }
  return absl::OkStatus();
}

absl::Status ShardedOptimizer::RunExternalUpdate(int64_t* update_ns) {
  if (!options_.external_update) return absl::OkStatus();
  SHARDOPT_RETURN_IF_ERROR(AgreeIfNeeded(-1));  // the whole mask
  const int64_t t0 = NowNs();
  absl::Status s = options_.external_update(active_);
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
    absl::MutexLock lock(&hook_state_->mu);
    Trace(TraceEvent::kAllGatherDone, b, -1);
    return absl::OkStatus();
  }
  const int64_t before = wait_ns_;
  absl::Status s = WaitOrAbort(ag_handles_[b], "all-gather", b);
  gather_wait_ns_ += wait_ns_ - before;
  ag_handles_[b] = nullptr;
  SHARDOPT_RETURN_IF_ERROR(s);
  absl::MutexLock lock(&hook_state_->mu);
  Trace(TraceEvent::kAllGatherDone, b, -1);
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

bool ShardedOptimizer::OrderAgreed() const {
  absl::MutexLock lock(&hook_state_->mu);
  return order_agreed_;
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
    if (clip) result->clipped = ClipGradients(result->grad_norm);
  }
  SHARDOPT_RETURN_IF_ERROR(RunExternalUpdate(update_ns));
  for (int b = 0; b < nb; ++b) {
    SHARDOPT_RETURN_IF_ERROR(UpdateAndGather(b, result->step, update_ns));
  }
  return absl::OkStatus();
}

// Each bucket updated and gathered as soon as its reduction is in; the norm
// (reported, not applied) after.
absl::Status ShardedOptimizer::StepBucketByBucket(StepResult* result, int64_t* update_ns) {
  const int nb = static_cast<int>(layout_.buckets().size());
  double local_sq = 0.0;
  for (int b = 0; b < nb; ++b) {
    SHARDOPT_RETURN_IF_ERROR(FinishReduce(b, &local_sq));
    SHARDOPT_RETURN_IF_ERROR(UpdateAndGather(b, result->step, update_ns));
  }
  if (async_) return GlobalNormOnDevice(local_sq, /*clip=*/false, result);
  SHARDOPT_ASSIGN_OR_RETURN(result->grad_norm, GlobalNorm(local_sq));
  return absl::OkStatus();
}

absl::StatusOr<StepResult> ShardedOptimizer::Step() {
  at::NoGradGuard no_grad;
  wait_ns_ = 0;
  const bool in_agreed_order = OrderAgreed();
  // The previous step's gathers (overlap_param_gather) end before this
  // step's updates write the same buffer (device_async_step: on the device,
  // and the outcome of what the last steps left to the device is checked).
  SHARDOPT_RETURN_IF_ERROR(async_ ? OrderPreviousGathers() : WaitForParameters());
  SHARDOPT_RETURN_IF_ERROR(BeginStep());
  const int nb = static_cast<int>(layout_.buckets().size());
  StepResult result;
  result.step = step_ + 1;
  SHARDOPT_RETURN_IF_ERROR(LaunchHyperAgreement());
  // Gathers waited for since the last step (forward pre-hooks), and backward
  // waiting for a staging buffer (shard_gradients), are exposed
  // communication of this step.
  wait_ns_ = gather_wait_ns_;
  gather_wait_ns_ = 0;
  {
    absl::MutexLock lock(&hook_state_->mu);
    wait_ns_ += hook_wait_ns_;
    hook_wait_ns_ = 0;
  }
  int64_t update_ns = 0;
  if (options_.overlap_param_gather) {
    SHARDOPT_RETURN_IF_ERROR(StepOverlapped(&result, &update_ns));
  } else if (options_.max_grad_norm > 0.0 || options_.external_update) {
    SHARDOPT_RETURN_IF_ERROR(StepNormFirst(&result, &update_ns));
  } else {
    SHARDOPT_RETURN_IF_ERROR(StepBucketByBucket(&result, &update_ns));
  }
  if (!options_.overlap_param_gather) {
    for (int b = 0; b < nb; ++b) SHARDOPT_RETURN_IF_ERROR(WaitForBucket(b));
    gather_wait_ns_ = 0;  // counted in wait_ns_ already
  }
  result.comm_wait_seconds = wait_ns_ * 1e-9;
  result.update_seconds = update_ns * 1e-9;
  if (!result.grad_norm_pending) last_norm_ = {result.step, result.grad_norm, result.clipped};
  // The agreement, if no update had to wait for it: it hid behind the step.
  if (!agreed_) {
    agreed_ = true;
    SHARDOPT_RETURN_IF_ERROR(FinishHyperAgreement(result.step));
  }
  if (!OrderAgreed()) SHARDOPT_RETURN_IF_ERROR(AgreeLaunchOrder());
  EndStep(result.step);
  if (in_agreed_order) {
    absl::MutexLock lock(&hook_state_->mu);
    SizeStagingAfterSecondStepLocked();
  }
  return result;
}

void ShardedOptimizer::EndStep(int64_t step) {
  absl::MutexLock lock(&hook_state_->mu);
  if (options_.shard_gradients) ReleaseShardedBuffersLocked();
  ResetBackwardStateLocked(/*needs_zero_grad=*/true);
  folded_pending_ = false;
  step_ = step;
  Trace(TraceEvent::kStepEnd, -1, -1);
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
        WaitOrAbort(comm_->AllGather(pbase + b.flat_offset * elem, b.capacity_per_rank, ptype),
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
  m.grad_bytes = options_.shard_gradients
                     ? sharded_grad_bytes_.load()
                     : bytes(grad_flat_) + bytes(comm_scratch_) + folded_bytes_.load();
  m.param_bytes = bytes(param_flat_);
  return m;
}

// ---- Gradient sharding (ZeRO-2) ----
//
// A bucket's reduce-scatter works on world_ chunks of capacity_per_rank
// elements. With a communicator that takes separate chunks (Gloo, shared
// memory, in-process) and gradients travelling in the model's type, this
// rank's chunk is its slice of owned_grad_flat_ itself: backward writes that
// part of each gradient straight into the owned gradients, and the reduction
// ends there, so only the other ranks' chunks are staged ((N-1)/N of a bucket)
// and nothing is copied after it. Otherwise (NCCL, bf16 travel) the whole
// bucket is staged and the owned chunk copied out afterwards ("reclaim").
//
// Staging is one arena in the type gradients travel in, allocated at first
// use: room for grad_staging_buffers buckets of the cap, and at least for the
// largest bucket that is staged whole (with split_own_, a bucket of one
// tensor larger than that is reduced in pieces through the arena while
// backward waits: LaunchPiecesLocked). Buckets take regions first-fit as backward reaches them and
// give them back once reduced (in launch order); when no region is free,
// backward waits for the oldest reduction in flight. Autograd's gradient is
// dropped as soon as it is copied. While micro-batches accumulate (no_sync)
// they are summed in a full-size buffer that is then reduced in place.
// Autograd's gradient tensor itself is not reduced in place: while its hook
// runs, autograd still holds references to it that cannot be told apart
// from a user's, so overwriting it could not be proven safe.

namespace {

torch::ScalarType ScalarTypeOf(DType t) {
  return t == DType::kBFloat16 ? torch::kBFloat16 : torch::kFloat;
}

}  // namespace

void ShardedOptimizer::PrepareShardedGradients() {
  absl::MutexLock lock(&hook_state_->mu);
  const int nb = static_cast<int>(layout_.buckets().size());
  gaps_.assign(nb, {});
  chunks_.assign(nb, {});
  arena_.Reset(nb);
  pieces_.clear();
  overflow_buf_.assign(nb, torch::Tensor());
  in_accum_.assign(nb, false);
  reclaimed_.assign(nb, false);
  split_own_ = comm_->SupportsSeparateChunks() && comm_type_ == DTypeOf(dtype_);
  // A bucket of the cap holds at most the cap plus each rank's alignment.
  const int64_t cap_bucket =
      layout_.options().bucket_cap_elements + world_ * layout_.options().alignment_elements;
  std::vector<int64_t> stages;
  for (const Bucket& bk : layout_.buckets()) {
    const int64_t size = bk.capacity_per_rank * world_;
    int64_t at = 0;
    for (int p : bk.params) {
      const ParamPlacement& pl = layout_.placement(p);
      if (pl.bucket_offset > at) gaps_[bk.index].push_back({at, pl.bucket_offset - at});
      at = pl.bucket_offset + pl.numel;
    }
    if (size > at) gaps_[bk.index].push_back({at, size - at});
  }
  // A tensor whose reduce-scatter would stage more than a bucket of the cap
  // is reduced in pieces of that size (LaunchPiecesLocked).
  const int64_t align = std::max<int64_t>(1, layout_.options().alignment_elements);
  piece_elements_ = split_own_ && world_ > 1 && options_.reduce_large_gradients_in_pieces
                        ? ((cap_bucket + world_ - 1) / world_ + align - 1) / align * align
                        : 0;
  for (const Bucket& bk : layout_.buckets()) {
    stages.push_back(PiecewiseLocked(bk.index) ? (world_ - 1) * piece_elements_
                                               : StageLength(bk.index));
  }
  // Room for grad_staging_buffers buckets of the cap (no more than the
  // largest buckets there are need), and at least for the largest bucket.
  std::sort(stages.rbegin(), stages.rend());
  const int staged_chunks = split_own_ ? world_ - 1 : world_;
  const int64_t cap_stage =
      std::max((cap_bucket + world_ - 1) / world_ * staged_chunks, (world_ - 1) * piece_elements_);
  int64_t largest_k = 0;
  for (int i = 0; i < options_.grad_staging_buffers && i < static_cast<int>(stages.size()); ++i) {
    largest_k += stages[i];
  }
  arena_.set_size(
      stages.empty()
          ? 0
          : std::max(stages[0], std::min(largest_k, options_.grad_staging_buffers * cap_stage)));
  UpdateGradBytesLocked();
}

int64_t ShardedOptimizer::StageLength(int b) const {
  const int64_t cap = layout_.buckets()[b].capacity_per_rank;
  return (split_own_ ? world_ - 1 : world_) * cap;
}

torch::Tensor ShardedOptimizer::AccumView(int param) {
  const ParamPlacement& pl = layout_.placement(param);
  return accum_flat_.narrow(0, layout_.buckets()[pl.bucket].flat_offset + pl.bucket_offset,
                            pl.numel);
}

void ShardedOptimizer::UpdateGradBytesLocked() {
  auto bytes = [](const torch::Tensor& t) {
    return t.defined() ? t.numel() * t.element_size() : 0;
  };
  sharded_grad_bytes_ =
      bytes(owned_grad_flat_) + bytes(accum_flat_) + bytes(staging_) + overflow_peak_bytes_;
}

// shard_gradients, after the second step (the first in the agreed order):
// if buckets still needed buffers of their own (backward fills a bucket while
// a larger one arrives, as when biases and weights are in different groups),
// the arena grows by what the largest of them lacked at the arena's end, so
// later steps need none and the memory is one arena again. Every rank decides alone: the arena is
// local memory, not part of any collective.
void ShardedOptimizer::SizeStagingAfterSecondStepLocked() {
  if (arena_sized_ || !options_.shard_gradients) return;
  arena_sized_ = true;
  // Called between steps: nothing is placed or in flight.
  if (overflow_shortfall_ == 0 || !arena_.held().empty() || overflow_bytes_ > 0) return;
  arena_.set_size(arena_.size() + overflow_shortfall_);
  staging_ = torch::empty({arena_.size()}, param_flat_.options().dtype(ScalarTypeOf(comm_type_)));
  overflow_peak_bytes_ = 0;
  UpdateGradBytesLocked();
}

template <typename Fn>
void ShardedOptimizer::ForChunks(int b, int64_t offset, int64_t length, Fn fn) {
  const int64_t cap = layout_.buckets()[b].capacity_per_rank;
  const int64_t end = offset + length;
  for (int64_t at = offset; at < end;) {
    const int r = static_cast<int>(at / cap);
    const int64_t stop = std::min(end, (r + 1) * cap);
    fn(chunks_[b][r].narrow(0, at - r * cap, stop - at), at - offset, stop - at);
    at = stop;
  }
}

void ShardedOptimizer::WriteGradLocked(int b, int64_t offset, const torch::Tensor& flat) {
  ForChunks(b, offset, flat.numel(), [&](torch::Tensor dst, int64_t from, int64_t n) {
    dst.copy_(flat.narrow(0, from, n));
  });
}

void ShardedOptimizer::ZeroGradRangeLocked(int b, int64_t offset, int64_t length) {
  ForChunks(b, offset, length, [](torch::Tensor dst, int64_t, int64_t) { dst.zero_(); });
}

void ShardedOptimizer::OnShardedGradReadyLocked(int param, torch::Tensor g) {
  const ParamPlacement& pl = layout_.placement(param);
  const int b = pl.bucket;
  Trace(TraceEvent::kGradReady, b, param);
  ++grads_seen_;
  if (needs_zero_grad_) {
    grad_after_step_ = true;
    return;
  }
  if (!g.defined()) return;
  has_grad_[param] = 1;
  at::NoGradGuard no_grad;
  if (!sync_) {  // accumulate locally; reduced with the last micro-batch
    if (!accum_flat_.defined()) {
      accum_flat_ = torch::zeros({layout_.flat_size()}, param_flat_.options());
      UpdateGradBytesLocked();
    }
    AccumView(param).add_(g.reshape({-1}));
    return;
  }
  if (ready_[param]) {
    accumulated_while_syncing_ = true;
    return;
  }
  ready_[param] = true;
  ReclaimFinishedLocked();
  if (!accum_flat_.defined() && PiecewiseLocked(b) && chunks_[b].empty() &&
      next_launch_ < static_cast<int>(launch_order_.size()) && launch_order_[next_launch_] == b) {
    // Its turn: reduced in pieces now, from autograd's gradient.
    ++bucket_ready_count_[b];  // its only parameter
    if (!order_agreed_) ready_order_.push_back(b);
    ++next_launch_;
    LaunchPiecesLocked(b, g.reshape({-1}));
    LaunchReadyBucketsLocked();
    return;
  }
  if (accum_flat_.defined()) {
    torch::Tensor acc = AccumView(param);
    acc.add_(g.reshape({-1}));
    g = torch::Tensor();
    AcquireStagingLocked(b);
    if (!in_accum_[b]) WriteGradLocked(b, pl.bucket_offset, acc);
  } else {
    AcquireStagingLocked(b);
    WriteGradLocked(b, pl.bucket_offset, g.reshape({-1}));
  }
  if (++bucket_ready_count_[b] == bucket_size_[b]) BucketCompleteLocked(b);
}

// Takes back buckets whose reduction has finished (oldest first, without
// waiting), so their staging is reused during backward.
void ShardedOptimizer::ReclaimFinishedLocked() {
  while (!pieces_.empty() && pieces_.front().handle->done()) {
    absl::Status s = WaitPieceLocked(0);
    if (!s.ok()) {
      if (hook_error_.ok()) hook_error_ = s;
      return;
    }
  }
  while (!in_flight_.empty() && rs_handles_[in_flight_.front()]->done()) {
    absl::Status s = ReclaimLocked(in_flight_.front());
    if (!s.ok()) {
      if (hook_error_.ok()) hook_error_ = s;
      return;
    }
  }
}

// Waits for the oldest reduction in flight (backward blocked: exposed).
void ShardedOptimizer::ReclaimOldestLocked() {
  const int64_t t0 = NowNs();
  absl::Status s = ReclaimLocked(in_flight_.front());
  hook_wait_ns_ += NowNs() - t0;
  if (!s.ok() && hook_error_.ok()) hook_error_ = s;
}

std::vector<ShardedOptimizer::Region> ShardedOptimizer::PieceRegionsLocked() const {
  std::vector<Region> regions;
  for (const StagedPiece& p : pieces_) regions.push_back(p.region);
  return regions;
}

bool ShardedOptimizer::PlaceLocked(int64_t length, int64_t* begin) const {
  const std::optional<int64_t> at = arena_.Place(length, PieceRegionsLocked());
  if (at) *begin = *at;
  return at.has_value();
}

// Gives bucket `b` the chunks its reduce-scatter will use (this rank's is
// its owned gradients where the communicator allows) and zeroes its padding.
void ShardedOptimizer::AcquireStagingLocked(int b) {
  if (!chunks_[b].empty()) return;
  const Bucket& bk = layout_.buckets()[b];
  const int64_t cap = bk.capacity_per_rank;
  std::vector<torch::Tensor> chunks(world_);
  if (accum_flat_.defined() && comm_type_ == DTypeOf(dtype_)) {
    // Micro-batches were accumulated: reduce that buffer in place.
    for (int r = 0; r < world_; ++r)
      chunks[r] = accum_flat_.narrow(0, bk.flat_offset + r * cap, cap);
    in_accum_[b] = true;
  } else {
    const int64_t length = StageLength(b);
    torch::Tensor buf;
    if (length > 0) {
      Region region;
      // A bucket reduced in pieces reached out of its turn is staged whole in
      // a buffer of its own (counted): waiting for the arena, or growing it
      // to fit, would undo what pieces save.
      buf = StageLocked(length, &region, &overflow_buf_[b], /*in_arena=*/!PiecewiseLocked(b));
      arena_.Hold(b, region);  // (nothing when it got a buffer of its own)
    }
    in_accum_[b] = false;
    chunks = StagedChunks(b, buf);
  }
  chunks_[b] = std::move(chunks);
  for (const auto& [begin, length] : gaps_[b]) ZeroGradRangeLocked(b, begin, length);
}

torch::Tensor ShardedOptimizer::StageLocked(int64_t length, Region* region,
                                            torch::Tensor* own_buffer, bool in_arena) {
  const auto opts = param_flat_.options().dtype(ScalarTypeOf(comm_type_));
  int64_t begin = 0;
  bool placed = in_arena && PlaceLocked(length, &begin);
  while (in_arena && !placed && !(in_flight_.empty() && pieces_.empty())) {
    if (!in_flight_.empty()) {
      ReclaimOldestLocked();  // may fail, and then drop the arena: allocated below
    } else {                  // the pieces of the bucket being launched
      const int64_t t0 = NowNs();
      absl::Status s = WaitPieceLocked(0);
      hook_wait_ns_ += NowNs() - t0;
      if (!s.ok() && hook_error_.ok()) hook_error_ = s;
    }
    placed = PlaceLocked(length, &begin);
  }
  if (in_arena && !placed && staging_.defined() && !arena_.held().empty() && hook_error_.ok()) {
    CompactStagingLocked();
    placed = PlaceLocked(length, &begin);
  }
  if (placed) {
    if (!staging_.defined()) {
      staging_ = torch::empty({arena_.size()}, opts);
      UpdateGradBytesLocked();
    }
    *region = Region{begin, length};
    return staging_.narrow(0, begin, length);
  }
  // Buckets backward reached early but cannot reduce yet (they go in launch
  // order) hold the arena: a buffer of its own, counted.
  if (in_arena) {
    const int64_t end = arena_.End(PieceRegionsLocked());
    overflow_shortfall_ = std::max(overflow_shortfall_, length - (arena_.size() - end));
  }
  *own_buffer = torch::empty({length}, opts);
  overflow_bytes_ += length * DTypeSize(comm_type_);
  if (overflow_bytes_ > overflow_peak_bytes_) {
    overflow_peak_bytes_ = overflow_bytes_;
    UpdateGradBytesLocked();
  }
  return *own_buffer;
}

void ShardedOptimizer::ReleaseOwnBufferLocked(torch::Tensor* own_buffer) {
  if (!own_buffer->defined()) return;
  overflow_bytes_ -= own_buffer->numel() * own_buffer->element_size();
  *own_buffer = torch::Tensor();
}

std::vector<torch::Tensor> ShardedOptimizer::StagedChunks(int b, const torch::Tensor& buf) {
  const int64_t cap = layout_.buckets()[b].capacity_per_rank;
  std::vector<torch::Tensor> chunks(world_);
  int at = 0;
  for (int r = 0; r < world_; ++r) {
    if (split_own_ && r == rank_) {
      chunks[r] = owner_->owned_grad(b);
    } else {
      chunks[r] = buf.narrow(0, (at++) * cap, cap);
    }
  }
  return chunks;
}

// With nothing in flight, every placed bucket is one backward is still
// filling: moves them to the arena's start, so the free room is one region.
void ShardedOptimizer::CompactStagingLocked() {
  at::NoGradGuard no_grad;
  for (const StagingArena::Move& m : arena_.Compact()) {
    torch::Tensor moved = staging_.narrow(0, m.from, m.length).clone();
    staging_.narrow(0, m.to, m.length).copy_(moved);
    chunks_[m.bucket] = StagedChunks(m.bucket, staging_.narrow(0, m.to, m.length));
  }
}

void ShardedOptimizer::LaunchShardedLocked(int b) {
  at::NoGradGuard no_grad;
  const Bucket& bk = layout_.buckets()[b];
  if (PiecewiseLocked(b) && chunks_[b].empty() && !accum_flat_.defined()) {
    // No gradient reached it (ready_ would have launched it in pieces).
    return LaunchPiecesLocked(b, torch::Tensor());
  }
  // (A bucket reduced in pieces with its chunks in place, staged whole or
  // accumulated, is launched in the same pieces below: every rank must issue
  // the same collectives, whichever way its gradient came.)
  Trace(TraceEvent::kReduceScatterStart, b, -1);
  AcquireStagingLocked(b);
  // Parameters this backward gave no gradient: what earlier micro-batches
  // accumulated, or zeros (DDP's find_unused_parameters).
  if (!in_accum_[b]) {
    for (int p : bk.params) {
      if (ready_[p]) continue;
      const ParamPlacement& pl = layout_.placement(p);
      if (accum_flat_.defined()) {
        WriteGradLocked(b, pl.bucket_offset, AccumView(p));
      } else {
        ZeroGradRangeLocked(b, pl.bucket_offset, pl.numel);
      }
    }
  }
  std::vector<void*> ptrs(world_);
  CollectiveBucketScope tag(b);  // for the flight recorder
  if (PiecewiseLocked(b)) {
    const int64_t elem = DTypeSize(comm_type_);
    for (int64_t at = 0; at < bk.capacity_per_rank; at += piece_elements_) {
      const int64_t n = std::min(piece_elements_, bk.capacity_per_rank - at);
      for (int r = 0; r < world_; ++r) {
        ptrs[r] = static_cast<char*>(chunks_[b][r].data_ptr()) + at * elem;
      }
      StagedPiece piece;  // its memory is the bucket's (freed when it is reclaimed)
      piece.bucket = b;
      LaunchPieceLocked(ptrs, n, std::move(piece));
    }
    in_flight_.push_back(b);
    return;
  }
  for (int r = 0; r < world_; ++r) ptrs[r] = chunks_[b][r].data_ptr();
  rs_handles_[b] =
      comm_->ReduceScatterChunks(ptrs, bk.capacity_per_rank, comm_type_, ReduceOp::kAverage);
  in_flight_.push_back(b);
}

bool ShardedOptimizer::PiecewiseLocked(int b) const {
  const Bucket& bk = layout_.buckets()[b];
  return piece_elements_ > 0 && bk.params.size() == 1 && bk.capacity_per_rank > piece_elements_;
}

// A bucket of one tensor larger than a piece (PiecewiseLocked), launched as
// its gradient arrives: its reduce-scatter runs as one collective per
// piece_elements_ of every rank's chunk, this rank's part written straight
// into the owned gradients and the other ranks' parts staged in the arena;
// when the arena is full, backward waits for the oldest piece. So staging
// never exceeds the arena however large the tensor (one collective would
// stage (N-1)/N of it), at the price of backward waiting while most of the
// tensor is reduced. Sums are those of one collective bit for bit: each
// element is reduced at the same ring positions. `flat_grad`: the gradient,
// flat; undefined: zeros (no gradient reached the parameter).
void ShardedOptimizer::LaunchPiecesLocked(int b, const torch::Tensor& flat_grad) {
  if (!hook_error_.ok()) return;  // a reduction failed: Step() reports it
  at::NoGradGuard no_grad;
  const Bucket& bk = layout_.buckets()[b];
  const ParamPlacement& pl = layout_.placement(bk.params[0]);
  const int64_t cap = bk.capacity_per_rank;
  Trace(TraceEvent::kReduceScatterStart, b, -1);
  // dst <- bucket elements [from, from + dst.numel()): the gradient's, zeros outside it.
  auto fill = [&](torch::Tensor dst, int64_t from) {
    const int64_t n = dst.numel();
    const int64_t lo = std::max(from, pl.bucket_offset);
    const int64_t hi = std::min(from + n, pl.bucket_offset + pl.numel);
    if (!flat_grad.defined() || lo >= hi) {
      dst.zero_();
      return;
    }
    if (lo > from) dst.narrow(0, 0, lo - from).zero_();
    dst.narrow(0, lo - from, hi - lo).copy_(flat_grad.narrow(0, lo - pl.bucket_offset, hi - lo));
    if (hi < from + n) dst.narrow(0, hi - from, from + n - hi).zero_();
  };
  torch::Tensor own = owner_->owned_grad(b);
  in_accum_[b] = false;  // reduced into the owned gradients, not from accum_flat_
  for (int64_t at = 0; at < cap; at += piece_elements_) {
    const int64_t n = std::min(piece_elements_, cap - at);
    StagedPiece piece;
    piece.bucket = b;
    torch::Tensor buf = StageLocked((world_ - 1) * n, &piece.region, &piece.own, /*in_arena=*/true);
    if (!hook_error_.ok()) {  // waiting for room found a failed reduction
      ReleaseOwnBufferLocked(&piece.own);
      return;
    }
    std::vector<void*> ptrs(world_);
    int slot = 0;
    for (int r = 0; r < world_; ++r) {
      torch::Tensor dst = r == rank_ ? own.narrow(0, at, n) : buf.narrow(0, (slot++) * n, n);
      fill(dst, r * cap + at);
      ptrs[r] = dst.data_ptr();
    }
    CollectiveBucketScope tag(b);  // for the flight recorder
    LaunchPieceLocked(ptrs, n, std::move(piece));
  }
  in_flight_.push_back(b);
}

// One piece's reduce-scatter; the bucket's handle is its last piece's.
void ShardedOptimizer::LaunchPieceLocked(const std::vector<void*>& chunks, int64_t count,
                                         StagedPiece piece) {
  piece.handle = comm_->ReduceScatterChunks(chunks, count, comm_type_, ReduceOp::kAverage);
  rs_handles_[piece.bucket] = piece.handle;
  pieces_.push_back(std::move(piece));
}

void ShardedOptimizer::FreeStagingLocked(int b) {
  arena_.Free(b);
  ReleaseOwnBufferLocked(&overflow_buf_[b]);
  chunks_[b].clear();
}

// A reduction failed: the communicator is aborted, and the collectives
// launched may still write into their staging, so the arena (with every
// region and piece in it) and the pieces' own buffers are abandoned; a later
// placement allocates a new arena. (The owned chunks are views of the owned
// gradients, which stay; an aborted communicator never runs another
// collective into them.)
absl::Status ShardedOptimizer::FailStagingLocked(const absl::Status& s) {
  comm_->Abort(s);
  if (staging_.defined()) abandoned_.push_back(staging_);
  staging_ = torch::Tensor();
  arena_.Clear();
  for (StagedPiece& p : pieces_) {
    if (p.own.defined()) abandoned_.push_back(p.own);
    ReleaseOwnBufferLocked(&p.own);
  }
  pieces_.clear();
  UpdateGradBytesLocked();
  return s;
}

// Bucket `b`'s reduction failed: collectives may still write into its
// chunks (a buffer of its own, the arena, accum_flat_), so they stay alive.
void ShardedOptimizer::AbandonChunksLocked(int b) {
  for (const torch::Tensor& c : chunks_[b]) abandoned_.push_back(c);
  ReleaseOwnBufferLocked(&overflow_buf_[b]);  // a chunk's memory, so kept in abandoned_
  FreeStagingLocked(b);
  UpdateGradBytesLocked();
}

// Waits for pieces_[index] and gives its staging back.
absl::Status ShardedOptimizer::WaitPieceLocked(size_t index) {
  StagedPiece& p = pieces_[index];
  const int b = p.bucket;
  absl::Status s = p.handle->Wait(options_.timeout);
  if (!s.ok()) {
    return FailStagingLocked(
        absl::Status(s.code(), absl::StrCat("rank ", rank_, ": reduce-scatter of bucket ", b,
                                            " (a piece) failed: ", s.message())));
  }
  ReleaseOwnBufferLocked(&p.own);
  pieces_.erase(pieces_.begin() + index);
  return absl::OkStatus();
}

absl::Status ShardedOptimizer::ReclaimLocked(int b) {
  auto it = std::find(in_flight_.begin(), in_flight_.end(), b);
  if (it == in_flight_.end()) return absl::OkStatus();
  in_flight_.erase(it);
  // A bucket reduced in pieces: its pieces still staged (the last one's
  // handle is rs_handles_[b]).
  for (size_t i = 0; i < pieces_.size();) {
    if (pieces_[i].bucket != b) {
      ++i;
      continue;
    }
    absl::Status s = WaitPieceLocked(i);  // on failure: arena and pieces abandoned
    if (!s.ok()) {
      AbandonChunksLocked(b);
      return s;
    }
  }
  absl::Status s = rs_handles_[b]->Wait(options_.timeout);
  if (!s.ok()) {
    AbandonChunksLocked(b);
    (void)FailStagingLocked(s);
    return absl::Status(s.code(), absl::StrCat("rank ", rank_, ": reduce-scatter of bucket ", b,
                                               " failed: ", s.message()));
  }
  if (in_accum_[b] || !split_own_) {  // this rank's chunk is not the owned gradient
    at::NoGradGuard no_grad;
    owner_->owned_grad(b).copy_(chunks_[b][rank_]);
  }
  FreeStagingLocked(b);
  reclaimed_[b] = true;
  Trace(TraceEvent::kReduceScatterDone, b, -1);
  return absl::OkStatus();
}

void ShardedOptimizer::ReleaseShardedBuffersLocked() {
  while (!pieces_.empty()) (void)WaitPieceLocked(0);  // none unless a launch stopped early
  for (size_t b = 0; b < chunks_.size(); ++b) {
    FreeStagingLocked(static_cast<int>(b));
    reclaimed_[b] = false;
  }
  accum_flat_ = torch::Tensor();
  UpdateGradBytesLocked();
}

}  // namespace shardopt
