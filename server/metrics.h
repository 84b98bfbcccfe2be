// Prometheus metrics of a job, served over HTTP by shardrun's coordinator
// (shardrun --metrics-port). Nothing is recorded here: every scrape reads
// Coordinator::GetJob() (what the ranks' heartbeats reported, the step
// windows, the slow-rank verdicts) and turns it into metric families, so
// metrics cost nothing between scrapes. Uses Debian's prometheus-cpp (its
// pull Exposer, a civetweb server); only targets that serve metrics link it.
//
// Names (see docs/observability.md): per rank, label rank="N":
//   shardopt_rank_step, shardopt_rank_step_seconds (histogram),
//   shardopt_rank_samples_per_second, shardopt_rank_loss,
//   shardopt_rank_learning_rate, shardopt_rank_grad_norm,
//   shardopt_rank_comm_wait_seconds, shardopt_rank_update_seconds,
//   shardopt_rank_sent_bytes_total, shardopt_rank_memory_bytes{role},
//   shardopt_rank_heartbeat_age_seconds, shardopt_rank_stalls_total,
//   shardopt_rank_busy_seconds, shardopt_rank_slow;
// per job: shardopt_job_info{job_id}, shardopt_job_state{state},
//   shardopt_job_world_size, shardopt_job_step, shardopt_job_duration_seconds,
//   shardopt_job_aborts_total{cause}, shardopt_job_slow_ranks,
//   shardopt_checkpoints_total, shardopt_last_checkpoint_step,
//   shardopt_last_checkpoint_duration_seconds, shardopt_last_checkpoint_bytes,
//   shardopt_last_checkpoint_timestamp_seconds.
#ifndef SHARDOPT_SERVER_METRICS_H_
#define SHARDOPT_SERVER_METRICS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/coordinator.h"

namespace shardopt {

// The job's metrics in Prometheus' text exposition format (what a scrape of
// MetricsServer returns, less the exposer's own exposer_* metrics).
std::string RenderMetrics(const JobStatus& job);

// GET /metrics on host:port. Every scrape calls coordinator->GetJob().
class MetricsServer {
 public:
  // `host`: an IPv4 address or name ("127.0.0.1", "0.0.0.0"), or an IPv6
  // address; `port` 0: chosen by the OS. `coordinator` must outlive the
  // server. Unavailable (naming the address) when it cannot listen there.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(Coordinator* coordinator,
                                                              const std::string& host, int port);
  // Stops serving; waits for scrapes in progress.
  ~MetricsServer();
  int port() const { return port_; }
  // "host:port" as it listens (the port resolved).
  const std::string& address() const { return address_; }

  struct Impl;

 private:
  MetricsServer() = default;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
  std::string address_;
};

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_METRICS_H_
