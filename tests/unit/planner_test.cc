// Tests of the greedy partition planner (common/planner.h).
#include "common/planner.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "tools/models/model_shapes.h"
#include "gtest/gtest.h"

namespace shardopt {
namespace {

ModelShapes Load(const std::string& name) {
  auto shapes = LoadModelShapes("tests/fixtures/" + name);
  EXPECT_TRUE(shapes.ok()) << shapes.status();
  return *shapes;
}

int64_t Numel(const ParamSpec& p) {
  int64_t n = 1;
  for (int64_t d : p.shape) n *= d;
  return n;
}

ParamSpec P(const std::string& name, std::vector<int64_t> shape, bool trainable = true) {
  ParamSpec s;
  s.name = name;
  s.shape = std::move(shape);
  s.trainable = trainable;
  return s;
}

// Checks every structural promise of a Layout. Returns the number of failures
// so callers in loops can stop early.
void ExpectValidLayout(const Layout& layout) {
  const int n = layout.world_size();
  const auto& params = layout.params();
  SCOPED_TRACE(layout.Summary());

  // Frozen parameters have no placement; trainable ones are in exactly one bucket.
  std::vector<int> seen(params.size(), 0);
  for (const Bucket& b : layout.buckets()) {
    for (int p : b.params) ++seen[p];
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].trainable) {
      EXPECT_EQ(seen[i], 0) << params[i].name;
      EXPECT_EQ(layout.placement(i).bucket, -1) << params[i].name;
      EXPECT_FALSE(layout.Locate(i, 0, 0).ok());
    } else {
      ASSERT_EQ(seen[i], 1) << params[i].name;
    }
  }

  // Buckets follow reverse registration order: every parameter of bucket b was
  // registered after every parameter of bucket b+1.
  for (size_t b = 0; b + 1 < layout.buckets().size(); ++b) {
    const auto& cur = layout.buckets()[b].params;
    const auto& next = layout.buckets()[b + 1].params;
    EXPECT_GT(*std::min_element(cur.begin(), cur.end()),
              *std::max_element(next.begin(), next.end()));
  }

  int64_t flat = 0;
  std::vector<int64_t> owned(n, 0);
  for (const Bucket& b : layout.buckets()) {
    EXPECT_EQ(b.flat_offset, flat);
    flat += b.capacity_per_rank * n;
    EXPECT_EQ(b.capacity_per_rank % layout.options().alignment_elements, 0);
    EXPECT_LE(b.num_elements, layout.options().bucket_cap_elements > b.num_elements
                                  ? layout.options().bucket_cap_elements
                                  : b.num_elements);
    if (b.params.size() > 1) {
      EXPECT_LE(b.num_elements, layout.options().bucket_cap_elements);
    }
    // Parameters are contiguous and disjoint in the bucket: sorted by offset,
    // each ends before the next begins, all inside the buffer.
    int64_t end = 0;
    int64_t sum = 0;
    int cut = 0;
    for (int p : b.params) {
      const ParamPlacement& pl = layout.placement(p);
      EXPECT_EQ(pl.bucket, b.index);
      EXPECT_EQ(pl.numel, Numel(params[p]));
      EXPECT_GE(pl.bucket_offset, end) << params[p].name << " overlaps its predecessor";
      end = pl.bucket_offset + pl.numel;
      sum += pl.numel;
      // Every element owned exactly once: the pieces tile the parameter.
      auto pieces = layout.Locate(p, 0, pl.numel);
      ASSERT_TRUE(pieces.ok()) << pieces.status();
      int64_t next = 0;
      for (const Piece& piece : *pieces) {
        EXPECT_EQ(piece.param_offset, next);
        EXPECT_GT(piece.length, 0);
        EXPECT_GE(piece.rank, 0);
        EXPECT_LT(piece.rank, n);
        EXPECT_LE(piece.rank_offset + piece.length, b.capacity_per_rank);
        // Contiguity: the piece sits exactly where the parameter's span says.
        EXPECT_EQ(piece.rank * b.capacity_per_rank + piece.rank_offset,
                  pl.bucket_offset + piece.param_offset);
        owned[piece.rank] += piece.length;
        next += piece.length;
      }
      EXPECT_EQ(next, pl.numel);
      if (pieces->size() > 1) ++cut;
    }
    EXPECT_LE(end, b.capacity_per_rank * n);
    EXPECT_EQ(sum, b.num_elements);
    EXPECT_EQ(cut, b.num_cut);
    EXPECT_LE(b.num_cut, n - 1) << "bucket " << b.index;
    if (!layout.options().allow_cut) EXPECT_EQ(b.num_cut, 0);
  }
  EXPECT_EQ(flat, layout.flat_size());
  EXPECT_EQ(owned, layout.owned_elements());
  int64_t trainable = 0;
  for (const auto& p : params) {
    if (p.trainable) trainable += Numel(p);
  }
  EXPECT_EQ(std::accumulate(owned.begin(), owned.end(), int64_t{0}), trainable);

  // PiecesOfRank partitions AllPieces.
  size_t total_pieces = 0;
  for (int r = 0; r < std::min(n, 8); ++r) {
    for (const Piece& piece : layout.PiecesOfRank(r)) EXPECT_EQ(piece.rank, r);
  }
  for (int r = 0; r < n; ++r) total_pieces += layout.PiecesOfRank(r).size();
  EXPECT_EQ(total_pieces, layout.AllPieces().size());
}

TEST(PlannerTest, SmallExampleIsPlacedWholeLargestFirst) {
  // Registration order a, b, c, d; one bucket; 2 ranks, alignment 1.
  std::vector<ParamSpec> params = {P("a", {6}), P("b", {4}), P("c", {3}), P("d", {3})};
  PlanOptions opt;
  opt.alignment_elements = 1;
  auto layout = Plan(params, 2, opt);
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_EQ(layout->buckets().size(), 1u);
  const Bucket& b = layout->buckets()[0];
  EXPECT_EQ(b.capacity_per_rank, 8);
  // Largest first, ties in bucket (reverse registration) order: a(6) -> rank 0,
  // b(4) -> rank 1, d(3) -> rank 1 (free 4 > 2), c(3) fits whole nowhere (free
  // 2 and 1) and is streamed: cut at the rank boundary.
  auto locate = [&](const std::string& name) {
    return *layout->Locate(*layout->FindParam(name), 0, Numel(params[*layout->FindParam(name)]));
  };
  EXPECT_EQ(locate("a").size(), 1u);
  EXPECT_EQ(locate("a")[0].rank, 0);
  EXPECT_EQ(locate("b")[0].rank, 1);
  EXPECT_EQ(locate("d")[0].rank, 1);
  auto d = locate("c");
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d[0].rank, 0);
  EXPECT_EQ(d[0].length, 2);
  EXPECT_EQ(d[1].rank, 1);
  EXPECT_EQ(d[1].length, 1);
  EXPECT_EQ(d[1].rank_offset, 0);  // continues at the start of rank 1's range
  EXPECT_EQ(layout->owned_elements(), (std::vector<int64_t>{8, 8}));
  EXPECT_EQ(layout->num_cut_tensors(), 1);
  EXPECT_DOUBLE_EQ(layout->imbalance(), 1.0);
  ExpectValidLayout(*layout);
}

TEST(PlannerTest, BucketsFollowReverseRegistrationOrderUpToTheCap) {
  std::vector<ParamSpec> params = {P("w0", {10}), P("w1", {10}), P("w2", {10}), P("big", {50}),
                                   P("w4", {10})};
  PlanOptions opt;
  opt.bucket_cap_elements = 25;
  opt.alignment_elements = 1;
  auto layout = Plan(params, 2, opt);
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_EQ(layout->buckets().size(), 4u);
  auto ids = [&](int b) {
    auto v = layout->buckets()[b].params;
    std::sort(v.begin(), v.end());
    return v;
  };
  EXPECT_EQ(ids(0), (std::vector<int>{4}));     // w4 alone: w4 + big > cap
  EXPECT_EQ(ids(1), (std::vector<int>{3}));     // a tensor over the cap gets its own bucket
  EXPECT_EQ(ids(2), (std::vector<int>{1, 2}));  // w2, w1
  EXPECT_EQ(ids(3), (std::vector<int>{0}));
  ExpectValidLayout(*layout);
}

TEST(PlannerTest, FrozenParametersAreExcluded) {
  std::vector<ParamSpec> params = {P("a", {100}), P("frozen", {1000}, false), P("b", {50}),
                                   P("empty_frozen", {0}, false)};
  auto layout = Plan(params, 3);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->num_elements(), 150);
  EXPECT_EQ(layout->placement(1).bucket, -1);
  EXPECT_EQ(layout->Locate(1, 0, 1).status().code(), absl::StatusCode::kFailedPrecondition);
  ExpectValidLayout(*layout);
}

TEST(PlannerTest, LocateSplitsRangesAtRankBoundaries) {
  std::vector<ParamSpec> params = {P("huge", {1000})};
  PlanOptions opt;
  opt.alignment_elements = 8;
  auto layout = Plan(params, 3, opt);
  ASSERT_TRUE(layout.ok());
  // capacity = roundup(334, 8) = 336: ranks own [0,336), [336,672), [672,1000).
  auto pieces = layout->Locate(0, 300, 700);
  ASSERT_TRUE(pieces.ok());
  ASSERT_EQ(pieces->size(), 3u);
  EXPECT_EQ((*pieces)[0], (Piece{0, 300, 36, 0, 0, 300}));
  EXPECT_EQ((*pieces)[1], (Piece{0, 336, 336, 0, 1, 0}));
  EXPECT_EQ((*pieces)[2], (Piece{0, 672, 28, 0, 2, 0}));
  EXPECT_EQ(layout->Locate(0, 5, 5)->size(), 0u);
  EXPECT_EQ(layout->Locate(0, 10, 1001).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(layout->Locate(0, 10, 5).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(layout->Locate(7, 0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(layout->FindParam("nope").status().code(), absl::StatusCode::kNotFound);
  ExpectValidLayout(*layout);
}

TEST(PlannerTest, CarriedTensorLongerThanFreeSpaceStaysContiguous) {
  // One tensor larger than a rank's capacity next to small ones: the ranks it
  // passes through give their whole tensors back to the stream.
  std::vector<ParamSpec> params;
  for (int i = 0; i < 40; ++i) params.push_back(P(absl::StrCat("small", i), {7 + i % 5}));
  params.push_back(P("embedding", {900}));
  for (int i = 0; i < 40; ++i) params.push_back(P(absl::StrCat("late", i), {11 + i % 3}));
  for (int n : {2, 3, 4, 5, 8, 16, 33}) {
    PlanOptions opt;
    opt.alignment_elements = 4;
    auto layout = Plan(params, n, opt);
    ASSERT_TRUE(layout.ok()) << layout.status();
    ExpectValidLayout(*layout);
    EXPECT_LT(layout->padding_elements(), n * 4);
  }
}

TEST(PlannerTest, IsDeterministic) {
  ModelShapes gpt2 = Load("gpt2_small_params.json");
  for (int n : {1, 3, 8, 64}) {
    auto a = Plan(gpt2.params, n);
    auto b = Plan(gpt2.params, n);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->hash(), b->hash());
    EXPECT_EQ(a->AllPieces(), b->AllPieces());
  }
  auto two = Plan(gpt2.params, 2);
  auto four = Plan(gpt2.params, 4);
  EXPECT_NE(two->hash(), four->hash());
  PlanOptions whole;
  whole.allow_cut = false;
  EXPECT_NE(Plan(gpt2.params, 4, whole)->hash(), four->hash());
  // A renamed parameter changes the hash (ranks must agree on the model too).
  auto renamed = gpt2.params;
  renamed[5].name = "renamed";
  EXPECT_NE(Plan(renamed, 4)->hash(), four->hash());
  // The hash is a fixed function of the input: pin one value so that a change
  // to the encoding (which would break mixed-version jobs) is noticed.
  std::vector<ParamSpec> tiny = {P("w", {10, 10}), P("b", {10})};
  EXPECT_EQ(Plan(tiny, 2)->hash(), Plan(tiny, 2)->hash());
}

TEST(PlannerTest, WorldSizesOneTo1024) {
  ModelShapes resnet = Load("resnet101_params.json");
  std::vector<ParamSpec> params = resnet.params;
  // Interleave the batch-norm buffers as frozen entries.
  params.insert(params.end(), resnet.buffers.begin(), resnet.buffers.end());
  std::vector<int> sizes;
  for (int n = 1; n <= 40; ++n) sizes.push_back(n);
  for (int n : {63, 64, 65, 100, 127, 128, 255, 256, 500, 511, 512, 777, 1000, 1023, 1024}) {
    sizes.push_back(n);
  }
  for (int n : sizes) {
    SCOPED_TRACE(absl::StrCat("world size ", n));
    PlanOptions opt;
    opt.bucket_cap_elements = 4 * 1024 * 1024;  // several buckets
    auto layout = Plan(params, n, opt);
    ASSERT_TRUE(layout.ok()) << layout.status();
    ExpectValidLayout(*layout);
    EXPECT_EQ(layout->num_elements(), 44549160);
    for (size_t b = 0; b < layout->buckets().size(); ++b) {
      EXPECT_LT(layout->padding_elements(b), n * opt.alignment_elements);
    }
    if (::testing::Test::HasFailure()) break;
  }
}

struct FixtureCase {
  const char* file;
  int64_t total;
};

class RealModelTest : public ::testing::TestWithParam<std::tuple<FixtureCase, int>> {};

TEST_P(RealModelTest, BalancedWithPaddingOnlyForAlignment) {
  const auto [fixture, n] = GetParam();
  ModelShapes model = Load(fixture.file);
  auto layout = Plan(model.params, n);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->num_elements(), fixture.total);
  EXPECT_EQ(model.total_parameters, fixture.total);
  ExpectValidLayout(*layout);
  EXPECT_LE(layout->imbalance(), 1.001) << layout->Summary();
  for (size_t b = 0; b < layout->buckets().size(); ++b) {
    EXPECT_LT(layout->padding_elements(b), n * layout->options().alignment_elements);
  }
  // Most tensors stay whole: at most N-1 cut per bucket.
  EXPECT_LE(layout->num_cut_tensors(), static_cast<int>(layout->buckets().size()) * (n - 1));
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, RealModelTest,
    ::testing::Combine(::testing::Values(FixtureCase{"resnet101_params.json", 44549160},
                                         FixtureCase{"gpt2_small_params.json", 124439808}),
                       ::testing::Values(2, 4, 8, 64)));

TEST(PlannerTest, Gpt2EmbeddingIsCutNotUnbalancing) {
  ModelShapes gpt2 = Load("gpt2_small_params.json");
  const int emb = 0;  // wte.weight, 50257 x 768 = 38,597,376 elements > the default cap
  for (int n : {2, 4, 8}) {
    auto layout = Plan(gpt2.params, n);
    ASSERT_TRUE(layout.ok());
    const ParamPlacement& pl = layout->placement(emb);
    // Bucket of its own (it exceeds the cap), spread evenly over all ranks.
    EXPECT_EQ(layout->buckets()[pl.bucket].params, std::vector<int>{emb});
    EXPECT_EQ(layout->Locate(emb, 0, pl.numel)->size(), static_cast<size_t>(n));
  }
  // With one big bucket the embedding fits whole on a rank for N = 2.
  PlanOptions one_bucket;
  one_bucket.bucket_cap_elements = int64_t{1} << 30;
  auto two = Plan(gpt2.params, 2, one_bucket);
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(two->Locate(emb, 0, two->placement(emb).numel)->size(), 1u);
  EXPECT_LE(two->imbalance(), 1.001);
  for (int n : {4, 8, 64}) {
    auto layout = Plan(gpt2.params, n, one_bucket);
    ASSERT_TRUE(layout.ok());
    ExpectValidLayout(*layout);
    EXPECT_LE(layout->imbalance(), 1.001);
    EXPECT_LT(layout->padding_elements(), n * 64);
  }
}

TEST(PlannerTest, ForbiddingCutsShowsTheEmbeddingImbalance) {
  ModelShapes gpt2 = Load("gpt2_small_params.json");
  PlanOptions whole;
  whole.allow_cut = false;
  whole.bucket_cap_elements = 25 * 1024 * 1024;  // the figures below (README) are for 25 Mi
  // The 38.6M-element embedding sits alone in its bucket and must go whole to
  // one rank: that rank owns it plus its share of everything else.
  // owned(max) = 38,597,376 + its share of the other 85,842,432 elements.
  const double total = 124439808.0;
  const double emb = 38597376.0;
  for (int n : {2, 4, 8, 64}) {
    SCOPED_TRACE(absl::StrCat("world size ", n));
    auto layout = Plan(gpt2.params, n, whole);
    ASSERT_TRUE(layout.ok());
    ExpectValidLayout(*layout);
    EXPECT_EQ(layout->num_cut_tensors(), 0);
    // Lower bound: the embedding's owner holds at least the embedding.
    EXPECT_GE(layout->imbalance(), emb / (total / n));
    // The embedding bucket alone pads N-1 ranks up to 38.6M elements each.
    EXPECT_GE(layout->padding_elements(), static_cast<int64_t>(emb) * (n - 1));
  }
  // The figures (also in the README). Each bucket is balanced on its own (the
  // collectives need equal ranges per bucket), so the embedding's owner also
  // carries a full share of every other bucket:
  //   N=2: (38.60M + 85.84M/2) / 62.22M = 1.313;  N=4: 1.943;  N=8: 3.429;  N=64: 24.70.
  EXPECT_NEAR(Plan(gpt2.params, 2, whole)->imbalance(), 1.3133, 1e-3);
  EXPECT_NEAR(Plan(gpt2.params, 4, whole)->imbalance(), 1.9431, 1e-3);
  EXPECT_NEAR(Plan(gpt2.params, 8, whole)->imbalance(), 3.4293, 1e-3);
  EXPECT_NEAR(Plan(gpt2.params, 64, whole)->imbalance(), 24.704, 1e-2);
  // Cutting allowed: the same model is balanced to 0.1%.
  EXPECT_LE(Plan(gpt2.params, 8)->imbalance(), 1.001);
}

TEST(PlannerTest, BadInputIsAnErrorNotACrash) {
  std::vector<ParamSpec> ok = {P("w", {4, 4})};
  auto code = [](const absl::StatusOr<Layout>& l) { return l.status().code(); };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(code(Plan(ok, 0)), kInvalid);
  EXPECT_EQ(code(Plan(ok, -3)), kInvalid);
  EXPECT_EQ(code(Plan(ok, kMaxWorldSize + 1)), kInvalid);
  EXPECT_EQ(code(Plan({}, 2)), kInvalid);
  EXPECT_EQ(code(Plan({P("frozen", {3}, false)}, 2)), kInvalid);
  EXPECT_EQ(code(Plan({P("zero", {4, 0})}, 2)), kInvalid);
  EXPECT_EQ(code(Plan({P("neg", {4, -1})}, 2)), kInvalid);
  EXPECT_EQ(code(Plan({P("absurd", {int64_t{1} << 30, int64_t{1} << 30, 16})}, 2)), kInvalid);
  EXPECT_EQ(code(Plan({P("overflow", {int64_t{1} << 62, 8})}, 2)), kInvalid);
  std::vector<ParamSpec> many;
  for (int i = 0; i < 40; ++i) many.push_back(P(absl::StrCat("p", i), {int64_t{1} << 39}));
  EXPECT_EQ(code(Plan(many, 2)), kInvalid);  // total beyond kMaxTotalElements
  EXPECT_EQ(code(Plan({P("", {3})}, 2)), kInvalid);
  EXPECT_EQ(code(Plan({P(std::string(5000, 'x'), {3})}, 2)), kInvalid);
  EXPECT_EQ(code(Plan({P("dup", {3}), P("dup", {4})}, 2)), kInvalid);
  PlanOptions opt;
  opt.bucket_cap_elements = 0;
  EXPECT_EQ(code(Plan(ok, 2, opt)), kInvalid);
  opt = PlanOptions();
  opt.alignment_elements = 0;
  EXPECT_EQ(code(Plan(ok, 2, opt)), kInvalid);
  opt.alignment_elements = 48;  // not a power of two
  EXPECT_EQ(code(Plan(ok, 2, opt)), kInvalid);
  // Messages say what is wrong.
  EXPECT_NE(Plan(ok, 0).status().message().find("world size"), absl::string_view::npos);
  EXPECT_NE(Plan({P("zero", {0})}, 1).status().message().find("'zero'"), absl::string_view::npos);
  // A scalar parameter (shape []) is one element and valid.
  EXPECT_TRUE(Plan({P("scalar", {})}, 4).ok());
}

TEST(PlannerTest, MoreRanksThanElements) {
  auto layout = Plan({P("a", {3}), P("b", {2})}, 1024);
  ASSERT_TRUE(layout.ok());
  ExpectValidLayout(*layout);
  EXPECT_EQ(layout->num_elements(), 5);
}

}  // namespace
}  // namespace shardopt
