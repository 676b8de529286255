// The one target-range check every destination uses
// (server/delivery/target_ranges.h).
#include "server/delivery/target_ranges.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ckptd {
namespace {

using ::testing::HasSubstr;

std::string Error(const absl::StatusOr<uint64_t>& r) {
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(r.status().message());
}

TEST(TargetRanges, InsideAndApartIsTheEndOfTheLastTarget) {
  const TargetRegion seg{"segment", "segment", 100};
  auto r = CheckTargetRanges("rank 0", seg, {{"a", 40, 60}, {"b", 0, 40}, {"empty", 100, 0}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, 100u);
  EXPECT_EQ(*CheckTargetRanges("rank 0", seg, {}), 0u);
}

TEST(TargetRanges, PastTheEndNamesTheTensorTheBytesAndTheRegion) {
  const std::string m = Error(
      CheckTargetRanges("job 'j' rank 1", {"segment", "segment", 64}, {{"w", 32, 64}}));
  EXPECT_THAT(m, HasSubstr("job 'j' rank 1 tensor 'w' needs bytes [32, 96) of the segment"));
  EXPECT_THAT(m, HasSubstr("(segment too small)"));
  // An offset past the end, and one whose end would wrap.
  Error(CheckTargetRanges("r", {"segment", "segment", 64}, {{"w", 65, 0}}));
  Error(CheckTargetRanges("r", {"segment", "segment", 64}, {{"w", 8, ~0ull}}));
  EXPECT_THAT(Error(CheckTargetRanges("r", {"cuda_ipc buffer 2", "buffer", 8}, {{"w", 0, 9}})),
              HasSubstr("of the cuda_ipc buffer 2 but the cuda_ipc buffer 2 is 8 bytes (buffer "
                        "too small)"));
}

TEST(TargetRanges, OverlapsNameBothTensors) {
  const std::string m = Error(CheckTargetRanges(
      "rank 0", {"segment", "segment", 100}, {{"b", 50, 20}, {"a", 0, 51}, {"c", 80, 20}}));
  EXPECT_THAT(m, HasSubstr("rank 0: two targets overlap in the segment at byte 50: tensor 'a' "
                           "[0, 51) and tensor 'b' [50, 70)"));
  // Empty targets overlap nothing.
  EXPECT_TRUE(CheckTargetRanges("r", {"segment", "segment", 10}, {{"a", 0, 10}, {"z", 5, 0}}).ok());
}

TEST(TargetRanges, AnAddressSpaceRefusesNullAndWrappingAndNamesAddresses) {
  const TargetRegion mem{"process's memory", "memory", std::nullopt};
  EXPECT_THAT(Error(CheckTargetRanges("r", mem, {{"w", 0, 4}})),
              HasSubstr("tensor 'w': process's memory address 0 cannot hold 4 bytes"));
  Error(CheckTargetRanges("r", mem, {{"w", ~0ull - 2, 4}}));
  EXPECT_TRUE(CheckTargetRanges("r", mem, {{"w", 0, 0}, {"v", 4096, 4}}).ok());
  EXPECT_THAT(Error(CheckTargetRanges("r", mem, {{"a", 0x1000, 16}, {"b", 0x1008, 8}})),
              HasSubstr("overlap in the process's memory at address 0x1008"));
}

// The pages a segment's targets touch: rounded out, merged where they touch
// or overlap, sorted; empty ranges touch nothing; an end by 2^64 stays in range.
TEST(PageRuns, RoundsOutMergesAndSorts) {
  using Runs = std::vector<std::pair<uint64_t, uint64_t>>;
  EXPECT_EQ(PageRuns({{8190, 8206}, {0, 4}, {100, 104}, {1 << 20, (1 << 20) + 4}, {500, 500}},
                     4096),
            (Runs{{0, 12288}, {1 << 20, (1 << 20) + 4096}}));
  EXPECT_EQ(PageRuns({{0, 4096}, {4096, 4097}}, 4096), (Runs{{0, 8192}}));  // touching: one run
  EXPECT_EQ(PageRuns({}, 4096), Runs{});
  const uint64_t top = UINT64_MAX / 4096 * 4096;
  EXPECT_EQ(PageRuns({{top - 10, UINT64_MAX}}, 4096), (Runs{{top - 4096, top}}));
  EXPECT_EQ(PageRuns({{UINT64_MAX - 10, UINT64_MAX}}, 4096), Runs{});  // no whole page
}

}  // namespace
}  // namespace ckptd
