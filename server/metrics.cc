#include "server/metrics.h"

#include <cmath>
#include <exception>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"

namespace shardopt {

namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;
using Labels = std::vector<ClientMetric::Label>;

// Builds the families in a fixed order; a family with no samples is left out.
class Families {
 public:
  // Starts a family; Add() appends samples to the last one started.
  void Start(std::string name, std::string help, MetricType type) {
    MetricFamily f;
    f.name = std::move(name);
    f.help = std::move(help);
    f.type = type;
    families_.push_back(std::move(f));
  }
  void Add(double value, Labels labels = {}) {
    ClientMetric m;
    m.label = std::move(labels);
    switch (families_.back().type) {
      case MetricType::Counter: m.counter.value = value; break;
      case MetricType::Gauge: m.gauge.value = value; break;
      default: m.untyped.value = value; break;
    }
    families_.back().metric.push_back(std::move(m));
  }
  void AddHistogram(ClientMetric::Histogram h, Labels labels) {
    ClientMetric m;
    m.label = std::move(labels);
    m.histogram = std::move(h);
    families_.back().metric.push_back(std::move(m));
  }
  std::vector<MetricFamily> Take() {
    std::vector<MetricFamily> out;
    for (auto& f : families_) {
      if (!f.metric.empty()) out.push_back(std::move(f));
    }
    families_.clear();
    return out;
  }

 private:
  std::vector<MetricFamily> families_;
};

Labels RankLabel(int rank) { return {{"rank", absl::StrCat(rank)}}; }
Labels RankLabel(int rank, const char* name, const char* value) {
  return {{"rank", absl::StrCat(rank)}, {name, value}};
}

double UnixSeconds(absl::Time t) { return absl::ToDoubleSeconds(t - absl::UnixEpoch()); }

// The job.
void AddJob(const JobStatus& j, Families& f) {
  f.Start("shardopt_job_info", "The job this coordinator runs (value 1).", MetricType::Gauge);
  f.Add(1, {{"job_id", j.job_id}});
  f.Start("shardopt_job_state",
          "1 for the job's state (starting, running, failed, finished), 0 for the others.",
          MetricType::Gauge);
  for (JobState s :
       {JobState::kStarting, JobState::kRunning, JobState::kFailed, JobState::kFinished}) {
    f.Add(j.state == s ? 1 : 0, {{"state", JobStateName(s)}});
  }
  f.Start("shardopt_job_world_size", "Ranks in the job.", MetricType::Gauge);
  f.Add(j.world_size);
  f.Start("shardopt_job_step", "The job's step: the lowest step any joined rank reported.",
          MetricType::Gauge);
  f.Add(static_cast<double>(j.step));
  f.Start("shardopt_job_duration_seconds",
          "Seconds since the coordinator started (until the job failed or finished).",
          MetricType::Gauge);
  f.Add(absl::ToDoubleSeconds(j.duration()));
  f.Start("shardopt_job_aborts_total",
          "Job failures by cause: heartbeat_timeout (a rank went silent), rank_abort (a rank "
          "reported a failure), request (shardctl abort), rank_exit (a rank process exited or "
          "died), interrupted (shardrun got a signal).",
          MetricType::Counter);
  for (AbortCause c : AllAbortCauses()) {
    f.Add(j.state == JobState::kFailed && j.failure_cause == c ? 1 : 0,
          {{"cause", AbortCauseName(c)}});
  }
  f.Start("shardopt_job_slow_ranks", "Ranks the coordinator names slow now.", MetricType::Gauge);
  f.Add(static_cast<double>(j.slow_ranks.size()));
  f.Start("shardopt_job_restarts_total",
          "Times shardrun --max-restarts started this job again after a failure.",
          MetricType::Counter);
  f.Add(j.restarts);
  f.Start("shardopt_job_membership_epoch",
          "Membership epoch of the job: live resizes it went through (shardctl resize/drain).",
          MetricType::Gauge);
  f.Add(static_cast<double>(j.epoch));
  f.Start("shardopt_job_resize_seconds",
          "Time the last live resize took, from its request to the last rank's join of the "
          "new epoch (0: none yet).",
          MetricType::Gauge);
  f.Add(j.membership.empty() ? 0.0 : absl::ToDoubleSeconds(j.membership.back().took));
  f.Start("shardopt_job_resize_pending", "1 while a live resize is requested and not complete.",
          MetricType::Gauge);
  f.Add(j.resize ? 1 : 0);
}

// Checkpoints, as rank 0 reports them.
void AddCheckpoints(const JobStatus& j, Families& f) {
  const bool rank0_metrics = !j.ranks.empty() && j.ranks[0].has_metrics;
  f.Start("shardopt_checkpoints_total", "Checkpoints committed (rank 0's count since it started).",
          MetricType::Counter);
  if (rank0_metrics) f.Add(static_cast<double>(j.checkpoints_total));
  f.Start("shardopt_last_checkpoint_step", "Step of the last committed checkpoint (0: none).",
          MetricType::Gauge);
  if (rank0_metrics) f.Add(static_cast<double>(j.last_checkpoint_step));
  f.Start("shardopt_last_checkpoint_duration_seconds", "How long the last checkpoint took.",
          MetricType::Gauge);
  if (rank0_metrics) f.Add(j.last_checkpoint_seconds);
  f.Start("shardopt_last_checkpoint_bytes", "Size of the last checkpoint, all shards.",
          MetricType::Gauge);
  if (rank0_metrics) f.Add(static_cast<double>(j.last_checkpoint_bytes));
  f.Start("shardopt_last_checkpoint_timestamp_seconds",
          "Unix time at which the coordinator learned of the last checkpoint (absent: none yet).",
          MetricType::Gauge);
  if (rank0_metrics && j.last_checkpoint_time != absl::InfinitePast()) {
    f.Add(UnixSeconds(j.last_checkpoint_time));
  }
}

// The joined ranks, and those of them that reported step metrics.
struct RankSets {
  std::vector<const RankState*> joined, measured;
};

RankSets JoinedRanks(const JobStatus& j) {
  RankSets s;
  for (const RankState& r : j.ranks) {
    if (!r.joined) continue;
    s.joined.push_back(&r);
    if (r.has_metrics) s.measured.push_back(&r);
  }
  return s;
}

ClientMetric::Histogram StepSecondsHistogram(const RankState& r) {
  ClientMetric::Histogram h;
  h.sample_count = r.step_count;
  h.sample_sum = r.step_seconds_sum;
  uint64_t cumulative = 0;
  for (size_t b = 0; b < r.step_bucket_counts.size(); ++b) {
    cumulative += r.step_bucket_counts[b];
    h.bucket.push_back({cumulative, b < kStepSecondsBounds.size()
                                        ? kStepSecondsBounds[b]
                                        : std::numeric_limits<double>::infinity()});
  }
  return h;
}

// Per rank: training progress and the time a step takes.
void AddRankTraining(const RankSets& ranks, Families& f) {
  const std::vector<const RankState*>& joined = ranks.joined;
  const std::vector<const RankState*>& measured = ranks.measured;
  f.Start("shardopt_rank_step", "The rank's step (optimizer steps done).", MetricType::Gauge);
  for (const RankState* r : joined) f.Add(static_cast<double>(r->step), RankLabel(r->rank));
  f.Start("shardopt_rank_step_seconds", "Wall time of the rank's steps.", MetricType::Histogram);
  for (const RankState* r : measured) f.AddHistogram(StepSecondsHistogram(*r), RankLabel(r->rank));
  f.Start("shardopt_rank_samples_per_second", "The rank's training throughput.", MetricType::Gauge);
  for (const RankState* r : joined) f.Add(r->samples_per_s, RankLabel(r->rank));
  f.Start("shardopt_rank_loss", "The rank's last loss.", MetricType::Gauge);
  for (const RankState* r : joined) f.Add(r->loss, RankLabel(r->rank));
  f.Start("shardopt_rank_learning_rate",
          "The learning rate the rank trains with (0: not reported).", MetricType::Gauge);
  for (const RankState* r : joined) f.Add(r->learning_rate, RankLabel(r->rank));
  f.Start("shardopt_rank_grad_norm",
          "Global gradient norm of the rank's last step, before clipping.", MetricType::Gauge);
  for (const RankState* r : measured) f.Add(r->metrics.grad_norm, RankLabel(r->rank));
  f.Start("shardopt_rank_comm_wait_seconds",
          "Last step: time blocked on collectives (exposed communication).", MetricType::Gauge);
  for (const RankState* r : measured) f.Add(r->metrics.comm_wait_seconds, RankLabel(r->rank));
  f.Start("shardopt_rank_update_seconds", "Last step: time in the fused optimizer update.",
          MetricType::Gauge);
  for (const RankState* r : measured) f.Add(r->metrics.update_seconds, RankLabel(r->rank));
}

// Per rank: communication, memory, liveness and slowness.
void AddRankResources(const JobStatus& j, const RankSets& ranks, Families& f) {
  const std::vector<const RankState*>& joined = ranks.joined;
  const std::vector<const RankState*>& measured = ranks.measured;
  f.Start("shardopt_rank_sent_bytes_total", "Bytes the rank's communicator sent.",
          MetricType::Counter);
  for (const RankState* r : measured) {
    f.Add(static_cast<double>(r->metrics.bytes_sent_total), RankLabel(r->rank));
  }
  f.Start("shardopt_rank_memory_bytes",
          "Memory by role: master (fp32 master weights), state (optimizer state), gradients, "
          "parameters (flat buffers), rss (the process's resident set).",
          MetricType::Gauge);
  for (const RankState* r : measured) {
    const RankMetricsInfo& m = r->metrics;
    for (const auto& [role, bytes] : {std::pair<const char*, int64_t>{"master", m.master_bytes},
                                      {"state", m.state_bytes},
                                      {"gradients", m.grad_bytes},
                                      {"parameters", m.param_bytes},
                                      {"rss", m.rss_bytes}}) {
      f.Add(static_cast<double>(bytes), RankLabel(r->rank, "role", role));
    }
  }
  f.Start("shardopt_rank_heartbeat_age_seconds", "Seconds since the rank's last heartbeat.",
          MetricType::Gauge);
  for (const RankState* r : joined) {
    f.Add(absl::ToDoubleSeconds(j.now - r->last_heartbeat), RankLabel(r->rank));
  }
  f.Start("shardopt_rank_stalls_total", "Collective waits of the rank that timed out.",
          MetricType::Counter);
  for (const RankState* r : measured) {
    f.Add(static_cast<double>(r->metrics.stalls_total), RankLabel(r->rank));
  }
  f.Start("shardopt_rank_busy_seconds",
          "Median over the last slow-rank window of the rank's step time minus its time blocked "
          "on collectives: what slow-rank detection compares (absent: no data yet).",
          MetricType::Gauge);
  for (const RankState* r : joined) {
    if (r->busy_seconds_p50 > 0) f.Add(r->busy_seconds_p50, RankLabel(r->rank));
  }
  f.Start("shardopt_rank_slow",
          "1 when the coordinator names the rank slow (busy time over --slow-factor times the "
          "median of the others' for --slow-windows windows in a row).",
          MetricType::Gauge);
  for (const RankState* r : joined) f.Add(r->slow ? 1 : 0, RankLabel(r->rank));
}

std::vector<MetricFamily> Collect(const JobStatus& j) {
  Families f;
  AddJob(j, f);
  AddCheckpoints(j, f);
  // Per rank (joined ranks only). One family at a time, every rank in it.
  const RankSets ranks = JoinedRanks(j);
  AddRankTraining(ranks, f);
  AddRankResources(j, ranks, f);
  return f.Take();
}

// Collects on scrape.
class JobCollectable final : public prometheus::Collectable {
 public:
  explicit JobCollectable(Coordinator* coordinator) : coordinator_(coordinator) {}
  std::vector<MetricFamily> Collect() const override {
    return shardopt::Collect(coordinator_->GetJob());
  }

 private:
  Coordinator* const coordinator_;
};

}  // namespace

std::string RenderMetrics(const JobStatus& job) {
  return prometheus::TextSerializer().Serialize(Collect(job));
}

struct MetricsServer::Impl {
  std::shared_ptr<JobCollectable> collectable;
  std::unique_ptr<prometheus::Exposer> exposer;  // destroyed first (declared last)
};

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(Coordinator* coordinator,
                                                                    const std::string& host,
                                                                    int port) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics port ", port, " out of range"));
  }
  // civetweb's listening_ports syntax: "[::1]:P" for IPv6.
  const bool v6 = host.find(':') != std::string::npos;
  const std::string host_part = v6 && host.front() != '[' ? absl::StrCat("[", host, "]") : host;
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->impl_ = std::make_unique<Impl>();
  server->impl_->collectable = std::make_shared<JobCollectable>(coordinator);
  try {
    // civetweb serves one connection per worker thread: with 2, two idle or
    // half-sent connections (a scraper behind a slow proxy) blocked every
    // scrape for ~17 s. Enough workers for a crowd of idle connections, and
    // a request that does not arrive within 2 s frees its worker.
    server->impl_->exposer = std::make_unique<prometheus::Exposer>(std::vector<std::string>{
        "listening_ports", absl::StrCat(host_part, ":", port), "num_threads", "64",
        "request_timeout_ms", "2000", "keep_alive_timeout_ms", "500"});
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", host_part, ":", port, ": ", e.what()));
  }
  const std::vector<int> ports = server->impl_->exposer->GetListeningPorts();
  if (ports.empty() || ports.front() <= 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", host_part, ":", port, ": not listening"));
  }
  server->impl_->exposer->RegisterCollectable(server->impl_->collectable);
  server->port_ = ports.front();
  server->address_ = absl::StrCat(host_part, ":", server->port_);
  return server;
}

MetricsServer::~MetricsServer() {
  if (impl_) impl_->exposer.reset();  // stops civetweb; no scrape runs after this
}

}  // namespace shardopt
