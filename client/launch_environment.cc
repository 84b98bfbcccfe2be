#include "client/launch_environment.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <initializer_list>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace shardopt {
namespace {

constexpr int64_t kMaxWorld = 1 << 20;

// Top-level pieces of a hostlist: commas outside brackets separate them.
absl::StatusOr<std::vector<std::string>> SplitTopLevel(absl::string_view list) {
  std::vector<std::string> out;
  int depth = 0;
  std::string cur;
  for (char ch : list) {
    if (ch == '[') {
      if (++depth > 1) return absl::InvalidArgumentError("nested '[' in a host list");
    } else if (ch == ']') {
      if (--depth < 0) return absl::InvalidArgumentError("']' without '[' in a host list");
    }
    if (ch == ',' && depth == 0) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += ch;
    }
  }
  if (depth != 0) return absl::InvalidArgumentError("'[' without ']' in a host list");
  out.push_back(cur);
  return out;
}

// "01-03,7" -> 01 02 03 7 (each range keeps its start's width).
absl::StatusOr<std::vector<std::string>> ExpandRanges(absl::string_view inner, size_t max_hosts) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= inner.size()) {
    size_t comma = inner.find(',', at);
    if (comma == absl::string_view::npos) comma = inner.size();
    absl::string_view r = inner.substr(at, comma - at);
    const size_t dash = r.find('-');
    absl::string_view lo_s = r.substr(0, dash);
    absl::string_view hi_s = dash == absl::string_view::npos ? lo_s : r.substr(dash + 1);
    int64_t lo = 0, hi = 0;
    const bool digits = !lo_s.empty() && !hi_s.empty() &&
                        lo_s.find_first_not_of("0123456789") == absl::string_view::npos &&
                        hi_s.find_first_not_of("0123456789") == absl::string_view::npos;
    if (!digits || !absl::SimpleAtoi(lo_s, &lo) || !absl::SimpleAtoi(hi_s, &hi) || hi < lo) {
      return absl::InvalidArgumentError(absl::StrCat("bad range '", r, "' in a host list"));
    }
    if (static_cast<size_t>(hi - lo + 1) > max_hosts) {
      return absl::InvalidArgumentError("host list names too many hosts");
    }
    for (int64_t v = lo; v <= hi; ++v) {
      std::string s = absl::StrCat(v);
      if (s.size() < lo_s.size()) s.insert(0, lo_s.size() - s.size(), '0');
      out.push_back(std::move(s));
    }
    at = comma + 1;
  }
  return out;
}

// One name with any number of bracket groups: their product, in order.
absl::Status ExpandName(absl::string_view name, size_t max_hosts, std::vector<std::string>* out) {
  std::vector<std::string> acc = {""};
  size_t at = 0;
  while (at < name.size()) {
    const size_t open = name.find('[', at);
    const absl::string_view text =
        name.substr(at, open == absl::string_view::npos ? absl::string_view::npos : open - at);
    for (std::string& a : acc) a.append(text.data(), text.size());
    if (open == absl::string_view::npos) break;
    const size_t close = name.find(']', open);  // balanced: SplitTopLevel checked
    auto parts = ExpandRanges(name.substr(open + 1, close - open - 1), max_hosts);
    if (!parts.ok()) return parts.status();
    std::vector<std::string> next;
    for (const std::string& a : acc) {
      for (const std::string& p : *parts) {
        next.push_back(a + p);
        if (next.size() > max_hosts) {
          return absl::InvalidArgumentError("host list names too many hosts");
        }
      }
    }
    acc = std::move(next);
    at = close + 1;
  }
  for (std::string& a : acc) {
    if (out->size() >= max_hosts)
      return absl::InvalidArgumentError("host list names too many hosts");
    out->push_back(std::move(a));
  }
  return absl::OkStatus();
}

class Env {
 public:
  explicit Env(const std::function<const char*(const char*)>& getenv) : getenv_(getenv) {}
  std::optional<std::string> Str(const char* name) const {
    const char* v = getenv_(name);
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  }
  bool Has(const char* name) const { return getenv_(name) != nullptr; }
  // An integer in [min, max]; `def` when unset.
  absl::StatusOr<int64_t> Int(const char* name, int64_t def, int64_t min, int64_t max) const {
    const char* v = getenv_(name);
    if (v == nullptr) return def;
    int64_t x = 0;
    if (!absl::SimpleAtoi(v, &x) || x < min || x > max) {
      return absl::InvalidArgumentError(absl::StrCat("environment variable ", name,
                                                     " must be an integer in [", min, ", ", max,
                                                     "], got '", v, "'"));
    }
    return x;
  }

 private:
  const std::function<const char*(const char*)>& getenv_;
};

#define SHARDOPT_ENV_INT(var, expr)   \
  {                                   \
    auto v_ = (expr);                 \
    if (!v_.ok()) return v_.status(); \
    var = static_cast<int>(*v_);      \
  }

absl::Status ReadTorchrun(const Env& env, LaunchEnvironment* e) {
  e->launcher = env.Has("SHARDOPT_COORDINATOR") ? "shardrun" : "torchrun";
  if (!env.Has("WORLD_SIZE"))
    return absl::InvalidArgumentError("RANK is set but WORLD_SIZE is not");
  SHARDOPT_ENV_INT(e->world_size, env.Int("WORLD_SIZE", 1, 1, kMaxWorld));
  SHARDOPT_ENV_INT(e->rank, env.Int("RANK", 0, 0, e->world_size - 1));
  SHARDOPT_ENV_INT(e->local_rank, env.Int("LOCAL_RANK", 0, 0, kMaxWorld - 1));
  SHARDOPT_ENV_INT(e->node_rank, env.Int(env.Has("GROUP_RANK") ? "GROUP_RANK" : "NODE_RANK", 0, 0,
                                         kMaxWorld - 1));
  int local_world = 0;
  SHARDOPT_ENV_INT(local_world, env.Int("LOCAL_WORLD_SIZE", 0, 1, kMaxWorld));
  if (local_world > 0) e->num_nodes = (e->world_size + local_world - 1) / local_world;
  e->master_addr = env.Str("MASTER_ADDR").value_or("");
  SHARDOPT_ENV_INT(e->master_port, env.Int("MASTER_PORT", 0, 1, 65535));
  return absl::OkStatus();
}

// The first of `names` that is set, else nullptr (its name in *which).
const char* FirstSet(const Env& env, std::initializer_list<const char*> names) {
  for (const char* n : names) {
    if (env.Has(n)) return n;
  }
  return nullptr;
}

absl::Status ReadSlurm(const Env& env, LaunchEnvironment* e) {
  e->launcher = "slurm";
  const char* ntasks = FirstSet(env, {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"});
  if (ntasks == nullptr) {
    return absl::InvalidArgumentError("SLURM_PROCID is set but SLURM_NTASKS is not");
  }
  SHARDOPT_ENV_INT(e->world_size, env.Int(ntasks, 1, 1, kMaxWorld));
  SHARDOPT_ENV_INT(e->rank, env.Int("SLURM_PROCID", 0, 0, e->world_size - 1));
  SHARDOPT_ENV_INT(e->local_rank, env.Int("SLURM_LOCALID", 0, 0, kMaxWorld - 1));
  if (const char* var =
          FirstSet(env, {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"})) {
    const std::string list = *env.Str(var);
    auto nodes = ExpandHostlist(list);
    if (!nodes.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(var, " '", list, "': ", nodes.status().message()));
    }
    e->nodes = *std::move(nodes);
    e->master_addr = e->nodes.front();
  }
  const int64_t known = e->nodes.empty() ? kMaxWorld : static_cast<int64_t>(e->nodes.size());
  const char* nnodes = FirstSet(env, {"SLURM_STEP_NUM_NODES", "SLURM_NNODES"});
  SHARDOPT_ENV_INT(e->num_nodes, env.Int(nnodes == nullptr ? "SLURM_NNODES" : nnodes,
                                         known == kMaxWorld ? 1 : known, 1, known));
  SHARDOPT_ENV_INT(e->node_rank, env.Int("SLURM_NODEID", 0, 0, e->num_nodes - 1));
  if (std::optional<std::string> tpn = env.Str("SLURM_STEP_TASKS_PER_NODE")) {
    auto n = TasksOnNode(*tpn, e->node_rank);
    if (!n.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("SLURM_STEP_TASKS_PER_NODE '", *tpn, "': ", n.status().message()));
    }
    e->local_world_size = *n;
    if (e->local_rank >= e->local_world_size) {
      return absl::InvalidArgumentError(absl::StrCat("SLURM_LOCALID ", e->local_rank,
                                                     " is not below this node's ",
                                                     e->local_world_size, " tasks"));
    }
  }
  e->job_id = env.Str("SLURM_JOB_ID").value_or("");
  e->step_id = env.Str(env.Has("SLURM_STEP_ID") ? "SLURM_STEP_ID" : "SLURM_STEPID").value_or("");
  e->node_name = env.Str("SLURMD_NODENAME").value_or("");
  return absl::OkStatus();
}

absl::Status ReadKubernetes(const Env& env, LaunchEnvironment* e) {
  e->launcher = "kubernetes";
  const char* world = env.Has("WORLD_SIZE") ? "WORLD_SIZE" : "SHARDOPT_WORLD_SIZE";
  if (!env.Has(world)) {
    return absl::InvalidArgumentError(
        "JOB_COMPLETION_INDEX is set but neither WORLD_SIZE nor SHARDOPT_WORLD_SIZE (set it to "
        "the Indexed Job's completions in the manifest)");
  }
  SHARDOPT_ENV_INT(e->world_size, env.Int(world, 1, 1, kMaxWorld));
  SHARDOPT_ENV_INT(e->rank, env.Int("JOB_COMPLETION_INDEX", 0, 0, e->world_size - 1));
  e->node_rank = e->rank;  // one pod per rank
  e->num_nodes = e->world_size;
  e->master_addr = env.Str("MASTER_ADDR").value_or("");
  SHARDOPT_ENV_INT(e->master_port, env.Int("MASTER_PORT", 0, 1, 65535));
  return absl::OkStatus();
}

#undef SHARDOPT_ENV_INT

}  // namespace

absl::StatusOr<std::vector<std::string>> ExpandHostlist(absl::string_view list, size_t max_hosts) {
  auto names = SplitTopLevel(list);
  if (!names.ok()) return names.status();
  std::vector<std::string> out;
  for (const std::string& n : *names) {
    if (n.empty()) return absl::InvalidArgumentError("empty name in a host list");
    if (absl::Status s = ExpandName(n, max_hosts, &out); !s.ok()) return s;
  }
  return out;
}

absl::StatusOr<LaunchEnvironment> ReadLaunchEnvironment(
    const std::function<const char*(const char*)>& getenv) {
  const Env env(getenv);
  LaunchEnvironment e;
  absl::Status s;
  if (env.Has("RANK")) {
    s = ReadTorchrun(env, &e);
  } else if (env.Has("WORLD_SIZE") && !env.Has("JOB_COMPLETION_INDEX") &&
             !env.Has("SLURM_PROCID")) {
    s = ReadTorchrun(env, &e);  // WORLD_SIZE alone: rank 0 of it
  } else if (env.Has("SLURM_PROCID") && (env.Has("SLURM_STEP_ID") || env.Has("SLURM_STEPID"))) {
    s = ReadSlurm(env, &e);
  } else if (env.Has("SLURM_PROCID")) {
    // sbatch's batch script (or salloc's shell) sets SLURM_PROCID=0 and the
    // allocation's SLURM_NTASKS without being one of its tasks: taking it
    // for rank 0 of the job would wait for ranks nobody started.
    e.note =
        "SLURM_PROCID is set but SLURM_STEP_ID is not: this is sbatch's batch script (or "
        "salloc's shell), not a task of an srun step, so this process runs alone; start the "
        "ranks with srun";
  } else if (env.Has("JOB_COMPLETION_INDEX")) {
    s = ReadKubernetes(env, &e);
  }
  if (!s.ok()) return s;
  return e;
}

absl::StatusOr<int> TasksOnNode(absl::string_view tasks_per_node, int node) {
  // Comma-separated "N" or "N(xR)".
  int64_t first = 0;
  for (absl::string_view part : absl::StrSplit(tasks_per_node, ',')) {
    int64_t tasks = 0, repeat = 1;
    absl::string_view count = part;
    if (const size_t open = part.find("(x"); open != absl::string_view::npos) {
      if (part.back() != ')' ||
          !absl::SimpleAtoi(part.substr(open + 2, part.size() - open - 3), &repeat) || repeat < 1) {
        return absl::InvalidArgumentError(absl::StrCat("bad repeat in '", part, "'"));
      }
      count = part.substr(0, open);
    }
    if (!absl::SimpleAtoi(count, &tasks) || tasks < 1 || tasks > kMaxWorld) {
      return absl::InvalidArgumentError(absl::StrCat("bad task count '", part, "'"));
    }
    if (node < first + repeat) return static_cast<int>(tasks);
    first += repeat;
    if (first > kMaxWorld) break;
  }
  return absl::InvalidArgumentError(absl::StrCat("no node ", node, " in it"));
}

int DefaultSlurmPort(absl::string_view job_id, absl::string_view step_id) {
  // FNV-1a of "job.step": stable across tasks, processes and builds.
  uint64_t h = 1469598103934665603ull;
  for (absl::string_view part : {job_id, absl::string_view("."), step_id}) {
    for (unsigned char ch : part) {
      h ^= ch;
      h *= 1099511628211ull;
    }
  }
  return 20000 + static_cast<int>(h % 9000);
}

absl::StatusOr<Rendezvous> PlanRendezvous(const LaunchEnvironment& e,
                                          const std::function<const char*(const char*)>& getenv) {
  const Env env(getenv);
  Rendezvous r;
  const bool slurm = e.launcher == "slurm";
  const bool kubernetes = e.launcher == "kubernetes";
  r.job_id = env.Str("SHARDOPT_JOB_ID").value_or(slurm && !e.job_id.empty() ? e.job_id : "job");
  if (r.job_id.empty()) return absl::InvalidArgumentError("SHARDOPT_JOB_ID is empty");
  if (std::optional<std::string> b = env.Str("SHARDOPT_BIND"); b && !b->empty()) {
    r.bind = *b;
  } else if (std::optional<std::string> n = env.Str("SLURMD_NODENAME");
             n && !n->empty() && env.Has("SLURM_JOB_ID")) {
    r.bind = *n;  // also for shardrun's ranks inside a Slurm step
  } else if (std::optional<std::string> h = env.Str("HOSTNAME"); kubernetes && h && !h->empty()) {
    r.bind = *h;
  } else {
    r.bind = "127.0.0.1";
  }
  if (std::optional<std::string> c = env.Str("SHARDOPT_COORDINATOR")) {
    if (c->empty()) return absl::InvalidArgumentError("SHARDOPT_COORDINATOR is empty");
    r.coordinator = *c;
    return r;
  }
  if (!slurm && !kubernetes) return r;
  std::string host = env.Str("MASTER_ADDR").value_or(slurm ? e.master_addr : "");
  if (host.empty()) {
    return absl::InvalidArgumentError(
        slurm ? "no node list (SLURM_STEP_NODELIST / SLURM_JOB_NODELIST) and no MASTER_ADDR: "
                "cannot tell where the coordinator runs"
              : "MASTER_ADDR is not set: set it in the Indexed Job's manifest to pod 0's name "
                "through the headless Service (JOBNAME-0.SERVICE), or set SHARDOPT_COORDINATOR");
  }
  int64_t port = 0;
  {
    auto p =
        env.Int("SHARDOPT_PORT",
                slurm ? DefaultSlurmPort(e.job_id, e.step_id) : kDefaultKubernetesPort, 1, 65535);
    if (!p.ok()) return p.status();
    port = *p;
  }
  r.coordinator = absl::StrCat(host, ":", port);
  r.served_by_rank0 = true;
  r.host_coordinator = e.rank == 0;
  if (r.host_coordinator) {
    std::string listen_host = env.Str("SHARDOPT_LISTEN").value_or("0.0.0.0");
    if (listen_host.empty()) return absl::InvalidArgumentError("SHARDOPT_LISTEN is empty");
    r.listen = absl::StrCat(listen_host, ":", port);
  }
  return r;
}

namespace {

bool Resolves(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (res != nullptr) freeaddrinfo(res);
  return rc == 0;
}

}  // namespace

absl::StatusOr<Rendezvous> PlanRendezvous(const LaunchEnvironment& env) {
  auto r = PlanRendezvous(env, [](const char* name) { return std::getenv(name); });
  if (!r.ok()) return r;
  // A Slurm node name that does not resolve here (NodeName differs from the
  // host name, NodeHostname set): this host's own name, which Gloo and the
  // shard-owner service can bind and the other nodes can usually reach.
  const char* explicit_bind = std::getenv("SHARDOPT_BIND");
  if ((explicit_bind == nullptr || *explicit_bind == '\0') && r->bind != "127.0.0.1" &&
      !Resolves(r->bind)) {
    char host[256] = {};
    if (gethostname(host, sizeof(host) - 1) == 0 && Resolves(host)) r->bind = host;
  }
  return r;
}

absl::StatusOr<LaunchEnvironment> ReadLaunchEnvironment() {
  return ReadLaunchEnvironment([](const char* name) { return std::getenv(name); });
}

}  // namespace shardopt
