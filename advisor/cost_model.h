// The partition advisor's cost model: for a model (its parameter tensors), a
// cluster (ranks, nodes, links) and measured or given compute and optimizer
// costs, predicts per data-parallel strategy the step time, split into
// compute, exposed communication and optimizer, and the memory per rank
// (parameters, gradients, optimizer state, master copy, staging, the
// communication's own buffers). Torch-free, no I/O: the inputs come from
// fixtures, checkpoints, a live job's layout or benchmarks (advisor/inputs.h).
//
// The terms (docs/advisor.md derives each and says where it fails):
// - ring collectives on n ranks, a buffer of S bytes, a link of bandwidth B
//   (bytes/s each rank sends) and per-step latency a: all-reduce
//   2(n-1)/n S/B + 2(n-1)a; reduce-scatter and all-gather (n-1)/n S/B +
//   (n-1)a; broadcast and reduce (pipelined chain) S/B + (n-1)a;
// - overlap: backward produces gradients at a uniform rate in reverse
//   registration order; a bucket's collective starts when its last gradient
//   is in and the previous collective is done; what ends after backward is
//   exposed. A collective's fixed per-call cost is host time (launch,
//   synchronisation) and never overlaps: per-parameter schemes pay it per
//   tensor. Where communication runs on the cores that compute (CPU
//   training with every core busy), nothing overlaps: its time adds;
// - the optimizer: elements x seconds per element (fused: one pass;
//   torch.optim: several passes) + tensors x a fixed cost per tensor.
#ifndef SHARDOPT_ADVISOR_COST_MODEL_H_
#define SHARDOPT_ADVISOR_COST_MODEL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/param_spec.h"

namespace shardopt {
namespace advisor {

// What one rank can push through a link.
struct Link {
  std::string name;
  double bandwidth = 0.0;  // bytes/s per rank and direction (a ring's bus bandwidth)
  double latency = 0.0;    // seconds per ring step (per message hop)
  // Fixed cost of one collective call (launch, synchronisation): what a
  // per-parameter scheme pays per tensor.
  double per_call = 0.0;
  std::string source;  // where the figures come from
};

// The named profiles (NVLink 4 via NVSwitch, PCIe 4 with and without
// peer-to-peer, 100/200/400 Gb/s Ethernet and InfiniBand, this machine's
// loopback transports), each with its source.
const std::vector<Link>& NamedLinks();
// NotFound listing the names.
absl::StatusOr<Link> FindLink(const std::string& name);

struct Cluster {
  int world_size = 2;
  int ranks_per_node = 0;  // 0: every rank on one node
  Link intra;              // between ranks of a node
  Link inter;              // between nodes, per rank (unused on one node)
  // Communication runs on the cores that compute (CPU training, every core
  // busy with a rank's compute thread): it cannot overlap; its time adds.
  bool comm_on_compute_cores = false;
};
// The link a ring over the whole cluster runs at: the slowest hop.
Link RingLink(const Cluster& cluster);
int Nodes(const Cluster& cluster);

// Seconds for one collective over `bytes` (the whole buffer) on n ranks.
double AllReduceSeconds(double bytes, int n, const Link& link);
double ReduceScatterSeconds(double bytes, int n, const Link& link);
double AllGatherSeconds(double bytes, int n, const Link& link);
double BroadcastSeconds(double bytes, int n, const Link& link);
double ReduceSeconds(double bytes, int n, const Link& link);

struct Compute {
  double forward_s = 0.0;
  double backward_s = 0.0;
  // Optimizer cost: seconds per parameter element for a fused kernel (one
  // pass over parameters, gradients and state) and for torch.optim's
  // implementation (several passes), plus a fixed cost per tensor of
  // torch.optim's loop (kernel launches, Python).
  double fused_s_per_element = 0.0;
  double unfused_s_per_element = 0.0;
  double per_tensor_s = 0.0;
};

// Bytes per element.
struct Precision {
  int param = 4;   // the model's parameters
  int grad = 4;    // their gradients (and what travels)
  int master = 0;  // a float32 master copy when parameters are 16-bit (4), else 0
  int state = 8;   // optimizer state (Adam: m and v in float32, 8; SGD momentum 4)
};

enum class Strategy {
  kDdp,              // DDP: bucketed all-reduce in backward, torch.optim on everything
  kDdpFused,         // the same with a fused optimizer
  kOssDdp,           // fairscale OSS + DDP: all-reduce, 1/N update, a broadcast per owner
  kOssShardedDdp,    // OSS + ShardedDDP: a reduce per parameter to its owner, a broadcast per
                     // owner, buffers broadcast one by one before each forward
  kZero,             // PyTorch ZeroRedundancyOptimizer + DDP: a broadcast per parameter
  kShardopt,         // bucketed reduce-scatter, fused 1/N update, bucketed all-gather waited for
  kShardoptOverlap,  // the all-gathers overlap the next forward (the default)
  kShardoptZero2,    // that plus gradient sharding
};
const char* StrategyName(Strategy s);
absl::StatusOr<Strategy> ParseStrategy(const std::string& name);
std::vector<Strategy> AllStrategies();

struct Options {
  int64_t bucket_bytes = int64_t{25} << 20;       // DDP's and shardopt's gradient buckets
  int64_t zero2_bucket_bytes = int64_t{8} << 20;  // shardopt_zero2's buckets
  int zero2_staging_buckets = 2;                  // staging arena, in buckets
  // shardopt_zero2 reduces a tensor larger than a bucket in pieces of a
  // bucket's share (reduce_large_gradients_in_pieces): staging stays the
  // arena's; false: such a tensor is staged whole.
  bool zero2_pieces = true;
  // ZeroRedundancyOptimizer: broadcast parameters per tensor (0, its
  // default) or in buckets of this size (parameters_as_bucket_view).
  int64_t broadcast_bucket_bytes = 0;
  // Module buffers (batch-norm statistics) from rank 0 before each forward,
  // as DDP's broadcast_buffers: coalesced (DDP, ZeRO, shardopt) or one call
  // per buffer (ShardedDDP).
  bool broadcast_buffers = true;
  // DDP keeps its own bucket copy of the gradients (gradient_as_bucket_view=False).
  bool ddp_bucket_copy = true;
  // What forward keeps for backward at the peak (measured or estimated; the
  // model has no view of it): added to every strategy's memory.
  double activation_bytes = 0;
};

// What the model needs to know of a model: its trainable tensors' element
// counts in registration order, and the bytes of its buffers.
struct ModelInfo {
  std::string name;
  std::vector<int64_t> numel;
  int64_t buffer_bytes = 0;
  int64_t buffer_tensors = 0;
  int64_t elements() const;
};
ModelInfo ModelOf(const std::string& name, const std::vector<ParamSpec>& params,
                  const std::vector<ParamSpec>& buffers = {});

struct Memory {
  double params = 0, grads = 0, state = 0, master = 0, staging = 0, comm_buffers = 0;
  double activations = 0;  // as given (Options::activation_bytes): the same for every strategy
  double total() const {
    return params + grads + state + master + staging + comm_buffers + activations;
  }
};

struct Prediction {
  Strategy strategy = Strategy::kDdp;
  double compute_s = 0.0;       // forward + backward
  double exposed_comm_s = 0.0;  // communication the step waits for
  double optimizer_s = 0.0;
  double step_s = 0.0;      // the sum
  double comm_s = 0.0;      // every collective's time, overlapped or not
  double bytes_sent = 0.0;  // per rank per step
  int64_t collectives = 0;  // per step
  Memory memory;
};

// InvalidArgument for an empty model, world < 1, non-positive bandwidths or
// compute times, bucket sizes < 1.
absl::StatusOr<Prediction> Predict(const ModelInfo& model, const Cluster& cluster,
                                   const Compute& compute, const Precision& precision,
                                   const Options& options, Strategy strategy);

struct Recommendation {
  Strategy strategy = Strategy::kShardoptOverlap;
  int64_t bucket_bytes = 0;
  bool shard_gradients = false;
  std::string why;  // one line
};
// The fastest of shardopt's configurations over bucket sizes 1-100 MiB, and
// whether sharding gradients is worth its cost (it is when it saves memory
// at <= 3% of the step time, or when `memory_limit_bytes` > 0 requires it).
absl::StatusOr<Recommendation> Recommend(const ModelInfo& model, const Cluster& cluster,
                                         const Compute& compute, const Precision& precision,
                                         double memory_limit_bytes = 0);

}  // namespace advisor
}  // namespace shardopt

#endif  // SHARDOPT_ADVISOR_COST_MODEL_H_
