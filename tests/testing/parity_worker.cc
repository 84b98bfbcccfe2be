// One rank of a multi-process parity run: joins a Gloo job through a file
// store, trains with ShardedOptimizer, writes the final parameters (raw fp32).
//   parity_worker --rank=R --world=N --store=DIR --out=FILE [training flags]
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <ATen/Parallel.h>

#include "absl/strings/numbers.h"
#include "client/comm/gloo_communicator.h"
#include "client/comm/kv_store.h"
#include "tests/testing/training_harness.h"

int main(int argc, char** argv) {
  using namespace shardopt;
  std::vector<std::string> args(argv + 1, argv + argc);
  int rank = -1, world = 0;
  std::string store_dir, out;
  for (const std::string& a : args) {
    if (a.rfind("--rank=", 0) == 0) (void)absl::SimpleAtoi(a.substr(7), &rank);
    if (a.rfind("--world=", 0) == 0) (void)absl::SimpleAtoi(a.substr(8), &world);
    if (a.rfind("--store=", 0) == 0) store_dir = a.substr(8);
    if (a.rfind("--out=", 0) == 0) out = a.substr(6);
  }
  auto config = ParseTrainConfig(args);
  if (!config.ok() || rank < 0 || world < 1 || store_dir.empty() || out.empty()) {
    std::cerr << "usage: parity_worker --rank=R --world=N --store=DIR --out=FILE [--model=...]\n";
    return 2;
  }
  at::set_num_threads(1);
  FileKeyValueStore store(store_dir);
  GlooOptions gopt;
  gopt.timeout = absl::Seconds(60);
  auto comm = GlooCommunicator::Create(&store, rank, world, gopt);
  if (!comm.ok()) {
    std::cerr << "rank " << rank << ": " << comm.status() << "\n";
    return 1;
  }
  ByteCounters bytes;
  auto params = TrainSharded(*config, comm->get(), nullptr, &bytes);
  if (!params.ok()) {
    std::cerr << "rank " << rank << ": " << params.status() << "\n";
    return 1;
  }
  std::ofstream f(out, std::ios::binary);
  f.write(reinterpret_cast<const char*>(params->data()),
          static_cast<std::streamsize>(params->size() * sizeof(float)));
  std::ofstream b(out + ".bytes");
  b << bytes.total_sent() << "\n";
  return f && b ? 0 : 1;
}
