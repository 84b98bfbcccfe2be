#include "client/comm/flight_record_proto.h"

namespace shardopt {

v1::FlightRecord ToFlightRecord(int rank, const std::vector<FlightEntry>& entries,
                                absl::Time captured, const std::string& reason) {
  v1::FlightRecord r;
  r.set_rank(rank);
  r.set_captured_unix(absl::ToDoubleSeconds(captured - absl::UnixEpoch()));
  r.set_reason(reason);
  r.mutable_records()->Reserve(static_cast<int>(entries.size()));
  for (const FlightEntry& e : entries) {
    v1::CollectiveRecord* c = r.add_records();
    c->set_seq(e.seq);
    c->set_op(CollectiveKindName(e.op));
    c->set_bucket(e.bucket);
    c->set_bytes(e.bytes);
    c->set_start_unix(e.start_unix_ns * 1e-9);
    c->set_end_unix(e.end_unix_ns * 1e-9);
    c->set_state(FlightStateName(e.state));
    c->set_step(e.step);
  }
  return r;
}

}  // namespace shardopt
