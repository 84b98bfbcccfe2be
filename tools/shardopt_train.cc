// shardopt_train: the main job. One rank of data-parallel training with
// ShardedOptimizer on synthetic data, its shard-owner gRPC service next to it,
// joined to the job's coordinator. Start it with shardrun.
#include <ATen/Parallel.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#include <google/protobuf/util/json_util.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/checkpoint.h"
#include "client/torch_interop.h"
#include "client/coordinator_client.h"
#include "client/flight_recorder.h"
#include "client/gloo_communicator.h"
#include "client/models.h"
#include "client/sharded_optimizer.h"
#include "common/malloc_tuning.h"
#include "server/coordinator_service.h"
#include "server/flight_records.h"
#include "server/rpc_server.h"
#include "tools/flags.h"

namespace shardopt {
namespace {

constexpr char kUsage[] = R"(usage: shardopt_train [flags]

One rank of a data-parallel training job with ShardedOptimizer, on synthetic
data. Normally started by shardrun, which sets RANK, WORLD_SIZE, LOCAL_RANK and
SHARDOPT_COORDINATOR:

  shardrun --nproc 2 -- shardopt_train --model=mlp --steps=20

flags (a malformed or out-of-range value is refused, naming the flag; exit status 2):
  --model=NAME         tiny | small | mlp | resnet101 (default tiny)
  --steps=N            optimizer steps, 1..100000000 (default 20)
  --lr=X               learning rate: > 0 and representable as a float,
                       1.17549e-38..3.40282e+38 (default 1e-4)
  --optimizer=NAME     adam | adamw | sgd (SGD uses momentum 0.9; default adam)
  --batch=N            samples per rank per step, 1..65536 (default: the model's)
  --clip=X             clip gradients to global L2 norm X, 0..1e+30 (default 0: off)
  --bucket-cap=N       bucket cap in elements, 1..2147483647 (default 26214400)
  --threads=N          compute threads per rank, 1..256 (default 1)
  --malloc=MODE        tuned | default (default tuned: see README, "allocator")
  --coordinator=H:P    coordinator address (default $SHARDOPT_COORDINATOR)
  --job-id=ID          job id (default $SHARDOPT_JOB_ID or "job")
  --token-file=PATH    bearer token for the control plane (default $SHARDOPT_TOKEN_FILE)
  --bind=HOST          address for this rank's shard-owner service and Gloo (default 127.0.0.1)
  --tls-ca=PEM         TLS to the coordinator, verified against this CA (default $SHARDOPT_TLS_CA)
  --tls-cert=PEM       client certificate for mutual TLS (default $SHARDOPT_TLS_CERT)
  --tls-key=PEM        its key (default $SHARDOPT_TLS_KEY)
  --log-every=N        progress line every N steps, 1..100000000 (default: about 10 lines per run)
  --ckpt-dir=DIR       write sharded checkpoints under DIR (step-N/, LATEST)
  --ckpt-every=K       ... every K steps, 0..100000000 (default 0: only at the end;
                       needs --ckpt-dir)
  --ckpt-keep=N        keep only the newest N checkpoints, 0..1000000 (default 0: keep all;
                       needs --ckpt-dir)
  --resume=PATH        resume from a checkpoint directory, a root with LATEST, a consolidated
                       .safetensors file or a torch.save file (.pt, see shardctl import); the
                       saved step and hyper-parameters are restored (an explicit --lr wins),
                       at any world size; training continues at the saved step
  --collective-timeout=S  bound on every collective wait (steps, the per-step agreement,
                       checkpoints), seconds in [0.1, 86400] (default 120)
  --debug-stall-rank=R, --debug-stall-step=N
                       testing: rank R (-1..WORLD_SIZE-1) stops taking part in collectives
                       before step N (-1..100000000) while its heartbeats go on (a stalled
                       rank); -1: off (default)
  --debug-nan-rank=R, --debug-nan-step=N
                       testing: rank R takes its loss at step N for nan (same ranges)
  --debug-slow-rank=R, --debug-slow-ms=N
                       testing: rank R (-1..WORLD_SIZE-1) sleeps N ms (0..60000) in every
                       step, before its forward pass (a slow rank); -1: off (default)
  --help               this text

Environment: RANK in [0, WORLD_SIZE), WORLD_SIZE in [1, 1048576] (defaults 0 and 1).

A step whose global gradient norm, or whose loss on any rank, is not finite
(nan or inf) stops every rank at that step with a message naming it, before
anything is checkpointed; the job then exits non-zero. Lower --lr if it happens.

Exit status: 0 trained, 1 the job failed, 2 a bad flag or environment variable.
)";

// Limits of the flags (see kUsage): nothing may allocate or loop absurdly.
constexpr int64_t kMaxSteps = 100000000;
constexpr int64_t kMaxBatch = 65536;
constexpr int64_t kMaxThreads = 256;
constexpr int64_t kMaxBucketCap = 2147483647;
constexpr int64_t kMaxCkptKeep = 1000000;
constexpr int64_t kMaxWorldSize = 1 << 20;
constexpr double kMaxClip = 1e30;
constexpr double kMaxTimeoutSeconds = 86400;

// Set by SIGTERM/SIGINT; the heartbeat thread turns it into an abort.
std::atomic<int> g_signal{0};
void OnSignal(int sig) { g_signal = sig; }

std::string g_failure;  // the last Fail() message (main thread): the flight record's reason

int Fail(int rank, const std::string& msg) {
  g_failure = msg;
  std::fprintf(stderr, "shardopt_train[rank %d]: %s\n", rank, msg.c_str());
  return 1;
}

// A bad flag or environment variable: one line, exit status 2.
int UsageError(absl::string_view msg) {
  std::fprintf(stderr, "shardopt_train: %s\n", std::string(msg).c_str());
  return 2;
}

// A number for messages: "nan" rather than "-nan".
std::string Num(double v) { return std::isnan(v) ? "nan" : absl::StrFormat("%g", v); }

// The value of a checked flag; the first error lands in *first_error.
template <typename T>
T Take(absl::StatusOr<T> v, absl::Status* first_error) {
  if (!v.ok()) {
    if (first_error->ok()) *first_error = v.status();
    return T();
  }
  return *std::move(v);
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
                             "debug-nan-rank", "debug-nan-step", "debug-slow-rank", "debug-slow-ms",
                             "help"});
  if (!flags.ok()) return UsageError(flags.status().message());
  if (flags->Has("help")) {
    std::printf("%s", kUsage);
    return 0;
  }
  if (!flags->positional().empty() || !flags->rest().empty()) {
    const std::string& extra =
        flags->positional().empty() ? flags->rest().front() : flags->positional().front();
    return UsageError(absl::StrCat("unexpected argument '", extra, "' (flags are --name=value; see --help)"));
  }
  // Every flag and variable is checked here, before any work: a bad value is
  // refused by name (exit status 2), never replaced by its default.
  absl::Status bad;
  const int world = static_cast<int>(Take(EnvInt("WORLD_SIZE", 1, 1, kMaxWorldSize), &bad));
  const int rank = static_cast<int>(Take(EnvInt("RANK", 0, 0, std::max(0, world - 1)), &bad));
  const std::string model_name =
      Take(flags->Choice("model", "tiny", {"tiny", "small", "mlp", "resnet101"}), &bad);
  const int64_t steps = Take(flags->Int("steps", 20, 1, kMaxSteps), &bad);
  const absl::StatusOr<double> lr = flags->PositiveFloat("lr", 1e-4);  // (the resume block reads *lr)
  if (!lr.ok() && bad.ok()) bad = lr.status();
  const std::string kind = Take(flags->Choice("optimizer", "adam", {"adam", "adamw", "sgd"}), &bad);
  const int64_t batch_flag = Take(flags->Int("batch", 0, 1, kMaxBatch), &bad);
  const double clip = Take(flags->Double("clip", 0, 0, kMaxClip), &bad);
  const int64_t bucket_cap = Take(flags->Int("bucket-cap", 25 * 1024 * 1024, 1, kMaxBucketCap), &bad);
  const int64_t threads = Take(flags->Int("threads", 1, 1, kMaxThreads), &bad);
  const std::string malloc_flag = Take(flags->Choice("malloc", "tuned", {"tuned", "default"}), &bad);
  const std::string coordinator =
      Take(flags->NonEmpty("coordinator", EnvStr("SHARDOPT_COORDINATOR", "")), &bad);
  const std::string job_id = Take(flags->NonEmpty("job-id", EnvStr("SHARDOPT_JOB_ID", "job")), &bad);
  const std::string token_file =
      Take(flags->NonEmpty("token-file", EnvStr("SHARDOPT_TOKEN_FILE", "")), &bad);
  const std::string bind = Take(flags->NonEmpty("bind", "127.0.0.1"), &bad);
  const std::string tls_ca = Take(flags->NonEmpty("tls-ca", EnvStr("SHARDOPT_TLS_CA", "")), &bad);
  const std::string tls_cert = Take(flags->NonEmpty("tls-cert", EnvStr("SHARDOPT_TLS_CERT", "")), &bad);
  const std::string tls_key = Take(flags->NonEmpty("tls-key", EnvStr("SHARDOPT_TLS_KEY", "")), &bad);
  const int64_t log_every =
      Take(flags->Int("log-every", std::max<int64_t>(1, steps / 10), 1, kMaxSteps), &bad);
  const std::string ckpt_dir = Take(flags->NonEmpty("ckpt-dir", ""), &bad);
  const int64_t ckpt_every = Take(flags->Int("ckpt-every", 0, 0, kMaxSteps), &bad);
  const int64_t ckpt_keep = Take(flags->Int("ckpt-keep", 0, 0, kMaxCkptKeep), &bad);
  (void)Take(flags->NonEmpty("resume", ""), &bad);
  const absl::Duration collective_timeout =
      Take(flags->Seconds("collective-timeout", 120, 0.1, kMaxTimeoutSeconds), &bad);
  const int64_t stall_rank = Take(flags->Int("debug-stall-rank", -1, -1, world - 1), &bad);
  const int64_t stall_step = Take(flags->Int("debug-stall-step", -1, -1, kMaxSteps), &bad);
  const int64_t nan_rank = Take(flags->Int("debug-nan-rank", -1, -1, world - 1), &bad);
  const int64_t nan_step = Take(flags->Int("debug-nan-step", -1, -1, kMaxSteps), &bad);
  const int64_t slow_rank = Take(flags->Int("debug-slow-rank", -1, -1, world - 1), &bad);
  const int64_t slow_ms = Take(flags->Int("debug-slow-ms", 0, 0, 60000), &bad);
  if (!bad.ok()) return UsageError(bad.message());
  if (ckpt_dir.empty() && (ckpt_every > 0 || ckpt_keep > 0)) {
    return UsageError("--ckpt-every and --ckpt-keep need --ckpt-dir");
  }
  if (coordinator.empty()) {
    return UsageError("no coordinator: run under shardrun, or pass --coordinator=HOST:PORT");
  }
  std::string token;
  if (!token_file.empty()) {
    auto t = ReadTokenFile(token_file);
    if (!t.ok()) return UsageError(t.status().message());
    token = *t;
  }
  MallocMode malloc_mode;
  if (absl::Status s = ParseMallocMode(malloc_flag, &malloc_mode); !s.ok()) return UsageError(s.message());
  if (absl::Status s = ApplyMallocMode(malloc_mode); !s.ok()) return Fail(rank, s.ToString());
  at::set_num_threads(static_cast<int>(threads));

  auto model = MakeModel(model_name, 42);
  if (!model.ok()) return Fail(rank, std::string(model.status().message()));
  const int64_t batch = flags->Has("batch") ? batch_flag : (*model)->batch_per_rank();

  ShardedOptimizerOptions opt;
  if (kind == "adam") {
    opt.kind = OptimizerKind::kAdam;
  } else if (kind == "adamw") {
    opt.kind = OptimizerKind::kAdamW;
    opt.adam = AdamWConfig();
  } else {
    opt.kind = OptimizerKind::kSgd;
    opt.sgd.momentum = 0.9;
  }
  opt.adam.lr = *lr;
  opt.sgd.lr = *lr;
  opt.max_grad_norm = clip;
  opt.plan.bucket_cap_elements = bucket_cap;
  opt.timeout = collective_timeout;

  if (rank == 0) {
    std::printf("shardopt_train: %d ranks, model %s, %s lr %g, batch %lld/rank, %lld steps; %s\n",
                world, (*model)->name().c_str(), kind.c_str(), *lr, static_cast<long long>(batch),
                static_cast<long long>(steps), DescribeMallocMode(malloc_mode).c_str());
    std::fflush(stdout);
  }

  // Rendezvous for Gloo through the coordinator's key-value store.
  ClientTls tls{tls_ca, tls_cert, tls_key};
  auto creds = MakeChannelCredentials(tls);
  if (!creds.ok()) return Fail(rank, std::string(creds.status().message()));
  CoordinatorClient client(coordinator, token, *creds);
  GrpcKeyValueStore kv(&client);
  PrefixKeyValueStore job_kv(&kv, job_id);
  GlooOptions gopt;
  gopt.hostname = bind;
  gopt.timeout = collective_timeout;
  auto gloo = GlooCommunicator::Create(&job_kv, rank, world, gopt);
  if (!gloo.ok()) return Fail(rank, gloo.status().ToString());
  // Every collective goes through the flight recorder (README, "Flight recorder").
  auto recorder = std::make_shared<FlightRecorder>();
  absl::StatusOr<std::unique_ptr<Communicator>> comm = std::unique_ptr<Communicator>(
      std::make_unique<FlightRecordingCommunicator>(*std::move(gloo), recorder));

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
      token, [rank, recorder] { return ToFlightRecord(rank, recorder->Snapshot(), absl::Now(), ""); });
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
  join.set_learning_rate(o->learning_rate());
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
  // Waits for every rank to join (they start at different speeds): at least 2 minutes.
  auto joined = client.Join(join, std::max(absl::Seconds(120), collective_timeout));
  if (!joined.ok()) return Fail(rank, joined.status().ToString());

  // Heartbeats: report progress, learn of aborts and learning-rate changes.
  std::atomic<bool> stop{false};
  std::atomic<double> loss_now{0}, sps_now{0}, lr_wanted{0};
  std::atomic<int64_t> lr_version{0};
  std::atomic<double> lr_applied{o->learning_rate()};  // what heartbeats report
  std::atomic<int64_t> ckpt_request{0};
  std::mutex abort_mu;
  std::string abort_reason;
  // What heartbeats report besides progress (RankMetrics): the training loop
  // writes it, the heartbeat thread takes it once a second.
  struct Metrics {
    std::mutex mu;
    std::vector<double> step_seconds;  // finished since the last heartbeat (the newest 256)
    double grad_norm = 0, comm_wait_seconds = 0, update_seconds = 0;
    int64_t checkpoints_total = 0, last_checkpoint_step = 0, last_checkpoint_bytes = 0;
    double last_checkpoint_seconds = 0;
  } metrics;
  constexpr size_t kMaxStepTimes = 256;  // per heartbeat (the coordinator's limit)
  metrics.step_seconds.reserve(kMaxStepTimes);
  auto fill_metrics = [&](v1::RankMetrics* m) {
    {
      std::lock_guard<std::mutex> l(metrics.mu);
      for (double v : metrics.step_seconds) m->add_step_seconds(v);
      metrics.step_seconds.clear();
      m->set_grad_norm(metrics.grad_norm);
      m->set_comm_wait_seconds(metrics.comm_wait_seconds);
      m->set_update_seconds(metrics.update_seconds);
      m->set_checkpoints_total(metrics.checkpoints_total);
      m->set_last_checkpoint_step(metrics.last_checkpoint_step);
      m->set_last_checkpoint_seconds(metrics.last_checkpoint_seconds);
      m->set_last_checkpoint_bytes(metrics.last_checkpoint_bytes);
    }
    m->set_bytes_sent_total((*comm)->counters().total_sent());
    const MemoryReport mem = o->memory();
    m->set_master_bytes(mem.master_bytes);
    m->set_state_bytes(mem.state_bytes);
    m->set_grad_bytes(mem.grad_bytes);
    m->set_param_bytes(mem.param_bytes);
    m->set_rss_bytes(ProcessRssBytes());
    m->set_stalls_total(recorder->stalls());
  };
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
      hb.set_learning_rate(lr_applied.load());
      fill_metrics(hb.mutable_metrics());
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
  // A failing rank sends its flight record (its last collectives) to the
  // coordinator, which shows where the ranks diverged; if that fails, it
  // writes it as JSON next to the checkpoints (or in the temporary
  // directory) and says where.
  auto report_flight = [&] {
    std::string reason = g_failure;
    {
      std::lock_guard<std::mutex> l(abort_mu);
      if (reason.empty()) reason = abort_reason;
    }
    if (reason.empty()) reason = "the rank failed";
    if (reason.size() > kMaxFlightReasonBytes) reason.resize(kMaxFlightReasonBytes);
    const v1::FlightRecord record = ToFlightRecord(rank, recorder->Snapshot(), absl::Now(), reason);
    const absl::Status sent = client.ReportFlightRecord(record);
    if (sent.ok()) return;
    std::string json;
    google::protobuf::util::JsonPrintOptions jo;
    jo.add_whitespace = true;
    jo.always_print_primitive_fields = true;
    (void)google::protobuf::util::MessageToJsonString(record, &json, jo);
    const std::string tmp = EnvStr("TMPDIR", "/tmp");
    const std::string path =
        !ckpt_dir.empty() ? absl::StrCat(ckpt_dir, "/flight-record-rank-", rank, ".json")
                          : absl::StrCat(tmp.empty() ? "/tmp" : tmp, "/shardopt-flight-record-", job_id,
                                         "-rank-", rank, "-", getpid(), ".json");
    if (!ckpt_dir.empty()) (void)PosixFileSystem()->MakeDirs(ckpt_dir);
    FILE* f = std::fopen(path.c_str(), "w");
    const bool written = f != nullptr && std::fwrite(json.data(), 1, json.size(), f) == json.size();
    if (f != nullptr && std::fclose(f) != 0) f = nullptr;
    std::fprintf(stderr, "shardopt_train[rank %d]: could not send the flight record to the coordinator (%s); %s\n",
                 rank, std::string(sent.message()).c_str(),
                 written && f != nullptr ? absl::StrCat("wrote it to ", path).c_str()
                                         : absl::StrCat("could not write it to ", path).c_str());
  };
  auto finish = [&](int code) {
    if (code != 0) report_flight();
    stop = true;
    heartbeat.join();
    session->Close();
    session_reader.join();
    (*server)->Shutdown();
    return code;
  };

  int64_t first_step = 0;
  const std::string resume = flags->Str("resume", "");
  if (!resume.empty()) {
    // A checkpoint directory or root, a consolidated .safetensors file, or a
    // torch.save file (shardctl consolidate --format=torch, or PyTorch's own).
    auto m = LoadAnyCheckpoint(*o, resume);
    if (!m.ok()) {
      (void)client.Abort(m.status().ToString(), rank);
      return finish(Fail(rank, absl::StrCat("cannot resume: ", m.status().ToString())));
    }
    first_step = m->step;
    step_now = first_step;
    // The saved hyper-parameters are in force now; an explicit --lr wins.
    std::string lr_note = absl::StrFormat("lr %g as saved", m->optimizer.lr);
    if (flags->Has("lr") && *lr != m->optimizer.lr) {
      o->SetLearningRate(*lr);
      lr_note = absl::StrFormat("lr %g from --lr (the checkpoint saved %g)", *lr, m->optimizer.lr);
    }
    if (rank == 0) {
      const std::string by = m->world_size > 0 ? absl::StrCat("saved by ", m->world_size, " ranks")
                                               : std::string("consolidated");
      std::printf("resumed from %s (%s, %s) at step %lld, %s\n", m->path.c_str(), m->format.c_str(), by.c_str(),
                  static_cast<long long>(first_step), lr_note.c_str());
    }
  }
  // Why a collective failed. A peer's death usually shows up first as a
  // broken connection (Gloo: UNAVAILABLE "... failed after 0.2s, before its
  // timeout"), which names no rank; the control plane names it, so its
  // diagnosis wins: the coordinator's verdict (pushed to us, or
  // in its job status), else ranks that stopped heartbeating, else ranks
  // behind us in the collectives (alive, but stalled). `since`: when the
  // failed phase began.
  auto pushed_reason = [&] {
    std::lock_guard<std::mutex> l(abort_mu);
    return abort_reason;
  };
  auto why = [&](const absl::Status& s, absl::Time since) -> std::string {
    std::string reason;
    for (int i = 0; i < 30 && (reason = pushed_reason()).empty(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!reason.empty()) return reason;
    // Ranks that went silent: the coordinator declares them dead after its
    // heartbeat timeout; wait for that verdict a while (up to ~15 s).
    std::string silent;
    for (int i = 0; i < 30; ++i) {
      auto job = client.GetJob();
      if (!job.ok()) break;
      if (!job->failure().empty()) return "job failed: " + job->failure();
      std::vector<std::string> quiet;
      for (const auto& r : job->ranks()) {
        if (r.rank() != rank && r.seconds_since_heartbeat() > 2.5) {
          quiet.push_back(absl::StrFormat("%d (no heartbeat for %.1f s)", r.rank(), r.seconds_since_heartbeat()));
        }
      }
      if (quiet.empty()) break;
      silent = absl::StrJoin(quiet, ", ");
      if (!(reason = pushed_reason()).empty()) return reason;
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
    if (!silent.empty()) {
      return absl::StrCat("lost rank(s) ", silent, ", probably dead [", s.message(), "]");
    }
    std::string msg = s.ToString();
    if (s.code() == absl::StatusCode::kDeadlineExceeded) {
      // A timeout: name the ranks that are behind.
      auto job = client.GetJob();
      if (job.ok()) {
        std::vector<std::string> behind;
        for (const auto& r : job->ranks()) {
          if (r.progress() < progress.load()) behind.push_back(absl::StrCat(r.rank(), " (at step ", r.step(), ")"));
        }
        if (!behind.empty()) {
          return absl::StrCat("collective timed out at step ", step_now.load() + 1, "; stalled rank(s): ",
                              absl::StrJoin(behind, ", "), " [", s.message(), "]");
        }
      }
      const absl::Duration took = absl::Now() - since;
      if (took < collective_timeout * 0.9) {
        msg = absl::StrCat("a collective failed after ", absl::FormatDuration(absl::Trunc(took, absl::Milliseconds(1))),
                           ", before its ", absl::FormatDuration(collective_timeout),
                           " timeout (a peer's connection broke) [", s.message(), "]");
      }
    }
    return msg;
  };

  // Checkpoints. A failed save either leaves the ranks able to go on (an I/O
  // error, which SaveCheckpoint agrees on between the ranks) or not (a
  // collective failed or timed out: `fatal`). The message says what is on
  // disk: a checkpoint that rank 0 committed before a later collective failed
  // is reported as committed, not as failed.
  struct Saved {
    absl::Status status;
    bool fatal = false;
    bool committed = false;  // on disk and LATEST, although status is an error
  };
  int64_t last_saved = -1;
  auto save = [&](int64_t step) -> Saved {
    Saved out;
    if (step == last_saved) return out;
    FileSystem* fs = PosixFileSystem();
    const std::string expected = absl::StrCat(ckpt_dir, "/step-", step);
    auto before = ResolveCheckpoint(fs, ckpt_dir);
    const bool was_latest = before.ok() && *before == expected;
    CheckpointOptions co;
    co.user_metadata["data_position"] = std::to_string(step * batch * world);
    const absl::Time t0 = absl::Now();
    auto dir = SaveCheckpoint(*o, ckpt_dir, co);
    if (dir.ok()) {
      last_saved = step;
      const double took = absl::ToDoubleSeconds(absl::Now() - t0);
      int64_t bytes = 0;  // the whole checkpoint: every shard and the manifest
      if (auto files = fs->ListDir(*dir); files.ok()) {
        for (const std::string& name : *files) {
          if (auto size = fs->FileSize(absl::StrCat(*dir, "/", name)); size.ok()) bytes += static_cast<int64_t>(*size);
        }
      }
      {
        std::lock_guard<std::mutex> l(metrics.mu);
        ++metrics.checkpoints_total;
        metrics.last_checkpoint_step = step;
        metrics.last_checkpoint_seconds = took;
        metrics.last_checkpoint_bytes = bytes;
      }
      if (rank == 0) {
        std::printf("checkpoint %s written in %.2f s\n", dir->c_str(), absl::ToDoubleSeconds(absl::Now() - t0));
        if (ckpt_keep > 0) {
          absl::Status p = PruneCheckpoints(fs, ckpt_dir, static_cast<int>(ckpt_keep));
          if (!p.ok()) std::printf("pruning old checkpoints failed: %s\n", p.ToString().c_str());
        }
      }
      return out;
    }
    const absl::Status& s = dir.status();
    // A wait that timed out leaves its collective running on buffers that
    // are gone now: stop it. Then ask whether the ranks can still talk: an
    // error they agreed on leaves the communicator healthy, a broken
    // collective has aborted it (this fails at once then).
    if (s.code() == absl::StatusCode::kDeadlineExceeded) (*comm)->Abort(s);
    float probe = 0;
    absl::Status p = (*comm)->AllReduce(&probe, 1, ElementType::kFloat32, ReduceOp::kMax)->Wait(collective_timeout);
    if (!p.ok()) {
      (*comm)->Abort(p);
      out.fatal = true;
    }
    auto after = ResolveCheckpoint(fs, ckpt_dir);
    out.committed = !was_latest && after.ok() && *after == expected;
    const std::string cause = out.fatal ? why(s, t0) : s.ToString();
    if (out.committed) {
      last_saved = step;
      out.status = absl::Status(s.code(), absl::StrCat("checkpoint ", expected,
                                                       " was committed (LATEST names it), but a rank failed after the commit: ",
                                                       cause));
    } else {
      out.status = absl::Status(s.code(), absl::StrCat("checkpoint at step ", step, " failed: ", cause));
    }
    return out;
  };
  // A save during training: fatal failures end the job; otherwise training
  // goes on (and the rank that saw the error says so; rank 0 always does).
  auto save_during_training = [&](int64_t step) -> absl::Status {
    Saved sv = save(step);
    if (sv.status.ok() || sv.fatal) return sv.status;
    if (rank == 0 || !absl::StrContains(sv.status.message(), "on another rank")) {
      std::printf("%s (training continues)\n", std::string(sv.status.message()).c_str());
      std::fflush(stdout);
    }
    return absl::OkStatus();
  };

  int64_t applied_version = 0;
  int64_t done_request = 0;
  auto t_start = std::chrono::steady_clock::now();
  auto t_window = t_start;
  int64_t window_steps = 0;
  // Control actions (learning-rate changes, requested checkpoints) reach
  // ranks at different heartbeats, and a loss is known only to its rank: one
  // 12-byte all-reduce at the end of every step makes every rank act on them
  // at the same step, and stop together when any rank's loss is not finite.
  struct Agreed {
    int nonfinite_rank = -1;  // the highest rank whose loss was not finite
    bool checkpoint = false;  // a requested checkpoint is due
  };
  auto agree = [&](int64_t step, bool nonfinite_loss) -> absl::StatusOr<Agreed> {
    Agreed a;
    lr_applied = o->learning_rate();  // (a resumed run restores its own)
    float ctl[3] = {static_cast<float>(lr_version.load()), static_cast<float>(ckpt_request.load()),
                    nonfinite_loss ? static_cast<float>(rank + 1) : 0.0f};
    absl::Status s = (*comm)->AllReduce(ctl, 3, ElementType::kFloat32, ReduceOp::kMax)->Wait(collective_timeout);
    if (!s.ok()) {
      (*comm)->Abort(s);  // a timed-out collective still writes into ctl
      return s;
    }
    if (ctl[2] > 0) {
      a.nonfinite_rank = static_cast<int>(ctl[2]) - 1;
      return a;
    }
    if (static_cast<int64_t>(ctl[0]) > applied_version) {
      // The learning rate of the newest version, from a rank that has it.
      float lr_new = lr_version.load() == static_cast<int64_t>(ctl[0])
                         ? static_cast<float>(lr_wanted.load()) : 0.0f;
      s = (*comm)->AllReduce(&lr_new, 1, ElementType::kFloat32, ReduceOp::kMax)->Wait(collective_timeout);
      if (!s.ok()) {
        (*comm)->Abort(s);
        return s;
      }
      applied_version = static_cast<int64_t>(ctl[0]);
      if (std::isfinite(lr_new) && lr_new >= FLT_MIN) {
        o->SetLearningRate(lr_new);
        lr_applied = lr_new;
        if (rank == 0) std::printf("learning rate set to %g at step %lld\n", lr_new, static_cast<long long>(step));
      } else if (rank == 0) {
        std::printf("learning rate %g requested at step %lld: not a positive float, ignored\n",
                    lr_wanted.load(), static_cast<long long>(step));
      }
    }
    if (static_cast<int64_t>(ctl[1]) > done_request) {
      done_request = static_cast<int64_t>(ctl[1]);
      if (ckpt_dir.empty()) {
        if (rank == 0) std::printf("checkpoint requested, but no --ckpt-dir was given: skipped\n");
      } else {
        a.checkpoint = true;
      }
    }
    return a;
  };
  // Ends the job from this rank: tells the coordinator (which stops the
  // others at once and tells shardrun why), then exits 1.
  auto fail_job = [&](const std::string& msg) {
    (void)client.Abort(msg, rank);
    return finish(Fail(rank, msg));
  };
  for (int64_t step = first_step; step < steps; ++step) {
    if (rank == stall_rank && step == stall_step) {
      // Alive but silent in collectives: heartbeats continue until aborted.
      while (g_signal.load() == 0 && pushed_reason().empty()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      return finish(Fail(rank, "stalled on purpose (--debug-stall-rank)"));
    }
    const absl::Time step_start = absl::Now();
    if (rank == slow_rank && slow_ms > 0) {  // --debug-slow-rank: slower on purpose
      std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms));
    }
    recorder->set_step(step + 1);  // the step the next collectives belong to
    ++progress;
    o->ZeroGrad();
    torch::Tensor loss;
    try {
      loss = (*model)->Loss(step, rank * batch, (rank + 1) * batch);
      loss.backward();
    } catch (const std::exception& e) {  // c10::Error: e.g. out of memory
      std::string what = e.what();
      what = what.substr(0, what.find('\n'));
      return fail_job(absl::StrCat("step ", step + 1, " failed in forward/backward: ", what));
    }
    auto r = o->Step();
    if (!r.ok()) {
      const std::string msg = why(r.status(), step_start);
      (void)client.Abort(msg, rank);
      return finish(Fail(rank, absl::StrCat("step ", step + 1, " failed: ", msg)));
    }
    double l = loss.item<double>();
    if (rank == nan_rank && step + 1 == nan_step) l = std::nan("");  // --debug-nan-rank
    if (!std::isfinite(r->grad_norm)) {
      // The norm is global: every rank stops here, at the same step, before
      // anything is checkpointed.
      return fail_job(absl::StrCat("non-finite gradient norm (", Num(r->grad_norm), ") at step ", step + 1,
                                   " (loss ", Num(l), "); stopping (lower --lr)"));
    }
    ++progress;
    // The per-step agreement is a collective too: a rank that is slow after
    // Step() (logging, data) makes the others wait here, and that wait must
    // count as communication, not as their busy time (slow-rank detection).
    const absl::Time agree_start = absl::Now();
    auto agreed = agree(step + 1, !std::isfinite(l));
    const double agree_seconds = absl::ToDoubleSeconds(absl::Now() - agree_start);
    if (!agreed.ok()) {
      const std::string msg = why(agreed.status(), step_start);
      (void)client.Abort(msg, rank);
      return finish(Fail(rank, absl::StrCat("step ", step + 1, " failed: ", msg)));
    }
    if (agreed->nonfinite_rank >= 0) {
      return fail_job(!std::isfinite(l)
                          ? absl::StrCat("non-finite loss (", Num(l), ") at step ", step + 1, "; stopping (lower --lr)")
                          : absl::StrCat("rank ", agreed->nonfinite_rank, " had a non-finite loss at step ",
                                         step + 1, "; stopping"));
    }
    {
      std::lock_guard<std::mutex> l(metrics.mu);
      if (metrics.step_seconds.size() == kMaxStepTimes) metrics.step_seconds.erase(metrics.step_seconds.begin());
      metrics.step_seconds.push_back(absl::ToDoubleSeconds(absl::Now() - step_start));
      metrics.grad_norm = r->grad_norm;
      metrics.comm_wait_seconds = r->comm_wait_seconds + agree_seconds;
      metrics.update_seconds = r->update_seconds;
    }
    ++window_steps;
    step_now = step + 1;
    loss_now = l;
    const auto now = std::chrono::steady_clock::now();
    const double secs = std::chrono::duration<double>(now - t_window).count();
    if (secs > 0) sps_now = window_steps * batch / secs;
    const bool periodic = !ckpt_dir.empty() && ckpt_every > 0 && (step + 1) % ckpt_every == 0 && step + 1 < steps;
    if (agreed->checkpoint || periodic) {
      if (absl::Status s = save_during_training(step + 1); !s.ok()) return fail_job(std::string(s.message()));
    }
    if ((step + 1) % log_every == 0 || step + 1 == steps) {
      if (rank == 0) {
        const int width = 20;
        const int filled = static_cast<int>(width * (step + 1) / steps);
        std::printf("[%s%s] step %lld/%lld  loss %.5f  grad-norm %.4f  %.1f samples/s/rank\n",
                    std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(),
                    static_cast<long long>(step + 1), static_cast<long long>(steps), l,
                    r->grad_norm, sps_now.load());
        std::fflush(stdout);
      }
      t_window = now;
      window_steps = 0;
    }
  }
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  if (!ckpt_dir.empty() && first_step < steps) {
    Saved sv = save(steps);
    if (!sv.status.ok()) {
      return fail_job(sv.committed ? std::string(sv.status.message())
                                   : absl::StrCat(sv.status.message(), "; the final state is not saved"));
    }
  }
  (void)client.Finish(rank);
  if (rank == 0) {
    MemoryReport m = o->memory();
    std::printf("done: %lld steps in %.1f s; rank 0 holds optimizer state %.1f MiB (of %.1f MiB "
                "for the whole model), layout %016llx\n",
                static_cast<long long>(steps - first_step), total, m.state_bytes / 1048576.0,
                m.param_bytes / 1048576.0 * (opt.kind == OptimizerKind::kSgd ? 1 : 2),
                static_cast<unsigned long long>(o->layout().hash()));
  }
  return finish(0);
}

}  // namespace
}  // namespace shardopt

int main(int argc, char** argv) { return shardopt::Main(argc, argv); }
