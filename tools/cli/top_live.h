// `shardctl top` in a terminal: a live view of a running job, refreshed
// every `interval` (the frame: tools/cli/top_view.h).
#ifndef SHARDOPT_TOOLS_CLI_TOP_LIVE_H_
#define SHARDOPT_TOOLS_CLI_TOP_LIVE_H_

#include <string>

#include "absl/time/time.h"
#include "client/coordinator_client.h"

namespace shardopt {

// Runs until q, a signal or an error, with the terminal restored on every way
// out. Returns the exit status: 0, 128 + signal, 2 (an error, printed).
// Needs a terminal on stdin and stdout.
int RunTopLive(CoordinatorClient* client, const std::string& address, absl::Duration interval);

}  // namespace shardopt

#endif  // SHARDOPT_TOOLS_CLI_TOP_LIVE_H_
