// NcclCommunicator with world size 1 on one GPU: collectives complete through
// the watcher, abort fails later calls. Skips (SKIPPED) without a GPU.
#include <cuda_runtime.h>

#include <vector>

#include "client/kv_store.h"
#include "client/nccl_communicator.h"
#include "gtest/gtest.h"
#include "server/cuda/cuda_kernels.h"

namespace shardopt {
namespace {

TEST(NcclTest, WorldSizeOneCollectivesAndAbort) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  InMemoryKeyValueStore store;
  auto comm = NcclCommunicator::Create(&store, 0, 1, NcclOptions());
  ASSERT_TRUE(comm.ok()) << comm.status();
  std::vector<float> host = {1, 2, 3, 4};
  float* dev;
  ASSERT_EQ(cudaMalloc(&dev, 16), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev, host.data(), 16, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_TRUE((*comm)->AllReduce(dev, 4, ElementType::kFloat32, ReduceOp::kSum)->Wait(absl::Seconds(30)).ok());
  EXPECT_TRUE((*comm)->ReduceScatter(dev, 4, ElementType::kFloat32, ReduceOp::kAverage)->Wait(absl::Seconds(30)).ok());
  EXPECT_TRUE((*comm)->AllGather(dev, 4, ElementType::kFloat32)->Wait(absl::Seconds(30)).ok());
  EXPECT_TRUE((*comm)->Barrier()->Wait(absl::Seconds(30)).ok());
  std::vector<float> back(4);
  ASSERT_EQ(cudaMemcpy(back.data(), dev, 16, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host);  // one rank: every collective is the identity
  (*comm)->Abort(absl::CancelledError("test"));
  EXPECT_EQ((*comm)->Barrier()->Wait(absl::Seconds(5)).code(), absl::StatusCode::kAborted);
  cudaFree(dev);
}

}  // namespace
}  // namespace shardopt
