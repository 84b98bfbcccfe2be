// Fused optimizer kernels for NVIDIA GPUs: the contract of server/kernels/cpu/cpu_kernels.h
// on device pointers. One launch updates every slice (multi-tensor: a table
// of chunks, grid-stride over it); arithmetic in fp32 for bf16/fp16
// parameters with an fp32 master copy; built with -fmad=false and IEEE sqrt
// and division, so results equal the CPU reference bit for bit.
//
// No CUDA types in this header: streams are passed as void* (cudaStream_t),
// so CPU-only targets can include it. Every function returns a Status with
// CUDA's message on failure; when no device is present, DeviceCount() is 0.
#ifndef SHARDOPT_SERVER_KERNELS_CUDA_CUDA_KERNELS_H_
#define SHARDOPT_SERVER_KERNELS_CUDA_CUDA_KERNELS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "server/kernels/cuda/device_types.h"
#include "server/kernels/update_slice.h"

namespace shardopt {
namespace cuda {

// Devices visible to this process (0 without a GPU or driver).
int DeviceCount();

// DeviceSlice (device_types.h): one contiguous slice in device memory.
// `master` is the fp32 parameter (or the fp32 master copy); `grad` is of
// `grad_type`; `model` (optional) receives the updated parameter in
// `model_type` (the bf16/fp16 model copy); state0/state1 as on the CPU.

// Enqueue one step on `stream` (nullptr: the default stream).
absl::Status AdamStep(const AdamScalars& k, const std::vector<DeviceSlice>& slices, void* stream);
absl::Status SgdStep(const SgdScalars& k, const std::vector<DeviceSlice>& slices, void* stream);
// Sum of squares of fp32 `grad` elements of every slice, accumulated in a
// device double at `out` (zeroed first). Stays on the device.
absl::Status SquaredNorm(const std::vector<DeviceSlice>& slices, double* out, void* stream);
// Sets *flag (device int) to 1 if any gradient element is inf or NaN.
absl::Status CheckOverflow(const std::vector<DeviceSlice>& slices, int* flag, void* stream);
// Same traffic as Adam (read p, g, m, v; write p, m, v), trivial arithmetic:
// the bandwidth reference for benchmarks.
absl::Status SameTraffic(const std::vector<DeviceSlice>& slices, void* stream);

}  // namespace cuda
}  // namespace shardopt

#endif  // SHARDOPT_SERVER_KERNELS_CUDA_CUDA_KERNELS_H_
