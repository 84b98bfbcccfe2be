// shardrun: starts the coordinator and N local ranks, like torchrun.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/coordinator_client.h"
#include "client/launch_environment.h"
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
  --join=H:P             grow the running elastic job whose coordinator is H:P by --nproc
                         ranks, started here: they take their state from the job's ranks
                         (docs/elastic.md). The job's shardrun serves the coordinator until
                         these ranks finish too
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
  --max-restarts=N       when the job fails (a rank exits or is killed, or the coordinator
                         fails it), start it again up to N times, 0..1000 (default 0): the
                         ranks that failed first are left out, the others start again with
                         SHARDOPT_RESTART=K set, and shardopt_train (or a script that reads
                         it) resumes from its --ckpt-dir's last complete checkpoint; one line
                         says which ranks were lost and how many steps. One node only
  --min-ranks=M          restart only with at least M ranks, 1..1024 (default 1)
  --max-nproc=M          the most ranks shardctl resize may grow the job to, started here,
                         nproc..1024 (default: twice --nproc or the CPU count, whichever is
                         more); a larger grow is refused. One node only
  --replicate-shards=K   every K steps each rank keeps its optimizer state and its
                         successor's in memory; when a rank dies the others drop it and go
                         on from there, without a restart (shardopt_train; one node;
                         docs/elastic.md). With --max-restarts, a loss the replicas cannot
                         cover (none yet, a second loss) restarts from the checkpoint
  --help                 this text

Under srun (one shardrun per node: srun --ntasks-per-node=1 shardrun --nproc K -- ...)
or as the pods of a Kubernetes Indexed Job, --nnodes, --node-rank and --job-id come from
the launcher (SLURM_NTASKS, SLURM_PROCID, SLURM_JOB_ID; JOB_COMPLETION_INDEX and
WORLD_SIZE): node 0 serves the coordinator on 0.0.0.0:PORT and the others dial HOST:PORT,
where HOST is $MASTER_ADDR, else the step's first node, and PORT is --port, else
$SHARDOPT_PORT, else one derived from the Slurm job and step ids (Kubernetes: 29400).
Giving --nnodes, --node-rank or --coordinator turns this off (docs/slurm.md).

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

// What the ranks and shardctl use to reach a TLS coordinator
// (SHARDOPT_TLS_CA, SHARDOPT_TLS_CERT, SHARDOPT_TLS_KEY).
ClientTls ClientTlsFromEnv() {
  ClientTls tls;
  if (const char* v = std::getenv("SHARDOPT_TLS_CA")) tls.ca_file = v;
  if (const char* v = std::getenv("SHARDOPT_TLS_CERT")) tls.cert_file = v;
  if (const char* v = std::getenv("SHARDOPT_TLS_KEY")) tls.key_file = v;
  return tls;
}

// MASTER_PORT for the ranks: --master-port, else on node 0 a free port it
// publishes in its coordinator's store; other nodes read it from there.
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
  if (absl::Status s = client.WaitUntilReachable(absl::Seconds(120)); !s.ok()) return s;
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

// Every flag's value, all checked before anything starts.
struct RunConfig {
  int64_t nproc = 0;
  int64_t nnodes = 1;
  int64_t node_rank = 0;
  int world = 0;            // nproc * nnodes
  std::string join;         // --join: the coordinator of the running job these ranks grow
  int rank_offset = 0;      // --join: the rank of this shardrun's first
  std::string coordinator;  // --coordinator; empty: this shardrun starts one
  std::string advertise;    // the address the ranks dial when it is not the listening one
  std::string launcher;     // "slurm" or "kubernetes" when their variables set the nodes
  std::string bind;
  int port = 0;
  std::string port_file;
  std::string job_id;
  std::string token_file;
  std::string token;  // read from token_file
  std::string tls_cert, tls_key, tls_client_ca;
  int master_port = 0;  // 0: node 0 picks one
  absl::Duration heartbeat_timeout;
  int metrics_port = -1;  // -1: no metrics
  std::string metrics_port_file;
  double slow_factor = 1.5;
  int64_t slow_windows = 3;
  absl::Duration slow_window;
  int64_t max_restarts = 0;     // --max-restarts
  int restart = 0;              // this attempt: 0, then 1.. after each restart
  int64_t failed_step = 0;      // the step the ranks had reached when the last attempt failed
  int64_t saved_step = -1;      // the newest checkpoint rank 0 reported in any attempt (-1: none)
  std::string last_restart;     // the last restart's line (shardctl status shows it)
  int64_t min_ranks = 1;        // --min-ranks
  int64_t replicate_every = 0;  // --replicate-shards: in-memory replicas every K steps
  int64_t max_nproc = 0;        // --max-nproc: the most ranks a grow brings this node to
  std::vector<std::string> program;  // PROGRAM ARGS...
};

// Reads every flag's value into `cfg`; the first malformed or out-of-range one
// is refused by name, never replaced by its default.
absl::Status ReadFlagValues(const Flags& flags, RunConfig* cfg) {
  auto nproc = flags.Int("nproc", 0, 1, kMaxNproc);
  auto nnodes = flags.Int("nnodes", 1, 1, kMaxNnodes);
  auto port = flags.Port("port", 0);
  auto master_port_flag = flags.Port("master-port", 0);
  auto hb = flags.Seconds("heartbeat-timeout", 10, 0.1, kMaxHeartbeatTimeout);
  auto coordinator_flag = flags.NonEmpty("coordinator", "");
  auto join = flags.NonEmpty("join", "");
  auto bind = flags.NonEmpty("bind", "127.0.0.1");
  auto port_file = flags.NonEmpty("port-file", "");
  auto job_id_flag = flags.NonEmpty("job-id", "job");
  auto token_file_flag = flags.NonEmpty("token-file", "");
  auto tls_cert = flags.NonEmpty("tls-cert", "");
  auto tls_key = flags.NonEmpty("tls-key", "");
  auto tls_client_ca = flags.NonEmpty("tls-client-ca", "");
  auto metrics_port = flags.Port("metrics-port", -1);  // -1: no metrics
  auto metrics_port_file = flags.NonEmpty("metrics-port-file", "");
  auto slow_factor = flags.Double("slow-factor", 1.5, 1, 1000, /*min_exclusive=*/true);
  auto slow_windows = flags.Int("slow-windows", 3, 1, 1000);
  auto slow_window = flags.Seconds("slow-window", 5, 0.1, 3600);
  auto max_restarts = flags.Int("max-restarts", 0, 0, 1000);
  auto min_ranks = flags.Int("min-ranks", 1, 1, kMaxNproc);
  auto replicate = flags.Int("replicate-shards", 0, 1, 1000000);
  auto max_nproc = flags.Int("max-nproc", 0, 1, kMaxNproc);
  for (const absl::Status& s : {nproc.status(),
                                nnodes.status(),
                                port.status(),
                                hb.status(),
                                coordinator_flag.status(),
                                join.status(),
                                bind.status(),
                                port_file.status(),
                                job_id_flag.status(),
                                token_file_flag.status(),
                                tls_cert.status(),
                                tls_key.status(),
                                tls_client_ca.status(),
                                metrics_port.status(),
                                metrics_port_file.status(),
                                slow_factor.status(),
                                slow_windows.status(),
                                slow_window.status(),
                                master_port_flag.status(),
                                max_restarts.status(),
                                min_ranks.status(),
                                replicate.status(),
                                max_nproc.status()}) {
    if (!s.ok()) return s;
  }
  cfg->nproc = *nproc;
  cfg->nnodes = *nnodes;
  cfg->port = *port;
  cfg->master_port = *master_port_flag;
  cfg->heartbeat_timeout = *hb;
  cfg->coordinator = *coordinator_flag;
  cfg->join = *join;
  cfg->bind = *bind;
  cfg->port_file = *port_file;
  cfg->job_id = *job_id_flag;
  cfg->token_file = *token_file_flag;
  cfg->tls_cert = *tls_cert;
  cfg->tls_key = *tls_key;
  cfg->tls_client_ca = *tls_client_ca;
  cfg->metrics_port = *metrics_port;
  cfg->metrics_port_file = *metrics_port_file;
  cfg->slow_factor = *slow_factor;
  cfg->slow_windows = *slow_windows;
  cfg->slow_window = *slow_window;
  cfg->max_restarts = *max_restarts;
  cfg->min_ranks = *min_ranks;
  cfg->replicate_every = *replicate;
  cfg->max_nproc = *max_nproc;
  return absl::OkStatus();
}

// The checks that involve more than one flag, then --node-rank (bounded by
// --nnodes) and the program.
absl::Status CheckFlagCombinations(const Flags& flags, RunConfig* cfg) {
  if (!cfg->join.empty()) {
    // The job, its coordinator and its restarts are another shardrun's.
    for (const char* f : {"coordinator",
                          "nnodes",
                          "node-rank",
                          "bind",
                          "port",
                          "port-file",
                          "job-id",
                          "tls-cert",
                          "tls-key",
                          "tls-client-ca",
                          "heartbeat-timeout",
                          "metrics-port",
                          "metrics-port-file",
                          "slow-factor",
                          "slow-windows",
                          "slow-window",
                          "max-restarts",
                          "min-ranks",
                          "replicate-shards",
                          "max-nproc"}) {
      if (flags.Has(f)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", f, " applies to the shardrun that runs the job, not with --join"));
      }
    }
  }
  if (!cfg->metrics_port_file.empty() && cfg->metrics_port < 0) {
    return absl::InvalidArgumentError("--metrics-port-file needs --metrics-port");
  }
  if (!cfg->coordinator.empty() && cfg->launcher.empty()) {
    // Metrics and slow ranks are the coordinator's: node 0's shardrun (under
    // srun every node gets the same flags, and node 0's take effect).
    for (const char* f :
         {"metrics-port", "metrics-port-file", "slow-factor", "slow-windows", "slow-window"}) {
      if (flags.Has(f)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", f,
                         " applies to the shardrun that runs the coordinator "
                         "(node 0), not with --coordinator"));
      }
    }
  }
  if (!flags.Has("nproc")) {
    return absl::InvalidArgumentError("--nproc is required (1..1024; see --help)");
  }
  auto node_rank = flags.Int("node-rank", cfg->node_rank, 0, cfg->nnodes - 1);
  if (!node_rank.ok()) return node_rank.status();
  cfg->node_rank = *node_rank;
  if (flags.rest().empty()) {
    return absl::InvalidArgumentError("no program given: shardrun --nproc N -- PROGRAM ARGS...");
  }
  cfg->program = flags.rest();
  cfg->world = static_cast<int>(cfg->nproc * cfg->nnodes);  // at most 1024 * 1024
  if (cfg->max_restarts > 0 && (cfg->nnodes > 1 || !cfg->coordinator.empty())) {
    return absl::InvalidArgumentError(
        "--max-restarts works on one node (--nnodes=1, no --coordinator): the shardrun that "
        "restarts the job must start every rank");
  }
  if (cfg->replicate_every > 0 && (cfg->nnodes > 1 || !cfg->coordinator.empty())) {
    return absl::InvalidArgumentError(
        "--replicate-shards works on one node (--nnodes=1, no --coordinator): the shardrun that "
        "sees a rank die must run the job's coordinator");
  }
  if (flags.Has("max-nproc")) {
    if (cfg->nnodes > 1 || !cfg->coordinator.empty()) {
      return absl::InvalidArgumentError(
          "--max-nproc applies on one node (--nnodes=1, no --coordinator): elsewhere a job grows "
          "only by shardrun --join");
    }
    if (cfg->max_nproc < cfg->nproc) {
      return absl::InvalidArgumentError(
          absl::StrCat("--max-nproc=", cfg->max_nproc, " is less than --nproc=", cfg->nproc));
    }
  } else {
    const int64_t cpus = std::max(1u, std::thread::hardware_concurrency());
    cfg->max_nproc = std::min(kMaxNproc, std::max(2 * cfg->nproc, cpus));
  }
  if (cfg->min_ranks > cfg->world) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--min-ranks=", cfg->min_ranks, " is more than the job's ", cfg->world, " ranks"));
  }
  return absl::OkStatus();
}

// Under srun or a Kubernetes Indexed Job without --nnodes, --node-rank and
// --coordinator: one shardrun per node, whose index, count and coordinator
// come from the launcher (LaunchEnvironment, PlanRendezvous).
absl::Status ApplyLaunchEnvironment(const Flags& flags, RunConfig* cfg) {
  auto launch = ReadLaunchEnvironment();
  if (!launch.ok()) return launch.status();
  if (!launch->note.empty()) std::fprintf(stderr, "shardrun: %s\n", launch->note.c_str());
  if (launch->launcher != "slurm" && launch->launcher != "kubernetes") return absl::OkStatus();
  if (flags.Has("nnodes") || flags.Has("node-rank") || flags.Has("coordinator") ||
      flags.Has("join")) {
    return absl::OkStatus();
  }
  if (launch->launcher == "slurm" && launch->world_size != launch->num_nodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("under srun, shardrun starts its node's ranks itself: run one per node (srun "
                     "--ntasks-per-node=1 shardrun --nproc K ...); this step has ",
                     launch->world_size, " tasks on ", launch->num_nodes, " nodes"));
  }
  auto rdv = PlanRendezvous(*launch);
  if (!rdv.ok()) return rdv.status();
  if (launch->world_size > kMaxNnodes) {
    return absl::InvalidArgumentError(
        absl::StrCat(launch->world_size, " nodes: at most ", kMaxNnodes));
  }
  cfg->launcher = launch->launcher;
  cfg->nnodes = launch->world_size;
  cfg->node_rank = launch->rank;
  if (!flags.Has("job-id")) cfg->job_id = rdv->job_id;
  // --port (the same on every node under srun) wins over the planned one.
  const size_t colon = rdv->coordinator.rfind(':');
  const std::string host = rdv->coordinator.substr(0, colon);
  int port = cfg->port;
  if (!flags.Has("port") && !absl::SimpleAtoi(rdv->coordinator.substr(colon + 1), &port)) {
    return absl::InternalError(absl::StrCat("bad coordinator address ", rdv->coordinator));
  }
  if (!rdv->host_coordinator) {
    cfg->coordinator = absl::StrCat(host, ":", port);
    return absl::OkStatus();
  }
  cfg->port = port;
  cfg->advertise = absl::StrCat(host, ":", port);
  if (!flags.Has("bind")) cfg->bind = "0.0.0.0";
  return absl::OkStatus();
}

// Parses and checks the command line into `cfg` and reads the token. Returns
// the exit status when shardrun must stop here (0 after --help; 2 after a
// bad flag's message), nullopt to go on.
std::optional<int> ParseFlags(int argc, char** argv, RunConfig* cfg) {
  auto flags = Flags::Parse(
      argc, argv,
      {"nproc",       "nnodes",       "node-rank",        "coordinator",  "bind",
       "port",        "port-file",    "job-id",           "token-file",   "heartbeat-timeout",
       "tls-cert",    "tls-key",      "tls-client-ca",    "metrics-port", "metrics-port-file",
       "slow-factor", "slow-windows", "slow-window",      "master-port",  "max-restarts",
       "min-ranks",   "join",         "replicate-shards", "max-nproc",    "help"});
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
  if (absl::Status s = ReadFlagValues(*flags, cfg); !s.ok()) return Fail(std::string(s.message()));
  if (absl::Status s = ApplyLaunchEnvironment(*flags, cfg); !s.ok()) {
    return Fail(std::string(s.message()));
  }
  if (absl::Status s = CheckFlagCombinations(*flags, cfg); !s.ok()) {
    return Fail(std::string(s.message()));
  }
  if (!cfg->token_file.empty()) {
    auto t = ReadTokenFile(cfg->token_file);
    if (!t.ok()) return Fail(std::string(t.status().message()));
    cfg->token = *t;
  }
  return std::nullopt;
}

// The job's coordinator and what serves it, all empty when this node joins
// another node's coordinator (--coordinator). Destroyed in reverse order.
struct CoordinatorServers {
  std::unique_ptr<Coordinator> coordinator;
  std::unique_ptr<CoordinatorService> service;
  std::unique_ptr<RpcServer> server;
  std::unique_ptr<MetricsServer> metrics;  // reads the coordinator: goes first
  std::string address;                     // the coordinator's host:port
};

// `s` with its whole text (code included) as its message, for the errors
// shardrun reports that way.
absl::Status WithCode(const absl::Status& s) { return absl::Status(s.code(), s.ToString()); }

// Writes `value` to `path` (unless empty) whole or not at all: a temporary
// file renamed.
absl::Status WriteAddressFile(const std::string& path, const std::string& value, const char* flag) {
  if (path.empty()) return absl::OkStatus();
  std::ofstream pf(path + ".tmp");
  pf << value << "\n";
  pf.close();
  if (!pf || std::rename((path + ".tmp").c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot write --", flag, " '", path, "': ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

// Creates the coordinator and starts its RPC server on --bind:--port.
absl::Status StartCoordinator(const RunConfig& cfg, CoordinatorServers* servers) {
  if (cfg.nnodes > 1 && cfg.node_rank != 0) {
    return absl::InvalidArgumentError(
        "--node-rank > 0 needs --coordinator=HOST:PORT of node 0's shardrun");
  }
  CoordinatorOptions copt;
  copt.job_id = cfg.job_id;
  copt.world_size = cfg.world;
  copt.heartbeat_timeout = cfg.heartbeat_timeout;
  copt.slow_factor = cfg.slow_factor;
  copt.slow_windows = static_cast<int>(cfg.slow_windows);
  copt.slow_window = cfg.slow_window;
  copt.restarts = cfg.restart;
  copt.last_restart = cfg.last_restart;
  // A job on one node grows by itself: its shardrun starts the new ranks (RunOnce).
  copt.max_grow_world =
      cfg.nnodes == 1 && cfg.coordinator.empty() ? static_cast<int>(cfg.max_nproc) : 0;
  copt.on_event = [](const std::string& line) {
    std::lock_guard<std::mutex> l(g_out_mu);
    std::fprintf(stdout, "shardrun: %s\n", line.c_str());
    std::fflush(stdout);
  };
  servers->coordinator = std::make_unique<Coordinator>(copt);
  servers->service = std::make_unique<CoordinatorService>(servers->coordinator.get(), cfg.token);
  if (!cfg.tls_cert.empty()) {
    // The ranks serve their shard owners over TLS too (SpawnRank): reach them
    // so, trusting the CA the ranks use for us (or our own certificate), with
    // the client certificate of mutual TLS when there is one.
    ClientTls owner_tls = ClientTlsFromEnv();
    if (owner_tls.ca_file.empty()) owner_tls.ca_file = cfg.tls_cert;
    auto owner_creds = MakeChannelCredentials(owner_tls);
    if (!owner_creds.ok()) return WithCode(owner_creds.status());
    servers->service->SetOwnerCredentials(*owner_creds);
  }
  RpcServerOptions sopt;
  sopt.address = absl::StrCat(cfg.bind, ":", cfg.port);
  sopt.tls_cert_file = cfg.tls_cert;
  sopt.tls_key_file = cfg.tls_key;
  sopt.tls_client_ca_file = cfg.tls_client_ca;
  auto s = RpcServer::Start(sopt, {servers->service.get()});
  if (!s.ok()) return WithCode(s.status());
  servers->server = std::move(*s);
  servers->address = cfg.advertise.empty() ? servers->server->address() : cfg.advertise;
  return absl::OkStatus();
}

// The coordinator, unless this node joins someone else's: started with its
// metrics, announced, and its addresses written to --metrics-port-file and
// --port-file.
absl::Status ServeCoordinator(const RunConfig& cfg, CoordinatorServers* servers) {
  if (!cfg.coordinator.empty()) {
    servers->address = cfg.coordinator;
    return absl::OkStatus();
  }
  if (absl::Status s = StartCoordinator(cfg, servers); !s.ok()) return s;
  // Metrics next, so that a failure to serve them leaves no --port-file
  // behind, and --metrics-port-file exists once --port-file does.
  if (cfg.metrics_port >= 0) {
    auto m = MetricsServer::Start(servers->coordinator.get(), cfg.bind, cfg.metrics_port);
    if (!m.ok()) return m.status();
    servers->metrics = std::move(*m);
  }
  std::printf("shardrun: coordinator listening on %s (%sjob %s, %d ranks)\n",
              servers->address.c_str(), cfg.launcher.empty() ? "" : (cfg.launcher + " ").c_str(),
              cfg.job_id.c_str(), cfg.world);
  if (servers->metrics) {
    std::printf("shardrun: metrics on http://%s/metrics\n", servers->metrics->address().c_str());
  }
  std::fflush(stdout);
  if (servers->metrics) {
    absl::Status w =
        WriteAddressFile(cfg.metrics_port_file, servers->metrics->address(), "metrics-port-file");
    if (!w.ok()) return w;
  }
  return WriteAddressFile(cfg.port_file, servers->address, "port-file");
}

void InstallSignalHandlers() {
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
}

// The ranks this shardrun started and the threads copying their output.
// Destroyed in reverse order: the threads first.
struct Ranks {
  std::vector<Child> children;
  std::vector<std::thread> pumps;
};

// The environment a rank adds: torchrun's variables and shardopt's.
std::vector<std::string> RankEnv(const RunConfig& cfg, int rank, int local,
                                 const std::string& address, const std::string& master_port) {
  const std::string master_addr = address.substr(0, address.rfind(':'));
  std::vector<std::string> env = {
      absl::StrCat("RANK=", rank),        absl::StrCat("WORLD_SIZE=", cfg.world),
      absl::StrCat("LOCAL_RANK=", local), absl::StrCat("LOCAL_WORLD_SIZE=", cfg.nproc),
      "MASTER_ADDR=" + master_addr,       "MASTER_PORT=" + master_port,
      "SHARDOPT_COORDINATOR=" + address,  "SHARDOPT_JOB_ID=" + cfg.job_id};
  if (!cfg.token_file.empty()) env.push_back("SHARDOPT_TOKEN_FILE=" + cfg.token_file);
  if (cfg.max_restarts > 0) env.push_back(absl::StrCat("SHARDOPT_RESTART=", cfg.restart));
  if (cfg.restart > 0) env.push_back(absl::StrCat("SHARDOPT_RESTART_STEP=", cfg.failed_step));
  if (cfg.replicate_every > 0) {
    env.push_back(absl::StrCat("SHARDOPT_REPLICATE_EVERY=", cfg.replicate_every));
  }
  if (!cfg.tls_cert.empty()) {  // the ranks' shard-owner services use TLS as the coordinator does
    env.push_back("SHARDOPT_OWNER_TLS_CERT=" + cfg.tls_cert);
    env.push_back("SHARDOPT_OWNER_TLS_KEY=" + cfg.tls_key);
    if (!cfg.tls_client_ca.empty()) {
      env.push_back("SHARDOPT_OWNER_TLS_CLIENT_CA=" + cfg.tls_client_ca);
    }
  }
  return env;
}

// In the forked child: die with shardrun (`parent`), output into the pipe
// `fds`, then exec `args` with `env` added.
[[noreturn]] void ExecRank(const int fds[2], pid_t parent, const std::vector<std::string>& env,
                           const std::vector<std::string>& args) {
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != parent) _exit(1);
  dup2(fds[1], STDOUT_FILENO);
  dup2(fds[1], STDERR_FILENO);
  close(fds[0]);
  close(fds[1]);
  for (const auto& e : env) putenv(const_cast<char*>(e.c_str()));
  std::vector<char*> argv2;
  for (const auto& a : args) argv2.push_back(const_cast<char*>(a.c_str()));
  argv2.push_back(nullptr);
  execvp(argv2[0], argv2.data());
  std::fprintf(stderr, "cannot execute '%s': %s\n", argv2[0], std::strerror(errno));
  _exit(127);
}

// Starts this node's rank `local`, its output prefixed by a Pump thread.
// join_epoch > 0: a rank that grows the running job (a live resize) to
// cfg.world ranks, as rank `local` of it.
absl::Status SpawnRank(const RunConfig& cfg, int local, const std::string& address,
                       const std::string& master_port, Ranks* ranks, int64_t join_epoch = 0) {
  Child c;
  c.rank = static_cast<int>(cfg.rank_offset + cfg.node_rank * cfg.nproc + local);
  int fds[2];
  if (pipe(fds) != 0) return absl::InternalError("pipe() failed");
  std::vector<std::string> env = RankEnv(cfg, c.rank, local, address, master_port);
  if (join_epoch > 0) env.push_back(absl::StrCat("SHARDOPT_JOIN_EPOCH=", join_epoch));
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) ExecRank(fds, parent, env, cfg.program);
  close(fds[1]);
  if (pid < 0) return absl::InternalError("fork() failed");
  c.pid = pid;
  c.out_fd = fds[0];
  ranks->children.push_back(c);
  ranks->pumps.emplace_back(Pump, fds[0], c.rank);
  return absl::OkStatus();
}

// Watches the ranks until every one has exited. The first failure (a rank's
// exit, the coordinator's verdict, or a signal) stops everything: the
// coordinator tells the remaining ranks first (they exit within a heartbeat,
// naming the cause); SIGTERM after 3 s, SIGKILL after 8 s.
class Supervisor {
 public:
  // `grow(from, to, epoch)`: starts ranks from..to-1 of a job growing to
  // `to` ranks (a live resize the coordinator accepted); null: this
  // shardrun cannot.
  using Grow = std::function<absl::Status(int from, int to, int64_t epoch)>;
  // recover_losses: a rank that dies is dropped and the others go on from
  // their in-memory replicas (--replicate-shards) when the coordinator can.
  Supervisor(Coordinator* coordinator, std::vector<Child>* children, Grow grow = nullptr,
             bool recover_losses = false)
      : coordinator_(coordinator),
        children_(children),
        remaining_(static_cast<int>(children->size())),
        grow_(std::move(grow)),
        recover_losses_(recover_losses) {}
  // Ranks lost and recovered from replicas.
  int recovered() const { return recovered_; }

  // The ranks whose own exit failed the job (empty when the coordinator or
  // a signal stopped it).
  const std::vector<int>& lost() const { return lost_; }
  // The job as the coordinator saw it when it was stopped (the steps the
  // ranks had reached, the last checkpoint).
  const JobStatus& at_failure() const { return at_failure_; }
  // Ranks' processes still running when the job was stopped (not those that
  // had exited: the one whose exit stopped it, ranks a resize let go).
  int alive_at_stop() const { return alive_at_stop_; }
  // Whether ranks started by another shardrun (--join) joined the job.
  bool had_external_ranks() const { return had_external_ranks_; }

  // The reason the job was stopped; empty when every rank finished.
  std::string Run() {
    while (remaining_ > 0) {
      ReapExited();
      if (g_signal.load() != 0 && !stopping_) {
        StopAll(absl::StrCat("interrupted (signal ", g_signal.load(), ")"), true,
                AbortCause::kInterrupted);
      }
      if (coordinator_ && !stopping_) {
        JobStatus j = coordinator_->GetJob();
        if (j.state == JobState::kFailed) StopAll(j.failure, false, j.failure_cause);
        if (j.resize && j.resize->external) had_external_ranks_ = true;
        if (!stopping_ && grow_ && j.resize && !j.resize->external &&
            j.resize->to_world > j.resize->from_world && j.resize->request > grown_request_) {
          grown_request_ = j.resize->request;
          const size_t before = children_->size();
          absl::Status s = grow_(j.resize->from_world, j.resize->to_world, j.resize->epoch);
          remaining_ += static_cast<int>(children_->size() - before);
          if (!s.ok()) {
            StopAll(absl::StrCat("starting the ranks of a resize to ", j.resize->to_world,
                                 " failed: ", s.message()),
                    true, AbortCause::kRequest);
          }
        }
      }
      SignalRemaining();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    // Every rank has exited: the survivors' last heartbeats are in.
    if (stopping_ && coordinator_) at_failure_ = coordinator_->GetJob();
    return failure_;
  }

 private:
  void StopAll(const std::string& why, bool now, AbortCause cause) {
    if (stopping_) return;
    stopping_ = true;
    alive_at_stop_ = 0;
    for (const Child& c : *children_) alive_at_stop_ += c.exited ? 0 : 1;
    failure_ = why;
    if (coordinator_) coordinator_->Abort(why, -1, cause);  // no-op once the job has failed
    term_deadline_ = absl::Now() + (now || !coordinator_ ? absl::ZeroDuration() : absl::Seconds(3));
    kill_deadline_ = term_deadline_ + absl::Seconds(5);
  }

  // Collects the ranks that exited; the first to fail stops the others.
  void ReapExited() {
    for (Child& c : *children_) {
      if (c.exited) continue;
      int status = 0;
      if (waitpid(c.pid, &status, WNOHANG) != c.pid) continue;
      c.exited = true;
      c.status = status;
      --remaining_;
      const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (!ok && !stopping_ && recover_losses_ && coordinator_) {
        auto r = coordinator_->RecoverLoss(c.pid, ExitReason(c.rank, status));
        if (r.ok()) {
          ++recovered_;
          continue;
        }
        std::lock_guard<std::mutex> l(g_out_mu);
        std::printf("shardrun: cannot recover from the replicas: %s\n",
                    std::string(r.status().message()).c_str());
        std::fflush(stdout);
      }
      if (!ok && !stopping_) {
        // Lost: killed (by nobody here), or ended with an error before the
        // coordinator failed the job. A rank that exits after the job's
        // verdict (a NaN, an exception it reported) is not: its process and
        // node are sound, and a restart keeps it.
        const bool verdict = coordinator_ && coordinator_->GetJob().state == JobState::kFailed;
        if (WIFSIGNALED(status) || !verdict) lost_.push_back(c.rank);
        StopAll(ExitReason(c.rank, status), false, AbortCause::kRankExit);
      }
    }
  }

  // Why a rank that exited with `status` failed the job.
  std::string ExitReason(int rank, int status) const {
    std::string why = WIFEXITED(status)
                          ? absl::StrCat("rank ", rank, " exited with status ", WEXITSTATUS(status))
                          : absl::StrCat("rank ", rank, " was killed by signal ", WTERMSIG(status));
    // A rank that exits with an error has usually told the coordinator
    // why first (a non-finite loss, a failed checkpoint): say that.
    if (coordinator_ && WIFEXITED(status)) {
      JobStatus j = coordinator_->GetJob();
      if (j.state == JobState::kFailed && !j.failure.empty()) {
        why = absl::StrCat(j.failure, " (", why, ")");
      }
    }
    return why;
  }

  // Once stopping: SIGTERM to the remaining ranks at term_deadline_, SIGKILL
  // from kill_deadline_ on.
  void SignalRemaining() {
    if (stopping_ && !terminated_ && absl::Now() >= term_deadline_) {
      terminated_ = true;
      for (const Child& c : *children_) {
        if (!c.exited) kill(c.pid, SIGTERM);
      }
    }
    if (stopping_ && absl::Now() >= kill_deadline_) {
      for (const Child& c : *children_) {
        if (!c.exited) kill(c.pid, SIGKILL);
      }
    }
  }

  Coordinator* const coordinator_;  // null when this node joined another's
  std::vector<Child>* const children_;
  int remaining_;
  Grow grow_;
  int64_t grown_request_ = 0;  // the last grow whose ranks this shardrun started
  bool recover_losses_ = false;
  int recovered_ = 0;
  bool had_external_ranks_ = false;
  std::string failure_;
  std::vector<int> lost_;
  JobStatus at_failure_;
  int alive_at_stop_ = 0;
  bool stopping_ = false;
  bool terminated_ = false;
  absl::Time term_deadline_, kill_deadline_;
};

// This shardrun's ranks have finished, but ranks that another shardrun
// started (--join) may still be running: keeps serving the coordinator until
// the job has finished (every rank) or failed (a rank silent past the
// heartbeat timeout fails it). The failure, or "".
std::string AwaitOtherRanks(Coordinator* coordinator) {
  bool said = false;
  while (true) {
    JobStatus j = coordinator->GetJob();
    if (j.state == JobState::kFinished) return "";
    if (j.state == JobState::kFailed) return j.failure;
    if (g_signal.load() != 0) {
      const std::string why = absl::StrCat("interrupted (signal ", g_signal.load(), ")");
      coordinator->Abort(why, -1, AbortCause::kInterrupted);
      return why;
    }
    if (!said) {
      int running = 0;
      for (const RankState& r : j.ranks) running += r.finished ? 0 : 1;
      std::lock_guard<std::mutex> l(g_out_mu);
      std::printf(
          "shardrun: this shardrun's ranks finished; serving the coordinator until the "
          "job's other %d rank%s (started by shardrun --join) finish\n",
          running, running == 1 ? "" : "s");
      std::fflush(stdout);
      said = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// Once every rank has exited: waits for the last of their output, then stops
// serving metrics and the coordinator.
void ShutDown(Ranks* ranks, CoordinatorServers* servers) {
  for (auto& t : ranks->pumps) t.join();
  servers->metrics.reset();
  if (servers->server) servers->server->Shutdown();
}

// The job's outcome (and where the ranks' collectives diverged, when it
// failed); the exit status.
int Report(const std::string& failure, const CoordinatorServers& servers, size_t ranks,
           int recovered = 0) {
  if (!failure.empty()) {
    std::fprintf(stderr, "shardrun: job failed: %s; stopped all ranks\n", failure.c_str());
    if (servers.service) {  // where the ranks' collectives diverged, from the rings they reported
      const std::string d =
          ReportedDivergence(servers.service->flight_records(), *servers.coordinator);
      if (!d.empty()) std::fprintf(stderr, "shardrun: flight recorder: %s\n", d.c_str());
    }
    return g_signal.load() != 0 ? 130 : 1;
  }
  if (recovered > 0) {
    std::printf(
        "shardrun: all %zu remaining ranks finished (%d lost, recovered from the in-memory "
        "replicas)\n",
        ranks - recovered, recovered);
    return 0;
  }
  std::printf("shardrun: all %zu ranks finished\n", ranks);
  return 0;
}

// One run of the job: the coordinator, the ranks, until they have all
// exited. The failure ("" when every rank finished), with the supervisor's
// view of it in *lost and *at_failure; the exit status in *exit_status when
// shardrun must stop now (a setup error).
// The ranks a restart starts again: those that did not fail by themselves.
// After a live resize (the job's size then, ranks that left or had not yet
// joined), the processes still running when the job was stopped.
int Survivors(const RunConfig& cfg, const std::vector<int>& lost, const JobStatus& at_failure,
              int alive) {
  if (at_failure.epoch > 0 || at_failure.resize) return std::min(at_failure.world_size, alive);
  return cfg.world - static_cast<int>(lost.size());
}

std::string RunOnce(const RunConfig& cfg, std::vector<int>* lost, JobStatus* at_failure, int* alive,
                    std::optional<int>* exit_status) {
  CoordinatorServers servers;
  if (absl::Status s = ServeCoordinator(cfg, &servers); !s.ok()) {
    *exit_status = Fail(std::string(s.message()));
    return "";
  }
  // MASTER_PORT is torch.distributed's (its TCPStore listens there on rank
  // 0), not the coordinator's: node 0 picks a free port (or --master-port)
  // and publishes it in the coordinator's key-value store for other nodes.
  auto master_port = MasterPort(servers.coordinator.get(), servers.address, cfg.token, cfg.job_id,
                                cfg.master_port);
  if (!master_port.ok()) {
    *exit_status = Fail(std::string(master_port.status().message()));
    return "";
  }
  InstallSignalHandlers();
  const std::string master_port_str = std::to_string(*master_port);
  Ranks ranks;
  for (int local = 0; local < cfg.nproc; ++local) {
    absl::Status s = SpawnRank(cfg, local, servers.address, master_port_str, &ranks);
    if (!s.ok()) {
      *exit_status = Fail(std::string(s.message()));
      return "";
    }
  }
  // A job on one node can grow: its shardrun starts the new ranks.
  Supervisor::Grow grow;
  if (cfg.nnodes == 1 && cfg.coordinator.empty()) {
    grow = [&](int from, int to, int64_t epoch) -> absl::Status {
      RunConfig grown = cfg;
      grown.world = to;
      grown.nproc = to;
      {
        std::lock_guard<std::mutex> l(g_out_mu);
        std::printf("shardrun: starting rank%s %d%s to grow the job to %d ranks (epoch %lld)\n",
                    to - from > 1 ? "s" : "", from,
                    to - from > 1 ? absl::StrCat("..", to - 1).c_str() : "", to,
                    static_cast<long long>(epoch));
        std::fflush(stdout);
      }
      for (int r = from; r < to; ++r) {
        absl::Status s = SpawnRank(grown, r, servers.address, master_port_str, &ranks, epoch);
        if (!s.ok()) return s;
      }
      return absl::OkStatus();
    };
  }
  Supervisor supervisor(servers.coordinator.get(), &ranks.children, grow, cfg.replicate_every > 0);
  std::string failure = supervisor.Run();
  if (failure.empty() && supervisor.had_external_ranks()) {
    failure = AwaitOtherRanks(servers.coordinator.get());
  }
  ShutDown(&ranks, &servers);
  *lost = supervisor.lost();
  *at_failure = supervisor.at_failure();
  *alive = supervisor.alive_at_stop();
  const int survivors = Survivors(cfg, *lost, *at_failure, *alive);
  const bool restarting = !failure.empty() && g_signal.load() == 0 &&
                          cfg.restart < cfg.max_restarts && survivors >= cfg.min_ranks;
  if (!restarting && !failure.empty() && g_signal.load() == 0 && cfg.max_restarts > 0) {
    std::fprintf(
        stderr, "shardrun: not restarting: %s\n",
        cfg.restart >= cfg.max_restarts
            ? absl::StrCat("--max-restarts=", cfg.max_restarts, " used up").c_str()
            : absl::StrCat(survivors, " ranks would be left, under --min-ranks=", cfg.min_ranks)
                  .c_str());
  }
  if (!restarting) {
    *exit_status = Report(failure, servers, ranks.children.size(), supervisor.recovered());
  }
  return failure;
}

// The line that says what a restart lost: which ranks, and the steps since
// the last complete checkpoint.
std::string RestartLine(const RunConfig& cfg, const std::string& failure,
                        const std::vector<int>& lost, int survivors) {
  const int64_t reached = cfg.failed_step;
  const int64_t saved = std::max<int64_t>(0, cfg.saved_step);
  std::string who = "no rank lost";
  if (!lost.empty()) {
    who = "lost rank";
    if (lost.size() > 1) who += "s";
    for (size_t i = 0; i < lost.size(); ++i) absl::StrAppend(&who, i ? ", " : " ", lost[i]);
  }
  return absl::StrCat("job failed at step ", reached, ": ", failure, "; ", who, "; restart ",
                      cfg.restart + 1, " of ", cfg.max_restarts, " with ", survivors,
                      " ranks from ",
                      cfg.saved_step >= 0 ? absl::StrCat("the checkpoint of step ", saved)
                                          : std::string("the start (no checkpoint yet)"),
                      " (", std::max<int64_t>(0, reached - saved), " steps lost)");
}

// shardrun --join=ADDR: asks the running job at ADDR to grow by --nproc
// ranks, starts them here (SHARDOPT_JOIN_EPOCH: they take their state from
// the job's ranks) and supervises them as its own. Exit status as Main's.
// Asks the job at cfg->join to grow by cfg->nproc ranks started here; sets
// the job id, the ranks' numbers and world size in *cfg. The new epoch.
absl::StatusOr<int64_t> RequestJoin(RunConfig* cfg) {
  auto creds = MakeChannelCredentials(ClientTlsFromEnv());
  if (!creds.ok()) return creds.status();
  CoordinatorClient client(cfg->join, cfg->token, *creds);
  if (absl::Status s = client.WaitUntilReachable(absl::Seconds(30)); !s.ok()) return s;
  auto job = client.GetJob();
  if (!job.ok()) return job.status();
  if (job->state() != "running") {
    return absl::FailedPreconditionError(absl::StrCat("the job is ", job->state()));
  }
  if (job->resize_pending_world() != 0) {
    return absl::FailedPreconditionError(absl::StrCat("a resize to ", job->resize_pending_world(),
                                                      " ranks is in progress; try again after it"));
  }
  cfg->job_id = job->job_id();
  auto r = client.Resize(job->world_size() + static_cast<int>(cfg->nproc), {}, /*external=*/true);
  if (!r.ok()) return r.status();
  // (The coordinator's numbers: the job's size when the request arrived.)
  cfg->rank_offset = r->from_world();
  cfg->world = r->to_world();
  cfg->nproc = r->to_world() - r->from_world();
  return r->epoch();
}

int RunJoin(RunConfig cfg) {
  auto joined = [&cfg](const absl::Status& s) {
    std::fprintf(stderr, "shardrun: cannot join the job at %s: %s\n", cfg.join.c_str(),
                 std::string(s.message()).c_str());
    return 1;
  };
  auto epoch = RequestJoin(&cfg);
  if (!epoch.ok()) return joined(epoch.status());
  auto master_port = MasterPort(nullptr, cfg.join, cfg.token, cfg.job_id, cfg.master_port);
  if (!master_port.ok()) return joined(master_port.status());
  std::printf("shardrun: joining job %s at %s: starting rank%s %d%s of %d (epoch %lld)\n",
              cfg.job_id.c_str(), cfg.join.c_str(), cfg.nproc > 1 ? "s" : "", cfg.rank_offset,
              cfg.nproc > 1 ? absl::StrCat("..", cfg.world - 1).c_str() : "", cfg.world,
              static_cast<long long>(*epoch));
  std::fflush(stdout);
  InstallSignalHandlers();
  Ranks ranks;
  for (int local = 0; local < cfg.nproc; ++local) {
    absl::Status s = SpawnRank(cfg, local, cfg.join, std::to_string(*master_port), &ranks, *epoch);
    if (!s.ok()) {
      std::fprintf(stderr, "shardrun: %s\n", std::string(s.message()).c_str());
      for (const Child& c : ranks.children) kill(c.pid, SIGTERM);
      break;
    }
  }
  Supervisor supervisor(nullptr, &ranks.children);
  const std::string failure = supervisor.Run();
  CoordinatorServers none;
  ShutDown(&ranks, &none);
  return Report(failure, none, ranks.children.size());
}

int Main(int argc, char** argv) {
  RunConfig cfg;
  if (std::optional<int> exit_status = ParseFlags(argc, argv, &cfg)) return *exit_status;
  if (!cfg.join.empty()) return RunJoin(cfg);
  while (true) {
    std::vector<int> lost;
    JobStatus at_failure;
    std::optional<int> exit_status;
    int alive = 0;
    const std::string failure = RunOnce(cfg, &lost, &at_failure, &alive, &exit_status);
    if (exit_status) return *exit_status;
    const int survivors = Survivors(cfg, lost, at_failure, alive);
    cfg.failed_step = 0;
    for (const RankState& r : at_failure.ranks) cfg.failed_step = std::max(cfg.failed_step, r.step);
    if (at_failure.checkpoints_total > 0) {
      cfg.saved_step = std::max(cfg.saved_step, at_failure.last_checkpoint_step);
    }
    cfg.last_restart = RestartLine(cfg, failure, lost, survivors);
    std::printf("shardrun: %s\n", cfg.last_restart.c_str());
    std::fflush(stdout);
    cfg.nproc = survivors;
    cfg.world = survivors;
    ++cfg.restart;
  }
}

}  // namespace
}  // namespace shardopt

int main(int argc, char** argv) { return shardopt::Main(argc, argv); }
