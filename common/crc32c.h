// CRC-32C (Castagnoli), as used for checkpoint files. Debian bookworm packages
// no crc32c library for C++ and Abseil 20220623 has none, so this is ours: the
// SSE4.2 instruction when the CPU has it, a table otherwise.
#ifndef SHARDOPT_COMMON_CRC32C_H_
#define SHARDOPT_COMMON_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace shardopt {

// Extends `crc` (0 to start) with `n` bytes.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);
inline uint32_t Crc32c(const void* data, size_t n) { return Crc32cExtend(0, data, n); }

}  // namespace shardopt

#endif  // SHARDOPT_COMMON_CRC32C_H_
