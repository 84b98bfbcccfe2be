#include "server/kernels/kernel_backend.h"

namespace shardopt {

absl::Status KernelBackend::SquaredNormTo(absl::Span<const UpdateSlice> slices, double* out) {
  absl::StatusOr<double> sum = SquaredNorm(slices);
  if (!sum.ok()) return sum.status();
  *out = *sum;
  return absl::OkStatus();
}

namespace {
// Host work is done when it returns.
class ReadyFence : public KernelBackend::Fence {
 public:
  bool Ready() override { return true; }
  absl::Status Wait(absl::Duration) override { return absl::OkStatus(); }
};
}  // namespace

std::unique_ptr<KernelBackend::Fence> KernelBackend::RecordFence() {
  return std::make_unique<ReadyFence>();
}

}  // namespace shardopt
