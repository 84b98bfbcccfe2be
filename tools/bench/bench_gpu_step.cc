// bench_gpu_step: one optimizer step on one GPU, GPT-2 small's 148 parameter
// tensors (124M fp32 parameters, from the shapes fixture), three ways in one
// run, interleaved rounds:
//   shardopt  ZeroGrad + backward + ShardedOptimizer::Step() (world size 1:
//             NCCL reduce-scatter/all-gather per bucket, CUDA Adam, norm)
//   shardopt_async  the same with device_async_step: the step orders the
//             device after each collective and leaves the norm on the device
//             (no host round trip inside Step())
//   bare      backward + one multi-tensor CUDA Adam call on the same tensors
//             (our kernel without the optimizer around it)
//   torch     backward + ATen's fused Adam (_fused_adam_, what
//             torch.optim.Adam(fused=True) runs), where this LibTorch has it
// The "model" is loss = sum_i (p_i * c_i).sum(). Only the step is timed:
// after backward, the GPU is synchronized, then the step runs and the GPU is
// synchronized again (so host overhead, launches and waits count, as they do
// in training); median over all iterations. Needs a CUDA
// LibTorch and a GPU (tools/gpu_check.sh builds and runs it); elsewhere it
// says so and exits 2.
//   bench_gpu_step [--json=PATH] [--iters=20] [--rounds=5]
//                  [--fixture=tests/fixtures/gpt2_small_params.json]
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "client/comm/kv_store.h"
#include "client/comm/nccl_communicator.h"
#include "client/sharded_optimizer.h"
#include "tools/models/model_shapes.h"
#include "server/kernels/cuda/cuda_backend.h"
#include "server/kernels/cuda/cuda_kernels.h"

using namespace shardopt;

namespace {

struct Model {
  std::vector<torch::Tensor> params, consts;
};

Model Make(const ModelShapes& shapes, const torch::Device& d) {
  torch::manual_seed(3);
  Model m;
  for (const ParamSpec& p : shapes.params) {
    m.params.push_back((torch::randn(p.shape, d) * 0.02).set_requires_grad(true));
    m.consts.push_back(torch::randn(p.shape, d) * 1e-3);
  }
  return m;
}

void Backward(Model& m) {
  torch::Tensor loss = torch::zeros({}, m.params[0].options());
  for (size_t i = 0; i < m.params.size(); ++i) loss = loss + (m.params[i] * m.consts[i]).sum();
  loss.backward();
}

// ZeroGrad + backward and Step() of one ShardedOptimizer on its own model and
// NCCL communicator (world size 1); `async`: device_async_step.
struct ShardoptRun {
  Model model;
  InMemoryKeyValueStore store;
  std::unique_ptr<NcclCommunicator> comm;
  std::unique_ptr<ShardedOptimizer> opt;
  bool async = false;

  absl::Status Build(const ModelShapes& shapes, const torch::Device& gpu, bool device_async) {
    async = device_async;
    model = Make(shapes, gpu);
    auto c = NcclCommunicator::Create(&store, 0, 1, NcclOptions());
    if (!c.ok()) return c.status();
    comm = std::move(*c);
    std::vector<std::pair<std::string, torch::Tensor>> named;
    for (size_t i = 0; i < model.params.size(); ++i)
      named.emplace_back(shapes.params[i].name, model.params[i]);
    ShardedOptimizerOptions o;
    o.kernel_backend = MakeCudaKernelBackend();
    o.device_async_step = async;
    auto so = ShardedOptimizer::Create(named, o, comm.get());
    if (!so.ok()) return so.status();
    opt = std::move(*so);
    return absl::OkStatus();
  }
  void Backward() {
    opt->ZeroGrad();
    ::Backward(model);
  }
  void Step() {
    auto r = opt->Step();
    if (!r.ok()) {
      std::fprintf(stderr, "%s step: %s\n", async ? "async" : "default",
                   r.status().ToString().c_str());
      std::exit(1);
    }
  }
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string json, fixture = "tests/fixtures/gpt2_small_params.json";
  int iters = 20, rounds = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--json=", 0) == 0)
      json = a.substr(7);
    else if (a.rfind("--fixture=", 0) == 0)
      fixture = a.substr(10);
    else if (a.rfind("--iters=", 0) == 0)
      iters = std::atoi(a.c_str() + 8);
    else if (a.rfind("--rounds=", 0) == 0)
      rounds = std::atoi(a.c_str() + 9);
    else {
      std::fprintf(
          stderr,
          "usage: bench_gpu_step [--json=PATH] [--iters=20] [--rounds=5] [--fixture=PATH]\n");
      return a == "--help" ? 0 : 1;
    }
  }
  auto shapes = LoadModelShapes(fixture);
  if (!shapes.ok()) {
    std::fprintf(stderr, "bench_gpu_step: %s\n", shapes.status().ToString().c_str());
    return 1;
  }
  if (!torch::cuda::is_available() || cuda::DeviceCount() == 0) {
    std::printf("bench_gpu_step: needs a GPU and a CUDA build of LibTorch; nothing measured\n");
    return 2;
  }
  const torch::Device gpu(torch::kCUDA, 0);

  // shardopt and shardopt_async: each its own model, communicator and optimizer.
  ShardoptRun sync_run, async_run;
  for (auto [run, async] : {std::pair{&sync_run, false}, std::pair{&async_run, true}}) {
    if (absl::Status st = run->Build(*shapes, gpu, async); !st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      return 1;
    }
  }
  Model& a = sync_run.model;
  ShardedOptimizer* so = sync_run.opt.get();
  auto shardopt_backward = [&]() { sync_run.Backward(); };
  auto shardopt_step = [&]() { sync_run.Step(); };
  auto async_backward = [&]() { async_run.Backward(); };
  auto async_step = [&]() { async_run.Step(); };
  int64_t nparams = 0;
  for (auto& p : a.params) nparams += p.numel();

  // bare: our kernel on the same tensors, no optimizer around it
  Model b = Make(*shapes, gpu);
  std::vector<torch::Tensor> bm, bv;
  for (auto& p : b.params) {
    bm.push_back(torch::zeros_like(p));
    bv.push_back(torch::zeros_like(p));
  }
  int64_t bare_step_count = 0;
  auto bare_backward = [&]() {
    for (auto& p : b.params) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
    Backward(b);
  };
  auto bare_step = [&]() {
    ++bare_step_count;
    std::vector<cuda::DeviceSlice> slices;
    for (size_t i = 0; i < b.params.size(); ++i) {
      cuda::DeviceSlice s;
      s.master = b.params[i].data_ptr<float>();
      s.grad = b.params[i].grad().data_ptr<float>();
      s.state0 = bm[i].data_ptr<float>();
      s.state1 = bv[i].data_ptr<float>();
      s.size = b.params[i].numel();
      slices.push_back(s);
    }
    absl::Status st =
        cuda::AdamStep(MakeAdamScalars(AdamConfig(), bare_step_count), slices, nullptr);
    if (!st.ok()) {
      std::fprintf(stderr, "bare: %s\n", st.ToString().c_str());
      std::exit(1);
    }
  };

#if TORCH_VERSION_MAJOR >= 2
  Model c = Make(*shapes, gpu);
  std::vector<torch::Tensor> cm, cv, cmax, csteps;
  for (auto& p : c.params) {
    cm.push_back(torch::zeros_like(p));
    cv.push_back(torch::zeros_like(p));
    csteps.push_back(torch::zeros({}, p.options()));
  }
  auto torch_backward = [&]() {
    for (auto& p : c.params) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
    Backward(c);
  };
  auto torch_step = [&]() {
    torch::NoGradGuard ng;
    std::vector<torch::Tensor> grads;
    for (auto& p : c.params) grads.push_back(p.grad());
    at::_foreach_add_(csteps, 1);
    at::_fused_adam_(c.params, grads, cm, cv, cmax, csteps, 1e-3, 0.9, 0.999, 0.0, 1e-8,
                     /*amsgrad=*/false, /*maximize=*/false);
  };
  const bool have_torch = true;
#else
  auto torch_backward = [] {};
  auto torch_step = [] {};
  const bool have_torch = false;
#endif

  // Times `step` after an untimed `backward`, `iters` times; appends seconds.
  auto time_steps = [&](const std::function<void()>& backward, const std::function<void()>& step,
                        std::vector<double>* out) {
    for (int i = 0; i < iters; ++i) {
      backward();
      torch::cuda::synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      step();
      torch::cuda::synchronize();
      out->push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  };
  std::vector<double> warm;
  time_steps(shardopt_backward, shardopt_step, &warm);
  time_steps(async_backward, async_step, &warm);
  time_steps(bare_backward, bare_step, &warm);
  if (have_torch) time_steps(torch_backward, torch_step, &warm);
  std::vector<double> ts, ta, tb, tt;
  for (int r = 0; r < rounds; ++r) {  // interleaved rounds
    time_steps(shardopt_backward, shardopt_step, &ts);
    time_steps(async_backward, async_step, &ta);
    time_steps(bare_backward, bare_step, &tb);
    if (have_torch) time_steps(torch_backward, torch_step, &tt);
  }
  // The async step's norm, read after the timing, must be a real one.
  auto norm = async_run.opt->LastGradNorm();
  if (!norm.ok() || !(norm->grad_norm > 0)) {
    std::fprintf(stderr, "async step: no gradient norm (%s)\n",
                 norm.ok() ? "zero" : norm.status().ToString().c_str());
    return 1;
  }
  const double s_ms = Median(ts) * 1e3, b_ms = Median(tb) * 1e3, a_ms = Median(ta) * 1e3;
  const double t_ms = have_torch ? Median(tt) * 1e3 : 0.0;
  const double bytes = 28.0 * static_cast<double>(nparams);
  std::printf(
      "bench_gpu_step: %lld parameters in %zu tensors, %zu buckets; one step, synchronized before "
      "and after (median of %d):\n  shardopt ShardedOptimizer::Step() %.3f ms (%.0f GB/s of Adam "
      "traffic)\n"
      "  bare kernel (one multi-tensor CUDA Adam call) %.3f ms (%.0f GB/s)\n",
      static_cast<long long>(nparams), a.params.size(), so->layout().buckets().size(),
      rounds * iters, s_ms, bytes / s_ms / 1e6, b_ms, bytes / b_ms / 1e6);
  std::printf(
      "  shardopt_async (device_async_step) %.3f ms (%.0f GB/s); %.2fx the default step's speed\n",
      a_ms, bytes / a_ms / 1e6, s_ms / a_ms);
  if (have_torch) {
    std::printf(
        "  ATen fused Adam (_foreach_add_ on steps + _fused_adam_) %.3f ms (%.0f GB/s)\n"
        "  ShardedOptimizer step is %.2fx the fused Adam step's speed (async: %.2fx; target >= "
        "1.0); "
        "its overhead over the bare kernel %.3f ms (async: %.3f ms)\n",
        t_ms, bytes / t_ms / 1e6, t_ms / s_ms, t_ms / a_ms, s_ms - b_ms, a_ms - b_ms);
  }
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", json.c_str());
      return 1;
    }
    std::fprintf(f,
                 "{\"params\": %lld, \"tensors\": %zu, \"buckets\": %zu, \"samples\": %d, "
                 "\"shardopt_step_ms\": %.4f, \"shardopt_async_step_ms\": %.4f, "
                 "\"bare_kernel_step_ms\": %.4f, \"torch_fused_step_ms\": %s, "
                 "\"shardopt_vs_torch_fused\": %s, \"shardopt_async_vs_torch_fused\": %s}\n",
                 static_cast<long long>(nparams), a.params.size(), so->layout().buckets().size(),
                 rounds * iters, s_ms, a_ms, b_ms,
                 have_torch ? std::to_string(t_ms).c_str() : "null",
                 have_torch ? std::to_string(t_ms / s_ms).c_str() : "null",
                 have_torch ? std::to_string(t_ms / a_ms).c_str() : "null");
    std::fclose(f);
  }
  return 0;
}
