#include "client/checkpoint/torch_interop.h"

#include <torch/serialize.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "client/checkpoint/checkpoint.h"
#include "client/comm/in_process_communicator.h"
#include "client/sharded_optimizer.h"
#include "client/checkpoint/torch_pickle.h"
#include "common/status_macros.h"

namespace shardopt {

namespace {

// LibTorch reports failures (an allocation too large for this machine, ...)
// by exceptions: they become one-line Statuses here.
template <typename Fn>
auto Guarded(const char* what, Fn fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": out of memory"));
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what()));
  }
}

// The groups in `m`'s user metadata (kMetaParamGroups / kMetaParamGroupOf),
// or one group of m.optimizer when it records none. `trainable` parameters.
absl::Status GroupsOf(const Manifest& m, size_t trainable, const std::string& dir,
                      std::vector<SavedOptimizer>* groups, std::vector<int>* group_of) {
  auto hyper = m.user_metadata.find(kMetaParamGroups);
  auto of = m.user_metadata.find(kMetaParamGroupOf);
  groups->assign(1, m.optimizer);
  group_of->assign(trainable, 0);
  if (hyper == m.user_metadata.end() || of == m.user_metadata.end()) return absl::OkStatus();
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat("'", dir, "': user metadata '", kMetaParamGroups,
                                            "' / '", kMetaParamGroupOf, "' ", why));
  };
  const nlohmann::json h =
      nlohmann::json::parse(hyper->second, nullptr, /*allow_exceptions=*/false);
  const nlohmann::json o = nlohmann::json::parse(of->second, nullptr, /*allow_exceptions=*/false);
  if (!h.is_array() || h.empty() || !o.is_array() || o.size() != trainable) {
    return bad(absl::StrCat(
        "are not a list of groups and one group index per trainable parameter (", trainable, ")"));
  }
  groups->clear();
  for (const nlohmann::json& g : h) {
    SavedOptimizer s = m.optimizer;
    auto number = [&](const char* key, double* v) {
      auto it = g.is_object() ? g.find(key) : g.end();
      if (it != g.end() && it->is_number()) *v = it->get<double>();
      return it != g.end() && it->is_number();
    };
    if (!number("lr", &s.lr) || !number("weight_decay", &s.weight_decay))
      return bad("lack lr / weight_decay");
    if (s.kind == "sgd") {
      number("momentum", &s.momentum);
      number("dampening", &s.dampening);
      auto n = g.find("nesterov");
      if (n != g.end() && n->is_boolean()) s.nesterov = n->get<bool>();
    } else {
      number("eps", &s.eps);
      auto b = g.find("betas");
      if (b == g.end() || !b->is_array() || b->size() != 2 || !(*b)[0].is_number() ||
          !(*b)[1].is_number()) {
        return bad("lack betas");
      }
      s.beta1 = (*b)[0].get<double>();
      s.beta2 = (*b)[1].get<double>();
    }
    groups->push_back(s);
  }
  for (size_t k = 0; k < trainable; ++k) {
    if (!o[k].is_number_integer() || o[k].get<int64_t>() < 0 ||
        o[k].get<int64_t>() >= static_cast<int64_t>(groups->size())) {
      return bad(absl::StrCat("name a group that does not exist for trainable parameter ", k));
    }
    (*group_of)[k] = o[k].get<int>();
  }
  return absl::OkStatus();
}

// Module buffers (BatchNorm statistics) the Python API records in the user
// metadata ("shardopt.buffers": name, dtype, shape, base64 bytes), as named
// tensors; none when absent.
absl::Status BuffersOf(const Manifest& m, const std::string& dir,
                       c10::Dict<std::string, torch::Tensor>* out) {
  auto it = m.user_metadata.find("shardopt.buffers");
  if (it == m.user_metadata.end()) return absl::OkStatus();
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat("'", dir, "': user metadata 'shardopt.buffers' ", why));
  };
  const nlohmann::json list =
      nlohmann::json::parse(it->second, nullptr, /*allow_exceptions=*/false);
  if (!list.is_array()) return bad("is not a list");
  static const std::map<std::string, at::ScalarType> kTypes = {
      {"float32", at::kFloat},     {"float64", at::kDouble}, {"float16", at::kHalf},
      {"bfloat16", at::kBFloat16}, {"int64", at::kLong},     {"int32", at::kInt},
      {"int16", at::kShort},       {"int8", at::kChar},      {"uint8", at::kByte},
      {"bool", at::kBool}};
  for (const nlohmann::json& b : list) {
    if (!b.is_object() || !b.contains("name") || !b["name"].is_string() || !b.contains("dtype") ||
        !b["dtype"].is_string() || !b.contains("shape") || !b["shape"].is_array() ||
        !b.contains("data") || !b["data"].is_string()) {
      return bad("holds an entry without name, dtype, shape and data");
    }
    auto type = kTypes.find(b["dtype"].get<std::string>());
    if (type == kTypes.end())
      return bad(absl::StrCat("has dtype '", b["dtype"].get<std::string>(), "'"));
    std::vector<int64_t> shape;
    int64_t numel = 1;
    for (const nlohmann::json& d : b["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0 || d.get<int64_t>() > (int64_t{1} << 40)) {
        return bad("has a bad shape");
      }
      shape.push_back(d.get<int64_t>());
      numel *= shape.back();
      if (numel > (int64_t{1} << 40)) return bad("has a bad shape");
    }
    std::string raw;
    if (!absl::Base64Unescape(b["data"].get<std::string>(), &raw))
      return bad("holds data that is not base64");
    torch::Tensor t = torch::empty(shape, torch::TensorOptions().dtype(type->second));
    if (static_cast<int64_t>(raw.size()) != t.numel() * static_cast<int64_t>(t.element_size())) {
      return bad(
          absl::StrCat("buffer '", b["name"].get<std::string>(), "' holds ", raw.size(), " bytes"));
    }
    if (!raw.empty()) std::memcpy(t.data_ptr(), raw.data(), raw.size());
    out->insert(b["name"].get<std::string>(), t);
  }
  return absl::OkStatus();
}

// Whole tensors, assembled from the pieces (which the manifest guarantees
// tile every trainable tensor exactly): (*full)[i][s] is state s of
// parameter i; `trainable` gets the trainable parameters' indices.
absl::Status AssembleFullTensors(FileSystem* fs, const std::string& dir, const Manifest& m,
                                 std::vector<std::vector<torch::Tensor>>* full,
                                 std::vector<int>* trainable) {
  const std::vector<std::string>& states = m.states;
  for (size_t i = 0; i < m.params.size(); ++i) {
    if (!m.params[i].trainable) continue;
    trainable->push_back(static_cast<int>(i));
    for (size_t s = 0; s < states.size(); ++s)
      (*full)[i].push_back(torch::empty(m.params[i].shape));
  }
  for (const ManifestPiece& p : m.pieces) {
    const std::string file = dir + "/" + m.files[p.file].name;
    for (size_t s = 0; s < states.size(); ++s) {
      float* dst = (*full)[p.param][s].data_ptr<float>() + p.offset;
      SHARDOPT_RETURN_IF_ERROR(fs->ReadAt(file, static_cast<uint64_t>(p.begin[s]),
                                          static_cast<size_t>(p.length) * 4, dst));
      SHARDOPT_RETURN_IF_ERROR(CheckPieceCrcs(m, p, s, reinterpret_cast<const char*>(dst), file));
    }
  }
  return absl::OkStatus();
}

// Per-parameter counts (torch.optim's state['step']) where they are not
// the step: a parameter never updated has no state, as in torch.optim.
absl::Status ParamStepsOf(const Manifest& m, const std::string& dir,
                          std::map<std::string, int64_t>* param_steps) {
  if (auto it = m.user_metadata.find(kMetaParamSteps); it != m.user_metadata.end()) {
    nlohmann::json j = nlohmann::json::parse(it->second, nullptr, false);
    if (!j.is_object()) {
      return absl::DataLossError(
          absl::StrCat("'", dir, "': user metadata '", kMetaParamSteps, "' is corrupt"));
    }
    for (const auto& [name, count] : j.items()) {
      if (!count.is_number_integer()) {
        return absl::DataLossError(
            absl::StrCat("'", dir, "': user metadata '", kMetaParamSteps, "' is corrupt"));
      }
      (*param_steps)[name] = count.get<int64_t>();
    }
  }
  return absl::OkStatus();
}

// torch.optim's param_groups: each group's hyper-parameters (with the
// defaults of the flags shardopt does not support) and its parameter indices.
c10::impl::GenericList TorchParamGroups(const std::vector<SavedOptimizer>& saved_groups,
                                        const std::string& kind,
                                        const std::vector<c10::List<int64_t>>& indices) {
  c10::impl::GenericList groups(c10::AnyType::get());
  for (size_t g = 0; g < saved_groups.size(); ++g) {
    const SavedOptimizer& o = saved_groups[g];
    c10::impl::GenericDict group(c10::StringType::get(), c10::AnyType::get());
    group.insert("lr", o.lr);
    group.insert("weight_decay", o.weight_decay);
    group.insert("maximize", false);
    group.insert("foreach", c10::IValue());
    if (kind == "sgd") {
      group.insert("momentum", o.momentum);
      group.insert("dampening", o.dampening);
      group.insert("nesterov", o.nesterov);
      group.insert("differentiable", false);
    } else {
      group.insert("betas", c10::ivalue::Tuple::create({o.beta1, o.beta2}));
      group.insert("eps", o.eps);
      group.insert("amsgrad", false);
      group.insert("capturable", false);
      group.insert("differentiable", false);
      group.insert("fused", false);
    }
    group.insert("params", indices[g]);
    groups.push_back(group);
  }
  return groups;
}

absl::Status ExportTorchUnguarded(FileSystem* fs, const std::string& dir, const std::string& out) {
  SHARDOPT_RETURN_IF_ERROR(VerifyCheckpoint(fs, dir));
  SHARDOPT_ASSIGN_OR_RETURN(Manifest m, ReadManifest(fs, dir));
  const std::vector<std::string>& states = m.states;
  std::vector<std::vector<torch::Tensor>> full(m.params.size());
  std::vector<int> trainable;
  SHARDOPT_RETURN_IF_ERROR(AssembleFullTensors(fs, dir, m, &full, &trainable));
  const std::string& kind = m.optimizer.kind;
  std::map<std::string, int64_t> param_steps;
  SHARDOPT_RETURN_IF_ERROR(ParamStepsOf(m, dir, &param_steps));
  std::vector<SavedOptimizer> saved_groups;
  std::vector<int> group_of;
  SHARDOPT_RETURN_IF_ERROR(GroupsOf(m, trainable.size(), dir, &saved_groups, &group_of));
  // torch numbers parameters group after group: index = position in that order.
  std::vector<size_t> order(trainable.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return group_of[a] < group_of[b]; });
  c10::Dict<int64_t, c10::Dict<std::string, torch::Tensor>> state;
  c10::Dict<std::string, torch::Tensor> named;
  c10::List<std::string> names;
  std::vector<c10::List<int64_t>> indices(saved_groups.size());
  for (size_t index = 0; index < order.size(); ++index) {
    const size_t k = order[index];
    const int i = trainable[k];
    const std::string& name = m.params[i].name;
    names.push_back(name);
    indices[group_of[k]].push_back(static_cast<int64_t>(index));
    named.insert(name, full[i][0]);
    c10::Dict<std::string, torch::Tensor> st;
    auto count = param_steps.find(name);
    const int64_t step = count != param_steps.end() ? count->second : m.step;
    if (kind != "sgd") st.insert("step", torch::tensor(static_cast<double>(step)));
    for (size_t s = 1; s < states.size(); ++s) st.insert(states[s], full[i][s]);
    if (states.size() > 1 && step > 0) state.insert(static_cast<int64_t>(index), st);
  }
  c10::impl::GenericList groups = TorchParamGroups(saved_groups, kind, indices);
  c10::impl::GenericDict top(c10::StringType::get(), c10::AnyType::get());
  top.insert("state", state);
  top.insert("param_groups", groups);
  top.insert("param_names", names);
  top.insert("params", named);
  c10::Dict<std::string, torch::Tensor> buffers;
  SHARDOPT_RETURN_IF_ERROR(BuffersOf(m, dir, &buffers));
  if (!buffers.empty()) top.insert("buffers", buffers);  // module buffers (model.load_state_dict)
  top.insert("step", static_cast<int64_t>(m.step));
  const std::vector<char> bytes = torch::pickle_save(top);
  const std::string data(bytes.begin(), bytes.end());
  return WriteFileAtomically(fs, out, data);
}

}  // namespace

absl::Status ExportTorch(FileSystem* fs, const std::string& dir, const std::string& out) {
  return Guarded("exporting for torch", [&] { return ExportTorchUnguarded(fs, dir, out); });
}

namespace {

absl::Status Bad(const std::string& file, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("'", file, "': ", what));
}

const PyValue* FindDict(const PyValue* v, const char* key) {
  if (v == nullptr) return nullptr;
  const PyValue* f = v->Find(std::string(key));
  return f != nullptr && f->kind == PyValue::Kind::kDict ? f : nullptr;
}

bool IsOptimizerStateDict(const PyValue* v) {
  return v != nullptr && v->kind == PyValue::Kind::kDict && FindDict(v, "state") != nullptr &&
         v->Find(std::string("param_groups")) != nullptr;
}

// name -> tensor of a model state_dict (or a combined file's "model").
absl::StatusOr<std::vector<std::pair<std::string, at::Tensor>>> ModelTensors(
    const PyValue* sd, const std::string& file) {
  if (sd == nullptr || sd->kind != PyValue::Kind::kDict)
    return Bad(file, "holds no model state_dict");
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [k, v] : sd->entries) {
    if (k->kind != PyValue::Kind::kString)
      return Bad(file, "a model state_dict key is not a string");
    if (v->kind != PyValue::Kind::kTensor) {
      return Bad(file,
                 absl::StrCat("model entry '", k->s, "' is ", v->Describe(), ", not a tensor"));
    }
    out.push_back({k->s, v->tensor});
  }
  return out;
}

bool IsBuffer(const std::string& name, const at::Tensor& t) {
  auto ends = [&](const char* suffix) {
    const size_t n = std::strlen(suffix);
    return name.size() >= n && name.compare(name.size() - n, n, suffix) == 0;
  };
  return !t.is_floating_point() || ends("running_mean") || ends("running_var") ||
         ends("num_batches_tracked");
}

absl::StatusOr<double> Number(const PyValue* group, const char* key, const std::string& file,
                              int g) {
  const PyValue* v = group->Find(std::string(key));
  if (v == nullptr || !v->IsNumber()) {
    return Bad(file, absl::StrCat("param_groups[", g, "] has no number '", key, "'"));
  }
  return v->AsDouble();
}

// One param group's hyper-parameters.
absl::StatusOr<SavedOptimizer> GroupHyper(const PyValue* group, OptimizerKind kind,
                                          const std::string& file, int g) {
  SavedOptimizer o;
  o.kind = OptimizerKindName(kind);
  SHARDOPT_ASSIGN_OR_RETURN(o.lr, Number(group, "lr", file, g));
  SHARDOPT_ASSIGN_OR_RETURN(o.weight_decay, Number(group, "weight_decay", file, g));
  for (const char* flag : {"amsgrad", "maximize"}) {
    const PyValue* v = group->Find(std::string(flag));
    if (v != nullptr && v->kind == PyValue::Kind::kBool && v->b) {
      return Bad(file, absl::StrCat(flag, "=True is not supported by shardopt"));
    }
  }
  if (kind == OptimizerKind::kSgd) {
    SHARDOPT_ASSIGN_OR_RETURN(o.momentum, Number(group, "momentum", file, g));
    SHARDOPT_ASSIGN_OR_RETURN(o.dampening, Number(group, "dampening", file, g));
    const PyValue* n = group->Find(std::string("nesterov"));
    o.nesterov = n != nullptr && n->kind == PyValue::Kind::kBool && n->b;
  } else {
    const PyValue* betas = group->Find(std::string("betas"));
    if (betas == nullptr ||
        (betas->kind != PyValue::Kind::kTuple && betas->kind != PyValue::Kind::kList) ||
        betas->items.size() != 2 || !betas->items[0]->IsNumber() || !betas->items[1]->IsNumber()) {
      return Bad(file,
                 absl::StrCat("param_groups[", g,
                              "] has no betas (is this an SGD state_dict? use --optimizer=sgd)"));
    }
    o.beta1 = betas->items[0]->AsDouble();
    o.beta2 = betas->items[1]->AsDouble();
    SHARDOPT_ASSIGN_OR_RETURN(o.eps, Number(group, "eps", file, g));
  }
  return o;
}

bool SameHyper(const SavedOptimizer& a, const SavedOptimizer& b) {
  return a.lr == b.lr && a.weight_decay == b.weight_decay && a.beta1 == b.beta1 &&
         a.beta2 == b.beta2 && a.eps == b.eps && a.momentum == b.momentum &&
         a.dampening == b.dampening && a.nesterov == b.nesterov;
}

// The optimizer's parameter indices, in order, each group's
// hyper-parameters and each index's group.
absl::Status ReadGroups(const PyValue* sd, OptimizerKind kind, const std::string& file,
                        std::vector<int64_t>* indices, TorchCheckpoint* out) {
  const PyValue* groups = sd->Find(std::string("param_groups"));
  if (groups->kind != PyValue::Kind::kList || groups->items.empty())
    return Bad(file, "param_groups is not a list");
  for (size_t g = 0; g < groups->items.size(); ++g) {
    const PyValue* group = groups->items[g].get();
    if (group->kind != PyValue::Kind::kDict) return Bad(file, "a param_group is not a dict");
    SHARDOPT_ASSIGN_OR_RETURN(SavedOptimizer h, GroupHyper(group, kind, file, static_cast<int>(g)));
    out->groups.push_back(h);
    const PyValue* params = group->Find(std::string("params"));
    if (params == nullptr || params->kind != PyValue::Kind::kList)
      return Bad(file, "a param_group has no params list");
    for (const auto& p : params->items) {
      if (p->kind != PyValue::Kind::kInt)
        return Bad(file, "a param_group's params are not indices");
      indices->push_back(p->i);
      out->group_of.push_back(static_cast<int>(g));
    }
  }
  out->optimizer = out->groups.front();
  return absl::OkStatus();
}

// Which name each optimizer index stands for.
absl::StatusOr<std::vector<std::string>> IndexNames(
    const PyValue* top, size_t count, const std::vector<std::pair<std::string, at::Tensor>>& model,
    const std::vector<std::string>* expected, const std::string& file) {
  std::vector<std::string> names;
  if (expected != nullptr) {
    names = *expected;
  } else if (const PyValue* pn = top->Find(std::string("param_names"));
             pn != nullptr && pn->kind == PyValue::Kind::kList) {
    for (const auto& n : pn->items) {
      if (n->kind != PyValue::Kind::kString) return Bad(file, "param_names holds a non-string");
      names.push_back(n->s);
    }
  } else {
    for (const auto& [name, t] : model) {
      if (!IsBuffer(name, t)) names.push_back(name);
    }
  }
  if (names.size() != count) {
    return Bad(file, absl::StrCat("the optimizer has ", count, " parameters, the model ",
                                  names.size(), " (pass the matching model with --params)"));
  }
  return names;
}

absl::Status ReadState(const PyValue* sd, const std::vector<int64_t>& indices, OptimizerKind kind,
                       const std::string& file, TorchCheckpoint* out) {
  const PyValue* state = FindDict(sd, "state");
  const std::vector<std::string> want = kind == OptimizerKind::kSgd
                                            ? std::vector<std::string>{"momentum_buffer"}
                                            : std::vector<std::string>{"exp_avg", "exp_avg_sq"};
  for (size_t k = 0; k < indices.size(); ++k) {
    const std::string& name = out->names[k];
    const PyValue* st = state->Find(indices[k]);
    if (st == nullptr) continue;  // no step taken for this parameter yet
    if (st->kind != PyValue::Kind::kDict)
      return Bad(file, absl::StrCat("state of '", name, "' is not a dict"));
    for (const std::string& s : want) {
      const PyValue* t = st->Find(s);
      if (t == nullptr || t->kind != PyValue::Kind::kTensor) {
        if (kind == OptimizerKind::kSgd && t == nullptr) continue;  // SGD without momentum
        return Bad(file, absl::StrCat("state of '", name, "' has no tensor '", s,
                                      "' (another optimizer?)"));
      }
      out->state[name][s] = t->tensor.to(at::kFloat).contiguous();
    }
    if (const PyValue* step = st->Find(std::string("step")); step != nullptr && step->IsNumber()) {
      const double v = step->AsDouble();
      if (!(v >= 0 && v < 9e15))
        return Bad(file, absl::StrCat("state of '", name, "' has a bad step"));
      out->param_steps[name] = static_cast<int64_t>(v);
      out->step = std::max<int64_t>(out->step, static_cast<int64_t>(v));
    }
  }
  // torch's SGD keeps no step; a momentum buffer means the first step is past.
  if (kind == OptimizerKind::kSgd && !out->state.empty())
    out->step = std::max<int64_t>(out->step, 1);
  // Only the counts that differ from the step are kept (a parameter without
  // state was never updated: 0).
  if (kind != OptimizerKind::kSgd && !out->state.empty()) {
    for (const std::string& name : out->names) {
      if (out->state.count(name) == 0) out->param_steps[name] = 0;
    }
  }
  for (auto it = out->param_steps.begin(); it != out->param_steps.end();) {
    it = it->second == out->step ? out->param_steps.erase(it) : std::next(it);
  }
  return absl::OkStatus();
}

absl::StatusOr<PyValuePtr> ReadTorch(const std::string& path) {
  char resolved[PATH_MAX];
  if (::realpath(path.c_str(), resolved) == nullptr)
    return absl::NotFoundError(absl::StrCat("'", path, "' does not exist"));
  return ReadTorchFile(resolved);
}

// The optimizer state_dict in `top` (itself, or a combined file's
// "optimizer" / "optimizer_state_dict") and the model state_dict next to it,
// if any; a refusal that says what the file holds instead.
absl::Status FindStateDicts(const PyValue* top, const std::string& optimizer_file,
                            const PyValue** sd_out, const PyValue** model_out) {
  const PyValue* sd = top;
  const PyValue* model = FindDict(top, "params");
  if (!IsOptimizerStateDict(sd)) {
    sd = nullptr;
    for (const char* key : {"optimizer", "optimizer_state_dict"}) {
      if (IsOptimizerStateDict(FindDict(top, key))) sd = FindDict(top, key);
    }
    for (const char* key : {"model", "model_state_dict", "state_dict"}) {
      if (FindDict(top, key) != nullptr) model = FindDict(top, key);
    }
  }
  if (sd == nullptr) {
    // A refusal names the key that should have held the state.
    for (const char* key : {"optimizer", "optimizer_state_dict"}) {
      if (const PyValue* v = top->Find(std::string(key)); v != nullptr) {
        return Bad(optimizer_file,
                   absl::StrCat("key '", key, "' holds ", v->Describe(),
                                ", not an optimizer state_dict ('state', 'param_groups'): "
                                "save optimizer.state_dict(), not the optimizer"));
      }
    }
    return Bad(optimizer_file,
               absl::StrCat("is ", top->Describe(),
                            ", neither an optimizer state_dict ('state', "
                            "'param_groups') nor {'model': ..., 'optimizer': ...}"));
  }
  *sd_out = sd;
  *model_out = model;
  return absl::OkStatus();
}

// A file of several param groups names its parameters (param_names), or the
// caller names them (`expected`).
absl::Status CheckGroupsNamed(const PyValue* top, const TorchCheckpoint& out,
                              const std::vector<std::string>* expected,
                              const std::string& optimizer_file) {
  if (out.groups.size() > 1 && expected == nullptr &&
      top->Find(std::string("param_names")) == nullptr) {
    // torch numbers parameters group after group, not in the model's order.
    return Bad(
        optimizer_file,
        absl::StrCat(
            "has ", out.groups.size(),
            " param_groups and no parameter names: which model parameter each index "
            "stands for is not recorded. Load it from the training script instead "
            "(ShardedOptimizer.load_checkpoint "
            "with the optimizer built with the same groups), where the live optimizer names them"));
  }
  return absl::OkStatus();
}

// out->params: each named parameter's tensor from the model, as float32.
absl::Status CopyNamedParams(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                             const std::string& model_file, TorchCheckpoint* out) {
  for (const std::string& name : out->names) {
    auto it = std::find_if(tensors.begin(), tensors.end(),
                           [&](const auto& e) { return e.first == name; });
    if (it == tensors.end()) return Bad(model_file, absl::StrCat("has no parameter '", name, "'"));
    out->params[name] = it->second.to(at::kFloat).contiguous();
  }
  return absl::OkStatus();
}

// Every state tensor has its parameter's elements (and shape, beyond 1-D).
absl::Status CheckStateSizes(TorchCheckpoint* out, const std::string& optimizer_file) {
  for (const auto& [name, states] : out->state) {
    for (const auto& [s, t] : states) {
      if (t.numel() != out->params[name].numel() ||
          (t.dim() > 1 && t.sizes() != out->params[name].sizes())) {
        return Bad(optimizer_file,
                   absl::StrCat("'", s, "' of '", name, "' has ", t.numel(),
                                " elements, the parameter ", out->params[name].numel()));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

absl::StatusOr<TorchCheckpoint> ReadTorchCheckpointUnguarded(
    const std::string& optimizer_file, const std::string& params_file, OptimizerKind kind,
    const std::vector<std::string>* expected) {
  SHARDOPT_ASSIGN_OR_RETURN(PyValuePtr top, ReadTorch(optimizer_file));
  const PyValue* sd = nullptr;
  const PyValue* model = nullptr;
  SHARDOPT_RETURN_IF_ERROR(FindStateDicts(top.get(), optimizer_file, &sd, &model));
  PyValuePtr params_top;
  if (!params_file.empty()) {
    SHARDOPT_ASSIGN_OR_RETURN(params_top, ReadTorch(params_file));
    model = params_top.get();
    for (const char* key : {"model", "model_state_dict", "state_dict", "params"}) {
      if (FindDict(params_top.get(), key) != nullptr) model = FindDict(params_top.get(), key);
    }
  }
  if (model == nullptr) {
    return Bad(optimizer_file,
               "holds no parameters: pass the model's state_dict file (--params=MODEL.pt)");
  }
  const std::string& model_file = params_file.empty() ? optimizer_file : params_file;
  SHARDOPT_ASSIGN_OR_RETURN(auto tensors, ModelTensors(model, model_file));
  TorchCheckpoint out;
  std::vector<int64_t> indices;
  SHARDOPT_RETURN_IF_ERROR(ReadGroups(sd, kind, optimizer_file, &indices, &out));
  SHARDOPT_RETURN_IF_ERROR(CheckGroupsNamed(top.get(), out, expected, optimizer_file));
  SHARDOPT_ASSIGN_OR_RETURN(
      out.names, IndexNames(top.get(), indices.size(), tensors, expected, optimizer_file));
  SHARDOPT_RETURN_IF_ERROR(CopyNamedParams(tensors, model_file, &out));
  SHARDOPT_RETURN_IF_ERROR(ReadState(sd, indices, kind, optimizer_file, &out));
  SHARDOPT_RETURN_IF_ERROR(CheckStateSizes(&out, optimizer_file));
  if (const PyValue* step = top->Find(std::string("step"));
      step != nullptr && step->kind == PyValue::Kind::kInt) {
    out.step = step->i;  // shardopt's export records it (SGD's state has none)
  }
  if (out.step < 0) return Bad(optimizer_file, "has a negative step");
  return out;
}

}  // namespace

absl::StatusOr<TorchCheckpoint> ReadTorchCheckpoint(const std::string& optimizer_file,
                                                    const std::string& params_file,
                                                    OptimizerKind kind,
                                                    const std::vector<std::string>* expected) {
  return Guarded(optimizer_file.c_str(), [&] {
    return ReadTorchCheckpointUnguarded(optimizer_file, params_file, kind, expected);
  });
}

namespace {

// Writes this rank's owned slices from `t`.
absl::Status FillFromTorch(ShardedOptimizer& opt, const TorchCheckpoint& t,
                           const std::string& file) {
  const Layout& layout = opt.layout();
  const std::vector<std::string> states = opt.state_names();
  for (const Piece& p : layout.PiecesOfRank(opt.communicator()->rank())) {
    const ParamSpec& spec = layout.params()[p.param];
    auto it = t.params.find(spec.name);
    if (it == t.params.end()) return Bad(file, absl::StrCat("has no parameter '", spec.name, "'"));
    if (it->second.numel() != layout.placement(p.param).numel) {
      return Bad(file, absl::StrCat("parameter '", spec.name, "' has ", it->second.numel(),
                                    " elements, this model ", layout.placement(p.param).numel));
    }
    // Same element count is not enough: an [8,16] tensor would load into a
    // [16,8] parameter without a word (the sharded and safetensors paths
    // compare shapes too).
    if (it->second.sizes().vec() != spec.shape) {
      return Bad(file, absl::StrCat("parameter '", spec.name, "' has shape [",
                                    absl::StrJoin(it->second.sizes(), ","), "], this model [",
                                    absl::StrJoin(spec.shape, ","), "]"));
    }
    ShardedOptimizer::OwnedSlice slice = OptimizerStateAccess(opt).owned_slice(p.bucket);
    std::memcpy(slice.master + p.rank_offset, it->second.data_ptr<float>() + p.param_offset,
                p.length * 4);
    float* arrays[2] = {slice.state0, slice.state1};
    auto st = t.state.find(spec.name);
    for (size_t s = 0; s < states.size(); ++s) {
      if (st == t.state.end() || st->second.count(states[s]) == 0) {
        if (t.step > 0)
          return Bad(file, absl::StrCat("has no '", states[s], "' for '", spec.name, "'"));
        std::memset(arrays[s] + p.rank_offset, 0,
                    p.length * 4);  // before the first step: zero state
        continue;
      }
      std::memcpy(arrays[s] + p.rank_offset,
                  st->second.at(states[s]).data_ptr<float>() + p.param_offset, p.length * 4);
    }
  }
  return absl::OkStatus();
}

std::vector<std::string> TrainableNames(const Layout& layout) {
  std::vector<std::string> names;
  for (const ParamSpec& p : layout.params()) {
    if (p.trainable) names.push_back(p.name);
  }
  return names;
}

// The file's param groups are the live optimizer's: as many, with the same
// parameters in each (a parameter in another group would get its
// hyper-parameters).
absl::Status CheckGroups(const ShardedOptimizer& opt, const TorchCheckpoint& t,
                         const std::string& file) {
  const int theirs = static_cast<int>(t.groups.size());
  if (theirs == 1 && opt.num_groups() == 1) return absl::OkStatus();
  if (theirs != opt.num_groups()) {  // as torch.optim's load_state_dict refuses it
    return Bad(
        file, absl::StrCat("has ", theirs, " param_groups, this optimizer ", opt.num_groups(),
                           ": build it with the same groups as the optimizer that saved the file"));
  }
  const std::vector<int>& ours = opt.options().param_group;
  int trainable = 0;
  for (size_t i = 0; i < opt.layout().params().size(); ++i) {
    if (!opt.layout().params()[i].trainable) continue;
    const int mine = ours.empty() ? 0 : ours[i];
    if (trainable < static_cast<int>(t.group_of.size()) && t.group_of[trainable] != mine) {
      return Bad(
          file, absl::StrCat("parameter '", opt.layout().params()[i].name, "' is in param_groups[",
                             t.group_of[trainable], "] there and in group ", mine,
                             " here: build the optimizer with the same groups, in the same order"));
    }
    ++trainable;
  }
  return absl::OkStatus();
}

absl::StatusOr<RestoredCheckpoint> LoadTorchCheckpoint(ShardedOptimizer& opt,
                                                       const std::string& path) {
  RestoredCheckpoint info;
  auto fill = [&]() -> absl::Status {
    const std::vector<std::string> names = TrainableNames(opt.layout());
    SHARDOPT_ASSIGN_OR_RETURN(TorchCheckpoint t,
                              ReadTorchCheckpoint(path, "", opt.options().kind, &names));
    SHARDOPT_RETURN_IF_ERROR(CheckGroups(opt, t, path));
    info = {path, "torch", t.step, 0, t.optimizer, t.groups, {}, false};
    if (!t.param_steps.empty()) {
      info.user_metadata[kMetaParamSteps] = nlohmann::json(t.param_steps).dump();
    }
    return FillFromTorch(opt, t, path);
  };
  SHARDOPT_RETURN_IF_ERROR(RestoreOwnedSlices(opt, fill, info));
  return info;
}

}  // namespace

namespace {

absl::Status ImportTorchUnguarded(const std::string& optimizer_file, const std::string& params_file,
                                  OptimizerKind kind, const std::string& out_root) {
  SHARDOPT_ASSIGN_OR_RETURN(TorchCheckpoint t,
                            ReadTorchCheckpoint(optimizer_file, params_file, kind));
  std::vector<std::pair<std::string, torch::Tensor>> params;
  for (const std::string& name : t.names) {
    params.emplace_back(name, t.params.at(name).clone().set_requires_grad(true));
  }
  ShardedOptimizerOptions o;
  o.kind = kind;
  if (kind == OptimizerKind::kAdamW) o.adam = AdamWConfig();
  if (kind == OptimizerKind::kSgd) o.sgd.momentum = t.optimizer.momentum;
  CheckpointOptions co;
  if (t.groups.size() > 1) {
    // The file's groups (named by its param_names): kept, and recorded for
    // every reader (resume, consolidate --format=torch).
    nlohmann::json hyper = nlohmann::json::array();
    for (const SavedOptimizer& g : t.groups) {
      HyperParameters h{o.adam, o.sgd};
      h.adam.lr = h.sgd.lr = g.lr;
      h.adam.weight_decay = h.sgd.weight_decay = g.weight_decay;
      h.adam.beta1 = g.beta1;
      h.adam.beta2 = g.beta2;
      h.adam.eps = g.eps;
      h.sgd.momentum = g.momentum;
      h.sgd.dampening = g.dampening;
      h.sgd.nesterov = g.nesterov;
      o.groups.push_back(h);
      if (kind == OptimizerKind::kSgd) {
        hyper.push_back({{"lr", g.lr},
                         {"momentum", g.momentum},
                         {"dampening", g.dampening},
                         {"weight_decay", g.weight_decay},
                         {"nesterov", g.nesterov}});
      } else {
        hyper.push_back({{"lr", g.lr},
                         {"betas", {g.beta1, g.beta2}},
                         {"eps", g.eps},
                         {"weight_decay", g.weight_decay}});
      }
    }
    o.param_group = t.group_of;
    co.user_metadata[kMetaParamGroups] = hyper.dump();
    co.user_metadata[kMetaParamGroupOf] = nlohmann::json(t.group_of).dump();
  }
  InProcessWorld world(1, absl::Seconds(60));
  auto comm = world.Connect(0);
  SHARDOPT_ASSIGN_OR_RETURN(auto opt, ShardedOptimizer::Create(params, o, comm.get()));
  RestoredCheckpoint info{optimizer_file, "torch", t.step, 0, t.optimizer, t.groups, {}, false};
  if (!t.param_steps.empty()) {
    info.user_metadata[kMetaParamSteps] = nlohmann::json(t.param_steps).dump();
  }
  SHARDOPT_RETURN_IF_ERROR(RestoreOwnedSlices(
      *opt, [&] { return FillFromTorch(*opt, t, optimizer_file); }, info));
  return SaveCheckpoint(*opt, out_root, co).status();
}

}  // namespace

absl::Status ImportTorch(const std::string& optimizer_file, const std::string& params_file,
                         OptimizerKind kind, const std::string& out_root) {
  return Guarded(optimizer_file.c_str(),
                 [&] { return ImportTorchUnguarded(optimizer_file, params_file, kind, out_root); });
}

absl::StatusOr<RestoredCheckpoint> LoadAnyCheckpoint(ShardedOptimizer& opt, const std::string& path,
                                                     FileSystem* fs) {
  std::string target = path;
  if (fs->Kind(path) == EntryKind::kSymlink) {
    // The user named this file; a link to it is fine (files inside a
    // checkpoint directory are never followed).
    char resolved[PATH_MAX];
    if (::realpath(path.c_str(), resolved) != nullptr) target = resolved;
  }
  if (fs->Kind(target) == EntryKind::kFile) {
    char magic[4] = {0, 0, 0, 0};
    auto size = fs->FileSize(target);
    if (size.ok() && *size >= 4 && fs->ReadAt(target, 0, 4, magic).ok() &&
        std::memcmp(magic, "PK\x03\x04", 4) == 0) {
      return LoadTorchCheckpoint(opt, target);
    }
  }
  return LoadCheckpoint(opt, target, fs);
}

}  // namespace shardopt
