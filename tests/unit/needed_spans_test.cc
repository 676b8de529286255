// NeededSpans (core/plan/planner.h): the bytes of each read a node's ranks
// copy from, the byte ranges a multi-node load asks a peer for (issue 34).
// Plans are made by PlanLoad on hand-built metadata; expected spans are
// worked out from the layouts by hand.
#include <cstdint>
#include <random>
#include <vector>

#include "core/plan/planner.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ckpt {
namespace {

using ::testing::ElementsAre;

// One F32 tensor "w" of [rows, cols] stored in one shard at offset 0 of
// "0.safetensors".
CheckpointMetadata OneShard(int64_t rows, int64_t cols) {
  CheckpointMetadata m;
  TensorMeta t;
  t.dtype = DType::kF32;
  t.global_shape = {rows, cols};
  ShardMeta s;
  s.file = "0.safetensors";
  s.box = Box{{0, 0}, {rows, cols}};
  s.dtype = DType::kF32;
  s.nbytes = static_cast<uint64_t>(rows * cols * 4);
  t.shards.push_back(s);
  m.tensors["w"] = t;
  return m;
}

TargetTensor Target(Box box, Shape global) {
  TargetTensor t;
  t.name = "w";
  t.dtype = DType::kF32;
  t.global_shape = std::move(global);
  t.box = std::move(box);
  return t;
}

TEST(NeededSpans, ColumnSliceIsOneSpanPerRow) {
  // [4, 8] F32: a row is 32 bytes; columns [2, 6) are bytes [8, 24) of it.
  auto plan = PlanLoad(OneShard(4, 8), {RankTargets{0, {Target(Box{{0, 2}, {4, 4}}, {4, 8})}}});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->reads.size(), 1u);
  const auto spans = NeededSpans(*plan, 1024);
  ASSERT_EQ(spans.size(), 1u);
  // The read starts at the first needed byte (8): rows at 0, 32, 64, 96.
  EXPECT_THAT(spans[0], ElementsAre(ReadSpan{0, 16}, ReadSpan{32, 48}, ReadSpan{64, 80},
                                    ReadSpan{96, 112}));
  EXPECT_EQ(SpanBytes(spans[0]), 64u);
}

TEST(NeededSpans, RanksOfOneNodeNeedingTheSameBytesCountThemOnce) {
  // Two ranks want the left half, one the right: the left half's spans once,
  // the halves of a row touch and merge into whole rows.
  const Shape g{4, 8};
  auto plan = PlanLoad(OneShard(4, 8), {RankTargets{0, {Target(Box{{0, 0}, {4, 4}}, g)}},
                                        RankTargets{1, {Target(Box{{0, 0}, {4, 4}}, g)}}});
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto spans = NeededSpans(*plan, 1024);
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_THAT(spans[0], ElementsAre(ReadSpan{0, 16}, ReadSpan{32, 48}, ReadSpan{64, 80},
                                    ReadSpan{96, 112}));
  plan = PlanLoad(OneShard(4, 8), {RankTargets{0, {Target(Box{{0, 0}, {4, 4}}, g)}},
                                   RankTargets{1, {Target(Box{{0, 4}, {4, 4}}, g)}}});
  ASSERT_TRUE(plan.ok()) << plan.status();
  spans = NeededSpans(*plan, 1024);
  EXPECT_THAT(spans[0], ElementsAre(ReadSpan{0, 128}));
}

TEST(NeededSpans, MoreSpansThanTheCapCloseTheSmallestGapsFirst) {
  // Rows 0-3, columns [0, 2) and [6, 8) by two ranks: per row spans at
  // [0, 8) and [24, 32); gaps of 16 inside a row, 0 between rows (merged):
  // [0,8) [24,40) [56,72) [88,104) [120,128). A cap of 3 closes the
  // smallest gaps (all 16): one span.
  const Shape g{4, 8};
  auto plan = PlanLoad(OneShard(4, 8), {RankTargets{0, {Target(Box{{0, 0}, {4, 2}}, g)}},
                                        RankTargets{1, {Target(Box{{0, 6}, {4, 2}}, g)}}});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->reads.size(), 1u);
  EXPECT_THAT(NeededSpans(*plan, 100)[0],
              ElementsAre(ReadSpan{0, 8}, ReadSpan{24, 40}, ReadSpan{56, 72}, ReadSpan{88, 104},
                          ReadSpan{120, 128}));
  const auto capped = NeededSpans(*plan, 3)[0];
  EXPECT_LE(capped.size(), 3u);
  EXPECT_THAT(capped, ElementsAre(ReadSpan{0, 128}));
}

TEST(NeededSpans, UnevenGapsKeepTheWidestOpen) {
  // [2, 64] F32 (rows of 256 bytes), read as one range (coalesce_gap):
  // row 0 column 0 [0, 4), row 0 column 63 [252, 256) touching row 1
  // column 0 [256, 260), row 1 column 10 [296, 300): spans [0,4) [252,260)
  // [296,300) with gaps of 248 and 36. A cap of 2 closes the 36, a cap of 1
  // both.
  const Shape g{2, 64};
  PlanOptions po;
  po.coalesce_gap = 1 << 20;
  auto plan = PlanLoad(OneShard(2, 64),
                       {RankTargets{0, {Target(Box{{0, 0}, {1, 1}}, g)}},
                        RankTargets{1, {Target(Box{{0, 63}, {1, 1}}, g)}},
                        RankTargets{2, {Target(Box{{1, 0}, {1, 1}}, g)}},
                        RankTargets{3, {Target(Box{{1, 10}, {1, 1}}, g)}}},
                       po);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->reads.size(), 1u);
  EXPECT_EQ(plan->reads[0].offset, 0u);
  EXPECT_THAT(NeededSpans(*plan, 8)[0],
              ElementsAre(ReadSpan{0, 4}, ReadSpan{252, 260}, ReadSpan{296, 300}));
  EXPECT_THAT(NeededSpans(*plan, 2)[0], ElementsAre(ReadSpan{0, 4}, ReadSpan{252, 300}));
  EXPECT_THAT(NeededSpans(*plan, 1)[0], ElementsAre(ReadSpan{0, 300}));
}

TEST(NeededSpans, AReadNoRankCopiesFromHasNoSpans) {
  LoadPlan plan = *PlanLoad(OneShard(4, 8), {RankTargets{0, {Target(Box{{0, 0}, {4, 8}}, {4, 8})}}});
  plan.ranks[0].copies.clear();
  const auto spans = NeededSpans(plan, 16);
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_TRUE(spans[0].empty());
}

// PackSpans: what a fetcher sends (FetchReadRequest.span_runs).
TEST(PackSpans, AColumnSliceIsOneRun) {
  auto plan = PlanLoad(OneShard(4, 8), {RankTargets{0, {Target(Box{{0, 2}, {4, 4}}, {4, 8})}}});
  ASSERT_TRUE(plan.ok()) << plan.status();
  const auto spans = NeededSpans(*plan, 1024);
  EXPECT_THAT(PackSpans(spans[0]), ElementsAre(SpanRun{0, 16, 32, 4}));
}

TEST(PackSpans, ALengthOrStrideThatChangesStartsANewRun) {
  EXPECT_THAT(PackSpans({}), ElementsAre());
  EXPECT_THAT(PackSpans({{5, 9}}), ElementsAre(SpanRun{5, 4, 0, 1}));
  // 4-byte spans 10 apart, then one 8 bytes long, then 4-byte spans 20 apart.
  EXPECT_THAT(PackSpans({{0, 4}, {10, 14}, {20, 24}, {30, 38}, {50, 54}, {70, 74}, {90, 94}}),
              ElementsAre(SpanRun{0, 4, 10, 3}, SpanRun{30, 8, 0, 1}, SpanRun{50, 4, 20, 3}));
  // Touching spans of one length: a stride equal to the length.
  EXPECT_THAT(PackSpans({{0, 4}, {4, 8}, {8, 12}}), ElementsAre(SpanRun{0, 4, 4, 3}));
}

TEST(PackSpans, RunsExpandToExactlyTheSpansPacked) {
  std::mt19937_64 rng(34);
  for (int trial = 0; trial < 500; ++trial) {
    std::vector<ReadSpan> spans;
    uint64_t at = rng() % 8;
    const int n = static_cast<int>(rng() % 64);
    const uint64_t len = 1 + rng() % 16, gap = rng() % 16;
    for (int i = 0; i < n; ++i) {
      // Mostly regular (one length, one gap), sometimes not.
      const uint64_t l = rng() % 5 == 0 ? 1 + rng() % 16 : len;
      spans.push_back({at, at + l});
      at += l + (rng() % 7 == 0 ? rng() % 32 : gap);
    }
    const std::vector<SpanRun> runs = PackSpans(spans);
    std::vector<ReadSpan> back;
    for (const SpanRun& r : runs) {
      ASSERT_GE(r.count, 1u);
      if (r.count > 1) ASSERT_GE(r.stride, r.length);
      for (uint64_t i = 0; i < r.count; ++i) {
        back.push_back({r.begin + i * r.stride, r.begin + i * r.stride + r.length});
      }
    }
    ASSERT_EQ(back, spans) << "trial " << trial;
    ASSERT_LE(runs.size(), spans.size());
  }
}

}  // namespace
}  // namespace ckpt
