// For the PyTorch interop test: loads a checkpoint into the "tiny" model on
// one rank, takes one Adam step on loss = 0.01 * sum(-cos(p)) over every
// parameter, and writes the parameters (raw fp32, registration order).
//   interop_step CKPT OUT
#include <ATen/Parallel.h>

#include <fstream>
#include <iostream>

#include "client/checkpoint/checkpoint.h"
#include "client/comm/in_process_communicator.h"
#include "tools/models/models.h"

int main(int argc, char** argv) {
  using namespace shardopt;
  if (argc != 3) {
    std::cerr << "usage: interop_step CKPT OUT\n";
    return 2;
  }
  at::set_num_threads(1);
  auto dir = ResolveCheckpoint(PosixFileSystem(), argv[1]);
  auto manifest = dir.ok() ? ReadManifest(PosixFileSystem(), *dir) : dir.status();
  if (!manifest.ok()) {
    std::cerr << manifest.status() << "\n";
    return 1;
  }
  InProcessWorld world(1, absl::Seconds(60));
  auto comm = world.Connect(0);
  auto model = *MakeModel("tiny", 1);
  ShardedOptimizerOptions o;
  o.adam.lr = manifest->optimizer.lr;
  auto opt = ShardedOptimizer::Create(model->NamedParameters(), o, comm.get());
  auto loaded = LoadCheckpoint(**opt, argv[1]);
  if (!loaded.ok()) {
    std::cerr << loaded.status() << "\n";
    return 1;
  }
  (*opt)->ZeroGrad();
  torch::Tensor loss = torch::zeros({});
  for (const auto& [name, p] : model->NamedParameters()) loss = loss - p.cos().sum();
  (loss * 0.01).backward();
  auto r = (*opt)->Step();
  if (!r.ok()) {
    std::cerr << r.status() << "\n";
    return 1;
  }
  std::ofstream f(argv[2], std::ios::binary);
  for (const auto& [name, p] : model->NamedParameters()) {
    torch::Tensor c = p.detach().contiguous();
    f.write(reinterpret_cast<const char*>(c.data_ptr<float>()), c.numel() * 4);
  }
  return f ? 0 : 1;
}
