// NcclCommunicator with world size 1 on one GPU: collectives complete through
// the watcher, abort fails later calls. Skips (SKIPPED) without a GPU.
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "client/comm/kv_store.h"
#include "client/comm/nccl_communicator.h"
#include "gtest/gtest.h"
#include "server/kernels/cuda/cuda_kernels.h"

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
  EXPECT_TRUE(
      (*comm)->AllReduce(dev, 4, DType::kFloat32, ReduceOp::kSum)->Wait(absl::Seconds(30)).ok());
  EXPECT_TRUE((*comm)
                  ->ReduceScatter(dev, 4, DType::kFloat32, ReduceOp::kAverage)
                  ->Wait(absl::Seconds(30))
                  .ok());
  EXPECT_TRUE((*comm)->AllGather(dev, 4, DType::kFloat32)->Wait(absl::Seconds(30)).ok());
  EXPECT_TRUE((*comm)->Barrier()->Wait(absl::Seconds(30)).ok());
  std::vector<float> back(4);
  ASSERT_EQ(cudaMemcpy(back.data(), dev, 16, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host);  // one rank: every collective is the identity
  // Host buffers are staged through the device (control values, model check).
  std::vector<float> on_host = {5, -1, 2.5f};
  EXPECT_TRUE((*comm)
                  ->AllReduce(on_host.data(), 3, DType::kFloat32, ReduceOp::kMax)
                  ->Wait(absl::Seconds(30))
                  .ok());
  EXPECT_EQ(on_host, (std::vector<float>{5, -1, 2.5f}));
  std::string text = "model description";
  EXPECT_TRUE((*comm)
                  ->Broadcast(text.data(), static_cast<int64_t>(text.size()), DType::kByte, 0)
                  ->Wait(absl::Seconds(30))
                  .ok());
  EXPECT_EQ(text, "model description");
  std::vector<float> gathered = {7, 8};
  EXPECT_TRUE(
      (*comm)->AllGather(gathered.data(), 2, DType::kFloat32)->Wait(absl::Seconds(30)).ok());
  EXPECT_EQ(gathered, (std::vector<float>{7, 8}));
  const ByteCounters counters = (*comm)->counters();
  EXPECT_EQ(counters.sent[static_cast<int>(CollectiveKind::kAllReduce)],
            0);  // one rank sends nothing
  (*comm)->Abort(absl::CancelledError("test"));
  EXPECT_EQ((*comm)->Barrier()->Wait(absl::Seconds(5)).code(), absl::StatusCode::kAborted);
  cudaFree(dev);
}

// A peer that never comes: rank 0 of two gives up after the timeout, through
// ncclCommAbort, with a status that says so (one GPU is enough: the second
// rank never starts).
TEST(NcclTest, MissingPeerTimesOutWithAClearStatus) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  InMemoryKeyValueStore store;
  NcclOptions o;
  o.timeout = absl::Seconds(3);
  const absl::Time start = absl::Now();
  auto comm = NcclCommunicator::Create(&store, 0, 2, o);
  const absl::Duration took = absl::Now() - start;
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
  EXPECT_NE(comm.status().message().find("timed out"), absl::string_view::npos) << comm.status();
  EXPECT_GE(took, absl::Seconds(3));
  EXPECT_LT(took, absl::Seconds(20));
  // Rank 1 whose rank 0 never publishes the NCCL id: the store's wait ends it.
  InMemoryKeyValueStore empty;
  o.timeout = absl::Seconds(1);
  auto lonely = NcclCommunicator::Create(&empty, 1, 2, o);
  EXPECT_FALSE(lonely.ok());
}

}  // namespace
}  // namespace shardopt
