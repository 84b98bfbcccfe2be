// The coordinator's side of the flight recorder (client/comm/flight_recorder.h,
// sent as client/comm/flight_record_proto.h makes it):
// the rings ranks report when a job fails, validation of what they send, and
// the analysis that says in one or two lines where the ranks first stopped
// agreeing, e.g.
//
//   step 57: ranks 0, 2, 3 wait in all-gather of bucket 3 (seq 1141, for 40.2 s);
//   rank 1 never started it (last: reduce-scatter of bucket 3, seq 1139, finished 41.0 s ago)
//
// No gRPC here; coordinator_service.cc serves ReportFlightRecord and
// GetFlightRecords with it.
#ifndef SHARDOPT_SERVER_FLIGHT_RECORDS_H_
#define SHARDOPT_SERVER_FLIGHT_RECORDS_H_

#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/protocol_limits.h"
#include "proto/shardopt.pb.h"

namespace shardopt {

class Coordinator;

// Bounds on a reported ring (larger ones are refused): kMaxFlightRecords,
// kMaxFlightReasonBytes in common/protocol_limits.h.
// Ranks whose rings differ only by collectives younger than this (a live
// job's rings are taken milliseconds apart) are "making progress".
inline constexpr absl::Duration kFlightSettleTime = absl::Seconds(1);

// InvalidArgument naming the first bad field: rank outside [0, world_size),
// too many records, unknown op or state, negative sequence numbers, times
// that are not finite, an over-long reason or error.
absl::Status ValidateFlightRecord(const v1::FlightRecord& record, int world_size);

// Where the ranks' rings first disagree: the lowest sequence number that not
// every rank has finished, and what each rank did with it (waits in it,
// failed in it, finished it, never started it: then its last collective),
// prefixed by the step. One or two lines; "no divergence: ..." when every
// rank is at the same place, or all ranks are within kFlightSettleTime of
// each other (a live job making progress). `records`: at most one per rank; a rank without
// one, or whose record has `error` set, "sent no record (dead?)", followed by
// `notes[rank]` when given (e.g. its last heartbeat). Durations ("41.0 s
// ago") are relative to the latest captured_unix of the records.
std::string FirstDivergence(const std::vector<v1::FlightRecord>& records, int world_size,
                            const std::map<int, std::string>& notes = {});

// The rings the ranks reported (the latest per rank). Thread-safe.
class FlightRecords {
 public:
  // Validates and keeps `record` (replacing an earlier one of its rank).
  absl::Status Report(const v1::FlightRecord& record, int world_size);
  // By rank.
  std::vector<v1::FlightRecord> Reported() const;
  bool Has(int rank) const;
  bool empty() const;

 private:
  mutable absl::Mutex mu_;
  std::map<int, v1::FlightRecord> by_rank_ ABSL_GUARDED_BY(mu_);
};

// For ranks that have no ring: what the coordinator last heard from them
// ("last heartbeat 3.1 s ago, at step 11"), from coordinator.GetJob().
std::map<int, std::string> HeartbeatNotes(Coordinator& coordinator);

// FirstDivergence of the reported rings, with HeartbeatNotes for the ranks
// that sent none; "" when no rank reported a ring. What shardrun prints when
// a job fails.
std::string ReportedDivergence(const FlightRecords& records, Coordinator& coordinator);

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_FLIGHT_RECORDS_H_
