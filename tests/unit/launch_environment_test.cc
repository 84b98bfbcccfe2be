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
                 {"SLURM_JOB_ID", "4242"}});
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
      {{{"SLURM_PROCID", "0"}}, "SLURM_NTASKS"},
      {{{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "2"}}, "SLURM_PROCID"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "n[2-1]"}},
       "SLURM_JOB_NODELIST"},
      {{{"SLURM_PROCID", "0"},
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
