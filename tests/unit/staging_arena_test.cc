// The shard_gradients staging arena's bookkeeping (client/staging_arena.h),
// alone: first-fit placement among buckets' and pieces' regions, freeing,
// compaction and the end of what is held.
#include "client/staging_arena.h"

#include <vector>

#include "gtest/gtest.h"

namespace shardopt {
namespace {

using Region = StagingArena::Region;

StagingArena Arena(int buckets, int64_t size) {
  StagingArena a;
  a.Reset(buckets);
  a.set_size(size);
  return a;
}

TEST(StagingArenaTest, FirstFitFromTheStart) {
  StagingArena a = Arena(3, 100);
  ASSERT_EQ(a.Place(40), 0);
  a.Hold(0, {0, 40});
  ASSERT_EQ(a.Place(40), 40);
  a.Hold(1, {40, 40});
  EXPECT_EQ(a.Place(21), std::nullopt);  // 20 left at the end
  EXPECT_EQ(a.Place(20), 80);
  EXPECT_EQ(a.End(), 80);
  EXPECT_EQ(a.held(), (std::vector<int>{0, 1}));
}

TEST(StagingArenaTest, FreedRoomIsReusedAndHolesAreFilledFirst) {
  StagingArena a = Arena(3, 100);
  a.Hold(0, {0, 30});
  a.Hold(1, {30, 30});
  a.Hold(2, {60, 30});
  a.Free(1);
  EXPECT_EQ(a.Place(30), 30);            // the hole
  EXPECT_EQ(a.Place(31), std::nullopt);  // neither the hole nor the 10 at the end
  EXPECT_EQ(a.region(1).length, 0);
  EXPECT_EQ(a.held(), (std::vector<int>{0, 2}));
  a.Free(1);  // a no-op: it holds nothing
  EXPECT_EQ(a.held(), (std::vector<int>{0, 2}));
}

TEST(StagingArenaTest, PiecesCountAsHeld) {
  StagingArena a = Arena(2, 100);
  a.Hold(0, {0, 40});
  const std::vector<Region> pieces = {{40, 30}, {0, 0} /* none */};
  EXPECT_EQ(a.Place(30, pieces), 70);
  EXPECT_EQ(a.Place(31, pieces), std::nullopt);
  EXPECT_EQ(a.End(pieces), 70);
}

TEST(StagingArenaTest, CompactMovesRegionsDownInOrder) {
  StagingArena a = Arena(4, 100);
  a.Hold(2, {70, 20});
  a.Hold(0, {10, 30});
  a.Hold(3, {40, 5});
  const std::vector<StagingArena::Move> moves = a.Compact();
  ASSERT_EQ(moves.size(), 3u);
  // By position: bucket 0 (10 -> 0), bucket 3 (40 -> 30), bucket 2 (70 -> 35).
  EXPECT_EQ(moves[0].bucket, 0);
  EXPECT_EQ(moves[0].from, 10);
  EXPECT_EQ(moves[0].to, 0);
  EXPECT_EQ(moves[1].bucket, 3);
  EXPECT_EQ(moves[1].to, 30);
  EXPECT_EQ(moves[2].bucket, 2);
  EXPECT_EQ(moves[2].from, 70);
  EXPECT_EQ(moves[2].to, 35);
  for (const auto& m : moves) EXPECT_LE(m.to, m.from);  // copying in order never overwrites
  EXPECT_EQ(a.End(), 55);
  EXPECT_EQ(a.Place(45), 55);
  EXPECT_TRUE(a.Compact().empty());  // already compact
}

TEST(StagingArenaTest, ClearDropsEverythingAndResetKeepsTheSize) {
  StagingArena a = Arena(2, 64);
  a.Hold(0, {0, 32});
  a.Hold(1, {32, 32});
  EXPECT_EQ(a.Place(1), std::nullopt);
  a.Clear();
  EXPECT_TRUE(a.held().empty());
  EXPECT_EQ(a.Place(64), 0);
  a.Hold(1, {0, 8});
  a.Reset(3);
  EXPECT_EQ(a.size(), 64);
  EXPECT_TRUE(a.held().empty());
  EXPECT_EQ(a.region(2).length, 0);
}

TEST(StagingArenaTest, EmptyArenaFitsNothingButZero) {
  StagingArena a = Arena(1, 0);
  EXPECT_EQ(a.Place(1), std::nullopt);
  EXPECT_EQ(a.Place(0), 0);
  a.Hold(0, {0, 0});  // a zero-length region is not held
  EXPECT_TRUE(a.held().empty());
}

}  // namespace
}  // namespace shardopt
