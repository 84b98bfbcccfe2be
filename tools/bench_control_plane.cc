// Control plane at scale: one coordinator (its own process) serves N simulated
// ranks (light gRPC clients, not trainers): all join with the GPT-2-small
// manifest and receive its plan, heartbeat at 1 Hz, take two checkpoint
// rounds (requests observed through heartbeats), then one rank goes silent.
// Reports join time, planner time, coordinator CPU at steady state, and the
// time from the silent rank's last heartbeat to every other client seeing
// the abort.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/model_shapes.h"
#include "common/planner.h"
#include "nlohmann/json.hpp"
#include "proto/shardopt.grpc.pb.h"
#include "server/coordinator.h"
#include "server/coordinator_service.h"
#include "server/rpc_server.h"
#include "tools/flags.h"

namespace shardopt {
namespace {

using Clock = std::chrono::steady_clock;
double Now() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

double CpuSeconds(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  std::getline(f, line);
  std::istringstream in(line.substr(line.rfind(')') + 2));
  std::string field;
  double ut = 0, st = 0;
  for (int i = 3; i <= 15; ++i) {
    in >> field;
    if (i == 14) ut = std::stod(field);
    if (i == 15) st = std::stod(field);
  }
  return (ut + st) / sysconf(_SC_CLK_TCK);
}

int Main(int argc, char** argv) {
  auto f = Flags::Parse(argc, argv, {"ranks", "heartbeat-timeout", "steady", "fixture", "json", "help"});
  if (!f.ok() || f->Has("help")) {
    std::printf("usage: bench_control_plane [--ranks=1024] [--heartbeat-timeout=3] [--steady=10]\n"
                "                           [--fixture=tests/fixtures/gpt2_small_params.json] [--json=PATH]\n");
    return f.ok() ? 0 : 2;
  }
  const int n = static_cast<int>(f->Int("ranks", 1024).value_or(1024));
  const double hb_timeout = f->Double("heartbeat-timeout", 3).value_or(3);
  const double steady = f->Double("steady", 10).value_or(10);
  auto model = LoadModelShapes(f->Str("fixture", "tests/fixtures/gpt2_small_params.json"));
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  // The coordinator in its own process, so its CPU time is its own.
  int pipefd[2];
  if (pipe(pipefd) != 0) return 1;
  const pid_t child = fork();
  if (child == 0) {
    close(pipefd[0]);
    CoordinatorOptions o;
    o.world_size = n;
    o.heartbeat_timeout = absl::Seconds(hb_timeout);
    Coordinator c(o);
    CoordinatorService service(&c, "");
    auto server = RpcServer::Start(RpcServerOptions(), {&service});
    if (!server.ok()) _exit(1);
    const int port = (*server)->port();
    (void)!write(pipefd[1], &port, sizeof(port));
    pause();  // killed by the parent
    _exit(0);
  }
  close(pipefd[1]);
  int port = 0;
  if (read(pipefd[0], &port, sizeof(port)) != sizeof(port)) return 1;
  const std::string address = absl::StrCat("127.0.0.1:", port);

  // Planner time for n ranks (what every rank and the coordinator compute).
  double t = Now();
  auto layout = Plan(model->params, n);
  const double plan_s = Now() - t;
  if (!layout.ok()) return 1;

  std::vector<std::unique_ptr<v1::Coordinator::Stub>> stubs;
  for (int c = 0; c < 16; ++c) {
    grpc::ChannelArguments args;
    args.SetInt("grpc.channel_id", c);  // separate connections
    stubs.push_back(v1::Coordinator::NewStub(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args)));
  }
  auto stub = [&](int r) { return stubs[r % stubs.size()].get(); };

  // 1. Everyone joins at once.
  std::mutex mu;
  std::condition_variable cv;
  int joined = 0, join_errors = 0;
  std::string join_error;
  t = Now();
  struct JoinCall {
    grpc::ClientContext ctx;
    v1::JoinRequest req;
    v1::JoinResponse resp;
  };
  std::vector<std::unique_ptr<JoinCall>> joins;
  for (int r = 0; r < n; ++r) {
    auto call = std::make_unique<JoinCall>();
    call->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    call->req.set_job_id("job");
    call->req.set_rank(r);
    call->req.set_world_size(n);
    call->req.set_host("127.0.0.1");
    call->req.set_shard_owner_port(10000 + r);
    call->req.set_layout_hash(layout->hash());
    call->req.mutable_plan()->set_bucket_cap_elements(PlanOptions().bucket_cap_elements);
    call->req.mutable_plan()->set_alignment_elements(PlanOptions().alignment_elements);
    call->req.mutable_plan()->set_allow_cut(true);
    for (const ParamSpec& p : model->params) {
      auto* pi = call->req.add_params();
      pi->set_name(p.name);
      for (int64_t d : p.shape) pi->add_shape(d);
      pi->set_dtype("float32");
      pi->set_trainable(true);
    }
    JoinCall* c = call.get();
    stub(r)->async()->Join(&c->ctx, &c->req, &c->resp, [&, c](grpc::Status s) {
      std::lock_guard<std::mutex> l(mu);
      ++joined;
      if (!s.ok()) {
        ++join_errors;
        join_error = s.error_message();
      } else if (c->resp.layout_hash() != layout->hash()) {
        ++join_errors;
        join_error = "plan hash differs";
      }
      cv.notify_all();
    });
    joins.push_back(std::move(call));
  }
  {
    std::unique_lock<std::mutex> l(mu);
    cv.wait_for(l, std::chrono::seconds(150), [&] { return joined == n; });
  }
  const double join_s = Now() - t;
  if (join_errors > 0 || joined != n) {
    std::fprintf(stderr, "join failed: %d/%d answered, %d errors (%s)\n", joined, n, join_errors,
                 join_error.c_str());
    kill(child, SIGKILL);
    return 1;
  }

  // 2. Every rank opens its session and streams heartbeats at 1 Hz, spread
  //    over the second; the coordinator pushes notices (abort, checkpoint).
  std::atomic<int> silent{-1};
  std::vector<double> last_ok(n, 0), abort_seen(n, 0);
  std::vector<int64_t> ckpt_seen(n, 0);
  std::atomic<bool> stop{false};
  std::atomic<int64_t> hb_errors{0};
  class SimRank : public grpc::ClientBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse> {
   public:
    SimRank(v1::Coordinator::Stub* stub, int rank, std::function<void(const v1::HeartbeatResponse&)> on_notice)
        : rank_(rank), on_notice_(std::move(on_notice)) {
      stub->async()->Session(&ctx_, this);
      StartRead(&resp_);
      AddHold();
      StartCall();
    }
    // Returns false if the previous heartbeat is still being written.
    bool Beat(int64_t step) {
      std::lock_guard<std::mutex> l(mu_);
      if (writing_ || done_) return false;
      writing_ = true;
      req_.set_rank(rank_);
      req_.set_step(step);
      StartWrite(&req_);
      return true;
    }
    void Close() {
      std::lock_guard<std::mutex> l(mu_);
      if (!closed_) {
        closed_ = true;
        ctx_.TryCancel();
        RemoveHold();
      }
    }
    void OnWriteDone(bool) override {
      std::lock_guard<std::mutex> l(mu_);
      writing_ = false;
    }
    void OnReadDone(bool ok) override {
      if (!ok) return;
      on_notice_(resp_);
      StartRead(&resp_);
    }
    void OnDone(const grpc::Status&) override {
      std::lock_guard<std::mutex> l(mu_);
      done_ = true;
      cv_.notify_all();
    }
    void WaitDone() {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait_for(l, std::chrono::seconds(10), [&] { return done_; });
    }

   private:
    int rank_;
    std::function<void(const v1::HeartbeatResponse&)> on_notice_;
    grpc::ClientContext ctx_;
    v1::HeartbeatRequest req_;
    v1::HeartbeatResponse resp_;
    std::mutex mu_;
    std::condition_variable cv_;
    bool writing_ = false, done_ = false, closed_ = false;
  };
  std::vector<std::unique_ptr<SimRank>> sims;
  for (int r = 0; r < n; ++r) {
    sims.push_back(std::make_unique<SimRank>(stub(r), r, [&, r](const v1::HeartbeatResponse& resp) {
      const double now = Now();
      std::lock_guard<std::mutex> l(mu);
      if (resp.abort() && abort_seen[r] == 0) abort_seen[r] = now;
      ckpt_seen[r] = std::max(ckpt_seen[r], resp.checkpoint_request());
    }));
  }
  std::thread sender([&] {
    const double start = Now();
    for (int64_t k = 0; !stop.load(); ++k) {
      const int r = static_cast<int>(k % n);
      const double due = start + static_cast<double>(k) / n;
      const double wait = due - Now();
      if (wait > 0) std::this_thread::sleep_for(std::chrono::duration<double>(wait));
      if (r == silent.load()) continue;
      if (sims[r]->Beat(k / n)) {
        std::lock_guard<std::mutex> l(mu);
        last_ok[r] = Now();
      } else {
        ++hb_errors;
      }
    }
  });
  std::this_thread::sleep_for(std::chrono::seconds(2));  // warm up
  const double cpu0 = CpuSeconds(child), w0 = Now();
  std::this_thread::sleep_for(std::chrono::duration<double>(steady));
  const double cpu_fraction = (CpuSeconds(child) - cpu0) / (Now() - w0);

  // 3. Two checkpoint rounds: requested, seen by every rank.
  std::vector<double> round_s;
  for (int round = 1; round <= 2; ++round) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::RequestCheckpointResponse resp;
    t = Now();
    grpc::Status s = stub(0)->RequestCheckpoint(&ctx, v1::RequestCheckpointRequest(), &resp);
    if (!s.ok()) return 1;
    while (true) {
      {
        std::lock_guard<std::mutex> l(mu);
        if (std::all_of(ckpt_seen.begin(), ckpt_seen.end(), [&](int64_t v) { return v >= resp.request(); })) break;
      }
      if (Now() - t > 10) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    round_s.push_back(Now() - t);
  }

  // 4. One rank goes silent.
  const int victim = n / 2 + 1;
  silent = victim;
  double victim_last;
  {
    std::lock_guard<std::mutex> l(mu);
    victim_last = last_ok[victim];
  }
  const double deadline = Now() + hb_timeout + 10;
  double worst = 0;
  int seen = 0;
  while (Now() < deadline) {
    {
      std::lock_guard<std::mutex> l(mu);
      seen = 0;
      worst = 0;
      for (int r = 0; r < n; ++r) {
        if (r == victim) continue;
        if (abort_seen[r] > 0) {
          ++seen;
          worst = std::max(worst, abort_seen[r] - victim_last);
        }
      }
    }
    if (seen == n - 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  stop = true;
  sender.join();
  for (auto& s : sims) s->Close();
  for (auto& s : sims) s->WaitDone();
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);

  std::printf("bench_control_plane: %d simulated ranks, GPT-2 small manifest (%zu tensors), "
              "heartbeat 1 Hz, timeout %.1f s\n", n, model->params.size(), hb_timeout);
  std::printf("  all joined and planned:         %.3f s   (target < 5 s)\n", join_s);
  std::printf("  planner time for %d ranks:    %.3f s\n", n, plan_s);
  std::printf("  coordinator CPU, steady state:  %.1f%% of one core for %d streamed heartbeats/s (target < 10%%)\n",
              100 * cpu_fraction, n);
  std::printf("  checkpoint rounds seen by all:  %.2f s, %.2f s\n", round_s[0], round_s[1]);
  std::printf("  silent rank %d: abort seen by %d/%d others, at most %.2f s after its last "
              "heartbeat (target < timeout + 1 s = %.1f s)\n",
              victim, seen, n - 1, worst, hb_timeout + 1);
  std::printf("  heartbeats skipped (previous one still being written): %lld\n", static_cast<long long>(hb_errors.load()));
  nlohmann::json out = {{"ranks", n}, {"join_s", join_s}, {"plan_s", plan_s},
                        {"coordinator_cpu_fraction", cpu_fraction}, {"checkpoint_rounds_s", round_s},
                        {"abort_seen_by", seen}, {"abort_latency_s", worst},
                        {"heartbeat_timeout_s", hb_timeout}, {"heartbeat_errors", hb_errors.load()}};
  if (f->Has("json")) std::ofstream(f->Str("json", "")) << out.dump(2) << "\n";
  const bool ok = join_s < 5 && cpu_fraction < 0.10 && seen == n - 1 && worst < hb_timeout + 1;
  return ok ? 0 : 3;
}

}  // namespace
}  // namespace shardopt

int main(int argc, char** argv) { return shardopt::Main(argc, argv); }
