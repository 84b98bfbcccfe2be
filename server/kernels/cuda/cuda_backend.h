// The CUDA KernelBackend: the fused kernels of cuda_kernels.h on the legacy
// default stream (the one LibTorch uses unless told otherwise). Pass it to a
// ShardedOptimizer whose parameters are on a GPU:
//   options.kernel_backend = MakeCudaKernelBackend();
// Tested on one H200 by tools/gpu_check.sh (tests/gpu/gpu_sharded_optimizer_test.cc).
#ifndef SHARDOPT_SERVER_KERNELS_CUDA_CUDA_BACKEND_H_
#define SHARDOPT_SERVER_KERNELS_CUDA_CUDA_BACKEND_H_

#include <memory>

#include "server/kernels/kernel_backend.h"

namespace shardopt {

std::shared_ptr<KernelBackend> MakeCudaKernelBackend();

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_KERNELS_CUDA_CUDA_BACKEND_H_
