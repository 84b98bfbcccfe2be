// shardopt_train: the main job. One rank of data-parallel training with
// ShardedOptimizer on synthetic data, its shard-owner gRPC service next to it,
// joined to the job's coordinator. Start it with shardrun.
#include <ATen/Parallel.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <array>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/checkpoint/torch_interop.h"
#include "client/comm/flight_recorder.h"
#include "client/comm/host_communicator.h"
#include "client/coordinator_client.h"
#include "client/launch_environment.h"
#include "tools/models/models.h"
#include "client/rank_agent.h"
#include "client/resize.h"
#include "client/advice.h"
#include "client/sharded_optimizer.h"
#include "client/host_allocator.h"
#include "common/file_system.h"
#include "common/malloc_tuning.h"
#include "server/hosted_coordinator.h"
#include "tools/cli/flags.h"

namespace shardopt {
namespace {

// An all-gather that failed while a layer waited for its parameters
// (overlap_param_gather), thrown out of the model's forward.
struct GatherFailure : std::runtime_error {
  explicit GatherFailure(absl::Status s)
      : std::runtime_error(std::string(s.message())), status(std::move(s)) {}
  absl::Status status;
};

constexpr char kUsage[] = R"(usage: shardopt_train [flags]

One rank of a data-parallel training job with ShardedOptimizer, on synthetic
data. Normally started by shardrun, which sets RANK, WORLD_SIZE, LOCAL_RANK and
SHARDOPT_COORDINATOR:

  shardrun --nproc 2 -- shardopt_train --model=mlp --steps=20

or by srun (every task one rank; rank 0 serves the coordinator on the step's
first node, see docs/slurm.md) or a Kubernetes Indexed Job (docs/kubernetes.md):

  srun -N2 --ntasks-per-node=2 shardopt_train --model=mlp --steps=20

flags (a malformed or out-of-range value is refused, naming the flag; exit status 2):
  --model=NAME         tiny | small | mlp | resnet101 (default tiny)
  --steps=N            optimizer steps, 1..100000000 (default 20)
  --lr=X               learning rate: > 0 and representable as a float,
                       1.17549e-38..3.40282e+38 (default 1e-4)
  --optimizer=NAME     adam | adamw | sgd (SGD uses momentum 0.9; default adam)
  --batch=N            samples per rank per step, 1..65536 (default: the model's)
  --clip=X             clip gradients to global L2 norm X, 0..1e+30 (default 0: off)
  --bucket-cap=N       bucket cap in elements, 1..2147483647 (default 6553600, 25 MiB of
                       fp32 as DDP's bucket; 2097152 with --shard-gradients=on)
  --threads=N          compute threads per rank, 1..256 (default 1)
  --malloc=MODE        tuned | default (default tuned: freed memory stays in the process,
                       LibTorch tensors of 1 MiB or more in their own mappings, reused
                       best-fit; default: glibc and LibTorch as they are; docs/performance.md, "Allocator")
  --overlap=on|off     on: Step() returns with the parameter all-gathers in flight and each
                       layer waits for its own before its forward (default on)
  --shard-gradients=on|off
                       on (ZeRO-2): each rank keeps only the reduced gradients of the slices
                       it owns (1/N of the gradient memory, plus staging for two buckets'
                       other-rank chunks or the largest tensor's; see shardctl memory)
                       (default off)
  --coordinator=H:P    coordinator address (default $SHARDOPT_COORDINATOR; under srun or an
                       Indexed Job without it: rank 0 serves one on $MASTER_ADDR (Slurm: the
                       step's first node) and port $SHARDOPT_PORT (Slurm: from the job and
                       step ids; Kubernetes: 29400), which every rank dials)
  --job-id=ID          job id (default $SHARDOPT_JOB_ID, else Slurm's job id, else "job")
  --token-file=PATH    bearer token for the control plane (default $SHARDOPT_TOKEN_FILE)
  --bind=HOST          address for this rank's shard-owner service and Gloo (default
                       $SHARDOPT_BIND, else the Slurm node's name, else the pod's $HOSTNAME
                       under Kubernetes, else 127.0.0.1)
  --transport=auto|gloo|shm
                       how gradients and parameters move between ranks: shm (shared memory,
                       every rank on this host), gloo (TCP, any hosts) or auto: shm when every
                       rank is on one host, else gloo (default $SHARDOPT_TRANSPORT or auto)
  --tls-ca=PEM         TLS to the coordinator, verified against this CA (default $SHARDOPT_TLS_CA)
  --tls-cert=PEM       client certificate for mutual TLS (default $SHARDOPT_TLS_CERT)
  --tls-key=PEM        its key (default $SHARDOPT_TLS_KEY)
  --log-every=N        progress line every N steps, 1..100000000 (default: about 10 lines per run)
  --advise             measure the link at start and, after 4 steps, print (rank 0) what the
                       partition advisor predicts for this run against DDP and OSS, and its
                       recommendation (docs/advisor.md)
  --ckpt-dir=DIR       write sharded checkpoints under DIR (step-N/, LATEST)
  --ckpt-every=K       ... every K steps, 0..100000000 (default 0: only at the end;
                       needs --ckpt-dir)
  --ckpt-keep=N        keep only the newest N checkpoints, 0..1000000 (default 0: keep all;
                       needs --ckpt-dir)
  --resume=PATH        (started again by shardrun --max-restarts, i.e. $SHARDOPT_RESTART > 0:
                       --ckpt-dir when it holds a checkpoint) resume from a checkpoint directory, a root with LATEST, a consolidated
                       .safetensors file or a torch.save file (.pt, see shardctl import); the
                       saved step and hyper-parameters are restored (an explicit --lr wins),
                       at any world size; training continues at the saved step
  --collective-timeout=S  bound on every collective wait (steps, the per-step agreement,
                       checkpoints), seconds in [0.1, 86400] (default 120)
  --on-sigterm=stop|drain  what a SIGTERM to this rank does: stop the job (default; shardrun
                       and scancel send it to every rank), or drain this rank: it asks for a live
                       resize without it, hands its optimizer state over at the next step
                       boundary and exits 0 (docs/elastic.md); a second signal stops the job
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

Environment: RANK in [0, WORLD_SIZE), WORLD_SIZE in [1, 1048576] (defaults 0 and 1); or
Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_STEP_NODELIST, ... of an srun step) or a
Kubernetes Indexed Job's (JOB_COMPLETION_INDEX with WORLD_SIZE). The coordinator that
rank 0 serves fails a rank silent for $SHARDOPT_HEARTBEAT_TIMEOUT seconds (default 10).

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
constexpr double kMaxTimeoutSeconds = 86400;

// Set by SIGTERM/SIGINT; the rank agent's heartbeat thread turns it into an
// abort.
std::atomic<int> g_signal{0};
// --on-sigterm=drain: the first SIGTERM asks for this rank's drain (1; 2
// once the training loop has acted on it) instead of stopping the job.
std::atomic<bool> g_drain_on_sigterm{false};
std::atomic<int> g_drain{0};
void OnSignal(int sig) {
  if (sig == SIGTERM && g_drain_on_sigterm.load() && g_drain.load() == 0) {
    g_drain = 1;
  } else {
    g_signal = sig;
  }
}

// A failure before the rank agent runs (which reports later ones).
int Fail(int rank, const std::string& msg) {
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

// Every flag and environment variable, checked.
struct Config {
  int world = 1, rank = 0;
  LaunchEnvironment launch;  // who this process is, from its launcher's variables
  Rendezvous rendezvous;     // where the coordinator is, and whether this process serves it
  bool host_coordinator = false;
  int restart = 0;  // $SHARDOPT_RESTART: how many times shardrun restarted the job
  // The membership epoch (a live resize moves the job to the next); a rank
  // that shardrun started to grow the job joins epoch $SHARDOPT_JOIN_EPOCH.
  int64_t epoch = 0;
  int64_t join_epoch = 0;
  int64_t replicate_every = 0;    // $SHARDOPT_REPLICATE_EVERY (shardrun --replicate-shards)
  bool drain_on_sigterm = false;  // --on-sigterm=drain
  absl::Duration heartbeat_timeout = absl::Seconds(10);  // the served coordinator's
  std::string model_name, kind, coordinator, job_id, bind, ckpt_dir, resume, token;
  CpuTransport transport = CpuTransport::kAuto;
  ClientTls tls;
  int64_t steps = 0, batch_flag = 0, bucket_cap = 0, threads = 1, log_every = 1;
  int64_t ckpt_every = 0, ckpt_keep = 0;
  double lr = 0, clip = 0;
  bool has_lr = false, has_batch = false, overlap = true, shard_gradients = false;
  bool advise = false;  // --advise: the partition advisor's line for this run
  absl::Duration collective_timeout;
  int64_t stall_rank = -1, stall_step = -1, nan_rank = -1, nan_step = -1, slow_rank = -1,
          slow_ms = 0;
  MallocMode malloc_mode;
};

// ReadConfig's parts, in its order: each reads its flags into *c, the first
// bad value landing in *bad. This one: WORLD_SIZE and RANK, then the model,
// the optimizer and its buckets.
void ReadTrainingFlags(const Flags& flags, Config* c, absl::Status* bad) {
  c->launch = Take(ReadLaunchEnvironment(), bad);
  c->world = c->launch.world_size;
  c->rank = c->launch.rank;
  c->model_name = Take(flags.Choice("model", "tiny", {"tiny", "small", "mlp", "resnet101"}), bad);
  c->steps = Take(flags.Int("steps", 20, 1, kMaxSteps), bad);
  c->lr = Take(flags.HyperParam("lr", HyperParameter::kLearningRate, 1e-4), bad);
  c->has_lr = flags.Has("lr");
  c->kind = Take(flags.Choice("optimizer", "adam", {"adam", "adamw", "sgd"}), bad);
  c->batch_flag = Take(flags.Int("batch", 0, 1, kMaxBatch), bad);
  c->has_batch = flags.Has("batch");
  c->clip = Take(flags.HyperParam("clip", HyperParameter::kMaxGradNorm, 0), bad);
  c->shard_gradients = Take(flags.Choice("shard-gradients", "off", {"on", "off"}), bad) == "on";
  c->bucket_cap =
      Take(flags.Int("bucket-cap", c->shard_gradients ? 2 * 1024 * 1024 : 25 * 1024 * 1024 / 4, 1,
                     kMaxBucketCap),
           bad);
  c->threads = Take(flags.Int("threads", 1, 1, kMaxThreads), bad);
}

// --transport (or $SHARDOPT_TRANSPORT) and the TLS files.
void ReadTransportFlags(const Flags& flags, Config* c, absl::Status* bad) {
  {
    auto t = ParseCpuTransport(Take(
        flags.Choice("transport", EnvStr("SHARDOPT_TRANSPORT", "auto"), {"auto", "gloo", "shm"}),
        bad));
    if (t.ok()) {
      c->transport = *t;
    } else if (bad->ok()) {
      *bad =
          absl::InvalidArgumentError(absl::StrCat("$SHARDOPT_TRANSPORT: ", t.status().message()));
    }
  }
  c->tls.ca_file = Take(flags.NonEmpty("tls-ca", EnvStr("SHARDOPT_TLS_CA", "")), bad);
  c->tls.cert_file = Take(flags.NonEmpty("tls-cert", EnvStr("SHARDOPT_TLS_CERT", "")), bad);
  c->tls.key_file = Take(flags.NonEmpty("tls-key", EnvStr("SHARDOPT_TLS_KEY", "")), bad);
}

// Logging, checkpoints, --resume, the collective timeout and the --debug-* flags.
void ReadRunFlags(const Flags& flags, Config* c, absl::Status* bad) {
  c->log_every =
      Take(flags.Int("log-every", std::max<int64_t>(1, c->steps / 10), 1, kMaxSteps), bad);
  c->ckpt_dir = Take(flags.NonEmpty("ckpt-dir", ""), bad);
  c->ckpt_every = Take(flags.Int("ckpt-every", 0, 0, kMaxSteps), bad);
  c->ckpt_keep = Take(flags.Int("ckpt-keep", 0, 0, kMaxCkptKeep), bad);
  c->resume = Take(flags.NonEmpty("resume", ""), bad);
  c->collective_timeout =
      Take(flags.Seconds("collective-timeout", 120, 0.1, kMaxTimeoutSeconds), bad);
  c->stall_rank = Take(flags.Int("debug-stall-rank", -1, -1, c->world - 1), bad);
  c->stall_step = Take(flags.Int("debug-stall-step", -1, -1, kMaxSteps), bad);
  c->nan_rank = Take(flags.Int("debug-nan-rank", -1, -1, c->world - 1), bad);
  c->nan_step = Take(flags.Int("debug-nan-step", -1, -1, kMaxSteps), bad);
  c->slow_rank = Take(flags.Int("debug-slow-rank", -1, -1, c->world - 1), bad);
  c->slow_ms = Take(flags.Int("debug-slow-ms", 0, 0, 60000), bad);
  c->drain_on_sigterm = Take(flags.Choice("on-sigterm", "stop", {"stop", "drain"}), bad) == "drain";
}

// Reads every flag and variable into *c; the first bad one is returned.
absl::Status ReadConfig(const Flags& flags, Config* c) {
  absl::Status bad;
  ReadTrainingFlags(flags, c, &bad);
  const std::string malloc_flag = Take(flags.Choice("malloc", "tuned", {"tuned", "default"}), &bad);
  c->overlap = Take(flags.Choice("overlap", "on", {"on", "off"}), &bad) == "on";
  c->advise = Take(flags.Bool("advise", false), &bad);
  if (bad.ok()) c->rendezvous = Take(PlanRendezvous(c->launch), &bad);
  c->coordinator = Take(flags.NonEmpty("coordinator", c->rendezvous.coordinator), &bad);
  c->host_coordinator = c->rendezvous.host_coordinator && !flags.Has("coordinator");
  c->job_id = Take(flags.NonEmpty("job-id", c->rendezvous.job_id), &bad);
  const std::string token_file =
      Take(flags.NonEmpty("token-file", EnvStr("SHARDOPT_TOKEN_FILE", "")), &bad);
  c->bind = Take(flags.NonEmpty("bind", c->rendezvous.bind), &bad);
  {
    auto hb = EnvDouble("SHARDOPT_HEARTBEAT_TIMEOUT", 10, 0.1, 86400);
    if (hb.ok()) {
      c->heartbeat_timeout = absl::Seconds(*hb);
    } else if (bad.ok()) {
      bad = hb.status();
    }
  }
  ReadTransportFlags(flags, c, &bad);
  ReadRunFlags(flags, c, &bad);
  if (!bad.ok()) return bad;
  // Started again by shardrun --max-restarts: continue from the last
  // complete checkpoint of --ckpt-dir, if there is one.
  c->restart = static_cast<int>(Take(EnvInt("SHARDOPT_RESTART", 0, 0, 1000), &bad));
  c->join_epoch = Take(EnvInt("SHARDOPT_JOIN_EPOCH", 0, 0, kMaxSteps), &bad);
  // shardrun --replicate-shards=K: in-memory replicas every K steps.
  c->replicate_every = Take(EnvInt("SHARDOPT_REPLICATE_EVERY", 0, 0, kMaxSteps), &bad);
  if (!bad.ok()) return bad;
  if (c->join_epoch > 0 && !c->resume.empty()) {
    return absl::InvalidArgumentError(
        "a rank joining a running job ($SHARDOPT_JOIN_EPOCH) takes its state from the job, not "
        "from --resume");
  }
  c->epoch = c->join_epoch;
  if (c->restart > 0 && c->resume.empty() && !c->ckpt_dir.empty() &&
      PosixFileSystem()->FileSize(c->ckpt_dir + "/LATEST").ok()) {
    c->resume = c->ckpt_dir;
  }
  if (c->ckpt_dir.empty() && (c->ckpt_every > 0 || c->ckpt_keep > 0)) {
    return absl::InvalidArgumentError("--ckpt-every and --ckpt-keep need --ckpt-dir");
  }
  if (c->coordinator.empty()) {
    return absl::InvalidArgumentError(
        "no coordinator: run under shardrun, srun or a Kubernetes Indexed Job, or pass "
        "--coordinator=HOST:PORT");
  }
  if (!token_file.empty()) {
    auto t = ReadTokenFile(token_file);
    if (!t.ok()) return t.status();
    c->token = *t;
  }
  return ParseMallocMode(malloc_flag, &c->malloc_mode);
}

// Parses argv into *c. Returns -1 to go on, else the exit status (0:
// --help; 2: a bad flag or environment variable, refused by name, never
// replaced by its default).
int ParseConfig(int argc, char** argv, Config* c) {
  auto flags = Flags::Parse(argc, argv,
                            {"model",
                             "steps",
                             "lr",
                             "optimizer",
                             "batch",
                             "clip",
                             "bucket-cap",
                             "threads",
                             "malloc",
                             "overlap",
                             "shard-gradients",
                             "coordinator",
                             "job-id",
                             "token-file",
                             "bind",
                             "transport",
                             "log-every",
                             "advise",
                             "tls-ca",
                             "tls-cert",
                             "tls-key",
                             "ckpt-dir",
                             "ckpt-every",
                             "resume",
                             "ckpt-keep",
                             "collective-timeout",
                             "debug-stall-rank",
                             "debug-stall-step",
                             "debug-nan-rank",
                             "debug-nan-step",
                             "debug-slow-rank",
                             "debug-slow-ms",
                             "on-sigterm",
                             "help"},
                            {"help", "advise"});
  if (!flags.ok()) return UsageError(flags.status().message());
  if (flags->Has("help")) {
    std::printf("%s", kUsage);
    return 0;
  }
  if (!flags->positional().empty() || !flags->rest().empty()) {
    const std::string& extra =
        flags->positional().empty() ? flags->rest().front() : flags->positional().front();
    return UsageError(
        absl::StrCat("unexpected argument '", extra, "' (flags are --name=value; see --help)"));
  }
  if (absl::Status s = ReadConfig(*flags, c); !s.ok()) return UsageError(s.message());
  return -1;
}

ShardedOptimizerOptions OptimizerOptions(const Config& c) {
  ShardedOptimizerOptions opt;
  if (c.kind == "adam") {
    opt.kind = OptimizerKind::kAdam;
  } else if (c.kind == "adamw") {
    opt.kind = OptimizerKind::kAdamW;
    opt.adam = AdamWConfig();
  } else {
    opt.kind = OptimizerKind::kSgd;
    opt.sgd.momentum = 0.9;
  }
  opt.adam.lr = c.lr;
  opt.sgd.lr = c.lr;
  opt.max_grad_norm = c.clip;
  opt.plan.bucket_cap_elements = c.bucket_cap;
  opt.timeout = c.collective_timeout;
  opt.overlap_param_gather = c.overlap;
  opt.shard_gradients = c.shard_gradients;
  return opt;
}

RankAgentOptions AgentOptions(const Config& c, int64_t batch) {
  RankAgentOptions a;
  a.job_id = c.job_id;
  a.rank = c.rank;
  a.host = c.bind;
  a.device = "cpu";
  a.token = c.token;
  a.collective_timeout = c.collective_timeout;
  a.ckpt_dir = c.ckpt_dir;
  a.ckpt_keep = static_cast<int>(c.ckpt_keep);
  a.samples_per_step = batch * c.world;
  a.epoch = c.epoch;
  a.elastic = true;  // this trainer makes live resizes (ResizeLive)
  a.stop_signal = [] { return g_signal.load(); };
  a.log_name = "shardopt_train";
  if (c.rendezvous.served_by_rank0 && c.coordinator == c.rendezvous.coordinator) {
    a.coordinator_rank = 0;
    a.coordinator_address = c.coordinator;
  }
  return a;
}

// The communicator: shared memory or Gloo (--transport), rendezvous through
// the coordinator's key-value store, every collective through the flight
// recorder (docs/observability.md, "Flight recorder").
absl::StatusOr<std::unique_ptr<Communicator>> Connect(const Config& c, CoordinatorClient* client) {
  GrpcKeyValueStore kv(client);
  // Each membership epoch rendezvouses afresh.
  PrefixKeyValueStore job_kv(&kv,
                             c.epoch > 0 ? absl::StrCat(c.job_id, "/epoch-", c.epoch) : c.job_id);
  CpuCommOptions copt;
  copt.transport = c.transport;
  copt.hostname = c.bind;
  copt.timeout = c.collective_timeout;
  auto comm = CreateCpuCommunicator(&job_kv, c.rank, c.world, copt);
  if (!comm.ok()) return comm.status();
  if (c.rank == 0 && c.world > 1) {
    std::printf("shardopt_train: transport %s%s\n", CpuTransportName(comm->transport),
                c.transport != CpuTransport::kAuto      ? ""
                : comm->transport == CpuTransport::kShm ? " (auto: every rank on this host)"
                : !comm->fallback_reason.empty()
                    ? absl::StrCat(" (auto: ", comm->fallback_reason, ")").c_str()
                    : " (auto: ranks on several hosts)");
    std::fflush(stdout);
  }
  return std::unique_ptr<Communicator>(std::make_unique<FlightRecordingCommunicator>(
      std::move(comm->comm), std::make_shared<FlightRecorder>()));
}

// --resume: a checkpoint directory or root, a consolidated .safetensors file,
// or a torch.save file (shardctl consolidate --format=torch, or PyTorch's
// own). The saved hyper-parameters are in force then; an explicit --lr wins.
// Returns the first step to run.
absl::StatusOr<int64_t> Resume(const Config& c, ShardedOptimizer* o) {
  const auto t0 = std::chrono::steady_clock::now();
  auto m = LoadAnyCheckpoint(*o, c.resume);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!m.ok()) return m.status();
  std::string lr_note = absl::StrFormat("lr %g as saved", m->optimizer.lr);
  if (c.has_lr && c.lr != m->optimizer.lr) {
    if (absl::Status s = o->SetLearningRate(c.lr); !s.ok()) return s;
    lr_note = absl::StrFormat("lr %g from --lr (the checkpoint saved %g)", c.lr, m->optimizer.lr);
  }
  if (c.rank == 0) {
    const std::string by = m->world_size > 0 ? absl::StrCat("saved by ", m->world_size, " ranks")
                                             : std::string("consolidated");
    std::printf("resumed from %s (%s, %s) at step %lld, %s; read in %.2f s\n", m->path.c_str(),
                m->format.c_str(), by.c_str(), static_cast<long long>(m->step), lr_note.c_str(),
                secs);
  }
  return m->step;
}

// Rank 0's progress line after step `step` of `steps`.
void PrintProgress(int64_t step, int64_t steps, double loss, double grad_norm,
                   double samples_per_s) {
  const int width = 20;
  const int filled = static_cast<int>(width * step / steps);
  std::printf("[%s%s] step %lld/%lld  loss %.5f  grad-norm %.4f  %.1f samples/s/rank\n",
              std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(),
              static_cast<long long>(step), static_cast<long long>(steps), loss, grad_norm,
              samples_per_s);
  std::fflush(stdout);
}

// --debug-stall-rank: alive but silent in collectives, heartbeats continue
// until aborted. Returns the exit status (the agent has reported the failure).
int StallOnPurpose(RankAgent* agent) {
  while (g_signal.load() == 0 && agent->abort_reason().empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return agent->Fail("stalled on purpose (--debug-stall-rank)", "");
}

// The forward and backward passes of step `step` (0-based) on this rank's
// samples, the loss into *loss. A collective's failure (a layer waiting for
// its parameters' all-gather: a peer's death seen first there) is returned
// as it is; any other error (c10::Error: e.g. out of memory) as Internal.
absl::Status ForwardBackward(const Config& c, TrainModel& model, int64_t batch, int64_t step,
                             torch::Tensor* loss) {
  try {
    *loss = model.Loss(step, c.rank * batch, (c.rank + 1) * batch);
    loss->backward();
  } catch (const GatherFailure& e) {
    return e.status;
  } catch (const std::exception& e) {
    std::string what = e.what();
    return absl::InternalError(
        absl::StrCat("in forward/backward: ", what.substr(0, what.find('\n'))));
  }
  return absl::OkStatus();
}

// After the update of step `step` (0-based), with loss `l`: a non-finite
// global gradient norm or any rank's non-finite loss stops every rank.
// Returns -1 to go on, else the exit status (the agent has reported it).
int CheckFinite(RankAgent* agent, int64_t step, double l, double grad_norm, int nonfinite_rank) {
  if (!std::isfinite(grad_norm)) {
    // The norm is global: every rank stops here, at the same step, before
    // anything is checkpointed.
    return agent->Fail(absl::StrCat("non-finite gradient norm (", Num(grad_norm), ") at step ",
                                    step + 1, " (loss ", Num(l), "); stopping (lower --lr)"));
  }
  if (nonfinite_rank >= 0) {
    return agent->Fail(!std::isfinite(l) ? absl::StrCat("non-finite loss (", Num(l), ") at step ",
                                                        step + 1, "; stopping (lower --lr)")
                                         : absl::StrCat("rank ", nonfinite_rank,
                                                        " had a non-finite loss at step ", step + 1,
                                                        "; stopping"));
  }
  return -1;
}

// The training loop: steps [first_step, c.steps). Returns -1 when every step
// ran, else the exit status (the agent has reported the failure).
// --advise: the link measured at start, and the run's measured steps.
struct Advice {
  advisor::Link link;
  int64_t at_step = -1;                      // print after this step (0-based); -1: off
  double fwd_bwd_s = 1e30, update_s = 1e30;  // the fastest step's
};

// This rank's part of the job in one membership epoch: its communicator,
// optimizer and agent (a live resize replaces all three).
struct Trainer {
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<ShardedOptimizer> opt;
  std::unique_ptr<RankAgent> agent;
  ~Trainer() {  // the agent uses the optimizer, which uses the communicator
    agent.reset();
    opt.reset();
    comm.reset();
  }
};

// TrainLoop's result for a rank that left the job in a live resize.
constexpr int kLeftTheJob = -2;

// --replicate-shards (shardrun's; $SHARDOPT_REPLICATE_EVERY): what the
// refreshes of the in-memory replicas cost, for rank 0's lines.
struct RefreshStats {
  int64_t count = 0;
  double seconds = 0;
  int64_t epoch_reported = -1;
};
RefreshStats g_refresh;

// After a refresh of the replicas at `step` (started at t0): counted; rank 0
// says what they hold, once per membership epoch.
void RecordRefresh(const Config& c, ReplicaStore* replicas, int64_t step,
                   std::chrono::steady_clock::time_point t0) {
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ++g_refresh.count;
  g_refresh.seconds += secs;
  if (c.rank == 0 && g_refresh.epoch_reported != c.epoch) {
    g_refresh.epoch_reported = c.epoch;
    std::printf(
        "shardopt_train: replicas of step %lld in memory, refreshed every %lld steps: rank 0 "
        "holds %.1f MiB (its own state and rank 1's), refreshed in %.3f s\n",
        static_cast<long long>(step), static_cast<long long>(c.replicate_every),
        replicas->bytes() / 1048576.0, secs);
    std::fflush(stdout);
  }
}

int ResizeLive(Config& c, TrainModel& model, int64_t batch, CoordinatorClient* client, Trainer* t,
               const ResizeOrder& order, int64_t step);
int RecoverFromReplicas(Config& c, TrainModel& model, int64_t batch, CoordinatorClient* client,
                        Trainer* t, ReplicaStore* replicas, const ResizeOrder& order,
                        int64_t reached, int64_t* resume_at);

// --on-sigterm=drain, after a SIGTERM: asks for a live resize without this
// rank; when that is refused (one rank left, a resize under way, a job that
// failed or cannot resize) the signal stops the job as without the flag.
void RequestDrain(const Config& c, CoordinatorClient* client) {
  g_drain = 2;
  auto job = client->GetJob();
  absl::Status s = job.status();
  if (s.ok() && job->state() != "running") {
    s = absl::FailedPreconditionError(absl::StrCat("the job is ", job->state()));
  } else if (s.ok() && job->world_size() < 2) {
    s = absl::FailedPreconditionError("it is the job's only rank");
  }
  if (s.ok()) s = client->Resize(job->world_size() - 1, {c.rank}).status();
  if (!s.ok()) {
    std::fprintf(stderr,
                 "shardopt_train[rank %d]: SIGTERM: cannot drain this rank (%s); stopping\n",
                 c.rank, std::string(s.message()).c_str());
    g_signal = SIGTERM;
    return;
  }
  std::printf(
      "shardopt_train: rank %d got SIGTERM: it leaves the job at the next step boundary "
      "(--on-sigterm=drain)\n",
      c.rank);
  std::fflush(stdout);
}

int TrainLoop(Config& c, TrainModel& model, int64_t batch, CoordinatorClient* client, Trainer* t,
              int64_t first_step, Advice* advice, ReplicaStore* replicas) {
  auto t_window = std::chrono::steady_clock::now();
  int64_t window_steps = 0;
  // A collective of step `step` failed with `s`: a rank was lost and the job
  // recovers from the replicas (--replicate-shards; -1 then, and
  // *resume_at is the step it goes on from), or this rank fails (the exit
  // status).
  auto failed = [&](const absl::Status& s, int64_t step, int64_t* resume_at) -> int {
    if (replicas != nullptr) {
      // (The notice may come a moment after a peer's death broke a collective.)
      if (auto order = t->agent->AwaitRecovery(absl::Seconds(3))) {
        return RecoverFromReplicas(c, model, batch, client, t, replicas, *order, step + 1,
                                   resume_at);
      }
    }
    const std::string msg = t->agent->Diagnose(s);
    return t->agent->Fail(absl::StrCat("step ", step + 1, " failed: ", msg), msg);
  };
  for (int64_t step = first_step; step < c.steps; ++step) {
    ShardedOptimizer* o = t->opt.get();
    RankAgent* agent = t->agent.get();
    int64_t resume_at = 0;
    // After a recovery: on from the step of the replicas (the loop adds 1).
#define SHARDOPT_ON_FAILURE(status)                                     \
  if (int rc = failed((status), step, &resume_at); rc != -1) return rc; \
  step = resume_at - 1;                                                 \
  t_window = std::chrono::steady_clock::now();                          \
  window_steps = 0;                                                     \
  continue
    if (g_drain.load() == 1) RequestDrain(c, client);
    if (c.rank == c.stall_rank && step == c.stall_step) return StallOnPurpose(agent);
    agent->BeforeStep(step + 1);
    if (c.rank == c.slow_rank && c.slow_ms > 0) {  // --debug-slow-rank: slower on purpose
      std::this_thread::sleep_for(std::chrono::milliseconds(c.slow_ms));
    }
    o->ZeroGrad();
    torch::Tensor loss;
    const auto t_fb = std::chrono::steady_clock::now();
    if (absl::Status s = ForwardBackward(c, model, batch, step, &loss); !s.ok()) {
      SHARDOPT_ON_FAILURE(s);
    }
    const double fb_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t_fb).count();
    double l = loss.item<double>();
    if (c.rank == c.nan_rank && step + 1 == c.nan_step) l = std::nan("");  // --debug-nan-rank
    // Control actions and non-finite losses are agreed before the update, so
    // the agreement's all-reduce does not wait behind the step's all-gathers
    // (which overlap the next forward).
    auto agreed = agent->AgreeBeforeUpdate(step + 1, l);
    if (!agreed.ok()) {
      SHARDOPT_ON_FAILURE(agreed.status());
    }
    auto r = o->Step();
    if (!r.ok()) {
      SHARDOPT_ON_FAILURE(r.status());
    }
    if (int rc = CheckFinite(agent, step, l, r->grad_norm, agreed->nonfinite_rank); rc >= 0) {
      return rc;
    }
    agent->FinishStep(step + 1, *r, l);
    if (step > first_step && step <= advice->at_step) {  // (the first step warms up)
      advice->fwd_bwd_s = std::min(advice->fwd_bwd_s, fb_s);
      advice->update_s = std::min(advice->update_s, r->update_seconds);
    }
    if (step == advice->at_step && c.rank == 0) {
      auto lines = AdviceLines(*o, advice->link, advice->fwd_bwd_s, advice->update_s);
      std::printf("%s\n", lines.ok() ? lines->c_str()
                                     : absl::StrCat("advisor: ", lines.status().message()).c_str());
      std::fflush(stdout);
    }
    ++window_steps;
    const auto now = std::chrono::steady_clock::now();
    const double secs = std::chrono::duration<double>(now - t_window).count();
    double sps = 0;
    if (secs > 0) agent->SetSamplesPerSecond(sps = window_steps * batch / secs);
    const bool periodic = !c.ckpt_dir.empty() && c.ckpt_every > 0 &&
                          (step + 1) % c.ckpt_every == 0 && step + 1 < c.steps;
    if (agreed->checkpoint || periodic) {
      if (absl::Status s = agent->CheckpointDuringTraining(step + 1); !s.ok()) {
        if (replicas != nullptr && agent->AwaitRecovery(absl::ZeroDuration())) {
          SHARDOPT_ON_FAILURE(s);
        }
        return agent->Fail(std::string(s.message()));
      }
    }
    if (replicas != nullptr && (step + 1) % c.replicate_every == 0 && step + 1 < c.steps) {
      const auto t0 = std::chrono::steady_clock::now();
      if (absl::Status s = replicas->Refresh(*o, client, c.epoch, agent->Context(step + 1),
                                             c.collective_timeout);
          !s.ok()) {
        SHARDOPT_ON_FAILURE(s);
      }
      RecordRefresh(c, replicas, step + 1, t0);
    }
    if ((step + 1) % c.log_every == 0 || step + 1 == c.steps) {
      if (c.rank == 0) PrintProgress(step + 1, c.steps, l, r->grad_norm, sps);
      t_window = now;
      window_steps = 0;
    }
    if (agreed->resize && step + 1 < c.steps) {
      if (int rc = ResizeLive(c, model, batch, client, t, *agreed->resize, step + 1); rc != -1) {
        return rc;
      }
      t_window = std::chrono::steady_clock::now();
      window_steps = 0;
    }
#undef SHARDOPT_ON_FAILURE
  }
  return -1;
}

// After the last step: the final checkpoint, Finish, and rank 0's summary.
int Conclude(const Config& c, ShardedOptimizer* o, RankAgent* agent, int64_t first_step,
             double seconds) {
  if (!c.ckpt_dir.empty() && first_step < c.steps) {
    CheckpointOutcome sv = agent->Checkpoint(c.steps);
    if (!sv.status.ok()) {
      return agent->Fail(sv.committed
                             ? std::string(sv.status.message())
                             : absl::StrCat(sv.status.message(), "; the final state is not saved"));
    }
  }
  agent->Finish();
  if (c.rank == 0) {
    MemoryReport m = o->memory();
    std::printf(
        "done: %lld steps in %.1f s; rank 0 holds optimizer state %.1f MiB (of %.1f MiB "
        "for the whole model), layout %016llx\n",
        static_cast<long long>(c.steps - first_step), seconds, m.state_bytes / 1048576.0,
        m.param_bytes / 1048576.0 * (o->options().kind == OptimizerKind::kSgd ? 1 : 2),
        static_cast<unsigned long long>(o->layout().hash()));
    if (g_refresh.count > 0) {
      std::printf("replicas: refreshed %lld times, %.4f s each on average\n",
                  static_cast<long long>(g_refresh.count), g_refresh.seconds / g_refresh.count);
    }
  }
  return 0;
}

// This rank's communicator, optimizer and agent for the epoch in c (the
// agent's Join waits for every rank of it). `context`: the step it starts
// from and the control requests acted on before (a live resize). The
// model's layers wait for the parameters of `current`'s optimizer (the
// trainer that `t` becomes). Returns -1 when formed, else the exit status
// (the failure is reported).
int FormEpoch(const Config& c, TrainModel& model, int64_t batch, CoordinatorClient* client,
              const ResizeContext& context, Trainer* t, Trainer* current) {
  auto comm = Connect(c, client);
  if (!comm.ok()) {
    (void)client->Abort(comm.status().ToString(), c.rank);
    return Fail(c.rank, comm.status().ToString());
  }
  t->comm = *std::move(comm);
  ShardedOptimizerOptions options = OptimizerOptions(c);
  // In a resize every parameter is restored from its owner right after.
  options.broadcast_initial_values = c.epoch == 0;
  auto optimizer = ShardedOptimizer::Create(model.NamedParameters(), options, t->comm.get());
  if (!optimizer.ok()) {
    (void)client->Abort(optimizer.status().ToString(), c.rank);
    return Fail(c.rank, optimizer.status().ToString());
  }
  t->opt = *std::move(optimizer);
  if (c.overlap) {
    // Each layer waits for its own parameters' all-gather (started by the
    // previous Step()) just before its forward; the optimizer is the
    // current epoch's.
    model.set_layer_gate([current](torch::nn::Module& layer) {
      absl::Status s = current->opt->WaitForParameters(layer);
      if (!s.ok()) throw GatherFailure(std::move(s));
    });
  }
  RankAgentOptions a = AgentOptions(c, batch);
  a.start_step = context.step;
  a.checkpoint_requests_done = context.checkpoint_requests_done;
  a.lr_versions_done = context.lr_versions_done;
  a.resize_requests_done = context.resize_requests_done;
  auto agent = RankAgent::Start(client, t->opt.get(), std::move(a));
  if (!agent.ok()) return Fail(c.rank, agent.status().ToString());
  t->agent = *std::move(agent);
  return -1;
}

// A live resize agreed after step `step` (docs/elastic.md): this rank's
// state is snapshotted in memory; a rank that leaves waits until the new
// epoch has loaded it and returns kLeftTheJob; the others form the new
// epoch (communicator, optimizer, agent), load what they now own from the
// snapshots and return -1 to train on. Else the exit status.
int ResizeLive(Config& c, TrainModel& model, int64_t batch, CoordinatorClient* client, Trainer* t,
               const ResizeOrder& order, int64_t step) {
  const auto t0 = std::chrono::steady_clock::now();
  const int old_rank = c.rank, new_rank = order.NewRank(c.rank);
  const ResizeContext context = t->agent->Context(step);
  auto snap = StateSnapshot::Take(*t->opt, client, order, context, c.bind, c.token);
  if (!snap.ok()) {
    const std::string msg = t->agent->Diagnose(snap.status());
    return t->agent->Fail(absl::StrCat("resizing to ", order.to_world, " ranks failed: ", msg),
                          msg);
  }
  auto since = [&t0] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  const double t_snapshot = since();
  // The old epoch ends here for this rank (its agent leaves without Finish).
  t->agent->Stop();
  auto failed = [&](const std::string& what, const absl::Status& s) {
    const std::string msg =
        absl::StrCat("resizing to ", order.to_world, " ranks failed: ", what, ": ", s.message());
    (void)client->Abort(msg, c.rank);
    return Fail(c.rank, msg);
  };
  if (new_rank < 0) {
    std::printf(
        "shardopt_train: rank %d leaves the job after step %lld; its state (%.1f MiB) "
        "waits for the remaining ranks\n",
        old_rank, static_cast<long long>(step), (*snap)->bytes() / 1048576.0);
    std::fflush(stdout);
    absl::Status s = AwaitHandOver(client, order.epoch, c.collective_timeout);
    if (!s.ok()) return failed("waiting for the remaining ranks to take its state", s);
    std::printf("shardopt_train: rank %d left: %.1f MiB of its state was read by the others\n",
                old_rank, (*snap)->bytes_served() / 1048576.0);
    std::fflush(stdout);
    return kLeftTheJob;
  }
  const Layout old_layout = t->opt->layout();
  c.rank = new_rank;
  c.world = order.to_world;
  c.epoch = order.epoch;
  auto source = FindSnapshots(client, order.epoch, c.collective_timeout);
  if (!source.ok()) return failed("finding the snapshots", source.status());
  Trainer next;
  if (int rc = FormEpoch(c, model, batch, client, context, &next, t); rc >= 0) return rc;
  const double t_formed = since();
  auto loaded = LoadFromSnapshots(*next.opt, *source, c.token, snap->get());
  if (!loaded.ok()) {
    const std::string msg = next.agent->Diagnose(loaded.status());
    return next.agent->Fail(absl::StrCat("resizing to ", order.to_world, " ranks failed: ", msg),
                            msg);
  }
  // Every rank of the new epoch has loaded (the load ends with an agreement):
  // the snapshots may go.
  if (c.rank == 0) {
    if (absl::Status s = AnnounceHandOver(client, order.epoch); !s.ok()) {
      return next.agent->Fail(absl::StrCat("resize: ", s.message()));
    }
  }
  auto moved =
      SumOverRanks(next.comm.get(), loaded->bytes_fetched / 1048576.0, c.collective_timeout);
  if (!moved.ok()) {
    const std::string msg = next.agent->Diagnose(moved.status());
    return next.agent->Fail(absl::StrCat("after the resize: ", msg), msg);
  }
  const int64_t least = BytesChangingOwner(old_layout, next.opt->layout(), order.leave,
                                           1 + static_cast<int>(next.opt->state_names().size()));
  const double snapshot_mib = (*snap)->bytes() / 1048576.0;
  snap->reset();
  // The old epoch's agent, optimizer and communicator go with `next`.
  std::swap(t->comm, next.comm);
  std::swap(t->opt, next.opt);
  std::swap(t->agent, next.agent);
  t->agent->Resumed(step);
  const double secs = since();
  if (c.rank == 0) {
    std::printf(
        "shardopt_train: resized %d -> %d ranks after step %lld in %.2f s (epoch %lld; snapshot "
        "%.2f s, new epoch formed %.2f s, state loaded %.2f s): moved %.1f MiB between ranks "
        "(the slices that changed owner: %.1f MiB); snapshot %.1f MiB on rank 0\n",
        order.from_world, order.to_world, static_cast<long long>(step), secs,
        static_cast<long long>(order.epoch), t_snapshot, t_formed - t_snapshot, secs - t_formed,
        *moved, least / 1048576.0, snapshot_mib);
    std::fflush(stdout);
  }
  return -1;
}

// A rank was lost while this one ran step `reached` (shardrun
// --replicate-shards; RankAgent::AwaitRecovery gave `order`, which drops
// it): the old epoch's agent stops, the ranks that remain agree on the
// newest generation of replicas they all hold, form the next epoch and load
// it, each what it now owns (the lost rank's from the rank that held its
// replica). Returns -1 with *resume_at the generation's step (training goes
// on from there), else the exit status.
int RecoverFromReplicas(Config& c, TrainModel& model, int64_t batch, CoordinatorClient* client,
                        Trainer* t, ReplicaStore* replicas, const ResizeOrder& order,
                        int64_t reached, int64_t* resume_at) {
  const auto t0 = std::chrono::steady_clock::now();
  const int old_rank = c.rank, lost = order.leave[0];
  const int64_t old_epoch = c.epoch;
  t->agent->Stop();
  auto failed = [&](const std::string& what, const absl::Status& s) {
    const std::string msg = absl::StrCat("recovering from the loss of rank ", lost,
                                         " failed: ", what, ": ", s.message());
    (void)client->Abort(msg, c.rank);
    return Fail(c.rank, msg);
  };
  auto source = replicas->AgreeOnRecovery(client, order, old_rank, old_epoch, c.collective_timeout);
  if (!source.ok()) return failed("agreeing on the replicas", source.status());
  ResizeContext context = source->context;
  // (The recovery is acted on: the next epoch's agents must not take it for a resize.)
  context.resize_requests_done = std::max(context.resize_requests_done, order.request);
  c.rank = order.NewRank(old_rank);
  c.world = order.to_world;
  c.epoch = order.epoch;
  Trainer next;
  if (int rc = FormEpoch(c, model, batch, client, context, &next, t); rc >= 0) return rc;
  auto loaded = LoadFromReplicas(*next.opt, *source, c.token, replicas, old_rank, lost);
  if (!loaded.ok()) {
    const std::string msg = next.agent->Diagnose(loaded.status());
    return next.agent->Fail(absl::StrCat("recovering from the replicas failed: ", msg), msg);
  }
  auto moved =
      SumOverRanks(next.comm.get(), loaded->bytes_fetched / 1048576.0, c.collective_timeout);
  if (!moved.ok()) {
    const std::string msg = next.agent->Diagnose(moved.status());
    return next.agent->Fail(absl::StrCat("after the recovery: ", msg), msg);
  }
  replicas->Clear();  // (every rank has loaded: the old epoch's generations may go)
  std::swap(t->comm, next.comm);
  std::swap(t->opt, next.opt);
  std::swap(t->agent, next.agent);
  t->agent->Resumed(context.step);
  *resume_at = context.step;
  if (c.rank == 0) {
    std::printf(
        "shardopt_train: rank %d was lost during step %lld; recovered in %.2f s from the "
        "in-memory replicas of step %lld (%lld steps lost): %d ranks now (epoch %lld), %.1f "
        "MiB moved between ranks\n",
        lost, static_cast<long long>(reached),
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
        static_cast<long long>(context.step), static_cast<long long>(reached - 1 - context.step),
        c.world, static_cast<long long>(c.epoch), *moved);
    std::fflush(stdout);
  }
  return -1;
}

// Under srun or a Kubernetes Indexed Job (no shardrun), rank 0's process
// serves the job's coordinator (Rendezvous::host_coordinator). Before this
// rank exits, it waits until every rank has finished or the job has failed,
// so that the others can still report their end to it (and hear why the job
// failed) before it goes away.
class CoordinatorHost {
 public:
  absl::Status Start(const Config& c) {
    if (!c.host_coordinator) return absl::OkStatus();
    HostedCoordinatorOptions o;
    o.listen = c.rendezvous.listen;
    o.advertised = c.coordinator;
    o.job_id = c.job_id;
    o.world_size = c.world;
    o.token = c.token;
    o.heartbeat_timeout = c.heartbeat_timeout;
    o.on_event = [](const std::string& line) {
      std::printf("shardopt_train: coordinator: %s\n", line.c_str());
      std::fflush(stdout);
    };
    auto h = HostedCoordinator::Start(std::move(o));
    if (!h.ok()) return h.status();
    hosted_ = *std::move(h);
    linger_ = c.collective_timeout + c.heartbeat_timeout;
    std::printf(
        "shardopt_train: coordinator listening on %s (%s job %s, %d ranks; shardctl "
        "--coordinator=%s status)\n",
        c.coordinator.c_str(), c.launch.launcher.c_str(), c.job_id.c_str(), c.world,
        c.coordinator.c_str());
    std::fflush(stdout);
    return absl::OkStatus();
  }
  ~CoordinatorHost() {
    if (!hosted_) return;
    const JobStatus j = hosted_->Release(linger_);
    if (j.state == JobState::kRunning) {
      std::fprintf(stderr,
                   "shardopt_train: stopping the coordinator after %s with ranks still "
                   "running\n",
                   absl::FormatDuration(linger_).c_str());
    }
  }

 private:
  std::unique_ptr<HostedCoordinator> hosted_;
  absl::Duration linger_;
};

void SetUpProcess() {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // lines reach shardrun's pipe at once
  signal(SIGPIPE, SIG_IGN);             // a vanished launcher must not kill us mid-message
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

int Main(int argc, char** argv) {
  SetUpProcess();
  Config c;
  if (int rc = ParseConfig(argc, argv, &c); rc >= 0) return rc;
  g_drain_on_sigterm = c.drain_on_sigterm;
  if (!c.launch.note.empty()) std::fprintf(stderr, "shardopt_train: %s\n", c.launch.note.c_str());
  CoordinatorHost host;  // destroyed last: after this rank's own end is reported
  if (absl::Status s = host.Start(c); !s.ok()) return Fail(c.rank, std::string(s.message()));
  if (absl::Status s = ApplyMallocMode(c.malloc_mode); !s.ok()) return Fail(c.rank, s.ToString());
  if (c.malloc_mode == MallocMode::kTuned) InstallHostAllocator();
  at::set_num_threads(static_cast<int>(c.threads));
  (void)LimitBlasThreads(static_cast<int>(c.threads));  // OpenBLAS keeps its own pool
  auto model = MakeModel(c.model_name, 42);
  if (!model.ok()) return Fail(c.rank, std::string(model.status().message()));
  const int64_t batch = c.has_batch ? c.batch_flag : (*model)->batch_per_rank();
  if (c.rank == 0) {
    std::printf(
        "shardopt_train: %d ranks, model %s, %s lr %g, batch %lld/rank, %lld steps; %s%s%s\n",
        c.world, (*model)->name().c_str(), c.kind.c_str(), c.lr, static_cast<long long>(batch),
        static_cast<long long>(c.steps), DescribeMallocMode(c.malloc_mode).c_str(),
        c.malloc_mode == MallocMode::kTuned ? "; " : "",
        c.malloc_mode == MallocMode::kTuned ? DescribeHostAllocator() : "");
    std::fflush(stdout);
  }
  auto creds = MakeChannelCredentials(c.tls);
  if (!creds.ok()) return Fail(c.rank, std::string(creds.status().message()));
  CoordinatorClient client(c.coordinator, c.token, *creds);
  if (absl::Status s = client.WaitUntilReachable(c.collective_timeout); !s.ok()) {
    return Fail(c.rank, std::string(s.message()));
  }
  std::unique_ptr<ReplicaStore> replicas;  // (outlives the trainer)
  if (c.replicate_every > 0) {
    auto r = ReplicaStore::Start(c.bind, c.token);
    if (!r.ok()) return Fail(c.rank, absl::StrCat("--replicate-shards: ", r.status().message()));
    replicas = *std::move(r);
  }
  Trainer trainer;
  int64_t first_step = 0;
  if (c.join_epoch > 0) {
    // Started by shardrun to grow a running job: the state comes from the
    // ranks already there, who go on training until every new rank is ready.
    int64_t total = 0;
    for (const auto& [name, p] : (*model)->NamedParameters()) total += p.numel();
    PrefaultStateBuffers(total, c.world);
    if (absl::Status s = client.KvSet(ResizeReadyKey(c.join_epoch, c.rank), "1"); !s.ok()) {
      return Fail(c.rank, absl::StrCat("cannot join epoch ", c.join_epoch, ": ", s.message()));
    }
    auto source = AwaitSnapshotsToJoin(&client, c.join_epoch, c.world, c.collective_timeout);
    if (!source.ok()) {
      if (absl::IsCancelled(source.status())) {  // the job ended first: nothing to join
        std::printf("shardopt_train: rank %d: %s\n", c.rank,
                    std::string(source.status().message()).c_str());
        return 0;
      }
      return Fail(c.rank, absl::StrCat("cannot join epoch ", c.join_epoch, ": ",
                                       source.status().message()));
    }
    if (int rc = FormEpoch(c, **model, batch, &client, source->context, &trainer, &trainer);
        rc >= 0) {
      return rc;
    }
    auto loaded = LoadFromSnapshots(*trainer.opt, *source, c.token, nullptr);
    if (!loaded.ok()) {
      const std::string msg = trainer.agent->Diagnose(loaded.status());
      return trainer.agent->Fail(absl::StrCat("joining the job failed: ", msg), msg);
    }
    // (The ranks that stayed sum the bytes moved: the same collective.)
    auto moved =
        SumOverRanks(trainer.comm.get(), loaded->bytes_fetched / 1048576.0, c.collective_timeout);
    if (!moved.ok()) {
      const std::string msg = trainer.agent->Diagnose(moved.status());
      return trainer.agent->Fail(absl::StrCat("after joining: ", msg), msg);
    }
    first_step = source->context.step;
    trainer.agent->Resumed(first_step);
    std::printf("shardopt_train: rank %d joined the job at step %lld (epoch %lld, %d ranks)\n",
                c.rank, static_cast<long long>(first_step), static_cast<long long>(c.epoch),
                c.world);
    std::fflush(stdout);
  } else if (int rc = FormEpoch(c, **model, batch, &client, ResizeContext(), &trainer, &trainer);
             rc >= 0) {
    return rc;
  }
  ShardedOptimizer* o = trainer.opt.get();
  RankAgent* agent = trainer.agent.get();
  if (!c.resume.empty()) {
    auto resumed = Resume(c, o);
    if (!resumed.ok()) {
      return agent->Fail(absl::StrCat("cannot resume: ", resumed.status().ToString()),
                         resumed.status().ToString());
    }
    first_step = *resumed;
    agent->Resumed(first_step);
    if (c.restart > 0 && c.rank == 0) {
      auto reached = EnvInt("SHARDOPT_RESTART_STEP", -1, 0, kMaxSteps);
      if (reached.ok() && *reached >= first_step) {
        std::printf("shardopt_train: restart %d: the job had reached step %lld; %lld steps lost\n",
                    c.restart, static_cast<long long>(*reached),
                    static_cast<long long>(*reached - first_step));
        std::fflush(stdout);
      }
    }
  }
  Advice advice;
  if (c.advise) {
    auto link = MeasureLink(trainer.comm.get(), c.collective_timeout);
    if (!link.ok()) {
      return agent->Fail(
          absl::StrCat("--advise: measuring the link failed: ", link.status().message()));
    }
    advice.link = *link;
    advice.at_step = first_step + 3;
  }
  const auto t_start = std::chrono::steady_clock::now();
  if (int rc = TrainLoop(c, **model, batch, &client, &trainer, first_step, &advice, replicas.get());
      rc >= 0) {
    return rc;
  } else if (rc == kLeftTheJob) {
    return 0;
  }
  const double total =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  return Conclude(c, trainer.opt.get(), trainer.agent.get(), first_step, total);
}

}  // namespace
}  // namespace shardopt

int main(int argc, char** argv) { return shardopt::Main(argc, argv); }
