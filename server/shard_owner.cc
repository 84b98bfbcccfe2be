#include "server/shard_owner.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/hyper_params.h"
#include "common/status_macros.h"

namespace shardopt {

namespace {

absl::Status ValidateGroup(OptimizerKind kind, const HyperParameters& hp) {
  if (kind == OptimizerKind::kSgd) return ValidateSgdConfig(hp.sgd);
  return ValidateAdamConfig(hp.adam);
}

// Checks the groups and the parameters' group indexes of `*options` (filling
// an empty param_group with group 0) and sets every group's
// decoupled_weight_decay from `kind`.
absl::Status ValidateGroups(OptimizerKind kind, int num_params, ShardOwnerOptions* options) {
  if (options->groups.empty()) return absl::InvalidArgumentError("no parameter group");
  if (options->param_group.empty()) options->param_group.assign(num_params, 0);
  if (static_cast<int>(options->param_group.size()) != num_params) {
    return absl::InvalidArgumentError(absl::StrCat("param_group has ", options->param_group.size(),
                                                   " entries for ", num_params, " parameters"));
  }
  for (int g : options->param_group) {
    if (g < 0 || g >= static_cast<int>(options->groups.size())) {
      return absl::InvalidArgumentError(absl::StrCat("parameter group ", g, " does not exist"));
    }
  }
  for (size_t g = 0; g < options->groups.size(); ++g) {
    HyperParameters& hp = options->groups[g];
    hp.adam.decoupled_weight_decay = kind == OptimizerKind::kAdamW;
    absl::Status s = ValidateGroup(kind, hp);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("parameter group ", g, ": ", s.message()));
    }
    if (kind == OptimizerKind::kSgd &&
        (hp.sgd.momentum != 0.0) != (options->groups[0].sgd.momentum != 0.0)) {
      return absl::InvalidArgumentError(
          "SGD parameter groups must all use momentum or all not use it");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShardOwner>> ShardOwner::Create(
    const Layout& layout, int rank, ShardOwnerOptions options, torch::Tensor param_flat,
    torch::Tensor grad_flat, std::shared_ptr<KernelBackend> backend) {
  if (rank < 0 || rank >= layout.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " outside the layout's world of ", layout.world_size()));
  }
  if (backend == nullptr) return absl::InvalidArgumentError("no kernel backend");
  if (!param_flat.defined() || !grad_flat.defined()) {
    return absl::InvalidArgumentError("flat parameter and gradient buffers are required");
  }
  int64_t owned = 0;
  for (const Bucket& b : layout.buckets()) owned += b.capacity_per_rank;
  const int64_t grad_elements = options.owned_grads_only ? owned : layout.flat_size();
  if (param_flat.dim() != 1 || param_flat.numel() != layout.flat_size() || grad_flat.dim() != 1 ||
      grad_flat.numel() != grad_elements || grad_flat.scalar_type() != param_flat.scalar_type() ||
      (param_flat.scalar_type() != torch::kFloat && param_flat.scalar_type() != torch::kBFloat16) ||
      !param_flat.is_contiguous() || !grad_flat.is_contiguous()) {
    return absl::InvalidArgumentError(
        absl::StrCat("flat buffers must be contiguous float32 or bfloat16 vectors of ",
                     layout.flat_size(), " elements (the gradient buffer ", grad_elements, ")"));
  }
  if (backend->on_device() == param_flat.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat("the ", backend->name(),
                                                   " kernel backend cannot update parameters on ",
                                                   param_flat.device().str()));
  }
  std::unique_ptr<ShardOwner> owner(new ShardOwner(layout, rank, options.kind));
  owner->backend_ = std::move(backend);
  SHARDOPT_RETURN_IF_ERROR(
      owner->Init(std::move(options), std::move(param_flat), std::move(grad_flat)));
  return owner;
}

ShardOwner::ShardOwner(const Layout& layout, int rank, OptimizerKind kind)
    : layout_(layout), rank_(rank), kind_(kind) {}

absl::Status ShardOwner::Init(ShardOwnerOptions options, torch::Tensor param_flat,
                              torch::Tensor grad_flat) {
  const int num_params = static_cast<int>(layout_.params().size());
  SHARDOPT_RETURN_IF_ERROR(ValidateGroups(kind_, num_params, &options));
  const size_t num_groups = options.groups.size();
  const bool sgd_momentum = options.groups[0].sgd.momentum != 0.0;
  {
    absl::MutexLock lock(&mu_);  // (Init runs before any other thread sees it: for the analysis)
    groups_ = std::move(options.groups);
  }
  param_group_ = std::move(options.param_group);
  param_flat_ = std::move(param_flat);
  grad_flat_ = std::move(grad_flat);
  owned_grads_only_ = options.owned_grads_only;
  bf16_ = param_flat_.scalar_type() == torch::kBFloat16;

  InitPieces(num_params);
  InitState(num_groups, sgd_momentum);
  return absl::OkStatus();
}

void ShardOwner::InitPieces(int num_params) {
  const int nb = static_cast<int>(layout_.buckets().size());
  for (const Bucket& b : layout_.buckets()) {
    owned_offset_.push_back(owned_elements_);
    owned_elements_ += b.capacity_per_rank;
  }
  // Segments: runs of consecutive pieces of one group; padding goes with the
  // run before it (the first run starts at 0), so segments tile the range.
  segments_.assign(nb, {});
  pieces_.assign(nb, {});
  param_steps_.assign(num_params, 0);
  for (const Piece& p : layout_.PiecesOfRank(rank_)) {
    pieces_[p.bucket].push_back(p);
    std::vector<Segment>& segs = segments_[p.bucket];
    const int g = param_group_[p.param];
    if (segs.empty()) {
      segs.push_back(Segment{0, 0, g});
    } else if (segs.back().group != g) {
      segs.back().size = p.rank_offset - segs.back().begin;
      segs.push_back(Segment{p.rank_offset, 0, g});
    }
  }
  for (int b = 0; b < nb; ++b) {
    if (segments_[b].empty()) segments_[b].push_back(Segment{0, 0, 0});
    segments_[b].back().size = layout_.buckets()[b].capacity_per_rank - segments_[b].back().begin;
  }
}

void ShardOwner::InitState(size_t num_groups, bool sgd_momentum) {
  const int nb = static_cast<int>(layout_.buckets().size());
  at::NoGradGuard no_grad;
  const auto f32 = torch::TensorOptions().device(param_flat_.device()).dtype(torch::kFloat);
  const bool adam = kind_ != OptimizerKind::kSgd;
  if (adam || sgd_momentum) state0_ = torch::zeros({owned_elements_}, f32);
  if (adam) state1_ = torch::zeros({owned_elements_}, f32);
  if (bf16_) {
    master_ = torch::empty({owned_elements_}, f32);
    for (int b = 0; b < nb; ++b) MasterOf(b).copy_(OwnedRange(param_flat_, b));
  }
  // The update's slices, per bucket and group (buffers never move).
  slices_.assign(nb, std::vector<std::vector<UpdateSlice>>(num_groups));
  for (int b = 0; b < nb; ++b) {
    for (const Segment& seg : segments_[b]) {
      if (seg.size > 0) slices_[b][seg.group].push_back(SliceOf(b, seg.begin, seg.size));
    }
  }
}

torch::Tensor ShardOwner::OwnedRange(const torch::Tensor& flat, int bucket) const {
  const Bucket& bk = layout_.buckets()[bucket];
  return flat.narrow(0, bk.flat_offset + rank_ * bk.capacity_per_rank, bk.capacity_per_rank);
}

torch::Tensor ShardOwner::owned_grad(int bucket) const {
  if (!owned_grads_only_) return OwnedRange(grad_flat_, bucket);
  return grad_flat_.narrow(0, owned_offset_[bucket], layout_.buckets()[bucket].capacity_per_rank);
}

torch::Tensor ShardOwner::MasterOf(int bucket) const {
  if (!bf16_) return OwnedRange(param_flat_, bucket);
  return master_.narrow(0, owned_offset_[bucket], layout_.buckets()[bucket].capacity_per_rank);
}

UpdateSlice ShardOwner::SliceOf(int bucket, int64_t begin, int64_t size) {
  const Bucket& bk = layout_.buckets()[bucket];
  const int64_t flat = bk.flat_offset + rank_ * bk.capacity_per_rank + begin;
  const int64_t owned = owned_offset_[bucket] + begin;
  const int64_t grad_at = owned_grads_only_ ? owned : flat;
  UpdateSlice s;
  s.size = size;
  s.state0 = state0_.defined() ? state0_.data_ptr<float>() + owned : nullptr;
  s.state1 = state1_.defined() ? state1_.data_ptr<float>() + owned : nullptr;
  if (bf16_) {
    s.param = master_.data_ptr<float>() + owned;
    s.grad_bf16 = reinterpret_cast<const uint16_t*>(grad_flat_.data_ptr()) + grad_at;
    s.param_bf16 = reinterpret_cast<uint16_t*>(param_flat_.data_ptr()) + flat;
  } else {
    s.param = param_flat_.data_ptr<float>() + flat;
    s.grad = grad_flat_.data_ptr<float>() + grad_at;
  }
  return s;
}

std::vector<UpdateSlice> ShardOwner::WholeSlices() {
  std::vector<UpdateSlice> slices;
  for (const Bucket& b : layout_.buckets()) {
    slices.push_back(SliceOf(b.index, 0, b.capacity_per_rank));
  }
  return slices;
}

absl::Status ShardOwner::Update(int bucket, int64_t step) {
  if (bucket < 0 || bucket >= static_cast<int>(segments_.size())) {
    return absl::OutOfRangeError(absl::StrCat("no bucket ", bucket));
  }
  if (staged_) return absl::FailedPreconditionError("cannot update while slices are staged");
  // One multi-slice call per group present in the bucket (slices built once,
  // at construction: no per-parameter host work per step).
  const std::vector<std::vector<UpdateSlice>>& by_group = slices_[bucket];
  for (size_t g = 0; g < by_group.size(); ++g) {
    if (by_group[g].empty()) continue;
    HyperParameters hp;
    {
      absl::MutexLock lock(&mu_);
      hp = groups_[g];
    }
    SHARDOPT_RETURN_IF_ERROR(backend_->Update(kind_, hp, step, by_group[g]));
  }
  for (const Piece& p : pieces_[bucket]) param_steps_[p.param] = step;
  return absl::OkStatus();
}

void ShardOwner::SetParamSteps(int64_t step) {
  std::fill(param_steps_.begin(), param_steps_.end(), step);
}

absl::Status ShardOwner::Update(int bucket, const std::vector<uint8_t>& active) {
  if (bucket < 0 || bucket >= static_cast<int>(segments_.size())) {
    return absl::OutOfRangeError(absl::StrCat("no bucket ", bucket));
  }
  if (staged_) return absl::FailedPreconditionError("cannot update while slices are staged");
  const std::vector<Piece>& pieces = pieces_[bucket];
  if (pieces.empty()) return absl::OkStatus();
  bool uniform = true;
  const int64_t count = param_steps_[pieces.front().param];
  for (const Piece& p : pieces) {
    uniform = uniform && active[p.param] != 0 && param_steps_[p.param] == count;
  }
  if (uniform) {  // the usual case: the slices built at construction
    SHARDOPT_RETURN_IF_ERROR(Update(bucket, count + 1));
    return absl::OkStatus();
  }
  // Some parameter got no gradient, or counts differ: piece by piece, one
  // backend call per (group, step) run.
  std::vector<std::pair<std::pair<int, int64_t>, UpdateSlice>> runs;
  for (const Piece& p : pieces) {
    if (active[p.param] == 0) continue;
    runs.push_back({{param_group_[p.param], param_steps_[p.param] + 1},
                    SliceOf(bucket, p.rank_offset, p.length)});
  }
  std::stable_sort(runs.begin(), runs.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 0; i < runs.size();) {
    size_t j = i;
    std::vector<UpdateSlice> slices;
    while (j < runs.size() && runs[j].first == runs[i].first) slices.push_back(runs[j++].second);
    HyperParameters hp;
    {
      absl::MutexLock lock(&mu_);
      hp = groups_[runs[i].first.first];
    }
    SHARDOPT_RETURN_IF_ERROR(backend_->Update(kind_, hp, runs[i].first.second, slices));
    i = j;
  }
  for (const Piece& p : pieces) {
    if (active[p.param] != 0) ++param_steps_[p.param];
  }
  return absl::OkStatus();
}

bool ShardOwner::AllActive(int bucket, const std::vector<uint8_t>& active) const {
  for (const Piece& p : pieces_[bucket]) {
    if (active[p.param] == 0) return false;
  }
  return true;
}

void ShardOwner::ZeroInactiveGradients(int bucket, const std::vector<uint8_t>& active) {
  at::NoGradGuard no_grad;
  torch::Tensor g;
  for (const Piece& p : pieces_[bucket]) {
    if (active[p.param] != 0) continue;
    if (!g.defined()) g = owned_grad(bucket);
    g.narrow(0, p.rank_offset, p.length).zero_();
  }
}

absl::StatusOr<double> ShardOwner::SquaredGradNorm() {
  return backend_->SquaredNorm(WholeSlices());
}

absl::StatusOr<double> ShardOwner::SquaredGradNorm(int bucket) {
  if (bucket < 0 || bucket >= static_cast<int>(layout_.buckets().size())) {
    return absl::OutOfRangeError(absl::StrCat("no bucket ", bucket));
  }
  const UpdateSlice slice = SliceOf(bucket, 0, layout_.buckets()[bucket].capacity_per_rank);
  return backend_->SquaredNorm({&slice, 1});
}

absl::Status ShardOwner::SquaredGradNormTo(double* out) {
  return backend_->SquaredNormTo(WholeSlices(), out);
}

void ShardOwner::ScaleGradients(const torch::Tensor& coef) {
  at::NoGradGuard no_grad;
  for (const Bucket& b : layout_.buckets()) {
    torch::Tensor g = owned_grad(b.index);
    if (g.scalar_type() == coef.scalar_type()) {
      g.mul_(coef);
    } else {
      // bf16 gradients: multiplied in float and rounded once, as a float
      // scalar coefficient is (a device tensor would be rounded to bf16 first).
      g.copy_(g.to(coef.scalar_type()).mul_(coef));
    }
  }
}

void ShardOwner::ScaleGradients(double coef) {
  at::NoGradGuard no_grad;
  for (const Bucket& b : layout_.buckets()) owned_grad(b.index).mul_(coef);
}

int ShardOwner::num_groups() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(groups_.size());
}

HyperParameters ShardOwner::group(int g) const {
  absl::MutexLock lock(&mu_);
  return groups_.at(g);
}

absl::Status ShardOwner::SetGroup(int g, const HyperParameters& hp) {
  absl::MutexLock lock(&mu_);
  if (g < 0 || g >= static_cast<int>(groups_.size())) {
    return absl::OutOfRangeError(
        absl::StrCat("no parameter group ", g, " (there are ", groups_.size(), ")"));
  }
  HyperParameters c = hp;
  c.adam.decoupled_weight_decay = kind_ == OptimizerKind::kAdamW;
  c.adam.maximize = groups_[g].adam.maximize;
  c.sgd.maximize = groups_[g].sgd.maximize;
  SHARDOPT_RETURN_IF_ERROR(ValidateGroup(kind_, c));
  if (kind_ == OptimizerKind::kSgd && (c.sgd.momentum != 0.0) != (groups_[g].sgd.momentum != 0.0)) {
    return absl::FailedPreconditionError(
        absl::StrCat("SGD momentum ", c.sgd.momentum, " cannot replace ", groups_[g].sgd.momentum,
                     ": one keeps a momentum buffer and the other does not"));
  }
  groups_[g] = c;
  return absl::OkStatus();
}

absl::Status ShardOwner::SetLearningRate(double lr) {
  SHARDOPT_RETURN_IF_ERROR(ValidateHyperParameter(HyperParameter::kLearningRate, lr));
  absl::MutexLock lock(&mu_);
  for (HyperParameters& hp : groups_) {
    hp.adam.lr = lr;
    hp.sgd.lr = lr;
  }
  return absl::OkStatus();
}

double ShardOwner::learning_rate() const {
  absl::MutexLock lock(&mu_);
  return kind_ == OptimizerKind::kSgd ? groups_[0].sgd.lr : groups_[0].adam.lr;
}

std::vector<std::string> ShardOwner::state_names() const {
  if (kind_ != OptimizerKind::kSgd) return {"exp_avg", "exp_avg_sq"};
  if (state0_.defined()) return {"momentum_buffer"};
  return {};
}

absl::Status ShardOwner::StageToHost() {
  if (staged_) return absl::FailedPreconditionError("owned slices are already staged");
  at::NoGradGuard no_grad;
  host_master_ = torch::empty({owned_elements_}, torch::TensorOptions().dtype(torch::kFloat));
  for (const Bucket& b : layout_.buckets()) {
    host_master_.narrow(0, owned_offset_[b.index], b.capacity_per_rank).copy_(MasterOf(b.index));
  }
  // Always a copy (on the CPU too: .to(kCPU) would alias the state).
  const auto host = torch::TensorOptions().device(torch::kCPU).dtype(torch::kFloat);
  if (state0_.defined()) host_state0_ = state0_.to(host, /*non_blocking=*/false, /*copy=*/true);
  if (state1_.defined()) host_state1_ = state1_.to(host, /*non_blocking=*/false, /*copy=*/true);
  staged_ = true;
  return absl::OkStatus();
}

absl::Status ShardOwner::EndStaging(bool copy_back) {
  if (!staged_) return absl::FailedPreconditionError("owned slices are not staged");
  at::NoGradGuard no_grad;
  if (copy_back) {
    for (const Bucket& b : layout_.buckets()) {
      MasterOf(b.index).copy_(host_master_.narrow(0, owned_offset_[b.index], b.capacity_per_rank));
    }
    if (state0_.defined()) state0_.copy_(host_state0_);
    if (state1_.defined()) state1_.copy_(host_state1_);
  }
  host_master_ = host_state0_ = host_state1_ = torch::Tensor();
  staged_ = false;
  return absl::OkStatus();
}

ShardOwner::OwnedSlice ShardOwner::owned_slice(int bucket) {
  OwnedSlice s;
  s.size = layout_.buckets()[bucket].capacity_per_rank;
  const int64_t off = owned_offset_[bucket];
  if (staged_) {
    s.master = host_master_.data_ptr<float>() + off;
    s.state0 = host_state0_.defined() ? host_state0_.data_ptr<float>() + off : nullptr;
    s.state1 = host_state1_.defined() ? host_state1_.data_ptr<float>() + off : nullptr;
    return s;
  }
  s.master = MasterOf(bucket).data_ptr<float>();
  s.state0 = state0_.defined() ? state0_.data_ptr<float>() + off : nullptr;
  s.state1 = state1_.defined() ? state1_.data_ptr<float>() + off : nullptr;
  return s;
}

void ShardOwner::WriteModelCopy(int bucket) {
  if (!bf16_) return;  // fp32 models are updated in place
  at::NoGradGuard no_grad;
  OwnedRange(param_flat_, bucket).copy_(MasterOf(bucket));
}

MemoryReport ShardOwner::memory() const {
  auto bytes = [](const torch::Tensor& t) {
    return t.defined() ? t.numel() * t.element_size() : 0;
  };
  MemoryReport m;
  m.master_bytes = bytes(master_);
  m.state_bytes = bytes(state0_) + bytes(state1_);
  return m;
}

}  // namespace shardopt
