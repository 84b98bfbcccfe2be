// Fused CPU optimizer kernels: one call updates every owned slice (multi-tensor),
// vectorised for the best instruction set this CPU has (AVX-512, AVX2, or the
// x86-64 baseline), threaded over chunks with OpenMP.
//
// Results are bitwise identical to the reference (reference_optimizer.h) for
// every instruction set and thread count: the kernels are the same expressions,
// compiled without floating-point contraction, and sqrt/div are correctly
// rounded in every SIMD width. Thread-safe as long as concurrent calls touch
// disjoint slices.
#ifndef SHARDOPT_SERVER_KERNELS_CPU_CPU_KERNELS_H_
#define SHARDOPT_SERVER_KERNELS_CPU_CPU_KERNELS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/optimizer_config.h"
#include "server/kernels/update_slice.h"

namespace shardopt {

enum class Isa { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };
const char* IsaName(Isa isa);
// The best instruction set both compiled in and supported by this CPU.
Isa BestIsa();
bool IsaSupported(Isa isa);

struct KernelOptions {
  // Threads for one call. 0 = all hardware threads; 1 runs on the caller's
  // thread without entering OpenMP.
  int num_threads = 1;
  // Instruction set; defaults to BestIsa(). Unsupported -> FailedPrecondition.
  Isa isa = BestIsa();
  // Elements per unit of parallel work (64 Ki fp32 = 256 KiB per array).
  int64_t chunk_elements = 64 * 1024;
};

// One step numbered `step` (1 for the first) over all slices. Errors: invalid
// config, step < 1, malformed slices, unsupported ISA; nothing is modified then.
absl::Status AdamStep(const AdamConfig& config, int64_t step, absl::Span<const UpdateSlice> slices,
                      const KernelOptions& options = KernelOptions());
absl::Status SgdStep(const SgdConfig& config, int64_t step, absl::Span<const UpdateSlice> slices,
                     const KernelOptions& options = KernelOptions());

// A kernel with exactly Adam's memory traffic (reads p, g, m, v; writes p, m, v:
// 28 bytes per element) and trivial arithmetic: the bandwidth limit an Adam
// step can reach. For benchmarks. Uses slices' param, grad, state0, state1.
absl::Status SameTrafficStep(absl::Span<const UpdateSlice> slices,
                             const KernelOptions& options = KernelOptions());

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_KERNELS_CPU_CPU_KERNELS_H_
