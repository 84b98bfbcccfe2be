// Where the cost model's inputs come from: measured primitives of this
// machine (bench_comm's and bench_kernels' --json results, bench_oss's
// compute_only row) and standard model shapes.
#ifndef SHARDOPT_ADVISOR_INPUTS_H_
#define SHARDOPT_ADVISOR_INPUTS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "advisor/cost_model.h"
#include "common/param_spec.h"

namespace shardopt {
namespace advisor {

// A link fitted to a bench_comm --json result: its reduce-scatter +
// all-gather times per buffer size over `transport` ("gloo" or "shm"),
// t(S) = 2 (n-1)/n S/B + 2 c, least squares over every size: the slope
// gives B, the intercept the per-call cost c.
absl::StatusOr<Link> LinkFromBenchComm(const std::string& json_text, const std::string& transport);

struct OptimizerCost {
  double fused_s_per_element = 0.0;
  double unfused_s_per_element = 0.0;
};
// From a bench_kernels --json result: shardopt's fused Adam and LibTorch's
// Adam per parameter, one thread.
absl::StatusOr<OptimizerCost> OptimizerCostFromBenchKernels(const std::string& json_text);

// Forward + backward seconds of `model`'s compute_only row in a bench_oss
// --json result.
absl::StatusOr<double> ComputeFromBenchOss(const std::string& json_text, const std::string& model);

// The most an input file (a benchmark result, a layout) may hold.
constexpr int64_t kMaxInputBytes = int64_t{256} << 20;

// A link named by a profile (NamedLinks) or FILE.json:gloo|shm (a bench_comm
// --json result, fitted with LinkFromBenchComm).
absl::StatusOr<Link> LinkFromSpec(const std::string& spec);

// gpt:LAYERS,HIDDEN,VOCAB,SEQ, mlp:IN,HIDDEN,...,OUT, gpt2-small, gpt-1.3b,
// gpt-7b; NotFound for anything else (a file, for the caller to read).
absl::StatusOr<std::vector<ParamSpec>> StandardModel(const std::string& spec);

// GPT-2-style shapes: token and position embeddings, `layers` blocks of
// (layer norm, fused QKV, attention projection, layer norm, 4x MLP), a final
// layer norm; about 12 layers hidden^2 + (vocab + seq) hidden parameters.
std::vector<ParamSpec> GptShapes(int layers, int hidden, int vocab, int seq);

}  // namespace advisor
}  // namespace shardopt

#endif  // SHARDOPT_ADVISOR_INPUTS_H_
