// bf16 <-> fp32 on the host. bf16 is the upper half of an fp32; rounding is to
// nearest even, NaN stays NaN (quiet). Used by the kernels' reference and CPU
// backends and by the communicators' reductions.
#ifndef SHARDOPT_COMMON_BF16_H_
#define SHARDOPT_COMMON_BF16_H_

#include <cstdint>

namespace shardopt {

inline float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  __builtin_memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace shardopt

#endif  // SHARDOPT_COMMON_BF16_H_
