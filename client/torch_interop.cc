#include "client/torch_interop.h"

#include <torch/serialize.h>

#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "client/checkpoint.h"
#include "client/in_process_communicator.h"
#include "client/sharded_optimizer.h"
#include "common/status_macros.h"

namespace shardopt {

namespace {

absl::StatusOr<std::vector<char>> ReadBytes(const std::string& path) {
  SHARDOPT_ASSIGN_OR_RETURN(std::string data, ReadWholeFile(PosixFileSystem(), path));
  return std::vector<char>(data.begin(), data.end());
}

}  // namespace

absl::Status ExportTorch(FileSystem* fs, const std::string& dir, const std::string& out) {
  SHARDOPT_RETURN_IF_ERROR(VerifyCheckpoint(fs, dir));
  SHARDOPT_ASSIGN_OR_RETURN(nlohmann::json m, ReadManifest(fs, dir));
  const auto states = m["states"].get<std::vector<std::string>>();
  const auto& params = m["params"];
  // Whole tensors, assembled from the pieces.
  std::vector<std::vector<torch::Tensor>> full(params.size());
  std::vector<int> trainable;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i]["trainable"].get<bool>()) continue;
    trainable.push_back(static_cast<int>(i));
    for (size_t s = 0; s < states.size(); ++s) {
      full[i].push_back(torch::empty(params[i]["shape"].get<std::vector<int64_t>>()));
    }
  }
  for (const auto& p : m["pieces"]) {
    const size_t i = p["param"].get<size_t>();
    const std::string file = dir + "/" + m["files"][p["file"].get<size_t>()]["name"].get<std::string>();
    for (size_t s = 0; s < states.size(); ++s) {
      float* dst = full[i][s].data_ptr<float>() + p["offset"].get<int64_t>();
      SHARDOPT_RETURN_IF_ERROR(fs->ReadAt(file, p["begin"][s].get<int64_t>(),
                                          p["length"].get<size_t>() * 4, dst));
    }
  }
  const std::string kind = m["optimizer"]["kind"].get<std::string>();
  const double step = static_cast<double>(m["step"].get<int64_t>());
  c10::Dict<int64_t, c10::Dict<std::string, torch::Tensor>> state;
  c10::Dict<std::string, torch::Tensor> named;
  c10::List<std::string> names;
  c10::List<int64_t> indices;
  for (size_t k = 0; k < trainable.size(); ++k) {
    const int i = trainable[k];
    const std::string name = params[i]["name"].get<std::string>();
    names.push_back(name);
    indices.push_back(static_cast<int64_t>(k));
    named.insert(name, full[i][0]);
    c10::Dict<std::string, torch::Tensor> st;
    if (kind != "sgd") st.insert("step", torch::tensor(step));
    for (size_t s = 1; s < states.size(); ++s) st.insert(states[s], full[i][s]);
    if (states.size() > 1) state.insert(static_cast<int64_t>(k), st);
  }
  const auto& o = m["optimizer"];
  c10::impl::GenericDict group(c10::StringType::get(), c10::AnyType::get());
  group.insert("lr", o["lr"].get<double>());
  group.insert("weight_decay", o["weight_decay"].get<double>());
  group.insert("maximize", false);
  group.insert("foreach", c10::IValue());
  if (kind == "sgd") {
    group.insert("momentum", o["momentum"].get<double>());
    group.insert("dampening", o["dampening"].get<double>());
    group.insert("nesterov", o["nesterov"].get<bool>());
    group.insert("differentiable", false);
  } else {
    group.insert("betas", c10::ivalue::Tuple::create({o["betas"][0].get<double>(), o["betas"][1].get<double>()}));
    group.insert("eps", o["eps"].get<double>());
    group.insert("amsgrad", false);
    group.insert("capturable", false);
    group.insert("differentiable", false);
    group.insert("fused", false);
  }
  group.insert("params", indices);
  c10::impl::GenericList groups(c10::AnyType::get());
  groups.push_back(group);
  c10::impl::GenericDict top(c10::StringType::get(), c10::AnyType::get());
  top.insert("state", state);
  top.insert("param_groups", groups);
  top.insert("param_names", names);
  top.insert("params", named);
  const std::vector<char> bytes = torch::pickle_save(top);
  const std::string data(bytes.begin(), bytes.end());
  return WriteFileAtomically(fs, out, data);
}

absl::Status ImportTorch(const std::string& optimizer_file, const std::string& params_file,
                         OptimizerKind kind, const std::string& out_root) {
  SHARDOPT_ASSIGN_OR_RETURN(std::vector<char> opt_bytes, ReadBytes(optimizer_file));
  c10::IValue top;
  try {
    top = torch::pickle_load(opt_bytes);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("'", optimizer_file, "' is not a torch.save file: ", e.what()));
  }
  if (!top.isGenericDict()) return absl::InvalidArgumentError("optimizer file: not a state_dict");
  auto sd = top.toGenericDict();
  if (!sd.contains("state") || !sd.contains("param_groups")) {
    return absl::InvalidArgumentError("optimizer file: no 'state' / 'param_groups' (not an optimizer state_dict)");
  }
  // The model's parameters: name -> tensor, in registration order.
  c10::impl::GenericDict named(c10::StringType::get(), c10::TensorType::get());
  if (params_file.empty()) {
    if (!sd.contains("params")) return absl::InvalidArgumentError("no parameters: pass the model's state_dict file");
    named = sd.at("params").toGenericDict();
  } else {
    SHARDOPT_ASSIGN_OR_RETURN(std::vector<char> pb, ReadBytes(params_file));
    try {
      named = torch::pickle_load(pb).toGenericDict();
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("'", params_file, "' is not a state_dict: ", e.what()));
    }
  }
  std::vector<std::pair<std::string, torch::Tensor>> params;
  for (const auto& item : named) {
    params.emplace_back(item.key().toStringRef(),
                        item.value().toTensor().to(torch::kFloat).contiguous().clone().set_requires_grad(true));
  }
  auto groups = sd.at("param_groups").toList();
  if (groups.size() != 1) return absl::InvalidArgumentError("only one param_group is supported");
  auto group = groups.get(0).toGenericDict();
  ShardedOptimizerOptions o;
  o.kind = kind;
  if (kind == OptimizerKind::kSgd) {
    o.sgd.lr = group.at("lr").toDouble();
    o.sgd.momentum = group.at("momentum").toDouble();
    o.sgd.dampening = group.at("dampening").toDouble();
    o.sgd.weight_decay = group.at("weight_decay").toDouble();
    o.sgd.nesterov = group.at("nesterov").toBool();
  } else {
    o.adam.lr = group.at("lr").toDouble();
    auto betas = group.at("betas").toTuple()->elements();
    o.adam.beta1 = betas[0].toDouble();
    o.adam.beta2 = betas[1].toDouble();
    o.adam.eps = group.at("eps").toDouble();
    o.adam.weight_decay = group.at("weight_decay").toDouble();
  }
  const auto indices = group.at("params").toList();
  if (indices.size() != params.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the optimizer has ", indices.size(),
                                                   " parameters, the model file ", params.size()));
  }
  InProcessWorld world(1, absl::Seconds(60));
  auto comm = world.Connect(0);
  SHARDOPT_ASSIGN_OR_RETURN(auto opt, ShardedOptimizer::Create(params, o, comm.get()));
  const std::vector<std::string> state_names = opt->state_names();
  auto state = sd.at("state").toGenericDict();
  int64_t step = 0;
  const Layout& layout = opt->layout();
  for (const Piece& p : layout.PiecesOfRank(0)) {
    ShardedOptimizer::OwnedSlice slice = opt->owned_slice(p.bucket);
    const int64_t key = indices.get(p.param).toInt();
    if (!state.contains(key)) {
      if (!state_names.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("no optimizer state for parameter '",
                                                       layout.params()[p.param].name, "'"));
      }
      continue;
    }
    auto st = state.at(key).toGenericDict();
    float* arrays[2] = {slice.state0, slice.state1};
    for (size_t s = 0; s < state_names.size(); ++s) {
      if (!st.contains(state_names[s])) {
        return absl::InvalidArgumentError(absl::StrCat("state of '", layout.params()[p.param].name,
                                                       "' has no '", state_names[s], "'"));
      }
      torch::Tensor t = st.at(state_names[s]).toTensor().to(torch::kFloat).contiguous().view(-1);
      if (t.numel() != layout.placement(p.param).numel) {
        return absl::InvalidArgumentError(absl::StrCat("'", state_names[s], "' of '",
                                                       layout.params()[p.param].name, "' has ",
                                                       t.numel(), " elements"));
      }
      std::memcpy(arrays[s] + p.rank_offset, t.data_ptr<float>() + p.param_offset, p.length * 4);
    }
    if (st.contains("step")) {
      const c10::IValue v = st.at("step");
      step = v.isTensor() ? static_cast<int64_t>(v.toTensor().item<double>()) : static_cast<int64_t>(v.toDouble());
    }
  }
  // torch's SGD keeps no step; a momentum buffer means the first step is past.
  if (kind == OptimizerKind::kSgd && !state_names.empty() && state.size() > 0) step = std::max<int64_t>(step, 1);
  SHARDOPT_RETURN_IF_ERROR(opt->FinishRestore(step));
  return SaveCheckpoint(*opt, out_root).status();
}

}  // namespace shardopt
