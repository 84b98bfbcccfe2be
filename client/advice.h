// The partition advisor (advisor/cost_model.h) for a live run (shardopt_train
// --advise, Python's ShardedOptimizer(advise=True)): the link is measured at
// start (all-reduces of two sizes over the job's own communicator;
// collective), compute and the update from the run's first steps; rank 0
// then prints the prediction for this run and the recommendation in two
// lines.
#ifndef SHARDOPT_CLIENT_ADVICE_H_
#define SHARDOPT_CLIENT_ADVICE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "advisor/cost_model.h"
#include "client/comm/communicator.h"
#include "client/sharded_optimizer.h"

namespace shardopt {

// Bandwidth and per-call cost fitted to all-reduces of 16 KiB and 8 MiB
// (the fastest of 3 each). Collective. World size 1: an infinitely fast link.
absl::StatusOr<advisor::Link> MeasureLink(Communicator* comm, absl::Duration timeout);

// The two lines: what the advisor predicts for this run's strategy against
// DDP and OSS, and its recommendation. `fwd_bwd_s` and `update_s` are this
// run's measured forward + backward and fused update per step.
absl::StatusOr<std::string> AdviceLines(const ShardedOptimizer& o, const advisor::Link& link,
                                        double fwd_bwd_s, double update_s);

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_ADVICE_H_
