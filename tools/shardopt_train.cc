// shardopt_train: the main job. One rank of data-parallel training with
// ShardedOptimizer on synthetic data, its shard-owner gRPC service next to it,
// joined to the job's coordinator. Start it with shardrun.
#include <ATen/Parallel.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/checkpoint.h"
#include "client/coordinator_client.h"
#include "client/gloo_communicator.h"
#include "client/models.h"
#include "client/sharded_optimizer.h"
#include "common/malloc_tuning.h"
#include "server/coordinator_service.h"
#include "server/rpc_server.h"
#include "tools/flags.h"

namespace shardopt {
namespace {

constexpr char kUsage[] = R"(usage: shardopt_train [flags]

One rank of a data-parallel training job with ShardedOptimizer, on synthetic
data. Normally started by shardrun, which sets RANK, WORLD_SIZE, LOCAL_RANK and
SHARDOPT_COORDINATOR:

  shardrun --nproc 2 -- shardopt_train --model=mlp --steps=20

flags:
  --model=NAME         tiny | small | mlp (default tiny)
  --steps=N            optimizer steps (default 20)
  --lr=X               learning rate (default 1e-4)
  --optimizer=NAME     adam | adamw | sgd (SGD uses momentum 0.9; default adam)
  --batch=N            samples per rank per step (default: the model's)
  --clip=X             clip gradients to global L2 norm X (default off)
  --bucket-cap=N       bucket cap in elements (default 26214400)
  --threads=N          compute threads per rank (default 1)
  --malloc=MODE        tuned | default (default tuned: see README, "allocator")
  --coordinator=H:P    coordinator address (default $SHARDOPT_COORDINATOR)
  --job-id=ID          job id (default $SHARDOPT_JOB_ID or "job")
  --token-file=PATH    bearer token for the control plane (default $SHARDOPT_TOKEN_FILE)
  --bind=HOST          address for this rank's shard-owner service and Gloo (default 127.0.0.1)
  --tls-ca=PEM         TLS to the coordinator, verified against this CA (default $SHARDOPT_TLS_CA)
  --tls-cert=PEM       client certificate for mutual TLS (default $SHARDOPT_TLS_CERT)
  --tls-key=PEM        its key (default $SHARDOPT_TLS_KEY)
  --log-every=N        progress line every N steps (default: about 10 lines per run)
  --ckpt-dir=DIR       write sharded checkpoints under DIR (step-N/, LATEST)
  --ckpt-every=K       ... every K steps (default: only at the end when --ckpt-dir is set)
  --ckpt-keep=N        keep only the newest N checkpoints (default: keep all)
  --resume=PATH        resume from a checkpoint directory, or a root with LATEST
                       (any world size); training continues at the saved step
  --collective-timeout=S  bound on every collective wait (default 120)
  --debug-stall-rank=R, --debug-stall-step=N
                       testing: rank R stops taking part in collectives before step N
                       while its heartbeats go on (a stalled rank)
  --help               this text
)";

// Set by SIGTERM/SIGINT; the heartbeat thread turns it into an abort.
std::atomic<int> g_signal{0};
void OnSignal(int sig) { g_signal = sig; }

int Fail(int rank, const std::string& msg) {
  std::fprintf(stderr, "shardopt_train[rank %d]: %s\n", rank, msg.c_str());
  return 1;
}

int EnvInt(const char* name, int def) {
  const char* v = std::getenv(name);
  return v == nullptr ? def : std::atoi(v);
}

std::string EnvStr(const char* name, const std::string& def) {
  const char* v = std::getenv(name);
  return v == nullptr ? def : std::string(v);
}

int Main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // lines reach shardrun's pipe at once
  signal(SIGPIPE, SIG_IGN);             // a vanished launcher must not kill us mid-message
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  auto flags = Flags::Parse(argc, argv,
                            {"model", "steps", "lr", "optimizer", "batch", "clip", "bucket-cap",
                             "threads", "malloc", "coordinator", "job-id", "token-file", "bind",
                             "log-every", "tls-ca", "tls-cert", "tls-key", "ckpt-dir", "ckpt-every",
                             "resume", "ckpt-keep", "collective-timeout", "debug-stall-rank", "debug-stall-step",
                             "help"});
  if (!flags.ok()) return Fail(-1, std::string(flags.status().message()));
  if (flags->Has("help")) {
    std::printf("%s", kUsage);
    return 0;
  }
  const int rank = EnvInt("RANK", 0);
  const int world = EnvInt("WORLD_SIZE", 1);
  auto steps = flags->Int("steps", 20);
  auto lr = flags->Double("lr", 1e-4);
  auto clip = flags->Double("clip", 0.0);
  auto threads = flags->Int("threads", 1);
  auto bucket_cap = flags->Int("bucket-cap", 25 * 1024 * 1024);
  for (const absl::Status& s : {steps.status(), lr.status(), clip.status(), threads.status(),
                                bucket_cap.status()}) {
    if (!s.ok()) return Fail(rank, std::string(s.message()));
  }
  if (*steps < 1 || *threads < 1 || world < 1 || rank < 0 || rank >= world) {
    return Fail(rank, "need --steps >= 1, --threads >= 1 and 0 <= RANK < WORLD_SIZE");
  }
  MallocMode malloc_mode;
  if (absl::Status s = ParseMallocMode(flags->Str("malloc", "tuned"), &malloc_mode); !s.ok()) {
    return Fail(rank, std::string(s.message()));
  }
  if (absl::Status s = ApplyMallocMode(malloc_mode); !s.ok()) return Fail(rank, s.ToString());
  at::set_num_threads(static_cast<int>(*threads));

  const std::string coordinator = flags->Str("coordinator", EnvStr("SHARDOPT_COORDINATOR", ""));
  if (coordinator.empty()) {
    return Fail(rank, "no coordinator: run under shardrun, or pass --coordinator=HOST:PORT");
  }
  std::string token;
  const std::string token_file = flags->Str("token-file", EnvStr("SHARDOPT_TOKEN_FILE", ""));
  if (!token_file.empty()) {
    auto t = ReadTokenFile(token_file);
    if (!t.ok()) return Fail(rank, std::string(t.status().message()));
    token = *t;
  }
  const std::string job_id = flags->Str("job-id", EnvStr("SHARDOPT_JOB_ID", "job"));
  const std::string bind = flags->Str("bind", "127.0.0.1");

  auto model = MakeModel(flags->Str("model", "tiny"), 42);
  if (!model.ok()) return Fail(rank, std::string(model.status().message()));
  const int64_t batch = flags->Int("batch", (*model)->batch_per_rank()).value_or(0);
  if (batch < 1) return Fail(rank, "--batch must be >= 1");

  ShardedOptimizerOptions opt;
  const std::string kind = flags->Str("optimizer", "adam");
  if (kind == "adam") {
    opt.kind = OptimizerKind::kAdam;
  } else if (kind == "adamw") {
    opt.kind = OptimizerKind::kAdamW;
    opt.adam = AdamWConfig();
  } else if (kind == "sgd") {
    opt.kind = OptimizerKind::kSgd;
    opt.sgd.momentum = 0.9;
  } else {
    return Fail(rank, "--optimizer must be adam, adamw or sgd");
  }
  opt.adam.lr = *lr;
  opt.sgd.lr = *lr;
  opt.max_grad_norm = *clip;
  opt.plan.bucket_cap_elements = *bucket_cap;
  const double collective_timeout = flags->Double("collective-timeout", 120).value_or(120);
  if (!(collective_timeout > 0)) return Fail(rank, "--collective-timeout must be > 0");
  opt.timeout = absl::Seconds(collective_timeout);

  if (rank == 0) {
    std::printf("shardopt_train: %d ranks, model %s, %s lr %g, batch %lld/rank, %lld steps; %s\n",
                world, (*model)->name().c_str(), kind.c_str(), *lr, static_cast<long long>(batch),
                static_cast<long long>(*steps), DescribeMallocMode(malloc_mode).c_str());
    std::fflush(stdout);
  }

  // Rendezvous for Gloo through the coordinator's key-value store.
  ClientTls tls{flags->Str("tls-ca", EnvStr("SHARDOPT_TLS_CA", "")),
                flags->Str("tls-cert", EnvStr("SHARDOPT_TLS_CERT", "")),
                flags->Str("tls-key", EnvStr("SHARDOPT_TLS_KEY", ""))};
  auto creds = MakeChannelCredentials(tls);
  if (!creds.ok()) return Fail(rank, std::string(creds.status().message()));
  CoordinatorClient client(coordinator, token, *creds);
  GrpcKeyValueStore kv(&client);
  PrefixKeyValueStore job_kv(&kv, job_id);
  GlooOptions gopt;
  gopt.hostname = bind;
  gopt.timeout = absl::Seconds(collective_timeout);
  auto comm = GlooCommunicator::Create(&job_kv, rank, world, gopt);
  if (!comm.ok()) return Fail(rank, comm.status().ToString());

  auto optimizer = ShardedOptimizer::Create((*model)->NamedParameters(), opt, comm->get());
  if (!optimizer.ok()) {
    (void)client.Abort(optimizer.status().ToString(), rank);
    return Fail(rank, optimizer.status().ToString());
  }
  ShardedOptimizer* o = optimizer->get();

  // This rank's shard-owner service.
  std::atomic<int64_t> step_now{0};
  std::atomic<int64_t> progress{0};  // collective phases entered
  ShardOwnerService shard_owner(
      [o, rank, &step_now, kind] {
        v1::GetShardInfoResponse r;
        MemoryReport m = o->memory();
        r.set_rank(rank);
        r.set_step(step_now.load());
        r.set_owned_elements(m.state_bytes / 4 / (kind == "adam" || kind == "adamw" ? 2 : 1));
        r.set_master_bytes(m.master_bytes);
        r.set_state_bytes(m.state_bytes);
        r.set_grad_bytes(m.grad_bytes);
        r.set_param_bytes(m.param_bytes);
        r.set_optimizer(kind);
        return r;
      },
      token);
  RpcServerOptions sopt;
  sopt.address = bind + ":0";
  auto server = RpcServer::Start(sopt, {&shard_owner});
  if (!server.ok()) return Fail(rank, server.status().ToString());

  v1::JoinRequest join;
  join.set_job_id(job_id);
  join.set_rank(rank);
  join.set_world_size(world);
  join.set_host(bind);
  join.set_shard_owner_port((*server)->port());
  join.set_device("cpu");
  join.set_layout_hash(o->layout().hash());
  join.mutable_plan()->set_bucket_cap_elements(opt.plan.bucket_cap_elements);
  join.mutable_plan()->set_alignment_elements(opt.plan.alignment_elements);
  join.mutable_plan()->set_allow_cut(opt.plan.allow_cut);
  for (const ParamSpec& p : o->layout().params()) {
    v1::ParamInfo* pi = join.add_params();
    pi->set_name(p.name);
    for (int64_t d : p.shape) pi->add_shape(d);
    pi->set_dtype(DTypeName(p.dtype));
    pi->set_trainable(p.trainable);
  }
  auto joined = client.Join(join, absl::Seconds(120));
  if (!joined.ok()) return Fail(rank, joined.status().ToString());

  // Heartbeats: report progress, learn of aborts and learning-rate changes.
  std::atomic<bool> stop{false};
  std::atomic<double> loss_now{0}, sps_now{0}, lr_wanted{0};
  std::atomic<int64_t> lr_version{0};
  std::atomic<int64_t> ckpt_request{0};
  std::mutex abort_mu;
  std::string abort_reason;
  // One handler for the coordinator's notices, pushed on the session or
  // returned by a unary heartbeat.
  auto handle_notice = [&](const v1::HeartbeatResponse& r) -> std::string {
    if (r.hyper_params_version() > lr_version.load() && r.learning_rate() > 0) {
      lr_wanted = r.learning_rate();
      lr_version = r.hyper_params_version();
    }
    if (r.checkpoint_request() > ckpt_request.load()) ckpt_request = r.checkpoint_request();
    return r.abort() ? "job aborted: " + r.abort_reason() : "";
  };
  auto set_abort = [&](const std::string& reason) {
    {
      std::lock_guard<std::mutex> l(abort_mu);
      if (!abort_reason.empty()) return;
      abort_reason = reason;
    }
    (*comm)->Abort(absl::AbortedError(reason));
  };
  // The session: heartbeats stream out; aborts, learning rates and
  // checkpoint requests are pushed back at once.
  std::unique_ptr<CoordinatorSession> session = client.OpenSession();
  std::atomic<bool> session_ok{true};
  std::thread session_reader([&] {
    v1::HeartbeatResponse notice;
    while (session->Receive(&notice)) {
      const std::string reason = handle_notice(notice);
      if (!reason.empty()) set_abort(reason);
    }
    session_ok = false;
  });
  std::thread heartbeat([&] {
    absl::Time last_ok = absl::Now();
    while (!stop.load()) {
      v1::HeartbeatRequest hb;
      hb.set_rank(rank);
      hb.set_step(step_now.load());
      hb.set_loss(loss_now.load());
      hb.set_samples_per_s(sps_now.load());
      hb.set_progress(progress.load());
      std::string reason;
      if (g_signal.load() != 0) {
        reason = absl::StrCat("stopped by signal ", g_signal.load(),
                              " (shardrun is stopping the job, or it died)");
      } else if (session_ok.load() && session->Send(hb)) {
        last_ok = absl::Now();
      } else {
        // No session: plain heartbeats, until the coordinator is lost.
        auto r = client.Heartbeat(hb);
        if (r.ok()) {
          last_ok = absl::Now();
          reason = handle_notice(*r);
        } else if (absl::Now() - last_ok > absl::Seconds(15)) {
          reason = "lost the coordinator: " + std::string(r.status().message());
        }
      }
      if (!reason.empty()) {
        set_abort(reason);
        return;
      }
      for (int i = 0; i < 10 && !stop.load() && g_signal.load() == 0; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    }
  });
  auto finish = [&](int code) {
    stop = true;
    heartbeat.join();
    session->Close();
    session_reader.join();
    (*server)->Shutdown();
    return code;
  };

  const int64_t log_every = flags->Int("log-every", std::max<int64_t>(1, *steps / 10)).value_or(1);
  const std::string ckpt_dir = flags->Str("ckpt-dir", "");
  const int64_t ckpt_every = flags->Int("ckpt-every", 0).value_or(0);
  const int64_t ckpt_keep = flags->Int("ckpt-keep", 0).value_or(0);
  int64_t first_step = 0;
  const std::string resume = flags->Str("resume", "");
  if (!resume.empty()) {
    auto m = LoadCheckpoint(*o, resume);
    if (!m.ok()) {
      (void)client.Abort(m.status().ToString(), rank);
      return finish(Fail(rank, absl::StrCat("cannot resume: ", m.status().ToString())));
    }
    first_step = (*m)["step"].get<int64_t>();
    step_now = first_step;
    if (rank == 0) {
      std::printf("resumed from %s at step %lld (saved by %d ranks)\n", resume.c_str(),
                  static_cast<long long>(first_step), (*m)["world_size"].get<int>());
    }
  }
  auto save = [&](int64_t step) -> bool {
    CheckpointOptions co;
    co.user_metadata["data_position"] = std::to_string(step * batch * world);
    const auto t0 = std::chrono::steady_clock::now();
    auto dir = SaveCheckpoint(*o, ckpt_dir, co);
    if (!dir.ok()) {
      if (rank == 0) std::printf("checkpoint at step %lld failed (training continues): %s\n",
                                 static_cast<long long>(step), dir.status().ToString().c_str());
      return false;
    }
    if (rank == 0) {
      std::printf("checkpoint %s written in %.2f s\n", dir->c_str(),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      if (ckpt_keep > 0) {
        absl::Status p = PruneCheckpoints(PosixFileSystem(), ckpt_dir, static_cast<int>(ckpt_keep));
        if (!p.ok()) std::printf("pruning old checkpoints failed: %s\n", p.ToString().c_str());
      }
    }
    return true;
  };
  int64_t applied_version = 0;
  auto t_start = std::chrono::steady_clock::now();
  auto t_window = t_start;
  int64_t window_steps = 0;
  // A peer's death usually shows up first as a broken connection; the
  // coordinator's verdict (which names the rank) follows within a heartbeat
  // or two: wait for it briefly.
  auto why = [&](const absl::Status& s) {
    std::string reason;
    for (int i = 0; i < 30 && reason.empty(); ++i) {
      {
        std::lock_guard<std::mutex> l(abort_mu);
        reason = abort_reason;
      }
      if (reason.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!reason.empty()) return reason;
    // A timeout in a collective: name the ranks that are behind (alive, since
    // they still heartbeat, but not taking part).
    std::string msg = s.ToString();
    if (s.code() == absl::StatusCode::kDeadlineExceeded) {
      auto job = client.GetJob();
      if (job.ok()) {
        std::vector<std::string> behind;
        for (const auto& r : job->ranks()) {
          if (r.progress() < progress.load()) behind.push_back(absl::StrCat(r.rank(), " (at step ", r.step(), ")"));
        }
        if (!behind.empty()) {
          msg = absl::StrCat("collective timed out at step ", step_now.load() + 1, "; stalled rank(s): ",
                             absl::StrJoin(behind, ", "), " [", s.message(), "]");
        }
      }
    }
    return msg;
  };
  const int64_t stall_rank = flags->Int("debug-stall-rank", -1).value_or(-1);
  const int64_t stall_step = flags->Int("debug-stall-step", -1).value_or(-1);
  int64_t done_request = 0;
  // Control actions (learning-rate changes, requested checkpoints) reach
  // ranks at different heartbeats; one 8-byte all-reduce per step makes every
  // rank act on them at the same step.
  auto agree = [&](int64_t step) -> absl::Status {
    float ctl[2] = {static_cast<float>(lr_version.load()), static_cast<float>(ckpt_request.load())};
    absl::Status s = (*comm)->AllReduce(ctl, 2, ElementType::kFloat32, ReduceOp::kMax)
                         ->Wait(absl::Seconds(120));
    if (!s.ok()) return s;
    if (static_cast<int64_t>(ctl[0]) > applied_version) {
      // The learning rate of the newest version, from a rank that has it.
      float lr_new = lr_version.load() == static_cast<int64_t>(ctl[0])
                         ? static_cast<float>(lr_wanted.load()) : 0.0f;
      s = (*comm)->AllReduce(&lr_new, 1, ElementType::kFloat32, ReduceOp::kMax)
              ->Wait(absl::Seconds(120));
      if (!s.ok()) return s;
      applied_version = static_cast<int64_t>(ctl[0]);
      o->SetLearningRate(lr_new);
      if (rank == 0) std::printf("learning rate set to %g at step %lld\n", lr_new,
                                 static_cast<long long>(step));
    }
    if (static_cast<int64_t>(ctl[1]) > done_request) {
      done_request = static_cast<int64_t>(ctl[1]);
      if (ckpt_dir.empty()) {
        if (rank == 0) std::printf("checkpoint requested, but no --ckpt-dir was given: skipped\n");
      } else {
        save(step);
      }
    }
    return absl::OkStatus();
  };
  for (int64_t step = first_step; step < *steps; ++step) {
    if (rank == stall_rank && step == stall_step) {
      // Alive but silent in collectives: heartbeats continue until aborted.
      while (g_signal.load() == 0) {
        {
          std::lock_guard<std::mutex> l(abort_mu);
          if (!abort_reason.empty()) break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      return finish(Fail(rank, "stalled on purpose (--debug-stall-rank)"));
    }
    ++progress;
    if (absl::Status s = agree(step); !s.ok()) {
      const std::string msg = why(s);
      (void)client.Abort(msg, rank);
      return finish(Fail(rank, absl::StrCat("step ", step + 1, " failed: ", msg)));
    }
    o->ZeroGrad();
    torch::Tensor loss = (*model)->Loss(step, rank * batch, (rank + 1) * batch);
    loss.backward();
    ++progress;
    auto r = o->Step();
    if (!r.ok()) {
      const std::string msg = why(r.status());
      (void)client.Abort(msg, rank);
      return finish(Fail(rank, absl::StrCat("step ", step + 1, " failed: ", msg)));
    }
    const double l = loss.item<double>();
    ++window_steps;
    step_now = step + 1;
    loss_now = l;
    const auto now = std::chrono::steady_clock::now();
    const double secs = std::chrono::duration<double>(now - t_window).count();
    if (secs > 0) sps_now = window_steps * batch / secs;
    if (!ckpt_dir.empty() && ckpt_every > 0 && (step + 1) % ckpt_every == 0 && step + 1 < *steps) {
      save(step + 1);
    }
    if ((step + 1) % log_every == 0 || step + 1 == *steps) {
      if (rank == 0) {
        const int width = 20;
        const int filled = static_cast<int>(width * (step + 1) / *steps);
        std::printf("[%s%s] step %lld/%lld  loss %.5f  grad-norm %.4f  %.1f samples/s/rank\n",
                    std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(),
                    static_cast<long long>(step + 1), static_cast<long long>(*steps), l,
                    r->grad_norm, sps_now.load());
        std::fflush(stdout);
      }
      t_window = now;
      window_steps = 0;
    }
  }
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  if (!ckpt_dir.empty() && first_step < *steps && !save(*steps)) return finish(1);
  (void)client.Finish(rank);
  if (rank == 0) {
    MemoryReport m = o->memory();
    std::printf("done: %lld steps in %.1f s; rank 0 holds optimizer state %.1f MiB (of %.1f MiB "
                "for the whole model), layout %016llx\n",
                static_cast<long long>(*steps - first_step), total, m.state_bytes / 1048576.0,
                m.param_bytes / 1048576.0 * (opt.kind == OptimizerKind::kSgd ? 1 : 2),
                static_cast<unsigned long long>(o->layout().hash()));
  }
  return finish(0);
}

}  // namespace
}  // namespace shardopt

int main(int argc, char** argv) { return shardopt::Main(argc, argv); }
