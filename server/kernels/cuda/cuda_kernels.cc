#include "server/kernels/cuda/cuda_kernels.h"

#include "absl/strings/str_cat.h"

namespace shardopt {
namespace cuda {

namespace {

absl::Status ToStatus(int code, const char* err) {
  if (code == 0) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("CUDA: ", err));
}

absl::Status CheckSlices(const std::vector<DeviceSlice>& slices) {
  for (size_t i = 0; i < slices.size(); ++i) {
    const DeviceSlice& s = slices[i];
    if (s.size < 0) return absl::InvalidArgumentError(absl::StrCat("slice ", i, ": negative size"));
    if (s.size > 0 && (s.master == nullptr || s.grad == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("slice ", i, ": missing parameter or gradient"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

int DeviceCount() { return impl::DeviceCount(); }

absl::Status AdamStep(const AdamScalars& k, const std::vector<DeviceSlice>& slices, void* stream) {
  if (absl::Status s = CheckSlices(slices); !s.ok()) return s;
  for (const DeviceSlice& s : slices) {
    if (s.size > 0 && (s.state0 == nullptr || s.state1 == nullptr)) {
      return absl::InvalidArgumentError("Adam needs both optimizer states");
    }
  }
  const AdamArgs& a = k;
  char err[256] = {0};
  return ToStatus(
      impl::Adam(a, slices.data(), static_cast<int>(slices.size()), stream, err, sizeof(err)), err);
}

absl::Status SgdStep(const SgdScalars& k, const std::vector<DeviceSlice>& slices, void* stream) {
  if (absl::Status s = CheckSlices(slices); !s.ok()) return s;
  const SgdArgs& a = k;
  char err[256] = {0};
  return ToStatus(
      impl::Sgd(a, slices.data(), static_cast<int>(slices.size()), stream, err, sizeof(err)), err);
}

absl::Status SquaredNorm(const std::vector<DeviceSlice>& slices, double* out, void* stream) {
  char err[256] = {0};
  return ToStatus(impl::SquaredNorm(slices.data(), static_cast<int>(slices.size()), out, stream,
                                    err, sizeof(err)),
                  err);
}

absl::Status CheckOverflow(const std::vector<DeviceSlice>& slices, int* flag, void* stream) {
  char err[256] = {0};
  return ToStatus(impl::CheckOverflow(slices.data(), static_cast<int>(slices.size()), flag, stream,
                                      err, sizeof(err)),
                  err);
}

absl::Status SameTraffic(const std::vector<DeviceSlice>& slices, void* stream) {
  char err[256] = {0};
  return ToStatus(
      impl::SameTraffic(slices.data(), static_cast<int>(slices.size()), stream, err, sizeof(err)),
      err);
}

}  // namespace cuda
}  // namespace shardopt
