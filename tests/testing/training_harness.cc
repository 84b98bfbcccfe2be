#include "tests/testing/training_harness.h"

#include <stdexcept>

#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tools/models/models.h"
#include "common/status_macros.h"

namespace shardopt {

ShardedOptimizerOptions OptionsFor(const TrainConfig& c) {
  ShardedOptimizerOptions o;
  o.kind = c.kind;
  if (c.kind == OptimizerKind::kAdamW) o.adam = AdamWConfig();
  o.adam.lr = c.lr;
  o.sgd.lr = c.lr;
  o.sgd.momentum = 0.9;
  o.max_grad_norm = c.max_grad_norm;
  o.plan.bucket_cap_elements = c.bucket_cap;
  o.shard_gradients = c.shard_gradients;
  o.grad_staging_buffers = c.staging_buffers;
  o.device_async_step = c.device_async_step;
  if (c.grad_bf16) o.grad_comm_type = DType::kBFloat16;
  o.timeout = absl::Seconds(60);
  return o;
}

std::vector<float> FlattenParameters(TrainModel& m) {
  std::vector<float> out;
  for (const auto& [name, t] : m.NamedParameters()) {
    torch::Tensor f = t.detach().to(torch::kFloat).contiguous();
    out.insert(out.end(), f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
  }
  return out;
}

absl::StatusOr<std::vector<float>> TrainSharded(const TrainConfig& c, Communicator* comm,
                                                std::vector<TraceEvent>* trace,
                                                ByteCounters* bytes_per_step, int* clipped_steps,
                                                std::vector<double>* grad_norms) {
  SHARDOPT_ASSIGN_OR_RETURN(std::unique_ptr<TrainModel> model, MakeModel(c.model, c.seed));
  ShardedOptimizerOptions o = OptionsFor(c);
  o.trace = trace != nullptr;
  o.overlap_param_gather = c.overlap;
  SHARDOPT_ASSIGN_OR_RETURN(auto opt, ShardedOptimizer::Create(model->NamedParameters(), o, comm));
  if (c.overlap) {
    ShardedOptimizer* raw = opt.get();
    model->set_layer_gate([raw](torch::nn::Module& layer) {
      absl::Status s = raw->WaitForParameters(layer);
      if (!s.ok()) throw std::runtime_error(std::string(s.message()));
    });
  }
  const int n = comm->world_size();
  if (c.global_batch % n != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("global batch ", c.global_batch, " not divisible by ", n, " ranks"));
  }
  const int64_t per = c.global_batch / n;
  ByteCounters before;
  for (int step = 0; step < c.steps; ++step) {
    if (step == c.steps - 1) {
      before = comm->counters();
      if (trace) opt->TakeTrace();
    }
    opt->ZeroGrad();
    torch::Tensor loss = model->Loss(step, comm->rank() * per, (comm->rank() + 1) * per);
    loss.backward();
    SHARDOPT_ASSIGN_OR_RETURN(StepResult r, opt->Step());
    SHARDOPT_ASSIGN_OR_RETURN(GradNormReading norm, opt->LastGradNorm());
    std::optional<GradNormReading> ready = opt->ReadyGradNorm();
    if (norm.step != r.step || !ready.has_value() || ready->step != r.step ||
        ready->grad_norm != norm.grad_norm ||
        (!r.grad_norm_pending && (norm.grad_norm != r.grad_norm || norm.clipped != r.clipped))) {
      return absl::InternalError(absl::StrCat(
          "step ", r.step, ": StepResult norm ", r.grad_norm, " clipped ", r.clipped,
          ", LastGradNorm step ", norm.step, " norm ", norm.grad_norm, " clipped ", norm.clipped));
    }
    if (clipped_steps != nullptr && norm.clipped) ++*clipped_steps;
    if (grad_norms != nullptr) grad_norms->push_back(norm.grad_norm);
  }
  if (trace) *trace = opt->TakeTrace();
  // The last step's gathers may still be in flight (overlap): wait before
  // reading the parameters outside a forward.
  SHARDOPT_RETURN_IF_ERROR(opt->WaitForParameters());
  if (bytes_per_step) {
    ByteCounters after = comm->counters();
    for (int k = 0; k < kNumCollectiveKinds; ++k) {
      bytes_per_step->sent[k] = after.sent[k] - before.sent[k];
      bytes_per_step->received[k] = after.received[k] - before.received[k];
    }
  }
  return FlattenParameters(*model);
}

absl::StatusOr<std::vector<float>> TrainReference(const TrainConfig& c) {
  SHARDOPT_ASSIGN_OR_RETURN(std::unique_ptr<TrainModel> model, MakeModel(c.model, c.seed));
  std::vector<torch::Tensor> params;
  for (const auto& [name, t] : model->NamedParameters()) {
    if (t.requires_grad()) params.push_back(t);
  }
  std::unique_ptr<torch::optim::Optimizer> opt;
  switch (c.kind) {
    case OptimizerKind::kAdam:
      opt = std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(c.lr));
      break;
    case OptimizerKind::kAdamW:
      opt = std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(c.lr));
      break;
    case OptimizerKind::kSgd:
      opt =
          std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(c.lr).momentum(0.9));
      break;
  }
  for (int step = 0; step < c.steps; ++step) {
    opt->zero_grad();
    torch::Tensor loss = model->Loss(step, 0, c.global_batch);
    loss.backward();
    if (c.max_grad_norm > 0) torch::nn::utils::clip_grad_norm_(params, c.max_grad_norm);
    opt->step();
  }
  return FlattenParameters(*model);
}

absl::StatusOr<TrainConfig> ParseTrainConfig(const std::vector<std::string>& args) {
  TrainConfig c;
  for (const std::string& a : args) {
    const size_t eq = a.find('=');
    if (a.rfind("--", 0) != 0 || eq == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("bad flag '", a, "'"));
    }
    const std::string k = a.substr(2, eq - 2), v = a.substr(eq + 1);
    bool ok = true;
    if (k == "model") {
      c.model = v;
    } else if (k == "optimizer") {
      if (v == "adam")
        c.kind = OptimizerKind::kAdam;
      else if (v == "adamw")
        c.kind = OptimizerKind::kAdamW;
      else if (v == "sgd")
        c.kind = OptimizerKind::kSgd;
      else
        ok = false;
    } else if (k == "lr") {
      ok = absl::SimpleAtod(v, &c.lr);
    } else if (k == "clip") {
      ok = absl::SimpleAtod(v, &c.max_grad_norm);
    } else if (k == "steps") {
      ok = absl::SimpleAtoi(v, &c.steps);
    } else if (k == "global_batch") {
      ok = absl::SimpleAtoi(v, &c.global_batch);
    } else if (k == "bucket_cap") {
      ok = absl::SimpleAtoi(v, &c.bucket_cap);
    } else if (k == "shard_gradients") {
      ok = absl::SimpleAtob(v, &c.shard_gradients);
    } else if (k == "device_async_step") {
      ok = absl::SimpleAtob(v, &c.device_async_step);
    } else if (k == "staging_buffers") {
      ok = absl::SimpleAtoi(v, &c.staging_buffers);
    } else if (k == "grad_bf16") {
      ok = absl::SimpleAtob(v, &c.grad_bf16);
    } else {
      continue;  // flags of the caller
    }
    if (!ok) return absl::InvalidArgumentError(absl::StrCat("bad value in '", a, "'"));
  }
  return c;
}

std::vector<std::string> TrainConfigFlags(const TrainConfig& c) {
  return {absl::StrCat("--model=", c.model),
          absl::StrCat("--optimizer=", OptimizerKindName(c.kind)),
          absl::StrCat("--lr=", c.lr),
          absl::StrCat("--clip=", c.max_grad_norm),
          absl::StrCat("--steps=", c.steps),
          absl::StrCat("--global_batch=", c.global_batch),
          absl::StrCat("--bucket_cap=", c.bucket_cap),
          absl::StrCat("--shard_gradients=", c.shard_gradients ? "true" : "false"),
          absl::StrCat("--staging_buffers=", c.staging_buffers),
          absl::StrCat("--device_async_step=", c.device_async_step ? "true" : "false"),
          absl::StrCat("--grad_bf16=", c.grad_bf16 ? "true" : "false")};
}

}  // namespace shardopt
