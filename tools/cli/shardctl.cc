// shardctl: ask a running shardopt job what is going on.
#include <fcntl.h>
#include <google/protobuf/util/json_util.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <map>
#include <vector>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/checkpoint/checkpoint.h"
#include "client/coordinator_client.h"
#include "client/checkpoint/torch_interop.h"
#include "common/file_system.h"
#include "nlohmann/json.hpp"
#include "tools/cli/flags.h"
#include "tools/cli/plan_command.h"
#include "tools/cli/top_live.h"
#include "tools/cli/top_view.h"

namespace shardopt {
namespace {

constexpr char kUsage[] = R"(usage: shardctl [flags] COMMAND

commands:
  plan          predict step time and memory per rank of DDP, OSS, ZeRO and shardopt
                for a model on a cluster, and recommend buckets and gradient sharding
                (offline; its flags: shardctl plan --help)
  status        job state, step, and every rank's heartbeat, loss and throughput
  layout        which rank owns what: per rank and bucket, elements and parameters
  memory        per rank: fp32 master, optimizer state, gradients, parameters, RSS
  health        grpc.health.v1 check of the coordinator
  set-lr X      change the learning rate; every rank applies it at the same next step
  checkpoint    ask the job to save a checkpoint at the next step boundary
                (the trainers need --ckpt-dir)
  abort REASON  fail the job (every rank stops)
  resize --ranks=M  change the job to M ranks at the next step boundary, live: new
                ranks join (started by the job's shardrun) or the highest ranks hand
                their optimizer state over and leave (docs/elastic.md); --wait=S waits
                up to S seconds for it to complete and prints the change
  drain --rank=R  the same, one rank fewer: rank R hands its state over and leaves
  top           live view, refreshed every --interval: a header (job, state, ranks,
                step, lr, duration, slow ranks) and per rank: step, step time p50
                and max over the coordinator's window, samples/s, exposed
                communication, optimizer update time, memory (RSS), heartbeat age;
                the slowest rank marked '*' and in reverse video ('!': named slow);
                q or Ctrl-C quits; --once prints one plain frame and exits
                (non-zero when the coordinator does not answer)
  flight-recorder  every rank's last collectives (seq, step, op, bucket, bytes, times,
                state; the last 20 per rank, --json: all of them, --rank=R: one rank)
                and where the ranks first diverge
  checkpoints DIR         list the checkpoints under DIR: step, world size, size, status
  inspect CKPT            show a checkpoint's manifest summary and verify every CRC
  consolidate CKPT OUT    stream a checkpoint into one safetensors file of whole tensors
                          ("<param>" and "<param>.<state>"), with a progress bar;
                          --format=torch writes the torch.optim state_dict instead
                          (torch.load-able, "param_names" and "params" alongside)
  import FILE.pt OUTDIR   turn a torch.save file into a shardopt checkpoint under OUTDIR
                          (resumable at any world size): an optimizer state_dict with
                          --params=MODEL.pt (the model's state_dict), a combined
                          {"model": ..., "optimizer": ...} file, or shardopt's own torch
                          export; PyTorch does not record Adam vs AdamW: say it with
                          --optimizer=adam|adamw|sgd. Every param_group is kept (membership,
                          order, hyper-parameters) when the file names its parameters
(shardopt_train --resume also takes a consolidated .safetensors or a .pt file directly.)
  load          query status, layout and memory in turn at --rate per second for
                --duration seconds; prints latency percentiles (load testing)

flags:
  --coordinator=H:P   the job's coordinator (default $SHARDOPT_COORDINATOR)
  --token-file=PATH   bearer token (default $SHARDOPT_TOKEN_FILE)
  --tls-ca=PEM        TLS, verifying the coordinator against this CA (default $SHARDOPT_TLS_CA)
  --tls-cert=PEM      client certificate for mutual TLS (default $SHARDOPT_TLS_CERT)
  --tls-key=PEM       its key (default $SHARDOPT_TLS_KEY)
  --json              machine-readable output (--json=false: off)
  --wait=SECONDS      status: wait until the job is running (or failed) first; resize,
                      drain: until the resize is complete; seconds in [0, 604800] (default 0)
  --rate=N            load: queries per second, in (0, 100000] (default 50)
  --duration=S        load: seconds, in (0, 31536000] (default 10)
  --format=F          consolidate: safetensors | torch (default safetensors)
  --optimizer=NAME    import: adam | adamw | sgd (default adam)
  --params=MODEL.pt   import: the model's state_dict
  --interval=S        top: seconds between refreshes, in [0.1, 3600] (default 1)
  --once              top: print one frame without terminal control (for scripts)
  --rank=R            flight-recorder: only rank R; drain: the rank that leaves; 0..1048575
  --ranks=M           resize: the new number of ranks, 1..1048576
  --help              this text
Every flag is checked, whatever the command: a malformed or out-of-range value
is refused by name (exit status 2).
)";

// Limits of the flags (see kUsage).
constexpr double kMaxWaitSeconds = 604800;
constexpr double kMaxRate = 100000;
constexpr double kMaxDurationSeconds = 31536000;
constexpr double kMinTopInterval = 0.1, kMaxTopInterval = 3600;

// Checks every flag (also those the command does not use); the first error.
absl::Status CheckFlags(const Flags& f) {
  absl::Status bad;
  auto check = [&bad](const absl::Status& s) {
    if (!s.ok() && bad.ok()) bad = s;
  };
  check(f.Bool("json", false).status());
  check(f.Seconds("wait", 0, 0, kMaxWaitSeconds).status());
  check(f.Double("rate", 50, 0, kMaxRate, /*min_exclusive=*/true).status());
  check(f.Seconds("duration", 10, 0, kMaxDurationSeconds, /*min_exclusive=*/true).status());
  check(f.Choice("format", "safetensors", {"safetensors", "torch"}).status());
  check(f.Choice("optimizer", "adam", {"adam", "adamw", "sgd"}).status());
  check(f.Seconds("interval", 1, kMinTopInterval, kMaxTopInterval).status());  // top
  check(f.Bool("once", false).status());                                       // top
  check(f.Int("rank", -1, 0, (1 << 20) - 1).status());
  check(f.Int("ranks", 1, 1, 1 << 20).status());  // resize
  for (const char* name :
       {"coordinator", "token-file", "tls-ca", "tls-cert", "tls-key", "params"}) {
    check(f.NonEmpty(name, "").status());
  }
  return bad;
}

int Fail(const std::string& msg) {
  std::fprintf(stderr, "shardctl: %s\n", msg.c_str());
  return 2;
}

std::string Bytes(int64_t b) {
  if (b >= (int64_t{1} << 30)) return absl::StrFormat("%.2f GiB", b / 1073741824.0);
  if (b >= (1 << 20)) return absl::StrFormat("%.1f MiB", b / 1048576.0);
  if (b >= (1 << 10)) return absl::StrFormat("%.1f KiB", b / 1024.0);
  return absl::StrCat(b, " B");
}

template <typename Msg>
int PrintJson(const Msg& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = true;
  o.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  std::printf("%s", out.c_str());
  return 0;
}

// shardctl flight-recorder: the rings of a live job (or those its ranks
// reported when it failed) and where they diverge.
template <typename Unreachable>
int FlightRecorderCommand(CoordinatorClient& client, bool json, int64_t only_rank,
                          const Unreachable& unreachable) {
  auto f = client.GetFlightRecords();
  if (!f.ok()) return unreachable(f.status());
  if (only_rank >= 0) {
    if (only_rank >= f->records_size()) {
      return Fail(
          absl::StrCat("--rank=", only_rank, ": the job has ", f->records_size(), " ranks"));
    }
    v1::FlightRecord keep = f->records(static_cast<int>(only_rank));
    f->clear_records();
    *f->add_records() = std::move(keep);
  }
  if (json) return PrintJson(*f);
  constexpr int kShown = 20;
  std::printf("divergence: %s\n", f->divergence().c_str());
  for (const v1::FlightRecord& r : f->records()) {
    if (!r.error().empty()) {
      std::printf("\nrank %d: no record (%s)\n", r.rank(), r.error().c_str());
      continue;
    }
    const int n = r.records_size();
    const int first = std::max(0, n - kShown);
    std::printf(
        "\nrank %d: %d collectives in its ring%s%s\n", r.rank(), n,
        n > kShown ? absl::StrCat(", the last ", kShown, " shown (--json: all)").c_str() : "",
        r.reason().empty() ? "" : absl::StrCat("; reported when it failed: ", r.reason()).c_str());
    if (n == 0) continue;
    std::printf("%10s %8s  %-15s %6s %12s %12s %10s  %s\n", "seq", "step", "op", "bucket", "bytes",
                "started", "took", "state");
    for (int i = first; i < n; ++i) {
      const v1::CollectiveRecord& c = r.records(i);
      const double ago = r.captured_unix() - c.start_unix();
      const double took = (c.end_unix() > 0 ? c.end_unix() : r.captured_unix()) - c.start_unix();
      std::printf(
          "%10lld %8lld  %-15s %6s %12s %12s %10s  %s\n", static_cast<long long>(c.seq()),
          static_cast<long long>(c.step()), c.op().c_str(),
          c.bucket() < 0 ? "-" : absl::StrCat(c.bucket()).c_str(), Bytes(c.bytes()).c_str(),
          absl::StrFormat("%.3f s ago", ago).c_str(),
          (c.end_unix() > 0 ? absl::StrFormat("%.4f s", took) : absl::StrFormat("%.1f s+", took))
              .c_str(),
          c.state().c_str());
    }
  }
  return 0;
}

// What an offline checkpoint command (no coordinator) works with.
struct OfflineContext {
  const std::vector<std::string>& args;  // the command's name first
  const Flags& flags;
  FileSystem* fs;
  bool json;
};

// shardctl import OPT.pt OUTDIR: a torch.optim state_dict as a checkpoint.
int ImportCommand(const OfflineContext& ctx) {
  const std::vector<std::string>& args = ctx.args;
  if (args.size() != 3)
    return Fail("usage: shardctl import OPT.pt OUTDIR [--params=MODEL.pt] [--optimizer=adam]");
  const std::string k = ctx.flags.Str("optimizer", "adam");
  OptimizerKind kind = k == "sgd"     ? OptimizerKind::kSgd
                       : k == "adamw" ? OptimizerKind::kAdamW
                                      : OptimizerKind::kAdam;
  if (k != "sgd" && k != "adamw" && k != "adam")
    return Fail("--optimizer must be adam, adamw or sgd");
  absl::Status s = ImportTorch(args[1], ctx.flags.Str("params", ""), kind, args[2]);
  if (!s.ok()) return Fail(std::string(s.message()));
  std::printf("imported %s into %s (resume with --resume=%s at any world size)\n", args[1].c_str(),
              args[2].c_str(), args[2].c_str());
  return 0;
}

// The entries of a checkpoint directory named step-N (canonically), by step.
std::vector<std::pair<int64_t, std::string>> StepEntries(const std::vector<std::string>& entries) {
  std::vector<std::pair<int64_t, std::string>> steps;
  for (const auto& e : entries) {
    int64_t step = 0;
    if (e.size() > 5 && e.rfind("step-", 0) == 0 && absl::SimpleAtoi(e.substr(5), &step) &&
        e == absl::StrCat("step-", step)) {
      steps.push_back({step, e});
    }
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

// shardctl checkpoints DIR: each step-N checkpoint, complete or not.
int CheckpointsCommand(const OfflineContext& ctx) {
  const std::vector<std::string>& args = ctx.args;
  if (args.size() != 2) return Fail("usage: shardctl checkpoints DIR");
  auto entries = ctx.fs->ListDir(args[1]);
  if (!entries.ok()) return Fail(std::string(entries.status().message()));
  auto latest = ResolveCheckpoint(ctx.fs, args[1]);
  nlohmann::json out = nlohmann::json::array();
  if (!ctx.json)
    std::printf("%-14s %8s %6s %12s  %s\n", "checkpoint", "step", "ranks", "size", "status");
  for (const auto& [step, name] : StepEntries(*entries)) {
    const std::string dir = args[1] + "/" + name;
    auto m = ctx.fs->Kind(dir) == EntryKind::kDirectory
                 ? ReadManifest(ctx.fs, dir)
                 : absl::StatusOr<Manifest>(absl::FailedPreconditionError("not a directory"));
    std::string status =
        m.ok() ? "complete" : absl::StrCat("incomplete (", m.status().message(), ")");
    const int64_t bytes = m.ok() ? m->total_file_bytes() : 0;
    if (m.ok() && latest.ok() && *latest == dir) status += ", LATEST";
    const int ranks = m.ok() ? m->world_size : 0;
    out.push_back({{"name", name},
                   {"step", step},
                   {"world_size", ranks},
                   {"bytes", bytes},
                   {"complete", m.ok()},
                   {"status", status}});
    if (!ctx.json) {
      std::printf("%-14s %8lld %6d %12s  %s\n", name.c_str(), static_cast<long long>(step), ranks,
                  Bytes(bytes).c_str(), status.c_str());
    }
  }
  if (ctx.json) std::printf("%s\n", out.dump(1).c_str());
  return 0;
}

// shardctl inspect --json: the manifest of `dir` and its verification `v`.
void PrintManifestJson(const std::string& dir, const Manifest& m, const absl::Status& v) {
  nlohmann::json out;
  out["path"] = dir;
  out["format"] = m.format;
  out["step"] = m.step;
  out["world_size"] = m.world_size;
  out["optimizer"] = nlohmann::json::parse(SavedOptimizerJson(m.optimizer));
  out["layout_hash"] = m.layout_hash;
  out["states"] = m.states;
  out["params"] = nlohmann::json::array();
  for (const auto& p : m.params) {
    out["params"].push_back({{"name", p.name},
                             {"shape", p.shape},
                             {"dtype", DTypeName(p.dtype)},
                             {"trainable", p.trainable}});
  }
  out["pieces"] = m.pieces.size();
  out["files"] = nlohmann::json::array();
  for (const auto& f : m.files)
    out["files"].push_back({{"name", f.name}, {"bytes", f.bytes}, {"crc32c", f.crc32c}});
  out["user_metadata"] = m.user_metadata;
  out["verified"] = v.ok();
  if (!v.ok()) out["error"] = std::string(v.message());
  std::printf("%s\n", out.dump(1).c_str());
}

// shardctl inspect CKPT: its manifest, and whether every CRC matches (exit 1 if not).
int InspectCommand(const OfflineContext& ctx) {
  const std::vector<std::string>& args = ctx.args;
  if (args.size() != 2) return Fail("usage: shardctl inspect CKPT");
  auto dir = ResolveCheckpoint(ctx.fs, args[1]);
  if (!dir.ok()) return Fail(std::string(dir.status().message()));
  auto m = ReadManifest(ctx.fs, *dir);
  if (!m.ok()) return Fail(std::string(m.status().message()));
  absl::Status v = VerifyCheckpoint(ctx.fs, *dir);
  const std::string verdict = !v.ok() ? std::string(v.message())
                              : m->self_checked
                                  ? "every CRC matches (manifest and shards)"
                                  : "every shard CRC matches (a v1 manifest has no CRC of its own)";
  if (ctx.json) {
    PrintManifestJson(*dir, *m, v);
  } else {
    std::printf("checkpoint %s\n  step %lld, saved by %d ranks, optimizer %s, layout %s\n",
                dir->c_str(), static_cast<long long>(m->step), m->world_size,
                SavedOptimizerJson(m->optimizer).c_str(), m->layout_hash.c_str());
    std::printf("  %zu parameters, %zu pieces, states %s\n", m->params.size(), m->pieces.size(),
                nlohmann::json(m->states).dump().c_str());
    for (const auto& f : m->files) {
      std::printf("  %-28s %12s  crc32c %08x\n", f.name.c_str(), Bytes(f.bytes).c_str(), f.crc32c);
    }
    if (!m->user_metadata.empty()) {
      std::printf("  user metadata %s\n", nlohmann::json(m->user_metadata).dump().c_str());
    }
    std::printf("  verify: %s\n", verdict.c_str());
  }
  return v.ok() ? 0 : 1;
}

// shardctl consolidate CKPT OUT: one safetensors file (with a progress bar),
// or a torch.optim state_dict (--format=torch).
int ConsolidateCommand(const OfflineContext& ctx) {
  const std::vector<std::string>& args = ctx.args;
  if (args.size() != 3)
    return Fail("usage: shardctl consolidate CKPT OUT [--format=safetensors|torch]");
  auto dir = ResolveCheckpoint(ctx.fs, args[1]);
  if (!dir.ok()) return Fail(std::string(dir.status().message()));
  const std::string format = ctx.flags.Str("format", "safetensors");
  if (format == "torch") {
    const auto t0 = absl::Now();
    absl::Status s = ExportTorch(ctx.fs, *dir, args[2]);
    if (!s.ok()) return Fail(std::string(s.message()));
    std::printf("wrote %s (torch.optim state_dict) in %.2f s\n", args[2].c_str(),
                absl::ToDoubleSeconds(absl::Now() - t0));
    return 0;
  }
  if (format != "safetensors") return Fail("--format must be safetensors or torch");
  const auto t0 = absl::Now();
  int last_pct = -1;
  absl::Status s = Consolidate(ctx.fs, *dir, args[2], [&](int64_t done, int64_t total) {
    const int pct = total > 0 ? static_cast<int>(100 * done / total) : 100;
    if (pct != last_pct) {
      last_pct = pct;
      std::fprintf(stderr, "\r[%-40s] %3d%%  %s / %s", std::string(pct * 40 / 100, '#').c_str(),
                   pct, Bytes(done).c_str(), Bytes(total).c_str());
    }
  });
  std::fprintf(stderr, "\n");
  if (!s.ok()) return Fail(std::string(s.message()));
  std::printf("wrote %s in %.2f s\n", args[2].c_str(), absl::ToDoubleSeconds(absl::Now() - t0));
  return 0;
}

// The commands that work on checkpoint files, without a coordinator.
struct OfflineCommand {
  const char* name;
  int (*run)(const OfflineContext&);
};
constexpr OfflineCommand kOfflineCommands[] = {
    {"import", ImportCommand},
    {"checkpoints", CheckpointsCommand},
    {"inspect", InspectCommand},
    {"consolidate", ConsolidateCommand},
};

// Runs the offline command args[0] (one of kOfflineCommands).
int CheckpointCommand(const std::vector<std::string>& args, const Flags& flags) {
  const bool json = *flags.Bool("json", false);  // checked by CheckFlags
  const OfflineContext ctx{args, flags, PosixFileSystem(), json};
  for (const OfflineCommand& c : kOfflineCommands) {
    if (args[0] == c.name) return c.run(ctx);
  }
  return Fail(absl::StrCat("unknown command '", args[0], "' (see --help)"));
}

int TopCommand(CoordinatorClient* client, const std::string& address, const Flags& flags) {
  if (*flags.Bool("json", false))
    return Fail("top has no --json output (use shardctl status --json)");
  const absl::Duration interval =
      *flags.Seconds("interval", 1, kMinTopInterval, kMaxTopInterval);  // checked
  if (!*flags.Bool("once", false)) return RunTopLive(client, address, interval);
  // One frame, plain text, no terminal control: for scripts.
  auto job = client->GetJob();
  if (!job.ok()) return Fail(absl::StrCat(job.status().message(), " [", address, "]"));
  TopViewOptions o;
  o.width = 0;
  o.height = 0;
  for (const std::string& line : RenderTopView(&*job, o)) std::printf("%s\n", line.c_str());
  return job->state() == "failed" ? 1 : 0;
}

// What a command run against a job's coordinator gets.
struct JobContext {
  CoordinatorClient& client;
  const Flags& flags;
  const std::string& address;
  bool json;
  // A failed RPC: the message and the address, exit status 2.
  int Unreachable(const absl::Status& s) const {
    return Fail(absl::StrCat(s.message(), " [", address, "]"));
  }
};

int StatusCommand(const JobContext& ctx) {
  auto wait = ctx.flags.Double("wait", 0);
  if (!wait.ok()) return Fail(std::string(wait.status().message()));
  const absl::Time deadline = absl::Now() + absl::Seconds(*wait);
  absl::StatusOr<v1::GetJobResponse> job;
  while (true) {
    job = ctx.client.GetJob();
    const bool settled = job.ok() && job->state() != "starting";
    if (settled || absl::Now() >= deadline) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  if (!job.ok()) return ctx.Unreachable(job.status());
  if (ctx.json) return PrintJson(*job);
  // The ranks' learning rate; a requested one they have not applied yet
  // (compared as the float they train with) is shown beside it.
  std::string lr = absl::StrFormat("%g", job->learning_rate());
  if (job->requested_learning_rate() > 0 && static_cast<float>(job->requested_learning_rate()) !=
                                                static_cast<float>(job->learning_rate())) {
    lr += absl::StrFormat(" (%g requested)", job->requested_learning_rate());
  }
  std::printf("job %s: %s, %d ranks, step %lld, lr %s, layout %016llx\n", job->job_id().c_str(),
              job->state().c_str(), job->world_size(), static_cast<long long>(job->step()),
              lr.c_str(), static_cast<unsigned long long>(job->layout_hash()));
  if (!job->failure().empty()) std::printf("failure: %s\n", job->failure().c_str());
  if (job->restarts() > 0) {
    std::printf("restarts: %d; last: %s\n", job->restarts(), job->last_restart().c_str());
  }
  if (const std::string m = MembershipLine(*job); !m.empty()) std::printf("%s\n", m.c_str());
  std::printf("%5s  %-22s %8s %10s %14s %12s\n", "rank", "shard owner", "step", "loss", "samples/s",
              "heartbeat");
  for (const auto& r : job->ranks()) {
    std::printf(
        "%5d  %-22s %8lld %10.5f %14.1f %12s\n", r.rank(),
        r.address().empty() ? "(not joined)" : r.address().c_str(),
        static_cast<long long>(r.step()), r.loss(), r.samples_per_s(),
        r.seconds_since_heartbeat() < 0
            ? "-"
            : absl::StrFormat("%.1fs ago%s", r.seconds_since_heartbeat(), r.alive() ? "" : " DEAD")
                  .c_str());
  }
  return job->state() == "failed" ? 1 : 0;
}

int LayoutCommand(const JobContext& ctx) {
  auto l = ctx.client.GetLayout();
  if (!l.ok()) return ctx.Unreachable(l.status());
  if (ctx.json) return PrintJson(*l);
  std::printf(
      "layout %016llx: %d ranks, %zu buckets, %lld elements, padding %lld, imbalance "
      "%.5f, %d cut tensors\n",
      static_cast<unsigned long long>(l->layout_hash()), l->world_size(),
      static_cast<size_t>(l->bucket_capacity_size()), static_cast<long long>(l->num_elements()),
      static_cast<long long>(l->padding_elements()), l->imbalance(), l->cut_tensors());
  std::printf("%6s %5s %12s %12s  %s\n", "bucket", "rank", "elements", "capacity", "parameters");
  for (const auto& row : l->ranges()) {
    std::string params = absl::StrJoin(row.params(), ", ");
    if (params.size() > 90) params = params.substr(0, 87) + "...";
    std::printf("%6d %5d %12lld %12lld  %s\n", row.bucket(), row.rank(),
                static_cast<long long>(row.elements()),
                static_cast<long long>(l->bucket_capacity(row.bucket())), params.c_str());
  }
  std::printf("owned per rank:");
  for (int r = 0; r < l->owned_elements_size(); ++r) {
    std::printf(" %d:%lld", r, static_cast<long long>(l->owned_elements(r)));
  }
  std::printf("\n");
  return 0;
}

int MemoryCommand(const JobContext& ctx) {
  auto m = ctx.client.GetMemory();
  if (!m.ok()) return ctx.Unreachable(m.status());
  if (ctx.json) return PrintJson(*m);
  std::printf("%5s %12s %12s %12s %12s %12s\n", "rank", "master", "opt state", "gradients",
              "parameters", "RSS");
  v1::RankMemory total;
  for (const auto& r : m->ranks()) {
    if (!r.error().empty()) {
      std::printf("%5d  %s\n", r.rank(), r.error().c_str());
      continue;
    }
    std::printf("%5d %12s %12s %12s %12s %12s\n", r.rank(), Bytes(r.master_bytes()).c_str(),
                Bytes(r.state_bytes()).c_str(), Bytes(r.grad_bytes()).c_str(),
                Bytes(r.param_bytes()).c_str(), Bytes(r.rss_bytes()).c_str());
    total.set_master_bytes(total.master_bytes() + r.master_bytes());
    total.set_state_bytes(total.state_bytes() + r.state_bytes());
    total.set_grad_bytes(total.grad_bytes() + r.grad_bytes());
    total.set_param_bytes(total.param_bytes() + r.param_bytes());
    total.set_rss_bytes(total.rss_bytes() + r.rss_bytes());
  }
  std::printf("%5s %12s %12s %12s %12s %12s\n", "total", Bytes(total.master_bytes()).c_str(),
              Bytes(total.state_bytes()).c_str(), Bytes(total.grad_bytes()).c_str(),
              Bytes(total.param_bytes()).c_str(), Bytes(total.rss_bytes()).c_str());
  return 0;
}

int HealthCommand(const JobContext& ctx) {
  auto h = ctx.client.Health();
  if (!h.ok()) return ctx.Unreachable(h.status());
  std::printf("%s\n", ctx.json ? absl::StrCat("{\"status\": \"", *h, "\"}").c_str() : h->c_str());
  return *h == "SERVING" ? 0 : 1;
}

int SetLrCommand(const JobContext& ctx) {
  if (ctx.flags.positional().size() != 2)
    return Fail("usage: shardctl set-lr VALUE");  // (no value)
  double lr = 0;
  if (!absl::SimpleAtod(ctx.flags.positional()[1], &lr)) {
    return Fail(absl::StrCat("set-lr: '", ctx.flags.positional()[1], "' is not a number"));
  }
  if (absl::Status s = ValidateLearningRateChange(lr); !s.ok()) {
    return Fail(absl::StrCat("set-lr: ", s.message()));
  }
  auto v = ctx.client.SetLearningRate(lr);
  if (!v.ok() && v.status().code() == absl::StatusCode::kInvalidArgument) {
    // Refused by the coordinator (the same rule, checked there too).
    return Fail(absl::StrCat(v.status().message(), "; the job's learning rate is unchanged"));
  }
  if (!v.ok()) return ctx.Unreachable(v.status());
  std::printf("learning rate %g requested (version %lld); ranks apply it at their next step\n", lr,
              static_cast<long long>(*v));
  return 0;
}

int CheckpointRequestCommand(const JobContext& ctx) {
  auto r = ctx.client.RequestCheckpoint();
  if (!r.ok()) return ctx.Unreachable(r.status());
  std::printf(
      "checkpoint requested (request %lld); every rank saves at the same next step "
      "boundary\n",
      static_cast<long long>(*r));
  return 0;
}

// shardctl resize / drain: ask for a live resize; with --wait=S, wait for
// the job to reach the new epoch and print the change.
int RequestResize(const JobContext& ctx, int to_world, const std::vector<int>& leave) {
  auto wait = ctx.flags.Double("wait", 0);
  if (!wait.ok()) return Fail(std::string(wait.status().message()));
  auto r = ctx.client.Resize(to_world, leave);
  if (!r.ok()) {
    if (r.status().code() == absl::StatusCode::kUnavailable) return ctx.Unreachable(r.status());
    return Fail(absl::StrCat("cannot resize: ", r.status().message()));
  }
  std::printf(
      "resize to %d ranks requested (epoch %lld); the ranks change at their next step "
      "boundary\n",
      to_world, static_cast<long long>(r->epoch()));
  std::fflush(stdout);
  if (*wait <= 0) return 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(*wait);
  while (absl::Now() < deadline) {
    auto job = ctx.client.GetJob();
    if (job.ok() && job->state() == "failed") {
      return Fail(absl::StrCat("the job failed: ", job->failure()));
    }
    if (job.ok() && job->epoch() >= r->epoch() && job->resize_pending_world() == 0) {
      for (const auto& m : job->membership()) {
        if (m.epoch() != r->epoch()) continue;
        std::printf("epoch %lld at step %lld: %d -> %d ranks%s%s in %.2fs\n",
                    static_cast<long long>(m.epoch()), static_cast<long long>(m.step()),
                    m.from_world(), m.to_world(),
                    m.left().empty()
                        ? ""
                        : absl::StrCat(" (left: ", absl::StrJoin(m.left(), ", "), ")").c_str(),
                    m.joined().empty()
                        ? ""
                        : absl::StrCat(" (joined: ", absl::StrJoin(m.joined(), ", "), ")").c_str(),
                    m.seconds());
      }
      return 0;
    }
    if (job.ok() && job->state() == "finished") {
      return Fail("the job finished before the resize took effect");
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  return Fail(absl::StrCat("the resize did not complete within --wait=", *wait, " s"));
}

int ResizeCommand(const JobContext& ctx) {
  if (!ctx.flags.Has("ranks")) return Fail("usage: shardctl resize --ranks=M [--wait=S]");
  auto m = ctx.flags.Int("ranks", 0, 1, (1 << 20));
  if (!m.ok()) return Fail(std::string(m.status().message()));
  return RequestResize(ctx, static_cast<int>(*m), {});
}

int DrainCommand(const JobContext& ctx) {
  if (!ctx.flags.Has("rank")) return Fail("usage: shardctl drain --rank=R [--wait=S]");
  auto rank = ctx.flags.Int("rank", 0, 0, (1 << 20) - 1);
  if (!rank.ok()) return Fail(std::string(rank.status().message()));
  auto job = ctx.client.GetJob();
  if (!job.ok()) return ctx.Unreachable(job.status());
  if (*rank >= job->world_size()) {
    return Fail(absl::StrCat("--rank=", *rank, ": the job has ", job->world_size(), " ranks"));
  }
  if (job->world_size() == 1) return Fail("the job has one rank: nothing would be left to train");
  return RequestResize(ctx, job->world_size() - 1, {static_cast<int>(*rank)});
}

int AbortCommand(const JobContext& ctx) {
  const std::string reason = ctx.flags.positional().size() > 1 ? ctx.flags.positional()[1] : "";
  absl::Status s = ctx.client.Abort(reason.empty() ? "aborted with shardctl" : reason, -1);
  if (!s.ok()) return ctx.Unreachable(s);
  std::printf("job aborted\n");
  return 0;
}

int FlightRecorderJobCommand(const JobContext& ctx) {
  return FlightRecorderCommand(ctx.client, ctx.json, *ctx.flags.Int("rank", -1, 0, (1 << 20) - 1),
                               [&ctx](const absl::Status& s) { return ctx.Unreachable(s); });
}

int LoadCommand(const JobContext& ctx) {
  auto rate = ctx.flags.Double("rate", 50);
  auto duration = ctx.flags.Double("duration", 10);
  if (!rate.ok() || !duration.ok() || *rate <= 0 || *duration <= 0) {
    return Fail("load needs --rate > 0 and --duration > 0");
  }
  std::vector<double> ms;
  int errors = 0, consecutive = 0;
  const absl::Time start = absl::Now();
  const absl::Duration period = absl::Seconds(1.0 / *rate);
  for (int64_t i = 0;; ++i) {
    const absl::Time due = start + i * period;
    if (due - start > absl::Seconds(*duration)) break;
    const absl::Time now = absl::Now();
    if (due > now) absl::SleepFor(due - now);
    const absl::Time t0 = absl::Now();
    absl::Status s = i % 3 == 0   ? ctx.client.GetJob().status()
                     : i % 3 == 1 ? ctx.client.GetLayout().status()
                                  : ctx.client.GetMemory().status();
    if (!s.ok()) {
      ++errors;
      if (++consecutive == 5) break;  // the job is gone
      continue;
    }
    consecutive = 0;
    ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
  }
  std::sort(ms.begin(), ms.end());
  auto pct = [&](double p) {
    return ms.empty() ? 0 : ms[static_cast<size_t>(p * (ms.size() - 1))];
  };
  std::printf(
      "%zu answered queries in %.1f s (%d errors): latency p50 %.2f ms, p90 %.2f ms, p99 %.2f "
      "ms, "
      "max %.2f ms\n",
      ms.size(), absl::ToDoubleSeconds(absl::Now() - start), errors, pct(0.5), pct(0.9), pct(0.99),
      ms.empty() ? 0 : ms.back());
  return ms.empty() ? 1 : 0;
}

int TopJobCommand(const JobContext& ctx) { return TopCommand(&ctx.client, ctx.address, ctx.flags); }

// The commands that talk to a job, and how many arguments each takes.
struct JobCommand {
  const char* name;
  int min_args, max_args;  // after the command's name
  int (*run)(const JobContext&);
};
constexpr JobCommand kJobCommands[] = {
    {"status", 0, 0, StatusCommand},
    {"layout", 0, 0, LayoutCommand},
    {"memory", 0, 0, MemoryCommand},
    {"health", 0, 0, HealthCommand},
    {"set-lr", 0, 1, SetLrCommand},  // (its own usage line when the value is missing)
    {"checkpoint", 0, 0, CheckpointRequestCommand},
    {"abort", 0, 1, AbortCommand},
    {"resize", 0, 0, ResizeCommand},
    {"drain", 0, 0, DrainCommand},
    {"flight-recorder", 0, 0, FlightRecorderJobCommand},
    {"load", 0, 0, LoadCommand},
    {"top", 0, 0, TopJobCommand},
};

// The client of the coordinator the flags and environment name.
absl::StatusOr<std::unique_ptr<CoordinatorClient>> ConnectFromFlags(const Flags& flags,
                                                                    std::string* address) {
  auto env_or = [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v ? v : "");
  };
  *address = flags.Str("coordinator", env_or("SHARDOPT_COORDINATOR"));
  if (address->empty()) {
    return absl::InvalidArgumentError("no coordinator address: pass --coordinator=HOST:PORT");
  }
  std::string token;
  const std::string token_file = flags.Str("token-file", env_or("SHARDOPT_TOKEN_FILE"));
  if (!token_file.empty()) {
    auto t = ReadTokenFile(token_file);
    if (!t.ok()) return t.status();
    token = *t;
  }
  ClientTls tls{flags.Str("tls-ca", env_or("SHARDOPT_TLS_CA")),
                flags.Str("tls-cert", env_or("SHARDOPT_TLS_CERT")),
                flags.Str("tls-key", env_or("SHARDOPT_TLS_KEY"))};
  auto creds = MakeChannelCredentials(tls);
  if (!creds.ok()) return creds.status();
  return std::make_unique<CoordinatorClient>(*address, token, *creds);
}

// Checks the command's arity; the message when it is wrong ("" when right).
std::string ArityError(const JobCommand& c, const std::vector<std::string>& positional) {
  const int n = static_cast<int>(positional.size()) - 1;
  if (n >= c.min_args && n <= c.max_args) return "";
  const std::string cmd = c.name;
  if (cmd == "abort")
    return "usage: shardctl abort REASON (one argument: quote a reason with spaces)";
  if (cmd == "set-lr") return "usage: shardctl set-lr VALUE";
  return absl::StrCat(cmd, " takes no argument, got '", positional[1], "' (see --help)");
}

int Main(int argc, char** argv) {
  // The advisor works offline and has flags of its own.
  if (argc >= 2 && std::string(argv[1]) == "plan") return PlanMain(argc - 1, argv + 1);
  auto flags = Flags::Parse(
      argc, argv,
      {"coordinator", "token-file", "json", "wait", "rate", "duration", "tls-ca", "tls-cert",
       "tls-key", "format", "params", "optimizer", "rank", "ranks", "interval", "once", "help"},
      {"help", "json", "once"});
  if (!flags.ok()) return Fail(std::string(flags.status().message()));
  if (absl::Status s = CheckFlags(*flags); !s.ok() && !flags->Has("help")) {
    return Fail(std::string(s.message()));
  }
  if (flags->Has("help") || flags->positional().empty()) {
    std::printf("%s", kUsage);
    return flags->Has("help") ? 0 : 2;
  }
  const std::string& cmd = flags->positional()[0];
  if (cmd == "checkpoints" || cmd == "inspect" || cmd == "consolidate" || cmd == "import") {
    return CheckpointCommand(flags->positional(), *flags);  // offline: no coordinator
  }
  std::string address;
  auto client = ConnectFromFlags(*flags, &address);
  if (!client.ok()) return Fail(std::string(client.status().message()));
  for (const JobCommand& c : kJobCommands) {
    if (cmd != c.name) continue;
    if (std::string e = ArityError(c, flags->positional()); !e.empty()) return Fail(e);
    const JobContext ctx{**client, *flags, address, *flags->Bool("json", false)};
    return c.run(ctx);
  }
  return Fail(absl::StrCat("unknown command '", cmd, "' (see --help)"));
}

}  // namespace
}  // namespace shardopt

int main(int argc, char** argv) { return shardopt::Main(argc, argv); }
