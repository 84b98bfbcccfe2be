#include "server/coordinator.h"

#include <algorithm>
#include <cmath>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "common/hyper_params.h"
#include "common/planner.h"

namespace shardopt {

namespace {

constexpr char kShuttingDown[] = "coordinator shutting down";

void Run(std::vector<std::function<void()>>* completions) {
  for (auto& f : *completions) f();
  completions->clear();
}

// Blocks on an asynchronous wait: ends it at `deadline` if nothing else has.
template <typename T, typename Start>
absl::StatusOr<T> Block(Coordinator* c, absl::Time deadline, Start start) {
  struct State {
    absl::Notification done;
    absl::StatusOr<T> result;
  };
  auto st = std::make_shared<State>();
  const Coordinator::WaitId id = start([st](absl::StatusOr<T> r) {
    st->result = std::move(r);
    st->done.Notify();
  });
  if (id != 0 && !st->done.WaitForNotificationWithDeadline(deadline)) {
    c->ExpireWaits(std::max(deadline, absl::Now()));
  }
  st->done.WaitForNotification();
  return std::move(st->result);
}

}  // namespace

const char* AbortCauseName(AbortCause cause) {
  switch (cause) {
    case AbortCause::kNone: return "none";
    case AbortCause::kHeartbeatTimeout: return "heartbeat_timeout";
    case AbortCause::kRankAbort: return "rank_abort";
    case AbortCause::kRequest: return "request";
    case AbortCause::kRankExit: return "rank_exit";
    case AbortCause::kInterrupted: return "interrupted";
  }
  return "unknown";
}

const std::vector<AbortCause>& AllAbortCauses() {
  static const std::vector<AbortCause> all = {AbortCause::kHeartbeatTimeout, AbortCause::kRankAbort,
                                              AbortCause::kRequest, AbortCause::kRankExit,
                                              AbortCause::kInterrupted};
  return all;
}

absl::Status ValidateRankMetrics(const RankMetricsInfo& m) {
  if (m.step_seconds.size() > static_cast<size_t>(kMaxStepTimesPerHeartbeat)) {
    return absl::InvalidArgumentError(absl::StrCat("metrics.step_seconds has ",
                                                   m.step_seconds.size(), " entries; at most ",
                                                   kMaxStepTimesPerHeartbeat, " per heartbeat"));
  }
  auto time = [](const char* name, double v) {
    return std::isfinite(v) && v >= 0 ? absl::OkStatus()
                                      : absl::InvalidArgumentError(absl::StrCat(
                                            "metrics.", name, " must be finite and >= 0, got ", v));
  };
  for (double v : m.step_seconds) {
    if (absl::Status s = time("step_seconds", v); !s.ok()) return s;
  }
  for (const auto& [name, v] :
       {std::pair<const char*, double>{"comm_wait_seconds", m.comm_wait_seconds},
        {"update_seconds", m.update_seconds},
        {"last_checkpoint_seconds", m.last_checkpoint_seconds}}) {
    if (absl::Status s = time(name, v); !s.ok()) return s;
  }
  for (const auto& [name, v] :
       {std::pair<const char*, int64_t>{"bytes_sent_total", m.bytes_sent_total},
        {"master_bytes", m.master_bytes},
        {"state_bytes", m.state_bytes},
        {"grad_bytes", m.grad_bytes},
        {"param_bytes", m.param_bytes},
        {"rss_bytes", m.rss_bytes},
        {"stalls_total", m.stalls_total},
        {"checkpoints_total", m.checkpoints_total},
        {"last_checkpoint_step", m.last_checkpoint_step},
        {"last_checkpoint_bytes", m.last_checkpoint_bytes}}) {
    if (v < 0)
      return absl::InvalidArgumentError(absl::StrCat("metrics.", name, " must be >= 0, got ", v));
  }
  return absl::OkStatus();
}

namespace {

// The median of v (sorted), 0 when empty.
double SortedMedian(const std::vector<double>& v) {
  if (v.empty()) return 0;
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

const char* JobStateName(JobState state) {
  switch (state) {
    case JobState::kStarting: return "starting";
    case JobState::kRunning: return "running";
    case JobState::kFailed: return "failed";
    case JobState::kFinished: return "finished";
  }
  return "unknown";
}

Coordinator::Coordinator(CoordinatorOptions options)
    : options_(std::move(options)),
      start_(options_.now()),
      slow_ranks_(SlowRankOptions{options_.slow_factor, options_.slow_windows, options_.slow_window,
                                  options_.slow_min_excess}),
      kv_(std::max(options_.max_kv_waiters, 2 * options_.world_size)) {
  world_ = options_.world_size;
  ranks_.resize(std::max(0, options_.world_size));
  windows_.resize(ranks_.size());
  slow_ranks_.Reset(static_cast<int>(ranks_.size()));
  for (int r = 0; r < options_.world_size; ++r) ranks_[r].rank = r;
  joining_.assign(ranks_.size(), 0);
}

Coordinator::~Coordinator() { Shutdown(); }

absl::Status Coordinator::ValidateJoin(const JoinInfo& info) const {
  if (info.job_id != options_.job_id) {
    return absl::InvalidArgumentError(absl::StrCat("job id '", info.job_id.substr(0, 64),
                                                   "' does not match this coordinator's job '",
                                                   options_.job_id, "'"));
  }
  if (info.host.empty() || info.host.size() > 255) {
    return absl::InvalidArgumentError("host must be 1..255 bytes");
  }
  if (info.shard_owner_port < 1 || info.shard_owner_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard-owner port ", info.shard_owner_port, " out of range"));
  }
  if (info.params.empty() || info.params.size() > static_cast<size_t>(kMaxParams)) {
    return absl::InvalidArgumentError(absl::StrCat("parameter count ", info.params.size(),
                                                   " out of range [1, ", kMaxParams, "]"));
  }
  // Reported, not applied: a valid learning rate (0: not reported).
  if (absl::Status s = ValidateHyperParameter(HyperParameter::kLearningRate, info.learning_rate);
      !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("reported learning rate: ", s.message()));
  }
  for (const ParamSpec& p : info.params) {
    if (p.shape.size() > 16) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", p.name.substr(0, 64), "' has more than 16 dimensions"));
    }
  }
  return absl::OkStatus();
}

absl::Status Coordinator::ValidateMembershipLocked(const JoinInfo& info) const {
  if (info.world_size != world_) {
    return absl::InvalidArgumentError(
        absl::StrCat("world size ", info.world_size, " does not match the job's ", world_,
                     epoch_ > 0 ? absl::StrCat(" (epoch ", epoch_, ")") : std::string()));
  }
  if (info.rank < 0 || info.rank >= world_) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", info.rank, " out of range [0, ", world_, ")"));
  }
  return absl::OkStatus();
}

std::string DescribeMembershipChange(const MembershipChange& c) {
  std::string who;
  auto list = [](const char* what, const std::vector<int>& ranks) {
    return absl::StrCat(ranks.size() == 1 ? "rank " : "ranks ", absl::StrJoin(ranks, ", "), " ",
                        what);
  };
  if (!c.left.empty()) who = list(c.lost ? "lost, recovered from replicas" : "left", c.left);
  if (!c.joined.empty()) absl::StrAppend(&who, who.empty() ? "" : ", ", list("joined", c.joined));
  return absl::StrCat("epoch ", c.epoch, " at step ", c.step, ": ", c.from_world, " -> ",
                      c.to_world, " ranks", who.empty() ? "" : absl::StrCat(" (", who, ")"), " in ",
                      absl::StrFormat("%.2fs", absl::ToDoubleSeconds(c.took)));
}

void Coordinator::BeginEpochLocked() {
  resize_->begun = true;
  epoch_ = resize_->epoch;
  world_ = resize_->to_world;
  epoch_step_ = 0;
  ranks_.assign(static_cast<size_t>(world_), RankState());
  for (int r = 0; r < world_; ++r) ranks_[r].rank = r;
  windows_.assign(ranks_.size(), RankWindow());
  slow_ranks_.Reset(world_);
  joining_.assign(ranks_.size(), 0);
  joined_ = 0;
  rank0_.reset();
  layout_.reset();
  all_elastic_ = true;
}

bool Coordinator::AnnounceResizeIfReadyLocked() {
  if (!resize_ || resize_->ready) return false;
  for (int r = resize_->from_world; r < resize_->to_world; ++r) {
    if (kv_.Find(ResizeReadyKey(resize_->epoch, r)) == nullptr) return false;
  }
  resize_->ready = true;
  last_resize_ = *resize_;
  return true;
}

absl::StatusOr<PendingResize> Coordinator::RequestResize(int to_world, std::vector<int> leave,
                                                         bool external) {
  PendingResize r;
  {
    absl::MutexLock lock(&mu_);
    if (state_ != JobState::kRunning) {
      return absl::FailedPreconditionError(
          absl::StrCat("the job is ", JobStateName(state_), "; it can be resized while it runs"));
    }
    if (resize_) {
      return absl::FailedPreconditionError(absl::StrCat("a resize to ", resize_->to_world,
                                                        " ranks (epoch ", resize_->epoch,
                                                        ") is still in progress"));
    }
    if (!all_elastic_) {
      return absl::FailedPreconditionError(
          "the job's trainer cannot resize live (shardopt_train can, and Python scripts whose "
          "ShardedOptimizer has elastic=True): restart it at the new size from a checkpoint "
          "instead");
    }
    if (to_world < 1 || to_world > kMaxWorldSize) {
      return absl::InvalidArgumentError(
          absl::StrCat("--ranks=", to_world, " out of range [1, ", kMaxWorldSize, "]"));
    }
    if (to_world == world_) {
      return absl::InvalidArgumentError(absl::StrCat("the job has ", world_, " ranks already"));
    }
    std::sort(leave.begin(), leave.end());
    if (std::adjacent_find(leave.begin(), leave.end()) != leave.end()) {
      return absl::InvalidArgumentError("a rank is named twice");
    }
    for (int l : leave) {
      if (l < 0 || l >= world_) {
        return absl::InvalidArgumentError(
            absl::StrCat("rank ", l, " out of range [0, ", world_, ")"));
      }
    }
    if (to_world > world_) {
      if (!leave.empty()) {
        return absl::InvalidArgumentError("a grow cannot let ranks leave: resize in two steps");
      }
      if (options_.max_grow_world <= 0 && !external) {
        return absl::FailedPreconditionError(
            "this job cannot grow by itself: no launcher of its can start ranks (a job started "
            "by shardrun on one node can); start the new ranks with shardrun --join=ADDR "
            "--nproc K on their node, or a larger job from a checkpoint");
      }
      if (!external && to_world > options_.max_grow_world) {
        return absl::FailedPreconditionError(absl::StrCat(
            "this job's shardrun starts at most ", options_.max_grow_world,
            " ranks on its node (shardrun --max-nproc; default: twice --nproc or the CPU count, "
            "whichever is more): ask for at most ",
            options_.max_grow_world,
            ", or add ranks on another node with shardrun --join=ADDR "
            "--nproc K"));
      }
    } else if (external) {
      return absl::InvalidArgumentError("only a grow can have ranks started by the caller");
    } else if (leave.empty()) {
      for (int l = to_world; l < world_; ++l) leave.push_back(l);
    } else if (static_cast<int>(leave.size()) != world_ - to_world) {
      return absl::InvalidArgumentError(absl::StrCat("going from ", world_, " to ", to_world,
                                                     " ranks, ", world_ - to_world, " must leave; ",
                                                     leave.size(), " named"));
    }
    r.request = ++resize_request_;
    last_requested_epoch_ = std::max(last_requested_epoch_, epoch_) + 1;
    r.epoch = last_requested_epoch_;
    r.external = external;
    r.from_world = world_;
    r.to_world = to_world;
    r.leave = std::move(leave);
    r.requested = options_.now();
    // A shrink is announced at once; a grow once its new ranks are ready.
    r.ready = r.to_world < r.from_world;
    resize_ = r;
    if (r.ready) last_resize_ = r;
  }
  Notify();
  return r;
}

absl::StatusOr<PendingResize> Coordinator::RecoverLoss(int64_t pid, const std::string& why) {
  PendingResize r;
  {
    absl::MutexLock lock(&mu_);
    if (state_ != JobState::kRunning) {
      return absl::FailedPreconditionError(absl::StrCat("the job is ", JobStateName(state_)));
    }
    int lost = -1;
    for (const RankState& rs : ranks_) {
      if (pid > 0 && rs.joined && rs.pid == pid) lost = rs.rank;
    }
    if (lost < 0) {
      return absl::NotFoundError(absl::StrCat("no rank of epoch ", epoch_, " has process ", pid));
    }
    if (resize_) {
      return absl::FailedPreconditionError(
          absl::StrCat("a resize to ", resize_->to_world, " ranks is in progress"));
    }
    if (!all_elastic_) return absl::FailedPreconditionError("the job cannot resize live");
    if (world_ < 2) return absl::FailedPreconditionError("it was the job's only rank");
    for (int q = 0; q < world_; ++q) {
      if (q != lost && kv_.Find(ReplicaReadyKey(epoch_, q)) == nullptr) {
        return absl::FailedPreconditionError(
            absl::StrCat("rank ", q, " holds no replica yet in epoch ", epoch_));
      }
    }
    r.request = ++resize_request_;
    last_requested_epoch_ = std::max(last_requested_epoch_, epoch_) + 1;
    r.epoch = last_requested_epoch_;
    r.from_world = world_;
    r.to_world = world_ - 1;
    r.leave = {lost};
    r.requested = options_.now();
    r.ready = true;
    r.recovery = true;
    resize_ = r;
    last_resize_ = r;
  }
  if (options_.on_event) {
    options_.on_event(absl::StrCat("rank ", r.leave[0], " was lost (", why, "); the other ",
                                   r.to_world, " ranks go on from their in-memory replicas (epoch ",
                                   r.epoch, ")"));
  }
  Notify();
  return r;
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
      return absl::StrCat("parameter #", i, " differs: rank 0 has ", Describe(x), ", rank ", b.rank,
                          " has ", Describe(y));
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
  // Waits use the real clock; the injectable one only ages heartbeats.
  const absl::Time deadline = absl::Now() + wait;
  return Block<JoinResult>(this, deadline, [&](JoinCallback done) {
    return JoinAsync(info, deadline, std::move(done));
  });
}

Coordinator::WaitId Coordinator::JoinAsync(JoinInfo info, absl::Time deadline, JoinCallback done) {
  if (absl::Status s = ValidateJoin(info); !s.ok()) {
    done(s);
    return 0;
  }
  Completions ready;
  WaitId id = 0;
  {
    absl::MutexLock lock(&mu_);
    const int rank = info.rank;
    absl::Status refused;
    if (!shutting_down_ && state_ != JobState::kFailed && info.epoch != epoch_) {
      if (resize_ && !resize_->begun && info.epoch == resize_->epoch) {
        BeginEpochLocked();
      } else {
        refused = absl::FailedPreconditionError(absl::StrCat(
            "rank ", rank, " joins epoch ", info.epoch, ", but the job is in epoch ", epoch_,
            resize_ ? absl::StrCat(" (moving to ", resize_->epoch, ")") : std::string()));
      }
    }
    if (refused.ok()) refused = ValidateMembershipLocked(info);
    if (!refused.ok()) {
    } else if (shutting_down_) {
      refused = absl::UnavailableError(kShuttingDown);
    } else if (state_ == JobState::kFailed) {
      refused = absl::AbortedError("job failed: " + failure_);
    } else if (ranks_[rank].joined) {
      refused = absl::AlreadyExistsError(absl::StrCat("rank ", rank, " has already joined"));
    } else if (joining_[rank] != 0) {
      refused = absl::AlreadyExistsError(
          absl::StrCat("rank ", rank, " is already joining (another Join for it is waiting)"));
    } else if (rank == 0) {
      auto layout = Plan(info.params, world_, info.plan);
      if (!layout.ok()) {
        refused = absl::InvalidArgumentError(
            absl::StrCat("cannot plan rank 0's model: ", layout.status().message()));
      } else {
        layout_ = std::make_shared<const Layout>(std::move(*layout));
        rank0_ = info;
      }
    }
    if (!refused.ok()) {
      ready.push_back([done = std::move(done), refused] { done(refused); });
    } else {
      id = next_wait_id_++;
      JoinWait& w = join_waits_[id];
      w.rank = rank;
      w.deadline = deadline;
      w.info = std::make_unique<JoinInfo>(std::move(info));
      w.done = std::move(done);
      joining_[rank] = id;
      AdvanceJoinsLocked(&ready);
      auto it = join_waits_.find(id);
      if (it == join_waits_.end()) {
        id = 0;  // answered already
      } else if (deadline <= absl::Now()) {
        const absl::Status timeout = JoinTimeoutLocked(it->second);
        JoinWait expired = TakeJoinLocked(it);
        ready.push_back([f = std::move(expired.done), timeout] { f(timeout); });
        id = 0;
      }
    }
  }
  Run(&ready);
  return id;
}

absl::Status Coordinator::AdmitLocked(const JoinInfo& info) {
  RankState& rs = ranks_[info.rank];
  if (rs.joined) {
    return absl::AlreadyExistsError(absl::StrCat("rank ", info.rank, " has already joined"));
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
  if (info.learning_rate > 0) rs.learning_rate = info.learning_rate;
  rs.step = info.step;
  rs.pid = info.pid;
  all_elastic_ = all_elastic_ && info.elastic;
  epoch_step_ = std::max(epoch_step_, info.step);
  if (joined_ + 1 == world_ && resize_ && resize_->begun) {
    // The resize is complete: every rank of the new epoch has joined.
    const absl::Time now = options_.now();
    MembershipChange c;
    c.epoch = epoch_;
    c.from_world = resize_->from_world;
    c.to_world = world_;
    c.step = epoch_step_;
    c.left = resize_->leave;
    c.lost = resize_->recovery;
    for (int r = world_ - (resize_->to_world -
                           (resize_->from_world - static_cast<int>(resize_->leave.size())));
         r < world_; ++r) {
      c.joined.push_back(r);
    }
    c.took = now - resize_->requested;
    c.completed = now;
    membership_.push_back(c);
    resize_.reset();
    for (RankState& r : ranks_) r.last_heartbeat = now;
    slow_window_start_ = now;
  }
  if (++joined_ == world_ && state_ == JobState::kStarting) {
    state_ = JobState::kRunning;
    // Every rank's heartbeat clock starts when the job does: a rank that
    // joined early waited for the others and could not yet have a session,
    // so the time the whole job took to join must not count against it.
    const absl::Time now = options_.now();
    for (RankState& r : ranks_) r.last_heartbeat = now;
    slow_window_start_ = now;
  }
  return absl::OkStatus();
}

void Coordinator::AdvanceJoinsLocked(Completions* out) {
  if (!rank0_) return;
  for (auto it = join_waits_.begin(); it != join_waits_.end();) {
    auto next = std::next(it);
    JoinWait& w = it->second;
    if (w.info) {
      absl::Status s = AdmitLocked(*w.info);
      if (!s.ok()) {
        JoinWait refused = TakeJoinLocked(it);
        out->push_back([f = std::move(refused.done), s] { f(s); });
      } else {
        w.info.reset();  // admitted: now waits for every rank
      }
    }
    it = next;
  }
  if (joined_ != world_) return;
  const JoinResult result = JoinResultLocked();
  while (!join_waits_.empty()) {
    JoinWait w = TakeJoinLocked(join_waits_.begin());
    out->push_back([f = std::move(w.done), result] { f(result); });
  }
}

JoinResult Coordinator::JoinResultLocked() {
  JoinResult out;
  out.layout_hash = layout_->hash();
  for (const RankState& r : ranks_) out.peers.push_back(r.address);
  return out;
}

absl::Status Coordinator::JoinTimeoutLocked(const JoinWait& w) {
  if (w.info) return absl::DeadlineExceededError("rank 0 did not join in time");
  std::vector<int> missing;
  for (const RankState& r : ranks_) {
    if (!r.joined) missing.push_back(r.rank);
  }
  return absl::DeadlineExceededError(
      absl::StrCat("ranks ", absl::StrJoin(missing, ", "), " did not join in time"));
}

Coordinator::JoinWait Coordinator::TakeJoinLocked(std::map<WaitId, JoinWait>::iterator it) {
  JoinWait w = std::move(it->second);
  if (joining_[w.rank] == it->first) joining_[w.rank] = 0;
  join_waits_.erase(it);
  return w;
}

absl::Status Coordinator::KvSet(const std::string& key, const std::string& value) {
  if (key.empty() || key.size() > kMaxKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("key must be 1..", kMaxKeyBytes, " bytes"));
  }
  if (value.size() > kMaxValueBytes) {
    return absl::InvalidArgumentError(absl::StrCat("value over ", kMaxValueBytes, " bytes"));
  }
  std::vector<KvWaits::Wait> settled;  // whoever waits for this key
  bool announce = false;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<std::vector<KvWaits::Wait>> set = kv_.Set(key, value);
    if (!set.ok()) return set.status();
    settled = std::move(*set);
    announce = AnnounceResizeIfReadyLocked();
  }
  for (KvWaits::Wait& w : settled) w.done(value);
  if (announce) Notify();
  return absl::OkStatus();
}

absl::StatusOr<std::string> Coordinator::KvGet(const std::string& key, absl::Duration wait) {
  const absl::Time deadline = absl::Now() + wait;
  return Block<std::string>(
      this, deadline, [&](KvCallback done) { return KvGetAsync(key, deadline, std::move(done)); });
}

Coordinator::WaitId Coordinator::KvGetAsync(const std::string& key, absl::Time deadline,
                                            KvCallback done) {
  if (key.empty() || key.size() > kMaxKeyBytes) {
    done(absl::InvalidArgumentError(absl::StrCat("key must be 1..", kMaxKeyBytes, " bytes")));
    return 0;
  }
  absl::StatusOr<std::string> now;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time t = absl::Now();
    if (const std::string* value = kv_.Find(key)) {
      now = *value;
    } else if (state_ == JobState::kFailed) {
      now = absl::AbortedError("job failed: " + failure_);
    } else if (shutting_down_) {
      now = absl::UnavailableError(kShuttingDown);
    } else if (absl::Status s = kv_.AddWait(next_wait_id_, key, deadline, t, &done); !s.ok()) {
      now = std::move(s);  // too late, or too many waiting: `done` is still ours
    } else {
      return next_wait_id_++;
    }
  }
  done(std::move(now));
  return 0;
}

bool Coordinator::CancelWait(WaitId id) {
  // The callback is destroyed outside the lock.
  std::optional<KvWaits::Wait> kv;
  JoinWait join;
  absl::MutexLock lock(&mu_);
  kv = kv_.Take(id);
  if (kv) return true;
  if (auto it = join_waits_.find(id); it != join_waits_.end()) {
    join = TakeJoinLocked(it);
    return true;
  }
  return false;
}

int Coordinator::ExpireWaits(absl::Time now) {
  Completions ready;
  {
    absl::MutexLock lock(&mu_);
    for (KvWaits::Wait& w : kv_.TakeExpired(now)) {
      ready.push_back([f = std::move(w.done), s = w.TimeoutError()] { f(s); });
    }
    for (auto it = join_waits_.begin(); it != join_waits_.end();) {
      auto next = std::next(it);
      if (it->second.deadline <= now) {
        const absl::Status s = JoinTimeoutLocked(it->second);
        JoinWait w = TakeJoinLocked(it);
        ready.push_back([f = std::move(w.done), s] { f(s); });
      }
      it = next;
    }
  }
  const int n = static_cast<int>(ready.size());
  Run(&ready);
  return n;
}

void Coordinator::EndAllWaitsLocked(const absl::Status& status, Completions* out) {
  for (KvWaits::Wait& w : kv_.TakeAll()) {
    out->push_back([f = std::move(w.done), status] { f(status); });
  }
  while (!join_waits_.empty()) {
    JoinWait w = TakeJoinLocked(join_waits_.begin());
    out->push_back([f = std::move(w.done), status] { f(status); });
  }
}

void Coordinator::Shutdown() {
  Completions ready;
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return;
    shutting_down_ = true;
    EndAllWaitsLocked(absl::UnavailableError(kShuttingDown), &ready);
  }
  Run(&ready);
}

int Coordinator::pending_waits() {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(kv_.size() + join_waits_.size());
}

namespace {

// What Heartbeat() refuses before it takes the lock: a rank outside the
// world, a bad step, throughput or learning rate, bad metrics.
absl::Status ValidateHeartbeat(const HeartbeatInfo& info) {
  if (info.rank < 0 || info.rank >= kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", info.rank, " out of range"));
  }
  if (info.step < 0 || !std::isfinite(info.samples_per_s)) {
    return absl::InvalidArgumentError("bad step or throughput");
  }
  // Reported, not applied: a valid learning rate (0: not reported).
  if (absl::Status s = ValidateHyperParameter(HyperParameter::kLearningRate, info.learning_rate);
      !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("reported learning rate: ", s.message()));
  }
  if (info.has_metrics) {
    if (absl::Status s = ValidateRankMetrics(info.metrics); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<HeartbeatReply> Coordinator::Heartbeat(const HeartbeatInfo& info) {
  if (absl::Status s = ValidateHeartbeat(info); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  // A rank still in the epoch a resize leaves (or not yet in the new one):
  // told the notice, not recorded.
  if (info.epoch != epoch_) return NoticeLocked();
  if (info.rank >= world_) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", info.rank, " out of range"));
  }
  RankState& r = ranks_[info.rank];
  if (!r.joined) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", info.rank, " has not joined"));
  }
  const absl::Time now = options_.now();
  r.last_heartbeat = now;
  r.session_lost = absl::InfiniteFuture();
  r.step = info.step;
  r.loss = info.loss;
  r.samples_per_s = info.samples_per_s;
  r.progress = info.progress;
  if (info.learning_rate > 0) r.learning_rate = info.learning_rate;
  if (info.has_metrics) RecordMetricsLocked(info.rank, info.metrics, now);
  return NoticeLocked();
}

void Coordinator::RecordMetricsLocked(int rank, const RankMetricsInfo& m, absl::Time now) {
  RankState& r = ranks_[rank];
  // Everything but the step times, which go to the window and histogram.
  const int64_t checkpoints_before = r.metrics.checkpoints_total;
  r.has_metrics = true;
  r.metrics.grad_norm = m.grad_norm;
  r.metrics.comm_wait_seconds = m.comm_wait_seconds;
  r.metrics.update_seconds = m.update_seconds;
  r.metrics.bytes_sent_total = m.bytes_sent_total;
  r.metrics.master_bytes = m.master_bytes;
  r.metrics.state_bytes = m.state_bytes;
  r.metrics.grad_bytes = m.grad_bytes;
  r.metrics.param_bytes = m.param_bytes;
  r.metrics.rss_bytes = m.rss_bytes;
  r.metrics.stalls_total = m.stalls_total;
  r.metrics.checkpoints_total = m.checkpoints_total;
  r.metrics.last_checkpoint_step = m.last_checkpoint_step;
  r.metrics.last_checkpoint_seconds = m.last_checkpoint_seconds;
  r.metrics.last_checkpoint_bytes = m.last_checkpoint_bytes;
  if (rank == 0 && m.checkpoints_total > checkpoints_before) last_checkpoint_time_ = now;
  if (!m.step_seconds.empty()) {
    RankWindow& w = windows_[rank];
    for (double t : m.step_seconds) {
      const size_t b = std::lower_bound(kStepSecondsBounds.begin(), kStepSecondsBounds.end(), t) -
                       kStepSecondsBounds.begin();
      ++r.step_bucket_counts[b];
      ++r.step_count;
      r.step_seconds_sum += t;
      w.steps.emplace_back(now, t);
    }
    while (w.steps.size() > static_cast<size_t>(kStepWindowSteps)) w.steps.pop_front();
    w.dirty = true;
    // One busy sample per heartbeat (server/slow_ranks.h).
    slow_ranks_.AddBusy(rank, m.step_seconds.back(), m.comm_wait_seconds);
  }
}

void Coordinator::RefreshStepWindowLocked(int rank, absl::Time now) {
  RankWindow& w = windows_[rank];
  while (!w.steps.empty() && now - w.steps.front().first > kStepWindowAge) {
    w.steps.pop_front();
    w.dirty = true;
  }
  if (!w.dirty) return;
  w.dirty = false;
  RankState& r = ranks_[rank];
  std::vector<double> v;
  v.reserve(w.steps.size());
  for (const auto& s : w.steps) v.push_back(s.second);
  std::sort(v.begin(), v.end());
  r.step_seconds_p50 = SortedMedian(v);
  r.step_seconds_max = v.empty() ? 0 : v.back();
}

int Coordinator::CheckSlowRanks() {
  std::vector<std::string> events;
  {
    absl::MutexLock lock(&mu_);
    if (state_ != JobState::kRunning) return 0;
    const absl::Time now = options_.now();
    if (now - slow_window_start_ < options_.slow_window) return 0;
    slow_window_start_ = now;
    std::vector<bool> eligible(ranks_.size());
    for (size_t r = 0; r < ranks_.size(); ++r) {
      eligible[r] = ranks_[r].joined && !ranks_[r].finished;
    }
    for (const SlowRankDetector::Verdict& v : slow_ranks_.EndWindow(eligible)) {
      RankState& rs = ranks_[v.rank];
      rs.busy_seconds_p50 = v.busy_p50;
      rs.busy_ratio = v.ratio;
      if (!v.changed) continue;
      rs.slow = v.slow;
      rs.slow_reason = v.reason;
      events.push_back(v.event);
    }
  }
  if (options_.on_event) {
    for (const std::string& e : events) options_.on_event(e);
  }
  return static_cast<int>(events.size());
}

void Coordinator::SessionLost(int rank) {
  if (options_.session_loss_grace <= absl::ZeroDuration()) return;
  absl::MutexLock lock(&mu_);
  // (A resize under way ends sessions on purpose.)
  if (rank < 0 || rank >= world_ || (resize_ && resize_->ready)) return;
  RankState& r = ranks_[rank];
  if (r.joined && !r.finished) r.session_lost = options_.now();
}

bool Coordinator::CheckHeartbeats() {
  Completions ready;
  std::string cancelled;
  bool failed = false;
  {
    absl::MutexLock lock(&mu_);
    if (state_ != JobState::kRunning) return false;
    const absl::Time now = options_.now();
    if (resize_) {
      // The ranks are moving to the new epoch: no heartbeats meanwhile (a
      // rank that dies is seen by its launcher or by its peers' collectives),
      // but the move is bounded.
      if (now - resize_->requested <= options_.resize_timeout) {
        if (resize_->ready) return false;  // (before: the ranks train and heartbeat on)
      } else if (!resize_->ready) {
        // The ranks were never told: the job trains on at its size.
        cancelled =
            absl::StrCat("the grow to ", resize_->to_world, " ranks (epoch ", resize_->epoch,
                         ") is cancelled: its new ranks were not all ready "
                         "within ",
                         absl::FormatDuration(options_.resize_timeout), "; the job goes on with ",
                         world_, " ranks");
        resize_.reset();
      } else {
        std::vector<int> missing;
        for (const RankState& r : ranks_) {
          if (!r.joined) missing.push_back(r.rank);
        }
        std::string why = ": the ranks did not start it";
        if (resize_->begun) {
          why = absl::StrCat(": ranks ", absl::StrJoin(missing, ", "), " of epoch ", epoch_,
                             " did not join");
        }
        FailLocked(absl::StrCat("the resize to ", resize_->to_world, " ranks did not complete in ",
                                absl::FormatDuration(options_.resize_timeout), why),
                   AbortCause::kHeartbeatTimeout, &ready);
        failed = true;
      }
    }
    for (const RankState& r : ranks_) {
      if (failed) break;
      if (r.joined && !r.finished && now - r.session_lost > options_.session_loss_grace) {
        FailLocked(absl::StrCat("rank ", r.rank, " lost its connection to the coordinator at step ",
                                r.step, " without finishing (on host ",
                                r.address.substr(0, r.address.rfind(':')),
                                "): its process ended or its node went down"),
                   AbortCause::kHeartbeatTimeout, &ready);
        failed = true;
        break;
      }
      if (r.joined && !r.finished && now - r.last_heartbeat > options_.heartbeat_timeout) {
        FailLocked(
            absl::StrCat("rank ", r.rank, " sent no heartbeat for ",
                         absl::FormatDuration(now - r.last_heartbeat), " (last step ", r.step,
                         "; on host ", r.address.substr(0, r.address.rfind(':')), ")"),
            AbortCause::kHeartbeatTimeout, &ready);
        failed = true;
        break;
      }
    }
    if (!failed && cancelled.empty()) return false;
  }
  if (!cancelled.empty() && options_.on_event) options_.on_event(cancelled);
  Run(&ready);
  Notify();
  return failed;
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
  reply.resize_request = last_resize_.request;
  reply.resize_epoch = last_resize_.epoch;
  reply.resize_world = last_resize_.to_world;
  reply.resize_leave = last_resize_.leave;
  reply.resize_recovery = last_resize_.recovery;
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

void Coordinator::FailLocked(const std::string& reason, AbortCause cause, Completions* out) {
  if (state_ == JobState::kFailed) return;
  state_ = JobState::kFailed;
  failure_ = reason;
  failure_cause_ = cause;
  if (end_ == absl::InfiniteFuture()) end_ = options_.now();
  EndAllWaitsLocked(absl::AbortedError("job failed: " + failure_), out);
}

JobStatus Coordinator::GetJob() {
  absl::MutexLock lock(&mu_);
  JobStatus s;
  s.now = options_.now();
  for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) RefreshStepWindowLocked(r, s.now);
  s.job_id = options_.job_id;
  s.state = state_;
  s.world_size = world_;
  s.epoch = epoch_;
  s.membership = membership_;
  s.resize = resize_;
  s.ranks = ranks_;
  s.start = start_;
  s.end = end_;
  s.failure_cause = failure_cause_;
  s.restarts = options_.restarts;
  s.last_restart = options_.last_restart;
  for (const RankState& r : ranks_) {
    if (r.slow) s.slow_ranks.push_back(r.rank);
  }
  if (!ranks_.empty() && ranks_[0].has_metrics) {
    const RankMetricsInfo& m = ranks_[0].metrics;
    s.checkpoints_total = m.checkpoints_total;
    s.last_checkpoint_step = m.last_checkpoint_step;
    s.last_checkpoint_seconds = m.last_checkpoint_seconds;
    s.last_checkpoint_bytes = m.last_checkpoint_bytes;
    s.last_checkpoint_time = last_checkpoint_time_;
  }
  s.failure = failure_;
  s.layout_hash = layout_ ? layout_->hash() : 0;
  s.requested_learning_rate = learning_rate_;
  s.learning_rate = learning_rate_;
  for (const RankState& r : ranks_) {
    if (r.joined && r.learning_rate > 0) {
      s.learning_rate = r.learning_rate;
      break;
    }
  }
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
  if (absl::Status s = ValidateLearningRateChange(lr); !s.ok()) return s;
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
      return absl::FailedPreconditionError(absl::StrCat("the job is ", JobStateName(state_),
                                                        "; checkpoints are taken while it runs"));
    }
    request = ++checkpoint_request_;
  }
  Notify();
  return request;
}

void Coordinator::Abort(const std::string& reason, int rank) {
  Abort(reason, rank, rank >= 0 ? AbortCause::kRankAbort : AbortCause::kRequest);
}

void Coordinator::Abort(const std::string& reason, int rank, AbortCause cause) {
  Completions ready;
  {
    absl::MutexLock lock(&mu_);
    FailLocked(rank >= 0 ? absl::StrCat("rank ", rank, ": ", reason) : reason, cause, &ready);
  }
  Run(&ready);
  Notify();
}

absl::Status Coordinator::Finish(int rank) {
  absl::MutexLock lock(&mu_);
  if (rank < 0 || rank >= world_) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " out of range"));
  }
  ranks_[rank].finished = true;
  if (state_ == JobState::kRunning &&
      std::all_of(ranks_.begin(), ranks_.end(), [](const RankState& r) { return r.finished; })) {
    state_ = JobState::kFinished;
    end_ = options_.now();
  }
  return absl::OkStatus();
}

}  // namespace shardopt
