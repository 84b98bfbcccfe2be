// Element-wise reductions used by the collectives' implementations.
#ifndef SHARDOPT_CLIENT_REDUCE_OPS_H_
#define SHARDOPT_CLIENT_REDUCE_OPS_H_

#include <cstdint>

#include "client/comm/communicator.h"

namespace shardopt {

// dst[i] = dst[i] (+ or max) src[i]; kAverage adds (divide afterwards with
// Scale). bf16 is accumulated in fp32 and rounded to nearest even.
void ReduceInto(void* dst, const void* src, int64_t count, ElementType type, ReduceOp op);

// buffer[i] *= factor.
void Scale(void* buffer, int64_t count, ElementType type, float factor);

}  // namespace shardopt

#endif  // SHARDOPT_CLIENT_REDUCE_OPS_H_
