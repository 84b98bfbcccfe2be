// Checkpoint throughput: save and load of the mlp model's optimizer (2 ranks
// as threads, fp32 parameters + Adam state = 503 MB) against a plain
// sequential write (with fsync) and read of the same number of bytes in the
// same directory, interleaved, medians; plus consolidation time. Reads are
// from a cold page cache when this process may drop it (root), so both the
// plain read and the load come from the disk.
#include <ATen/Parallel.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/checkpoint/checkpoint.h"
#include "client/comm/in_process_communicator.h"
#include "tools/models/models.h"
#include "common/file_system.h"
#include "common/malloc_tuning.h"
#include "nlohmann/json.hpp"
#include "tools/cli/flags.h"

namespace shardopt {
namespace {

double Seconds(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Main(int argc, char** argv) {
  auto f = Flags::Parse(argc, argv, {"dir", "rounds", "json", "help"});
  if (!f.ok() || f->Has("help")) {
    std::printf("usage: bench_ckpt [--dir=DIR (default /tmp)] [--rounds=3] [--json=PATH]\n");
    return f.ok() ? 0 : 2;
  }
  (void)ApplyMallocMode(MallocMode::kTuned);
  at::set_num_threads(1);
  const std::string base = f->Str("dir", "/tmp") + "/bench_ckpt." + std::to_string(getpid());
  const int rounds = static_cast<int>(f->Int("rounds", 3).value_or(3));
  FileSystem* fs = PosixFileSystem();
  (void)fs->MakeDirs(base);
  const int n = 2;
  InProcessWorld world(n, absl::Seconds(600));
  std::vector<std::unique_ptr<Communicator>> comms;
  std::vector<std::unique_ptr<TrainModel>> models;
  std::vector<std::unique_ptr<ShardedOptimizer>> opts(n);
  for (int r = 0; r < n; ++r) {
    comms.push_back(world.Connect(r));
    models.push_back(*MakeModel("mlp", 42));
  }
  auto parallel = [&](const std::function<void(int)>& fn) {
    std::vector<std::thread> t;
    for (int r = 0; r < n; ++r) t.emplace_back(fn, r);
    for (auto& x : t) x.join();
  };
  parallel([&](int r) {
    opts[r] = std::move(*ShardedOptimizer::Create(models[r]->NamedParameters(),
                                                  ShardedOptimizerOptions(), comms[r].get()));
    opts[r]->ZeroGrad();
    models[r]->Loss(0, r * 8, r * 8 + 8).backward();
    (void)opts[r]->Step();
  });
  int64_t bytes = 0;
  std::vector<double> save_s, write_s, load_s, read_s;
  std::string last_ckpt;
  for (int round = 0; round < rounds; ++round) {
    // Plain sequential write of the same bytes, one file per rank, in parallel.
    auto t0 = std::chrono::steady_clock::now();
    std::vector<int64_t> per_rank(n);
    for (int r = 0; r < n; ++r) per_rank[r] = opts[r]->memory().state_bytes / 2 * 3;
    parallel([&](int r) {
      std::vector<char> buf(4 << 20, static_cast<char>(r));
      auto file = *fs->NewWritableFile(absl::StrCat(base, "/plain", r));
      for (int64_t w = 0; w < per_rank[r]; w += buf.size()) {
        (void)file->Append(buf.data(), std::min<int64_t>(buf.size(), per_rank[r] - w));
      }
      (void)file->Sync();
      (void)file->Close();
    });
    write_s.push_back(Seconds(t0));
    // The checkpoint.
    t0 = std::chrono::steady_clock::now();
    std::vector<absl::StatusOr<std::string>> dirs(n, absl::UnknownError(""));
    const std::string root = absl::StrCat(base, "/ckpt", round);
    parallel([&](int r) { dirs[r] = SaveCheckpoint(*opts[r], root); });
    save_s.push_back(Seconds(t0));
    if (!dirs[0].ok()) {
      std::fprintf(stderr, "save failed: %s\n", dirs[0].status().ToString().c_str());
      return 1;
    }
    last_ckpt = *dirs[0];
    bytes = 0;
    bytes = ReadManifest(fs, last_ckpt)->total_file_bytes();
    // Plain read, then load, each from a cold cache when permitted.
    auto drop = [&] {
      sync();
      std::ofstream("/proc/sys/vm/drop_caches") << "3\n";
    };
    drop();
    t0 = std::chrono::steady_clock::now();
    parallel([&](int r) {
      std::vector<char> buf(4 << 20);
      const std::string p = absl::StrCat(base, "/plain", r);
      for (int64_t o = 0; o < per_rank[r]; o += buf.size()) {
        (void)fs->ReadAt(p, o, std::min<int64_t>(buf.size(), per_rank[r] - o), buf.data());
      }
    });
    read_s.push_back(Seconds(t0));
    drop();
    t0 = std::chrono::steady_clock::now();
    parallel([&](int r) { (void)LoadCheckpoint(*opts[r], root); });
    load_s.push_back(Seconds(t0));
  }
  auto t0 = std::chrono::steady_clock::now();
  absl::Status c = Consolidate(fs, last_ckpt, base + "/whole.safetensors");
  const double consolidate_s = Seconds(t0);
  const double gb = bytes / 1e9;
  nlohmann::json out = {{"bytes", bytes},
                        {"save_gbps", gb / Median(save_s)},
                        {"plain_write_gbps", gb / Median(write_s)},
                        {"save_vs_plain_write", Median(write_s) / Median(save_s)},
                        {"load_gbps", gb / Median(load_s)},
                        {"plain_read_gbps", gb / Median(read_s)},
                        {"load_vs_plain_read", Median(read_s) / Median(load_s)},
                        {"consolidate_s", consolidate_s},
                        {"consolidate_ok", c.ok()}};
  std::printf("bench_ckpt: mlp, 2 ranks, %.1f MB per checkpoint, median of %d rounds, dir %s\n",
              bytes / 1e6, rounds, base.c_str());
  std::printf("  save %.2f GB/s vs plain write+fsync %.2f GB/s: %.2fx\n", gb / Median(save_s),
              gb / Median(write_s), Median(write_s) / Median(save_s));
  std::printf("  load %.2f GB/s vs plain read %.2f GB/s: %.2fx\n", gb / Median(load_s),
              gb / Median(read_s), Median(read_s) / Median(load_s));
  std::printf("  consolidate: %.2f s (%s)\n", consolidate_s,
              c.ok() ? "ok" : std::string(c.message()).c_str());
  if (f->Has("json")) std::ofstream(f->Str("json", "")) << out.dump(2) << "\n";
  (void)std::system(("rm -rf " + base).c_str());
  return 0;
}

}  // namespace
}  // namespace shardopt

int main(int argc, char** argv) { return shardopt::Main(argc, argv); }
