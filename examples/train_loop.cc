// The smallest complete trainer on shardopt's C++ API (README quickstart; docs/cpp.md).
// Launch it with shardrun, which starts the ranks and a coordinator whose
// key-value store the communicators rendezvous through:
//
//   shardrun --nproc 2 -- bazel-bin/examples/train_loop --steps=30 --ckpt-dir=/tmp/ckpt
//
// Each rank joins the job through a RankAgent (client/rank_agent.h), as
// tools/cli/shardopt_train.cc does: it serves the rank's shard owner to
// shardctl, heartbeats, applies `shardctl set-lr` and `shardctl checkpoint`
// at the same step on every rank, and names the rank at fault when a
// collective fails. Run it again with more steps and it resumes from the
// latest checkpoint (at any world size). --device=cuda puts the model on GPU
// LOCAL_RANK and uses NCCL (needs a CUDA build of LibTorch and a build with
// the CUDA toolkit, which defines SHARDOPT_WITH_CUDA; nothing else changes).
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/checkpoint/checkpoint.h"
#include "client/comm/host_communicator.h"
#include "client/coordinator_client.h"
#include "client/rank_agent.h"
#include "client/sharded_optimizer.h"
#ifdef SHARDOPT_WITH_CUDA
#include "client/comm/nccl_communicator.h"
#include "server/kernels/cuda/cuda_backend.h"
#endif

namespace {

std::string Env(const char* name, const char* def) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : def;
}

std::string Flag(int argc, char** argv, const std::string& name, const std::string& def) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--" + name + "=", 0) == 0) return a.substr(name.size() + 3);
  }
  return def;
}

// A whole number in [lo, hi] from a flag or the environment; nullopt (after
// saying why) for anything else, so "--steps=abc" or "--steps=-5" cannot
// silently become 0.
std::optional<int> ParseInt(const std::string& what, const std::string& text, int lo, int hi) {
  int v = 0;
  if (!absl::SimpleAtoi(text, &v) || v < lo || v > hi) {
    std::fprintf(stderr, "train_loop: %s must be a whole number in [%d, %d], not '%s'\n",
                 what.c_str(), lo, hi, text.c_str());
    return std::nullopt;
  }
  return v;
}

// A failure before the rank agent runs (which reports later ones).
int Fail(int rank, const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "rank %d: %s: %s\n", rank, what.c_str(), s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace shardopt;
  const char* usage =
      "usage: shardrun --nproc N -- train_loop [--steps=30] [--ckpt-dir=DIR] [--ckpt-every=10] "
      "[--device=cpu|cuda]\n";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help") {
      std::printf("%s", usage);
      return 0;
    }
    bool known = false;
    for (const char* f : {"--steps=", "--ckpt-dir=", "--ckpt-every=", "--device="})
      known |= a.rfind(f, 0) == 0;
    if (!known) {
      std::fprintf(stderr, "train_loop: unknown argument '%s'\n%s", a.c_str(), usage);
      return 2;
    }
  }
  const auto world_opt = ParseInt("WORLD_SIZE", Env("WORLD_SIZE", "1"), 1, 1 << 20);
  const auto rank_opt = ParseInt("RANK", Env("RANK", "0"), 0, world_opt.value_or(1) - 1);
  const auto local_rank = ParseInt("LOCAL_RANK", Env("LOCAL_RANK", "0"), 0, 1 << 16);
  const auto steps_opt = ParseInt("--steps", Flag(argc, argv, "steps", "30"), 0, 1 << 30);
  const auto every_opt = ParseInt("--ckpt-every", Flag(argc, argv, "ckpt-every", "10"), 1, 1 << 30);
  if (!world_opt || !rank_opt || !local_rank || !steps_opt || !every_opt) {
    std::fprintf(stderr, "%s", usage);
    return 2;
  }
  const int rank = *rank_opt, world = *world_opt, steps = *steps_opt, every = *every_opt;
  const std::string job_id = Env("SHARDOPT_JOB_ID", "job");
  const std::string ckpt_dir = Flag(argc, argv, "ckpt-dir", "");
  const std::string device_flag = Flag(argc, argv, "device", "cpu");
  if (device_flag != "cpu" && device_flag != "cuda") {
    std::fprintf(stderr, "train_loop: --device must be cpu or cuda, not '%s'\n",
                 device_flag.c_str());
    return 2;
  }
#ifndef SHARDOPT_WITH_CUDA
  if (device_flag == "cuda") {
    return Fail(
        rank, "--device=cuda",
        absl::FailedPreconditionError("this build has no CUDA (built without the toolkit)"));
  }
#endif
  if (device_flag == "cuda" && !torch::cuda::is_available()) {
    return Fail(rank, "--device=cuda",
                absl::FailedPreconditionError("LibTorch sees no CUDA device"));
  }
  const torch::Device device =
      device_flag == "cuda"
          ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(*local_rank))
          : torch::Device(torch::kCPU);

  // 1. Rendezvous through the coordinator that shardrun started.
  CoordinatorClient client(Env("SHARDOPT_COORDINATOR", "127.0.0.1:0"), /*token=*/"");
  GrpcKeyValueStore kv(&client);
  PrefixKeyValueStore job_kv(&kv, job_id);

  // 2. The model: any torch::nn module; every rank builds the same one.
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Linear(128, 512), torch::nn::ReLU(),
                            torch::nn::Linear(512, 10));
  net->to(device);
  std::vector<std::pair<std::string, torch::Tensor>> params;
  for (const auto& p : net->named_parameters()) params.emplace_back(p.key(), p.value());

  // 3. A communicator: NCCL on GPU; on CPU shared memory when every rank is on
  // this host, else Gloo over TCP (CpuTransport::kAuto).
  std::unique_ptr<Communicator> comm;
#ifdef SHARDOPT_WITH_CUDA
  if (device.is_cuda()) {
    NcclOptions o;
    o.device = device.index();
    auto c = NcclCommunicator::Create(&job_kv, rank, world, o);
    if (!c.ok()) return Fail(rank, "NCCL", c.status());
    comm = std::move(*c);
  }
#endif
  if (comm == nullptr) {
    auto c = CreateCpuCommunicator(&job_kv, rank, world, CpuCommOptions());
    if (!c.ok()) return Fail(rank, "communicator", c.status());
    comm = std::move(c->comm);
  }

  // 4. The sharded optimizer: this rank keeps 1/N of AdamW's state. Parameters
  // become views of its flat buffers; rank 0's values are broadcast.
  ShardedOptimizerOptions options;
  options.kind = OptimizerKind::kAdamW;
  options.adam = AdamWConfig();
  options.max_grad_norm = 1.0;
  // GPU parameters are updated by the CUDA kernels (CPU ones by the SIMD kernels).
#ifdef SHARDOPT_WITH_CUDA
  if (device.is_cuda()) options.kernel_backend = MakeCudaKernelBackend();
#endif
  auto optimizer = ShardedOptimizer::Create(params, options, comm.get());
  if (!optimizer.ok()) return Fail(rank, "optimizer", optimizer.status());
  ShardedOptimizer* opt = optimizer->get();

  // 5. Join the job: the agent serves this rank's shard owner, joins (every
  // rank must agree on the layout) and heartbeats until Finish or Fail.
  RankAgentOptions agent_options;
  agent_options.job_id = job_id;
  agent_options.rank = rank;
  agent_options.device = device.is_cuda() ? absl::StrCat("cuda:", device.index()) : "cpu";
  agent_options.ckpt_dir = ckpt_dir;  // where `shardctl checkpoint` saves
  agent_options.log_name = "train_loop";
  auto started = RankAgent::Start(&client, opt, agent_options);
  if (!started.ok()) return Fail(rank, "join", started.status());
  RankAgent* agent = started->get();

  // 6. Resume from the latest checkpoint, if there is one.
  if (!ckpt_dir.empty() && ResolveCheckpoint(PosixFileSystem(), ckpt_dir).ok()) {
    auto m = LoadCheckpoint(*opt, ckpt_dir);
    if (!m.ok()) return agent->Fail("resume: " + m.status().ToString());
    agent->Resumed(opt->step_count());
    if (rank == 0)
      std::printf("resumed from step %lld\n", static_cast<long long>(opt->step_count()));
  }

  // 7. Train: backward starts the bucket reduce-scatters; Step() updates this
  // rank's shard and all-gathers the parameters; AfterStep agrees with every
  // rank on what to do at this step (a new learning rate, a checkpoint, stop).
  for (int64_t step = opt->step_count() + 1; step <= steps; ++step) {
    agent->BeforeStep(step);
    torch::manual_seed(1000 * step + rank);  // this rank's share of the batch
    torch::Tensor x = torch::randn({64, 128}, device);
    torch::Tensor y = x.narrow(1, 0, 10) * 0.5;
    opt->ZeroGrad();
    torch::Tensor loss = torch::mse_loss(net->forward(x), y);
    loss.backward();
    auto r = opt->Step();
    if (!r.ok()) return agent->Fail(agent->Diagnose(r.status()));  // names the rank at fault
    auto agreed = agent->AfterStep(step, *r, loss.item<double>());
    if (!agreed.ok()) return agent->Fail(agent->Diagnose(agreed.status()));
    if (agreed->nonfinite_rank >= 0) {
      return agent->Fail(
          absl::StrCat("rank ", agreed->nonfinite_rank, " had a non-finite loss at step ", step));
    }
    if (rank == 0 && (step % 10 == 0 || step == steps)) {
      std::printf("step %lld loss %.5f grad-norm %.4f\n", static_cast<long long>(step),
                  loss.item<double>(), r->grad_norm);
      std::fflush(stdout);
    }
    if (agreed->checkpoint || (!ckpt_dir.empty() && every > 0 && step % every == 0)) {
      // Collective; sharded; rank 0 commits. A failed save that leaves the
      // ranks able to go on is printed and training continues.
      if (absl::Status s = agent->CheckpointDuringTraining(step); !s.ok())
        return agent->Fail(std::string(s.message()));
    }
  }
  const MemoryReport mem = opt->memory();
  std::printf("rank %d: done; optimizer state on this rank %.2f MiB\n", rank,
              mem.state_bytes / 1048576.0);
  return agent->Finish();
}
