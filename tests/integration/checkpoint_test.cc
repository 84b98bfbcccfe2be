// Checkpoints: resume at other world sizes equals an uninterrupted run;
// corruption of every kind is refused naming the file or parameter; a full
// disk fails the save cleanly; crashes at any point leave LATEST complete;
// consolidation yields whole tensors.
#include "client/checkpoint/checkpoint.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/comm/in_process_communicator.h"
#include "tools/models/models.h"
#include "common/crc32c.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/checkpoint_job.h"
#include "tests/testing/training_harness.h"

namespace shardopt {
namespace {

TEST(Crc32cTest, KnownVector) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32cExtend(Crc32c("1234", 4), "56789", 5), 0xE3069283u);
}

TEST(CheckpointTest, ResumeAtAnyWorldSizeMatchesAnUninterruptedRun) {
  const std::string root = Fresh("resume");
  Job uninterrupted(2);
  uninterrupted.Train(0, 6);
  const std::vector<float> want = uninterrupted.Params();

  // Saved after 4 steps, so the first resumed step (index 4, even) gives
  // even_bias a gradient: a resumed process, like torch.optim in a new
  // process, skips a parameter that has had no gradient yet (the small
  // model's even_bias on odd steps), where the uninterrupted run steps it
  // with a zero gradient (zero_grad without set_to_none).
  Job first(2);
  first.Train(0, 4);
  for (const auto& s : first.Save(root, PosixFileSystem())) ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE(VerifyCheckpoint(PosixFileSystem(), root + "/step-4").ok());
  for (int n : {1, 2, 3, 4}) {
    SCOPED_TRACE(absl::StrCat("resume with ", n, " ranks"));
    Job resumed(n);
    for (const auto& s : resumed.Load(root)) ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(resumed.opts[0]->step_count(), 4);
    resumed.Train(4, 6);
    const std::vector<float> got = resumed.Params();
    ASSERT_EQ(got.size(), want.size());
    if (n == 2) {
      EXPECT_EQ(got, want) << "same world size: the math is identical, so bitwise";
    }
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], 1e-6 + 1e-5 * std::fabs(want[i])) << i;
    }
    for (int r = 1; r < n; ++r) EXPECT_EQ(resumed.Params(r), got);
  }
  auto m = ReadManifest(PosixFileSystem(), root + "/step-4");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->user_metadata.at("data_position"), "1234");
  EXPECT_EQ(m->world_size, 2);
}

// Per-parameter step counts (torch.optim's state['step']) survive a
// checkpoint: with gradients set to None before each step, the small model's
// even_bias (no gradient on odd steps) is updated in steps 0 and 2 only, so
// after 3 steps its count is 2; a job resumed at another world size keeps
// that count and continues as the uninterrupted run does.
TEST(CheckpointTest, PerParameterStepCountsRoundTrip) {
  const std::string root = Fresh("param_steps");
  Job uninterrupted(2);
  uninterrupted.Train(0, 6, /*set_to_none=*/true);
  const std::vector<float> want = uninterrupted.Params();

  Job first(2);
  first.Train(0, 3, /*set_to_none=*/true);
  for (const auto& s : first.Save(root, PosixFileSystem())) ASSERT_TRUE(s.ok()) << s.status();
  auto m = ReadManifest(PosixFileSystem(), root + "/step-3");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->user_metadata.at(kMetaParamSteps), "{\"even_bias\":2}");
  for (int n : {2, 3}) {
    SCOPED_TRACE(absl::StrCat("resume with ", n, " ranks"));
    Job resumed(n);
    for (const auto& s : resumed.Load(root)) ASSERT_TRUE(s.ok()) << s;
    const Layout& layout = resumed.opts[0]->layout();
    for (int r = 0; r < n; ++r) {
      for (const Piece& p : layout.PiecesOfRank(r)) {
        const bool even_bias = layout.params()[p.param].name == "even_bias";
        EXPECT_EQ(resumed.opts[r]->shard_owner().param_step(p.param), even_bias ? 2 : 3);
      }
    }
    resumed.Train(3, 6, /*set_to_none=*/true);
    const std::vector<float> got = resumed.Params();
    ASSERT_EQ(got.size(), want.size());
    if (n == 2) EXPECT_EQ(got, want) << "same world size: bitwise";
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], 1e-6 + 1e-5 * std::fabs(want[i])) << i;
    }
  }
}

TEST(CheckpointTest, SgdMomentumStateRoundTrips) {
  const std::string root = Fresh("sgd");
  Job a(2, OptimizerKind::kSgd);
  a.Train(0, 2);
  for (const auto& s : a.Save(root, PosixFileSystem())) ASSERT_TRUE(s.ok());
  a.Train(2, 4);
  Job b(3, OptimizerKind::kSgd);
  for (const auto& s : b.Load(root)) ASSERT_TRUE(s.ok()) << s;
  b.Train(2, 4);
  const auto x = a.Params(), y = b.Params();
  for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(x[i], y[i], 1e-6 + 1e-5 * std::fabs(x[i]));
}

void FlipByte(const std::string& path, long offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c;
  f.read(&c, 1);
  c ^= 0x5a;
  f.seekp(offset);
  f.write(&c, 1);
}

TEST(CheckpointTest, CorruptionIsRefusedNamingTheFileOrParameter) {
  const std::string root = Fresh("corrupt");
  Job job(2);
  job.Train(0, 2);
  for (const auto& s : job.Save(root, PosixFileSystem())) ASSERT_TRUE(s.ok());
  const std::string dir = root + "/step-2";
  const std::string shard = dir + "/shard-1-of-2.safetensors";
  const std::string backup = root + "/backup";
  ASSERT_EQ(std::system(("cp -r " + dir + " " + backup).c_str()), 0);
  auto restore = [&] {
    ASSERT_EQ(std::system(("rm -rf " + dir + " && cp -r " + backup + " " + dir).c_str()), 0);
  };
  auto expect_refused = [&](const std::string& needle) {
    Job fresh(2);
    for (const absl::Status& s : fresh.Load(root)) EXPECT_FALSE(s.ok());
    const auto st = fresh.Load(root);
    bool named = false;
    for (const absl::Status& s : st) named |= s.message().find(needle) != absl::string_view::npos;
    EXPECT_TRUE(named) << "no error mentions '" << needle << "': " << st[0] << " / " << st[1];
  };
  // A flipped byte in the data.
  auto size = PosixFileSystem()->FileSize(shard);
  FlipByte(shard, static_cast<long>(*size) - 3);
  expect_refused("shard-1-of-2.safetensors' is corrupt");
  EXPECT_FALSE(VerifyCheckpoint(PosixFileSystem(), dir).ok());
  restore();
  // A truncated file.
  ASSERT_EQ(truncate(shard.c_str(), static_cast<off_t>(*size) - 100), 0);
  expect_refused("truncated");
  restore();
  // A missing shard.
  std::remove(shard.c_str());
  expect_refused("is missing");
  restore();
  // A corrupt manifest.
  FlipByte(dir + "/manifest.json", 1);
  expect_refused("manifest.json");
  restore();
  // A manifest for another model.
  {
    InProcessWorld w(1, absl::Seconds(10));
    auto c = w.Connect(0);
    auto other = *MakeModel("tiny", 1);
    auto o = ShardedOptimizer::Create(other->NamedParameters(), ShardedOptimizerOptions(), c.get());
    auto s = LoadCheckpoint(**o, root);
    EXPECT_NE(s.status().message().find("another model"), absl::string_view::npos) << s.status();
  }
  // A different optimizer kind.
  {
    Job sgd(2, OptimizerKind::kSgd);
    const auto st = sgd.Load(root);
    EXPECT_NE(st[0].message().find("holds adam state"), absl::string_view::npos) << st[0];
  }
  // And the intact checkpoint still loads.
  Job fine(2);
  for (const auto& s : fine.Load(root)) EXPECT_TRUE(s.ok()) << s;
}

TEST(CheckpointTest, DiskFullFailsCleanlyAndTrainingContinues) {
  const std::string root = Fresh("full");
  Job job(2);
  job.Train(0, 2);
  for (const auto& s : job.Save(root, PosixFileSystem())) ASSERT_TRUE(s.ok());
  job.Train(2, 3);
  FaultInjectingFileSystem full(PosixFileSystem());
  full.set_budget_bytes(3000);  // the first shard fits, not both
  const auto st = job.Save(root, &full);
  bool enospc = false;
  for (const auto& s : st) {
    EXPECT_FALSE(s.ok());
    enospc |= s.status().message().find("No space left") != absl::string_view::npos;
  }
  EXPECT_TRUE(enospc) << st[0].status();
  // LATEST still names the previous, complete checkpoint.
  EXPECT_EQ(*ResolveCheckpoint(PosixFileSystem(), root), root + "/step-2");
  EXPECT_TRUE(VerifyCheckpoint(PosixFileSystem(), root + "/step-2").ok());
  job.Train(3, 4);  // training continues
  for (const auto& s : job.Save(root, PosixFileSystem())) EXPECT_TRUE(s.ok());
}

TEST(CheckpointTest, CrashAtAnyPointLeavesLatestComplete) {
  // Count the file-system operations of one save, then crash at random points.
  const std::string probe_root = Fresh("crash_probe");
  Job probe(2);
  probe.Train(0, 1);
  FaultInjectingFileSystem counter(PosixFileSystem());
  for (const auto& s : probe.Save(probe_root, &counter)) ASSERT_TRUE(s.ok());
  const int64_t total_ops = counter.ops();
  ASSERT_GT(total_ops, 5);
  std::mt19937 rng(7);
  for (int trial = 0; trial < 24; ++trial) {
    const std::string root = Fresh(absl::StrCat("crash", trial));
    Job job(2);
    job.Train(0, 1);
    for (const auto& s : job.Save(root, PosixFileSystem())) ASSERT_TRUE(s.ok());
    job.Train(1, 2);
    FaultInjectingFileSystem crashing(PosixFileSystem());
    const int64_t at = static_cast<int64_t>(rng() % (total_ops + 1));
    crashing.set_crash_after_ops(at);
    job.Save(root, &crashing);  // may fail anywhere
    auto dir = ResolveCheckpoint(PosixFileSystem(), root);
    ASSERT_TRUE(dir.ok()) << "trial " << trial << " crash after op " << at << ": " << dir.status();
    EXPECT_TRUE(VerifyCheckpoint(PosixFileSystem(), *dir).ok()) << "trial " << trial;
    Job resumed(2);
    for (const auto& s : resumed.Load(root)) EXPECT_TRUE(s.ok()) << "trial " << trial << ": " << s;
  }
}

TEST(CheckpointTest, PruneKeepsTheNewestAndLatest) {
  const std::string root = Fresh("prune");
  Job job(2);
  for (int k = 1; k <= 4; ++k) {
    job.Train(k - 1, k);
    for (const auto& s : job.Save(root, PosixFileSystem())) ASSERT_TRUE(s.ok());
  }
  // A crash leftover: an unfinished, older step directory.
  ASSERT_TRUE(PosixFileSystem()->MakeDirs(root + "/step-0").ok());
  ASSERT_TRUE(PruneCheckpoints(PosixFileSystem(), root, 2).ok());
  auto entries = *PosixFileSystem()->ListDir(root);
  std::sort(entries.begin(), entries.end());
  EXPECT_EQ(entries, (std::vector<std::string>{"LATEST", "step-3", "step-4"}));
  EXPECT_TRUE(VerifyCheckpoint(PosixFileSystem(), root + "/step-4").ok());
  EXPECT_EQ(PruneCheckpoints(PosixFileSystem(), root, 0).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CheckpointTest, ConsolidateWritesWholeTensors) {
  const std::string root = Fresh("consolidate");
  Job job(3);
  job.Train(0, 2);
  for (const auto& s : job.Save(root, PosixFileSystem())) ASSERT_TRUE(s.ok());
  const std::string out = root + "/whole.safetensors";
  int64_t last = 0, total = 0;
  ASSERT_TRUE(Consolidate(PosixFileSystem(), root + "/step-2", out, [&](int64_t d, int64_t t) {
                last = d;
                total = t;
              }).ok());
  EXPECT_EQ(last, total);
  // Parse the safetensors header and compare one parameter with the model.
  std::string data = *ReadWholeFile(PosixFileSystem(), out);
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i)
    hlen |= static_cast<uint64_t>(static_cast<unsigned char>(data[i])) << (8 * i);
  auto header = nlohmann::json::parse(data.substr(8, hlen));
  for (const auto& [name, t] : job.models[0]->NamedParameters()) {
    if (!t.requires_grad()) {
      EXPECT_FALSE(header.contains(name));
      continue;
    }
    ASSERT_TRUE(header.contains(name)) << name;
    ASSERT_TRUE(header.contains(name + ".exp_avg_sq")) << name;
    const int64_t begin = header[name]["data_offsets"][0];
    torch::Tensor f = t.detach().contiguous();
    EXPECT_EQ(std::memcmp(data.data() + 8 + hlen + begin, f.data_ptr<float>(), f.numel() * 4), 0)
        << name;
  }
}

}  // namespace
}  // namespace shardopt

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  at::set_num_threads(1);
  return RUN_ALL_TESTS();
}
