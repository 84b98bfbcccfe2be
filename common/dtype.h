// The element types of shardopt's tensors and buffers: one enum for the
// planner, checkpoints, the communicators and the CUDA kernels. Plain C++
// (no Abseil): nvcc compiles the kernels against this header.
#ifndef SHARDOPT_COMMON_DTYPE_H_
#define SHARDOPT_COMMON_DTYPE_H_

#include <cstdint>

namespace shardopt {

// kByte: raw bytes (what a communicator moves for non-numeric payloads); not a
// parameter type.
enum class DType : uint8_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kByte = 3 };

// Bytes per element.
constexpr int DTypeSize(DType dtype) {
  return dtype == DType::kFloat32 ? 4 : dtype == DType::kByte ? 1 : 2;
}
// "float32", "bfloat16", "float16", "byte".
const char* DTypeName(DType dtype);

}  // namespace shardopt

#endif  // SHARDOPT_COMMON_DTYPE_H_
