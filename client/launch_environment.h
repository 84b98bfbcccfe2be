// Where a rank learns who it is: one mapping of every launcher's variables
// to rank, world size, local rank, node and the rendezvous address, so that
// nothing launcher-specific leaks into the trainer, shardrun or Python's
// init(). Recognised, in this order (the first that sets a rank wins):
// - shardrun and torchrun: RANK, WORLD_SIZE, LOCAL_RANK, (torchrun)
//   MASTER_ADDR / MASTER_PORT, GROUP_RANK / NODE_RANK;
// - Slurm (srun): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID,
//   SLURM_NNODES, SLURM_JOB_NODELIST (expanded as `scontrol show hostnames`
//   does; the first node is the rendezvous host), SLURM_JOB_ID;
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
};

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
