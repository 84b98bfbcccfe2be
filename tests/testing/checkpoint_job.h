// An in-process job of N ranks training the "small" model, for checkpoint
// tests: train, save, load, and read back parameters.
#ifndef SHARDOPT_TESTS_TESTING_CHECKPOINT_JOB_H_
#define SHARDOPT_TESTS_TESTING_CHECKPOINT_JOB_H_

#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "client/checkpoint/checkpoint.h"
#include "client/comm/in_process_communicator.h"
#include "tools/models/models.h"
#include "gtest/gtest.h"
#include "tests/testing/training_harness.h"

namespace shardopt {

// One in-process job of `n` ranks training the small model.
struct Job {
  int n;
  InProcessWorld world;
  std::vector<std::unique_ptr<Communicator>> comms;
  std::vector<std::unique_ptr<TrainModel>> models;
  std::vector<std::unique_ptr<ShardedOptimizer>> opts;
  TrainConfig config;

  Job(int n, OptimizerKind kind = OptimizerKind::kAdam) : n(n), world(n, absl::Seconds(30)) {
    config.model = "small";
    config.kind = kind;
    config.lr = 1e-2;
    config.bucket_cap = 300;  // several buckets, cut tensors
    for (int r = 0; r < n; ++r) {
      comms.push_back(world.Connect(r));
      models.push_back(*MakeModel("small", 42));
    }
    opts.resize(n);
    Parallel([&](int r) {
      auto o = ShardedOptimizer::Create(models[r]->NamedParameters(), OptionsFor(config),
                                        comms[r].get());
      ASSERT_TRUE(o.ok()) << o.status();
      opts[r] = std::move(*o);
    });
  }
  void Parallel(const std::function<void(int)>& fn) {
    std::vector<std::thread> t;
    for (int r = 0; r < n; ++r) t.emplace_back(fn, r);
    for (auto& x : t) x.join();
  }
  void Train(int from, int to, bool set_to_none = false) {
    Parallel([&](int r) {
      const int64_t per = 12 / n;
      for (int step = from; step < to; ++step) {
        opts[r]->ZeroGrad(set_to_none);
        models[r]->Loss(step, r * per, (r + 1) * per).backward();
        ASSERT_TRUE(opts[r]->Step().ok());
      }
    });
  }
  std::vector<absl::StatusOr<std::string>> Save(const std::string& root, FileSystem* fs) {
    std::vector<absl::StatusOr<std::string>> out(n, absl::UnknownError(""));
    CheckpointOptions o;
    o.fs = fs;
    o.user_metadata["data_position"] = "1234";
    Parallel([&](int r) { out[r] = SaveCheckpoint(*opts[r], root, o); });
    return out;
  }
  std::vector<absl::Status> Load(const std::string& path) {
    std::vector<absl::Status> out(n);
    Parallel([&](int r) { out[r] = LoadCheckpoint(*opts[r], path).status(); });
    return out;
  }
  std::vector<float> Params(int r = 0) { return FlattenParameters(*models[r]); }
  // This rank's owned optimizer state and master values, bucket by bucket.
  std::vector<float> OwnedState(int r) {
    std::vector<float> out;
    for (const Piece& p : opts[r]->layout().PiecesOfRank(r)) {
      auto s = OptimizerStateAccess(*opts[r]).owned_slice(p.bucket);
      for (const float* a : {s.master, s.state0, s.state1}) {
        if (a != nullptr) out.insert(out.end(), a + p.rank_offset, a + p.rank_offset + p.length);
      }
    }
    return out;
  }
};

inline std::string Fresh(const std::string& name) {
  const std::string d = ::testing::TempDir() + "/" + name;
  EXPECT_EQ(std::system(("rm -rf " + d + " && mkdir -p " + d).c_str()), 0);
  return d;
}

}  // namespace shardopt

#endif  // SHARDOPT_TESTS_TESTING_CHECKPOINT_JOB_H_
