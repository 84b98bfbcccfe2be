// Plain types shared by the CUDA translation unit (compiled by nvcc, which
// sees no Abseil) and its C++ wrapper.
#ifndef SHARDOPT_SERVER_KERNELS_CUDA_DEVICE_TYPES_H_
#define SHARDOPT_SERVER_KERNELS_CUDA_DEVICE_TYPES_H_

#include <cstdint>

#include "common/dtype.h"
#include "server/kernels/optimizer_math.h"

namespace shardopt {
namespace cuda {

struct DeviceSlice {
  float* master = nullptr;
  const void* grad = nullptr;
  DType grad_type = DType::kFloat32;
  float* state0 = nullptr;
  float* state1 = nullptr;
  void* model = nullptr;
  DType model_type = DType::kFloat32;
  int64_t size = 0;
};

// The per-step scalars: the very structs of server/kernels/optimizer_math.h.
using AdamArgs = ::shardopt::AdamScalars;
using SgdArgs = ::shardopt::SgdScalars;

namespace impl {
// Each returns 0 on success, or a CUDA error code with its message in `err`.
int DeviceCount();
int Adam(const AdamArgs& a, const DeviceSlice* slices, int n, void* stream, char* err, int errlen);
int Sgd(const SgdArgs& a, const DeviceSlice* slices, int n, void* stream, char* err, int errlen);
int SquaredNorm(const DeviceSlice* slices, int n, double* out, void* stream, char* err, int errlen);
int CheckOverflow(const DeviceSlice* slices, int n, int* flag, void* stream, char* err, int errlen);
int SameTraffic(const DeviceSlice* slices, int n, void* stream, char* err, int errlen);
}  // namespace impl

}  // namespace cuda
}  // namespace shardopt

#endif  // SHARDOPT_SERVER_KERNELS_CUDA_DEVICE_TYPES_H_
