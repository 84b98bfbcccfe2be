// Shared by the parity tests and their worker binary: train a model with
// ShardedOptimizer on one rank's share of a fixed global batch, or with plain
// LibTorch optimizers on the whole batch in one process (the reference).
#ifndef SHARDOPT_TESTS_TESTING_TRAINING_HARNESS_H_
#define SHARDOPT_TESTS_TESTING_TRAINING_HARNESS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/comm/communicator.h"
#include "client/sharded_optimizer.h"

namespace shardopt {

struct TrainConfig {
  std::string model = "small";
  OptimizerKind kind = OptimizerKind::kAdam;
  double lr = 1e-3;
  double max_grad_norm = 0.0;
  int steps = 20;
  int64_t global_batch = 12;
  int64_t bucket_cap = 25 * 1024 * 1024 / 4;
  uint64_t seed = 42;
  // overlap_param_gather, with the model's layers waiting for their own
  // parameters before their forward (TrainModel::set_layer_gate).
  bool overlap = false;
  // ZeRO-2: keep only the owned gradient ranges (shard_gradients), with this
  // many staging buffers.
  bool shard_gradients = false;
  int staging_buffers = 2;
  // Gradients travel in bf16.
  bool grad_bf16 = false;
  // ShardedOptimizerOptions::device_async_step.
  bool device_async_step = false;
};

class TrainModel;
// Every parameter of `model` (trainable and frozen) as fp32, in registration order.
std::vector<float> FlattenParameters(TrainModel& model);

// The optimizer options a config implies (Adam/AdamW/SGD-momentum defaults).
ShardedOptimizerOptions OptionsFor(const TrainConfig& c);

// Trains on rank comm->rank() of comm->world_size(); returns every parameter
// of the model (trainable and frozen), flattened in registration order.
// `trace` (optional) receives the optimizer's trace of the last step;
// `grad_norms` each step's gradient norm (read with LastGradNorm() and
// checked against StepResult and ReadyGradNorm() when it is not pending).
absl::StatusOr<std::vector<float>> TrainSharded(const TrainConfig& c, Communicator* comm,
                                                std::vector<TraceEvent>* trace = nullptr,
                                                ByteCounters* bytes_per_step = nullptr,
                                                int* clipped_steps = nullptr,
                                                std::vector<double>* grad_norms = nullptr);

// The same training in one process with torch::optim on the whole batch.
absl::StatusOr<std::vector<float>> TrainReference(const TrainConfig& c);

// Parses "--key=value" flags into a config (for the worker binary).
absl::StatusOr<TrainConfig> ParseTrainConfig(const std::vector<std::string>& args);
std::vector<std::string> TrainConfigFlags(const TrainConfig& c);

}  // namespace shardopt

#endif  // SHARDOPT_TESTS_TESTING_TRAINING_HARNESS_H_
