// The job's coordinator served from inside one rank's process. Under srun
// or a Kubernetes Indexed Job no shardrun starts the ranks, so rank 0's
// process serves the control plane (PlanRendezvous in
// client/launch_environment.h says who and where): the same Coordinator and
// CoordinatorService as shardrun's, on a port every rank knows in advance.
// Plain gRPC with the bearer token; for TLS run shardrun under srun
// (docs/slurm.md).
#ifndef SHARDOPT_SERVER_HOSTED_COORDINATOR_H_
#define SHARDOPT_SERVER_HOSTED_COORDINATOR_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/coordinator.h"
#include "server/coordinator_service.h"
#include "server/rpc_server.h"

namespace shardopt {

struct HostedCoordinatorOptions {
  std::string listen;      // host:port to listen on (0.0.0.0:PORT)
  std::string advertised;  // host:port the ranks dial (printed, returned by address())
  std::string job_id = "job";
  int world_size = 1;
  std::string token;  // required on every RPC when not empty
  absl::Duration heartbeat_timeout = absl::Seconds(10);
  // One line per event (a rank lost, slow, the job failed).
  std::function<void(const std::string&)> on_event;
};

class HostedCoordinator {
 public:
  // Listens on options.listen; Unavailable naming the port and SHARDOPT_PORT
  // when it is taken.
  static absl::StatusOr<std::unique_ptr<HostedCoordinator>> Start(HostedCoordinatorOptions options);
  ~HostedCoordinator();

  const std::string& address() const { return options_.advertised; }
  int port() const { return server_->port(); }
  Coordinator* coordinator() { return coordinator_.get(); }

  // Waits until every rank has finished or the job has failed (at once when
  // the job never started: this rank did not join), at most `timeout`: the hosting rank calls it
  // before it exits, so that the other ranks can still report their end to it. Returns the job's
  // state then.
  JobStatus AwaitEnd(absl::Duration timeout);
  // AwaitEnd, then, when the job failed, a moment for the other ranks to
  // hear the verdict through their sessions before the caller stops
  // serving: what the hosting rank does last (C++ trainer and Python alike).
  JobStatus Release(absl::Duration timeout);

 private:
  explicit HostedCoordinator(HostedCoordinatorOptions options) : options_(std::move(options)) {}
  HostedCoordinatorOptions options_;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<RpcServer> server_;
};

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_HOSTED_COORDINATOR_H_
