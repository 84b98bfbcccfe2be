#include "advisor/cost_model.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace shardopt {
namespace advisor {
namespace {

constexpr double kGB = 1e9;

// The per-tensor (or per-bucket) sizes in bytes of `numel`, greedily packed
// into buckets of `cap` bytes in reverse registration order (backward's), as
// DDP and shardopt's planner do (a tensor larger than a bucket is its own).
std::vector<double> Buckets(const std::vector<int64_t>& numel, int elem, int64_t cap) {
  std::vector<double> out;
  double cur = 0.0;
  for (auto it = numel.rbegin(); it != numel.rend(); ++it) {
    const double b = static_cast<double>(*it) * elem;
    if (cur > 0 && cur + b > static_cast<double>(cap)) {
      out.push_back(cur);
      cur = 0.0;
    }
    cur += b;
  }
  if (cur > 0) out.push_back(cur);
  return out;
}

std::vector<double> PerTensor(const std::vector<int64_t>& numel, int elem) {
  std::vector<double> out;
  for (auto it = numel.rbegin(); it != numel.rend(); ++it) out.push_back(double(*it) * elem);
  return out;
}

// Overlap with backward: message i (bytes m[i], in backward's order) is ready
// when backward has produced the bytes up to it (at a uniform rate over
// `backward_s`); messages go one after another. Returns the time past the
// end of backward at which the last one is done (>= 0).
template <typename CostFn>
double ExposedAfterBackward(const std::vector<double>& m, double backward_s, CostFn cost) {
  double total = 0.0;
  for (double b : m) total += b;
  double produced = 0.0, done = 0.0;
  for (double b : m) {
    produced += b;
    const double ready = total > 0 ? backward_s * produced / total : backward_s;
    done = std::max(done, ready) + cost(b);
  }
  return std::max(0.0, done - backward_s);
}

template <typename CostFn>
double Sum(const std::vector<double>& m, CostFn cost) {
  double t = 0.0;
  for (double b : m) t += cost(b);
  return t;
}

}  // namespace

const std::vector<Link>& NamedLinks() {
  // Bus bandwidth (what one rank moves per second in a ring) and per-step
  // latency; docs/advisor.md gives each source.
  static const std::vector<Link>* links = new std::vector<Link>{
      {"nvlink4", 370 * kGB, 3e-6, 15e-6,
       "H100 SXM NVLink 4 via NVSwitch: 450 GB/s per direction (NVIDIA H100 datasheet); "
       "NCCL ring all-reduce ~370 GB/s bus bandwidth on 8 GPUs (NVIDIA's DGX H100 figures)"},
      {"pcie4-p2p", 24 * kGB, 5e-6, 15e-6,
       "PCIe 4.0 x16: 31.5 GB/s per direction (PCI-SIG); GPU peer-to-peer all-reduce ~24.5 "
       "GB/s bus bandwidth (nccl-tests on PCIe 4 GPUs with P2P)"},
      {"pcie4-nop2p", 10 * kGB, 8e-6, 25e-6,
       "PCIe 4.0 x16 without peer-to-peer (NCCL_P2P_DISABLE=1; GeForce cards have no P2P, "
       "nccl-tests issue 287): NCCL's SHM transport through host memory, ~8-13 GB/s"},
      {"eth100", 12 * kGB, 10e-6, 20e-6,
       "100 Gb/s Ethernet/RoCE with GPUDirect RDMA: 12.5 GB/s line rate, ~96% to NCCL"},
      {"ib200", 24 * kGB, 5e-6, 20e-6,
       "200 Gb/s InfiniBand HDR with GPUDirect RDMA: 25 GB/s line rate, ~96% to NCCL"},
      {"eth200", 24 * kGB, 10e-6, 20e-6,
       "200 Gb/s Ethernet/RoCE with GPUDirect RDMA: 25 GB/s line rate, ~96% to NCCL"},
      {"ib400", 48 * kGB, 5e-6, 20e-6,
       "400 Gb/s InfiniBand NDR, one NIC per GPU (DGX H100): 50 GB/s line rate, ~96% to NCCL"},
      {"eth400", 48 * kGB, 10e-6, 20e-6,
       "400 Gb/s Ethernet/RoCE, one NIC per GPU: 50 GB/s line rate, ~96% to NCCL"},
  };
  return *links;
}

absl::StatusOr<Link> FindLink(const std::string& name) {
  std::vector<std::string> names;
  for (const Link& l : NamedLinks()) {
    if (l.name == name) return l;
    names.push_back(l.name);
  }
  return absl::NotFoundError(absl::StrCat("no network profile '", name,
                                          "'; profiles: ", absl::StrJoin(names, ", "),
                                          " (or measure one with bench_comm --json)"));
}

int Nodes(const Cluster& c) {
  if (c.ranks_per_node <= 0 || c.ranks_per_node >= c.world_size) return 1;
  return (c.world_size + c.ranks_per_node - 1) / c.ranks_per_node;
}

Link RingLink(const Cluster& c) {
  if (Nodes(c) == 1) return c.intra;
  Link l;
  l.name = absl::StrCat(c.intra.name, "+", c.inter.name);
  l.bandwidth = std::min(c.intra.bandwidth, c.inter.bandwidth);
  l.latency = std::max(c.intra.latency, c.inter.latency);
  l.per_call = std::max(c.intra.per_call, c.inter.per_call);
  l.source = "a ring over every rank crosses the slowest link";
  return l;
}

double AllReduceSeconds(double bytes, int n, const Link& l) {
  if (n <= 1) return 0.0;
  return 2.0 * (n - 1) / n * bytes / l.bandwidth + 2.0 * (n - 1) * l.latency + l.per_call;
}
double ReduceScatterSeconds(double bytes, int n, const Link& l) {
  if (n <= 1) return 0.0;
  return double(n - 1) / n * bytes / l.bandwidth + (n - 1) * l.latency + l.per_call;
}
double AllGatherSeconds(double bytes, int n, const Link& l) {
  return ReduceScatterSeconds(bytes, n, l);
}
double BroadcastSeconds(double bytes, int n, const Link& l) {
  if (n <= 1) return 0.0;
  return bytes / l.bandwidth + (n - 1) * l.latency + l.per_call;
}
double ReduceSeconds(double bytes, int n, const Link& l) { return BroadcastSeconds(bytes, n, l); }

const char* StrategyName(Strategy s) {
  switch (s) {
    case Strategy::kDdp: return "ddp";
    case Strategy::kDdpFused: return "ddp_fused";
    case Strategy::kOssDdp: return "oss_ddp";
    case Strategy::kOssShardedDdp: return "oss_sharded_ddp";
    case Strategy::kZero: return "zero";
    case Strategy::kShardopt: return "shardopt";
    case Strategy::kShardoptOverlap: return "shardopt_overlap";
    case Strategy::kShardoptZero2: return "shardopt_zero2";
  }
  return "?";
}

std::vector<Strategy> AllStrategies() {
  return {
      Strategy::kDdp,  Strategy::kDdpFused, Strategy::kOssDdp,          Strategy::kOssShardedDdp,
      Strategy::kZero, Strategy::kShardopt, Strategy::kShardoptOverlap, Strategy::kShardoptZero2};
}

absl::StatusOr<Strategy> ParseStrategy(const std::string& name) {
  std::vector<std::string> names;
  for (Strategy s : AllStrategies()) {
    if (name == StrategyName(s)) return s;
    names.push_back(StrategyName(s));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("no strategy '", name, "'; strategies: ", absl::StrJoin(names, ", ")));
}

int64_t ModelInfo::elements() const {
  int64_t n = 0;
  for (int64_t x : numel) n += x;
  return n;
}

ModelInfo ModelOf(const std::string& name, const std::vector<ParamSpec>& params,
                  const std::vector<ParamSpec>& buffers) {
  ModelInfo m;
  m.name = name;
  for (const ParamSpec& p : params) {
    if (!p.trainable) continue;
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    m.numel.push_back(n);
  }
  for (const ParamSpec& b : buffers) {
    int64_t n = 1;
    for (int64_t d : b.shape) n *= d;
    m.buffer_bytes += n * 4;
    ++m.buffer_tensors;
  }
  return m;
}

namespace {

absl::Status Validate(const ModelInfo& model, const Cluster& c, const Compute& k,
                      const Options& o) {
  if (model.numel.empty() || model.elements() <= 0) {
    return absl::InvalidArgumentError("the model has no trainable parameters");
  }
  if (c.world_size < 1) return absl::InvalidArgumentError("world size must be >= 1");
  if (!(c.intra.bandwidth > 0) || (Nodes(c) > 1 && !(c.inter.bandwidth > 0))) {
    return absl::InvalidArgumentError("link bandwidths must be > 0");
  }
  if (!(c.intra.latency >= 0) || !(c.inter.latency >= 0)) {
    return absl::InvalidArgumentError("link latencies must be >= 0");
  }
  if (!(k.forward_s >= 0) || !(k.backward_s > 0)) {
    return absl::InvalidArgumentError("forward must be >= 0 s and backward > 0 s");
  }
  if (!(k.fused_s_per_element >= 0) || !(k.unfused_s_per_element >= 0) || !(k.per_tensor_s >= 0)) {
    return absl::InvalidArgumentError("optimizer costs must be >= 0");
  }
  if (o.bucket_bytes < 1 || o.zero2_bucket_bytes < 1 || o.zero2_staging_buckets < 1 ||
      o.broadcast_bucket_bytes < 0 || !(o.activation_bytes >= 0)) {
    return absl::InvalidArgumentError("bucket sizes must be >= 1 byte");
  }
  return absl::OkStatus();
}

// Parameter sharding keeps whole tensors per owner (fairscale, ZeRO):
// greedy by size onto the least loaded rank; returns the largest share
// (the slowest rank's update) in elements and its tensor count.
std::pair<int64_t, int64_t> LargestOwnedShare(const std::vector<int64_t>& numel, int n) {
  std::vector<int64_t> sorted = numel;
  std::sort(sorted.rbegin(), sorted.rend());
  std::vector<int64_t> load(n, 0), count(n, 0);
  for (int64_t x : sorted) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    load[r] += x;
    ++count[r];
  }
  const int r = static_cast<int>(std::max_element(load.begin(), load.end()) - load.begin());
  return {load[r], count[r]};
}

}  // namespace

absl::StatusOr<Prediction> Predict(const ModelInfo& model, const Cluster& cluster,
                                   const Compute& compute, const Precision& precision,
                                   const Options& options, Strategy strategy) {
  if (absl::Status s = Validate(model, cluster, compute, options); !s.ok()) return s;
  const int n = cluster.world_size;
  const Link link = RingLink(cluster);
  const double P = static_cast<double>(model.elements());
  const double tensors = static_cast<double>(model.numel.size());
  const double S = P * precision.grad;  // gradient bytes
  const double Sp = P * precision.param;
  Prediction p;
  p.strategy = strategy;
  p.compute_s = compute.forward_s + compute.backward_s;
  // The wire (bandwidth and latency) overlaps compute; the per-call cost is
  // host time (launch, synchronisation) on the thread that also drives
  // compute: it never overlaps, and is added per collective below.
  Link wire = link;
  wire.per_call = 0.0;
  auto ar = [&](double b) { return AllReduceSeconds(b, n, wire); };
  auto rs = [&](double b) { return ReduceScatterSeconds(b, n, wire); };
  auto ag = [&](double b) { return AllGatherSeconds(b, n, wire); };
  auto bc = [&](double b) { return BroadcastSeconds(b, n, wire); };
  auto rd = [&](double b) { return ReduceSeconds(b, n, wire); };
  // Communication during backward, then after the update.
  std::vector<double> backward_msgs, after_msgs;
  double backward_comm = 0.0, after_comm = 0.0, exposed_backward = 0.0, exposed_after = 0.0;
  Memory& m = p.memory;
  m.params = Sp;
  m.master = P * precision.master;
  m.activations = options.activation_bytes;
  const bool sharded_opt = strategy != Strategy::kDdp && strategy != Strategy::kDdpFused;
  const auto [owned_whole, owned_tensors] = LargestOwnedShare(model.numel, n);
  switch (strategy) {
    case Strategy::kDdp:
    case Strategy::kDdpFused:
    case Strategy::kOssDdp:
    case Strategy::kZero: {
      backward_msgs = Buckets(model.numel, precision.grad, options.bucket_bytes);
      backward_comm = Sum(backward_msgs, ar);
      exposed_backward = ExposedAfterBackward(backward_msgs, compute.backward_s, ar);
      p.bytes_sent += 2.0 * (n - 1) / n * S;
      m.grads = S * (options.ddp_bucket_copy ? 2 : 1);
      break;
    }
    case Strategy::kOssShardedDdp: {
      // One reduce per parameter to its owner, in backward's hooks.
      backward_msgs = PerTensor(model.numel, precision.grad);
      backward_comm = Sum(backward_msgs, rd);
      exposed_backward = ExposedAfterBackward(backward_msgs, compute.backward_s, rd);
      p.bytes_sent += double(n - 1) / n * S;
      m.grads = double(owned_whole) * precision.grad;  // others' are freed once reduced
      break;
    }
    case Strategy::kShardopt:
    case Strategy::kShardoptOverlap:
    case Strategy::kShardoptZero2: {
      const int64_t cap =
          strategy == Strategy::kShardoptZero2 ? options.zero2_bucket_bytes : options.bucket_bytes;
      backward_msgs = Buckets(model.numel, precision.grad, cap);
      backward_comm = Sum(backward_msgs, rs);
      exposed_backward = ExposedAfterBackward(backward_msgs, compute.backward_s, rs);
      p.bytes_sent += double(n - 1) / n * S;
      if (strategy == Strategy::kShardoptZero2) {
        double largest = 0.0;  // a bucket staged whole
        for (double b : backward_msgs) {
          if (b <= double(cap) || !options.zero2_pieces) largest = std::max(largest, b);
        }
        m.grads = S / n;
        m.staging = std::max(largest, double(options.zero2_staging_buckets) * double(cap)) *
                    double(n - 1) / n;
      } else {
        m.grads = S;
      }
      break;
    }
  }
  // The update.
  if (strategy == Strategy::kDdp) {
    p.optimizer_s = P * compute.unfused_s_per_element + tensors * compute.per_tensor_s;
  } else if (strategy == Strategy::kDdpFused) {
    p.optimizer_s = P * compute.fused_s_per_element;
  } else if (strategy == Strategy::kOssDdp || strategy == Strategy::kOssShardedDdp ||
             strategy == Strategy::kZero) {
    p.optimizer_s = double(owned_whole) * compute.unfused_s_per_element +
                    double(owned_tensors) * compute.per_tensor_s;
  } else {
    p.optimizer_s = P / n * compute.fused_s_per_element;
  }
  m.state = P * precision.state / (sharded_opt ? n : 1);
  m.master /= sharded_opt ? n : 1;
  // Parameters to every rank after the update.
  if (strategy == Strategy::kOssDdp || strategy == Strategy::kOssShardedDdp) {
    // fairscale's OSS: each rank's parameters in one flat buffer, broadcast
    // from its owner after the step and waited for (nothing overlaps).
    after_msgs.assign(n, Sp / n);
    after_comm = Sum(after_msgs, bc);
    exposed_after = after_comm;
    p.bytes_sent += double(n - 1) / n * Sp;
  } else if (strategy == Strategy::kZero) {
    after_msgs = options.broadcast_bucket_bytes > 0
                     ? Buckets(model.numel, precision.param, options.broadcast_bucket_bytes)
                     : PerTensor(model.numel, precision.param);
    after_comm = Sum(after_msgs, bc);
    exposed_after = after_comm;  // after the step, before the next forward
    p.bytes_sent += double(n - 1) / n * Sp;
  } else if (strategy == Strategy::kShardopt || strategy == Strategy::kShardoptOverlap ||
             strategy == Strategy::kShardoptZero2) {
    after_msgs = Buckets(model.numel, precision.param, options.bucket_bytes);
    after_comm = Sum(after_msgs, ag);
    // Each bucket's gather starts once its slice is updated.
    const double per_bucket_update = p.optimizer_s / after_msgs.size();
    double done = 0.0, updated = 0.0;
    for (double b : after_msgs) {
      updated += per_bucket_update;
      done = std::max(done, updated) + ag(b);
    }
    exposed_after = std::max(0.0, done - p.optimizer_s);
    if (strategy != Strategy::kShardopt) {
      // Overlapping the next forward: the first layers' bucket is needed at
      // once, the rest while forward runs.
      exposed_after = std::max(ag(after_msgs.back()), exposed_after - compute.forward_s);
    }
    p.bytes_sent += double(n - 1) / n * Sp;
  }
  // Buffers from rank 0 before forward, waited for.
  double buffer_comm = 0.0;
  int64_t buffer_calls = 0;
  if (options.broadcast_buffers && model.buffer_tensors > 0) {
    if (strategy == Strategy::kOssShardedDdp) {
      buffer_calls = model.buffer_tensors;
      buffer_comm =
          double(buffer_calls) * bc(double(model.buffer_bytes) / double(model.buffer_tensors));
    } else {
      buffer_calls = 1;
      buffer_comm = bc(double(model.buffer_bytes));
    }
    p.bytes_sent += double(model.buffer_bytes) / n;
  }
  p.collectives = static_cast<int64_t>(backward_msgs.size() + after_msgs.size()) + buffer_calls;
  const double host_calls = double(p.collectives) * link.per_call;
  p.comm_s = backward_comm + after_comm + buffer_comm + host_calls;
  if (n == 1) {
    p.exposed_comm_s = 0.0;
    p.comm_s = 0.0;
    p.bytes_sent = 0.0;
  } else if (cluster.comm_on_compute_cores) {
    p.exposed_comm_s = p.comm_s;  // nothing overlaps
  } else {
    p.exposed_comm_s = exposed_backward + exposed_after + buffer_comm + host_calls;
  }
  p.step_s = p.compute_s + p.exposed_comm_s + p.optimizer_s;
  return p;
}

absl::StatusOr<Recommendation> Recommend(const ModelInfo& model, const Cluster& cluster,
                                         const Compute& compute, const Precision& precision,
                                         double memory_limit_bytes) {
  Recommendation best;
  double best_step = 0.0;
  Prediction best_full;
  for (int64_t mib : {1, 2, 4, 8, 16, 25, 50, 100}) {
    Options o;
    o.bucket_bytes = mib << 20;
    o.zero2_bucket_bytes = mib << 20;
    auto full = Predict(model, cluster, compute, precision, o, Strategy::kShardoptOverlap);
    if (!full.ok()) return full.status();
    if (best.bucket_bytes == 0 || full->step_s < best_step) {
      best_step = full->step_s;
      best.bucket_bytes = o.bucket_bytes;
      best_full = *full;
    }
  }
  Options o;
  o.bucket_bytes = best.bucket_bytes;
  o.zero2_bucket_bytes = std::min<int64_t>(best.bucket_bytes, int64_t{8} << 20);
  auto zero2 = Predict(model, cluster, compute, precision, o, Strategy::kShardoptZero2);
  if (!zero2.ok()) return zero2.status();
  const double saved = best_full.memory.total() - zero2->memory.total();
  const double cost = zero2->step_s / best_full.step_s - 1.0;
  const bool needed = memory_limit_bytes > 0 && best_full.memory.total() > memory_limit_bytes;
  best.shard_gradients = needed || (saved > 0 && cost <= 0.03);
  best.strategy = best.shard_gradients ? Strategy::kShardoptZero2 : Strategy::kShardoptOverlap;
  if (saved > 0) {
    best.why = absl::StrFormat(
        "buckets of %d MiB (predicted step %.1f ms); gradient sharding saves %.1f MiB per rank at "
        "%+.1f%% step time%s",
        best.bucket_bytes >> 20, best_step * 1e3, saved / (1 << 20), cost * 100,
        needed ? ", and the memory limit needs it" : "");
  } else {
    best.why = absl::StrFormat(
        "buckets of %d MiB (predicted step %.1f ms); gradient sharding would save no memory "
        "(its staging exceeds the gradients it frees)%s",
        best.bucket_bytes >> 20, best_step * 1e3, needed ? ", but the memory limit needs it" : "");
  }
  return best;
}

}  // namespace advisor
}  // namespace shardopt
