// Communication benchmark: for 2 ranks (2 processes, Gloo over TCP loopback)
// and buffers from 1 MB to 256 MB, times shardopt's ring reduce-scatter
// followed by all-gather against stock Gloo's all-reduce (gloo::allreduce,
// ring) of the same buffer, interleaved in one run, and reports the ratio.
// A reduce-scatter plus an all-gather move the bytes of one all-reduce.
// The same reduce-scatter + all-gather over the shared-memory transport
// (ShmCommunicator, default slots) is timed in the same rounds.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/comm/gloo_communicator.h"
#include "client/comm/kv_store.h"
#include "client/comm/shm_communicator.h"
#include "gloo/allreduce.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/file_store.h"
#include "gloo/transport/tcp/device.h"
#include "nlohmann/json.hpp"

namespace {

struct Flags {
  std::string json;
  std::vector<int64_t> sizes_mb = {1, 2, 4, 8, 16, 32, 64, 128, 256};
  std::vector<int64_t> segments_kb = {256, 1024, 4096, 16384};
  int64_t default_segment_kb = 4096;
  int reps = 5;
};

void Usage() {
  std::printf(
      "usage: bench_comm [--json=PATH] [--sizes-mb=1,2,...] [--segments-kb=256,1024,...]\n"
      "                  [--reps=N]\n\n"
      "2 ranks (processes) over Gloo TCP on 127.0.0.1. For each buffer size, the median of N\n"
      "interleaved runs of: stock gloo::allreduce (ring), and shardopt's reduce-scatter +\n"
      "all-gather with each ring segment size, and the same over shared memory\n"
      "(ShmCommunicator, 4 x 1 MiB slots). rs_ag_vs_allreduce uses the default segment\n"
      "size (GlooOptions::segment_bytes = 4096 KiB); shm_vs_gloo is shm's reduce-scatter +\n"
      "all-gather time over Gloo's at that segment size.\n");
}

bool Parse(int argc, char** argv, Flags* f) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto list = [](const std::string& v) {
      std::vector<int64_t> out;
      for (absl::string_view p : absl::StrSplit(v, ',')) out.push_back(std::stoll(std::string(p)));
      return out;
    };
    try {
      if (a == "--help" || a == "-h") {
        Usage();
        std::exit(0);
      } else if (a.rfind("--json=", 0) == 0) {
        f->json = a.substr(7);
      } else if (a.rfind("--sizes-mb=", 0) == 0) {
        f->sizes_mb = list(a.substr(11));
      } else if (a.rfind("--segments-kb=", 0) == 0) {
        f->segments_kb = list(a.substr(14));
      } else if (a.rfind("--reps=", 0) == 0) {
        f->reps = std::stoi(a.substr(7));
      } else {
        std::fprintf(stderr, "bench_comm: unknown flag '%s' (see --help)\n", a.c_str());
        return false;
      }
    } catch (const std::exception&) {
      std::fprintf(stderr, "bench_comm: bad value in '%s'\n", a.c_str());
      return false;
    }
  }
  if (std::find(f->segments_kb.begin(), f->segments_kb.end(), f->default_segment_kb) ==
      f->segments_kb.end()) {
    f->segments_kb.push_back(f->default_segment_kb);
  }
  return f->reps >= 1 && !f->sizes_mb.empty();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

int RunRank(int rank, const Flags& flags, const std::string& dir) {
  using namespace shardopt;
  FileKeyValueStore store(dir);
  std::map<int64_t, std::unique_ptr<GlooCommunicator>> comms;
  for (int64_t seg : flags.segments_kb) {
    GlooOptions opt;
    opt.segment_bytes = seg * 1024;
    opt.timeout = absl::Seconds(120);
    opt.store_prefix = absl::StrCat("seg", seg);
    auto c = GlooCommunicator::Create(&store, rank, 2, opt);
    if (!c.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, c.status().ToString().c_str());
      return 1;
    }
    comms[seg] = std::move(*c);
  }
  ShmOptions sopt;
  sopt.timeout = absl::Seconds(120);
  auto shm = ShmCommunicator::Create(&store, rank, 2, sopt);
  if (!shm.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, shm.status().ToString().c_str());
    return 1;
  }
  // Stock Gloo, for the baseline.
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, 2);
  ctx->setTimeout(std::chrono::seconds(120));
  gloo::rendezvous::FileStore gstore(dir);
  ctx->connectFullMesh(gstore, device);

  nlohmann::json out;
  auto* any = comms.begin()->second.get();
  auto barrier = [&] { (void)any->Barrier()->Wait(absl::Seconds(120)); };
  if (rank == 0) {
    std::printf("%10s %14s", "size", "gloo_allreduce");
    for (int64_t seg : flags.segments_kb) std::printf("  rs+ag seg=%-5lldK", (long long)seg);
    std::printf("  ratio(default)  shm rs+ag  shm_vs_gloo\n");
  }
  uint32_t tag = 0;
  for (int64_t mb : flags.sizes_mb) {
    const int64_t count = mb * 1024 * 1024 / 4;  // floats, even for 2 ranks
    std::vector<float> buf(count, 1.0f);
    std::map<std::string, std::vector<double>> times;
    for (int rep = 0; rep < flags.reps + 1; ++rep) {
      barrier();
      auto t0 = std::chrono::steady_clock::now();
      gloo::AllreduceOptions opts(ctx);
      opts.setOutput(buf.data(), count);
      opts.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
      opts.setTag(++tag);
      gloo::allreduce(opts);
      double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (rep > 0) times["gloo"].push_back(t);
      for (auto& [seg, comm] : comms) {
        barrier();
        t0 = std::chrono::steady_clock::now();
        absl::Status s = comm->ReduceScatter(buf.data(), count / 2, DType::kFloat32, ReduceOp::kSum)
                             ->Wait(absl::Seconds(120));
        if (s.ok())
          s = comm->AllGather(buf.data(), count / 2, DType::kFloat32)->Wait(absl::Seconds(120));
        if (!s.ok()) {
          std::fprintf(stderr, "rank %d: %s\n", rank, s.ToString().c_str());
          return 1;
        }
        t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (rep > 0) times[absl::StrCat("seg", seg)].push_back(t);
      }
      barrier();
      t0 = std::chrono::steady_clock::now();
      absl::Status s = (*shm)
                           ->ReduceScatter(buf.data(), count / 2, DType::kFloat32, ReduceOp::kSum)
                           ->Wait(absl::Seconds(120));
      if (s.ok())
        s = (*shm)->AllGather(buf.data(), count / 2, DType::kFloat32)->Wait(absl::Seconds(120));
      if (!s.ok()) {
        std::fprintf(stderr, "rank %d: shm: %s\n", rank, s.ToString().c_str());
        return 1;
      }
      t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (rep > 0) times["shm"].push_back(t);
    }
    if (rank == 0) {
      const double g = Median(times["gloo"]);
      std::printf("%7lld MB %11.2f ms", (long long)mb, g * 1e3);
      nlohmann::json row;
      row["size_mb"] = mb;
      row["gloo_allreduce_s"] = g;
      for (int64_t seg : flags.segments_kb) {
        const double t = Median(times[absl::StrCat("seg", seg)]);
        std::printf("  %11.2f ms %4.2fx", t * 1e3, t / g);
        row[absl::StrCat("rs_ag_s_seg", seg, "k")] = t;
        row[absl::StrCat("ratio_seg", seg, "k")] = t / g;
      }
      const double ratio = Median(times[absl::StrCat("seg", flags.default_segment_kb)]) / g;
      const double shm_t = Median(times["shm"]);
      const double shm_ratio = shm_t / Median(times[absl::StrCat("seg", flags.default_segment_kb)]);
      std::printf("  %13.2f  %8.2f ms  %10.2fx\n", ratio, shm_t * 1e3, shm_ratio);
      row["rs_ag_vs_allreduce"] = ratio;
      row["shm_rs_ag_s"] = shm_t;
      row["shm_vs_gloo"] = shm_ratio;
      out["shm_vs_gloo"][absl::StrCat(mb, "MB")] = shm_ratio;
      out["sizes"].push_back(row);
      out["rs_ag_vs_allreduce"][absl::StrCat(mb, "MB")] = ratio;
    }
  }
  if (rank == 0) {
    out["ranks"] = 2;
    out["transport"] = "gloo tcp 127.0.0.1; shm: ShmCommunicator, 4 x 1 MiB slots";
    out["default_segment_kb"] = flags.default_segment_kb;
    if (!flags.json.empty()) {
      std::ofstream f(flags.json);
      f << out.dump(2) << "\n";
      std::printf("wrote %s\n", flags.json.c_str());
    }
  }
  barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  if (!Parse(argc, argv, &flags)) return 2;
  char tmpl[] = "/tmp/bench_comm.XXXXXX";
  const char* dir = mkdtemp(tmpl);
  if (dir == nullptr) {
    std::perror("mkdtemp");
    return 1;
  }
  std::printf(
      "bench_comm: 2 ranks (processes), Gloo TCP on 127.0.0.1 and shared memory, median of %d "
      "runs\n",
      flags.reps);
  std::fflush(stdout);
  pid_t child = fork();
  if (child == 0) _exit(RunRank(1, flags, dir));
  const int rc0 = RunRank(0, flags, dir);
  int status = 0;
  waitpid(child, &status, 0);
  std::string cmd = std::string("rm -rf ") + dir;
  (void)std::system(cmd.c_str());
  return rc0 != 0 ? rc0 : (WIFEXITED(status) ? WEXITSTATUS(status) : 1);
}
