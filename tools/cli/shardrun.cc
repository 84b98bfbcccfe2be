// shardrun: starts the coordinator and N local ranks, like torchrun.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/coordinator_client.h"
#include "server/coordinator.h"
#include "server/coordinator_service.h"
#include "server/flight_records.h"
#include "server/metrics.h"
#include "server/rpc_server.h"
#include "tools/cli/flags.h"

namespace shardopt {
namespace {

constexpr char kUsage[] = R"(usage: shardrun --nproc N [flags] -- PROGRAM ARGS...

Starts N ranks of PROGRAM on this machine with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT, SHARDOPT_COORDINATOR and SHARDOPT_JOB_ID set (the
variables torchrun sets), and the job's coordinator unless one is given.
Every output line is prefixed with its rank. If a rank fails, the others are
stopped within seconds and shardrun exits non-zero with a one-line reason.
Ctrl-C stops everything cleanly.

flags (a malformed or out-of-range value is refused, naming the flag; exit status 2):
  --nproc=N              ranks on this node, 1..1024 (required)
  --nnodes=N             nodes in the job, 1..1024 (default 1)
  --node-rank=I          this node's index, 0..nnodes-1 (default 0); ranks are
                         I*nproc ... I*nproc+nproc-1
  --coordinator=H:P      use this coordinator instead of starting one (other nodes)
  --bind=HOST            coordinator listen address (default 127.0.0.1; 0.0.0.0 for multi-node)
  --port=P               coordinator port, 0..65535 (default 0: chosen by the OS)
  --port-file=PATH       write the coordinator's host:port here once it listens
  --job-id=ID            job id (default "job")
  --token-file=PATH      require this bearer token on every RPC
  --tls-cert=PEM         serve the coordinator over TLS with this certificate ...
  --tls-key=PEM          ... and key
  --tls-client-ca=PEM    mutual TLS: clients must present a certificate signed by this CA
                         (ranks and shardctl read SHARDOPT_TLS_CA, SHARDOPT_TLS_CERT and
                         SHARDOPT_TLS_KEY from the environment, which shardrun passes on);
                         the ranks' shard-owner services use the same certificate, key
                         and client CA (on other nodes: pass that node's own)
  --master-port=P        MASTER_PORT for torch.distributed in the ranks, 1..65535 (default:
                         node 0 picks a free port and other nodes learn it from the
                         coordinator; it is never the coordinator's own port)
  --heartbeat-timeout=S  a rank silent this long fails the job, seconds in [0.1, 86400]
                         (default 10)
  --metrics-port=P       serve Prometheus metrics over HTTP at --bind:P/metrics, 0..65535
                         (0: chosen by the OS, printed; default: no metrics). Plain HTTP,
                         read-only, no token: see docs/observability.md
  --metrics-port-file=PATH  write the metrics host:port here once it listens
  --slow-factor=X        a rank whose busy time per step (step time minus waiting on
                         collectives) exceeds X times the median of the other ranks' is
                         slow, (1, 1000] (default 1.5) ...
  --slow-windows=K       ... for K windows in a row, 1..1000 (default 3); as many windows
                         under X and it recovers; each change is one line here
  --slow-window=S        the length of one window, seconds in [0.1, 3600] (default 5)
  --help                 this text

Exit status: 0 every rank finished, 1 the job failed, 2 a bad flag, 130 interrupted.
)";

constexpr int64_t kMaxNproc = 1024;
constexpr int64_t kMaxNnodes = 1024;
constexpr double kMaxHeartbeatTimeout = 86400;

std::atomic<int> g_signal{0};
void OnSignal(int sig) { g_signal = sig; }

struct Child {
  int rank = 0;
  pid_t pid = -1;
  int out_fd = -1;
  bool exited = false;
  int status = 0;
};

std::mutex g_out_mu;

void Pump(int fd, int rank) {
  FILE* f = fdopen(fd, "r");
  if (f == nullptr) return;
  char* line = nullptr;
  size_t cap = 0;
  ssize_t n;
  while ((n = getline(&line, &cap, f)) > 0) {
    std::lock_guard<std::mutex> l(g_out_mu);
    std::fprintf(stdout, "[rank %d] %.*s", rank, static_cast<int>(n), line);
    if (line[n - 1] != '\n') std::fputc('\n', stdout);
    std::fflush(stdout);
  }
  free(line);
  fclose(f);
}

int Fail(const std::string& msg) {
  std::fprintf(stderr, "shardrun: %s\n", msg.c_str());
  return 2;
}

// A port nothing listens on now (the OS picks it; closed again at once).
absl::StatusOr<int> FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket(): ", std::strerror(errno)));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    const std::string err = std::strerror(errno);
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot pick a free port for MASTER_PORT: ", err));
  }
  close(fd);
  return static_cast<int>(ntohs(a.sin_port));
}

// MASTER_PORT for the ranks: --master-port, else on node 0 a free port it
// publishes in its coordinator's store; other nodes read it from there.
// What the ranks and shardctl use to reach a TLS coordinator
// (SHARDOPT_TLS_CA, SHARDOPT_TLS_CERT, SHARDOPT_TLS_KEY).
ClientTls ClientTlsFromEnv() {
  ClientTls tls;
  if (const char* v = std::getenv("SHARDOPT_TLS_CA")) tls.ca_file = v;
  if (const char* v = std::getenv("SHARDOPT_TLS_CERT")) tls.cert_file = v;
  if (const char* v = std::getenv("SHARDOPT_TLS_KEY")) tls.key_file = v;
  return tls;
}

absl::StatusOr<int> MasterPort(Coordinator* own, const std::string& address,
                               const std::string& token, const std::string& job_id, int flag) {
  const std::string key = absl::StrCat("shardrun/", job_id, "/master_port");
  if (own != nullptr) {
    int port = flag;
    if (port == 0) {
      auto p = FreePort();
      if (!p.ok()) return p.status();
      port = *p;
    }
    if (absl::Status s = own->KvSet(key, std::to_string(port)); !s.ok()) return s;
    return port;
  }
  if (flag != 0) return flag;
  auto creds = MakeChannelCredentials(ClientTlsFromEnv());
  if (!creds.ok()) return creds.status();
  CoordinatorClient client(address, token, *creds);
  auto v = client.KvGet(key, absl::Seconds(120));
  if (!v.ok()) {
    return absl::Status(v.status().code(),
                        absl::StrCat("cannot learn MASTER_PORT from the coordinator at ", address,
                                     " (pass --master-port): ", v.status().message()));
  }
  int port = 0;
  if (!absl::SimpleAtoi(*v, &port) || port <= 0 || port > 65535) {
    return absl::DataLossError(
        absl::StrCat("the coordinator's MASTER_PORT '", *v, "' is not a port"));
  }
  return port;
}

int Main(int argc, char** argv) {
  auto flags = Flags::Parse(
      argc, argv,
      {"nproc",       "nnodes",       "node-rank",     "coordinator",  "bind",
       "port",        "port-file",    "job-id",        "token-file",   "heartbeat-timeout",
       "tls-cert",    "tls-key",      "tls-client-ca", "metrics-port", "metrics-port-file",
       "slow-factor", "slow-windows", "slow-window",   "master-port",  "help"});
  if (!flags.ok()) return Fail(std::string(flags.status().message()));
  if (flags->Has("help")) {
    std::printf("%s", kUsage);
    return 0;
  }
  if (!flags->positional().empty()) {
    return Fail(
        absl::StrCat("unexpected argument '", flags->positional().front(),
                     "' (the program goes after --: shardrun --nproc N -- PROGRAM ARGS...)"));
  }
  // Every flag is checked before anything starts; a bad value is refused by
  // name, never replaced by its default.
  auto nproc = flags->Int("nproc", 0, 1, kMaxNproc);
  auto nnodes = flags->Int("nnodes", 1, 1, kMaxNnodes);
  auto port = flags->Port("port", 0);
  auto master_port_flag = flags->Port("master-port", 0);
  auto hb = flags->Seconds("heartbeat-timeout", 10, 0.1, kMaxHeartbeatTimeout);
  auto coordinator_flag = flags->NonEmpty("coordinator", "");
  auto bind = flags->NonEmpty("bind", "127.0.0.1");
  auto port_file = flags->NonEmpty("port-file", "");
  auto job_id_flag = flags->NonEmpty("job-id", "job");
  auto token_file_flag = flags->NonEmpty("token-file", "");
  auto tls_cert = flags->NonEmpty("tls-cert", "");
  auto tls_key = flags->NonEmpty("tls-key", "");
  auto tls_client_ca = flags->NonEmpty("tls-client-ca", "");
  auto metrics_port = flags->Port("metrics-port", -1);  // -1: no metrics
  auto metrics_port_file = flags->NonEmpty("metrics-port-file", "");
  auto slow_factor = flags->Double("slow-factor", 1.5, 1, 1000, /*min_exclusive=*/true);
  auto slow_windows = flags->Int("slow-windows", 3, 1, 1000);
  auto slow_window = flags->Seconds("slow-window", 5, 0.1, 3600);
  for (const absl::Status& s :
       {nproc.status(), nnodes.status(), port.status(), hb.status(), coordinator_flag.status(),
        bind.status(), port_file.status(), job_id_flag.status(), token_file_flag.status(),
        tls_cert.status(), tls_key.status(), tls_client_ca.status(), metrics_port.status(),
        metrics_port_file.status(), slow_factor.status(), slow_windows.status(),
        slow_window.status(), master_port_flag.status()}) {
    if (!s.ok()) return Fail(std::string(s.message()));
  }
  if (!metrics_port_file->empty() && *metrics_port < 0) {
    return Fail("--metrics-port-file needs --metrics-port");
  }
  if (!coordinator_flag->empty()) {
    // Metrics and slow ranks are the coordinator's: node 0's shardrun.
    for (const char* f :
         {"metrics-port", "metrics-port-file", "slow-factor", "slow-windows", "slow-window"}) {
      if (flags->Has(f)) {
        return Fail(absl::StrCat("--", f,
                                 " applies to the shardrun that runs the coordinator "
                                 "(node 0), not with --coordinator"));
      }
    }
  }
  if (!flags->Has("nproc")) return Fail("--nproc is required (1..1024; see --help)");
  auto node_rank = flags->Int("node-rank", 0, 0, *nnodes - 1);
  if (!node_rank.ok()) return Fail(std::string(node_rank.status().message()));
  if (flags->rest().empty()) return Fail("no program given: shardrun --nproc N -- PROGRAM ARGS...");
  const int world = static_cast<int>(*nproc * *nnodes);  // at most 1024 * 1024
  const std::string job_id = *job_id_flag;
  std::string token;
  const std::string token_file = *token_file_flag;
  if (!token_file.empty()) {
    auto t = ReadTokenFile(token_file);
    if (!t.ok()) return Fail(std::string(t.status().message()));
    token = *t;
  }

  // The coordinator, unless this node joins someone else's.
  std::unique_ptr<Coordinator> coordinator;
  std::unique_ptr<CoordinatorService> service;
  std::unique_ptr<RpcServer> server;
  std::unique_ptr<MetricsServer> metrics;  // reads the coordinator: goes first
  std::string address = *coordinator_flag;
  if (address.empty()) {
    if (*nnodes > 1 && *node_rank != 0) {
      return Fail("--node-rank > 0 needs --coordinator=HOST:PORT of node 0's shardrun");
    }
    CoordinatorOptions copt;
    copt.job_id = job_id;
    copt.world_size = world;
    copt.heartbeat_timeout = *hb;
    copt.slow_factor = *slow_factor;
    copt.slow_windows = static_cast<int>(*slow_windows);
    copt.slow_window = *slow_window;
    copt.on_event = [](const std::string& line) {
      std::lock_guard<std::mutex> l(g_out_mu);
      std::fprintf(stdout, "shardrun: %s\n", line.c_str());
      std::fflush(stdout);
    };
    coordinator = std::make_unique<Coordinator>(copt);
    service = std::make_unique<CoordinatorService>(coordinator.get(), token);
    if (!tls_cert->empty()) {
      // The ranks serve their shard owners over TLS too (below): reach them so,
      // trusting the CA the ranks use for us (or our own certificate), with
      // the client certificate of mutual TLS when there is one.
      ClientTls owner_tls = ClientTlsFromEnv();
      if (owner_tls.ca_file.empty()) owner_tls.ca_file = *tls_cert;
      auto owner_creds = MakeChannelCredentials(owner_tls);
      if (!owner_creds.ok()) return Fail(owner_creds.status().ToString());
      service->SetOwnerCredentials(*owner_creds);
    }
    RpcServerOptions sopt;
    sopt.address = absl::StrCat(*bind, ":", *port);
    sopt.tls_cert_file = *tls_cert;
    sopt.tls_key_file = *tls_key;
    sopt.tls_client_ca_file = *tls_client_ca;
    auto s = RpcServer::Start(sopt, {service.get()});
    if (!s.ok()) return Fail(s.status().ToString());
    server = std::move(*s);
    address = server->address();
    // Metrics next, so that a failure to serve them leaves no --port-file
    // behind, and --metrics-port-file exists once --port-file does.
    if (*metrics_port >= 0) {
      auto m = MetricsServer::Start(coordinator.get(), *bind, *metrics_port);
      if (!m.ok()) return Fail(std::string(m.status().message()));
      metrics = std::move(*m);
    }
    std::printf("shardrun: coordinator listening on %s (job %s, %d ranks)\n", address.c_str(),
                job_id.c_str(), world);
    if (metrics)
      std::printf("shardrun: metrics on http://%s/metrics\n", metrics->address().c_str());
    std::fflush(stdout);
    // Written whole or not at all (a temporary file renamed).
    auto write_address = [](const std::string& path, const std::string& value,
                            const char* flag) -> absl::Status {
      if (path.empty()) return absl::OkStatus();
      std::ofstream pf(path + ".tmp");
      pf << value << "\n";
      pf.close();
      if (!pf || std::rename((path + ".tmp").c_str(), path.c_str()) != 0) {
        return absl::UnavailableError(
            absl::StrCat("cannot write --", flag, " '", path, "': ", std::strerror(errno)));
      }
      return absl::OkStatus();
    };
    if (metrics) {
      absl::Status w = write_address(*metrics_port_file, metrics->address(), "metrics-port-file");
      if (!w.ok()) return Fail(std::string(w.message()));
    }
    if (absl::Status w = write_address(*port_file, address, "port-file"); !w.ok()) {
      return Fail(std::string(w.message()));
    }
  }
  const std::string master_addr = address.substr(0, address.rfind(':'));
  // MASTER_PORT is torch.distributed's (its TCPStore listens there on rank
  // 0), not the coordinator's: node 0 picks a free port (or --master-port)
  // and publishes it in the coordinator's key-value store for other nodes.
  auto master_port_or = MasterPort(coordinator.get(), address, token, job_id, *master_port_flag);
  if (!master_port_or.ok()) return Fail(std::string(master_port_or.status().message()));
  const std::string master_port = std::to_string(*master_port_or);

  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);

  std::vector<Child> children;
  std::vector<std::thread> pumps;
  for (int local = 0; local < *nproc; ++local) {
    Child c;
    c.rank = static_cast<int>(*node_rank * *nproc + local);
    int fds[2];
    if (pipe(fds) != 0) return Fail("pipe() failed");
    std::vector<std::string> env = {
        absl::StrCat("RANK=", c.rank),      absl::StrCat("WORLD_SIZE=", world),
        absl::StrCat("LOCAL_RANK=", local), absl::StrCat("LOCAL_WORLD_SIZE=", *nproc),
        "MASTER_ADDR=" + master_addr,       "MASTER_PORT=" + master_port,
        "SHARDOPT_COORDINATOR=" + address,  "SHARDOPT_JOB_ID=" + job_id};
    if (!token_file.empty()) env.push_back("SHARDOPT_TOKEN_FILE=" + token_file);
    if (!tls_cert->empty()) {  // the ranks' shard-owner services use TLS as the coordinator does
      env.push_back("SHARDOPT_OWNER_TLS_CERT=" + *tls_cert);
      env.push_back("SHARDOPT_OWNER_TLS_KEY=" + *tls_key);
      if (!tls_client_ca->empty()) env.push_back("SHARDOPT_OWNER_TLS_CLIENT_CA=" + *tls_client_ca);
    }
    std::vector<std::string> args = flags->rest();
    const pid_t parent = getpid();
    pid_t pid = fork();
    if (pid == 0) {
      // Child: die with shardrun, output into the pipe, then exec.
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != parent) _exit(1);
      dup2(fds[1], STDOUT_FILENO);
      dup2(fds[1], STDERR_FILENO);
      close(fds[0]);
      close(fds[1]);
      for (const auto& e : env) putenv(const_cast<char*>(e.c_str()));
      std::vector<char*> argv2;
      for (auto& a : args) argv2.push_back(const_cast<char*>(a.c_str()));
      argv2.push_back(nullptr);
      execvp(argv2[0], argv2.data());
      std::fprintf(stderr, "cannot execute '%s': %s\n", argv2[0], std::strerror(errno));
      _exit(127);
    }
    close(fds[1]);
    if (pid < 0) return Fail("fork() failed");
    c.pid = pid;
    c.out_fd = fds[0];
    children.push_back(c);
    pumps.emplace_back(Pump, fds[0], c.rank);
  }

  // Supervise: the first failure (a rank's exit, the coordinator's verdict,
  // or a signal) stops everything.
  std::string failure;
  int remaining = static_cast<int>(children.size());
  bool stopping = false;
  bool terminated = false;
  absl::Time term_deadline, kill_deadline;
  // The coordinator tells the remaining ranks first (they exit within a
  // heartbeat, naming the cause); SIGTERM after 3 s, SIGKILL after 8 s.
  auto stop_all = [&](const std::string& why, bool now, AbortCause cause) {
    if (stopping) return;
    stopping = true;
    failure = why;
    if (coordinator) coordinator->Abort(why, -1, cause);  // no-op once the job has failed
    term_deadline = absl::Now() + (now || !coordinator ? absl::ZeroDuration() : absl::Seconds(3));
    kill_deadline = term_deadline + absl::Seconds(5);
  };
  while (remaining > 0) {
    for (Child& c : children) {
      if (c.exited) continue;
      int status = 0;
      if (waitpid(c.pid, &status, WNOHANG) == c.pid) {
        c.exited = true;
        c.status = status;
        --remaining;
        const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (!ok && !stopping) {
          std::string why =
              WIFEXITED(status)
                  ? absl::StrCat("rank ", c.rank, " exited with status ", WEXITSTATUS(status))
                  : absl::StrCat("rank ", c.rank, " was killed by signal ", WTERMSIG(status));
          // A rank that exits with an error has usually told the coordinator
          // why first (a non-finite loss, a failed checkpoint): say that.
          if (coordinator && WIFEXITED(status)) {
            JobStatus j = coordinator->GetJob();
            if (j.state == JobState::kFailed && !j.failure.empty())
              why = absl::StrCat(j.failure, " (", why, ")");
          }
          stop_all(why, false, AbortCause::kRankExit);
        }
      }
    }
    if (g_signal.load() != 0 && !stopping) {
      stop_all(absl::StrCat("interrupted (signal ", g_signal.load(), ")"), true,
               AbortCause::kInterrupted);
    }
    if (coordinator && !stopping) {
      JobStatus j = coordinator->GetJob();
      if (j.state == JobState::kFailed) stop_all(j.failure, false, j.failure_cause);
    }
    if (stopping && !terminated && absl::Now() >= term_deadline) {
      terminated = true;
      for (const Child& c : children) {
        if (!c.exited) kill(c.pid, SIGTERM);
      }
    }
    if (stopping && absl::Now() >= kill_deadline) {
      for (const Child& c : children) {
        if (!c.exited) kill(c.pid, SIGKILL);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (auto& t : pumps) t.join();
  metrics.reset();
  if (server) server->Shutdown();
  if (!failure.empty()) {
    std::fprintf(stderr, "shardrun: job failed: %s; stopped all ranks\n", failure.c_str());
    if (service) {  // where the ranks' collectives diverged, from the rings they reported
      const std::string d = ReportedDivergence(service->flight_records(), *coordinator);
      if (!d.empty()) std::fprintf(stderr, "shardrun: flight recorder: %s\n", d.c_str());
    }
    return g_signal.load() != 0 ? 130 : 1;
  }
  std::printf("shardrun: all %zu ranks finished\n", children.size());
  return 0;
}

}  // namespace
}  // namespace shardopt

int main(int argc, char** argv) { return shardopt::Main(argc, argv); }
