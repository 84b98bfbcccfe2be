// LaunchEnvironment with each launcher's variables as that launcher sets
// them (shardrun, torchrun, srun, a Kubernetes Indexed Job), and Slurm's
// hostlist syntax as `scontrol show hostnames` expands it.
#include "client/launch_environment.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

namespace shardopt {
namespace {

absl::StatusOr<LaunchEnvironment> Read(const std::map<std::string, std::string>& vars) {
  return ReadLaunchEnvironment([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

using Hosts = std::vector<std::string>;

TEST(HostlistTest, ExpandsAsScontrolShowHostnames) {
  EXPECT_EQ(*ExpandHostlist("node1"), Hosts({"node1"}));
  EXPECT_EQ(*ExpandHostlist("node[01-03,07],gpu5"),
            Hosts({"node01", "node02", "node03", "node07", "gpu5"}));
  EXPECT_EQ(*ExpandHostlist("n[8-10]"), Hosts({"n8", "n9", "n10"}));
  EXPECT_EQ(*ExpandHostlist("rack[1-2]-n[1-2]"),
            Hosts({"rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"}));
  EXPECT_EQ(*ExpandHostlist("a[009-011]b"), Hosts({"a009b", "a010b", "a011b"}));
  EXPECT_EQ(*ExpandHostlist("x[3]"), Hosts({"x3"}));
}

TEST(HostlistTest, RefusesWhatSlurmWouldNotWrite) {
  for (const char* bad : {"", "a,,b", "node[1-", "node1-2]", "node[2-1]", "node[a-b]", "node[1-2",
                          "n[[1]]", "n[]", "n[1,]", "n[-3]"}) {
    auto r = ExpandHostlist(bad);
    EXPECT_FALSE(r.ok()) << "'" << bad << "' expanded to " << (r.ok() ? r->size() : 0);
  }
  EXPECT_FALSE(ExpandHostlist("n[1-2000000]").ok());            // past the default limit
  EXPECT_FALSE(ExpandHostlist("a[1-100]b[1-100]", 5000).ok());  // the product counts
}

TEST(LaunchEnvironmentTest, NoLauncherIsOneRank) {
  auto e = Read({});
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->launcher, "none");
  EXPECT_EQ(e->world_size, 1);
  EXPECT_EQ(e->rank, 0);
}

TEST(LaunchEnvironmentTest, ShardrunAndTorchrun) {
  auto s = Read({{"RANK", "1"},
                 {"WORLD_SIZE", "4"},
                 {"LOCAL_RANK", "1"},
                 {"SHARDOPT_COORDINATOR", "127.0.0.1:5000"}});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->launcher, "shardrun");
  EXPECT_EQ(s->rank, 1);
  EXPECT_EQ(s->world_size, 4);
  auto t = Read({{"RANK", "5"},
                 {"WORLD_SIZE", "8"},
                 {"LOCAL_RANK", "1"},
                 {"LOCAL_WORLD_SIZE", "4"},
                 {"GROUP_RANK", "1"},
                 {"MASTER_ADDR", "10.0.0.1"},
                 {"MASTER_PORT", "29500"}});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->launcher, "torchrun");
  EXPECT_EQ(t->local_rank, 1);
  EXPECT_EQ(t->node_rank, 1);
  EXPECT_EQ(t->num_nodes, 2);
  EXPECT_EQ(t->master_addr, "10.0.0.1");
  EXPECT_EQ(t->master_port, 29500);
}

TEST(LaunchEnvironmentTest, Srun) {
  // srun -N2 --ntasks-per-node=2: task 3 is the second on the second node.
  auto e = Read({{"SLURM_PROCID", "3"},
                 {"SLURM_NTASKS", "4"},
                 {"SLURM_LOCALID", "1"},
                 {"SLURM_NODEID", "1"},
                 {"SLURM_NNODES", "2"},
                 {"SLURM_JOB_NODELIST", "gpu[07-08]"},
                 {"SLURM_JOB_ID", "4242"},
                 {"SLURM_STEP_ID", "0"},
                 {"SLURMD_NODENAME", "gpu08"}});
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->launcher, "slurm");
  EXPECT_EQ(e->rank, 3);
  EXPECT_EQ(e->world_size, 4);
  EXPECT_EQ(e->local_rank, 1);
  EXPECT_EQ(e->node_rank, 1);
  EXPECT_EQ(e->num_nodes, 2);
  EXPECT_EQ(e->nodes, Hosts({"gpu07", "gpu08"}));
  EXPECT_EQ(e->master_addr, "gpu07");
  EXPECT_EQ(e->job_id, "4242");
  EXPECT_EQ(e->step_id, "0");
  EXPECT_EQ(e->node_name, "gpu08");
  EXPECT_EQ(e->note, "");
}

// Inside an allocation of 2 nodes, `srun -N1 -n3`: the step's own node list,
// task and node counts win over the job's.
TEST(LaunchEnvironmentTest, SrunStepInsideALargerAllocation) {
  auto e = Read({{"SLURM_PROCID", "2"},
                 {"SLURM_NTASKS", "3"},
                 {"SLURM_STEP_NUM_TASKS", "3"},
                 {"SLURM_LOCALID", "2"},
                 {"SLURM_NODEID", "0"},
                 {"SLURM_NNODES", "1"},
                 {"SLURM_STEP_NUM_NODES", "1"},
                 {"SLURM_JOB_NODELIST", "n[1-2]"},
                 {"SLURM_STEP_NODELIST", "n2"},
                 {"SLURM_STEP_TASKS_PER_NODE", "3"},
                 {"SLURM_JOB_ID", "7"},
                 {"SLURM_STEP_ID", "1"}});
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->world_size, 3);
  EXPECT_EQ(e->nodes, Hosts({"n2"}));
  EXPECT_EQ(e->master_addr, "n2");
  EXPECT_EQ(e->num_nodes, 1);
  EXPECT_EQ(e->local_world_size, 3);
}

// sbatch's batch script has SLURM_PROCID=0 and the allocation's task count
// but is no task of a step: one process, with a note, never "rank 0 of 4".
TEST(LaunchEnvironmentTest, BatchScriptIsNotRankZero) {
  auto e = Read({{"SLURM_PROCID", "0"},
                 {"SLURM_NTASKS", "4"},
                 {"SLURM_NNODES", "2"},
                 {"SLURM_JOB_NODELIST", "n[1-2]"},
                 {"SLURM_JOB_ID", "9"}});
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->launcher, "none");
  EXPECT_EQ(e->world_size, 1);
  EXPECT_NE(e->note.find("srun"), std::string::npos) << e->note;
}

TEST(LaunchEnvironmentTest, TasksPerNode) {
  EXPECT_EQ(*TasksOnNode("2(x3),1", 0), 2);
  EXPECT_EQ(*TasksOnNode("2(x3),1", 2), 2);
  EXPECT_EQ(*TasksOnNode("2(x3),1", 3), 1);
  EXPECT_EQ(*TasksOnNode("4", 0), 4);
  for (const char* bad : {"", "x", "2(x0)", "2(x3", "0", "2(xa)", "-1"}) {
    EXPECT_FALSE(TasksOnNode(bad, 0).ok()) << bad;
  }
  EXPECT_FALSE(TasksOnNode("2(x3),1", 4).ok());
}

absl::StatusOr<Rendezvous> Plan(const std::map<std::string, std::string>& vars) {
  auto get = [&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
  auto e = ReadLaunchEnvironment(get);
  if (!e.ok()) return e.status();
  return PlanRendezvous(*e, get);
}

std::map<std::string, std::string> SrunTask(int rank, int node) {
  return {{"SLURM_PROCID", std::to_string(rank)},
          {"SLURM_NTASKS", "4"},
          {"SLURM_LOCALID", std::to_string(rank % 2)},
          {"SLURM_NODEID", std::to_string(node)},
          {"SLURM_NNODES", "2"},
          {"SLURM_JOB_NODELIST", "n[1-2]"},
          {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"},
          {"SLURMD_NODENAME", node == 0 ? "n1" : "n2"},
          {"SLURM_JOB_ID", "31"},
          {"SLURM_STEP_ID", "0"}};
}

TEST(RendezvousTest, SlurmRankZeroHostsTheCoordinatorOnTheFirstNode) {
  const std::string port = std::to_string(DefaultSlurmPort("31", "0"));
  for (int rank = 0; rank < 4; ++rank) {
    auto r = Plan(SrunTask(rank, rank / 2));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->coordinator, "n1:" + port);  // every task dials the same address
    EXPECT_EQ(r->host_coordinator, rank == 0);
    EXPECT_EQ(r->listen, rank == 0 ? "0.0.0.0:" + port : "");
    EXPECT_EQ(r->bind, rank < 2 ? "n1" : "n2");
    EXPECT_EQ(r->job_id, "31");
  }
  // Another step of the same job gets another port; the range holds.
  EXPECT_NE(DefaultSlurmPort("31", "0"), DefaultSlurmPort("31", "1"));
  for (int j = 0; j < 1000; ++j) {
    const int p = DefaultSlurmPort(std::to_string(j), "0");
    EXPECT_GE(p, 20000);
    EXPECT_LT(p, 29000);
  }
}

TEST(RendezvousTest, VariablesWin) {
  auto vars = SrunTask(1, 0);
  vars["SHARDOPT_PORT"] = "31000";
  vars["MASTER_ADDR"] = "10.1.1.1";
  vars["SHARDOPT_BIND"] = "10.1.1.2";
  vars["SHARDOPT_JOB_ID"] = "mine";
  auto r = Plan(vars);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->coordinator, "10.1.1.1:31000");
  EXPECT_EQ(r->bind, "10.1.1.2");
  EXPECT_EQ(r->job_id, "mine");
  // A coordinator given by hand (or by shardrun): dialled, never hosted.
  vars = SrunTask(0, 0);
  vars["SHARDOPT_COORDINATOR"] = "login1:4000";
  r = Plan(vars);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->coordinator, "login1:4000");
  EXPECT_FALSE(r->host_coordinator);
  vars["SHARDOPT_PORT"] = "0";
  vars.erase("SHARDOPT_COORDINATOR");
  r = Plan(vars);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("SHARDOPT_PORT"), std::string::npos);
}

TEST(RendezvousTest, ShardrunRanksInsideASlurmStepBindToTheNode) {
  // srun --ntasks-per-node=1 shardrun --nproc 2: shardrun's ranks see RANK
  // and SHARDOPT_COORDINATOR, plus the step's SLURMD_NODENAME.
  auto vars = SrunTask(1, 1);
  vars["RANK"] = "3";
  vars["WORLD_SIZE"] = "4";
  vars["SHARDOPT_COORDINATOR"] = "n1:20001";
  auto r = Plan(vars);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->coordinator, "n1:20001");
  EXPECT_EQ(r->bind, "n2");
}

TEST(RendezvousTest, KubernetesIndexedJob) {
  std::map<std::string, std::string> vars = {{"JOB_COMPLETION_INDEX", "0"},
                                             {"WORLD_SIZE", "3"},
                                             {"MASTER_ADDR", "train-0.train"},
                                             {"HOSTNAME", "train-0"}};
  auto r = Plan(vars);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->coordinator, "train-0.train:29400");
  EXPECT_TRUE(r->host_coordinator);
  EXPECT_EQ(r->listen, "0.0.0.0:29400");
  EXPECT_EQ(r->bind, "train-0");
  vars["SHARDOPT_LISTEN"] = "127.0.0.1";
  r = Plan(vars);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->listen, "127.0.0.1:29400");
  vars.erase("SHARDOPT_LISTEN");
  vars.erase("MASTER_ADDR");
  r = Plan(vars);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("MASTER_ADDR"), std::string::npos);
}

TEST(RendezvousTest, NoLauncherNoCoordinator) {
  auto r = Plan({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->coordinator, "");
  EXPECT_FALSE(r->host_coordinator);
  EXPECT_EQ(r->bind, "127.0.0.1");
  EXPECT_EQ(r->job_id, "job");
}

// WORLD_SIZE alone (a launcher that sets no RANK for rank 0): rank 0 of it,
// never silently one rank.
TEST(LaunchEnvironmentTest, WorldSizeAloneIsRankZeroOfIt) {
  auto e = Read({{"WORLD_SIZE", "3"}});
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->world_size, 3);
  EXPECT_EQ(e->rank, 0);
}

TEST(LaunchEnvironmentTest, KubernetesIndexedJob) {
  auto e = Read({{"JOB_COMPLETION_INDEX", "2"},
                 {"SHARDOPT_WORLD_SIZE", "3"},
                 {"MASTER_ADDR", "train-0.train"}});
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->launcher, "kubernetes");
  EXPECT_EQ(e->rank, 2);
  EXPECT_EQ(e->world_size, 3);
  EXPECT_EQ(e->master_addr, "train-0.train");
  auto no_world = Read({{"JOB_COMPLETION_INDEX", "2"}});
  EXPECT_FALSE(no_world.ok());
  EXPECT_NE(no_world.status().message().find("SHARDOPT_WORLD_SIZE"), std::string::npos);
}

TEST(LaunchEnvironmentTest, BadValuesAreRefusedByName) {
  const std::vector<std::pair<std::map<std::string, std::string>, std::string>> cases = {
      {{{"RANK", "0"}}, "WORLD_SIZE"},
      {{{"RANK", "4"}, {"WORLD_SIZE", "4"}}, "RANK"},
      {{{"RANK", "x"}, {"WORLD_SIZE", "4"}}, "RANK"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "0"}}, "WORLD_SIZE"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}, "MASTER_PORT"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_STEP_ID", "0"}}, "SLURM_NTASKS"},
      {{{"SLURM_PROCID", "2"}, {"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "2"}}, "SLURM_PROCID"},
      {{{"SLURM_PROCID", "0"},
        {"SLURM_STEP_ID", "0"},
        {"SLURM_NTASKS", "2"},
        {"SLURM_JOB_NODELIST", "n[2-1]"}},
       "SLURM_JOB_NODELIST"},
      {{{"SLURM_PROCID", "0"},
        {"SLURM_STEP_ID", "0"},
        {"SLURM_NTASKS", "2"},
        {"SLURM_STEP_TASKS_PER_NODE", "2(x"}},
       "SLURM_STEP_TASKS_PER_NODE"},
      {{{"SLURM_PROCID", "0"},
        {"SLURM_STEP_ID", "0"},
        {"SLURM_NTASKS", "2"},
        {"SLURM_JOB_NODELIST", "n[1-2]"},
        {"SLURM_NODEID", "2"}},
       "SLURM_NODEID"},
      {{{"JOB_COMPLETION_INDEX", "3"}, {"WORLD_SIZE", "3"}}, "JOB_COMPLETION_INDEX"},
  };
  for (const auto& [vars, name] : cases) {
    auto e = Read(vars);
    ASSERT_FALSE(e.ok()) << name;
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(e.status().message().find(name), std::string::npos) << e.status();
  }
}

}  // namespace
}  // namespace shardopt
