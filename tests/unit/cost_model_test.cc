// The advisor's cost model term by term, against hand-computed cases: ring
// collective formulas, overlap with backward, per-parameter collectives,
// memory per rank (and the ZeRO paper's 2+2+12 bytes per parameter).
#include "advisor/cost_model.h"

#include <gtest/gtest.h>

#include <string>

#include "advisor/inputs.h"

namespace shardopt {
namespace advisor {
namespace {

Link L(double gbps, double latency = 0.0, double per_call = 0.0) {
  return Link{"test", gbps * 1e9, latency, per_call, "test"};
}

TEST(CollectivesTest, RingFormulas) {
  const Link l = L(1.0, 1e-5, 2e-5);  // 1 GB/s, 10 us per step, 20 us per call
  // 1 GB on 4 ranks.
  EXPECT_NEAR(AllReduceSeconds(1e9, 4, l), 2.0 * 3 / 4 + 6 * 1e-5 + 2e-5, 1e-12);
  EXPECT_NEAR(ReduceScatterSeconds(1e9, 4, l), 0.75 + 3e-5 + 2e-5, 1e-12);
  EXPECT_NEAR(AllGatherSeconds(1e9, 4, l), 0.75 + 3e-5 + 2e-5, 1e-12);
  EXPECT_NEAR(BroadcastSeconds(1e9, 4, l), 1.0 + 3e-5 + 2e-5, 1e-12);
  EXPECT_NEAR(ReduceSeconds(1e9, 4, l), 1.0 + 3e-5 + 2e-5, 1e-12);
  // A reduce-scatter and an all-gather move an all-reduce's bytes.
  const Link bw = L(10.0);
  EXPECT_NEAR(ReduceScatterSeconds(8e8, 8, bw) + AllGatherSeconds(8e8, 8, bw),
              AllReduceSeconds(8e8, 8, bw), 1e-12);
  EXPECT_EQ(AllReduceSeconds(1e9, 1, l), 0.0);
  EXPECT_EQ(BroadcastSeconds(1e9, 1, l), 0.0);
}

TEST(CollectivesTest, RingOverNodesRunsAtTheSlowestLink) {
  Cluster c;
  c.world_size = 16;
  c.ranks_per_node = 8;
  c.intra = L(370, 3e-6);
  c.inter = L(48, 5e-6);
  EXPECT_EQ(Nodes(c), 2);
  const Link r = RingLink(c);
  EXPECT_DOUBLE_EQ(r.bandwidth, 48e9);
  EXPECT_DOUBLE_EQ(r.latency, 5e-6);
  c.world_size = 8;
  EXPECT_EQ(Nodes(c), 1);
  EXPECT_DOUBLE_EQ(RingLink(c).bandwidth, 370e9);
}

// One tensor per 25 MiB bucket: 4 tensors of 25 MiB each (fp32).
ModelInfo FourBuckets() {
  ModelInfo m;
  m.name = "four";
  m.numel = {25 << 18, 25 << 18, 25 << 18, 25 << 18};  // 25 MiB / 4 B each
  return m;
}

Cluster TwoRanks(double gbps, bool cpu = false) {
  Cluster c;
  c.world_size = 2;
  c.intra = L(gbps);
  c.comm_on_compute_cores = cpu;
  return c;
}

Compute Backward(double fwd, double bwd) {
  Compute k;
  k.forward_s = fwd;
  k.backward_s = bwd;
  k.fused_s_per_element = 1e-9;
  k.unfused_s_per_element = 3e-9;
  return k;
}

TEST(PredictTest, DdpHidesItsAllReduceBehindBackwardButTheLastBucket) {
  const ModelInfo m = FourBuckets();
  const double bucket = double(25 << 20);
  // 10 GB/s: each bucket's all-reduce 2 (1/2) 26.2 MB / 10 GB/s = 2.62 ms,
  // backward 1 s: only the last bucket (ready at the end) is exposed.
  auto p = Predict(m, TwoRanks(10), Backward(0.5, 1.0), Precision(), Options(), Strategy::kDdp);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NEAR(p->exposed_comm_s, bucket / 10e9, 1e-9);
  EXPECT_NEAR(p->comm_s, 4 * bucket / 10e9, 1e-9);
  EXPECT_EQ(p->collectives, 4);
  EXPECT_NEAR(p->optimizer_s, 4.0 * (25 << 18) * 3e-9, 1e-12);
  EXPECT_NEAR(p->step_s, 1.5 + p->exposed_comm_s + p->optimizer_s, 1e-12);
  EXPECT_NEAR(p->bytes_sent, 4 * bucket, 1);  // 2 (n-1)/n S
  // Communication on the compute cores: nothing overlaps.
  auto cpu =
      Predict(m, TwoRanks(10, true), Backward(0.5, 1.0), Precision(), Options(), Strategy::kDdp);
  ASSERT_TRUE(cpu.ok());
  EXPECT_NEAR(cpu->exposed_comm_s, cpu->comm_s, 1e-12);
}

TEST(PredictTest, SlowLinkExposesTheWholeBacklog) {
  const ModelInfo m = FourBuckets();
  const double t = double(25 << 20) / 0.1e9;  // one bucket's all-reduce at 0.1 GB/s: 0.262 s
  // Backward 0.4 s: buckets ready at 0.1, 0.2, 0.3, 0.4; the link is the
  // bottleneck: done at 0.1 + 4 t.
  auto p = Predict(m, TwoRanks(0.1), Backward(0.0, 0.4), Precision(), Options(), Strategy::kDdp);
  ASSERT_TRUE(p.ok());
  EXPECT_NEAR(p->exposed_comm_s, 0.1 + 4 * t - 0.4, 1e-9);
}

TEST(PredictTest, ShardoptSendsDdpsBytesAndUpdatesOneNth) {
  const ModelInfo m = FourBuckets();
  const double P = 4.0 * (25 << 18);
  auto ddp = Predict(m, TwoRanks(10), Backward(0.5, 1.0), Precision(), Options(), Strategy::kDdp);
  auto so = Predict(m, TwoRanks(10), Backward(0.5, 1.0), Precision(), Options(),
                    Strategy::kShardoptOverlap);
  ASSERT_TRUE(ddp.ok() && so.ok());
  EXPECT_NEAR(so->bytes_sent, ddp->bytes_sent, 1);
  EXPECT_NEAR(so->optimizer_s, P / 2 * 1e-9, 1e-12);
  EXPECT_EQ(so->collectives, 8);  // 4 reduce-scatters, 4 all-gathers
  // Memory, fp32 Adam: parameters 4P, gradients 4P (DDP 8P with its bucket
  // copy), state 8P / n.
  EXPECT_DOUBLE_EQ(ddp->memory.params, 4 * P);
  EXPECT_DOUBLE_EQ(ddp->memory.grads, 8 * P);
  EXPECT_DOUBLE_EQ(ddp->memory.state, 8 * P);
  EXPECT_DOUBLE_EQ(so->memory.grads, 4 * P);
  EXPECT_DOUBLE_EQ(so->memory.state, 4 * P);
}

TEST(PredictTest, OssBroadcastsAfterTheStepAndShardedDdpPaysPerParameterCalls) {
  ModelInfo m;
  m.numel.assign(100, 1000);  // 100 small tensors
  m.buffer_tensors = 50;
  m.buffer_bytes = 50 * 400;
  Cluster c = TwoRanks(10);
  c.intra.per_call = 30e-6;
  auto oss = Predict(m, c, Backward(0.1, 0.2), Precision(), Options(), Strategy::kOssDdp);
  auto sddp = Predict(m, c, Backward(0.1, 0.2), Precision(), Options(), Strategy::kOssShardedDdp);
  auto zero = Predict(m, c, Backward(0.1, 0.2), Precision(), Options(), Strategy::kZero);
  ASSERT_TRUE(oss.ok() && sddp.ok() && zero.ok());
  // OSS + DDP: 1 all-reduce bucket, 2 broadcasts (one per owner), 1 buffer broadcast.
  EXPECT_EQ(oss->collectives, 1 + 2 + 1);
  // ShardedDDP: 100 reduces, 2 broadcasts, 50 buffer broadcasts.
  EXPECT_EQ(sddp->collectives, 100 + 2 + 50);
  // ZeRO: one broadcast per parameter.
  EXPECT_EQ(zero->collectives, 1 + 100 + 1);
  // The broadcasts are exposed: at least 2 calls' cost over DDP's.
  auto ddp = Predict(m, c, Backward(0.1, 0.2), Precision(), Options(), Strategy::kDdp);
  ASSERT_TRUE(ddp.ok());
  EXPECT_GT(oss->exposed_comm_s, ddp->exposed_comm_s + 2 * 30e-6);
  EXPECT_GT(sddp->exposed_comm_s, 50 * 30e-6);                         // the buffers alone
  EXPECT_NEAR(oss->bytes_sent, 3.0 / 2 * 4e5 + 50 * 400 / 2.0, 1e-6);  // 1.5x DDP's + buffers
}

TEST(PredictTest, MixedPrecisionMemoryIsTheZeroPapers) {
  // 2 + 2 + 12 bytes per parameter: fp16 parameters and gradients, fp32
  // master, m, v (Rajbhandari et al., "ZeRO", section 3.1).
  ModelInfo m;
  m.numel = {1 << 20};
  Precision mixed;
  mixed.param = 2;
  mixed.grad = 2;
  mixed.master = 4;
  mixed.state = 8;
  Options o;
  o.ddp_bucket_copy = false;
  o.zero2_staging_buckets = 1;
  o.zero2_bucket_bytes = 1;  // (staging: the largest bucket, (n-1)/n of it)
  o.zero2_pieces = false;    // (staged whole)
  const double P = 1 << 20;
  const int n = 64;
  Cluster c = TwoRanks(100);
  c.world_size = n;
  auto ddp = Predict(m, c, Backward(0.1, 0.2), mixed, o, Strategy::kDdp);
  auto z1 = Predict(m, c, Backward(0.1, 0.2), mixed, o, Strategy::kShardoptOverlap);
  auto z2 = Predict(m, c, Backward(0.1, 0.2), mixed, o, Strategy::kShardoptZero2);
  ASSERT_TRUE(ddp.ok() && z1.ok() && z2.ok());
  EXPECT_DOUBLE_EQ(ddp->memory.total(), 16 * P);
  EXPECT_DOUBLE_EQ(z1->memory.total(), (2 + 2 + 12.0 / n) * P);                   // ZeRO-1 (P_os)
  EXPECT_DOUBLE_EQ(z2->memory.total() - z2->memory.staging, (2 + 14.0 / n) * P);  // P_os+g
  EXPECT_DOUBLE_EQ(z2->memory.staging, 2 * P * (n - 1) / n);
  // Reduced in pieces, a tensor larger than a bucket stages no more than the
  // arena (staging buckets x cap).
  o.zero2_pieces = true;
  o.zero2_bucket_bytes = 1 << 10;
  o.zero2_staging_buckets = 2;
  auto pieces = Predict(m, c, Backward(0.1, 0.2), mixed, o, Strategy::kShardoptZero2);
  ASSERT_TRUE(pieces.ok());
  EXPECT_DOUBLE_EQ(pieces->memory.staging, 2.0 * (1 << 10) * (n - 1) / n);
}

TEST(PredictTest, RefusesBadInput) {
  ModelInfo empty;
  EXPECT_FALSE(
      Predict(empty, TwoRanks(10), Backward(0, 1), Precision(), Options(), Strategy::kDdp).ok());
  Cluster c = TwoRanks(0);
  EXPECT_FALSE(
      Predict(FourBuckets(), c, Backward(0, 1), Precision(), Options(), Strategy::kDdp).ok());
  Options o;
  o.bucket_bytes = 0;
  EXPECT_FALSE(
      Predict(FourBuckets(), TwoRanks(10), Backward(0, 1), Precision(), o, Strategy::kDdp).ok());
  EXPECT_FALSE(ParseStrategy("fsdp").ok());
  EXPECT_EQ(*ParseStrategy("oss_ddp"), Strategy::kOssDdp);
  EXPECT_FALSE(FindLink("carrier-pigeon").ok());
  EXPECT_TRUE(FindLink("nvlink4").ok());
}

TEST(PredictTest, OneRankCommunicatesNothing) {
  Cluster c = TwoRanks(10);
  c.world_size = 1;
  auto p =
      Predict(FourBuckets(), c, Backward(0.5, 1), Precision(), Options(), Strategy::kShardoptZero2);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->comm_s, 0.0);
  EXPECT_EQ(p->exposed_comm_s, 0.0);
}

TEST(RecommendTest, ShardsGradientsWhenTheMemoryLimitNeedsIt) {
  Cluster c = TwoRanks(10);
  auto free = Recommend(FourBuckets(), c, Backward(0.5, 1.0), Precision());
  ASSERT_TRUE(free.ok());
  EXPECT_GT(free->bucket_bytes, 0);
  auto tight = Recommend(FourBuckets(), c, Backward(0.5, 1.0), Precision(), /*limit=*/1e6);
  ASSERT_TRUE(tight.ok());
  EXPECT_TRUE(tight->shard_gradients);
  EXPECT_EQ(tight->strategy, Strategy::kShardoptZero2);
  EXPECT_NE(tight->why.find("memory limit"), std::string::npos);
}

TEST(InputsTest, LinkFittedToBenchCommIsExact) {
  // Synthetic: B = 5 GB/s on 2 ranks, 100 us per call: t = S/B + 2 c.
  std::string j = R"({"ranks": 2, "sizes": [)";
  for (int mb : {1, 4, 16, 64}) {
    const double t = mb * 1e6 / 5e9 + 2 * 100e-6;
    j += (mb == 1 ? "" : ",") + std::string("{\"size_mb\": ") + std::to_string(mb) +
         ", \"shm_rs_ag_s\": " + std::to_string(t) + "}";
  }
  j += "]}";
  auto l = LinkFromBenchComm(j, "shm");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_NEAR(l->bandwidth, 5e9, 5e9 * 1e-4);
  EXPECT_NEAR(l->per_call, 100e-6, 1e-7);
  EXPECT_FALSE(LinkFromBenchComm(j, "carrier-pigeon").ok());
  EXPECT_FALSE(LinkFromBenchComm("{}", "shm").ok());
  EXPECT_FALSE(LinkFromBenchComm("not json", "shm").ok());
}

TEST(InputsTest, GptShapesCountGpt2Small) {
  // GPT-2 small: 124,439,808 parameters (tied output embedding).
  const ModelInfo m = ModelOf("gpt2", GptShapes(12, 768, 50257, 1024));
  EXPECT_EQ(m.elements(), 124439808);
  EXPECT_EQ(m.numel.size(), 2u + 12u * 12u + 2u);
}

}  // namespace
}  // namespace advisor
}  // namespace shardopt
