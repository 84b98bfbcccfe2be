// Registers the CUDA kernels (server/cuda) as ShardedOptimizer's device
// backend. Link with alwayslink so the registration runs.
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "client/device_backend.h"
#include "server/cuda/cuda_kernels.h"

namespace shardopt {
namespace {

cuda::DeviceSlice ToDevice(const UpdateSlice& s) {
  cuda::DeviceSlice d;
  d.master = s.param;
  d.grad = s.grad != nullptr ? static_cast<const void*>(s.grad) : s.grad_bf16;
  d.grad_type = s.grad != nullptr ? cuda::ParamType::kFloat32 : cuda::ParamType::kBFloat16;
  d.state0 = s.state0;
  d.state1 = s.state1;
  d.model = s.param_bf16;
  d.model_type = cuda::ParamType::kBFloat16;
  d.size = s.size;
  return d;
}

class CudaKernelsBackend : public DeviceBackend {
 public:
  absl::StatusOr<double> SquaredNorm(const std::vector<UpdateSlice>& slices) override {
    std::vector<cuda::DeviceSlice> d;
    for (const UpdateSlice& s : slices) d.push_back(ToDevice(s));
    double* out = nullptr;
    if (cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&out), sizeof(double), nullptr);
        e != cudaSuccess) {
      return absl::InternalError(absl::StrCat("cudaMallocAsync: ", cudaGetErrorString(e)));
    }
    absl::Status st = cuda::SquaredNorm(d, out, nullptr);
    double host = 0.0;
    if (st.ok()) {
      if (cudaError_t e = cudaMemcpy(&host, out, sizeof(double), cudaMemcpyDeviceToHost); e != cudaSuccess) {
        st = absl::InternalError(absl::StrCat("cudaMemcpy: ", cudaGetErrorString(e)));
      }
    }
    cudaFreeAsync(out, nullptr);
    if (!st.ok()) return st;
    return host;
  }

  absl::Status Update(OptimizerKind kind, const AdamConfig& adam, const SgdConfig& sgd,
                      int64_t step, const UpdateSlice& s) override {
    cuda::DeviceSlice d = ToDevice(s);
    // The legacy default stream, which LibTorch uses unless told otherwise.
    if (kind == OptimizerKind::kSgd) return cuda::SgdStep(MakeSgdScalars(sgd, step), {d}, nullptr);
    return cuda::AdamStep(MakeAdamScalars(adam, step), {d}, nullptr);
  }
};

const bool registered = [] {
  static CudaKernelsBackend backend;
  RegisterCudaBackend(&backend);
  return true;
}();

}  // namespace
}  // namespace shardopt
