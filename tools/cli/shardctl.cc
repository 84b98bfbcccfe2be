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
#include "tools/cli/top_view.h"

namespace shardopt {
namespace {

constexpr char kUsage[] = R"(usage: shardctl [flags] COMMAND

commands:
  status        job state, step, and every rank's heartbeat, loss and throughput
  layout        which rank owns what: per rank and bucket, elements and parameters
  memory        per rank: fp32 master, optimizer state, gradients, parameters, RSS
  health        grpc.health.v1 check of the coordinator
  set-lr X      change the learning rate; every rank applies it at the same next step
  checkpoint    ask the job to save a checkpoint at the next step boundary
                (the trainers need --ckpt-dir)
  abort REASON  fail the job (every rank stops)
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
  --wait=SECONDS      status: wait until the job is running (or failed) first, seconds in
                      [0, 604800] (default 0)
  --rate=N            load: queries per second, in (0, 100000] (default 50)
  --duration=S        load: seconds, in (0, 31536000] (default 10)
  --format=F          consolidate: safetensors | torch (default safetensors)
  --optimizer=NAME    import: adam | adamw | sgd (default adam)
  --params=MODEL.pt   import: the model's state_dict
  --interval=S        top: seconds between refreshes, in [0.1, 3600] (default 1)
  --once              top: print one frame without terminal control (for scripts)
  --rank=R            flight-recorder: only rank R, 0..1048575
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

int CheckpointCommand(const std::vector<std::string>& args, const Flags& flags) {
  const bool json = *flags.Bool("json", false);  // checked by CheckFlags
  FileSystem* fs = PosixFileSystem();
  const std::string& cmd = args[0];
  if (cmd == "import") {
    if (args.size() != 3)
      return Fail("usage: shardctl import OPT.pt OUTDIR [--params=MODEL.pt] [--optimizer=adam]");
    const std::string k = flags.Str("optimizer", "adam");
    OptimizerKind kind = k == "sgd"     ? OptimizerKind::kSgd
                         : k == "adamw" ? OptimizerKind::kAdamW
                                        : OptimizerKind::kAdam;
    if (k != "sgd" && k != "adamw" && k != "adam")
      return Fail("--optimizer must be adam, adamw or sgd");
    absl::Status s = ImportTorch(args[1], flags.Str("params", ""), kind, args[2]);
    if (!s.ok()) return Fail(std::string(s.message()));
    std::printf("imported %s into %s (resume with --resume=%s at any world size)\n",
                args[1].c_str(), args[2].c_str(), args[2].c_str());
    return 0;
  }
  if (cmd == "checkpoints") {
    if (args.size() != 2) return Fail("usage: shardctl checkpoints DIR");
    auto entries = fs->ListDir(args[1]);
    if (!entries.ok()) return Fail(std::string(entries.status().message()));
    auto latest = ResolveCheckpoint(fs, args[1]);
    std::vector<std::pair<int64_t, std::string>> steps;
    for (const auto& e : *entries) {
      int64_t step = 0;
      if (e.size() > 5 && e.rfind("step-", 0) == 0 && absl::SimpleAtoi(e.substr(5), &step) &&
          e == absl::StrCat("step-", step)) {
        steps.push_back({step, e});
      }
    }
    std::sort(steps.begin(), steps.end());
    nlohmann::json out = nlohmann::json::array();
    if (!json)
      std::printf("%-14s %8s %6s %12s  %s\n", "checkpoint", "step", "ranks", "size", "status");
    for (const auto& [step, name] : steps) {
      const std::string dir = args[1] + "/" + name;
      auto m = fs->Kind(dir) == EntryKind::kDirectory
                   ? ReadManifest(fs, dir)
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
      if (!json) {
        std::printf("%-14s %8lld %6d %12s  %s\n", name.c_str(), static_cast<long long>(step), ranks,
                    Bytes(bytes).c_str(), status.c_str());
      }
    }
    if (json) std::printf("%s\n", out.dump(1).c_str());
    return 0;
  }
  if (cmd == "inspect") {
    if (args.size() != 2) return Fail("usage: shardctl inspect CKPT");
    auto dir = ResolveCheckpoint(fs, args[1]);
    if (!dir.ok()) return Fail(std::string(dir.status().message()));
    auto m = ReadManifest(fs, *dir);
    if (!m.ok()) return Fail(std::string(m.status().message()));
    absl::Status v = VerifyCheckpoint(fs, *dir);
    const std::string verdict =
        !v.ok()           ? std::string(v.message())
        : m->self_checked ? "every CRC matches (manifest and shards)"
                          : "every shard CRC matches (a v1 manifest has no CRC of its own)";
    if (json) {
      nlohmann::json out;
      out["path"] = *dir;
      out["format"] = m->format;
      out["step"] = m->step;
      out["world_size"] = m->world_size;
      out["optimizer"] = nlohmann::json::parse(SavedOptimizerJson(m->optimizer));
      out["layout_hash"] = m->layout_hash;
      out["states"] = m->states;
      out["params"] = nlohmann::json::array();
      for (const auto& p : m->params) {
        out["params"].push_back({{"name", p.name},
                                 {"shape", p.shape},
                                 {"dtype", DTypeName(p.dtype)},
                                 {"trainable", p.trainable}});
      }
      out["pieces"] = m->pieces.size();
      out["files"] = nlohmann::json::array();
      for (const auto& f : m->files)
        out["files"].push_back({{"name", f.name}, {"bytes", f.bytes}, {"crc32c", f.crc32c}});
      out["user_metadata"] = m->user_metadata;
      out["verified"] = v.ok();
      if (!v.ok()) out["error"] = std::string(v.message());
      std::printf("%s\n", out.dump(1).c_str());
    } else {
      std::printf("checkpoint %s\n  step %lld, saved by %d ranks, optimizer %s, layout %s\n",
                  dir->c_str(), static_cast<long long>(m->step), m->world_size,
                  SavedOptimizerJson(m->optimizer).c_str(), m->layout_hash.c_str());
      std::printf("  %zu parameters, %zu pieces, states %s\n", m->params.size(), m->pieces.size(),
                  nlohmann::json(m->states).dump().c_str());
      for (const auto& f : m->files) {
        std::printf("  %-28s %12s  crc32c %08x\n", f.name.c_str(), Bytes(f.bytes).c_str(),
                    f.crc32c);
      }
      if (!m->user_metadata.empty()) {
        std::printf("  user metadata %s\n", nlohmann::json(m->user_metadata).dump().c_str());
      }
      std::printf("  verify: %s\n", verdict.c_str());
    }
    return v.ok() ? 0 : 1;
  }
  // consolidate
  if (args.size() != 3)
    return Fail("usage: shardctl consolidate CKPT OUT [--format=safetensors|torch]");
  auto dir = ResolveCheckpoint(fs, args[1]);
  if (!dir.ok()) return Fail(std::string(dir.status().message()));
  const std::string format = flags.Str("format", "safetensors");
  if (format == "torch") {
    const auto t0 = absl::Now();
    absl::Status s = ExportTorch(fs, *dir, args[2]);
    if (!s.ok()) return Fail(std::string(s.message()));
    std::printf("wrote %s (torch.optim state_dict) in %.2f s\n", args[2].c_str(),
                absl::ToDoubleSeconds(absl::Now() - t0));
    return 0;
  }
  if (format != "safetensors") return Fail("--format must be safetensors or torch");
  const auto t0 = absl::Now();
  int last_pct = -1;
  absl::Status s = Consolidate(fs, *dir, args[2], [&](int64_t done, int64_t total) {
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

// ---- shardctl top: a live view of a running job (the frame: tools/cli/top_view.h) ----
//
// The terminal is put in cbreak mode (no echo, no line buffering; Ctrl-C still
// signals) on the alternate screen with the cursor hidden, and restored on
// every way out: q, Ctrl-C / SIGTERM / SIGHUP (exit 128 + signal), an error,
// and a crash (SIGSEGV, SIGABRT, ...: restored, then the signal's default
// action). Ctrl-Z restores it before stopping and re-enters on SIGCONT. A
// background thread fetches the job every --interval, so q answers at once
// even while an RPC waits for an unreachable coordinator.

constexpr char kTopEnter[] = "\x1b[?1049h\x1b[?25l";  // alternate screen, hide the cursor
constexpr char kTopLeave[] = "\x1b[?25h\x1b[?1049l";  // show the cursor, main screen

struct termios g_top_saved;
volatile sig_atomic_t g_top_raw = 0;     // the terminal is ours to restore
volatile sig_atomic_t g_top_signal = 0;  // SIGINT, SIGTERM, SIGHUP or SIGQUIT received
volatile sig_atomic_t g_top_winch = 0;
volatile sig_atomic_t g_top_tstp = 0;
int g_top_wake[2] = {-1, -1};  // self-pipe: signals and new data wake the loop

void TopWake() {
  if (g_top_wake[1] >= 0) {
    const int saved = errno;
    (void)!write(g_top_wake[1], "x", 1);
    errno = saved;
  }
}

// Async-signal-safe.
void TopRestoreTerminal() {
  if (!g_top_raw) return;
  g_top_raw = 0;
  tcsetattr(STDIN_FILENO, TCSANOW, &g_top_saved);
  (void)!write(STDOUT_FILENO, kTopLeave, sizeof(kTopLeave) - 1);
}

void TopOnQuitSignal(int sig) {
  g_top_signal = sig;
  TopWake();
}
void TopOnWinch(int) {
  g_top_winch = 1;
  TopWake();
}
void TopOnTstp(int) {
  g_top_tstp = 1;
  TopWake();
}
void TopOnFatal(int sig) {  // installed with SA_RESETHAND: the re-raise kills
  TopRestoreTerminal();
  raise(sig);
}

bool TopWriteAll(const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    const ssize_t n = write(STDOUT_FILENO, s.data() + done, s.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

// Owns the terminal mode and the signal handlers while `top` runs; the
// destructor puts everything back.
class TopTerminal {
 public:
  TopTerminal() = default;
  TopTerminal(const TopTerminal&) = delete;
  TopTerminal& operator=(const TopTerminal&) = delete;
  ~TopTerminal() {
    TopRestoreTerminal();
    for (auto& [sig, old] : old_actions_) sigaction(sig, &old, nullptr);
    for (int& fd : g_top_wake) {
      if (fd >= 0) close(fd);
      fd = -1;
    }
  }

  absl::Status Start() {
    if (pipe2(g_top_wake, O_CLOEXEC | O_NONBLOCK) != 0) {
      return absl::InternalError(absl::StrCat("top: pipe: ", strerror(errno)));
    }
    Handle(SIGINT, TopOnQuitSignal, 0);
    Handle(SIGTERM, TopOnQuitSignal, 0);
    Handle(SIGHUP, TopOnQuitSignal, 0);
    Handle(SIGQUIT, TopOnQuitSignal, 0);
    Handle(SIGWINCH, TopOnWinch, SA_RESTART);
    Handle(SIGTSTP, TopOnTstp, SA_RESTART);
    for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT})
      Handle(sig, TopOnFatal, SA_RESETHAND);
    return EnterRaw();
  }

  absl::Status EnterRaw() {
    if (tcgetattr(STDIN_FILENO, &g_top_saved) != 0) {
      return absl::FailedPreconditionError(absl::StrCat("top: the terminal: ", strerror(errno)));
    }
    struct termios raw = g_top_saved;
    raw.c_lflag &= ~(ICANON | ECHO);  // ISIG stays: Ctrl-C and Ctrl-Z signal
    raw.c_cc[VMIN] = 1;
    raw.c_cc[VTIME] = 0;
    if (tcsetattr(STDIN_FILENO, TCSANOW, &raw) != 0) {
      return absl::FailedPreconditionError(absl::StrCat("top: the terminal: ", strerror(errno)));
    }
    g_top_raw = 1;
    TopWriteAll(kTopEnter);
    return absl::OkStatus();
  }

  // Ctrl-Z: give the terminal back, stop, take it again when continued.
  absl::Status Suspend() {
    TopRestoreTerminal();
    struct sigaction dfl = {}, mine = {};
    dfl.sa_handler = SIG_DFL;
    sigaction(SIGTSTP, &dfl, &mine);
    raise(SIGTSTP);  // stops here until SIGCONT
    sigaction(SIGTSTP, &mine, nullptr);
    return EnterRaw();
  }

 private:
  void Handle(int sig, void (*fn)(int), int flags) {
    struct sigaction sa = {}, old = {};
    sa.sa_handler = fn;
    sa.sa_flags = flags;
    sigemptyset(&sa.sa_mask);
    if (sigaction(sig, &sa, &old) == 0) old_actions_.push_back({sig, old});
  }
  std::vector<std::pair<int, struct sigaction>> old_actions_;
};

// Fetches the job every `interval` on its own thread; the loop reads the
// latest answer.
class TopPoller {
 public:
  struct Snapshot {
    std::optional<v1::GetJobResponse> job;  // the last answer
    absl::Time job_time;                    // when it came
    absl::Status error;                     // of the last fetch (ok when it answered)
    int64_t fetches = 0;
  };

  TopPoller(CoordinatorClient* client, absl::Duration interval)
      : client_(client), interval_(interval) {
    thread_ = std::thread([this] { Run(); });
  }
  ~TopPoller() {
    if (thread_.joinable() && !Stop(absl::Seconds(30))) thread_.detach();
  }
  // Waits at most `grace` for a fetch in flight; returns false if it is still
  // running (the caller then exits without joining).
  bool Stop(absl::Duration grace) {
    {
      absl::MutexLock l(&mu_);
      stop_ = true;
      if (!mu_.AwaitWithTimeout(absl::Condition(&done_), grace)) return false;
    }
    thread_.join();
    return true;
  }
  void Detach() { thread_.detach(); }
  Snapshot Get() {
    absl::MutexLock l(&mu_);
    return snap_;
  }

 private:
  void Run() {
    // An unreachable coordinator fails fast; a silent one costs at most the
    // deadline (q does not wait for it).
    const absl::Duration deadline = std::clamp(interval_, absl::Seconds(1), absl::Seconds(5));
    absl::MutexLock l(&mu_);
    while (!stop_) {
      mu_.Unlock();
      absl::StatusOr<v1::GetJobResponse> job = client_->GetJob(deadline);
      const absl::Time now = absl::Now();
      mu_.Lock();
      ++snap_.fetches;
      snap_.error = job.status();
      if (job.ok()) {
        snap_.job = std::move(*job);
        snap_.job_time = now;
      }
      TopWake();
      mu_.AwaitWithTimeout(absl::Condition(&stop_), interval_);
    }
    done_ = true;
  }

  CoordinatorClient* const client_;
  const absl::Duration interval_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  Snapshot snap_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// The status line of a live frame: "" while the coordinator answers. What
// matters comes first (the line is cut to the width): who, that it retries,
// how old the data on screen is, then the error itself.
std::string TopStatusLine(const TopPoller::Snapshot& s, const std::string& address,
                          absl::Duration interval) {
  if (s.fetches == 0) return absl::StrCat("connecting to the coordinator at ", address, " ...");
  if (s.error.ok()) return "";
  std::string line = absl::StrFormat("error from %s, retrying every %gs", address,
                                     absl::ToDoubleSeconds(interval));
  if (s.job) {
    absl::StrAppend(&line, absl::StrFormat(" (data from %.0fs ago)",
                                           absl::ToDoubleSeconds(absl::Now() - s.job_time)));
  }
  return absl::StrCat(line, ": ", s.error.message());
}

// One write per frame: each row is cleared, then drawn (clearing after the
// text would erase the last column's character); rows below the frame are
// blanked. Nothing is written past the last row (that would scroll).
std::string TopScreen(const std::vector<std::string>& lines, int height) {
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i)
    absl::StrAppend(&out, "\x1b[", i + 1, ";1H\x1b[2K", lines[i]);
  if (static_cast<int>(lines.size()) < height)
    absl::StrAppend(&out, "\x1b[", lines.size() + 1, ";1H\x1b[J");
  return out;
}

void TopTerminalSize(int* width, int* height) {
  struct winsize ws = {};
  *width = 80;
  *height = 24;
  if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0 && ws.ws_row > 0) {
    *width = ws.ws_col;
    *height = ws.ws_row;
  }
}

int TopLive(CoordinatorClient* client, const std::string& address, absl::Duration interval) {
  if (!isatty(STDIN_FILENO) || !isatty(STDOUT_FILENO)) {
    return Fail("top: needs a terminal on stdin and stdout (use top --once in scripts)");
  }
  const char* no_color = std::getenv("NO_COLOR");
  const char* term_name = std::getenv("TERM");
  const bool highlight =
      !(no_color && *no_color) && !(term_name && std::string(term_name) == "dumb");
  int code = 0;
  bool joined = true;
  std::string error;  // printed once the terminal is back
  {
    TopTerminal term;
    if (absl::Status s = term.Start(); !s.ok()) return Fail(std::string(s.message()));
    auto poller = std::make_unique<TopPoller>(client, interval);
    bool redraw = true;
    while (true) {
      if (g_top_signal) {
        code = 128 + g_top_signal;
        break;
      }
      if (g_top_tstp) {
        g_top_tstp = 0;
        if (absl::Status s = term.Suspend(); !s.ok()) {
          error = std::string(s.message());
          break;
        }
        redraw = true;
      }
      if (g_top_winch) {
        g_top_winch = 0;
        redraw = true;
      }
      if (redraw) {
        redraw = false;
        int width, height;
        TopTerminalSize(&width, &height);
        const TopPoller::Snapshot snap = poller->Get();
        TopViewOptions o;
        o.width = width;
        o.height = height;
        o.highlight = highlight;
        o.status = TopStatusLine(snap, address, interval);
        TopWriteAll(TopScreen(RenderTopView(snap.job ? &*snap.job : nullptr, o), height));
      }
      struct pollfd fds[2] = {{STDIN_FILENO, POLLIN, 0}, {g_top_wake[0], POLLIN, 0}};
      const int n = poll(fds, 2, -1);
      if (n < 0 && errno != EINTR) {
        error = absl::StrCat("top: poll: ", strerror(errno));
        break;
      }
      if (n <= 0) continue;
      if (fds[1].revents & POLLIN) {
        char buf[64];
        while (read(g_top_wake[0], buf, sizeof(buf)) > 0) {
        }
        redraw = true;  // new data (or a signal, handled above)
      }
      if (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) {
        char keys[64];
        const ssize_t k = read(STDIN_FILENO, keys, sizeof(keys));
        if (k == 0 || (k < 0 && errno != EINTR && errno != EAGAIN)) break;  // the terminal is gone
        bool quit = false;
        for (ssize_t i = 0; i < k; ++i) quit |= keys[i] == 'q' || keys[i] == 'Q';
        if (quit) break;
      }
    }
    // Give the terminal back at once; then wait briefly for a fetch in flight.
    TopRestoreTerminal();
    if (!error.empty()) code = Fail(error);
    joined = poller->Stop(absl::Milliseconds(300));
    if (!joined) {
      poller->Detach();
      (void)poller.release();  // its thread still uses it; the process ends below
    }
  }
  if (!joined) {
    // A fetch still waits for its deadline: do not wait for it.
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(code);
  }
  return code;
}

int TopCommand(CoordinatorClient* client, const std::string& address, const Flags& flags) {
  if (flags.positional().size() != 1) {
    return Fail(
        absl::StrCat("top takes no argument, got '", flags.positional()[1], "' (see --help)"));
  }
  if (*flags.Bool("json", false))
    return Fail("top has no --json output (use shardctl status --json)");
  const absl::Duration interval =
      *flags.Seconds("interval", 1, kMinTopInterval, kMaxTopInterval);  // checked
  if (!*flags.Bool("once", false)) return TopLive(client, address, interval);
  // One frame, plain text, no terminal control: for scripts.
  auto job = client->GetJob();
  if (!job.ok()) return Fail(absl::StrCat(job.status().message(), " [", address, "]"));
  TopViewOptions o;
  o.width = 0;
  o.height = 0;
  for (const std::string& line : RenderTopView(&*job, o)) std::printf("%s\n", line.c_str());
  return job->state() == "failed" ? 1 : 0;
}

int Main(int argc, char** argv) {
  auto flags = Flags::Parse(
      argc, argv,
      {"coordinator", "token-file", "json", "wait", "rate", "duration", "tls-ca", "tls-cert",
       "tls-key", "format", "params", "optimizer", "rank", "interval", "once", "help"},
      {"help", "json", "once"});
  if (!flags.ok()) return Fail(std::string(flags.status().message()));
  if (absl::Status s = CheckFlags(*flags); !s.ok() && !flags->Has("help")) {
    return Fail(std::string(s.message()));
  }
  if (flags->Has("help") || flags->positional().empty()) {
    std::printf("%s", kUsage);
    return flags->Has("help") ? 0 : 2;
  }
  const std::string& first = flags->positional()[0];
  if (first == "checkpoints" || first == "inspect" || first == "consolidate" || first == "import") {
    return CheckpointCommand(flags->positional(), *flags);
  }
  const char* env = std::getenv("SHARDOPT_COORDINATOR");
  const std::string address = flags->Str("coordinator", env ? env : "");
  if (address.empty()) return Fail("no coordinator address: pass --coordinator=HOST:PORT");
  std::string token;
  const char* tenv = std::getenv("SHARDOPT_TOKEN_FILE");
  const std::string token_file = flags->Str("token-file", tenv ? tenv : "");
  if (!token_file.empty()) {
    auto t = ReadTokenFile(token_file);
    if (!t.ok()) return Fail(std::string(t.status().message()));
    token = *t;
  }
  const bool json = *flags->Bool("json", false);  // checked by CheckFlags
  auto env_or = [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v ? v : "");
  };
  ClientTls tls{flags->Str("tls-ca", env_or("SHARDOPT_TLS_CA")),
                flags->Str("tls-cert", env_or("SHARDOPT_TLS_CERT")),
                flags->Str("tls-key", env_or("SHARDOPT_TLS_KEY"))};
  auto creds = MakeChannelCredentials(tls);
  if (!creds.ok()) return Fail(std::string(creds.status().message()));
  CoordinatorClient client(address, token, *creds);
  const std::string cmd = flags->positional()[0];
  const size_t nargs = flags->positional().size();
  if ((cmd == "status" || cmd == "layout" || cmd == "memory" || cmd == "health" ||
       cmd == "checkpoint" || cmd == "load") &&
      nargs != 1) {
    return Fail(
        absl::StrCat(cmd, " takes no argument, got '", flags->positional()[1], "' (see --help)"));
  }
  if (cmd == "top") return TopCommand(&client, address, *flags);
  if (cmd == "abort" && nargs > 2) {
    return Fail("usage: shardctl abort REASON (one argument: quote a reason with spaces)");
  }
  auto unreachable = [&](const absl::Status& s) {
    return Fail(absl::StrCat(s.message(), " [", address, "]"));
  };

  if (cmd == "status") {
    auto wait = flags->Double("wait", 0);
    if (!wait.ok()) return Fail(std::string(wait.status().message()));
    const absl::Time deadline = absl::Now() + absl::Seconds(*wait);
    absl::StatusOr<v1::GetJobResponse> job;
    while (true) {
      job = client.GetJob();
      const bool settled = job.ok() && job->state() != "starting";
      if (settled || absl::Now() >= deadline) break;
      absl::SleepFor(absl::Milliseconds(100));
    }
    if (!job.ok()) return unreachable(job.status());
    if (json) return PrintJson(*job);
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
    std::printf("%5s  %-22s %8s %10s %14s %12s\n", "rank", "shard owner", "step", "loss",
                "samples/s", "heartbeat");
    for (const auto& r : job->ranks()) {
      std::printf("%5d  %-22s %8lld %10.5f %14.1f %12s\n", r.rank(),
                  r.address().empty() ? "(not joined)" : r.address().c_str(),
                  static_cast<long long>(r.step()), r.loss(), r.samples_per_s(),
                  r.seconds_since_heartbeat() < 0
                      ? "-"
                      : absl::StrFormat("%.1fs ago%s", r.seconds_since_heartbeat(),
                                        r.alive() ? "" : " DEAD")
                            .c_str());
    }
    return job->state() == "failed" ? 1 : 0;
  }
  if (cmd == "layout") {
    auto l = client.GetLayout();
    if (!l.ok()) return unreachable(l.status());
    if (json) return PrintJson(*l);
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
  if (cmd == "memory") {
    auto m = client.GetMemory();
    if (!m.ok()) return unreachable(m.status());
    if (json) return PrintJson(*m);
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
  if (cmd == "health") {
    auto h = client.Health();
    if (!h.ok()) return unreachable(h.status());
    std::printf("%s\n", json ? absl::StrCat("{\"status\": \"", *h, "\"}").c_str() : h->c_str());
    return *h == "SERVING" ? 0 : 1;
  }
  if (cmd == "set-lr") {
    if (flags->positional().size() != 2) return Fail("usage: shardctl set-lr VALUE");
    double lr = 0;
    if (!absl::SimpleAtod(flags->positional()[1], &lr)) {
      return Fail(absl::StrCat("set-lr: '", flags->positional()[1], "' is not a number"));
    }
    if (absl::Status s = ValidateLearningRateChange(lr); !s.ok()) {
      return Fail(absl::StrCat("set-lr: ", s.message()));
    }
    auto v = client.SetLearningRate(lr);
    if (!v.ok() && v.status().code() == absl::StatusCode::kInvalidArgument) {
      // Refused by the coordinator (the same rule, checked there too).
      return Fail(absl::StrCat(v.status().message(), "; the job's learning rate is unchanged"));
    }
    if (!v.ok()) return unreachable(v.status());
    std::printf("learning rate %g requested (version %lld); ranks apply it at their next step\n",
                lr, static_cast<long long>(*v));
    return 0;
  }
  if (cmd == "checkpoint") {
    auto r = client.RequestCheckpoint();
    if (!r.ok()) return unreachable(r.status());
    std::printf(
        "checkpoint requested (request %lld); every rank saves at the same next step "
        "boundary\n",
        static_cast<long long>(*r));
    return 0;
  }
  if (cmd == "abort") {
    const std::string reason = flags->positional().size() > 1 ? flags->positional()[1] : "";
    absl::Status s = client.Abort(reason.empty() ? "aborted with shardctl" : reason, -1);
    if (!s.ok()) return unreachable(s);
    std::printf("job aborted\n");
    return 0;
  }
  if (cmd == "flight-recorder") {
    if (nargs != 1) return Fail("flight-recorder takes no argument (see --help)");
    return FlightRecorderCommand(client, json, *flags->Int("rank", -1, 0, (1 << 20) - 1),
                                 unreachable);
  }
  if (cmd == "load") {
    auto rate = flags->Double("rate", 50);
    auto duration = flags->Double("duration", 10);
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
      absl::Status s = i % 3 == 0   ? client.GetJob().status()
                       : i % 3 == 1 ? client.GetLayout().status()
                                    : client.GetMemory().status();
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
        ms.size(), absl::ToDoubleSeconds(absl::Now() - start), errors, pct(0.5), pct(0.9),
        pct(0.99), ms.empty() ? 0 : ms.back());
    return ms.empty() ? 1 : 0;
  }
  return Fail(absl::StrCat("unknown command '", cmd, "' (see --help)"));
}

}  // namespace
}  // namespace shardopt

int main(int argc, char** argv) { return shardopt::Main(argc, argv); }
