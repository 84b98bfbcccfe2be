// The models of docs/performance.md and the tests, and their seeded synthetic data.
#ifndef SHARDOPT_TOOLS_MODELS_MODELS_H_
#define SHARDOPT_TOOLS_MODELS_MODELS_H_

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace shardopt {

// A model with its loss on one batch.
class TrainModel {
 public:
  virtual ~TrainModel() = default;
  virtual std::string name() const = 0;
  virtual torch::nn::Module& module() = 0;
  // Loss on rows [begin, end) of the global batch of `step` (seeded: every
  // rank and a single-process reference see the same data).
  virtual torch::Tensor Loss(int64_t step, int64_t begin, int64_t end) = 0;
  // Samples in one global batch per rank of the benchmarks.
  virtual int64_t batch_per_rank() const = 0;
  std::vector<std::pair<std::string, torch::Tensor>> NamedParameters();
  // Called with each layer just before its forward (first layers first):
  // where a trainer waits for that layer's parameters when the optimizer's
  // all-gathers overlap the forward, e.g.
  //   model->set_layer_gate([&](torch::nn::Module& m) { Check(opt->WaitForParameters(m)); });
  // A gate may throw to fail the forward.
  using LayerGate = std::function<void(torch::nn::Module&)>;
  void set_layer_gate(LayerGate gate) { gate_ = std::move(gate); }

 protected:
  void Gate(torch::nn::Module& layer) {
    if (gate_) gate_(layer);
  }

 private:
  LayerGate gate_;
};

// Creates "mlp" (Linear 1024-4096-4096-4096-1024, ReLU, MSE; 42M parameters),
// "resnet101" (torchvision's ResNet-101, 44.5M parameters, 3x32x32 inputs,
// cross-entropy over 1000 classes),
// "small" (two linear layers with biases, a frozen parameter, and a parameter
// used only on even steps), or "tiny" (a quick run). `seed` fixes the weights.
absl::StatusOr<std::unique_ptr<TrainModel>> MakeModel(const std::string& name, uint64_t seed);

}  // namespace shardopt

#endif  // SHARDOPT_TOOLS_MODELS_MODELS_H_
