// Element-wise reductions used by the collectives' implementations.
#ifndef SHARDOPT_CLIENT_COMM_REDUCE_OPS_H_
#define SHARDOPT_CLIENT_COMM_REDUCE_OPS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"

#include "client/comm/communicator.h"

namespace shardopt {

// dst[i] = dst[i] (+ or max) src[i]; kAverage adds (divide afterwards with
// Scale). bf16 is accumulated in fp32 and rounded to nearest even.
void ReduceInto(void* dst, const void* src, int64_t count, DType type, ReduceOp op);

// buffer[i] *= factor.
void Scale(void* buffer, int64_t count, DType type, float factor);

// For ring implementations (Gloo, shared memory): one all-gather of chunks
// of `chunk_bytes` over `buffer` (world size chunks), or one reduce-scatter
// of world size chunks of `chunk_bytes` each at chunks[i].
using RingHalf = std::function<absl::Status(char* buffer, int64_t chunk_bytes)>;
using RingReduceHalf =
    std::function<absl::Status(const std::vector<char*>& chunks, int64_t chunk_bytes)>;

// The world_size chunk pointers of a buffer of adjacent chunks.
std::vector<char*> AdjacentChunks(void* buffer, int world_size, int64_t chunk_bytes);

// A reduce-scatter of `count` elements per rank through the ring's
// reduce-scatter, then this rank's chunk divided by N for kAverage.
absl::Status ReduceScatterFromHalf(const std::vector<char*>& chunks, int64_t count, DType type,
                                   ReduceOp op, int rank, int world_size,
                                   const RingReduceHalf& reduce_scatter);

// All-reduce as a reduce-scatter, this rank's chunk averaged for kAverage,
// and an all-gather: in place over the largest multiple of N elements (no
// copies); the < N elements left go through a small padded buffer, handed to
// *keep_on_failure if a half fails (a transport may still write into it).
absl::Status AllReduceFromHalves(void* buffer, int64_t count, DType type, ReduceOp op, int rank,
                                 int world_size, const RingReduceHalf& reduce_scatter,
                                 const RingHalf& all_gather,
                                 std::vector<std::unique_ptr<std::vector<char>>>* keep_on_failure);

// A barrier as the smallest reduce-scatter + all-gather (one float per rank);
// the halves are given fp32 sums.
absl::Status BarrierFromHalves(int world_size, const RingReduceHalf& reduce_scatter,
                               const RingHalf& all_gather,
                               std::vector<std::unique_ptr<std::vector<char>>>* keep_on_failure);

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_COMM_REDUCE_OPS_H_
