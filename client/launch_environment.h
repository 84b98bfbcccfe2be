// Where a rank learns who it is: one mapping of every launcher's variables
// to rank, world size, local rank, node and the rendezvous address, so that
// nothing launcher-specific leaks into the trainer, shardrun or Python's
// init(). Recognised, in this order (the first that sets a rank wins):
// - shardrun and torchrun: RANK, WORLD_SIZE, LOCAL_RANK, (torchrun)
//   MASTER_ADDR / MASTER_PORT, GROUP_RANK / NODE_RANK;
// - Slurm (a task of an srun step: SLURM_PROCID and SLURM_STEP_ID set):
//   SLURM_PROCID, SLURM_STEP_NUM_TASKS / SLURM_NTASKS, SLURM_LOCALID,
//   SLURM_NODEID, SLURM_STEP_NUM_NODES / SLURM_NNODES, SLURM_STEP_NODELIST /
//   SLURM_JOB_NODELIST (expanded as `scontrol show hostnames` does; the
//   step's first node is the rendezvous host), SLURM_STEP_TASKS_PER_NODE,
//   SLURMD_NODENAME, SLURM_JOB_ID, SLURM_STEP_ID. sbatch's batch script
//   itself (SLURM_PROCID=0 and SLURM_NTASKS of the whole allocation, but no
//   step) is one process, not rank 0 of the job: `note` says so;
// - Kubernetes Indexed Jobs: JOB_COMPLETION_INDEX (the rank) with the world
//   size from WORLD_SIZE or SHARDOPT_WORLD_SIZE (the Job's completions, set
//   in the manifest: Kubernetes has no variable for it).
// Torch-free; reads the environment through a function (tests pass a map).
#ifndef SHARDOPT_CLIENT_LAUNCH_ENVIRONMENT_H_
#define SHARDOPT_CLIENT_LAUNCH_ENVIRONMENT_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardopt {

struct LaunchEnvironment {
  // "shardrun" (SHARDOPT_COORDINATOR set), "torchrun", "slurm", "kubernetes",
  // or "none" (one rank by itself).
  std::string launcher = "none";
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int node_rank = 0;
  int num_nodes = 1;
  std::vector<std::string> nodes;  // Slurm: every node of the job, in order
  std::string master_addr;         // where rank 0 listens for the rendezvous ("" unknown)
  int master_port = 0;             // 0: unknown
  std::string job_id;              // Slurm's job id, else ""
  std::string step_id;             // Slurm's step id (the srun), else ""
  std::string node_name;           // Slurm: this node's name (SLURMD_NODENAME), else ""
  int local_world_size = 0;        // ranks on this node, 0: unknown
  // Why launcher variables present were not taken ("" when none were left
  // out): a process in sbatch's batch script, outside any srun step.
  std::string note;
};

// How this process reaches the job's coordinator, and what it serves.
struct Rendezvous {
  // host:port every rank dials; "" when the launcher gives none (a single
  // process or a torchrun-style launcher: no shardopt control plane).
  std::string coordinator;
  // This process serves the coordinator (rank 0 under Slurm or Kubernetes,
  // when no SHARDOPT_COORDINATOR is given), listening on `listen`.
  bool host_coordinator = false;
  std::string listen;
  // Rank 0's process serves it (this one or another): under Slurm or
  // Kubernetes without SHARDOPT_COORDINATOR.
  bool served_by_rank0 = false;
  // The address of this rank's own services (shard owner, Gloo): reachable
  // from the other ranks' hosts.
  std::string bind;
  std::string job_id;
};

// The coordinator port of a Slurm step when SHARDOPT_PORT is not given: a
// function of the job and step ids in [20000, 29000), the same on every
// task of the step (and different for two steps of one job).
int DefaultSlurmPort(absl::string_view job_id, absl::string_view step_id);
// Kubernetes' default coordinator port when SHARDOPT_PORT is not given.
inline constexpr int kDefaultKubernetesPort = 29400;

// The rendezvous for `env`:
// - SHARDOPT_COORDINATOR set (shardrun, or given by hand): dial it;
// - under Slurm or Kubernetes without it: rank 0 hosts the coordinator on
//   $SHARDOPT_LISTEN (default 0.0.0.0):PORT and every rank dials HOST:PORT, where HOST is
//   $MASTER_ADDR, else (Slurm) the step's first node, and PORT is $SHARDOPT_PORT, else
//   DefaultSlurmPort / kDefaultKubernetesPort;
// - otherwise no coordinator.
// bind: $SHARDOPT_BIND, else the Slurm node's name, else (Kubernetes) the
// pod's $HOSTNAME, else 127.0.0.1. job_id: $SHARDOPT_JOB_ID, else Slurm's
// job id, else "job". InvalidArgument naming the variable for a bad port or
// a Kubernetes job without MASTER_ADDR.
absl::StatusOr<Rendezvous> PlanRendezvous(const LaunchEnvironment& env,
                                          const std::function<const char*(const char*)>& getenv);
// The process's own environment; a Slurm node name (or pod name) that does
// not resolve here is replaced by this host's name (gethostname) for `bind`.
absl::StatusOr<Rendezvous> PlanRendezvous(const LaunchEnvironment& env);

// Slurm's SLURM_STEP_TASKS_PER_NODE ("2(x3),1": 2 tasks on each of the
// first 3 nodes, then 1): the tasks on node `node`. InvalidArgument when it
// does not parse or has no such node.
absl::StatusOr<int> TasksOnNode(absl::string_view tasks_per_node, int node);

// `getenv` returns nullptr for an unset variable. InvalidArgument naming the
// variable for a malformed or out-of-range value (a rank outside the world,
// a local rank below 0, a node list that does not parse, a node id outside
// it), never a silent default.
absl::StatusOr<LaunchEnvironment> ReadLaunchEnvironment(
    const std::function<const char*(const char*)>& getenv);
// The process's own environment.
absl::StatusOr<LaunchEnvironment> ReadLaunchEnvironment();

// Slurm's hostlist syntax, as `scontrol show hostnames` expands it:
// "node[01-03,07],gpu5,rack[1-2]-n[1-2]" -> node01 node02 node03 node07 gpu5
// rack1-n1 rack1-n2 rack2-n1 rack2-n2 (zero padding kept; several bracket
// groups in one name multiply). InvalidArgument for unbalanced brackets, an
// empty name or range, a range whose end is below its start, or more than
// `max_hosts` names.
absl::StatusOr<std::vector<std::string>> ExpandHostlist(absl::string_view list,
                                                        size_t max_hosts = 1 << 20);

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_LAUNCH_ENVIRONMENT_H_
