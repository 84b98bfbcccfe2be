// bench_oss: fairscale's OSS table reproduced on CPU (docs/performance.md section 1).
//
// Rows, all over the same Communicator, models and data, 2 ranks as separate
// processes (Gloo over loopback, 1 compute thread each), tuned malloc for all:
//   ddp       bucketed all-reduce of gradients overlapped with backward (25 MiB
//             buckets, launched from autograd hooks as PyTorch's DDP does),
//             then torch::optim::Adam on the whole model on every rank;
//   ddp_fused the same with shardopt's fused Adam on the whole model;
//   oss_ddp   fairscale's OSS + DDP: the same all-reduce, each rank runs
//             torch::optim::Adam on the parameters it owns (whole-tensor greedy
//             partition), then one broadcast per owner;
//   shardopt  ShardedOptimizer: bucketed reduce-scatter during backward, fused
//             update of the owned slices, bucketed all-gather;
//   shardopt_overlap  the same with the all-gathers overlapping the next
//             forward (overlap_param_gather; each layer waits for its own);
//   shardopt_zero2  shardopt_overlap with gradient sharding (shard_gradients,
//             4 Mi-element buckets as shardopt_train uses with it, or
//             --zero2-bucket-cap): each rank keeps only its slices' reduced
//             gradients;
//   compute_only  forward and backward alone: no communication, no optimizer
//             (not in the default rows): the ceiling any data-parallel optimizer
//             could reach on this model and machine;
//   shardopt_fr  the same with what shardopt_train adds for observability: every
//             collective through the flight recorder, per-step metrics under a
//             mutex and a thread that collects them once a second as heartbeats
//             do (not in the default rows; for measuring that overhead).
// Transport: every row runs over Gloo (TCP loopback) unless --transport says
// otherwise; a row named ROW@shm (or ROW@gloo) runs over that transport, so
// e.g. ddp,shardopt,ddp@shm,shardopt@shm compares both algorithms on both
// transports in one run (ShmCommunicator: client/comm/shm_communicator.h).
// Every row reports its gradient bytes per rank (buffers held across the
// step; autograd's transient gradients are not counted, in any row).
// Each (row, round) is a fresh pair of processes, so peak RSS is per row; rows
// are interleaved round by round, each round starting one row later (A B C D B C D A ...); warm-up
// steps are excluded.
#include <ATen/Parallel.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/optim/adam.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/comm/flight_recorder.h"
#include "client/comm/host_communicator.h"
#include "client/comm/kv_store.h"
#include "tools/models/models.h"
#include "client/host_allocator.h"
#include "client/sharded_optimizer.h"
#include "common/malloc_tuning.h"
#include "common/planner.h"
#include "nlohmann/json.hpp"
#include "server/kernels/cpu/cpu_kernels.h"
#include "tools/cli/flags.h"

namespace shardopt {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// DDP's gradient path: flat bucketed gradients, an all-reduce per bucket
// launched from autograd hooks in bucket order as buckets fill.
class DdpGradients {
 public:
  DdpGradients(const std::vector<std::pair<std::string, torch::Tensor>>& params, Communicator* comm,
               int64_t bucket_cap_elements)
      : comm_(comm) {
    std::vector<ParamSpec> specs;
    for (const auto& [name, t] : params)
      specs.push_back({name, t.sizes().vec(), DType::kFloat32, true});
    PlanOptions po;
    po.bucket_cap_elements = bucket_cap_elements;
    po.alignment_elements = 1;
    layout_ = *Plan(specs, 1, po);
    grads_ = torch::zeros({layout_.flat_size()});
    const int nb = static_cast<int>(layout_.buckets().size());
    ready_.assign(nb, 0);
    handles_.assign(nb, nullptr);
    for (size_t i = 0; i < params.size(); ++i) {
      torch::Tensor p = params[i].second;
      const ParamPlacement& pl = layout_.placement(static_cast<int>(i));
      const int64_t off = layout_.buckets()[pl.bucket].flat_offset + pl.bucket_offset;
      p.mutable_grad() = grads_.narrow(0, off, pl.numel).view(p.sizes());
      auto acc = torch::autograd::impl::grad_accumulator(p);
      const int bucket = pl.bucket;
      acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, bucket](const torch::autograd::variable_list& out,
                         const torch::autograd::variable_list&) {
            std::lock_guard<std::mutex> l(mu_);
            ++ready_[bucket];
            while (next_ < static_cast<int>(ready_.size()) &&
                   ready_[next_] == static_cast<int>(layout_.buckets()[next_].params.size())) {
              Launch(next_++);
            }
            return out;
          }));
      accumulators_.push_back(acc);
    }
  }
  void Zero() {
    grads_.zero_();
    std::fill(ready_.begin(), ready_.end(), 0);
    next_ = 0;
  }
  // Launches what backward did not, waits for all; returns seconds blocked.
  double Finish() {
    {
      std::lock_guard<std::mutex> l(mu_);
      while (next_ < static_cast<int>(ready_.size())) Launch(next_++);
    }
    const auto t = Clock::now();
    for (auto& h : handles_) {
      absl::Status s = h->Wait(absl::Seconds(300));
      if (!s.ok()) {
        std::fprintf(stderr, "all-reduce failed: %s\n", s.ToString().c_str());
        std::exit(1);
      }
    }
    return Since(t);
  }

 private:
  void Launch(int b) {
    const Bucket& bk = layout_.buckets()[b];
    handles_[b] = comm_->AllReduce(grads_.data_ptr<float>() + bk.flat_offset, bk.num_elements,
                                   DType::kFloat32, ReduceOp::kAverage);
  }
  Communicator* comm_;
  Layout layout_;
  torch::Tensor grads_;
  std::mutex mu_;
  std::vector<int> ready_;
  int next_ = 0;
  std::vector<CommHandlePtr> handles_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
};

struct StepTimes {
  double total = 0, fwd_bwd = 0, comm = 0, optim = 0, fwd = 0, gate_wait = 0;
  int64_t minor_faults = 0;  // page faults taken in the step (fresh memory touched)
};

int64_t MinorFaults() {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_minflt;
}

int RunWorker(const Flags& f) {
  const int rank = static_cast<int>(f.Int("rank", 0).value_or(0));
  const int world = static_cast<int>(f.Int("world", 2).value_or(2));
  const std::string row = f.Str("row", "shardopt");
  const int steps = static_cast<int>(f.Int("steps", 5).value_or(5));
  const int warmup = static_cast<int>(f.Int("warmup", 6).value_or(6));
  (void)ApplyMallocMode(MallocMode::kTuned);
  InstallHostAllocator();  // part of the tuned mode, as in shardopt_train
  at::set_num_threads(1);
  (void)LimitBlasThreads(1);  // OMP_NUM_THREADS=1 is set by the parent too
  FileKeyValueStore store(f.Str("store", "/tmp"));
  auto transport = ParseCpuTransport(f.Str("transport", "gloo"));
  if (!transport.ok()) {
    std::fprintf(stderr, "%s\n", transport.status().ToString().c_str());
    return 2;
  }
  CpuCommOptions co;
  co.transport = *transport;
  co.store_prefix = row;
  co.timeout = absl::Seconds(300);
  absl::StatusOr<std::unique_ptr<Communicator>> comm =
      [&]() -> absl::StatusOr<std::unique_ptr<Communicator>> {
    auto c = CreateCpuCommunicator(&store, rank, world, co);
    if (!c.ok()) return c.status();
    return std::move(c->comm);
  }();
  if (!comm.ok()) {
    std::fprintf(stderr, "%s\n", comm.status().ToString().c_str());
    return 1;
  }
  auto model = *MakeModel(f.Str("model", "mlp"), 42);
  const int64_t batch = model->batch_per_rank();
  auto named = model->NamedParameters();
  std::vector<torch::Tensor> params;
  int64_t numel = 0;
  for (auto& [n, t] : named) {
    params.push_back(t);
    numel += t.numel();
  }
  const double lr = 1e-4;
  int64_t state_bytes = 0;
  int64_t grad_bytes = numel * 4;  // ddp rows: the flat gradient buffer

  std::unique_ptr<ShardedOptimizer> sharded;
  double gate_wait_s = 0;  // overlap rows: time the forward's layer gates waited
  std::unique_ptr<DdpGradients> ddp;
  std::unique_ptr<torch::optim::Adam> torch_adam;
  std::vector<float> m, v;  // ddp_fused state
  std::vector<UpdateSlice> slices;
  torch::Tensor oss_flat;
  std::vector<std::pair<int64_t, int64_t>> oss_region;  // per owner: offset, elements
  // shardopt_fr: the flight recorder and the trainer's heartbeat metrics.
  const bool observed = row == "shardopt_fr";
  auto recorder = std::make_shared<FlightRecorder>();
  std::unique_ptr<Communicator> recording;
  if (observed) recording = std::make_unique<FlightRecordingCommunicator>(comm->get(), recorder);
  struct {
    std::mutex mu;
    std::vector<double> step_s;
    double grad_norm = 0, comm_s = 0, update_s = 0;
  } metrics;
  metrics.step_s.reserve(256);
  std::atomic<bool> stop_metrics{false};
  std::thread heartbeat;
  struct Joiner {  // also on early returns
    std::atomic<bool>* stop;
    std::thread* thread;
    ~Joiner() {
      stop->store(true);
      if (thread->joinable()) thread->join();
    }
  } joiner{&stop_metrics, &heartbeat};
  // shardopt_zero2[:cap=N][:staging=N][:pieces=0|1][:overlap=0|1]: variants side by side in one
  // run.
  const std::vector<std::string> row_parts = absl::StrSplit(row, ':');
  const bool zero2 = row_parts[0] == "shardopt_zero2";
  int64_t zero2_bucket_cap = f.Int("zero2-bucket-cap", 2 << 20).value_or(2 << 20);
  int zero2_staging = 2;
  bool zero2_pieces = true;
  bool zero2_overlap = true;
  for (size_t i = 1; i < row_parts.size(); ++i) {
    int64_t v = 0;
    const std::string& part = row_parts[i];
    const bool cap =
        absl::StartsWith(part, "cap=") && absl::SimpleAtoi(part.substr(4), &v) && v > 0;
    const bool staging =
        absl::StartsWith(part, "staging=") && absl::SimpleAtoi(part.substr(8), &v) && v > 0;
    const bool pieces = part == "pieces=0" || part == "pieces=1";
    const bool ovl = part == "overlap=0" || part == "overlap=1";
    if (!zero2 || (!cap && !staging && !pieces && !ovl)) {
      std::fprintf(
          stderr,
          "bad row '%s' (variants: shardopt_zero2:cap=N:staging=N:pieces=0|1:overlap=0|1)\n",
          row.c_str());
      return 2;
    }
    if (pieces) zero2_pieces = part == "pieces=1";
    if (ovl) zero2_overlap = part == "overlap=1";
    if (cap) zero2_bucket_cap = v;
    if (staging) zero2_staging = static_cast<int>(v);
  }
  const bool overlap = row == "shardopt_overlap" || (zero2 && zero2_overlap);
  if (row == "shardopt" || overlap || zero2 || observed) {
    ShardedOptimizerOptions o;
    o.adam.lr = lr;
    // shardopt_overlap: Step() returns with the all-gathers in flight; each
    // layer waits for its own in the next forward (as shardopt_train does).
    o.overlap_param_gather = overlap;
    if (zero2) {
      o.shard_gradients = true;
      o.plan.bucket_cap_elements = zero2_bucket_cap;
      o.grad_staging_buffers = zero2_staging;
      o.reduce_large_gradients_in_pieces = zero2_pieces;
    }
    auto s = ShardedOptimizer::Create(named, o, observed ? recording.get() : comm->get());
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.status().ToString().c_str());
      return 1;
    }
    sharded = std::move(*s);
    state_bytes = sharded->memory().state_bytes;
    if (overlap) {
      ShardedOptimizer* raw = sharded.get();
      model->set_layer_gate([raw, &gate_wait_s](torch::nn::Module& layer) {
        const auto g0 = Clock::now();
        absl::Status w = raw->WaitForParameters(layer);
        gate_wait_s += Since(g0);
        if (!w.ok()) throw std::runtime_error(std::string(w.message()));
      });
    }
    if (observed) {
      heartbeat = std::thread([&] {  // what shardopt_train's heartbeat thread collects
        double sink = 0;
        while (!stop_metrics.load()) {
          std::vector<double> taken;
          {
            std::lock_guard<std::mutex> l(metrics.mu);
            taken.swap(metrics.step_s);
            metrics.step_s.reserve(256);
            sink += metrics.grad_norm + metrics.comm_s + metrics.update_s;
          }
          sink += static_cast<double>((*comm)->counters().total_sent() + sharded->memory().total() +
                                      recorder->stalls());
          std::ifstream statm("/proc/self/statm");
          int64_t size = 0, resident = 0;
          statm >> size >> resident;
          sink += static_cast<double>(resident) + taken.size();
          for (int i = 0; i < 10 && !stop_metrics.load(); ++i) {
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
          }
        }
        (void)sink;
      });
    }
  } else if (row == "compute_only") {
    // Nothing to set up: autograd allocates the gradients, zeroed each step.
  } else {
    // Every rank starts from rank 0's weights, as DDP does.
    for (auto& p : params) {
      (void)(*comm)
          ->Broadcast(p.data_ptr(), p.numel(), DType::kFloat32, 0)
          ->Wait(absl::Seconds(300));
    }
    ddp = std::make_unique<DdpGradients>(named, comm->get(), 25 * 1024 * 1024 / 4);
    if (row == "ddp") {
      torch_adam = std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(lr));
      state_bytes = 2 * 4 * numel;
    } else if (row == "ddp_fused") {
      m.assign(numel, 0.0f);
      v.assign(numel, 0.0f);
      int64_t off = 0;
      for (auto& p : params) {
        UpdateSlice s;
        s.param = p.data_ptr<float>();
        s.grad = p.grad().data_ptr<float>();
        s.state0 = m.data() + off;
        s.state1 = v.data() + off;
        s.size = p.numel();
        off += p.numel();
        slices.push_back(s);
      }
      state_bytes = 2 * 4 * numel;
    } else if (row == "oss_ddp") {
      // fairscale OSS: whole parameters, each to the least loaded rank
      // (largest first); this rank's optimizer only sees its own. Parameters
      // are laid out by owner so that each owner broadcasts once.
      std::vector<int> order(params.size());
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int a, int b) { return params[a].numel() > params[b].numel(); });
      std::vector<int64_t> load(world, 0);
      std::vector<std::vector<int>> owned(world);
      for (int i : order) {
        const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
        owned[r].push_back(i);
        load[r] += params[i].numel();
      }
      oss_flat = torch::empty({numel});
      int64_t off = 0;
      torch::NoGradGuard ng;
      for (int r = 0; r < world; ++r) {
        oss_region.push_back({off, load[r]});
        for (int i : owned[r]) {
          torch::Tensor view = oss_flat.narrow(0, off, params[i].numel()).view(params[i].sizes());
          view.copy_(params[i]);
          params[i].set_data(view);
          off += params[i].numel();
        }
      }
      std::vector<torch::Tensor> mine;
      for (int i : owned[rank]) mine.push_back(params[i]);
      torch_adam = std::make_unique<torch::optim::Adam>(mine, torch::optim::AdamOptions(lr));
      state_bytes = 2 * 4 * load[rank];
    } else {
      std::fprintf(stderr, "unknown row '%s'\n", row.c_str());
      return 2;
    }
  }

  std::vector<StepTimes> times;
  ByteCounters before;
  for (int step = 0; step < warmup + steps; ++step) {
    if (step == warmup) before = (*comm)->counters();
    StepTimes t;
    const int64_t faults0 = MinorFaults();
    const auto t0 = Clock::now();
    if (observed) recorder->set_step(step + 1);
    if (sharded) {
      sharded->ZeroGrad();
    } else if (ddp) {
      ddp->Zero();
    } else {  // compute_only
      for (auto& p : params) {
        if (p.grad().defined()) p.mutable_grad().zero_();
      }
    }
    gate_wait_s = 0;
    const auto tf = Clock::now();
    torch::Tensor loss = model->Loss(step, rank * batch, (rank + 1) * batch);
    t.fwd = Since(tf);
    t.gate_wait = gate_wait_s;
    loss.backward();
    t.fwd_bwd = Since(t0);
    if (sharded) {
      auto r = sharded->Step();
      if (!r.ok()) {
        std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
        return 1;
      }
      t.comm = r->comm_wait_seconds;
      t.optim = r->update_seconds;
      if (observed) {
        std::lock_guard<std::mutex> l(metrics.mu);
        if (metrics.step_s.size() == 256) metrics.step_s.erase(metrics.step_s.begin());
        metrics.step_s.push_back(Since(t0));
        metrics.grad_norm = r->grad_norm;
        metrics.comm_s = r->comm_wait_seconds;
        metrics.update_s = r->update_seconds;
      }
    } else if (!ddp) {  // compute_only
      t.comm = 0;
      t.optim = 0;
    } else {
      t.comm = ddp->Finish();
      const auto t1 = Clock::now();
      if (row == "ddp_fused") {
        AdamConfig c;
        c.lr = lr;
        absl::Status s = AdamStep(c, step + 1, slices);
        if (!s.ok()) return 1;
      } else {
        torch_adam->step();
      }
      t.optim = Since(t1);
      if (row == "oss_ddp") {
        const auto t2 = Clock::now();
        std::vector<CommHandlePtr> hs;
        for (int r = 0; r < world; ++r) {
          hs.push_back((*comm)->Broadcast(oss_flat.data_ptr<float>() + oss_region[r].first,
                                          oss_region[r].second, DType::kFloat32, r));
        }
        for (auto& h : hs) (void)h->Wait(absl::Seconds(300));
        t.comm += Since(t2);
      }
    }
    t.total = Since(t0);
    t.minor_faults = MinorFaults() - faults0;
    if (step >= warmup) times.push_back(t);
  }
  const ByteCounters after = (*comm)->counters();
  if (sharded) grad_bytes = sharded->memory().grad_bytes;  // after the steps: staging included
  stop_metrics = true;
  if (heartbeat.joinable()) heartbeat.join();
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  nlohmann::json out;
  out["rank"] = rank;
  out["row"] = row;
  out["batch"] = batch;
  out["parameters"] = numel;
  out["optimizer_state_bytes"] = state_bytes;
  out["grad_bytes"] = grad_bytes;
  out["peak_rss_bytes"] = static_cast<int64_t>(ru.ru_maxrss) * 1024;
  out["bytes_sent_per_step"] =
      static_cast<double>(after.total_sent() - before.total_sent()) / steps;
  for (const StepTimes& t : times) {
    out["step_s"].push_back(t.total);
    out["fwd_bwd_s"].push_back(t.fwd_bwd);
    out["comm_s"].push_back(t.comm);
    out["optim_s"].push_back(t.optim);
    out["fwd_s"].push_back(t.fwd);
    out["gate_wait_s"].push_back(t.gate_wait);
    out["minor_faults"].push_back(t.minor_faults);
  }
  std::ofstream(f.Str("out", "/dev/stdout")) << out.dump() << "\n";
  return 0;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}
double StdDev(const std::vector<double>& v) {
  if (v.size() < 2) return 0;
  const double mean = std::accumulate(v.begin(), v.end(), 0.0) / v.size();
  double s = 0;
  for (double x : v) s += (x - mean) * (x - mean);
  return std::sqrt(s / (v.size() - 1));
}

// Runs one (model, row) pair of ranks; returns their JSON reports.
std::vector<nlohmann::json> RunPair(const std::string& self, const std::string& model,
                                    const std::string& row_name, int steps, int warmup, int world,
                                    int64_t zero2_bucket_cap, const std::string& transport) {
  // ROW@TRANSPORT runs ROW over that transport.
  const size_t at = row_name.find('@');
  const std::string row = row_name.substr(0, at);
  const std::string row_transport = at == std::string::npos ? transport : row_name.substr(at + 1);
  char tmpl[] = "/tmp/bench_oss.XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> args = {self,
                                     "--worker",
                                     "--rank=" + std::to_string(r),
                                     "--world=" + std::to_string(world),
                                     "--row=" + row,
                                     "--model=" + model,
                                     "--steps=" + std::to_string(steps),
                                     "--warmup=" + std::to_string(warmup),
                                     "--store=" + dir,
                                     absl::StrCat("--zero2-bucket-cap=", zero2_bucket_cap),
                                     "--transport=" + row_transport,
                                     absl::StrCat("--out=", dir, "/out", r, ".json")};
    pid_t pid = fork();
    if (pid == 0) {
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      // OpenBLAS sizes its thread pool when it loads: one thread, as the
      // Python benchmark and torchrun's default do.
      setenv("OMP_NUM_THREADS", "1", 1);
      execv(argv[0], argv.data());
      _exit(127);
    }
    pids.push_back(pid);
  }
  const auto deadline = Clock::now() + std::chrono::minutes(10);
  bool ok = true;
  for (pid_t pid : pids) {
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (Clock::now() > deadline) {
        for (pid_t p : pids) kill(p, SIGKILL);
      }
      usleep(20000);
    }
    ok &= WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  std::vector<nlohmann::json> out;
  for (int r = 0; ok && r < world; ++r) {
    std::ifstream in(absl::StrCat(dir, "/out", r, ".json"));
    out.push_back(nlohmann::json::parse(in));
  }
  (void)std::system(("rm -rf " + dir).c_str());
  if (!ok) {
    std::fprintf(stderr, "bench_oss: %s/%s failed\n", model.c_str(), row_name.c_str());
    std::exit(1);
  }
  return out;
}

constexpr char kUsage[] =
    R"(usage: bench_oss [--models=mlp,resnet101] [--rows=ddp,ddp_fused,oss_ddp,shardopt]
                 [--rounds=3] [--steps=5] [--warmup=6] [--ranks=2] [--zero2-bucket-cap=N]
                 [--transport=gloo|shm] [--ref=ROW] [--json=PATH] [--png=PATH]

fairscale's OSS benchmark table on CPU: 2 ranks (processes, Gloo over 127.0.0.1,
1 compute thread each, tuned malloc), rows interleaved round by round (each round one row later), each
(row, round) a fresh pair of processes, warm-up steps excluded. Prints median
samples/s per rank (+/- standard deviation over timed steps), ratio to ddp,
peak RSS, optimizer state and bytes sent per rank per step, and the step
breakdown. Warm-up is 6 steps: with the all-gathers overlapping the forward, glibc's heap
takes up to 6 steps to settle on the mlp (a step that grows it faults in 64 MiB of fresh pages,
~0.25 s on this VM: the JSON's minor_faults per step shows it; fwd_s and gate_wait_s split
the forward and its layer waits). --png draws the chart with tools/bench/plot_oss.py (needs python3-matplotlib).
--rows=shardopt,shardopt_fr measures what the flight recorder and the trainer's
heartbeat metrics cost (docs/observability.md, "Flight recorder"); --rows=...,shardopt_overlap adds the
all-gathers overlapping the next forward (its fwd+bwd column includes those waits, which its
exposed-comm column counts too); shardopt_zero2 adds gradient sharding to that (the "grads"
column: gradient buffers per rank; shardopt_zero2:cap=N:staging=N:pieces=0|1:overlap=0|1 rows compare bucket
caps, staging buffer counts, tensors larger than a bucket staged whole (pieces=0) and gradient sharding
without the overlapped all-gathers (overlap=0: shardopt plus shard_gradients) side by side). --ranks=4 runs 4 processes per row (on 2 cores: for the
memory columns, not for speed). compute_only runs forward and backward alone (no
communication, no optimizer) and prints every row as a fraction of it: the ceiling.
--ref=ROW adds paired ratios: for each round, every row's median over ROW's median in the same
round (the rows of a round run back to back), then the median of those ratios with the lowest and
highest; the JSON has them ("paired") and every row's per-round medians (samples_per_s_by_round).
Transport: --transport (default gloo) for every row; ROW@shm or ROW@gloo runs one row over
that transport (e.g. --rows=ddp,shardopt,ddp@shm,shardopt@shm); "vs ddp" is against the
plain ddp row, and the JSON's vs_ddp_same_transport against ddp@TRANSPORT when it ran.
)";

int RunParent(const Flags& f, const std::string& self) {
  const std::vector<std::string> models = absl::StrSplit(f.Str("models", "mlp,resnet101"), ',');
  const std::vector<std::string> rows =
      absl::StrSplit(f.Str("rows", "ddp,ddp_fused,oss_ddp,shardopt"), ',');
  const int rounds = static_cast<int>(f.Int("rounds", 3).value_or(3));
  const int steps = static_cast<int>(f.Int("steps", 5).value_or(5));
  const int warmup = static_cast<int>(f.Int("warmup", 6).value_or(6));
  const int ranks = static_cast<int>(f.Int("ranks", 2).value_or(2));
  const int64_t zero2_cap = f.Int("zero2-bucket-cap", 2 << 20).value_or(2 << 20);
  const std::string transport = f.Str("transport", "gloo");
  const std::string ref = f.Str("ref", "");
  if (!ref.empty() && std::find(rows.begin(), rows.end(), ref) == rows.end()) {
    std::fprintf(stderr, "bench_oss: --ref=%s is not one of --rows\n", ref.c_str());
    return 2;
  }
  for (const std::string& row : rows) {
    const size_t at = row.find('@');
    const std::string t = at == std::string::npos ? transport : row.substr(at + 1);
    if (!ParseCpuTransport(t).ok() || t == "auto") {
      std::fprintf(stderr, "bench_oss: row %s: transport must be gloo or shm\n", row.c_str());
      return 2;
    }
  }
  if (rounds < 1 || steps < 1 || warmup < 0 || ranks < 1 || ranks > 16 || zero2_cap < 1) {
    std::fprintf(
        stderr, "bench_oss: need --rounds >= 1, --steps >= 1, --warmup >= 0, 1 <= --ranks <= 16\n");
    return 2;
  }
  std::printf("bench_oss: %d ranks, %s (rows without @TRANSPORT), 1 thread per rank, %s; %s\n",
              ranks, transport == "shm" ? "shared memory" : "Gloo over 127.0.0.1",
              DescribeMallocMode(MallocMode::kTuned).c_str(), DescribeHostAllocator());
  std::printf("%d rounds x (%d warm-up + %d timed steps) per row, rows interleaved (rotated)\n\n",
              rounds, warmup, steps);
  nlohmann::json all;
  for (const std::string& model : models) {
    std::map<std::string, std::vector<nlohmann::json>> runs;
    // row -> samples/s of every timed step of every rank, one vector per round.
    std::map<std::string, std::vector<std::vector<double>>> by_round;
    for (int round = 0; round < rounds; ++round) {
      // Each round starts one row later: a row's place in the round (what ran
      // just before it) moves its throughput by several percent here, so no
      // row keeps the same place.
      for (size_t i = 0; i < rows.size(); ++i) {
        const std::string& row = rows[(i + round) % rows.size()];
        std::fprintf(stderr, "  %s round %d/%d: %s...\n", model.c_str(), round + 1, rounds,
                     row.c_str());
        by_round[row].emplace_back();
        for (auto& j : RunPair(self, model, row, steps, warmup, ranks, zero2_cap, transport)) {
          const double batch = j["batch"].get<double>();
          for (double s : j["step_s"]) by_round[row].back().push_back(batch / s);
          runs[row].push_back(j);
        }
      }
    }
    std::printf("model %s\n", model.c_str());
    std::printf("%-30s %20s %8s %12s %12s %12s %12s %10s %10s %10s\n", "row", "samples/s/rank",
                "vs ddp", "peak RSS", "opt state", "grads", "sent/step", "fwd+bwd", "exposed",
                "optim");
    double ddp_sps = 0;
    for (const std::string& row : rows) {
      std::vector<double> sps, rss, fb, cm, op, sent, faults;
      double state = 0, grads = 0;
      for (const auto& j : runs[row]) {
        grads = std::max(grads, j["grad_bytes"].get<double>());
        const double batch = j["batch"].get<double>();
        for (double s : j["step_s"]) sps.push_back(batch / s);
        for (double s : j["fwd_bwd_s"]) fb.push_back(s);
        for (double s : j["comm_s"]) cm.push_back(s);
        for (double s : j["optim_s"]) op.push_back(s);
        for (double s : j["minor_faults"]) faults.push_back(s);
        rss.push_back(j["peak_rss_bytes"].get<double>());
        sent.push_back(j["bytes_sent_per_step"].get<double>());
        state = std::max(state, j["optimizer_state_bytes"].get<double>());
      }
      const double med = Median(sps);
      if (row == "ddp") ddp_sps = med;
      nlohmann::json r;
      r["samples_per_s"] = med;
      r["samples_per_s_spread"] = StdDev(sps);
      r["vs_ddp"] = ddp_sps > 0 ? med / ddp_sps : 0;
      r["peak_rss_bytes"] = Median(rss);
      r["optimizer_state_bytes"] = state;
      r["grad_bytes"] = grads;
      r["bytes_sent_per_step"] = Median(sent);
      r["fwd_bwd_s"] = Median(fb);
      r["exposed_comm_s"] = Median(cm);
      r["optimizer_s"] = Median(op);
      r["minor_faults_per_step_max"] =
          faults.empty() ? 0.0 : *std::max_element(faults.begin(), faults.end());
      const size_t at = row.find('@');
      const std::string same_ddp = at == std::string::npos ? "ddp" : "ddp" + row.substr(at);
      if (all[model].contains(same_ddp)) {
        r["vs_ddp_same_transport"] = med / all[model][same_ddp]["samples_per_s"].get<double>();
      } else if (row == same_ddp) {
        r["vs_ddp_same_transport"] = 1.0;
      }
      all[model][row] = r;
      std::printf(
          "%-30s %11.2f +/- %5.2f %7.3fx %8.0f MiB %8.1f MiB %8.1f MiB %8.1f MiB %8.3f s %8.3f s "
          "%8.3f s\n",
          row.c_str(), med, StdDev(sps), r["vs_ddp"].get<double>(), Median(rss) / 1048576,
          state / 1048576, grads / 1048576, Median(sent) / 1048576, Median(fb), Median(cm),
          Median(op));
    }
    std::map<std::string, std::vector<double>> round_medians;
    for (const std::string& row : rows) {
      for (const auto& v : by_round[row]) round_medians[row].push_back(Median(v));
      all[model][row]["samples_per_s_by_round"] = round_medians[row];
    }
    if (!ref.empty()) {
      // Paired: each round ran the rows back to back, so a row's median over
      // the reference's in the same round cancels what drifts between rounds
      // (the machine's load), which the pooled medians above do not.
      std::printf("paired vs %s (median of per-round ratios [lowest, highest] over %d rounds):\n",
                  ref.c_str(), rounds);
      for (const std::string& row : rows) {
        std::vector<double> ratios;
        for (int i = 0; i < rounds; ++i) {
          ratios.push_back(round_medians[row][i] / round_medians[ref][i]);
        }
        const double med = Median(ratios);
        const auto [lo, hi] = std::minmax_element(ratios.begin(), ratios.end());
        std::printf("  %-30s %.3fx [%.3f, %.3f]\n", row.c_str(), med, *lo, *hi);
        all[model][row]["paired"] = {{"ref", ref}, {"median_ratio", med}, {"ratios", ratios}};
      }
    }
    if (all[model].contains("compute_only")) {
      const double ceiling = all[model]["compute_only"]["samples_per_s"].get<double>();
      std::printf("ceiling (compute_only: forward + backward, nothing else):");
      for (const std::string& row : rows) {
        if (row == "compute_only") continue;
        const double sps = all[model][row]["samples_per_s"].get<double>();
        if (sps > 0) std::printf(" %s %.3f", row.c_str(), sps / ceiling);
        all[model][row]["vs_compute_only"] = sps / ceiling;
      }
      std::printf(" of it\n");
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  all["setup"] = {
      {"ranks", ranks},
      {"omp_num_threads", 1},
      {"zero2_bucket_cap", zero2_cap},
      {"threads_per_rank", 1},
      {"transport", transport == "shm" ? "shm (ShmCommunicator); rows @gloo: gloo tcp 127.0.0.1"
                                       : "gloo tcp 127.0.0.1; rows @shm: ShmCommunicator"},
      {"malloc", DescribeMallocMode(MallocMode::kTuned)},
      {"host_allocator", DescribeHostAllocator()},
      {"rounds", rounds},
      {"steps", steps},
      {"warmup", warmup},
      {"optimizer", "adam lr 1e-4 fp32"}};
  const std::string json = f.Str("json", "");
  if (!json.empty()) {
    std::ofstream(json) << all.dump(2) << "\n";
    std::printf("wrote %s\n", json.c_str());
  }
  const std::string png = f.Str("png", "");
  if (!png.empty()) {
    if (json.empty()) {
      std::fprintf(stderr, "bench_oss: --png needs --json\n");
      return 2;
    }
    const std::string cmd =
        absl::StrCat("/usr/bin/python3 tools/bench/plot_oss.py '", json, "' '", png, "'");
    if (std::system(cmd.c_str()) != 0) {
      std::fprintf(stderr, "bench_oss: plotting failed (is python3-matplotlib installed?)\n");
      return 1;
    }
    std::printf("wrote %s\n", png.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace shardopt

int main(int argc, char** argv) {
  using namespace shardopt;
  auto f = Flags::Parse(
      argc, argv,
      {"worker", "rank", "world", "row", "model", "steps", "warmup", "store", "out", "models",
       "rows", "rounds", "json", "png", "ranks", "zero2-bucket-cap", "transport", "ref", "help"});
  if (!f.ok()) {
    std::fprintf(stderr, "bench_oss: %s\n", std::string(f.status().message()).c_str());
    return 2;
  }
  if (f->Has("help")) {
    std::printf("%s", kUsage);
    return 0;
  }
  if (f->Has("worker")) return RunWorker(*f);
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return 1;
  self[n] = '\0';
  return RunParent(*f, self);
}
