// The Python extension shardopt._C: thin bindings over the C++ API. The
// Python package (python/shardopt/__init__.py) builds the user-facing
// torch.optim.Optimizer on top of it. Tensors cross without copies: the
// optimizer works on the caller's parameters (they become views of its flat
// buffers). The GIL is released around everything that communicates or
// computes; errors become ValueError (bad arguments) or RuntimeError.
#include <torch/python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/checkpoint/checkpoint.h"
#include "client/checkpoint/torch_interop.h"
#include "client/comm/flight_recorder.h"
#include "client/comm/host_communicator.h"
#include "client/host_allocator.h"
#include "client/coordinator_client.h"
#include "client/launch_environment.h"
#include "server/hosted_coordinator.h"
#include "client/rank_agent.h"
#include "client/comm/in_process_communicator.h"
#include "client/comm/kv_store.h"
#include "client/checkpoint/full_state.h"
#include "client/advice.h"
#include "client/resize.h"
#include "common/membership.h"
#include "client/sharded_optimizer.h"
#include "advisor/cost_model.h"
#include "advisor/inputs.h"
#include "common/file_system.h"
#include "common/hyper_params.h"

namespace py = pybind11;

namespace shardopt {
namespace {

[[noreturn]] void Raise(const absl::Status& s) {
  const std::string msg(s.message());
  if (s.code() == absl::StatusCode::kInvalidArgument || s.code() == absl::StatusCode::kOutOfRange) {
    throw py::value_error(msg);
  }
  throw std::runtime_error(msg);
}
void Check(const absl::Status& s) {
  if (!s.ok()) Raise(s);
}
template <typename T>
T Take(absl::StatusOr<T> v) {
  if (!v.ok()) Raise(v.status());
  return *std::move(v);
}

// A torch.distributed Store (set / wait / get) as a KeyValueStore: Gloo's
// rendezvous under the torchrun contract. Called with the GIL released.
class PythonStore : public KeyValueStore {
 public:
  explicit PythonStore(py::object store) : store_(std::move(store)) {}
  absl::Status Set(const std::string& key, const std::string& value) override {
    py::gil_scoped_acquire gil;
    try {
      store_.attr("set")(key, py::bytes(value));
      return absl::OkStatus();
    } catch (py::error_already_set& e) {
      return absl::UnavailableError(absl::StrCat("store.set('", key, "'): ", e.what()));
    }
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    py::gil_scoped_acquire gil;
    try {
      py::object timedelta = py::module_::import("datetime").attr("timedelta");
      py::list keys;
      keys.append(key);
      store_.attr("wait")(keys, timedelta(py::arg("seconds") = absl::ToDoubleSeconds(timeout)));
      return std::string(py::bytes(store_.attr("get")(key)));
    } catch (py::error_already_set& e) {
      return absl::DeadlineExceededError(
          absl::StrCat("store: key '", key, "' did not appear: ", e.what()));
    }
  }

 private:
  py::object store_;
};

// A communicator and what it needs to live.
struct PyCommunicator {
  std::unique_ptr<InProcessWorld> world;      // world size 1 without a launcher
  std::unique_ptr<CoordinatorClient> client;  // under shardrun: the control plane
  std::string job_id;
  std::string transport = "none";  // the one in use: shm, gloo (or none: one rank, no launcher)
  std::unique_ptr<Communicator> comm;
};

// Shared memory or Gloo over `store` (with the GIL released: a Python store
// takes it back); `transport` is auto, gloo or shm.
std::unique_ptr<Communicator> ConnectHost(KeyValueStore* store, int rank, int world,
                                          const std::string& prefix, double timeout_s,
                                          const std::string& hostname, const std::string& transport,
                                          std::string* chosen) {
  if (world < 1 || rank < 0 || rank >= world) {
    throw py::value_error(absl::StrCat("rank ", rank, " is outside a world of ", world));
  }
  if (!(timeout_s > 0)) throw py::value_error("timeout must be > 0 seconds");
  auto t = ParseCpuTransport(transport);
  if (!t.ok()) throw py::value_error(std::string(t.status().message()));
  CpuCommOptions o;
  o.transport = *t;
  o.hostname = hostname;
  o.timeout = absl::Seconds(timeout_s);
  o.store_prefix = prefix;
  absl::StatusOr<CpuComm> comm;
  {
    py::gil_scoped_release release;
    comm = CreateCpuCommunicator(store, rank, world, o);
  }
  if (!comm.ok()) Raise(comm.status());
  *chosen = CpuTransportName(comm->transport);
  return std::move(comm->comm);
}

// Under shardrun: rendezvous through the coordinator's key-value store, every
// collective through the flight recorder (as shardopt_train does).
std::shared_ptr<PyCommunicator> MakeCoordinatorCommunicator(
    int rank, int world, const std::string& address, const std::string& token,
    const std::string& job_id, const std::string& prefix, double timeout_s,
    const std::string& hostname, const std::string& tls_ca, const std::string& tls_cert,
    const std::string& tls_key, const std::string& transport) {
  auto creds = MakeChannelCredentials(ClientTls{tls_ca, tls_cert, tls_key});
  if (!creds.ok()) Raise(creds.status());
  auto out = std::make_shared<PyCommunicator>();
  out->client = std::make_unique<CoordinatorClient>(address, token, *creds);
  {
    // Under srun, rank 0's process serves the coordinator: the others may
    // start before it listens.
    py::gil_scoped_release release;
    if (absl::Status s = out->client->WaitUntilReachable(absl::Seconds(timeout_s)); !s.ok()) {
      py::gil_scoped_acquire acquire;
      Raise(s);
    }
  }
  out->job_id = job_id;
  GrpcKeyValueStore kv(out->client.get());
  PrefixKeyValueStore job_kv(&kv, job_id);
  out->comm = std::make_unique<FlightRecordingCommunicator>(
      ConnectHost(&job_kv, rank, world, prefix, timeout_s, hostname, transport, &out->transport),
      std::make_shared<FlightRecorder>());
  return out;
}

std::shared_ptr<PyCommunicator> MakeCommunicator(int rank, int world, py::object store,
                                                 const std::string& prefix, double timeout_s,
                                                 const std::string& hostname,
                                                 const std::string& transport) {
  auto out = std::make_shared<PyCommunicator>();
  if (store.is_none()) {
    if (world != 1) throw py::value_error("several ranks need a store for their rendezvous");
    if (!(timeout_s > 0)) throw py::value_error("timeout must be > 0 seconds");
    out->world = std::make_unique<InProcessWorld>(1, absl::Seconds(timeout_s));
    out->comm = out->world->Connect(0);
    return out;
  }
  PythonStore py_store(store);
  out->comm =
      ConnectHost(&py_store, rank, world, prefix, timeout_s, hostname, transport, &out->transport);
  return out;
}

OptimizerKind ParseKind(const std::string& kind) {
  if (kind == "adam") return OptimizerKind::kAdam;
  if (kind == "adamw") return OptimizerKind::kAdamW;
  if (kind == "sgd") return OptimizerKind::kSgd;
  throw py::value_error(absl::StrCat("unknown optimizer '", kind, "' (adam, adamw or sgd)"));
}

template <typename T>
T Get(const py::dict& d, const char* key, T def) {
  return d.contains(key) ? d[key].cast<T>() : def;
}

// A group dict (lr, betas, eps, weight_decay, momentum, dampening, nesterov)
// over `base`.
HyperParameters ToHyper(const py::dict& g, HyperParameters base) {
  base.adam.lr = base.sgd.lr = Get<double>(g, "lr", base.adam.lr);
  if (g.contains("betas")) {
    auto betas = g["betas"].cast<std::pair<double, double>>();
    base.adam.beta1 = betas.first;
    base.adam.beta2 = betas.second;
  }
  base.adam.eps = Get<double>(g, "eps", base.adam.eps);
  base.adam.weight_decay = base.sgd.weight_decay =
      Get<double>(g, "weight_decay", base.adam.weight_decay);
  base.sgd.momentum = Get<double>(g, "momentum", base.sgd.momentum);
  base.sgd.dampening = Get<double>(g, "dampening", base.sgd.dampening);
  base.sgd.nesterov = Get<bool>(g, "nesterov", base.sgd.nesterov);
  return base;
}

py::dict FromHyper(OptimizerKind kind, const HyperParameters& hp) {
  py::dict d;
  if (kind == OptimizerKind::kSgd) {
    d["lr"] = hp.sgd.lr;
    d["momentum"] = hp.sgd.momentum;
    d["dampening"] = hp.sgd.dampening;
    d["weight_decay"] = hp.sgd.weight_decay;
    d["nesterov"] = hp.sgd.nesterov;
  } else {
    d["lr"] = hp.adam.lr;
    d["betas"] = py::make_tuple(hp.adam.beta1, hp.adam.beta2);
    d["eps"] = hp.adam.eps;
    d["weight_decay"] = hp.adam.weight_decay;
  }
  return d;
}

// What the Python package builds a core optimizer with (_C.OptimizerArgs):
// named fields instead of a dozen positional arguments.
struct PyOptimizerArgs {
  std::vector<int> param_group;  // per tensor: its group
  std::string kind = "adam";     // adam | adamw | sgd (sgd for classes without kernels)
  std::vector<py::dict> groups;  // each group's hyper-parameters
  double max_grad_norm = 0;
  int64_t bucket_cap_elements = 25 * 1024 * 1024 / 4;
  bool grad_bf16 = false;
  double timeout_s = 300;
  int kernel_threads = 0;
  bool overlap_param_gather = false;
  bool shard_gradients = false;
  py::object external_update = py::none();  // a torch.optim class's own step, or None
  bool allow_cut = true;
  // False for a rank that joins a running job: its state comes from the job.
  bool broadcast_initial_values = true;
};

// A rank started to grow a running job (shardrun sets $SHARDOPT_JOIN_EPOCH):
// where the state of the ranks already there is (await_join), for
// Optimizer.join_running.
struct JoinTicket {
  SnapshotSource source;
  int to_world = 0;
};

class PyOptimizer {
 public:
  PyOptimizer(std::shared_ptr<PyCommunicator> comm, const std::vector<std::string>& names,
              const std::vector<torch::Tensor>& tensors, const PyOptimizerArgs& args)
      : comm_(std::move(comm)) {
    if (names.size() != tensors.size()) throw py::value_error("names and tensors differ in length");
    ShardedOptimizerOptions o = ToOptions(args);
    if (!args.external_update.is_none()) SetExternalUpdate(args.external_update, &o);
    o.broadcast_initial_values = args.broadcast_initial_values;
    for (size_t i = 0; i < names.size(); ++i) named_.emplace_back(names[i], tensors[i]);
    absl::StatusOr<std::unique_ptr<ShardedOptimizer>> opt;
    {
      py::gil_scoped_release release;
      opt = ShardedOptimizer::Create(named_, o, comm_->comm.get());
    }
    opt_ = Take(std::move(opt));
    options_ = std::move(o);
  }

  static ShardedOptimizerOptions ToOptions(const PyOptimizerArgs& a) {
    ShardedOptimizerOptions o;
    o.kind = ParseKind(a.kind);
    if (o.kind == OptimizerKind::kAdamW) o.adam = AdamWConfig();
    HyperParameters base{o.adam, o.sgd};
    for (const py::dict& g : a.groups) o.groups.push_back(ToHyper(g, base));
    if (o.groups.empty()) throw py::value_error("no parameter group");
    o.adam = o.groups[0].adam;
    o.sgd = o.groups[0].sgd;
    o.param_group = a.param_group;
    o.max_grad_norm = a.max_grad_norm;
    if (a.bucket_cap_elements < 1) throw py::value_error("bucket_cap_mb must be > 0");
    o.plan.bucket_cap_elements = a.bucket_cap_elements;
    o.grad_comm_type = a.grad_bf16 ? DType::kBFloat16 : DType::kFloat32;
    if (!(a.timeout_s > 0)) throw py::value_error("timeout must be > 0 seconds");
    o.timeout = absl::Seconds(a.timeout_s);
    o.kernel_threads = a.kernel_threads;
    o.overlap_param_gather = a.overlap_param_gather;
    o.shard_gradients = a.shard_gradients;
    o.plan.allow_cut = a.allow_cut;
    return o;
  }

  // An optimizer without fused kernels: its torch.optim step runs on this
  // rank's whole owned tensors, called back with the GIL (Step releases it).
  // The callable is kept alive by external_ (declared before opt_, so it
  // outlives the optimizer); the lambda holds no reference, so copies of the
  // options may die without the GIL.
  void SetExternalUpdate(const py::object& step, ShardedOptimizerOptions* o) {
    external_ = step;
    PyObject* fn = external_.ptr();
    o->external_update = [fn](const std::vector<uint8_t>& active) -> absl::Status {
      py::gil_scoped_acquire gil;
      try {
        py::handle step_fn(fn);  // (a named handle: `py::handle(fn)(...)` declares a function)
        step_fn(py::bytes(reinterpret_cast<const char*>(active.data()), active.size()));
      } catch (py::error_already_set& e) {
        return absl::InternalError(absl::StrCat("the optimizer's step raised ", e.what()));
      }
      return absl::OkStatus();
    };
  }

  // Joins the control plane (shardrun): heartbeats, shardctl, set-lr,
  // checkpoint requests. Returns the job's layout hash as the coordinator has it.
  // samples_per_rank: the batch size on this rank (0: not known).
  // elastic: this rank makes live resizes (Step's "resize", CompleteResize).
  void StartAgent(const std::string& host, const std::string& token, const std::string& ckpt_dir,
                  int ckpt_keep, int64_t samples_per_rank, double timeout_s, int coordinator_rank,
                  bool elastic) {
    if (agent_) return;
    SetAgentArgs(host, token, ckpt_dir, ckpt_keep, samples_per_rank, timeout_s, coordinator_rank,
                 elastic);
    RunAgent(ResizeContext());
  }

  // A rank that joins a running job (after await_join, in an optimizer made
  // with broadcast_initial_values False): joins the job's control plane at
  // the resize's epoch and loads what it owns from the other ranks'
  // snapshots. Collective with the ranks already there (CompleteResize).
  py::dict JoinRunning(const JoinTicket& ticket, const std::string& host, const std::string& token,
                       const std::string& ckpt_dir, int ckpt_keep, int64_t samples_per_rank,
                       double timeout_s) {
    if (agent_) throw std::runtime_error("this optimizer is in the job already");
    if (ticket.to_world != comm_->comm->world_size()) {
      throw py::value_error("the join ticket is for another world size");
    }
    SetAgentArgs(host, token, ckpt_dir, ckpt_keep, samples_per_rank, timeout_s, -1, true);
    epoch_ = ticket.source.epoch;
    const auto t0 = std::chrono::steady_clock::now();
    RunAgent(ticket.source.context);
    absl::StatusOr<SnapshotLoad> loaded;
    {
      py::gil_scoped_release release;
      loaded = LoadFromSnapshots(*opt_, ticket.source, agent_args_.token, nullptr);
    }
    if (!loaded.ok()) {
      FailWith(absl::StrCat("joining the job failed: ", DiagnoseReleased(loaded.status())));
    }
    // (The ranks that stayed sum the bytes moved: the same collective.)
    absl::StatusOr<double> moved;
    {
      py::gil_scoped_release release;
      moved = SumOverRanks(comm_->comm.get(), loaded->bytes_fetched / 1048576.0,
                           absl::Seconds(agent_args_.timeout_s));
    }
    if (!moved.ok()) FailWith(absl::StrCat("after joining: ", DiagnoseReleased(moved.status())));
    agent_->Resumed(ticket.source.context.step);
    py::dict d;
    d["step"] = ticket.source.context.step;
    d["epoch"] = epoch_;
    d["from_world"] = ticket.source.context.from_world;
    d["to_world"] = comm_->comm->world_size();
    d["rank"] = comm_->comm->rank();
    d["seconds"] = Since(t0);
    d["bytes_fetched"] = loaded->bytes_fetched;
    return d;
  }

  // Asks the coordinator for a live resize without this rank (it leaves at
  // a step boundary the ranks agree on). "" when accepted, else why not.
  std::string RequestDrain() {
    if (!agent_ || !agent_args_.elastic) {
      return "the optimizer is not elastic=True under shardrun";
    }
    py::gil_scoped_release release;
    auto job = comm_->client->GetJob();
    absl::Status s = job.status();
    if (s.ok() && job->state() != "running") {
      s = absl::FailedPreconditionError(absl::StrCat("the job is ", job->state()));
    } else if (s.ok() && job->world_size() < 2) {
      s = absl::FailedPreconditionError("it is the job's only rank");
    }
    if (s.ok()) s = comm_->client->Resize(job->world_size() - 1, {comm_->comm->rank()}).status();
    return s.ok() ? "" : std::string(s.message());
  }

  // A live resize agreed after `step` (Step): this rank's owned state is
  // snapshotted in memory and served, and the old epoch's agent stops. A
  // rank that leaves waits until the new epoch has loaded its state ("rank"
  // -1 in the result: the process should exit); the others go on with
  // CompleteResize.
  py::dict BeginResize(const ResizeOrder& order, int64_t step) {
    PendingResize p;
    p.t0 = std::chrono::steady_clock::now();
    {
      // The step's parameter all-gathers land in the old buffers first.
      absl::Status s;
      {
        py::gil_scoped_release release;
        s = opt_->WaitForParameters();
      }
      if (!s.ok()) {
        FailWith(
            absl::StrCat("resizing to ", order.to_world, " ranks failed: ", DiagnoseReleased(s)));
      }
    }
    p.order = order;
    p.context = agent_->Context(step);
    p.old_layout = opt_->layout();
    const int old_rank = comm_->comm->rank(), new_rank = order.NewRank(old_rank);
    absl::StatusOr<std::unique_ptr<StateSnapshot>> snap;
    {
      py::gil_scoped_release release;
      snap = StateSnapshot::Take(*opt_, comm_->client.get(), order, p.context, agent_args_.host,
                                 agent_args_.token);
    }
    if (!snap.ok()) {
      FailWith(absl::StrCat("resizing to ", order.to_world,
                            " ranks failed: ", DiagnoseReleased(snap.status())));
    }
    p.snapshot = *std::move(snap);
    p.snapshot_s = Since(p.t0);
    {
      // The old epoch ends here for this rank (its agent leaves without Finish).
      py::gil_scoped_release release;
      agent_->Stop();
      agent_.reset();
    }
    py::dict d;
    d["step"] = step;
    d["epoch"] = order.epoch;
    d["from_world"] = order.from_world;
    d["to_world"] = order.to_world;
    d["previous_rank"] = old_rank;
    d["rank"] = new_rank;
    d["snapshot_bytes"] = p.snapshot->bytes();
    if (new_rank >= 0) {
      resize_ = std::move(p);
      return d;
    }
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = AwaitHandOver(comm_->client.get(), order.epoch, absl::Seconds(agent_args_.timeout_s));
    }
    if (!s.ok()) {
      ResizeFailed(old_rank, order, "waiting for the remaining ranks to take its state", s);
    }
    d["bytes_served"] = p.snapshot->bytes_served();
    return d;
  }

  // The rest of a live resize on a rank that stays, over `comm` (the new
  // epoch's communicator): a new optimizer over the same parameters, this
  // rank's agent in the new epoch, the state loaded from the snapshots.
  // Collective with the ranks that join (JoinRunning).
  py::dict CompleteResize(std::shared_ptr<PyCommunicator> comm) {
    if (!resize_) throw std::runtime_error("no live resize is under way");
    PendingResize p = std::move(*resize_);
    resize_.reset();
    const int old_rank = p.snapshot->old_rank();
    if (comm->comm->world_size() != p.order.to_world ||
        comm->comm->rank() != p.order.NewRank(old_rank)) {
      throw std::logic_error("the new epoch's communicator has another rank or world size");
    }
    const absl::Duration timeout = absl::Seconds(agent_args_.timeout_s);
    absl::StatusOr<SnapshotSource> source;
    ShardedOptimizerOptions o = options_;
    o.broadcast_initial_values = false;  // every value is restored from its owner right after
    absl::StatusOr<std::unique_ptr<ShardedOptimizer>> next;
    {
      py::gil_scoped_release release;
      source = FindSnapshots(comm->client.get(), p.order.epoch, timeout);
      if (source.ok()) next = ShardedOptimizer::Create(named_, o, comm->comm.get());
    }
    if (!source.ok()) ResizeFailed(old_rank, p.order, "finding the snapshots", source.status());
    if (!next.ok()) ResizeFailed(old_rank, p.order, "a new optimizer", next.status());
    // The old optimizer goes before its communicator; the parameters are
    // views of the new one's buffers now.
    opt_ = *std::move(next);
    comm_ = std::move(comm);
    epoch_ = p.order.epoch;
    RunAgent(p.context);
    const double formed_s = Since(p.t0);
    absl::StatusOr<SnapshotLoad> loaded;
    {
      py::gil_scoped_release release;
      loaded = LoadFromSnapshots(*opt_, *source, agent_args_.token, p.snapshot.get());
    }
    if (!loaded.ok()) {
      FailWith(absl::StrCat("resizing to ", p.order.to_world,
                            " ranks failed: ", DiagnoseReleased(loaded.status())));
    }
    // Every rank of the new epoch has loaded (the load ends with an
    // agreement): the leaving ranks may go.
    if (comm_->comm->rank() == 0) {
      if (absl::Status s = AnnounceHandOver(comm_->client.get(), epoch_); !s.ok()) {
        FailWith(absl::StrCat("resize: ", s.message()));
      }
    }
    absl::StatusOr<double> moved;
    {
      py::gil_scoped_release release;
      moved = SumOverRanks(comm_->comm.get(), loaded->bytes_fetched / 1048576.0, timeout);
    }
    if (!moved.ok()) FailWith(absl::StrCat("after the resize: ", DiagnoseReleased(moved.status())));
    const int64_t least = BytesChangingOwner(p.old_layout, opt_->layout(), p.order.leave,
                                             1 + static_cast<int>(opt_->state_names().size()));
    agent_->Resumed(p.context.step);
    last_step_end_.reset();
    py::dict d;
    d["seconds"] = Since(p.t0);
    d["snapshot_seconds"] = p.snapshot_s;
    d["form_seconds"] = formed_s - p.snapshot_s;
    d["load_seconds"] = Since(p.t0) - formed_s;
    d["moved_mib"] = *moved;
    d["least_mib"] = least / 1048576.0;
    d["snapshot_mib"] = p.snapshot->bytes() / 1048576.0;
    return d;
  }
  bool has_agent() const { return agent_ != nullptr; }
  std::string DiagnoseReleased(const absl::Status& s) {
    py::gil_scoped_release release;
    return agent_->Diagnose(s);
  }
  void BeforeStep() {
    if (agent_ && !step_open_) {
      agent_->BeforeStep(opt_->step_count() + 1);
      step_open_ = true;
    }
  }
  // Ends this rank in failure (tells the coordinator, reports the flight
  // record) and raises RuntimeError(message).
  [[noreturn]] void FailWith(const std::string& message) {
    if (agent_) {
      py::gil_scoped_release release;
      agent_->Fail(message);
      agent_.reset();
    }
    throw std::runtime_error(message);
  }
  void Finish() {
    if (!agent_) return;
    py::gil_scoped_release release;
    agent_->Finish();
    agent_.reset();
  }
  void Fail(const std::string& message) {
    if (!agent_) return;
    py::gil_scoped_release release;
    agent_->Fail(message);
    agent_.reset();
  }

  py::dict Step(py::object loss) {
    BeforeStep();
    step_open_ = false;
    const double l = loss.is_none() ? 0.0 : loss.cast<double>();
    const int64_t step = opt_->step_count() + 1;
    py::dict d;
    std::optional<AgreedStep> agreed;
    if (agent_) {
      // Agreed before the update: the all-reduce does not wait behind this
      // step's all-gathers, and a learning-rate change applies to this step.
      absl::StatusOr<AgreedStep> a;
      {
        py::gil_scoped_release release;
        a = agent_->AgreeBeforeUpdate(step, l);
      }
      if (!a.ok()) FailWith(absl::StrCat("step ", step, " failed: ", DiagnoseReleased(a.status())));
      agreed = *a;
      if (agreed->nonfinite_rank >= 0) {
        FailWith(std::isfinite(l)
                     ? absl::StrCat("rank ", agreed->nonfinite_rank,
                                    " had a non-finite loss at step ", step, "; stopping")
                     : absl::StrCat("non-finite loss (", l, ") at step ", step, "; stopping"));
      }
      if (agreed->new_lr) d["new_lr"] = *agreed->new_lr;
    }
    absl::StatusOr<StepResult> r;
    {
      py::gil_scoped_release release;
      r = opt_->Step();
    }
    if (!r.ok()) {
      if (!agent_) Raise(r.status());
      FailWith(absl::StrCat("step ", step, " failed: ", DiagnoseReleased(r.status())));
    }
    if (agent_) {
      // Throughput for heartbeats (shardctl status, /metrics): this rank's
      // samples over the time since the previous step ended.
      const auto now = std::chrono::steady_clock::now();
      if (samples_per_rank_ > 0 && last_step_end_.has_value()) {
        const double dt = std::chrono::duration<double>(now - *last_step_end_).count();
        if (dt > 0) agent_->SetSamplesPerSecond(samples_per_rank_ / dt);
      }
      last_step_end_ = now;
      agent_->FinishStep(r->step, *r, l);
      if (agreed->checkpoint) {
        absl::Status s;
        {
          py::gil_scoped_release release;
          s = agent_->CheckpointDuringTraining(r->step);
        }
        if (!s.ok()) FailWith(std::string(s.message()));
      }
    }
    // After the step's own checkpoint, so that a checkpoint and a resize
    // agreed at the same step both happen.
    if (agreed && agreed->resize) d["resize"] = BeginResize(*agreed->resize, r->step);
    d["step"] = r->step;
    d["grad_norm"] = r->grad_norm;
    d["clipped"] = r->clipped;
    d["comm_wait_seconds"] = r->comm_wait_seconds;
    d["update_seconds"] = r->update_seconds;
    return d;
  }

  void WaitBuckets(const std::vector<int>& buckets) {
    absl::Status s;
    {
      py::gil_scoped_release release;
      for (int b : buckets) {
        s = opt_->WaitForBucket(b);
        if (!s.ok()) break;
      }
    }
    CheckWait(s);
  }
  void WaitAll() {
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = opt_->WaitForParameters();
    }
    CheckWait(s);
  }
  // A failed all-gather seen by a forward pre-hook: under shardrun, the
  // coordinator's verdict names the rank at fault, as for a failed step.
  void CheckWait(const absl::Status& s) {
    if (s.ok() || !agent_) return Check(s);
    FailWith(absl::StrCat("step ", opt_->step_count() + 1, " failed: ", DiagnoseReleased(s)));
  }
  std::vector<int> BucketsOf(const std::vector<torch::Tensor>& params) const {
    return opt_->BucketsOf(params);
  }

  void ZeroGrad(bool set_to_none) {
    py::gil_scoped_release release;
    opt_->ZeroGrad(set_to_none);
  }
  // Collective: rank `root`'s bytes of `t` (contiguous, on the CPU or the
  // optimizer's device) into `t` on every rank, over the optimizer's
  // communicator (module buffers, as DistributedDataParallel broadcasts them).
  void Broadcast(torch::Tensor t, int root) {
    Communicator* comm = opt_->communicator();
    if (root < 0 || root >= comm->world_size()) throw py::value_error("root is outside the world");
    if (!t.is_contiguous()) throw py::value_error("broadcast needs a contiguous tensor");
    if (comm->world_size() == 1 || t.numel() == 0) return;
    absl::Status s;
    {
      py::gil_scoped_release release;
      CommHandlePtr h =
          comm->Broadcast(t.data_ptr(), static_cast<int64_t>(t.nbytes()), DType::kByte, root);
      s = h->Wait(opt_->options().timeout);
      if (!s.ok()) comm->Abort(s);
    }
    if (!s.ok()) {
      Raise(absl::Status(s.code(), absl::StrCat("rank ", comm->rank(),
                                                ": buffer broadcast failed: ", s.message())));
    }
  }
  // Under shardrun: every rank marks that it reached call `seq` (a
  // collective like state_dict()) in the coordinator's key-value store and
  // waits up to timeout_s for the others. Returns the ranks that did not
  // come; empty when all did. Without a coordinator: empty at once.
  std::vector<int> Join(const std::string& what, int64_t seq, double timeout_s) {
    std::vector<int> missing;
    if (!comm_->client || comm_->comm->world_size() == 1) return missing;
    py::gil_scoped_release release;
    const std::string base =
        absl::StrCat(comm_->job_id, "/shardopt-join/", epoch_, "/", what, "/", seq, "/");
    const int me = comm_->comm->rank();
    (void)comm_->client->KvSet(absl::StrCat(base, me), "1");
    const absl::Time deadline = absl::Now() + absl::Seconds(timeout_s);
    for (int r = 0; r < comm_->comm->world_size(); ++r) {
      if (r == me) continue;
      const absl::Duration left = std::max(absl::Milliseconds(1), deadline - absl::Now());
      if (!comm_->client->KvGet(absl::StrCat(base, r), left).ok()) missing.push_back(r);
    }
    return missing;
  }
  void SetGradSync(bool on) { opt_->SetGradientSync(on); }
  void FoldReducedGradients() {
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = opt_->FoldReducedGradients();
    }
    if (!s.ok()) Raise(s);
  }
  int NumGroups() const { return opt_->num_groups(); }
  py::dict Group(int g) const {
    if (g < 0 || g >= opt_->num_groups()) throw py::index_error("no such parameter group");
    return FromHyper(opt_->options().kind, opt_->group(g));
  }
  void SetGroup(int g, const py::dict& d) {
    if (g < 0 || g >= opt_->num_groups()) throw py::index_error("no such parameter group");
    Check(opt_->SetGroup(g, ToHyper(d, opt_->group(g))));
  }
  int64_t StepCount() const { return opt_->step_count(); }

  std::string SaveCheckpoint(const std::string& root,
                             const std::map<std::string, std::string>& meta, int keep) {
    CheckpointOptions co;
    co.user_metadata = meta;
    absl::StatusOr<std::string> dir;
    {
      py::gil_scoped_release release;
      const absl::Time t0 = absl::Now();
      dir = shardopt::SaveCheckpoint(*opt_, root, co);
      if (dir.ok() && agent_) {
        agent_->RecordCheckpoint(opt_->step_count(), *dir, absl::ToDoubleSeconds(absl::Now() - t0));
      }
      if (dir.ok() && keep > 0 && comm_->comm->rank() == 0) {
        (void)PruneCheckpoints(PosixFileSystem(), root, keep);
      }
    }
    return Take(std::move(dir));
  }

  py::dict LoadCheckpoint(const std::string& path) {
    absl::StatusOr<RestoredCheckpoint> r;
    {
      py::gil_scoped_release release;
      r = LoadAnyCheckpoint(*opt_, path);
    }
    if (!r.ok()) Raise(r.status());
    py::dict d;
    d["path"] = r->path;
    d["format"] = r->format;
    d["step"] = r->step;
    d["world_size"] = r->world_size;
    d["metadata"] = r->user_metadata;
    return d;
  }

  // {name: {"param": fp32, state...}} of every trainable parameter, on every rank.
  py::dict GetFullState() {
    absl::StatusOr<shardopt::FullState> s;
    {
      py::gil_scoped_release release;
      s = GatherFullState(*opt_);
    }
    if (!s.ok()) Raise(s.status());
    py::dict out;
    for (auto& [name, arrays] : s->tensors) {
      py::dict per;
      for (auto& [k, t] : arrays) per[py::str(k)] = t;
      auto count = s->param_steps.find(name);
      per["step"] = count != s->param_steps.end() ? count->second : s->step;
      out[py::str(name)] = per;
    }
    return out;
  }

  void LoadState(const std::map<std::string, std::map<std::string, torch::Tensor>>& state,
                 int64_t step, const std::map<std::string, int64_t>& param_steps) {
    shardopt::FullState s;
    s.step = step;
    s.tensors = state;
    s.param_steps = param_steps;
    py::gil_scoped_release release;
    Check(LoadFullState(*opt_, s));
  }

  py::dict Layout() const {
    const shardopt::Layout& l = opt_->layout();
    py::dict d;
    d["world_size"] = l.world_size();
    d["hash"] = absl::StrFormat("%016x", l.hash());
    d["flat_size"] = l.flat_size();
    d["num_buckets"] = static_cast<int64_t>(l.buckets().size());
    py::list params;
    for (size_t i = 0; i < l.params().size(); ++i) {
      const ParamSpec& p = l.params()[i];
      py::dict pd;
      pd["name"] = p.name;
      pd["shape"] = p.shape;
      pd["trainable"] = p.trainable;
      pd["bucket"] = l.placement(static_cast<int>(i)).bucket;
      py::list owners;
      if (p.trainable) {
        auto pieces = l.Locate(static_cast<int>(i), 0, l.placement(static_cast<int>(i)).numel);
        if (pieces.ok()) {
          for (const Piece& pc : *pieces) {
            owners.append(py::make_tuple(pc.rank, pc.param_offset, pc.length));
          }
        }
      }
      pd["owners"] = owners;  // (rank, first element, elements)
      params.append(pd);
    }
    d["params"] = params;
    py::list owned;
    for (int64_t e : l.owned_elements()) owned.append(e);
    d["owned_elements"] = owned;
    return d;
  }

  // ShardedOptimizer(advise=True): the job's link, measured with all-reduces
  // over its communicator (collective), then the advisor's two lines.
  void MeasureLink() {
    absl::StatusOr<advisor::Link> l;
    {
      py::gil_scoped_release release;
      l = shardopt::MeasureLink(comm_->comm.get(), opt_->options().timeout);
    }
    Check(l.status());
    link_ = *l;
  }
  std::string AdviceLines(double fwd_bwd_s, double update_s) const {
    return Take(shardopt::AdviceLines(*opt_, link_, fwd_bwd_s, update_s));
  }

  py::dict Memory() const {
    const MemoryReport m = opt_->memory();
    py::dict d;
    d["master_bytes"] = m.master_bytes;
    d["state_bytes"] = m.state_bytes;
    d["grad_bytes"] = m.grad_bytes;
    d["param_bytes"] = m.param_bytes;
    d["total_bytes"] = m.total();
    return d;
  }
  int rank() const { return comm_->comm->rank(); }
  std::string abort_reason() const { return agent_ ? agent_->abort_reason() : ""; }
  int world_size() const { return comm_->comm->world_size(); }
  int64_t epoch() const { return epoch_; }
  ShardedOptimizer* get() { return opt_.get(); }

 private:
  // What StartAgent was given, for the agents of later membership epochs.
  struct AgentArgs {
    std::string host, token, ckpt_dir;
    int ckpt_keep = 0;
    double timeout_s = 300;
    int coordinator_rank = -1;
    bool elastic = false;
  };
  // A live resize between BeginResize and CompleteResize.
  struct PendingResize {
    ResizeOrder order;
    ResizeContext context;
    std::unique_ptr<StateSnapshot> snapshot;
    shardopt::Layout old_layout;
    std::chrono::steady_clock::time_point t0;
    double snapshot_s = 0;
  };

  static double Since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  void SetAgentArgs(const std::string& host, const std::string& token, const std::string& ckpt_dir,
                    int ckpt_keep, int64_t samples_per_rank, double timeout_s, int coordinator_rank,
                    bool elastic) {
    if (samples_per_rank < 0) throw py::value_error("batch_size must be >= 0");
    if (!(timeout_s > 0)) throw py::value_error("timeout must be > 0 seconds");
    if (!comm_->client) throw std::runtime_error("no coordinator (not launched by shardrun)");
    samples_per_rank_ = static_cast<double>(samples_per_rank);
    agent_args_ = AgentArgs{host, token, ckpt_dir, ckpt_keep, timeout_s, coordinator_rank, elastic};
  }
  // This rank's agent in the current epoch (Join waits for every rank of
  // it), starting from `context` (the step and the control requests already
  // acted on before the epoch).
  void RunAgent(const ResizeContext& context) {
    RankAgentOptions o;
    o.job_id = comm_->job_id;
    o.rank = comm_->comm->rank();
    o.host = agent_args_.host;
    o.token = agent_args_.token;
    o.device = opt_->on_device() ? "cuda" : "cpu";
    o.collective_timeout = absl::Seconds(agent_args_.timeout_s);
    o.ckpt_dir = agent_args_.ckpt_dir;
    o.ckpt_keep = agent_args_.ckpt_keep;
    o.samples_per_step = static_cast<int64_t>(samples_per_rank_) * comm_->comm->world_size();
    o.log_name = "shardopt";
    o.coordinator_rank = agent_args_.coordinator_rank;
    o.coordinator_address = comm_->client->address();
    o.epoch = epoch_;
    o.elastic = agent_args_.elastic;
    o.start_step = context.step;
    o.checkpoint_requests_done = context.checkpoint_requests_done;
    o.lr_versions_done = context.lr_versions_done;
    o.resize_requests_done = context.resize_requests_done;
    absl::StatusOr<std::unique_ptr<RankAgent>> a;
    {
      py::gil_scoped_release release;
      a = RankAgent::Start(comm_->client.get(), opt_.get(), o);
    }
    if (!a.ok() && epoch_ > 0) {
      // No agent to report it: the job fails from here.
      (void)comm_->client->Abort(a.status().ToString(), comm_->comm->rank());
    }
    agent_ = Take(std::move(a));
  }
  // A resize that failed before this rank's agent of the new epoch runs:
  // the job fails (Abort), and RuntimeError.
  [[noreturn]] void ResizeFailed(int rank, const ResizeOrder& order, const std::string& what,
                                 const absl::Status& s) {
    const std::string msg =
        absl::StrCat("resizing to ", order.to_world, " ranks failed: ", what, ": ", s.message());
    {
      py::gil_scoped_release release;
      (void)comm_->client->Abort(msg, rank);
    }
    throw std::runtime_error(msg);
  }

  std::shared_ptr<PyCommunicator> comm_;
  py::object external_;  // ShardedOptimizerOptions::external_update's callable
  std::vector<std::pair<std::string, torch::Tensor>> named_;
  ShardedOptimizerOptions options_;  // what opt_ was made with (a resize makes another)
  AgentArgs agent_args_;
  int64_t epoch_ = 0;  // the membership epoch (a live resize starts the next)
  std::optional<PendingResize> resize_;
  std::unique_ptr<ShardedOptimizer> opt_;
  double samples_per_rank_ = 0;
  std::optional<std::chrono::steady_clock::time_point> last_step_end_;
  advisor::Link link_;                // MeasureLink's
  std::unique_ptr<RankAgent> agent_;  // declared last: stopped first
  bool step_open_ = false;
};

// shardopt.advise (python/src/shardopt/advisor.py): the cost model of
// advisor/cost_model.h for a model given by its parameter shapes, or by
// `model` (a standard model name); a dict per strategy and the
// recommendation.
// Every error of advise()'s inputs is a bad argument (ValueError).
void CheckArgument(const absl::Status& s) {
  if (!s.ok()) Raise(absl::InvalidArgumentError(s.message()));
}

py::dict Advise(const std::vector<std::vector<int64_t>>& shapes,
                const std::vector<std::vector<int64_t>>& buffer_shapes, const std::string& model,
                int world_size, int ranks_per_node, const std::string& intra,
                const std::string& inter, bool cpu, double forward_s, double backward_s,
                double fused_s, double unfused_s, double per_tensor_s, const std::string& precision,
                const std::string& optimizer, double bucket_mb, double zero2_bucket_mb,
                double activation_bytes, double memory_limit_bytes) {
  std::vector<ParamSpec> params, buffers;
  if (!model.empty()) {
    auto specs = advisor::StandardModel(model);
    CheckArgument(specs.status());
    params = *specs;
  }
  for (size_t i = 0; i < shapes.size(); ++i) params.push_back({absl::StrCat(i), shapes[i]});
  for (size_t i = 0; i < buffer_shapes.size(); ++i) {
    buffers.push_back({absl::StrCat(i), buffer_shapes[i]});
  }
  const advisor::ModelInfo info = advisor::ModelOf(model, params, buffers);
  advisor::Cluster c;
  c.world_size = world_size;
  c.ranks_per_node = ranks_per_node;
  auto a = advisor::LinkFromSpec(intra);
  CheckArgument(a.status());
  auto b = advisor::LinkFromSpec(inter);
  CheckArgument(b.status());
  c.intra = *a;
  c.inter = *b;
  c.comm_on_compute_cores = cpu;
  advisor::Compute k{forward_s, backward_s, fused_s, unfused_s, per_tensor_s};
  advisor::Precision pr;
  if (precision == "mixed") {
    pr = advisor::Precision{2, 2, 4, 8};
  } else if (precision != "fp32") {
    CheckArgument(absl::InvalidArgumentError("precision must be 'fp32' or 'mixed'"));
  }
  if (optimizer != "adam" && optimizer != "adamw" && optimizer != "rmsprop" && optimizer != "sgd") {
    CheckArgument(absl::InvalidArgumentError("optimizer must be adam, adamw, rmsprop or sgd"));
  }
  pr.state = optimizer == "sgd" ? 4 : 8;
  if (!(bucket_mb > 0) || !(zero2_bucket_mb > 0)) {
    CheckArgument(absl::InvalidArgumentError("bucket sizes must be > 0 MiB"));
  }
  advisor::Options o;
  o.bucket_bytes = std::max<int64_t>(1, static_cast<int64_t>(bucket_mb * (1 << 20)));
  o.zero2_bucket_bytes = std::max<int64_t>(1, static_cast<int64_t>(zero2_bucket_mb * (1 << 20)));
  o.activation_bytes = activation_bytes;
  o.broadcast_buffers = !buffer_shapes.empty();
  py::list rows;
  for (advisor::Strategy st : advisor::AllStrategies()) {
    auto p = advisor::Predict(info, c, k, pr, o, st);
    CheckArgument(p.status());
    py::dict d, mem;
    d["strategy"] = advisor::StrategyName(st);
    d["step_s"] = p->step_s;
    d["compute_s"] = p->compute_s;
    d["exposed_comm_s"] = p->exposed_comm_s;
    d["optimizer_s"] = p->optimizer_s;
    d["bytes_sent"] = p->bytes_sent;
    d["collectives"] = p->collectives;
    mem["params"] = p->memory.params;
    mem["grads"] = p->memory.grads;
    mem["state"] = p->memory.state;
    mem["master"] = p->memory.master;
    mem["staging"] = p->memory.staging;
    mem["activations"] = p->memory.activations;
    mem["total"] = p->memory.total();
    d["memory"] = mem;
    rows.append(d);
  }
  auto r = advisor::Recommend(info, c, k, pr, memory_limit_bytes);
  CheckArgument(r.status());
  py::dict out, rec;
  rec["strategy"] = advisor::StrategyName(r->strategy);
  rec["bucket_bytes"] = r->bucket_bytes;
  rec["shard_gradients"] = r->shard_gradients;
  rec["why"] = r->why;
  out["parameters"] = info.elements();
  out["tensors"] = info.numel.size();
  out["world_size"] = world_size;
  out["nodes"] = advisor::Nodes(c);
  out["ring_bandwidth"] = advisor::RingLink(c).bandwidth;
  out["strategies"] = rows;
  out["recommended"] = rec;
  return out;
}

void BindAdvisor(py::module_& m) {
  m.def("advise", &Advise, py::arg("shapes"), py::arg("buffer_shapes"), py::arg("model"),
        py::arg("world_size"), py::arg("ranks_per_node"), py::arg("intra"), py::arg("inter"),
        py::arg("cpu"), py::arg("forward_s"), py::arg("backward_s"), py::arg("fused_s"),
        py::arg("unfused_s"), py::arg("per_tensor_s"), py::arg("precision"), py::arg("optimizer"),
        py::arg("bucket_mb"), py::arg("zero2_bucket_mb"), py::arg("activation_bytes"),
        py::arg("memory_limit_bytes"));
}

// The module's bindings, in the order PYBIND11_MODULE registers them (a
// type is bound before the functions whose signatures name it).
void BindHyperParameters(py::module_& m) {
  // The one rule per hyper-parameter (common/hyper_params.h): ValueError
  // naming the value and its range, as every other path says it.
  m.def(
      "validate_hyper_parameter",
      [](const std::string& name, double value) {
        auto p = ParseHyperParameterName(name);
        if (!p) throw py::value_error("unknown hyper-parameter '" + name + "'");
        Check(ValidateHyperParameter(*p, value));
      },
      py::arg("name"), py::arg("value"));
}

void BindHostAllocator(py::module_& m) {
  m.def("install_host_allocator", [] {
    InstallHostAllocator();
    return std::string(DescribeHostAllocator());
  });
  m.def("host_allocator_stats", [] {
    py::dict d;
    LargeBlockCachingAllocator* a = InstalledHostAllocator();
    if (a == nullptr) return d;
    const HostAllocatorStats st = a->stats();
    d["mapped_bytes"] = st.mapped_bytes;
    d["kept_bytes"] = st.kept_bytes;
    d["peak_mapped_bytes"] = st.peak_mapped_bytes;
    d["maps"] = st.maps;
    d["reuses"] = st.reuses;
    d["reuses_larger"] = st.reuses_larger;
    return d;
  });
}

// A rank started to grow a running job: says it is ready (the job goes on
// training until every new rank is) and waits for the snapshots of the
// ranks already there. None when the job finished first (this rank is not
// needed); RuntimeError when it failed or the wait timed out.
py::object AwaitJoin(const std::string& address, const std::string& token,
                     const std::string& tls_ca, const std::string& tls_cert,
                     const std::string& tls_key, int64_t epoch, int rank, int world,
                     int64_t total_elements, double timeout_s) {
  if (epoch < 1) throw py::value_error("the membership epoch to join must be >= 1");
  if (world < 1 || rank < 0 || rank >= world) {
    throw py::value_error(absl::StrCat("rank ", rank, " is outside a world of ", world));
  }
  if (!(timeout_s > 0)) throw py::value_error("timeout must be > 0 seconds");
  auto creds = MakeChannelCredentials(ClientTls{tls_ca, tls_cert, tls_key});
  if (!creds.ok()) Raise(creds.status());
  CoordinatorClient client(address, token, *creds);
  absl::StatusOr<SnapshotSource> source;
  {
    py::gil_scoped_release release;
    const absl::Duration timeout = absl::Seconds(timeout_s);
    PrefaultStateBuffers(total_elements, world);
    absl::Status s = client.WaitUntilReachable(timeout);
    if (s.ok()) s = client.KvSet(ResizeReadyKey(epoch, rank), "1");
    source = s.ok() ? AwaitSnapshotsToJoin(&client, epoch, world, timeout)
                    : absl::StatusOr<SnapshotSource>(s);
  }
  if (!source.ok()) {
    if (absl::IsCancelled(source.status())) return py::none();
    throw std::runtime_error(
        absl::StrCat("cannot join epoch ", epoch, ": ", source.status().message()));
  }
  auto ticket = std::make_unique<JoinTicket>();
  ticket->source = *std::move(source);
  ticket->to_world = world;
  return py::cast(std::move(ticket));
}

void BindCommunicator(py::module_& m) {
  py::class_<JoinTicket>(m, "JoinTicket")
      .def_property_readonly("step", [](const JoinTicket& t) { return t.source.context.step; })
      .def_property_readonly("epoch", [](const JoinTicket& t) { return t.source.epoch; })
      .def_property_readonly("from_world",
                             [](const JoinTicket& t) { return t.source.context.from_world; });
  m.def("await_join", &AwaitJoin, py::arg("address"), py::arg("token"), py::arg("tls_ca"),
        py::arg("tls_cert"), py::arg("tls_key"), py::arg("epoch"), py::arg("rank"),
        py::arg("world_size"), py::arg("total_elements"), py::arg("timeout_s"));
  py::class_<PyCommunicator, std::shared_ptr<PyCommunicator>>(m, "Communicator")
      .def_property_readonly("rank", [](const PyCommunicator& c) { return c.comm->rank(); })
      .def_property_readonly("world_size",
                             [](const PyCommunicator& c) { return c.comm->world_size(); })
      .def_property_readonly("transport", [](const PyCommunicator& c) { return c.transport; });
  m.def("make_coordinator_communicator", &MakeCoordinatorCommunicator, py::arg("rank"),
        py::arg("world_size"), py::arg("address"), py::arg("token"), py::arg("job_id"),
        py::arg("prefix"), py::arg("timeout_s"), py::arg("hostname"), py::arg("tls_ca"),
        py::arg("tls_cert"), py::arg("tls_key"), py::arg("transport") = "auto");
  m.def("make_communicator", &MakeCommunicator, py::arg("rank"), py::arg("world_size"),
        py::arg("store"), py::arg("prefix"), py::arg("timeout_s"), py::arg("hostname"),
        py::arg("transport") = "auto");
}

// Who this process is (LaunchEnvironment) and where the job's coordinator is
// (PlanRendezvous), for init(); ValueError naming a bad variable.
py::dict LaunchEnvironmentDict() {
  auto e = ReadLaunchEnvironment();
  if (!e.ok()) throw py::value_error(std::string(e.status().message()));
  py::dict d;
  d["launcher"] = e->launcher;
  d["rank"] = e->rank;
  d["world_size"] = e->world_size;
  d["local_rank"] = e->local_rank;
  d["local_world_size"] = e->local_world_size;
  d["node_rank"] = e->node_rank;
  d["num_nodes"] = e->num_nodes;
  d["nodes"] = e->nodes;
  d["master_addr"] = e->master_addr;
  d["master_port"] = e->master_port;
  d["job_id"] = e->job_id;
  d["step_id"] = e->step_id;
  d["node_name"] = e->node_name;
  d["note"] = e->note;
  auto r = PlanRendezvous(*e);
  if (!r.ok()) throw py::value_error(std::string(r.status().message()));
  d["coordinator"] = r->coordinator;
  d["host_coordinator"] = r->host_coordinator;
  d["served_by_rank0"] = r->served_by_rank0;
  d["listen"] = r->listen;
  d["bind"] = r->bind;
  d["rendezvous_job_id"] = r->job_id;
  return d;
}

void BindLaunch(py::module_& m) {
  m.def("launch_environment", &LaunchEnvironmentDict);
  py::class_<HostedCoordinator>(m, "HostedCoordinator")
      .def_property_readonly("address", &HostedCoordinator::address)
      .def(
          "release",
          [](HostedCoordinator& h, double timeout_s) {
            JobStatus j;
            {
              py::gil_scoped_release release;
              j = h.Release(absl::Seconds(timeout_s));
            }
            return std::string(JobStateName(j.state));
          },
          py::arg("timeout_s"));
  m.def(
      "host_coordinator",
      [](const std::string& listen, const std::string& advertised, const std::string& job_id,
         int world_size, const std::string& token, double heartbeat_timeout_s) {
        HostedCoordinatorOptions o;
        o.listen = listen;
        o.advertised = advertised;
        o.job_id = job_id;
        o.world_size = world_size;
        o.token = token;
        o.heartbeat_timeout = absl::Seconds(heartbeat_timeout_s);
        o.on_event = [](const std::string& line) {
          std::fprintf(stdout, "shardopt: coordinator: %s\n", line.c_str());
          std::fflush(stdout);
        };
        auto h = HostedCoordinator::Start(std::move(o));
        if (!h.ok()) Raise(h.status());
        return std::unique_ptr<HostedCoordinator>(*std::move(h));
      },
      py::arg("listen"), py::arg("advertised"), py::arg("job_id"), py::arg("world_size"),
      py::arg("token"), py::arg("heartbeat_timeout_s"));
}

void BindOptimizerArgs(py::module_& m) {
  py::class_<PyOptimizerArgs>(m, "OptimizerArgs")
      .def(py::init<>())
      .def_readwrite("param_group", &PyOptimizerArgs::param_group)
      .def_readwrite("kind", &PyOptimizerArgs::kind)
      .def_readwrite("groups", &PyOptimizerArgs::groups)
      .def_readwrite("max_grad_norm", &PyOptimizerArgs::max_grad_norm)
      .def_readwrite("bucket_cap_elements", &PyOptimizerArgs::bucket_cap_elements)
      .def_readwrite("grad_bf16", &PyOptimizerArgs::grad_bf16)
      .def_readwrite("timeout_s", &PyOptimizerArgs::timeout_s)
      .def_readwrite("kernel_threads", &PyOptimizerArgs::kernel_threads)
      .def_readwrite("overlap_param_gather", &PyOptimizerArgs::overlap_param_gather)
      .def_readwrite("shard_gradients", &PyOptimizerArgs::shard_gradients)
      .def_readwrite("external_update", &PyOptimizerArgs::external_update)
      .def_readwrite("allow_cut", &PyOptimizerArgs::allow_cut)
      .def_readwrite("broadcast_initial_values", &PyOptimizerArgs::broadcast_initial_values);
}

void BindOptimizer(py::module_& m) {
  py::class_<PyOptimizer>(m, "Optimizer")
      .def(py::init<std::shared_ptr<PyCommunicator>, const std::vector<std::string>&,
                    const std::vector<torch::Tensor>&, const PyOptimizerArgs&>(),
           py::arg("comm"), py::arg("names"), py::arg("tensors"), py::arg("args"))
      .def("wait_buckets", &PyOptimizer::WaitBuckets)
      .def("wait_all", &PyOptimizer::WaitAll)
      .def("buckets_of", &PyOptimizer::BucketsOf)
      .def("step", &PyOptimizer::Step, py::arg("loss") = py::none())
      .def("start_agent", &PyOptimizer::StartAgent, py::arg("host"), py::arg("token"),
           py::arg("ckpt_dir"), py::arg("ckpt_keep"), py::arg("samples_per_rank"),
           py::arg("timeout_s"), py::arg("coordinator_rank") = -1, py::arg("elastic") = false)
      .def("join_running", &PyOptimizer::JoinRunning, py::arg("ticket"), py::arg("host"),
           py::arg("token"), py::arg("ckpt_dir"), py::arg("ckpt_keep"), py::arg("samples_per_rank"),
           py::arg("timeout_s"))
      .def("complete_resize", &PyOptimizer::CompleteResize, py::arg("comm"))
      .def("request_drain", &PyOptimizer::RequestDrain)
      .def_property_readonly("epoch", &PyOptimizer::epoch)
      .def("has_agent", &PyOptimizer::has_agent)
      .def("before_step", &PyOptimizer::BeforeStep)
      .def("finish", &PyOptimizer::Finish)
      .def("fail", &PyOptimizer::Fail)
      .def_property_readonly("abort_reason", &PyOptimizer::abort_reason)
      .def("zero_grad", &PyOptimizer::ZeroGrad, py::arg("set_to_none") = false)
      .def("join", &PyOptimizer::Join, py::arg("what"), py::arg("seq"), py::arg("timeout_s"))
      .def("fold_reduced_gradients", &PyOptimizer::FoldReducedGradients)
      .def("broadcast", &PyOptimizer::Broadcast, py::arg("tensor"), py::arg("root") = 0)
      .def("set_grad_sync", &PyOptimizer::SetGradSync)
      .def("num_groups", &PyOptimizer::NumGroups)
      .def("group", &PyOptimizer::Group)
      .def("set_group", &PyOptimizer::SetGroup)
      .def_property_readonly("step_count", &PyOptimizer::StepCount)
      .def_property_readonly("rank", &PyOptimizer::rank)
      .def_property_readonly("world_size", &PyOptimizer::world_size)
      .def("save_checkpoint", &PyOptimizer::SaveCheckpoint)
      .def("load_checkpoint", &PyOptimizer::LoadCheckpoint)
      .def("full_state", &PyOptimizer::GetFullState)
      .def("load_state", &PyOptimizer::LoadState, py::arg("state"), py::arg("step"),
           py::arg("param_steps") = std::map<std::string, int64_t>())
      .def("layout", &PyOptimizer::Layout)
      .def("measure_link", &PyOptimizer::MeasureLink)
      .def("advice_lines", &PyOptimizer::AdviceLines, py::arg("fwd_bwd_s"), py::arg("update_s"))
      .def("memory", &PyOptimizer::Memory);
}

}  // namespace
}  // namespace shardopt

PYBIND11_MODULE(_C, m) {
  using namespace shardopt;
  m.doc() = "shardopt's C++ core (use the shardopt package, not this module)";
  // Debian's python3-torch (the torch this extension is built against) has no
  // CUDA, so neither has the extension: GPU training is C++ only
  // (docs/gpu.md). The package refuses CUDA parameters with that reason.
  m.attr("has_cuda") = false;
  BindHyperParameters(m);
  BindHostAllocator(m);
  BindCommunicator(m);
  BindLaunch(m);
  BindOptimizerArgs(m);
  BindOptimizer(m);
  BindAdvisor(m);
}
