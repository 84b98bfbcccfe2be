#include "client/checkpoint/full_state.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "absl/strings/str_join.h"
#include "client/checkpoint/checkpoint.h"
#include "common/status_macros.h"

namespace shardopt {

namespace {

// Names of the arrays of an owned slice, in OwnedSlice order.
std::vector<std::string> ArrayNames(const ShardedOptimizer& opt) {
  std::vector<std::string> names = {"param"};
  for (const std::string& s : opt.state_names()) names.push_back(s);
  return names;
}

float* ArrayOf(const ShardedOptimizer::OwnedSlice& s, size_t k) {
  return k == 0 ? s.master : k == 1 ? s.state0 : s.state1;
}

}  // namespace

absl::StatusOr<FullState> GatherFullState(ShardedOptimizer& opt) {
  const Layout& layout = opt.layout();
  const int world = layout.world_size();
  const int rank = opt.communicator()->rank();
  const std::vector<std::string> names = ArrayNames(opt);
  SHARDOPT_RETURN_IF_ERROR(opt.WaitForParameters());  // overlap_param_gather
  const bool staged = opt.on_device();
  if (staged) SHARDOPT_RETURN_IF_ERROR(OptimizerStateAccess(opt).StageToHost());
  FullState out;
  out.step = opt.step_count();
  absl::Status status;
  for (const Bucket& b : layout.buckets()) {
    ShardedOptimizer::OwnedSlice own = OptimizerStateAccess(opt).owned_slice(b.index);
    for (size_t k = 0; k < names.size() && status.ok(); ++k) {
      auto buf =
          std::make_shared<std::vector<float>>(static_cast<size_t>(b.capacity_per_rank) * world);
      std::memcpy(buf->data() + rank * b.capacity_per_rank, ArrayOf(own, k),
                  b.capacity_per_rank * sizeof(float));
      CollectiveBucketScope tag(b.index);
      // On a timeout WaitSafely keeps `buf` alive: a late peer may still write it.
      status = WaitSafely(
          opt.communicator(),
          opt.communicator()->AllGather(buf->data(), b.capacity_per_rank, DType::kFloat32),
          opt.options().timeout, buf);
      if (!status.ok()) {
        if (status.code() != absl::StatusCode::kDeadlineExceeded) opt.communicator()->Abort(status);
        break;
      }
      for (int p : b.params) {
        const ParamSpec& spec = layout.params()[p];
        const ParamPlacement& pl = layout.placement(p);
        out.tensors[spec.name][names[k]] =
            torch::from_blob(buf->data() + pl.bucket_offset, {pl.numel}, torch::kFloat)
                .clone()
                .view(spec.shape);
      }
    }
    if (!status.ok()) break;
  }
  if (staged) (void)OptimizerStateAccess(opt).EndStaging(/*copy_back=*/false);
  SHARDOPT_RETURN_IF_ERROR(status);
  // Each parameter's count from a rank that owns a piece of it (the owners
  // of a cut parameter agree): every rank's counts, -1 where it owns none.
  const int n = static_cast<int>(layout.params().size());
  auto counts = std::make_shared<std::vector<int64_t>>(static_cast<size_t>(n) * world, -1);
  for (const Piece& p : layout.PiecesOfRank(rank)) {
    (*counts)[static_cast<size_t>(rank) * n + p.param] = opt.shard_owner().param_step(p.param);
  }
  SHARDOPT_RETURN_IF_ERROR(WaitSafely(
      opt.communicator(), opt.communicator()->AllGather(counts->data(), n * 8, DType::kByte),
      opt.options().timeout, counts));
  for (int p = 0; p < n; ++p) {
    int64_t count = -1;
    for (int r = 0; r < world; ++r)
      count = std::max(count, (*counts)[static_cast<size_t>(r) * n + p]);
    if (count >= 0 && count != out.step) out.param_steps[layout.params()[p].name] = count;
  }
  return out;
}

namespace {

// Writes this rank's owned slices of the states (not the parameters) from
// `state`, refusing a missing parameter or state, or a shape that differs.
absl::Status FillFromFullState(ShardedOptimizer& opt, const FullState& state, const Layout& layout,
                               int rank, const std::vector<std::string>& names) {
  if (state.step < 0) return absl::InvalidArgumentError("step must be >= 0");
  for (const Piece& p : layout.PiecesOfRank(rank)) {
    const ParamSpec& spec = layout.params()[p.param];
    auto it = state.tensors.find(spec.name);
    if (it == state.tensors.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the state has no entry for parameter '", spec.name, "'"));
    }
    ShardedOptimizer::OwnedSlice own = OptimizerStateAccess(opt).owned_slice(p.bucket);
    for (size_t k = 1; k < names.size(); ++k) {  // states only: parameters stay the model's
      auto t = it->second.find(names[k]);
      if (t == it->second.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "parameter '", spec.name, "' has no '", names[k], "' in the state (it has: ",
            absl::StrJoin(it->second, ", ",
                          [](std::string* o, const auto& kv) { o->append(kv.first); }),
            ")"));
      }
      if (!t->second.defined() || t->second.sizes().vec() != spec.shape) {
        return absl::InvalidArgumentError(
            absl::StrCat("state '", names[k], "' of parameter '", spec.name, "' has shape [",
                         t->second.defined() ? absl::StrJoin(t->second.sizes(), ", ") : "undefined",
                         "], the parameter [", absl::StrJoin(spec.shape, ", "), "]"));
      }
      torch::Tensor src = t->second.to(torch::kCPU, torch::kFloat).contiguous().view({-1});
      std::memcpy(ArrayOf(own, k) + p.rank_offset, src.data_ptr<float>() + p.param_offset,
                  p.length * sizeof(float));
    }
  }
  return absl::OkStatus();
}

// `s` as the optimizer's kind with group 0's hyper-parameters `g0`.
void DescribeGroupZero(const ShardedOptimizer& opt, const HyperParameters& g0, SavedOptimizer* s) {
  s->kind = OptimizerKindName(opt.options().kind);
  const bool sgd = opt.options().kind == OptimizerKind::kSgd;
  s->lr = sgd ? g0.sgd.lr : g0.adam.lr;
  s->beta1 = g0.adam.beta1;
  s->beta2 = g0.adam.beta2;
  s->eps = g0.adam.eps;
  s->momentum = g0.sgd.momentum;
  s->dampening = g0.sgd.dampening;
  s->nesterov = g0.sgd.nesterov;
  s->weight_decay = sgd ? g0.sgd.weight_decay : g0.adam.weight_decay;
}

}  // namespace

absl::Status LoadFullState(ShardedOptimizer& opt, const FullState& state) {
  const Layout& layout = opt.layout();
  const int rank = opt.communicator()->rank();
  const std::vector<std::string> names = ArrayNames(opt);
  std::vector<HyperParameters> groups;
  for (int g = 0; g < opt.num_groups(); ++g) groups.push_back(opt.group(g));
  RestoredCheckpoint info;
  info.step = state.step;
  info.format = "state_dict";
  if (!state.param_steps.empty()) {
    nlohmann::json steps = nlohmann::json::object();
    for (const auto& [name, count] : state.param_steps) steps[name] = count;
    info.user_metadata[kMetaParamSteps] = steps.dump();
  }
  auto fill = [&]() -> absl::Status { return FillFromFullState(opt, state, layout, rank, names); };
  // RestoreOwnedSlices applies info.optimizer to every group: give it group
  // 0's values, then put every group back.
  DescribeGroupZero(opt, groups[0], &info.optimizer);
  SHARDOPT_RETURN_IF_ERROR(RestoreOwnedSlices(opt, fill, info));
  for (size_t g = 0; g < groups.size(); ++g) {
    SHARDOPT_RETURN_IF_ERROR(opt.SetGroup(static_cast<int>(g), groups[g]));
  }
  return absl::OkStatus();
}

}  // namespace shardopt
