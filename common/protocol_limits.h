// Bounds on what a client may send the coordinator, shared by both sides: the
// coordinator refuses more, the ranks never send more.
#ifndef SHARDOPT_COMMON_PROTOCOL_LIMITS_H_
#define SHARDOPT_COMMON_PROTOCOL_LIMITS_H_

#include <cstddef>

namespace shardopt {

inline constexpr int kMaxParams = 1 << 20;
inline constexpr size_t kMaxKeyBytes = 512;
inline constexpr size_t kMaxValueBytes = 1 << 20;
inline constexpr size_t kMaxStoreBytes = 256 << 20;
// Step times a heartbeat may carry (RankMetrics in the protocol).
inline constexpr int kMaxStepTimesPerHeartbeat = 256;
// A reported flight-recorder ring: records, and bytes of its reason or error.
inline constexpr int kMaxFlightRecords = 65536;
inline constexpr size_t kMaxFlightReasonBytes = 4096;

}  // namespace shardopt

#endif  // SHARDOPT_COMMON_PROTOCOL_LIMITS_H_
