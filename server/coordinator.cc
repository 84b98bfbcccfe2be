#include "server/coordinator.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/planner.h"

namespace shardopt {

const char* JobStateName(JobState state) {
  switch (state) {
    case JobState::kStarting: return "starting";
    case JobState::kRunning: return "running";
    case JobState::kFailed: return "failed";
    case JobState::kFinished: return "finished";
  }
  return "unknown";
}

Coordinator::Coordinator(CoordinatorOptions options) : options_(std::move(options)) {
  ranks_.resize(std::max(0, options_.world_size));
  for (int r = 0; r < options_.world_size; ++r) ranks_[r].rank = r;
}

absl::Status Coordinator::ValidateJoin(const JoinInfo& info) const {
  if (info.job_id != options_.job_id) {
    return absl::InvalidArgumentError(absl::StrCat("job id '", info.job_id.substr(0, 64),
                                                   "' does not match this coordinator's job '",
                                                   options_.job_id, "'"));
  }
  if (info.world_size != options_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("world size ", info.world_size,
                                                   " does not match the job's ",
                                                   options_.world_size));
  }
  if (info.rank < 0 || info.rank >= options_.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", info.rank, " out of range [0, ", options_.world_size, ")"));
  }
  if (info.host.empty() || info.host.size() > 255) {
    return absl::InvalidArgumentError("host must be 1..255 bytes");
  }
  if (info.shard_owner_port < 1 || info.shard_owner_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard-owner port ", info.shard_owner_port, " out of range"));
  }
  if (info.params.empty() || info.params.size() > static_cast<size_t>(kMaxParams)) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter count ", info.params.size(), " out of range [1, ", kMaxParams, "]"));
  }
  for (const ParamSpec& p : info.params) {
    if (p.shape.size() > 16) {
      return absl::InvalidArgumentError(absl::StrCat("parameter '", p.name.substr(0, 64),
                                                     "' has more than 16 dimensions"));
    }
  }
  return absl::OkStatus();
}

namespace {

std::string Describe(const ParamSpec& p) {
  return absl::StrCat("'", p.name, "' [", absl::StrJoin(p.shape, ", "), "] ", DTypeName(p.dtype),
                      p.trainable ? "" : " frozen");
}

// The first difference between two models, or "" when equal.
std::string FirstDifference(const JoinInfo& a, const JoinInfo& b) {
  const size_t n = std::max(a.params.size(), b.params.size());
  for (size_t i = 0; i < n; ++i) {
    if (i >= a.params.size() || i >= b.params.size()) {
      return absl::StrCat("rank 0 has ", a.params.size(), " parameters, rank ", b.rank, " has ",
                          b.params.size());
    }
    const ParamSpec& x = a.params[i];
    const ParamSpec& y = b.params[i];
    if (x.name != y.name || x.shape != y.shape || x.dtype != y.dtype ||
        x.trainable != y.trainable) {
      return absl::StrCat("parameter #", i, " differs: rank 0 has ", Describe(x), ", rank ",
                          b.rank, " has ", Describe(y));
    }
  }
  if (a.plan.bucket_cap_elements != b.plan.bucket_cap_elements ||
      a.plan.alignment_elements != b.plan.alignment_elements ||
      a.plan.allow_cut != b.plan.allow_cut) {
    return "plan options (bucket cap, alignment, cutting) differ from rank 0's";
  }
  return "";
}

}  // namespace

absl::StatusOr<JoinResult> Coordinator::Join(const JoinInfo& info, absl::Duration wait) {
  if (absl::Status s = ValidateJoin(info); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (state_ == JobState::kFailed) return absl::AbortedError("job failed: " + failure_);
  RankState& rs = ranks_[info.rank];
  if (rs.joined) {
    return absl::AlreadyExistsError(absl::StrCat("rank ", info.rank, " has already joined"));
  }
  if (info.rank == 0) {
    auto layout = Plan(info.params, options_.world_size, info.plan);
    if (!layout.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot plan rank 0's model: ", layout.status().message()));
    }
    layout_ = std::make_shared<const Layout>(std::move(*layout));
    rank0_ = info;
  }
  // Waits use the real clock; the injectable one only ages heartbeats.
  const absl::Time deadline = absl::Now() + wait;
  auto have_rank0 = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return rank0_.has_value() || state_ == JobState::kFailed;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&have_rank0), deadline) || !rank0_) {
    if (state_ == JobState::kFailed) return absl::AbortedError("job failed: " + failure_);
    return absl::DeadlineExceededError("rank 0 did not join in time");
  }
  if (info.rank != 0) {
    const std::string diff = FirstDifference(*rank0_, info);
    if (!diff.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("layout mismatch, refusing rank ", info.rank, ": ", diff));
    }
  }
  if (info.layout_hash != layout_->hash()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layout hash mismatch: rank ", info.rank, " planned ", info.layout_hash,
        ", the coordinator planned ", layout_->hash(), " (different planner versions?)"));
  }
  rs.joined = true;
  rs.address = absl::StrCat(info.host, ":", info.shard_owner_port);
  rs.last_heartbeat = options_.now();
  if (++joined_ == options_.world_size && state_ == JobState::kStarting) {
    state_ = JobState::kRunning;
  }
  auto all_joined = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return joined_ == options_.world_size || state_ == JobState::kFailed;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&all_joined), deadline)) {
    std::vector<int> missing;
    for (const RankState& r : ranks_) {
      if (!r.joined) missing.push_back(r.rank);
    }
    return absl::DeadlineExceededError(
        absl::StrCat("ranks ", absl::StrJoin(missing, ", "), " did not join in time"));
  }
  if (state_ == JobState::kFailed) return absl::AbortedError("job failed: " + failure_);
  JoinResult out;
  out.layout_hash = layout_->hash();
  for (const RankState& r : ranks_) out.peers.push_back(r.address);
  return out;
}

absl::Status Coordinator::KvSet(const std::string& key, const std::string& value) {
  if (key.empty() || key.size() > kMaxKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("key must be 1..", kMaxKeyBytes, " bytes"));
  }
  if (value.size() > kMaxValueBytes) {
    return absl::InvalidArgumentError(absl::StrCat("value over ", kMaxValueBytes, " bytes"));
  }
  absl::MutexLock lock(&mu_);
  auto it = kv_.find(key);
  const size_t old = it == kv_.end() ? 0 : it->second.size() + key.size();
  if (kv_bytes_ - old + key.size() + value.size() > kMaxStoreBytes) {
    return absl::ResourceExhaustedError("rendezvous store is full");
  }
  kv_bytes_ = kv_bytes_ - old + key.size() + value.size();
  kv_[key] = value;
  return absl::OkStatus();
}

absl::StatusOr<std::string> Coordinator::KvGet(const std::string& key, absl::Duration wait) {
  if (key.empty() || key.size() > kMaxKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("key must be 1..", kMaxKeyBytes, " bytes"));
  }
  absl::MutexLock lock(&mu_);
  auto present = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return kv_.count(key) > 0 || state_ == JobState::kFailed;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&present), wait)) {
    return absl::DeadlineExceededError(absl::StrCat("key '", key, "' not set within ",
                                                    absl::FormatDuration(wait)));
  }
  if (kv_.count(key) == 0) return absl::AbortedError("job failed: " + failure_);
  return kv_[key];
}

absl::StatusOr<HeartbeatReply> Coordinator::Heartbeat(const HeartbeatInfo& info) {
  if (info.rank < 0 || info.rank >= options_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", info.rank, " out of range"));
  }
  if (info.step < 0 || !std::isfinite(info.samples_per_s)) {
    return absl::InvalidArgumentError("bad step or throughput");
  }
  absl::MutexLock lock(&mu_);
  RankState& r = ranks_[info.rank];
  if (!r.joined) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", info.rank, " has not joined"));
  }
  r.last_heartbeat = options_.now();
  r.step = info.step;
  r.loss = info.loss;
  r.samples_per_s = info.samples_per_s;
  r.progress = info.progress;
  return NoticeLocked();
}

bool Coordinator::CheckHeartbeats() {
  {
    absl::MutexLock lock(&mu_);
    if (state_ != JobState::kRunning) return false;
    const absl::Time now = options_.now();
    bool failed = false;
    for (const RankState& r : ranks_) {
      if (r.joined && !r.finished && now - r.last_heartbeat > options_.heartbeat_timeout) {
        FailLocked(absl::StrCat("rank ", r.rank, " sent no heartbeat for ",
                                absl::FormatDuration(now - r.last_heartbeat), " (last step ",
                                r.step, ")"));
        failed = true;
        break;
      }
    }
    if (!failed) return false;
  }
  Notify();
  return true;
}

HeartbeatReply Coordinator::Notice() {
  absl::MutexLock lock(&mu_);
  return NoticeLocked();
}

HeartbeatReply Coordinator::NoticeLocked() {
  HeartbeatReply reply;
  reply.abort = state_ == JobState::kFailed;
  reply.abort_reason = failure_;
  reply.learning_rate = learning_rate_;
  reply.hyper_params_version = hyper_version_;
  reply.checkpoint_request = checkpoint_request_;
  return reply;
}

void Coordinator::SetListener(std::function<void()> listener) {
  absl::MutexLock lock(&mu_);
  listener_ = std::move(listener);
}

void Coordinator::Notify() {
  std::function<void()> l;
  {
    absl::MutexLock lock(&mu_);
    l = listener_;
  }
  if (l) l();
}

void Coordinator::FailLocked(const std::string& reason) {
  if (state_ == JobState::kFailed) return;
  state_ = JobState::kFailed;
  failure_ = reason;
}

JobStatus Coordinator::GetJob() {
  absl::MutexLock lock(&mu_);
  JobStatus s;
  s.job_id = options_.job_id;
  s.state = state_;
  s.world_size = options_.world_size;
  s.ranks = ranks_;
  s.failure = failure_;
  s.layout_hash = layout_ ? layout_->hash() : 0;
  s.learning_rate = learning_rate_;
  s.now = options_.now();
  int64_t min_step = -1;
  for (const RankState& r : ranks_) {
    if (r.joined) min_step = min_step < 0 ? r.step : std::min(min_step, r.step);
  }
  s.step = std::max<int64_t>(0, min_step);
  return s;
}

absl::StatusOr<std::shared_ptr<const Layout>> Coordinator::GetLayout() {
  absl::MutexLock lock(&mu_);
  if (!layout_) return absl::FailedPreconditionError("no plan yet: rank 0 has not joined");
  return layout_;
}

std::vector<std::string> Coordinator::ShardOwnerAddresses() {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> out;
  for (const RankState& r : ranks_) out.push_back(r.joined ? r.address : "");
  return out;
}

absl::StatusOr<int64_t> Coordinator::SetLearningRate(double lr) {
  if (!(lr > 0) || !std::isfinite(lr)) {
    return absl::InvalidArgumentError(absl::StrCat("learning rate must be > 0, got ", lr));
  }
  int64_t version;
  {
    absl::MutexLock lock(&mu_);
    if (state_ == JobState::kFailed || state_ == JobState::kFinished) {
      return absl::FailedPreconditionError(
          absl::StrCat("the job is ", JobStateName(state_), "; nothing to change"));
    }
    learning_rate_ = lr;
    version = ++hyper_version_;
  }
  Notify();
  return version;
}

absl::StatusOr<int64_t> Coordinator::RequestCheckpoint() {
  int64_t request;
  {
    absl::MutexLock lock(&mu_);
    if (state_ != JobState::kRunning) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the job is ", JobStateName(state_), "; checkpoints are taken while it runs"));
    }
    request = ++checkpoint_request_;
  }
  Notify();
  return request;
}

void Coordinator::Abort(const std::string& reason, int rank) {
  {
    absl::MutexLock lock(&mu_);
    FailLocked(rank >= 0 ? absl::StrCat("rank ", rank, ": ", reason) : reason);
  }
  Notify();
}

absl::Status Coordinator::Finish(int rank) {
  if (rank < 0 || rank >= options_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " out of range"));
  }
  absl::MutexLock lock(&mu_);
  ranks_[rank].finished = true;
  if (state_ == JobState::kRunning &&
      std::all_of(ranks_.begin(), ranks_.end(), [](const RankState& r) { return r.finished; })) {
    state_ = JobState::kFinished;
  }
  return absl::OkStatus();
}

}  // namespace shardopt
