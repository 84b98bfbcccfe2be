// A rank's flight-recorder ring (client/comm/flight_recorder.h) as the
// protocol carries it: what a rank sends the coordinator (ReportFlightRecord)
// and writes beside its checkpoints when the coordinator is gone. The
// coordinator's side (validation, analysis) is server/flight_records.h.
#ifndef SHARDOPT_CLIENT_COMM_FLIGHT_RECORD_PROTO_H_
#define SHARDOPT_CLIENT_COMM_FLIGHT_RECORD_PROTO_H_

#include <string>
#include <vector>

#include "absl/time/time.h"
#include "client/comm/flight_recorder.h"
#include "proto/shardopt.pb.h"

namespace shardopt {

// Times in seconds since the epoch. `reason` is kept as given: callers bound
// it by kMaxFlightReasonBytes (common/protocol_limits.h).
v1::FlightRecord ToFlightRecord(int rank, const std::vector<FlightEntry>& entries,
                                absl::Time captured, const std::string& reason);

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_COMM_FLIGHT_RECORD_PROTO_H_
