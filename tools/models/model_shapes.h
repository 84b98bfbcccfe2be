// Loads the parameter-shape fixtures (tests/fixtures/*.json) used by planner
// tests and benchmarks: names and shapes in registration order.
#ifndef SHARDOPT_TOOLS_MODELS_MODEL_SHAPES_H_
#define SHARDOPT_TOOLS_MODELS_MODEL_SHAPES_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/param_spec.h"

namespace shardopt {

struct ModelShapes {
  std::string model;
  int64_t total_parameters = 0;    // as declared by the fixture
  std::vector<ParamSpec> params;   // trainable, fp32
  std::vector<ParamSpec> buffers;  // e.g. batch-norm running stats (not trainable)
};

// Reads a fixture file. Errors name the file and what is wrong with it.
absl::StatusOr<ModelShapes> LoadModelShapes(const std::string& path);

}  // namespace shardopt

#endif  // SHARDOPT_TOOLS_MODELS_MODEL_SHAPES_H_
