#include "client/advice.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "absl/strings/str_format.h"

namespace shardopt {

absl::StatusOr<advisor::Link> MeasureLink(Communicator* comm, absl::Duration timeout) {
  advisor::Link link;
  link.name = "measured";
  link.source = "all-reduces of 16 KiB and 8 MiB over this job's communicator";
  const int n = comm->world_size();
  if (n == 1) {
    link.bandwidth = 1e18;
    return link;
  }
  const int64_t sizes[2] = {int64_t{4} << 10, int64_t{2} << 20};  // floats
  double best[2] = {1e30, 1e30};
  std::vector<float> buf(sizes[1], 0.0f);
  for (int rep = 0; rep < 3; ++rep) {
    for (int i = 0; i < 2; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      absl::Status s =
          comm->AllReduce(buf.data(), sizes[i], DType::kFloat32, ReduceOp::kSum)->Wait(timeout);
      if (!s.ok()) return s;
      best[i] = std::min(
          best[i], std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  // t = 2 (n-1)/n S/B + c, from the two sizes.
  const double f = 2.0 * (n - 1) / n;
  const double dt = std::max(best[1] - best[0], 1e-9);
  link.bandwidth = f * double(sizes[1] - sizes[0]) * 4 / dt;
  link.per_call = std::max(0.0, best[0] - f * double(sizes[0]) * 4 / link.bandwidth);
  return link;
}

absl::StatusOr<std::string> AdviceLines(const ShardedOptimizer& o, const advisor::Link& link,
                                        double fwd_bwd_s, double update_s) {
  const Layout& layout = o.layout();
  const advisor::ModelInfo model = advisor::ModelOf("this model", layout.params());
  advisor::Cluster c;
  c.world_size = o.communicator()->world_size();
  c.intra = link;
  c.inter = link;
  c.comm_on_compute_cores = !o.on_device();
  advisor::Compute k;
  k.forward_s = fwd_bwd_s / 3;
  k.backward_s = std::max(fwd_bwd_s * 2 / 3, 1e-9);
  const int64_t owned = std::max<int64_t>(1, o.shard_owner().owned_elements());
  k.fused_s_per_element = update_s / double(owned);
  k.unfused_s_per_element = 3 * k.fused_s_per_element;  // as bench_kernels measures LibTorch's
  advisor::Precision p;
  const bool bf16 = !layout.params().empty() && layout.params()[0].dtype == DType::kBFloat16;
  if (bf16) p = advisor::Precision{2, 2, 4, 8};
  if (o.options().kind == OptimizerKind::kSgd) p.state = 4;
  advisor::Options opt;
  opt.bucket_bytes = std::max<int64_t>(1, o.options().plan.bucket_cap_elements * p.grad);
  opt.zero2_bucket_bytes = opt.bucket_bytes;
  opt.broadcast_buffers = false;
  const advisor::Strategy mine = o.options().shard_gradients ? advisor::Strategy::kShardoptZero2
                                 : o.options().overlap_param_gather
                                     ? advisor::Strategy::kShardoptOverlap
                                     : advisor::Strategy::kShardopt;
  auto predict = [&](advisor::Strategy s) { return advisor::Predict(model, c, k, p, opt, s); };
  auto self = predict(mine);
  auto ddp = predict(advisor::Strategy::kDdp);
  auto oss = predict(advisor::Strategy::kOssDdp);
  if (!self.ok()) return self.status();
  if (!ddp.ok()) return ddp.status();
  if (!oss.ok()) return oss.status();
  auto r = advisor::Recommend(model, c, k, p);
  if (!r.ok()) return r.status();
  const std::string measured = c.world_size == 1
                                   ? std::string("one rank: no communication")
                                   : absl::StrFormat("link measured %.2f GB/s, %.0f us per call",
                                                     link.bandwidth / 1e9, link.per_call * 1e6);
  return absl::StrFormat(
      "advisor: this run (%s) %.1f ms/step predicted, %.1f MiB per rank; DDP %.1f ms (this run "
      "%.2fx), OSS+DDP %.1f ms; %s\n"
      "advisor: recommended %s, %s (docs/advisor.md)",
      advisor::StrategyName(mine), self->step_s * 1e3, self->memory.total() / (1 << 20),
      ddp->step_s * 1e3, ddp->step_s / self->step_s, oss->step_s * 1e3, measured,
      advisor::StrategyName(r->strategy), r->why);
}

}  // namespace shardopt
