#include "server/kernels/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/kernels/cuda/cuda_kernels.h"

namespace shardopt {
namespace {

cuda::DeviceSlice ToDevice(const UpdateSlice& s) {
  cuda::DeviceSlice d;
  d.master = s.param;
  d.grad = s.grad != nullptr ? static_cast<const void*>(s.grad) : s.grad_bf16;
  d.grad_type = s.grad != nullptr ? DType::kFloat32 : DType::kBFloat16;
  d.state0 = s.state0;
  d.state1 = s.state1;
  d.model = s.param_bf16;
  d.model_type = DType::kBFloat16;
  d.size = s.size;
  return d;
}

std::vector<cuda::DeviceSlice> ToDevice(absl::Span<const UpdateSlice> slices) {
  std::vector<cuda::DeviceSlice> d;
  d.reserve(slices.size());
  for (const UpdateSlice& s : slices) d.push_back(ToDevice(s));
  return d;
}

// An event recorded on the legacy default stream (where Update runs). If the
// event cannot be made, Ready() is false and Wait() reports why.
class EventFence : public KernelBackend::Fence {
 public:
  EventFence() {
    error_ = cudaEventCreateWithFlags(&event_, cudaEventDisableTiming);
    if (error_ == cudaSuccess) error_ = cudaEventRecord(event_, nullptr);
  }
  ~EventFence() override {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }
  bool Ready() override { return error_ == cudaSuccess && cudaEventQuery(event_) == cudaSuccess; }
  absl::Status Wait(absl::Duration timeout) override {
    const absl::Time deadline = absl::Now() + timeout;
    while (error_ == cudaSuccess) {
      const cudaError_t q = cudaEventQuery(event_);
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady) {
        error_ = q;
        break;
      }
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("device work not done within ", absl::FormatDuration(timeout)));
      }
      absl::SleepFor(absl::Microseconds(20));
    }
    return absl::InternalError(absl::StrCat("device fence: ", cudaGetErrorString(error_)));
  }

 private:
  cudaEvent_t event_ = nullptr;
  cudaError_t error_ = cudaSuccess;
};

class CudaKernelBackend : public KernelBackend {
 public:
  const char* name() const override { return "cuda"; }
  bool on_device() const override { return true; }

  absl::Status SquaredNormTo(absl::Span<const UpdateSlice> slices, double* out) override {
    return cuda::SquaredNorm(ToDevice(slices), out, nullptr);
  }

  std::unique_ptr<Fence> RecordFence() override { return std::make_unique<EventFence>(); }

  absl::StatusOr<double> SquaredNorm(absl::Span<const UpdateSlice> slices) override {
    double* out = nullptr;
    if (cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&out), sizeof(double), nullptr);
        e != cudaSuccess) {
      return absl::InternalError(absl::StrCat("cudaMallocAsync: ", cudaGetErrorString(e)));
    }
    absl::Status st = SquaredNormTo(slices, out);
    double host = 0.0;
    if (st.ok()) {
      if (cudaError_t e = cudaMemcpy(&host, out, sizeof(double), cudaMemcpyDeviceToHost);
          e != cudaSuccess) {
        st = absl::InternalError(absl::StrCat("cudaMemcpy: ", cudaGetErrorString(e)));
      }
    }
    cudaFreeAsync(out, nullptr);
    if (!st.ok()) return st;
    return host;
  }

  absl::Status Update(OptimizerKind kind, const HyperParameters& hp, int64_t step,
                      absl::Span<const UpdateSlice> slices) override {
    if (kind == OptimizerKind::kSgd) {
      return cuda::SgdStep(MakeSgdScalars(hp.sgd, step), ToDevice(slices), nullptr);
    }
    return cuda::AdamStep(MakeAdamScalars(hp.adam, step), ToDevice(slices), nullptr);
  }
};

}  // namespace

std::shared_ptr<KernelBackend> MakeCudaKernelBackend() {
  return std::make_shared<CudaKernelBackend>();
}

}  // namespace shardopt
