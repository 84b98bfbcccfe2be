// The CPU KernelBackend: the SIMD kernels (server/kernels/cpu/cpu_kernels.h,
// dispatched to the best instruction set the machine has).
#ifndef SHARDOPT_SERVER_KERNELS_CPU_CPU_BACKEND_H_
#define SHARDOPT_SERVER_KERNELS_CPU_CPU_BACKEND_H_

#include <memory>

#include "server/kernels/kernel_backend.h"

namespace shardopt {

// On `num_threads` threads (0 = all hardware threads).
std::unique_ptr<KernelBackend> MakeCpuKernelBackend(int num_threads);

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_KERNELS_CPU_CPU_BACKEND_H_
