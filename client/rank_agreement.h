// What the ranks must agree on, checked with small collectives so that a
// rank that differs fails loudly instead of training silently wrong:
// - at creation, the model and options (CheckSameModel);
// - every step, every group's hyper-parameters (schedulers and param_groups
//   edits happen on each rank on its own) and which parameters are updated
//   (torch.optim updates a parameter iff its .grad is not None; here iff some
//   rank has a gradient for it, as DDP averages one that some rank used);
// - after the first step, the order buckets are reduced in (rank 0's).
// Torch-free; collective: every rank calls the same methods in the same
// order. Training thread only.
#ifndef SHARDOPT_CLIENT_RANK_AGREEMENT_H_
#define SHARDOPT_CLIENT_RANK_AGREEMENT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/collective_waiter.h"
#include "client/comm/communicator.h"
#include "common/layout.h"
#include "common/optimizer_config.h"

namespace shardopt {

// One line per parameter group with every hyper-parameter the update uses
// (%.17g: equal text means equal doubles).
std::string DescribeGroups(OptimizerKind kind, const std::vector<HyperParameters>& groups);

class RankAgreement {
 public:
  // `waiter` (and its communicator) and `layout` must outlive this.
  RankAgreement(CollectiveWaiter* waiter, const Layout* layout);
  ~RankAgreement();  // waits (bounded) for an agreement in flight

  // `description`: one line per fact that must agree ("param <name>\t..."
  // lines name a parameter). FailedPrecondition on every rank when any rank
  // differs from rank 0, naming the first difference any rank found.
  absl::Status CheckSameModel(const std::string& description);

  // The step's agreement: launched before the updates, finished at the
  // latest at the step's end, so it costs one small all-reduce that hides
  // behind the reductions. `local_active`: per parameter, 1 if this rank has
  // a gradient for it.
  absl::Status Launch(OptimizerKind kind, const std::vector<HyperParameters>& groups,
                      std::vector<float> local_active);
  // Before bucket `bucket` (-1: the whole mask) is updated: waits for the
  // agreement unless the bucket can be updated on this rank's own marks
  // (owned_all_active(bucket): every owned parameter has a gradient here; a
  // parameter this rank has a gradient for is updated whatever the others
  // say). Fails on a disagreement. `step`: the step being taken.
  absl::Status AgreeIfNeeded(int bucket, int64_t step,
                             absl::FunctionRef<bool(int bucket)> owned_all_active);
  // The step's end: finishes the agreement if no update waited for it.
  absl::Status FinishIfPending(int64_t step);
  // Per parameter: updated this step (the agreed mask, or this rank's own
  // marks until it is agreed); whether every trainable parameter is.
  const std::vector<uint8_t>& active() const { return active_; }
  bool all_active() const { return all_active_; }
  void set_all_active(int num_params);

  // Rank 0's `order` (a permutation of the buckets) to every rank.
  absl::Status BroadcastLaunchOrder(std::vector<int32_t>* order);

 private:
  absl::Status Finish(int64_t step);
  void ReadActive();
  absl::Status BroadcastText(const std::string& mine, const char* what, std::string* theirs);
  absl::StatusOr<std::string> ShareDetail(const std::string& mine, const char* what);

  CollectiveWaiter* const waiter_;
  Communicator* const comm_;
  const Layout* const layout_;
  const int rank_;
  const int world_;
  // Hash of the groups, its negation, then local_active_ (max over ranks).
  std::vector<float> hyper_buf_;
  std::string hyper_text_;  // what was hashed
  CommHandlePtr hyper_handle_;
  std::string detail_buf_;  // ShareDetail's all-gather (a member: it may outlive a timeout)
  std::vector<float> local_active_;
  std::vector<uint8_t> active_;
  bool agreed_ = true;  // active_ is the agreed result
  bool all_active_ = true;
};

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_RANK_AGREEMENT_H_
