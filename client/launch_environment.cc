#include "client/launch_environment.h"

#include <cstdlib>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

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
      return absl::InvalidArgumentError(
          absl::StrCat(name, " must be an integer in [", min, ", ", max, "], got '", v, "'"));
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

absl::Status ReadSlurm(const Env& env, LaunchEnvironment* e) {
  e->launcher = "slurm";
  if (!env.Has("SLURM_NTASKS")) {
    return absl::InvalidArgumentError("SLURM_PROCID is set but SLURM_NTASKS is not");
  }
  SHARDOPT_ENV_INT(e->world_size, env.Int("SLURM_NTASKS", 1, 1, kMaxWorld));
  SHARDOPT_ENV_INT(e->rank, env.Int("SLURM_PROCID", 0, 0, e->world_size - 1));
  SHARDOPT_ENV_INT(e->local_rank, env.Int("SLURM_LOCALID", 0, 0, kMaxWorld - 1));
  std::optional<std::string> list = env.Str("SLURM_JOB_NODELIST");
  if (!list) list = env.Str("SLURM_NODELIST");
  if (list) {
    auto nodes = ExpandHostlist(*list);
    if (!nodes.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("SLURM_JOB_NODELIST '", *list, "': ", nodes.status().message()));
    }
    e->nodes = *std::move(nodes);
    e->master_addr = e->nodes.front();
  }
  const int64_t known = e->nodes.empty() ? kMaxWorld : static_cast<int64_t>(e->nodes.size());
  SHARDOPT_ENV_INT(e->num_nodes, env.Int("SLURM_NNODES", known == kMaxWorld ? 1 : known, 1, known));
  SHARDOPT_ENV_INT(e->node_rank, env.Int("SLURM_NODEID", 0, 0, e->num_nodes - 1));
  e->job_id = env.Str("SLURM_JOB_ID").value_or("");
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
  } else if (env.Has("SLURM_PROCID")) {
    s = ReadSlurm(env, &e);
  } else if (env.Has("JOB_COMPLETION_INDEX")) {
    s = ReadKubernetes(env, &e);
  }
  if (!s.ok()) return s;
  return e;
}

absl::StatusOr<LaunchEnvironment> ReadLaunchEnvironment() {
  return ReadLaunchEnvironment([](const char* name) { return std::getenv(name); });
}

}  // namespace shardopt
