#include "server/kernels/cpu/cpu_kernels.h"

#include <omp.h>

#include <algorithm>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/kernels/cpu/cpu_kernels_isa.h"

namespace shardopt {

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kBaseline: return "baseline";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "unknown";
}

bool IsaSupported(Isa isa) {
  switch (isa) {
    case Isa::kBaseline: return true;
    case Isa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
  }
  return false;
}

Isa BestIsa() {
  if (IsaSupported(Isa::kAvx512)) return Isa::kAvx512;
  if (IsaSupported(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kBaseline;
}

namespace {

// Elements converted at a time for bf16 gradients / outputs: fits L1 easily.
constexpr int64_t kBf16Block = 2048;

absl::StatusOr<const internal::KernelTable*> TableFor(Isa isa) {
  if (!IsaSupported(isa)) {
    return absl::FailedPreconditionError(
        absl::StrCat("instruction set ", IsaName(isa), " is not supported by this CPU"));
  }
  switch (isa) {
    case Isa::kAvx512: return &internal::avx512::Table();
    case Isa::kAvx2: return &internal::avx2::Table();
    case Isa::kBaseline: break;
  }
  return &internal::baseline::Table();
}

struct Work {
  const UpdateSlice* slice;
  int64_t begin;
  int64_t size;
};

absl::StatusOr<std::vector<Work>> SplitWork(absl::Span<const UpdateSlice> slices,
                                            const KernelOptions& options) {
  if (options.chunk_elements < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_elements must be >= 1, got ", options.chunk_elements));
  }
  std::vector<Work> work;
  for (const UpdateSlice& s : slices) {
    for (int64_t b = 0; b < s.size; b += options.chunk_elements) {
      work.push_back(Work{&s, b, std::min(options.chunk_elements, s.size - b)});
    }
  }
  return work;
}

int ThreadCount(const KernelOptions& options) {
  if (options.num_threads > 0) return options.num_threads;
  return std::max(1u, std::thread::hardware_concurrency());
}

// Runs `kernel(p, g, s0, s1, n)` on fp32 blocks of one work item, converting
// bf16 gradients in and bf16 parameters out around it.
template <typename Kernel>
void RunWork(const internal::KernelTable& t, const Work& w, const Kernel& kernel) {
  const UpdateSlice& s = *w.slice;
  auto at = [](auto* ptr, int64_t off) { return ptr == nullptr ? nullptr : ptr + off; };
  if (s.grad != nullptr && s.param_bf16 == nullptr) {
    kernel(s.param + w.begin, s.grad + w.begin, at(s.state0, w.begin), at(s.state1, w.begin),
           w.size);
    return;
  }
  float grad[kBf16Block];
  for (int64_t off = w.begin; off < w.begin + w.size; off += kBf16Block) {
    const int64_t n = std::min(kBf16Block, w.begin + w.size - off);
    const float* g = s.grad + off;
    if (s.grad == nullptr) {
      t.bf16_to_float(s.grad_bf16 + off, grad, n);
      g = grad;
    }
    kernel(s.param + off, g, at(s.state0, off), at(s.state1, off), n);
    if (s.param_bf16 != nullptr) t.float_to_bf16(s.param + off, s.param_bf16 + off, n);
  }
}

template <typename Kernel>
absl::Status Run(absl::Span<const UpdateSlice> slices, const KernelOptions& options,
                 const Kernel& kernel) {
  SHARDOPT_ASSIGN_OR_RETURN(const internal::KernelTable* table, TableFor(options.isa));
  SHARDOPT_ASSIGN_OR_RETURN(std::vector<Work> work, SplitWork(slices, options));
  const int threads = std::min<int64_t>(ThreadCount(options), static_cast<int64_t>(work.size()));
  const int64_t count = static_cast<int64_t>(work.size());
  if (threads <= 1) {
    for (const Work& w : work) RunWork(*table, w, [&](auto... a) { kernel(*table, a...); });
    return absl::OkStatus();
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < count; ++i) {
    RunWork(*table, work[i], [&](auto... a) { kernel(*table, a...); });
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AdamStep(const AdamConfig& config, int64_t step, absl::Span<const UpdateSlice> slices,
                      const KernelOptions& options) {
  SHARDOPT_RETURN_IF_ERROR(ValidateAdamConfig(config));
  SHARDOPT_RETURN_IF_ERROR(ValidateStep(step));
  SHARDOPT_RETURN_IF_ERROR(ValidateSlices(slices, true, true));
  const AdamScalars k = MakeAdamScalars(config, step);
  return Run(slices, options,
             [&k](const internal::KernelTable& t, float* p, const float* g, float* m, float* v,
                  int64_t n) { t.adam(k, p, g, m, v, n); });
}

absl::Status SgdStep(const SgdConfig& config, int64_t step, absl::Span<const UpdateSlice> slices,
                     const KernelOptions& options) {
  SHARDOPT_RETURN_IF_ERROR(ValidateSgdConfig(config));
  SHARDOPT_RETURN_IF_ERROR(ValidateStep(step));
  const SgdScalars k = MakeSgdScalars(config, step);
  SHARDOPT_RETURN_IF_ERROR(ValidateSlices(slices, k.momentum_enabled, false));
  return Run(slices, options,
             [&k](const internal::KernelTable& t, float* p, const float* g, float* buf, float*,
                  int64_t n) { t.sgd(k, p, g, buf, n); });
}

absl::Status SameTrafficStep(absl::Span<const UpdateSlice> slices, const KernelOptions& options) {
  SHARDOPT_RETURN_IF_ERROR(ValidateSlices(slices, true, true));
  return Run(slices, options,
             [](const internal::KernelTable& t, float* p, const float* g, float* m, float* v,
                int64_t n) { t.same_traffic(p, g, m, v, n); });
}

}  // namespace shardopt
