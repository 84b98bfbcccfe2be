#include "client/comm/reduce_ops.h"

#include <algorithm>

#include "server/kernels/update_slice.h"

namespace shardopt {

void ReduceInto(void* dst, const void* src, int64_t count, ElementType type, ReduceOp op) {
  const bool max = op == ReduceOp::kMax;
  if (type == ElementType::kFloat32) {
    float* __restrict d = static_cast<float*>(dst);
    const float* __restrict s = static_cast<const float*>(src);
    if (max) {
      for (int64_t i = 0; i < count; ++i) d[i] = std::max(d[i], s[i]);
    } else {
      for (int64_t i = 0; i < count; ++i) d[i] += s[i];
    }
    return;
  }
  uint16_t* __restrict d = static_cast<uint16_t*>(dst);
  const uint16_t* __restrict s = static_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < count; ++i) {
    const float a = Bf16ToFloat(d[i]), b = Bf16ToFloat(s[i]);
    d[i] = FloatToBf16(max ? std::max(a, b) : a + b);
  }
}

void Scale(void* buffer, int64_t count, ElementType type, float factor) {
  if (type == ElementType::kFloat32) {
    float* b = static_cast<float*>(buffer);
    for (int64_t i = 0; i < count; ++i) b[i] *= factor;
    return;
  }
  uint16_t* b = static_cast<uint16_t*>(buffer);
  for (int64_t i = 0; i < count; ++i) b[i] = FloatToBf16(Bf16ToFloat(b[i]) * factor);
}

}  // namespace shardopt
