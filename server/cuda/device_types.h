// Plain types shared by the CUDA translation unit (compiled by nvcc, which
// sees no Abseil) and its C++ wrapper.
#ifndef SHARDOPT_SERVER_CUDA_DEVICE_TYPES_H_
#define SHARDOPT_SERVER_CUDA_DEVICE_TYPES_H_

#include <cstdint>

namespace shardopt {
namespace cuda {

enum class ParamType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct DeviceSlice {
  float* master = nullptr;
  const void* grad = nullptr;
  ParamType grad_type = ParamType::kFloat32;
  float* state0 = nullptr;
  float* state1 = nullptr;
  void* model = nullptr;
  ParamType model_type = ParamType::kFloat32;
  int64_t size = 0;
};

// The scalars of server/update_slice.h, as plain structs.
struct AdamArgs {
  float grad_sign, weight_decay, decay;
  int32_t l2, decoupled;
  float beta1, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size;
};
struct SgdArgs {
  float grad_sign, weight_decay;
  int32_t l2, momentum_enabled, first_step, nesterov;
  float momentum, one_minus_dampening, neg_lr;
};

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

#endif  // SHARDOPT_SERVER_CUDA_DEVICE_TYPES_H_
