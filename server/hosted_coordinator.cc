#include "server/hosted_coordinator.h"

#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardopt {

absl::StatusOr<std::unique_ptr<HostedCoordinator>> HostedCoordinator::Start(
    HostedCoordinatorOptions options) {
  if (options.world_size < 1) {
    return absl::InvalidArgumentError("the hosted coordinator needs a world size of at least 1");
  }
  std::unique_ptr<HostedCoordinator> h(new HostedCoordinator(std::move(options)));
  const HostedCoordinatorOptions& o = h->options_;
  CoordinatorOptions copt;
  copt.job_id = o.job_id;
  copt.world_size = o.world_size;
  copt.heartbeat_timeout = o.heartbeat_timeout;
  copt.on_event = o.on_event;
  // No launcher watches the ranks' processes here: a rank whose session
  // breaks without its Finish is named at once, not a heartbeat timeout later.
  copt.session_loss_grace = std::min(absl::Seconds(2), o.heartbeat_timeout);
  h->coordinator_ = std::make_unique<Coordinator>(copt);
  h->service_ = std::make_unique<CoordinatorService>(h->coordinator_.get(), o.token);
  RpcServerOptions sopt;
  sopt.address = o.listen;
  auto server = RpcServer::Start(sopt, {h->service_.get()});
  if (!server.ok()) {
    return absl::Status(
        server.status().code(),
        absl::StrCat("cannot serve the job's coordinator on ", o.listen, ": ",
                     server.status().message(),
                     "; every rank must use the same free port: set SHARDOPT_PORT for all of "
                     "them"));
  }
  h->server_ = *std::move(server);
  return h;
}

JobStatus HostedCoordinator::AwaitEnd(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    JobStatus j = coordinator_->GetJob();
    // kStarting: this rank never joined (it failed before, or made no
    // optimizer), so the job cannot start; nobody is left to wait for.
    if (j.state != JobState::kRunning || absl::Now() >= deadline) {
      return j;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

JobStatus HostedCoordinator::Release(absl::Duration timeout) {
  JobStatus j = AwaitEnd(timeout);
  if (j.state == JobState::kFailed) std::this_thread::sleep_for(std::chrono::seconds(2));
  return j;
}

HostedCoordinator::~HostedCoordinator() {
  if (server_) server_->Shutdown();
}

}  // namespace shardopt
