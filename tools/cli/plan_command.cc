#include "tools/cli/plan_command.h"

#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "advisor/cost_model.h"
#include "advisor/inputs.h"
#include "client/checkpoint/manifest.h"
#include "client/checkpoint/torch_pickle.h"
#include "common/file_system.h"
#include "tools/cli/flags.h"
#include "tools/models/model_shapes.h"

namespace shardopt {
namespace {

constexpr char kUsage[] = R"(usage: shardctl plan --model=MODEL [flags]

Predicts, per data-parallel strategy, the step time (compute, exposed
communication, optimizer) and the memory per rank (parameters, gradients,
optimizer state, master copy, staging) for MODEL on a cluster, and recommends
shardopt's bucket size and whether to shard gradients. The model and its
terms: docs/advisor.md.

model:
  --model=M             a parameter-shape fixture (tests/fixtures/*.json), a live job's
                        `shardctl layout --json` output (its model), a
                        .safetensors file (its header: every tensor is a parameter), a
                        model state_dict saved by torch.save (.pt/.pth; batch-norm
                        statistics count as buffers),
                        gpt:LAYERS,HIDDEN,VOCAB,SEQ (GPT-2-style shapes),
                        mlp:IN,HIDDEN,...,OUT (Linear layers), or one of gpt2-small,
                        gpt-1.3b, gpt-7b
cluster:
  --world=N[,N...]      world sizes, each in [1, 1048576] (default 2)
  --ranks-per-node=G    ranks per node (default: every rank on one node)
  --intra=LINK          between the ranks of a node: a profile (nvlink4, pcie4-p2p,
                        pcie4-nop2p, eth100, ib200, eth200, ib400, eth400) or
                        FILE.json:gloo|shm, a bench_comm --json result (default pcie4-p2p)
  --inter=LINK          between nodes, per rank (default ib400)
  --cpu                 communication runs on the cores that compute (CPU training):
                        it does not overlap
compute (per step, per rank):
  --forward-ms=F --backward-ms=B   forward and backward time
  --compute-json=FILE:MODEL        forward + backward of MODEL's compute_only row in a
                        bench_oss --json result (split 1:2)
  --kernels-json=FILE   the optimizer's cost per element from bench_kernels --json
  --fused-ns=X          a fused optimizer's cost per element, ns (default: 28 bytes per
                        element at --memory-gbps)
  --memory-gbps=G       device memory bandwidth for that default (default 2000)
  --unfused-factor=K    torch.optim's cost over the fused one (default 3, as measured
                        on CPU by bench_kernels)
  --per-tensor-us=T     torch.optim's fixed cost per tensor, us (default 0)
precision and optimizer:
  --precision=P         fp32 (4 + 4 bytes, no master) or mixed (fp16/bf16 parameters and
                        gradients with an fp32 master copy: ZeRO's 2 + 2 + 12) (default fp32)
  --optimizer=O         adam | rmsprop | sgd (state 8, 8, 4 bytes per element; default adam)
  --bucket-mb=M         DDP's and shardopt's buckets (default 25)
  --zero2-bucket-mb=M   shardopt_zero2's buckets (default 8)
  --memory-limit-gb=G   recommend gradient sharding when the rest would not fit
  --activation-mb=A     what forward keeps for backward at the peak (measured or
                        estimated): added to every strategy's memory (default 0)
  --broadcast-buffers=B module buffers (batch-norm statistics) from rank 0 before each
                        forward, as DDP does (default true; fixtures list the buffers)
output:
  --json                one JSON object per world size on stdout
  --help                this text
)";

// A model's state_dict saved by torch.save (also {"model": ...},
// {"model_state_dict": ...}, {"state_dict": ...}), read by the data-only
// unpickler: float tensors are parameters, batch-norm statistics buffers.
absl::StatusOr<std::vector<ParamSpec>> TorchStateDict(const std::string& path,
                                                      std::vector<ParamSpec>* buffers) {
  auto top = ReadTorchFile(path);
  if (!top.ok()) return top.status();
  const PyValue* sd = top->get();
  for (const char* key : {"model", "model_state_dict", "state_dict"}) {
    if (const PyValue* v = sd->Find(key); v != nullptr && v->kind == PyValue::Kind::kDict) sd = v;
  }
  if (sd->kind != PyValue::Kind::kDict) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a state_dict (", sd->Describe(), ")"));
  }
  std::vector<ParamSpec> out;
  for (const auto& [k, v] : sd->entries) {
    if (k->kind != PyValue::Kind::kString || v->kind != PyValue::Kind::kTensor) continue;
    ParamSpec p{k->s, v->tensor.sizes().vec(), DType::kFloat32, true};
    const bool stat = absl::EndsWith(k->s, "running_mean") || absl::EndsWith(k->s, "running_var") ||
                      absl::EndsWith(k->s, "num_batches_tracked");
    if (stat || !v->tensor.is_floating_point()) {
      buffers->push_back(std::move(p));
    } else {
      out.push_back(std::move(p));
    }
  }
  if (out.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no float tensors in its state_dict"));
  }
  return out;
}

// A live job's model: what `shardctl layout --json` printed (its params,
// trainable ones in registration order; proto3 JSON writes int64 as strings).
absl::StatusOr<std::vector<ParamSpec>> LiveLayout(const nlohmann::json& j, const std::string& path,
                                                  std::string* name) {
  std::vector<ParamSpec> out;
  for (const auto& p : j["params"]) {
    if (!p.is_object() || !p.contains("name") || !p["name"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": a param without a name"));
    }
    ParamSpec s{p["name"].get<std::string>(), {}, DType::kFloat32, p.value("trainable", false)};
    for (const auto& d : p.value("shape", nlohmann::json::array())) {
      int64_t v = 0;
      if (!(d.is_string() ? absl::SimpleAtoi(d.get<std::string>(), &v)
                          : (d.is_number_integer() && (v = d.get<int64_t>(), true))) ||
          v < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": parameter '", s.name, "' has a bad shape"));
      }
      s.shape.push_back(v);
    }
    if (s.trainable) out.push_back(std::move(s));
  }
  if (out.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": no trainable parameters (a `shardctl layout --json` of a job that reports them)"));
  }
  *name = absl::StrCat("the job's model (", path, ")");
  return out;
}

absl::StatusOr<std::vector<ParamSpec>> LoadModel(const std::string& spec, std::string* name,
                                                 std::vector<ParamSpec>* buffers) {
  *name = spec;
  auto standard = advisor::StandardModel(spec);
  if (standard.ok() || !absl::IsNotFound(standard.status())) return standard;
  if (absl::EndsWith(spec, ".pt") || absl::EndsWith(spec, ".pth")) {
    return TorchStateDict(spec, buffers);
  }
  if (absl::EndsWith(spec, ".safetensors")) {
    auto header = ReadSafetensorsHeader(PosixFileSystem(), spec);
    if (!header.ok()) return header.status();
    std::vector<ParamSpec> out;
    for (const SafetensorsEntry& e : header->tensors) {
      out.push_back(ParamSpec{e.name, e.shape, DType::kFloat32, true});
    }
    return out;
  }
  if (absl::EndsWith(spec, ".json")) {
    auto text = ReadConfigFile(spec, advisor::kMaxInputBytes);
    if (!text.ok()) return text.status();
    nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("layoutHash") && j.contains("params")) {
      return LiveLayout(j, spec, name);
    }
  }
  auto shapes = LoadModelShapes(spec);
  if (!shapes.ok()) return shapes.status();
  if (!shapes->model.empty()) *name = shapes->model;
  *buffers = shapes->buffers;
  return shapes->params;
}

struct PlanFlags {
  std::vector<int> worlds;
  advisor::Cluster cluster;
  advisor::Compute compute;
  advisor::Precision precision;
  advisor::Options options;
  double memory_limit = 0;
  bool json = false;
};

absl::Status ReadCompute(const Flags& f, advisor::Compute* k) {
  if (f.Has("compute-json")) {
    const std::string v = f.Str("compute-json", "");
    const size_t colon = v.rfind(':');
    if (colon == std::string::npos) {
      return absl::InvalidArgumentError("--compute-json=FILE:MODEL (bench_oss's model name)");
    }
    auto text = ReadConfigFile(v.substr(0, colon), advisor::kMaxInputBytes);
    if (!text.ok()) return text.status();
    auto fb = advisor::ComputeFromBenchOss(*text, v.substr(colon + 1));
    if (!fb.ok()) return fb.status();
    k->forward_s = *fb / 3;
    k->backward_s = *fb * 2 / 3;
  } else {
    if (!f.Has("forward-ms") || !f.Has("backward-ms")) {
      return absl::InvalidArgumentError(
          "say the compute: --forward-ms and --backward-ms, or --compute-json");
    }
    auto fwd = f.Double("forward-ms", 0, 0, 1e9);
    auto bwd = f.Double("backward-ms", 0, 0, 1e9, /*min_exclusive=*/true);
    if (!fwd.ok()) return fwd.status();
    if (!bwd.ok()) return bwd.status();
    k->forward_s = *fwd * 1e-3;
    k->backward_s = *bwd * 1e-3;
  }
  auto factor = f.Double("unfused-factor", 3.0, 1.0, 1000.0);
  auto per_tensor = f.Double("per-tensor-us", 0.0, 0.0, 1e6);
  if (!factor.ok()) return factor.status();
  if (!per_tensor.ok()) return per_tensor.status();
  k->per_tensor_s = *per_tensor * 1e-6;
  if (f.Has("kernels-json")) {
    auto text = ReadConfigFile(f.Str("kernels-json", ""), advisor::kMaxInputBytes);
    if (!text.ok()) return text.status();
    auto c = advisor::OptimizerCostFromBenchKernels(*text);
    if (!c.ok()) return c.status();
    k->fused_s_per_element = c->fused_s_per_element;
    k->unfused_s_per_element = c->unfused_s_per_element;
    return absl::OkStatus();
  }
  auto gbps = f.Double("memory-gbps", 2000.0, 0.0, 1e6, /*min_exclusive=*/true);
  if (!gbps.ok()) return gbps.status();
  auto fused = f.Double("fused-ns", 28.0 / *gbps, 0.0, 1e6);
  if (!fused.ok()) return fused.status();
  k->fused_s_per_element = *fused * 1e-9;
  k->unfused_s_per_element = k->fused_s_per_element * *factor;
  return absl::OkStatus();
}

absl::Status ReadPlanFlags(const Flags& f, PlanFlags* p) {
  for (absl::string_view w : absl::StrSplit(f.Str("world", "2"), ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(w, &n) || n < 1 || n > (1 << 20)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--world must be integers in [1, 1048576], got '", w, "'"));
    }
    p->worlds.push_back(n);
  }
  auto rpn = f.Int("ranks-per-node", 0, 1, 1 << 20);
  if (!rpn.ok()) return rpn.status();
  p->cluster.ranks_per_node = static_cast<int>(*rpn);
  auto intra = advisor::LinkFromSpec(f.Str("intra", "pcie4-p2p"));
  if (!intra.ok()) return intra.status();
  auto inter = advisor::LinkFromSpec(f.Str("inter", "ib400"));
  if (!inter.ok()) return inter.status();
  p->cluster.intra = *intra;
  p->cluster.inter = *inter;
  auto cpu = f.Bool("cpu", false);
  if (!cpu.ok()) return cpu.status();
  p->cluster.comm_on_compute_cores = *cpu;
  if (absl::Status s = ReadCompute(f, &p->compute); !s.ok()) return s;
  auto prec = f.Choice("precision", "fp32", {"fp32", "mixed"});
  auto opt = f.Choice("optimizer", "adam", {"adam", "rmsprop", "sgd"});
  if (!prec.ok()) return prec.status();
  if (!opt.ok()) return opt.status();
  if (*prec == "mixed") p->precision = advisor::Precision{2, 2, 4, 8};
  p->precision.state = *opt == "sgd" ? 4 : 8;
  auto bucket = f.Double("bucket-mb", 25, 0, 1e6, /*min_exclusive=*/true);
  auto zbucket = f.Double("zero2-bucket-mb", 8, 0, 1e6, /*min_exclusive=*/true);
  auto limit = f.Double("memory-limit-gb", 0, 0, 1e9);
  if (!bucket.ok()) return bucket.status();
  if (!zbucket.ok()) return zbucket.status();
  if (!limit.ok()) return limit.status();
  p->options.bucket_bytes = std::max<int64_t>(1, static_cast<int64_t>(*bucket * (1 << 20)));
  p->options.zero2_bucket_bytes = std::max<int64_t>(1, static_cast<int64_t>(*zbucket * (1 << 20)));
  p->memory_limit = *limit * 1e9;
  auto act = f.Double("activation-mb", 0, 0, 1e9);
  if (!act.ok()) return act.status();
  p->options.activation_bytes = *act * (1 << 20);
  auto buffers = f.Bool("broadcast-buffers", true);
  if (!buffers.ok()) return buffers.status();
  p->options.broadcast_buffers = *buffers;
  auto json = f.Bool("json", false);
  if (!json.ok()) return json.status();
  p->json = *json;
  return absl::OkStatus();
}

double MiB(double b) { return b / (1 << 20); }

nlohmann::json ToJson(const advisor::Prediction& p) {
  const advisor::Memory& m = p.memory;
  return {{"strategy", advisor::StrategyName(p.strategy)},
          {"step_s", p.step_s},
          {"compute_s", p.compute_s},
          {"exposed_comm_s", p.exposed_comm_s},
          {"optimizer_s", p.optimizer_s},
          {"comm_s", p.comm_s},
          {"bytes_sent", p.bytes_sent},
          {"collectives", p.collectives},
          {"memory",
           {{"params", m.params},
            {"grads", m.grads},
            {"state", m.state},
            {"master", m.master},
            {"staging", m.staging},
            {"activations", m.activations},
            {"total", m.total()}}}};
}

void PrintTable(const std::string& name, const advisor::ModelInfo& model, const PlanFlags& p,
                const std::vector<advisor::Prediction>& rows, const advisor::Recommendation& r) {
  const advisor::Link link = advisor::RingLink(p.cluster);
  std::printf(
      "%s: %.1fM parameters in %zu tensors; %d ranks on %d node(s), ring at %.1f GB/s "
      "(%s)%s\n",
      name.c_str(), model.elements() / 1e6, model.numel.size(), p.cluster.world_size,
      advisor::Nodes(p.cluster), link.bandwidth / 1e9, link.name.c_str(),
      p.cluster.comm_on_compute_cores ? ", communication on the compute cores" : "");
  std::printf("%-17s %9s %7s %9s %9s %9s %9s %6s %9s %9s %9s %9s %10s\n", "strategy", "step ms",
              "vs ddp", "compute", "exposed", "optimizer", "sent MiB", "calls", "grads MiB",
              "state MiB", "master", "staging", "total MiB");
  const double ddp = rows.front().step_s;
  for (const advisor::Prediction& x : rows) {
    std::printf("%-17s %9.1f %6.3fx %9.1f %9.1f %9.1f %9.1f %6lld %9.1f %9.1f %9.1f %9.1f %10.1f\n",
                advisor::StrategyName(x.strategy), x.step_s * 1e3, ddp / x.step_s,
                x.compute_s * 1e3, x.exposed_comm_s * 1e3, x.optimizer_s * 1e3, MiB(x.bytes_sent),
                static_cast<long long>(x.collectives), MiB(x.memory.grads), MiB(x.memory.state),
                MiB(x.memory.master), MiB(x.memory.staging), MiB(x.memory.total()));
  }
  std::printf("recommended: %s, %s\n\n", advisor::StrategyName(r.strategy), r.why.c_str());
}

}  // namespace

int PlanMain(int argc, char** argv) {
  auto flags = Flags::Parse(argc, argv,
                            {"model",
                             "world",
                             "ranks-per-node",
                             "intra",
                             "inter",
                             "cpu",
                             "forward-ms",
                             "backward-ms",
                             "compute-json",
                             "kernels-json",
                             "fused-ns",
                             "memory-gbps",
                             "unfused-factor",
                             "per-tensor-us",
                             "precision",
                             "optimizer",
                             "bucket-mb",
                             "zero2-bucket-mb",
                             "memory-limit-gb",
                             "broadcast-buffers",
                             "activation-mb",
                             "json",
                             "help"},
                            {"help", "json", "cpu"});
  auto fail = [](const absl::Status& s, int code) {
    std::fprintf(stderr, "shardctl plan: %s\n", std::string(s.message()).c_str());
    return code;
  };
  if (!flags.ok()) return fail(flags.status(), 2);
  if (flags->Has("help")) {
    std::printf("%s", kUsage);
    return 0;
  }
  if (!flags->positional().empty() && flags->positional() != std::vector<std::string>{"plan"}) {
    return fail(absl::InvalidArgumentError("plan takes no argument (see --help)"), 2);
  }
  if (!flags->Has("model")) return fail(absl::InvalidArgumentError("--model is required"), 2);
  PlanFlags p;
  if (absl::Status s = ReadPlanFlags(*flags, &p); !s.ok()) return fail(s, 2);
  std::string name;
  std::vector<ParamSpec> buffers;
  auto specs = LoadModel(flags->Str("model", ""), &name, &buffers);
  if (!specs.ok()) return fail(specs.status(), 1);
  const advisor::ModelInfo model = advisor::ModelOf(name, *specs, buffers);
  nlohmann::json out = nlohmann::json::array();
  for (int world : p.worlds) {
    p.cluster.world_size = world;
    std::vector<advisor::Prediction> rows;
    for (advisor::Strategy s : advisor::AllStrategies()) {
      auto pred = advisor::Predict(model, p.cluster, p.compute, p.precision, p.options, s);
      if (!pred.ok()) return fail(pred.status(), 2);
      rows.push_back(*pred);
    }
    auto r = advisor::Recommend(model, p.cluster, p.compute, p.precision, p.memory_limit);
    if (!r.ok()) return fail(r.status(), 2);
    if (p.json) {
      nlohmann::json j = {{"model", name},
                          {"parameters", model.elements()},
                          {"tensors", model.numel.size()},
                          {"world_size", world},
                          {"nodes", advisor::Nodes(p.cluster)},
                          {"ring_bandwidth", advisor::RingLink(p.cluster).bandwidth},
                          {"recommended",
                           {{"strategy", advisor::StrategyName(r->strategy)},
                            {"bucket_bytes", r->bucket_bytes},
                            {"shard_gradients", r->shard_gradients},
                            {"why", r->why}}},
                          {"strategies", nlohmann::json::array()}};
      for (const auto& x : rows) j["strategies"].push_back(ToJson(x));
      out.push_back(j);
    } else {
      PrintTable(name, model, p, rows, *r);
    }
  }
  if (p.json) std::printf("%s\n", out.dump(1).c_str());
  return 0;
}

}  // namespace shardopt
