// ShardOwner alone (no communication): the fused update of its owned slices
// equals the scalar reference, per parameter group; staging for checkpoints;
// the memory report per optimizer kind; errors.
#include "server/shard_owner.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>

#include "common/planner.h"
#include "server/kernels/cpu/cpu_backend.h"
#include "server/kernels/reference_optimizer.h"

namespace shardopt {
namespace {

constexpr int kWorld = 2;

// Parameters of mixed sizes so buckets hold several, with cuts and padding.
std::vector<ParamSpec> Specs(DType dtype) {
  std::vector<ParamSpec> specs;
  const std::vector<std::vector<int64_t>> shapes = {{37, 11}, {37}, {64, 5}, {5}, {300}, {13, 3}};
  for (size_t i = 0; i < shapes.size(); ++i) {
    ParamSpec s;
    s.name = "p" + std::to_string(i);
    s.shape = shapes[i];
    s.dtype = dtype;
    specs.push_back(s);
  }
  return specs;
}

Layout MakeLayout(DType dtype) {
  PlanOptions po;
  po.bucket_cap_elements = 500;  // several buckets
  po.alignment_elements = 8;
  auto l = Plan(Specs(dtype), kWorld, po);
  EXPECT_TRUE(l.ok()) << l.status();
  return *l;
}

struct Buffers {
  torch::Tensor param, grad;
};

Buffers RandomBuffers(const Layout& layout, torch::ScalarType dtype, int seed) {
  torch::manual_seed(seed);
  Buffers b;
  b.param = torch::randn({layout.flat_size()}).to(dtype);
  b.grad = torch::randn({layout.flat_size()}).to(dtype);
  return b;
}

HyperParameters Group(double lr, double wd) {
  HyperParameters hp;
  hp.adam.lr = lr;
  hp.adam.weight_decay = wd;
  hp.sgd.lr = lr;
  hp.sgd.weight_decay = wd;
  hp.sgd.momentum = 0.9;
  return hp;
}

// Runs `steps` steps of the owner for rank `rank` and of the reference on a
// copy, element by element per piece with the piece's group, and compares.
void CheckAgainstReference(OptimizerKind kind, bool two_groups, int rank) {
  const Layout layout = MakeLayout(DType::kFloat32);
  Buffers b = RandomBuffers(layout, torch::kFloat, 7 + rank);
  torch::Tensor ref_param = b.param.clone();
  ShardOwnerOptions o;
  o.kind = kind;
  o.groups = {Group(1e-2, 0.1)};
  if (two_groups) {
    o.groups.push_back(Group(3e-3, 0.0));  // e.g. biases: no decay
    o.param_group = {0, 1, 0, 1, 0, 1};
  }
  auto owner = ShardOwner::Create(layout, rank, o, b.param, b.grad, MakeCpuKernelBackend(1));
  ASSERT_TRUE(owner.ok()) << owner.status();
  // Reference state, per piece.
  const std::vector<Piece> pieces = layout.PiecesOfRank(rank);
  std::vector<std::vector<float>> m(pieces.size()), v(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    m[i].assign(pieces[i].length, 0.f);
    v[i].assign(pieces[i].length, 0.f);
  }
  for (int64_t step = 1; step <= 3; ++step) {
    for (const Bucket& bk : layout.buckets()) ASSERT_TRUE((*owner)->Update(bk.index, step).ok());
    for (size_t i = 0; i < pieces.size(); ++i) {
      const Piece& p = pieces[i];
      const Bucket& bk = layout.buckets()[p.bucket];
      const int64_t off = bk.flat_offset + rank * bk.capacity_per_rank + p.rank_offset;
      HyperParameters hp = o.groups[two_groups ? o.param_group[p.param] : 0];
      UpdateSlice s;
      s.param = ref_param.data_ptr<float>() + off;
      s.grad = b.grad.data_ptr<float>() + off;
      s.state0 = m[i].data();
      s.state1 = v[i].data();
      s.size = p.length;
      if (kind == OptimizerKind::kSgd) {
        ASSERT_TRUE(ReferenceSgdStep(hp.sgd, step, {&s, 1}).ok());
      } else {
        hp.adam.decoupled_weight_decay = kind == OptimizerKind::kAdamW;
        ASSERT_TRUE(ReferenceAdamStep(hp.adam, step, {&s, 1}).ok());
      }
    }
  }
  // Owned elements equal the reference bit for bit; the rest is untouched.
  for (const Piece& p : pieces) {
    const Bucket& bk = layout.buckets()[p.bucket];
    const int64_t off = bk.flat_offset + rank * bk.capacity_per_rank + p.rank_offset;
    ASSERT_EQ(std::memcmp(b.param.data_ptr<float>() + off, ref_param.data_ptr<float>() + off,
                          p.length * sizeof(float)),
              0)
        << "parameter " << p.param << " differs from the reference";
  }
  for (const Piece& p : layout.PiecesOfRank(1 - rank)) {
    const Bucket& bk = layout.buckets()[p.bucket];
    const int64_t off = bk.flat_offset + (1 - rank) * bk.capacity_per_rank + p.rank_offset;
    EXPECT_EQ(std::memcmp(b.param.data_ptr<float>() + off, ref_param.data_ptr<float>() + off,
                          p.length * sizeof(float)),
              0)
        << "another rank's range was modified";
  }
}

TEST(ShardOwnerTest, AdamEqualsReference) {
  for (int r = 0; r < kWorld; ++r) CheckAgainstReference(OptimizerKind::kAdam, false, r);
}
TEST(ShardOwnerTest, AdamWEqualsReference) {
  for (int r = 0; r < kWorld; ++r) CheckAgainstReference(OptimizerKind::kAdamW, false, r);
}
TEST(ShardOwnerTest, SgdMomentumEqualsReference) {
  for (int r = 0; r < kWorld; ++r) CheckAgainstReference(OptimizerKind::kSgd, false, r);
}
TEST(ShardOwnerTest, ParameterGroupsUseTheirOwnHyperParameters) {
  for (OptimizerKind k : {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kSgd}) {
    for (int r = 0; r < kWorld; ++r) CheckAgainstReference(k, true, r);
  }
}

TEST(ShardOwnerTest, Bf16ModelKeepsAnFp32MasterAndRoundsTheModelCopy) {
  const Layout layout = MakeLayout(DType::kBFloat16);
  Buffers b = RandomBuffers(layout, torch::kBFloat16, 3);
  ShardOwnerOptions o;
  o.kind = OptimizerKind::kAdamW;
  auto owner = ShardOwner::Create(layout, 0, o, b.param, b.grad, MakeCpuKernelBackend(1));
  ASSERT_TRUE(owner.ok()) << owner.status();
  for (const Bucket& bk : layout.buckets()) ASSERT_TRUE((*owner)->Update(bk.index, 1).ok());
  for (const Bucket& bk : layout.buckets()) {
    ShardOwner::OwnedSlice s = (*owner)->owned_slice(bk.index);
    torch::Tensor master = torch::from_blob(s.master, {s.size}, torch::kFloat);
    torch::Tensor model = (*owner)->OwnedRange(b.param, bk.index);
    EXPECT_TRUE(torch::equal(master.to(torch::kBFloat16), model));
  }
  const MemoryReport mem = (*owner)->memory();
  EXPECT_EQ(mem.master_bytes, (*owner)->owned_elements() * 4);
  EXPECT_EQ(mem.state_bytes, (*owner)->owned_elements() * 8);
}

TEST(ShardOwnerTest, MemoryReportPerKind) {
  const Layout layout = MakeLayout(DType::kFloat32);
  struct Case {
    OptimizerKind kind;
    double momentum;
    int64_t state_arrays;
    std::vector<std::string> names;
  };
  for (const Case& c : {Case{OptimizerKind::kAdam, 0, 2, {"exp_avg", "exp_avg_sq"}},
                        Case{OptimizerKind::kAdamW, 0, 2, {"exp_avg", "exp_avg_sq"}},
                        Case{OptimizerKind::kSgd, 0.9, 1, {"momentum_buffer"}},
                        Case{OptimizerKind::kSgd, 0.0, 0, {}}}) {
    Buffers b = RandomBuffers(layout, torch::kFloat, 1);
    ShardOwnerOptions o;
    o.kind = c.kind;
    o.groups[0].sgd.momentum = c.momentum;
    auto owner = ShardOwner::Create(layout, 1, o, b.param, b.grad, MakeCpuKernelBackend(1));
    ASSERT_TRUE(owner.ok()) << owner.status();
    int64_t owned = 0;
    for (const Bucket& bk : layout.buckets()) owned += bk.capacity_per_rank;
    EXPECT_EQ((*owner)->owned_elements(), owned);
    EXPECT_EQ((*owner)->memory().state_bytes, owned * 4 * c.state_arrays)
        << OptimizerKindName(c.kind);
    EXPECT_EQ((*owner)->memory().master_bytes, 0);
    EXPECT_EQ((*owner)->state_names(), c.names);
  }
}

TEST(ShardOwnerTest, StagingCopiesBackOnlyWhenAsked) {
  const Layout layout = MakeLayout(DType::kFloat32);
  Buffers b = RandomBuffers(layout, torch::kFloat, 5);
  ShardOwnerOptions o;
  o.kind = OptimizerKind::kAdam;
  auto owner = ShardOwner::Create(layout, 0, o, b.param, b.grad, MakeCpuKernelBackend(1));
  ASSERT_TRUE(owner.ok());
  ASSERT_TRUE((*owner)->Update(0, 1).ok());
  const float before = (*owner)->owned_slice(0).state0[0];
  ASSERT_TRUE((*owner)->StageToHost().ok());
  EXPECT_FALSE((*owner)->StageToHost().ok());
  EXPECT_FALSE((*owner)->Update(0, 2).ok()) << "no update while staged";
  ShardOwner::OwnedSlice s = (*owner)->owned_slice(0);
  EXPECT_NE(s.master, (*owner)->OwnedRange(b.param, 0).data_ptr<float>()) << "host copy";
  s.state0[0] = 42.f;
  s.master[0] = -7.f;
  ASSERT_TRUE((*owner)->EndStaging(false).ok());
  EXPECT_EQ((*owner)->owned_slice(0).state0[0], before) << "a save's staging must not write back";
  ASSERT_TRUE((*owner)->StageToHost().ok());
  s = (*owner)->owned_slice(0);
  s.state0[0] = 42.f;
  s.master[0] = -7.f;
  ASSERT_TRUE((*owner)->EndStaging(true).ok());
  EXPECT_EQ((*owner)->owned_slice(0).state0[0], 42.f);
  EXPECT_EQ((*owner)->OwnedRange(b.param, 0)[0].item<float>(), -7.f);
  EXPECT_FALSE((*owner)->EndStaging(true).ok());
}

TEST(ShardOwnerTest, HyperParametersAreValidatedPerGroup) {
  const Layout layout = MakeLayout(DType::kFloat32);
  Buffers b = RandomBuffers(layout, torch::kFloat, 1);
  ShardOwnerOptions o;
  o.kind = OptimizerKind::kSgd;
  o.groups = {Group(0.1, 0), Group(0.2, 0)};
  o.param_group = {0, 1, 0, 1, 0, 1};
  auto owner = ShardOwner::Create(layout, 0, o, b.param, b.grad, MakeCpuKernelBackend(1));
  ASSERT_TRUE(owner.ok()) << owner.status();
  EXPECT_EQ((*owner)->num_groups(), 2);
  HyperParameters bad = Group(-1, 0);
  absl::Status s = (*owner)->SetGroup(1, bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  HyperParameters no_momentum = Group(0.1, 0);
  no_momentum.sgd.momentum = 0;
  EXPECT_EQ((*owner)->SetGroup(0, no_momentum).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*owner)->SetGroup(2, Group(0.1, 0)).code(), absl::StatusCode::kOutOfRange);
  ASSERT_TRUE((*owner)->SetGroup(1, Group(0.5, 0.01)).ok());
  EXPECT_DOUBLE_EQ((*owner)->group(1).sgd.lr, 0.5);
  (*owner)->SetLearningRate(0.25);
  EXPECT_DOUBLE_EQ((*owner)->group(0).sgd.lr, 0.25);
  EXPECT_DOUBLE_EQ((*owner)->group(1).sgd.lr, 0.25);
  EXPECT_DOUBLE_EQ((*owner)->group(1).sgd.weight_decay, 0.01);

  o.param_group = {0, 1, 0, 1, 0, 2};
  EXPECT_FALSE(ShardOwner::Create(layout, 0, o, b.param, b.grad, MakeCpuKernelBackend(1)).ok());
  o.param_group = {0, 1};
  EXPECT_FALSE(ShardOwner::Create(layout, 0, o, b.param, b.grad, MakeCpuKernelBackend(1)).ok());
  o.param_group.clear();
  EXPECT_FALSE(
      ShardOwner::Create(layout, 0, o, b.param.narrow(0, 0, 10), b.grad, MakeCpuKernelBackend(1))
          .ok());
  EXPECT_FALSE(ShardOwner::Create(layout, 2, o, b.param, b.grad, MakeCpuKernelBackend(1)).ok());
  EXPECT_FALSE(ShardOwner::Create(layout, 0, o, b.param, b.grad, nullptr).ok());
}

}  // namespace
}  // namespace shardopt
