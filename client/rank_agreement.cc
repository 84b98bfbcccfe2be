#include "client/rank_agreement.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

namespace shardopt {
namespace {

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// The first lines where two descriptions differ (false: none).
bool FirstDifferentLines(const std::string& theirs, const std::string& mine, std::string* x,
                         std::string* y) {
  std::vector<std::string> a = absl::StrSplit(theirs, '\n');
  std::vector<std::string> b = absl::StrSplit(mine, '\n');
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    *x = i < a.size() ? a[i] : "(nothing)";
    *y = i < b.size() ? b[i] : "(nothing)";
    if (*x != *y) return true;
  }
  return false;
}

// "rank 0 has 'X', rank R has 'Y'" for the first difference, or "".
std::string FirstDifference(const std::string& theirs, const std::string& mine, int rank) {
  std::string x, y;
  if (!FirstDifferentLines(theirs, mine, &x, &y)) return "";
  return absl::StrCat("rank 0 has '", x, "', rank ", rank, " has '", y, "'");
}

}  // namespace

std::string DescribeGroups(OptimizerKind kind, const std::vector<HyperParameters>& groups) {
  std::string out;
  for (size_t g = 0; g < groups.size(); ++g) {
    const HyperParameters& h = groups[g];
    if (kind == OptimizerKind::kSgd) {
      absl::StrAppendFormat(&out,
                            "group %d: lr=%.17g momentum=%.17g dampening=%.17g "
                            "weight_decay=%.17g nesterov=%d\n",
                            g, h.sgd.lr, h.sgd.momentum, h.sgd.dampening, h.sgd.weight_decay,
                            h.sgd.nesterov ? 1 : 0);
    } else {
      absl::StrAppendFormat(&out,
                            "group %d: lr=%.17g betas=(%.17g, %.17g) eps=%.17g "
                            "weight_decay=%.17g\n",
                            g, h.adam.lr, h.adam.beta1, h.adam.beta2, h.adam.eps,
                            h.adam.weight_decay);
    }
  }
  return out;
}

RankAgreement::RankAgreement(CollectiveWaiter* waiter, const Layout* layout)
    : waiter_(waiter),
      comm_(waiter->comm()),
      layout_(layout),
      rank_(waiter->comm()->rank()),
      world_(waiter->comm()->world_size()) {}

RankAgreement::~RankAgreement() {
  if (hyper_handle_) (void)hyper_handle_->Wait(waiter_->timeout());
}

void RankAgreement::set_all_active(int num_params) {
  active_.assign(num_params, 1);
  all_active_ = true;
}

// Rank 0's `mine` into *theirs on every rank.
absl::Status RankAgreement::BroadcastText(const std::string& mine, const char* what,
                                          std::string* theirs) {
  int64_t len = static_cast<int64_t>(mine.size());
  // Host buffers: the communicator stages them where it moves device memory (NCCL).
  SHARDOPT_RETURN_IF_ERROR(
      waiter_->Wait(comm_->Broadcast(&len, sizeof(len), DType::kByte, 0), what));
  if (len < 0 || len > (int64_t{1} << 30)) {
    return absl::DataLossError(absl::StrCat(what, ": rank 0 sent a corrupt description length"));
  }
  *theirs = rank_ == 0 ? mine : std::string(static_cast<size_t>(len), '\0');
  return waiter_->Wait(comm_->Broadcast(theirs->data(), len, DType::kByte, 0), what);
}

// Every rank's `mine` (at most kDetailBytes, empty: nothing to say) to all;
// returns the lowest rank's non-empty one, or "".
absl::StatusOr<std::string> RankAgreement::ShareDetail(const std::string& mine, const char* what) {
  constexpr int64_t kDetailBytes = 1024;
  detail_buf_.assign(static_cast<size_t>(kDetailBytes * world_), '\0');
  std::memcpy(&detail_buf_[kDetailBytes * rank_], mine.data(),
              std::min<size_t>(mine.size(), kDetailBytes - 1));
  SHARDOPT_RETURN_IF_ERROR(
      waiter_->Wait(comm_->AllGather(detail_buf_.data(), kDetailBytes, DType::kByte), what));
  for (int r = 0; r < world_; ++r) {
    const char* d = &detail_buf_[kDetailBytes * r];
    const size_t n = strnlen(d, kDetailBytes);
    if (n > 0) return std::string(d, n);
  }
  return std::string();
}

absl::Status RankAgreement::CheckSameModel(const std::string& mine) {
  std::string theirs;
  SHARDOPT_RETURN_IF_ERROR(BroadcastText(mine, "model check", &theirs));
  std::string detail, x, y;
  if (FirstDifferentLines(theirs, mine, &x, &y)) {
    detail = absl::StrCat("rank 0 has '", x, "', rank ", rank_, " has '", y, "'");
    if (absl::StartsWith(x, "param ") || absl::StartsWith(y, "param ")) {
      const std::string name = (absl::StartsWith(x, "param ") ? x : y).substr(6);
      detail = absl::StrCat("model differs from rank 0's at parameter '",
                            name.substr(0, name.find('\t')), "': ", detail);
    }
  }
  // Every rank learns the first difference any rank found, so all fail
  // together and each names the parameter or group and both values.
  SHARDOPT_ASSIGN_OR_RETURN(detail, ShareDetail(detail, "model check"));
  if (!detail.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("layout hash mismatch, refusing to train: ", detail));
  }
  return absl::OkStatus();
}

absl::Status RankAgreement::Launch(OptimizerKind kind, const std::vector<HyperParameters>& groups,
                                   std::vector<float> local_active) {
  local_active_ = std::move(local_active);
  hyper_text_ = DescribeGroups(kind, groups);
  const uint64_t h = Fnv1a(hyper_text_);
  // [hash (3 floats), -hash, which parameters this rank has a gradient for]:
  // the maximum over ranks shows a difference in the hash, and is 1 for a
  // parameter some rank has a gradient for.
  hyper_buf_.assign(6 + local_active_.size(), 0.0f);
  for (int i = 0; i < 3; ++i) {
    hyper_buf_[i] = static_cast<float>((h >> (21 * i)) & 0x1FFFFF);  // exact in a float
    hyper_buf_[i + 3] = -hyper_buf_[i];
  }
  std::copy(local_active_.begin(), local_active_.end(), hyper_buf_.begin() + 6);
  if (world_ == 1) {
    hyper_handle_ = nullptr;
    ReadActive();
    agreed_ = true;
    return absl::OkStatus();
  }
  // Until the agreement arrives, this rank's own marks: a parameter it has
  // a gradient for is updated whatever the others say (the maximum), so
  // only a bucket with an owned parameter this rank has no gradient for
  // waits for it (AgreeIfNeeded); the usual step never does, and its
  // updates overlap the last reductions.
  active_.assign(local_active_.size(), 0);
  all_active_ = true;
  for (size_t p = 0; p < local_active_.size(); ++p) {
    active_[p] = local_active_[p] > 0.5f ? 1 : 0;
    if (active_[p] == 0 && layout_->placement(static_cast<int>(p)).bucket >= 0) all_active_ = false;
  }
  agreed_ = false;
  hyper_handle_ = comm_->AllReduce(hyper_buf_.data(), static_cast<int64_t>(hyper_buf_.size()),
                                   DType::kFloat32, ReduceOp::kMax);
  return absl::OkStatus();
}

void RankAgreement::ReadActive() {
  all_active_ = true;
  active_.assign(local_active_.size(), 0);
  for (size_t p = 0; p < local_active_.size(); ++p) {
    active_[p] = hyper_buf_[6 + p] > 0.5f ? 1 : 0;
    if (active_[p] == 0 && layout_->placement(static_cast<int>(p)).bucket >= 0) all_active_ = false;
  }
}

absl::Status RankAgreement::AgreeIfNeeded(int bucket, int64_t step,
                                          absl::FunctionRef<bool(int bucket)> owned_all_active) {
  if (agreed_) return absl::OkStatus();
  if (bucket >= 0 && (all_active_ || owned_all_active(bucket))) return absl::OkStatus();
  agreed_ = true;
  return Finish(step);
}

absl::Status RankAgreement::FinishIfPending(int64_t step) {
  if (agreed_) return absl::OkStatus();
  agreed_ = true;
  return Finish(step);
}

absl::Status RankAgreement::Finish(int64_t step) {
  if (hyper_handle_ == nullptr) return absl::OkStatus();
  CommHandlePtr handle = std::move(hyper_handle_);
  hyper_handle_ = nullptr;
  SHARDOPT_RETURN_IF_ERROR(waiter_->Wait(handle, "hyper-parameter agreement"));
  ReadActive();
  bool same = true;
  for (int i = 0; i < 3; ++i) same = same && hyper_buf_[i] == -hyper_buf_[i + 3];
  if (same) return absl::OkStatus();
  // Every rank saw the difference: rank 0's values go to all, each names its own.
  std::string theirs;
  SHARDOPT_RETURN_IF_ERROR(BroadcastText(hyper_text_, "hyper-parameter agreement", &theirs));
  std::string detail;
  SHARDOPT_ASSIGN_OR_RETURN(detail, ShareDetail(FirstDifference(theirs, hyper_text_, rank_),
                                                "hyper-parameter agreement"));
  if (detail.empty()) detail = "their hashes differ";
  return absl::FailedPreconditionError(absl::StrCat(
      "ranks disagree on hyper-parameters at step ", step, ": ", detail,
      ". Every rank must build the optimizer with the same values and change them (schedulers, "
      "param_groups edits) the same way at the same step"));
}

absl::Status RankAgreement::BroadcastLaunchOrder(std::vector<int32_t>* order) {
  const int nb = static_cast<int>(order->size());
  SHARDOPT_RETURN_IF_ERROR(
      waiter_->Wait(comm_->Broadcast(order->data(), nb * 4, DType::kByte, 0), "launch order"));
  std::vector<bool> seen(nb, false);
  for (int32_t b : *order) {
    if (b < 0 || b >= nb || seen[b]) {
      return absl::InternalError("rank 0's bucket launch order is not a permutation");
    }
    seen[b] = true;
  }
  return absl::OkStatus();
}

}  // namespace shardopt
