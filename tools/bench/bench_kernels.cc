// Kernel micro-benchmark (docs/performance.md section 2).
//
// On the `mlp` model's parameter tensors (42M fp32 parameters), single-threaded
// and with all threads, measures side by side, interleaved, medians of several
// steps after warm-up:
//   - shardopt's fused Adam, AdamW and SGD-momentum (one multi-tensor call),
//   - LibTorch's torch::optim::Adam / AdamW / SGD on the same tensors,
//   - the bandwidth limit: a kernel with Adam's memory traffic (28 bytes per
//     parameter) and trivial arithmetic, and a plain memcpy.
// LibTorch's Adam is measured with glibc's default malloc first (as users run
// it), then everything with tuned malloc (common/malloc_tuning.h).
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "common/malloc_tuning.h"
#include "nlohmann/json.hpp"
#include "server/kernels/cpu/cpu_kernels.h"

namespace shardopt {
namespace {

struct Flags {
  std::string json;
  int reps = 7;
  int warmup = 2;
  int default_malloc_reps = 3;
  int threads = 0;  // 0 = hardware threads
  double scale = 1.0;
};

void Usage() {
  std::printf(
      "usage: bench_kernels [--json=PATH] [--reps=N] [--warmup=N] [--threads=N]\n"
      "                     [--default-malloc-reps=N] [--scale=F]\n\n"
      "Optimizer kernel micro-benchmark on the mlp model's 42M fp32 parameters.\n"
      "  --json=PATH              also write the results as JSON\n"
      "  --reps=N                 timed steps per measurement (default 7; median reported)\n"
      "  --warmup=N               untimed steps first (default 2)\n"
      "  --threads=N              threads for the _mt rows (default: all hardware threads)\n"
      "  --default-malloc-reps=N  timed steps of LibTorch Adam with default malloc (default 3;\n"
      "                           0 skips it)\n"
      "  --scale=F                multiply the model size by F (e.g. 0.1 for a quick run)\n");
}

bool ParseFlags(int argc, char** argv, Flags* f) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&](const char* name, std::string* out) {
      const std::string prefix = std::string(name) + "=";
      if (a.rfind(prefix, 0) != 0) return false;
      *out = a.substr(prefix.size());
      return true;
    };
    std::string v;
    try {
      if (a == "--help" || a == "-h") {
        Usage();
        std::exit(0);
      } else if (val("--json", &v)) {
        f->json = v;
      } else if (val("--reps", &v)) {
        f->reps = std::stoi(v);
      } else if (val("--warmup", &v)) {
        f->warmup = std::stoi(v);
      } else if (val("--threads", &v)) {
        f->threads = std::stoi(v);
      } else if (val("--default-malloc-reps", &v)) {
        f->default_malloc_reps = std::stoi(v);
      } else if (val("--scale", &v)) {
        f->scale = std::stod(v);
      } else {
        std::fprintf(stderr, "bench_kernels: unknown flag '%s' (see --help)\n", a.c_str());
        return false;
      }
    } catch (const std::exception&) {
      std::fprintf(stderr, "bench_kernels: bad value in '%s'\n", a.c_str());
      return false;
    }
  }
  if (f->reps < 1 || f->warmup < 0 || f->threads < 0 || !(f->scale > 0 && f->scale <= 4)) {
    std::fprintf(stderr,
                 "bench_kernels: --reps >= 1, --warmup >= 0, --threads >= 0, "
                 "0 < --scale <= 4\n");
    return false;
  }
  return true;
}

// The mlp model: Linear(1024,4096), Linear(4096,4096) x2, Linear(4096,1024).
std::vector<std::vector<int64_t>> MlpShapes(double scale) {
  std::vector<std::vector<int64_t>> shapes;
  const int64_t dims[] = {1024, 4096, 4096, 4096, 1024};
  for (int i = 0; i < 4; ++i) {
    const int64_t out = std::max<int64_t>(1, static_cast<int64_t>(dims[i + 1] * scale));
    shapes.push_back({out, dims[i]});
    shapes.push_back({out});
  }
  return shapes;
}

struct Stat {
  double median = 0, lo = 0, hi = 0;  // seconds
};

Stat Summarize(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  Stat s;
  s.median = t.size() % 2 ? t[t.size() / 2] : 0.5 * (t[t.size() / 2 - 1] + t[t.size() / 2]);
  s.lo = t.front();
  s.hi = t.back();
  return s;
}

double Seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Runs every named candidate `warmup` times, then `reps` rounds A B C ... A B C.
std::map<std::string, Stat> Interleaved(
    const std::vector<std::pair<std::string, std::function<void()>>>& candidates, int warmup,
    int reps) {
  for (int w = 0; w < warmup; ++w) {
    for (const auto& c : candidates) c.second();
  }
  std::map<std::string, std::vector<double>> times;
  for (int r = 0; r < reps; ++r) {
    for (const auto& c : candidates) times[c.first].push_back(Seconds(c.second));
  }
  std::map<std::string, Stat> out;
  for (auto& [name, t] : times) out[name] = Summarize(t);
  return out;
}

void Check(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "bench_kernels: %s\n", s.ToString().c_str());
    std::exit(1);
  }
}

// One model's worth of fp32 arrays for our kernels, and a LibTorch copy.
struct Workload {
  int64_t n = 0;
  std::vector<std::vector<float>> p, g, m, v;
  std::vector<UpdateSlice> slices;
  std::vector<at::Tensor> torch_params;

  explicit Workload(const std::vector<std::vector<int64_t>>& shapes) {
    at::manual_seed(0);
    for (const auto& shape : shapes) {
      at::Tensor t = at::randn(shape);
      at::Tensor grad = at::randn(shape) * 0.01;
      const int64_t k = t.numel();
      n += k;
      p.emplace_back(t.data_ptr<float>(), t.data_ptr<float>() + k);
      g.emplace_back(grad.data_ptr<float>(), grad.data_ptr<float>() + k);
      m.emplace_back(k, 0.0f);
      v.emplace_back(k, 0.0f);
      t.set_requires_grad(true);
      t.mutable_grad() = grad;
      torch_params.push_back(t);
    }
    for (size_t i = 0; i < p.size(); ++i) {
      UpdateSlice s;
      s.param = p[i].data();
      s.grad = g[i].data();
      s.state0 = m[i].data();
      s.state1 = v[i].data();
      s.size = static_cast<int64_t>(p[i].size());
      slices.push_back(s);
    }
  }
};

}  // namespace
}  // namespace shardopt

int main(int argc, char** argv) {
  using namespace shardopt;
  Flags flags;
  if (!ParseFlags(argc, argv, &flags)) return 2;
  const int hw = std::max(1u, std::thread::hardware_concurrency());
  const int mt = flags.threads > 0 ? flags.threads : hw;

  Workload w(MlpShapes(flags.scale));
  const double n = static_cast<double>(w.n);
  std::printf(
      "bench_kernels: %lld fp32 parameters (mlp%s), ISA %s, %d hardware threads, "
      "multi-thread rows use %d\n",
      static_cast<long long>(w.n), flags.scale == 1.0 ? "" : " scaled", IsaName(BestIsa()), hw, mt);

  nlohmann::json out;
  out["parameters"] = w.n;
  out["isa"] = IsaName(BestIsa());
  out["hardware_threads"] = hw;
  out["mt_threads"] = mt;

  AdamConfig adam;
  adam.lr = 1e-4;
  AdamConfig adamw = AdamWConfig();
  adamw.lr = 1e-4;
  SgdConfig sgd;
  sgd.lr = 1e-4;
  sgd.momentum = 0.9;

  const std::vector<std::pair<std::string, int>> modes = {{"1t", 1}, {"mt", mt}};

  // Phase 1: LibTorch's Adam with glibc's default malloc, as users run it.
  if (flags.default_malloc_reps > 0) {
    std::printf("%s\n", DescribeMallocMode(MallocMode::kDefault).c_str());
    for (const auto& [suffix, threads] : modes) {
      at::set_num_threads(threads);
      torch::optim::Adam opt(w.torch_params, torch::optim::AdamOptions(1e-4));
      auto r =
          Interleaved({{"torch_adam_default", [&] { opt.step(); }}}, 1, flags.default_malloc_reps);
      const Stat s = r["torch_adam_default"];
      out["torch_adam_default_ns_per_param_" + suffix] = s.median * 1e9 / n;
      std::printf("  [%s] torch Adam, default malloc: %.2f ns/param (%.2f..%.2f)\n", suffix.c_str(),
                  s.median * 1e9 / n, s.lo * 1e9 / n, s.hi * 1e9 / n);
    }
  }

  // Phase 2: everything with tuned malloc, interleaved.
  Check(ApplyMallocMode(MallocMode::kTuned));
  std::printf("%s\n", DescribeMallocMode(MallocMode::kTuned).c_str());
  out["malloc"] = DescribeMallocMode(MallocMode::kTuned);
  std::vector<float> copy_src(w.n, 1.0f), copy_dst(w.n, 0.0f);

  for (const auto& mode : modes) {
    const auto& suffix = mode.first;
    const int threads = mode.second;  // (captured below: not a structured binding)
    at::set_num_threads(threads);
    KernelOptions ko;
    ko.num_threads = threads;
    torch::optim::Adam t_adam(w.torch_params, torch::optim::AdamOptions(1e-4));
    torch::optim::AdamW t_adamw(w.torch_params, torch::optim::AdamWOptions(1e-4));
    torch::optim::SGD t_sgd(w.torch_params, torch::optim::SGDOptions(1e-4).momentum(0.9));
    int64_t step = 0, sgd_step = 0;
    auto r = Interleaved(
        {
            {"adam", [&] { Check(AdamStep(adam, ++step, w.slices, ko)); }},
            {"torch_adam", [&] { t_adam.step(); }},
            {"stream", [&] { Check(SameTrafficStep(w.slices, ko)); }},
            {"adamw", [&] { Check(AdamStep(adamw, step, w.slices, ko)); }},
            {"torch_adamw", [&] { t_adamw.step(); }},
            {"sgd", [&] { Check(SgdStep(sgd, ++sgd_step, w.slices, ko)); }},
            {"torch_sgd", [&] { t_sgd.step(); }},
            {"copy",
             [&] {
               if (threads == 1) {
                 std::memcpy(copy_dst.data(), copy_src.data(), w.n * sizeof(float));
               } else {
                 at::parallel_for(0, w.n, 1 << 20, [&](int64_t b, int64_t e) {
                   std::memcpy(copy_dst.data() + b, copy_src.data() + b, (e - b) * sizeof(float));
                 });
               }
             }},
        },
        flags.warmup, flags.reps);
    auto ns = [&](const char* k) { return r[k].median * 1e9 / n; };
    const double stream_gbps = 28.0 * n / r["stream"].median / 1e9;
    const double copy_gbps = 2.0 * 4.0 * n / r["copy"].median / 1e9;
    out["stream_gbps_" + suffix] = stream_gbps;
    out["copy_gbps_" + suffix] = copy_gbps;
    std::printf("\n[%s: %d thread%s]  median ns/param (min..max over %d steps)\n", suffix.c_str(),
                threads, threads == 1 ? "" : "s", flags.reps);
    std::printf("  same-traffic kernel: %6.3f ns/param  %6.2f GB/s (28 B/param)\n", ns("stream"),
                stream_gbps);
    std::printf("  memcpy             : %6.3f ns/param  %6.2f GB/s (read + write)\n", ns("copy"),
                copy_gbps);
    struct Row {
      const char* name;
      const char* torch;
      double bytes;
    };
    for (const Row& row : {Row{"adam", "torch_adam", 28}, Row{"adamw", "torch_adamw", 28},
                           Row{"sgd", "torch_sgd", 20}}) {
      const std::string key = row.name;
      const double gbps = row.bytes * n / r[key].median / 1e9;
      const double speedup = r[row.torch].median / r[key].median;
      out[key + "_ns_per_param_" + suffix] = ns(row.name);
      out["torch_" + key + "_ns_per_param_" + suffix] = ns(row.torch);
      out[key + "_vs_torch_speedup_" + suffix] = speedup;
      out[key + "_gbps_" + suffix] = gbps;
      out[key + "_stream_fraction_" + suffix] = gbps / stream_gbps;
      std::printf(
          "  %-6s shardopt   : %6.3f ns/param (%.3f..%.3f)  %6.2f GB/s  %.2f of "
          "same-traffic\n",
          row.name, ns(row.name), r[key].lo * 1e9 / n, r[key].hi * 1e9 / n, gbps,
          gbps / stream_gbps);
      std::printf("  %-6s LibTorch   : %6.3f ns/param (%.3f..%.3f)  -> shardopt %.2fx faster\n",
                  row.name, ns(row.torch), r[row.torch].lo * 1e9 / n, r[row.torch].hi * 1e9 / n,
                  speedup);
    }
  }
  if (!flags.json.empty()) {
    std::ofstream f(flags.json);
    f << out.dump(2) << "\n";
    if (!f) {
      std::fprintf(stderr, "bench_kernels: cannot write %s\n", flags.json.c_str());
      return 1;
    }
    std::printf("\nwrote %s\n", flags.json.c_str());
  }
  return 0;
}
