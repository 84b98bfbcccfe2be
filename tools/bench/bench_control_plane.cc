// Control plane at scale: one coordinator (its own process) serves N simulated
// ranks (light gRPC clients, not trainers): all join with the GPT-2-small
// manifest and receive its plan, heartbeat at 1 Hz, take two checkpoint
// rounds (requests observed through heartbeats), then one rank goes silent.
// Reports join time, planner time, coordinator CPU at steady state, and the
// time from the silent rank's last heartbeat to every other client seeing
// the abort.
//
// The coordinator ages a rank's heartbeats from the moment it registers the
// rank's Join, but a Join only returns once every rank has joined. So a
// simulated rank heartbeats from the moment it asks to join: unary Heartbeat
// calls at 1 Hz until the coordinator has acknowledged a heartbeat on the
// rank's Session stream (refused with FailedPrecondition until the
// coordinator has registered the rank), then on the stream. Without that, a
// join spread (plus session setup) longer than the heartbeat timeout -- easy on
// two loaded cores -- failed the job before any rank could send a heartbeat.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/join_request.h"
#include "tools/models/model_shapes.h"
#include "common/planner.h"
#include "nlohmann/json.hpp"
#include "proto/shardopt.grpc.pb.h"
#include "server/coordinator.h"
#include "server/coordinator_service.h"
#include "server/rpc_server.h"
#include "tools/cli/flags.h"

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

// One simulated rank's Session stream. Heartbeats are written one at a time;
// one asked for while the previous is still being written goes out as soon as
// that write completes (delayed, never dropped: a dropped beat is a 2 s gap at
// 1 Hz). `on_sent` is called (under this rank's lock) whenever a write starts.
class SimRank : public grpc::ClientBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse> {
 public:
  SimRank(v1::Coordinator::Stub* stub, int rank, int64_t first_step,
          std::function<void(const v1::HeartbeatResponse&)> on_notice,
          std::function<void()> on_sent)
      : rank_(rank), on_notice_(std::move(on_notice)), on_sent_(std::move(on_sent)) {
    stub->async()->Session(&ctx_, this);
    StartRead(&resp_);
    {
      // The first heartbeat goes out with the call: the coordinator answers
      // it, which tells us the stream carries this rank's heartbeats.
      std::lock_guard<std::mutex> l(mu_);
      WriteLocked(first_step);
    }
    AddHold();
    StartCall();
  }
  // Returns false if the heartbeat is delayed behind one still being written.
  bool Beat(int64_t step) {
    std::lock_guard<std::mutex> l(mu_);
    if (done_ || silenced_) return true;
    if (writing_) {
      pending_ = true;
      pending_step_ = step;
      return false;
    }
    WriteLocked(step);
    return true;
  }
  // Stops heartbeats for good (a queued one included).
  void Silence() {
    std::lock_guard<std::mutex> l(mu_);
    silenced_ = true;
    pending_ = false;
  }
  // Whether the coordinator has answered a heartbeat on this stream.
  bool Acknowledged() const { return acknowledged_.load(); }
  void Close() {
    std::lock_guard<std::mutex> l(mu_);
    if (!closed_) {
      closed_ = true;
      ctx_.TryCancel();
      RemoveHold();
    }
  }
  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> l(mu_);
    writing_ = false;
    if (ok && pending_ && !silenced_ && !closed_) {
      pending_ = false;
      WriteLocked(pending_step_);
    }
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    acknowledged_ = true;
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
  void WriteLocked(int64_t step) {
    writing_ = true;
    req_.set_rank(rank_);
    req_.set_step(step);
    on_sent_();
    StartWrite(&req_);
  }

  int rank_;
  std::function<void(const v1::HeartbeatResponse&)> on_notice_;
  std::function<void()> on_sent_;
  grpc::ClientContext ctx_;
  v1::HeartbeatRequest req_;
  v1::HeartbeatResponse resp_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> acknowledged_{false};
  bool writing_ = false, pending_ = false, silenced_ = false, done_ = false, closed_ = false;
  int64_t pending_step_ = 0;
};

int Main(int argc, char** argv) {
  auto f =
      Flags::Parse(argc, argv, {"ranks", "heartbeat-timeout", "steady", "fixture", "json", "help"});
  if (!f.ok() || f->Has("help")) {
    std::printf(
        "usage: bench_control_plane [--ranks=1024] [--heartbeat-timeout=3] [--steady=10]\n"
        "                           [--fixture=tests/fixtures/gpt2_small_params.json] "
        "[--json=PATH]\n");
    return f.ok() ? 0 : 2;
  }
  const int n = static_cast<int>(f->Int("ranks", 1024).value_or(1024));
  const double hb_timeout = f->Double("heartbeat-timeout", 3).value_or(3);
  const double steady = f->Double("steady", 10).value_or(10);
  if (n < 2 || hb_timeout <= 1.5) {
    std::fprintf(stderr,
                 "need --ranks >= 2 and --heartbeat-timeout > 1.5 s (heartbeats are 1 s apart)\n");
    return 2;
  }
  auto model = LoadModelShapes(f->Str("fixture", "tests/fixtures/gpt2_small_params.json"));
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  // The coordinator in its own process, so its CPU time is its own. It dies
  // with this process, however this one ends.
  int pipefd[2];
  if (pipe(pipefd) != 0) return 1;
  const pid_t parent = getpid();
  const pid_t child = fork();
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
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
  struct Reaper {
    pid_t pid;
    ~Reaper() {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  } reaper{child};
  close(pipefd[1]);
  int port = 0;
  if (read(pipefd[0], &port, sizeof(port)) != sizeof(port)) {
    std::fprintf(stderr, "the coordinator did not start\n");
    return 1;
  }
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

  // Shared state of the simulated ranks, under mu.
  std::mutex mu;
  std::condition_variable cv;
  std::vector<double> join_sent(n, 0);   // 0: Join not sent yet
  std::vector<double> last_sent(n, 0);   // last heartbeat sent (or Join)
  std::vector<double> max_gap(n, 0);     // largest interval between those
  std::vector<double> abort_seen(n, 0);  // first abort pushed on the session
  std::vector<int64_t> ckpt_seen(n, 0);
  std::string abort_reason;  // first abort any rank learned of
  double abort_first = 0;
  int64_t unary_ok = 0, unary_refused = 0, unary_failed = 0, unary_in_flight = 0;
  std::string unary_error;
  auto sent = [&](int r, double when) {  // mu held
    if (when <= last_sent[r]) return;
    max_gap[r] = std::max(max_gap[r], when - last_sent[r]);
    last_sent[r] = when;
  };
  auto saw_notice = [&](const v1::HeartbeatResponse& resp) {  // mu held
    if (resp.abort() && abort_reason.empty()) {
      abort_reason = resp.abort_reason();
      abort_first = Now();
    }
  };

  // Heartbeats: one thread, every rank at 1 Hz spread over the second; unary
  // until the rank's session is acknowledged (see the top of the file).
  std::vector<std::unique_ptr<SimRank>> sims(n);
  std::atomic<bool> sessions_open{false};
  std::atomic<int> silent{-1};
  std::atomic<bool> stop{false};
  std::atomic<int64_t> hb_delayed{0};
  std::vector<char> unary_busy(n, 0);  // under mu
  struct UnaryBeat {
    grpc::ClientContext ctx;
    v1::HeartbeatRequest req;
    v1::HeartbeatResponse resp;
    double sent_at = 0;
  };
  auto unary_beat = [&](int r, int64_t step) {
    {
      std::lock_guard<std::mutex> l(mu);
      if (unary_busy[r] || join_sent[r] == 0) return;
      unary_busy[r] = 1;
      ++unary_in_flight;
    }
    auto* call = new UnaryBeat;
    call->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    call->req.set_rank(r);
    call->req.set_step(step);
    call->sent_at = Now();
    stub(r)->async()->Heartbeat(&call->ctx, &call->req, &call->resp, [&, r, call](grpc::Status s) {
      {
        std::lock_guard<std::mutex> l(mu);
        if (s.ok()) {
          ++unary_ok;
          sent(r, call->sent_at);
          saw_notice(call->resp);
        } else if (s.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
          ++unary_refused;  // not registered yet: its clock has not started
        } else {
          ++unary_failed;
          unary_error = s.error_message();
        }
        unary_busy[r] = 0;
        --unary_in_flight;
        cv.notify_all();
      }
      delete call;
    });
  };
  std::thread sender([&] {
    const double start = Now();
    for (int64_t k = 0; !stop.load(); ++k) {
      const int r = static_cast<int>(k % n);
      const double due = start + static_cast<double>(k) / n;
      const double wait = due - Now();
      if (wait > 0) std::this_thread::sleep_for(std::chrono::duration<double>(wait));
      if (r == silent.load()) continue;
      SimRank* sim = sessions_open.load() ? sims[r].get() : nullptr;
      if (sim != nullptr && !sim->Beat(k / n)) ++hb_delayed;
      if (sim == nullptr || !sim->Acknowledged()) unary_beat(r, k / n);
    }
  });
  auto shutdown = [&] {
    if (!stop.exchange(true)) sender.join();
    for (auto& s : sims) {
      if (s) s->Close();
    }
    for (auto& s : sims) {
      if (s) s->WaitDone();
    }
    std::unique_lock<std::mutex> l(mu);
    cv.wait_for(l, std::chrono::seconds(10), [&] { return unary_in_flight == 0; });
  };
  struct Guard {
    std::function<void()> fn;
    ~Guard() { fn(); }
  } guard{shutdown};

  // 1. Everyone joins at once (requests built first, then sent together).
  int joined = 0, join_errors = 0;
  std::string join_error;
  struct JoinCall {
    grpc::ClientContext ctx;
    v1::JoinRequest req;
    v1::JoinResponse resp;
  };
  std::vector<std::unique_ptr<JoinCall>> joins;
  for (int r = 0; r < n; ++r) {
    auto call = std::make_unique<JoinCall>();
    JoinRequestInfo info;
    info.rank = r;
    info.shard_owner_port = 10000 + r;
    call->req = MakeJoinRequest(*layout, info);
    joins.push_back(std::move(call));
  }
  t = Now();
  for (int r = 0; r < n; ++r) {
    JoinCall* c = joins[r].get();
    c->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    {
      std::lock_guard<std::mutex> l(mu);
      join_sent[r] = last_sent[r] = Now();
    }
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
  }
  {
    std::unique_lock<std::mutex> l(mu);
    if (!cv.wait_for(l, std::chrono::seconds(150), [&] { return joined == n; })) {
      for (auto& c : joins) c->ctx.TryCancel();
      cv.wait_for(l, std::chrono::seconds(10), [&] { return joined == n; });
    }
  }
  const double join_s = Now() - t;
  if (join_errors > 0 || joined != n) {
    std::lock_guard<std::mutex> l(mu);
    std::fprintf(stderr, "join failed after %.3f s: %d/%d answered, %d errors (%s)\n", join_s,
                 joined, n, join_errors, join_error.c_str());
    return 1;
  }

  // 2. Every rank opens its session and streams heartbeats at 1 Hz, spread
  //    over the second; the coordinator pushes notices (abort, checkpoint).
  for (int r = 0; r < n; ++r) {
    sims[r] = std::make_unique<SimRank>(
        stub(r), r, 0,
        [&, r](const v1::HeartbeatResponse& resp) {
          const double now = Now();
          std::lock_guard<std::mutex> l(mu);
          saw_notice(resp);
          if (resp.abort() && abort_seen[r] == 0) abort_seen[r] = now;
          ckpt_seen[r] = std::max(ckpt_seen[r], resp.checkpoint_request());
        },
        [&, r] {
          std::lock_guard<std::mutex> l(mu);
          sent(r, Now());
        });
  }
  sessions_open = true;
  // Every session acknowledged (heartbeats now on the streams), or a failure.
  t = Now();
  double handoff_s = 0;
  while (true) {
    const bool all =
        std::all_of(sims.begin(), sims.end(), [](const auto& s) { return s->Acknowledged(); });
    handoff_s = Now() - t;
    if (all || handoff_s > 10) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::this_thread::sleep_for(std::chrono::seconds(2));  // warm up
  const double cpu0 = CpuSeconds(child), w0 = Now();
  std::this_thread::sleep_for(std::chrono::duration<double>(steady));
  const double cpu_fraction = (CpuSeconds(child) - cpu0) / (Now() - w0);

  // The job must still run: an abort now means a live rank's heartbeats were
  // missed, and every later figure would be meaningless.
  auto premature = [&](const char* when) {
    std::lock_guard<std::mutex> l(mu);
    if (abort_reason.empty()) return false;
    std::fprintf(
        stderr,
        "the coordinator aborted the job %s, before any rank went silent: %s\n"
        "  (join %.3f s, sessions acknowledged after %.3f s, largest heartbeat gap %.2f s, "
        "%lld heartbeats delayed; unary heartbeats: %lld ok, %lld refused, %lld failed %s)\n",
        when, abort_reason.c_str(), join_s, handoff_s,
        *std::max_element(max_gap.begin(), max_gap.end()),
        static_cast<long long>(hb_delayed.load()), static_cast<long long>(unary_ok),
        static_cast<long long>(unary_refused), static_cast<long long>(unary_failed),
        unary_error.c_str());
    return true;
  };
  if (premature("at steady state")) return 1;
  if (!std::all_of(sims.begin(), sims.end(), [](const auto& s) { return s->Acknowledged(); })) {
    std::fprintf(stderr, "not every session was acknowledged within 10 s\n");
    return 1;
  }

  // 3. Two checkpoint rounds: requested, seen by every rank.
  std::vector<double> round_s;
  for (int round = 1; round <= 2; ++round) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::RequestCheckpointResponse resp;
    t = Now();
    grpc::Status s = stub(0)->RequestCheckpoint(&ctx, v1::RequestCheckpointRequest(), &resp);
    if (!s.ok()) {
      if (!premature("during the checkpoint rounds")) {
        std::fprintf(stderr, "RequestCheckpoint failed: %s\n", s.error_message().c_str());
      }
      return 1;
    }
    while (true) {
      {
        std::lock_guard<std::mutex> l(mu);
        if (std::all_of(ckpt_seen.begin(), ckpt_seen.end(),
                        [&](int64_t v) { return v >= resp.request(); }))
          break;
      }
      if (Now() - t > 10) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    round_s.push_back(Now() - t);
  }
  if (premature("during the checkpoint rounds")) return 1;

  // 4. One rank goes silent.
  const int victim = n / 2 + 1;
  silent = victim;
  sims[victim]->Silence();
  double victim_last, steady_gap;
  {
    std::lock_guard<std::mutex> l(mu);
    victim_last = last_sent[victim];
    steady_gap = *std::max_element(max_gap.begin(), max_gap.end());
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
  shutdown();
  std::string reason;
  {
    std::lock_guard<std::mutex> l(mu);
    reason = abort_reason;
  }
  // The abort must be for the silent rank, not for a live one.
  const bool right_rank =
      reason.find(absl::StrCat("rank ", victim, " sent no heartbeat")) != std::string::npos;

  std::printf(
      "bench_control_plane: %d simulated ranks, GPT-2 small manifest (%zu tensors), "
      "heartbeat 1 Hz, timeout %.1f s\n",
      n, model->params.size(), hb_timeout);
  std::printf("  all joined and planned:         %.3f s   (target < 5 s)\n", join_s);
  std::printf("  planner time for %d ranks:    %.3f s\n", n, plan_s);
  std::printf(
      "  sessions acknowledged:          %.3f s after the join (unary heartbeats until then: "
      "%lld ok, %lld before the rank was registered)\n",
      handoff_s, static_cast<long long>(unary_ok), static_cast<long long>(unary_refused));
  std::printf(
      "  largest gap between a live rank's heartbeats: %.2f s, from its Join on (timeout %.1f s)\n",
      steady_gap, hb_timeout);
  std::printf(
      "  coordinator CPU, steady state:  %.1f%% of one core for %d streamed heartbeats/s (target < "
      "10%%)\n",
      100 * cpu_fraction, n);
  std::printf("  checkpoint rounds seen by all:  %.2f s, %.2f s\n", round_s[0], round_s[1]);
  std::printf(
      "  silent rank %d: abort seen by %d/%d others, at most %.2f s after its last "
      "heartbeat (target < timeout + 1 s = %.1f s)\n",
      victim, seen, n - 1, worst, hb_timeout + 1);
  std::printf("  abort reason: %s%s\n", reason.c_str(),
              right_rank ? "" : "   (expected the silent rank)");
  std::printf("  heartbeats delayed (previous one still being written): %lld\n",
              static_cast<long long>(hb_delayed.load()));
  nlohmann::json out = {{"ranks", n},
                        {"join_s", join_s},
                        {"plan_s", plan_s},
                        {"session_handoff_s", handoff_s},
                        {"max_heartbeat_gap_s", steady_gap},
                        {"coordinator_cpu_fraction", cpu_fraction},
                        {"checkpoint_rounds_s", round_s},
                        {"abort_seen_by", seen},
                        {"abort_latency_s", worst},
                        {"abort_reason", reason},
                        {"heartbeat_timeout_s", hb_timeout},
                        // delayed behind a write still in progress (none are dropped)
                        {"heartbeat_errors", hb_delayed.load()}};
  if (f->Has("json")) std::ofstream(f->Str("json", "")) << out.dump(2) << "\n";
  const bool ok =
      join_s < 5 && cpu_fraction < 0.10 && seen == n - 1 && worst < hb_timeout + 1 && right_rank;
  return ok ? 0 : 3;
}

}  // namespace
}  // namespace shardopt

int main(int argc, char** argv) { return shardopt::Main(argc, argv); }
