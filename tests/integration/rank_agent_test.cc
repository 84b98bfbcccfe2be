// RankAgent (client/rank_agent.h) against the fake coordinator client
// (tests/testing/fake_coordinator.h), with 1-3 ranks as threads over
// InProcessCommunicator: the join, notices pushed on the session, control
// actions agreed at one step, the failure diagnosis, the flight record.
// Every wait is bounded (collective timeouts of seconds, bounded polls).
#include "client/rank_agent.h"

#include <grpcpp/grpcpp.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/checkpoint/checkpoint.h"
#include "client/comm/flight_recorder.h"
#include "client/comm/in_process_communicator.h"
#include "client/sharded_optimizer.h"
#include "common/file_system.h"
#include "gtest/gtest.h"
#include "proto/shardopt.grpc.pb.h"
#include "tests/testing/fake_coordinator.h"

namespace shardopt {
namespace {

constexpr double kLr = 0.1;

std::string TempDir(const std::string& name) {
  const char* t = std::getenv("TEST_TMPDIR");
  std::string dir =
      absl::StrCat(t != nullptr ? t : "/tmp", "/rank_agent_test_", name, "_", getpid());
  (void)PosixFileSystem()->MakeDirs(dir);
  return dir;
}

// A job of `n` ranks (threads): in-process communicators with flight
// recorders, a ShardedOptimizer (SGD without momentum) over a two-tensor
// model per rank, a fake coordinator client and a RankAgent per rank.
class Job {
 public:
  explicit Job(int n) : world_(n, absl::Seconds(30)), out_(n), err_(n) {
    for (int r = 0; r < n; ++r) {
      recorders_.push_back(std::make_shared<FlightRecorder>());
      comms_.push_back(
          std::make_unique<FlightRecordingCommunicator>(world_.Connect(r), recorders_[r]));
      fakes_.push_back(std::make_unique<FakeCoordinator>());
      params_.emplace_back();
    }
    opts_.resize(n);
    OnAllRanks([&](int r) {
      torch::manual_seed(1);
      params_[r] = {{"w", torch::randn({16, 4}).requires_grad_()},
                    {"b", torch::randn({4}).requires_grad_()}};
      ShardedOptimizerOptions o;
      o.kind = OptimizerKind::kSgd;
      o.sgd.lr = kLr;
      o.plan.alignment_elements = 4;
      o.timeout = absl::Seconds(5);
      auto opt = ShardedOptimizer::Create(params_[r], o, comms_[r].get());
      ASSERT_TRUE(opt.ok()) << opt.status();
      opts_[r] = *std::move(opt);
    });
  }
  ~Job() {
    for (auto& a : agents_) a.reset();  // before the fakes and optimizers
  }

  int size() const { return static_cast<int>(comms_.size()); }
  FakeCoordinator& fake(int r) { return *fakes_[r]; }
  ShardedOptimizer& opt(int r) { return *opts_[r]; }
  RankAgent& agent(int r) { return *agents_[r]; }
  Communicator& comm(int r) { return *comms_[r]; }
  FlightRecorder& recorder(int r) { return *recorders_[r]; }

  // Options for rank r: quick heartbeats and a quick diagnosis; output captured.
  RankAgentOptions Options(int r) {
    RankAgentOptions o;
    o.job_id = "testjob";
    o.rank = r;
    o.collective_timeout = absl::Seconds(5);
    o.heartbeat_interval = absl::Milliseconds(50);
    o.verdict_wait = absl::Milliseconds(200);
    o.silent_wait = absl::Seconds(1);
    o.poll_interval = absl::Milliseconds(50);
    o.print = [this, r](const std::string& line) {
      std::lock_guard<std::mutex> l(mu_);
      out_[r].push_back(line);
    };
    o.print_error = [this, r](const std::string& line) {
      std::lock_guard<std::mutex> l(mu_);
      err_[r].push_back(line);
    };
    return o;
  }
  void StartAgents(const std::function<void(int, RankAgentOptions&)>& tweak = nullptr) {
    agents_.resize(size());
    for (int r = 0; r < size(); ++r) {
      RankAgentOptions o = Options(r);
      if (tweak) tweak(r, o);
      auto a = RankAgent::Start(fakes_[r].get(), opts_[r].get(), o);
      ASSERT_TRUE(a.ok()) << a.status();
      agents_[r] = *std::move(a);
    }
  }

  void OnAllRanks(const std::function<void(int)>& f) {
    std::vector<std::thread> threads;
    for (int r = 0; r < size(); ++r) threads.emplace_back([&f, r] { f(r); });
    for (auto& t : threads) t.join();
  }

  // One training step of rank r, through the agent (step: 1 for the first).
  // agree == false: stops after opt->Step() (a rank that stalls there).
  absl::Status Train(int r, int64_t step, absl::StatusOr<AgreedStep>* agreed, bool agree = true) {
    agent(r).BeforeStep(step);
    opt(r).ZeroGrad();
    torch::Tensor loss =
        (params_[r][0].second * params_[r][0].second).sum() + params_[r][1].second.sum();
    loss.backward();
    auto result = opt(r).Step();
    if (!result.ok()) return result.status();
    if (!agree) return absl::OkStatus();
    *agreed = agent(r).AfterStep(step, *result, loss.item<double>());
    return agreed->status();
  }

  std::vector<std::string> out(int r) {
    std::lock_guard<std::mutex> l(mu_);
    return out_[r];
  }
  std::vector<std::string> err(int r) {
    std::lock_guard<std::mutex> l(mu_);
    return err_[r];
  }

 private:
  InProcessWorld world_;
  std::vector<std::shared_ptr<FlightRecorder>> recorders_;
  std::vector<std::unique_ptr<Communicator>> comms_;
  std::vector<std::vector<std::pair<std::string, torch::Tensor>>> params_;
  std::vector<std::unique_ptr<ShardedOptimizer>> opts_;
  std::vector<std::unique_ptr<FakeCoordinator>> fakes_;
  std::vector<std::unique_ptr<RankAgent>> agents_;
  std::mutex mu_;
  std::vector<std::vector<std::string>> out_, err_;
};

v1::RankStatus RankAt(int rank, int64_t step, int64_t progress, double since_heartbeat) {
  v1::RankStatus s;
  s.set_rank(rank);
  s.set_step(step);
  s.set_progress(progress);
  s.set_seconds_since_heartbeat(since_heartbeat);
  s.set_alive(true);
  return s;
}

TEST(MakeJoinRequestTest, DescribesTheLayout) {
  Job job(1);
  RankAgentOptions o;
  o.job_id = "j";
  o.rank = 0;
  o.host = "10.0.0.7";
  o.device = "cuda:1";
  const Layout& layout = job.opt(0).layout();
  const v1::JoinRequest join = MakeJoinRequest(layout, o, 4242, 0.25);
  EXPECT_EQ(join.job_id(), "j");
  EXPECT_EQ(join.rank(), 0);
  EXPECT_EQ(join.world_size(), 1);
  EXPECT_EQ(join.host(), "10.0.0.7");
  EXPECT_EQ(join.shard_owner_port(), 4242);
  EXPECT_EQ(join.device(), "cuda:1");
  EXPECT_EQ(join.layout_hash(), layout.hash());
  EXPECT_EQ(join.learning_rate(), 0.25);
  EXPECT_EQ(join.plan().bucket_cap_elements(), layout.options().bucket_cap_elements);
  EXPECT_EQ(join.plan().alignment_elements(), 4);
  EXPECT_EQ(join.plan().allow_cut(), layout.options().allow_cut);
  ASSERT_EQ(join.params_size(), 2);
  EXPECT_EQ(join.params(0).name(), "w");
  EXPECT_EQ(std::vector<int64_t>(join.params(0).shape().begin(), join.params(0).shape().end()),
            (std::vector<int64_t>{16, 4}));
  EXPECT_EQ(join.params(0).dtype(), "float32");
  EXPECT_TRUE(join.params(0).trainable());
  EXPECT_EQ(join.params(1).name(), "b");
}

TEST(RankAgentTest, JoinsServesItsShardOwnerHeartbeatsAndFinishes) {
  Job job(2);
  job.StartAgents();
  for (int r = 0; r < 2; ++r) {
    auto joins = job.fake(r).joins();
    ASSERT_EQ(joins.size(), 1u);
    const v1::JoinRequest& j = joins[0];
    EXPECT_EQ(j.job_id(), "testjob");
    EXPECT_EQ(j.rank(), r);
    EXPECT_EQ(j.world_size(), 2);
    EXPECT_EQ(j.host(), "127.0.0.1");
    EXPECT_GT(j.shard_owner_port(), 0);
    EXPECT_EQ(j.shard_owner_port(), job.agent(r).shard_owner_port());
    EXPECT_EQ(j.layout_hash(), job.opt(r).layout().hash());
    EXPECT_NEAR(j.learning_rate(), kLr, 1e-9);
    ASSERT_EQ(j.params_size(), 2);
    EXPECT_EQ(j.params(0).name(), "w");
    EXPECT_EQ(j.params(1).name(), "b");
    EXPECT_EQ(job.agent(r).join_response().layout_hash(), j.layout_hash());
    EXPECT_EQ(job.fake(r).sessions_opened(), 1);
  }
  // Heartbeats flow on the session, with the rank's learning rate and memory.
  ASSERT_TRUE(
      job.fake(1).WaitFor([&] { return job.fake(1).heartbeats().size() >= 2; }, absl::Seconds(10)));
  const v1::HeartbeatRequest hb = job.fake(1).heartbeats().back();
  EXPECT_EQ(hb.rank(), 1);
  EXPECT_NEAR(hb.learning_rate(), kLr, 1e-9);
  EXPECT_EQ(hb.metrics().state_bytes(), job.opt(1).memory().state_bytes);
  EXPECT_GT(hb.metrics().param_bytes(), 0);

  // The shard-owner service reads the ShardOwner: SGD without momentum holds
  // no state, and still owns its elements.
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", job.agent(1).shard_owner_port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::ShardOwner::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::GetShardInfoResponse info;
  ASSERT_TRUE(stub->GetShardInfo(&ctx, v1::GetShardInfoRequest(), &info).ok());
  EXPECT_EQ(info.rank(), 1);
  EXPECT_EQ(info.optimizer(), "sgd");
  EXPECT_EQ(info.state_bytes(), 0);
  EXPECT_EQ(info.owned_elements(), job.opt(1).shard_owner().owned_elements());
  EXPECT_GT(info.owned_elements(), 0);
  EXPECT_EQ(info.param_bytes(), job.opt(1).memory().param_bytes);

  // Two steps: the heartbeats report them; Finish says so and ends the session.
  job.OnAllRanks([&](int r) {
    for (int64_t step = 1; step <= 2; ++step) {
      absl::StatusOr<AgreedStep> agreed;
      ASSERT_TRUE(job.Train(r, step, &agreed).ok()) << agreed.status();
      EXPECT_EQ(agreed->nonfinite_rank, -1);
      EXPECT_FALSE(agreed->checkpoint);
      EXPECT_FALSE(agreed->new_lr.has_value());
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(job.agent(r).step(), 2);
    EXPECT_EQ(job.agent(r).progress(), 4);
    ASSERT_TRUE(job.fake(r).WaitFor(
        [&] {
          auto h = job.fake(r).heartbeats();
          return !h.empty() && h.back().step() == 2;
        },
        absl::Seconds(10)));
    EXPECT_EQ(job.fake(r).heartbeats().back().progress(), 4);
    EXPECT_EQ(job.agent(r).Finish(), 0);
    EXPECT_EQ(job.fake(r).finishes(), std::vector<int>{r});
    EXPECT_EQ(job.fake(r).sessions_closed(), 1);
    EXPECT_TRUE(job.fake(r).aborts().empty());
    EXPECT_TRUE(job.fake(r).flight_records().empty());
  }
}

TEST(RankAgentTest, AbortNoticeAbortsTheCommunicatorAndIsReported) {
  Job job(2);
  job.StartAgents();
  job.OnAllRanks([&](int r) {
    absl::StatusOr<AgreedStep> agreed;
    ASSERT_TRUE(job.Train(r, 1, &agreed).ok()) << agreed.status();
  });
  // The coordinator pushes its verdict to rank 0 (and, a moment later, to
  // rank 1).
  job.fake(0).PushAbort("test says stop");
  EXPECT_EQ(job.agent(0).WaitForAbort(absl::Seconds(10)), "job aborted: test says stop");
  float x = 1;
  const absl::Status s =
      job.comm(0).AllReduce(&x, 1, DType::kFloat32, ReduceOp::kSum)->Wait(absl::Seconds(5));
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "test says stop")) << s;
  job.fake(1).PushAbort("test says stop");
  EXPECT_EQ(job.agent(1).WaitForAbort(absl::Seconds(10)), "job aborted: test says stop");

  // Rank 0's next step fails at once; the diagnosis is the pushed verdict.
  absl::StatusOr<AgreedStep> agreed;
  const absl::Status failed = job.Train(0, 2, &agreed);
  ASSERT_FALSE(failed.ok());
  const std::string why = job.agent(0).Diagnose(failed);
  EXPECT_EQ(why, "job aborted: test says stop");
  EXPECT_EQ(job.agent(0).Fail(absl::StrCat("step 2 failed: ", why), why), 1);
  EXPECT_EQ(job.err(0), std::vector<std::string>{"step 2 failed: job aborted: test says stop"});
  const auto aborts = job.fake(0).aborts();
  ASSERT_EQ(aborts.size(), 1u);
  EXPECT_EQ(aborts[0], std::make_pair(0, std::string("job aborted: test says stop")));
  // The flight record: the reason, and step 1's collectives.
  const auto records = job.fake(0).flight_records();
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0].rank(), 0);
  EXPECT_EQ(records[0].reason(), "step 2 failed: job aborted: test says stop");
  bool step1 = false;
  for (const auto& c : records[0].records()) step1 |= c.step() == 1;
  EXPECT_TRUE(step1);
  EXPECT_EQ(job.fake(0).sessions_closed(), 1);
}

TEST(RankAgentTest, StopSignalAbortsTheJob) {
  Job job(1);
  std::atomic<int> sig{0};
  job.StartAgents([&](int, RankAgentOptions& o) { o.stop_signal = [&sig] { return sig.load(); }; });
  EXPECT_EQ(job.agent(0).WaitForAbort(absl::Milliseconds(200)), "");
  sig = 15;
  EXPECT_EQ(job.agent(0).WaitForAbort(absl::Seconds(10)),
            "stopped by signal 15 (the launcher is stopping the job: shardrun, srun or scancel; or "
            "shardrun died)");
  float x = 1;
  EXPECT_EQ(
      job.comm(0).AllReduce(&x, 1, DType::kFloat32, ReduceOp::kSum)->Wait(absl::Seconds(5)).code(),
      absl::StatusCode::kAborted);
}

TEST(RankAgentTest, WithoutASessionUnaryHeartbeatsCarryTheNotices) {
  Job job(1);
  job.StartAgents();
  ASSERT_TRUE(
      job.fake(0).WaitFor([&] { return !job.fake(0).heartbeats().empty(); }, absl::Seconds(10)));
  job.fake(0).BreakSession();
  job.fake(0).PushAbort("over unary");
  EXPECT_EQ(job.agent(0).WaitForAbort(absl::Seconds(10)), "job aborted: over unary");
}

TEST(RankAgentTest, LearningRateSeenByOneRankIsAppliedOnAllAtTheSameStep) {
  Job job(3);
  job.StartAgents();
  // Only rank 1's coordinator connection carries the change.
  ASSERT_TRUE(job.fake(1).SetLearningRate(0.05).ok());
  ASSERT_TRUE(
      job.fake(1).WaitFor([&] { return job.fake(1).pending_notices() == 0; }, absl::Seconds(10)));
  std::vector<std::map<int64_t, double>> lr_after(3);  // per rank: step -> optimizer lr
  std::vector<std::map<int64_t, double>> applied(3);   // per rank: step -> new_lr
  std::vector<int64_t> steps(3);
  job.OnAllRanks([&](int r) {
    // Until two steps after the change (every rank applies it at the same
    // step, so every rank runs as many steps; if not, a collective times out).
    int64_t last = 200;
    for (int64_t step = 1; step <= last; ++step) {
      absl::StatusOr<AgreedStep> agreed;
      ASSERT_TRUE(job.Train(r, step, &agreed).ok()) << agreed.status();
      if (agreed->new_lr.has_value()) {
        applied[r][step] = *agreed->new_lr;
        last = step + 2;
      }
      lr_after[r][step] = job.opt(r).learning_rate();
      steps[r] = step;
    }
  });
  ASSERT_EQ(applied[1].size(), 1u);
  const int64_t at = applied[1].begin()->first;
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(applied[r].size(), 1u) << "rank " << r;
    EXPECT_EQ(applied[r].begin()->first, at) << "rank " << r;
    EXPECT_NEAR(applied[r].begin()->second, 0.05, 1e-7);
    EXPECT_EQ(steps[r], at + 2);
    for (int64_t step = 1; step <= steps[r]; ++step) {
      EXPECT_NEAR(lr_after[r][step], step < at ? kLr : 0.05, 1e-7)
          << "rank " << r << " step " << step;
    }
  }
  EXPECT_EQ(job.out(0),
            std::vector<std::string>{absl::StrCat("learning rate set to 0.05 at step ", at)});
  EXPECT_TRUE(job.out(1).empty());
  // Heartbeats report the applied rate (rank 2 never saw the notice).
  ASSERT_TRUE(job.fake(2).WaitFor(
      [&] {
        auto h = job.fake(2).heartbeats();
        return !h.empty() && std::abs(h.back().learning_rate() - 0.05) < 1e-7;
      },
      absl::Seconds(10)));
}

TEST(RankAgentTest, RequestedCheckpointIsTakenAtOneStepOnAllRanks) {
  Job job(2);
  const std::string dir = TempDir("ckpt");
  job.StartAgents([&](int, RankAgentOptions& o) {
    o.ckpt_dir = dir;
    o.samples_per_step = 8;
  });
  ASSERT_TRUE(job.fake(0).RequestCheckpoint().ok());  // rank 0 only
  ASSERT_TRUE(
      job.fake(0).WaitFor([&] { return job.fake(0).pending_notices() == 0; }, absl::Seconds(10)));
  std::vector<std::vector<int64_t>> due(2);
  job.OnAllRanks([&](int r) {
    int64_t last = 200;  // until a step after the checkpoint
    for (int64_t step = 1; step <= last; ++step) {
      absl::StatusOr<AgreedStep> agreed;
      ASSERT_TRUE(job.Train(r, step, &agreed).ok()) << agreed.status();
      if (agreed->checkpoint) {
        due[r].push_back(step);
        last = step + 1;
        ASSERT_TRUE(job.agent(r).CheckpointDuringTraining(step).ok());
      }
    }
  });
  ASSERT_EQ(due[0].size(), 1u);
  EXPECT_EQ(due[1], due[0]);
  const std::string expected = absl::StrCat(dir, "/step-", due[0][0]);
  ASSERT_EQ(job.out(0).size(), 1u);
  EXPECT_TRUE(
      absl::StrContains(job.out(0)[0], absl::StrCat("checkpoint ", expected, " written in ")))
      << job.out(0)[0];
  auto latest = ResolveCheckpoint(PosixFileSystem(), dir);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, expected);
  // Saving the same step again is a no-op.
  job.OnAllRanks([&](int r) { EXPECT_TRUE(job.agent(r).Checkpoint(due[0][0]).status.ok()); });
  EXPECT_EQ(job.out(0).size(), 1u);
  // Heartbeats count it.
  ASSERT_TRUE(job.fake(1).WaitFor(
      [&] {
        auto h = job.fake(1).heartbeats();
        return !h.empty() && h.back().metrics().checkpoints_total() == 1;
      },
      absl::Seconds(10)));
}

TEST(RankAgentTest, RequestedCheckpointWithoutADirectoryIsSkipped) {
  Job job(1);
  job.StartAgents();
  ASSERT_TRUE(job.fake(0).RequestCheckpoint().ok());
  ASSERT_TRUE(
      job.fake(0).WaitFor([&] { return job.fake(0).pending_notices() == 0; }, absl::Seconds(10)));
  bool due = false;
  for (int64_t step = 1; step <= 3; ++step) {
    absl::StatusOr<AgreedStep> agreed;
    ASSERT_TRUE(job.Train(0, step, &agreed).ok()) << agreed.status();
    due |= agreed->checkpoint;
  }
  EXPECT_FALSE(due);
  EXPECT_EQ(job.out(0),
            std::vector<std::string>{"checkpoint requested, but no --ckpt-dir was given: skipped"});
}

TEST(RankAgentTest, NonFiniteLossOnOneRankStopsEveryRankAtThatStep) {
  Job job(2);
  job.StartAgents();
  std::vector<int> nonfinite(2, -2);
  job.OnAllRanks([&](int r) {
    // (The agreement needs no optimizer step.)
    job.agent(r).BeforeStep(1);
    StepResult result;
    const double loss = r == 1 ? std::nan("") : 1.0;
    auto agreed = job.agent(r).AfterStep(1, result, loss);
    ASSERT_TRUE(agreed.ok()) << agreed.status();
    nonfinite[r] = agreed->nonfinite_rank;
  });
  EXPECT_EQ(nonfinite, (std::vector<int>{1, 1}));
  EXPECT_EQ(job.agent(0).step(), 0);  // the step did not count
}

TEST(RankAgentTest, StalledPeerIsNamed) {
  Job job(2);
  job.StartAgents([&](int, RankAgentOptions& o) { o.collective_timeout = absl::Seconds(1); });
  job.OnAllRanks([&](int r) {
    absl::StatusOr<AgreedStep> agreed;
    ASSERT_TRUE(job.Train(r, 1, &agreed).ok()) << agreed.status();
  });
  // Step 2: rank 1 gets through Step() and then stops taking part (alive:
  // its heartbeats go on); rank 0 times out in the agreement.
  std::string why;
  job.OnAllRanks([&](int r) {
    if (r == 1) {
      absl::StatusOr<AgreedStep> unused;
      ASSERT_TRUE(job.Train(1, 2, &unused, /*agree=*/false).ok());
      EXPECT_EQ(job.agent(1).progress(), 3);
      return;
    }
    // What the coordinator knows: rank 1 heartbeats, but is behind rank 0
    // (which has entered the agreement: progress 4).
    v1::GetJobResponse status;
    status.set_state("running");
    *status.add_ranks() = RankAt(0, 1, 3, 0.1);
    *status.add_ranks() = RankAt(1, 1, 3, 0.2);
    job.fake(0).SetJob(status);
    absl::StatusOr<AgreedStep> agreed;
    const absl::Status s = job.Train(0, 2, &agreed);
    ASSERT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    why = job.agent(0).Diagnose(s);
  });
  EXPECT_TRUE(
      absl::StrContains(why, "collective timed out at step 2; stalled rank(s): 1 (at step 1) ["))
      << why;
  EXPECT_FALSE(absl::StrContains(why, "0 (at step")) << why;
  EXPECT_EQ(job.agent(0).Fail("step 2 failed: " + why, why), 1);
  ASSERT_EQ(job.fake(0).aborts().size(), 1u);
  EXPECT_EQ(job.fake(0).aborts()[0].second, why);
  ASSERT_EQ(job.fake(0).flight_records().size(), 1u);
  EXPECT_GE(job.recorder(0).stalls(), 1);
}

TEST(RankAgentTest, SilentPeerIsNamed) {
  Job job(2);
  job.StartAgents();
  v1::GetJobResponse status;
  status.set_state("running");
  *status.add_ranks() = RankAt(0, 4, 8, 0.3);
  *status.add_ranks() = RankAt(1, 4, 8, 31.0);
  job.fake(0).SetJob(status);
  const absl::Time t0 = absl::Now();
  const std::string why =
      job.agent(0).Diagnose(absl::UnavailableError("connection reset by peer"), t0);
  EXPECT_EQ(why,
            "lost rank(s) 1 (no heartbeat for 31.0 s), probably dead [connection reset by peer]");
  // Bounded: verdict_wait + silent_wait (and a poll).
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  // The coordinator's verdict, once it has one, wins.
  status.set_failure("rank 1 was killed by signal 9");
  job.fake(0).SetJob(status);
  EXPECT_EQ(job.agent(0).Diagnose(absl::UnavailableError("x"), t0),
            "job failed: rank 1 was killed by signal 9");
}

TEST(RankAgentTest, DiagnosisWithoutNamedRanks) {
  Job job(1);
  job.StartAgents();
  v1::GetJobResponse status;
  *status.add_ranks() = RankAt(0, 1, 2, 0.1);
  job.fake(0).SetJob(status);
  // Failing long before the timeout: a broken connection.
  EXPECT_EQ(job.agent(0)
                .Diagnose(absl::UnavailableError("pair closed"), absl::Now())
                .rfind("a collective failed after ", 0),
            0u);
  const std::string broke =
      job.agent(0).Diagnose(absl::UnavailableError("pair closed"), absl::Now());
  EXPECT_TRUE(
      absl::StrContains(broke, ", before its 5s timeout (a peer's connection broke) [pair closed]"))
      << broke;
  // At the timeout, with nobody behind: the status itself.
  EXPECT_EQ(
      job.agent(0).Diagnose(absl::DeadlineExceededError("slow"), absl::Now() - absl::Seconds(6)),
      "DEADLINE_EXCEEDED: slow");
}

TEST(RankAgentTest, FlightRecordIsWrittenWhenTheCoordinatorCannotTakeIt) {
  Job job(1);
  const std::string dir = TempDir("flight");
  job.StartAgents([&](int, RankAgentOptions& o) { o.flight_record_dir = dir; });
  job.fake(0).SetReportFlightStatus(
      absl::UnavailableError("flight record: cannot reach the coordinator"));
  absl::StatusOr<AgreedStep> agreed;
  ASSERT_TRUE(job.Train(0, 1, &agreed).ok());
  EXPECT_EQ(job.agent(0).Fail("stalled on purpose", ""), 1);
  EXPECT_TRUE(job.fake(0).aborts().empty());  // "": the coordinator is not told
  const std::string path = dir + "/flight-record-rank-0.json";
  const auto err = job.err(0);
  ASSERT_EQ(err.size(), 2u);
  EXPECT_EQ(err[0], "stalled on purpose");
  EXPECT_EQ(err[1],
            "could not send the flight record to the coordinator (flight record: cannot reach the "
            "coordinator); wrote it to " +
                path);
  auto size = PosixFileSystem()->FileSize(path);
  ASSERT_TRUE(size.ok()) << size.status();
  EXPECT_GT(*size, 10u);
}

TEST(RankAgentTest, JoinFailureIsReturned) {
  Job job(1);
  job.fake(0).SetJoinResponse(absl::FailedPreconditionError("join: layout differs"));
  auto a = RankAgent::Start(&job.fake(0), &job.opt(0), job.Options(0));
  EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition);
  RankAgentOptions wrong = job.Options(0);
  wrong.rank = 1;
  EXPECT_EQ(RankAgent::Start(&job.fake(0), &job.opt(0), wrong).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardopt
