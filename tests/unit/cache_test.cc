#include "core/cache.h"
#include "core/checkpoint.h"
#include "core/planner.h"
#include "core/safetensors.h"

#include <fstream>
#include <numeric>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;

RangeView Put(HostCache& c, const std::string& path, uint64_t off, uint64_t n, uint8_t fill) {
  auto p = c.Reserve(n);
  EXPECT_NE(p, nullptr);
  std::memset(c.PendingData(p), fill, n);
  return c.Publish(std::move(p), path, FileStamp{1, 2, 3, 4}, off);
}

TEST(HostCache, HitsContainedRangesAndEvictsLru) {
  HostCache c(300);
  FileStamp st{1, 2, 3, 4};
  Put(c, "/a", 0, 100, 1);
  Put(c, "/b", 0, 100, 2);
  auto hit = c.Lookup("/a", st, 10, 50);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->data[0], 1);
  EXPECT_FALSE(c.Lookup("/a", st, 50, 60).has_value());   // not contained
  EXPECT_FALSE(c.Lookup("/a", FileStamp{1, 2, 3, 5}, 0, 10).has_value());  // stale stamp
  hit.reset();
  Put(c, "/c", 0, 100, 3);
  Put(c, "/d", 0, 100, 4);  // evicts /b (least recent; /a was touched)
  EXPECT_TRUE(c.Lookup("/a", st, 0, 100).has_value());
  EXPECT_FALSE(c.Lookup("/b", st, 0, 100).has_value());
  CacheStats s = c.stats();
  EXPECT_EQ(s.bytes, 300u);
  EXPECT_EQ(s.evictions, 1u);
}

TEST(HostCache, RecyclesEntryMemoryWithinTheBudget) {
  constexpr uint64_t kMiB = 1 << 20;
  HostCache c(4 * kMiB);
  FileStamp st{1, 2, 3, 4};
  Put(c, "/a", 0, 2 * kMiB, 1);
  Put(c, "/b", 0, 2 * kMiB, 2);
  const uint8_t* a_bytes = c.Lookup("/a", st, 0, 1)->data;
  EXPECT_EQ(c.EvictPrefix("/a").first, 2 * kMiB);
  EXPECT_EQ(c.stats().recycled_bytes, 2 * kMiB);  // kept, already faulted in
  // The next entry of that size gets the same memory back.
  auto p = c.Reserve(2 * kMiB);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(c.PendingData(p), a_bytes);
  EXPECT_EQ(c.stats().recycled_bytes, 0u);
  std::memset(c.PendingData(p), 3, 2 * kMiB);
  c.Publish(std::move(p), "/c", st, 0);
  EXPECT_EQ(c.Lookup("/c", st, 2 * kMiB - 1, 1)->data[0], 3);
  // Recycled blocks count against the budget: published + recycled <= budget.
  c.EvictPrefix("/");
  EXPECT_EQ(c.stats().recycled_bytes, 4 * kMiB);
  Put(c, "/d", 0, 3 * kMiB, 4);
  EXPECT_LE(c.stats().bytes + c.stats().recycled_bytes, 4 * kMiB);
  EXPECT_EQ(c.Lookup("/d", st, 0, 3 * kMiB)->data[3 * kMiB - 1], 4);
}

TEST(HostCache, PinnedEntriesAreNeverEvicted) {
  HostCache c(200);
  FileStamp st{1, 2, 3, 4};
  RangeView a = Put(c, "/a", 0, 100, 1);
  RangeView b = Put(c, "/b", 0, 100, 2);
  EXPECT_EQ(c.Reserve(50), nullptr);  // both pinned
  b = RangeView{};
  auto p = c.Reserve(50);
  ASSERT_NE(p, nullptr);  // /b evicted
  EXPECT_EQ(a.data[99], 1);
  EXPECT_FALSE(c.Lookup("/b", st, 0, 1).has_value());
  p.reset();  // unpublished reservation returns its room
  EXPECT_EQ(c.stats().bytes, 100u);
  EXPECT_NE(c.Reserve(100), nullptr);
}

TEST(HostCache, EvictPrefix) {
  HostCache c(1000);
  Put(c, "/ck/x/0.st", 0, 10, 1);
  Put(c, "/ck/x/1.st", 0, 10, 1);
  Put(c, "/ck/y/0.st", 0, 10, 1);
  auto [bytes, entries] = c.EvictPrefix("/ck/x/");
  EXPECT_EQ(bytes, 20u);
  EXPECT_EQ(entries, 2u);
  EXPECT_EQ(c.Files().size(), 1u);
}

TEST(HostCache, EvictingAPinnedEntryKeepsItsBytesCountedUntilReleased) {
  HostCache c(200);
  FileStamp st{1, 2, 3, 4};
  RangeView a = Put(c, "/ck/run1/0.st", 0, 100, 7);  // a load is using it
  Put(c, "/ck/run10/0.st", 0, 50, 8);
  auto [bytes, entries] = c.EvictPrefix("/ck/run1/");  // by component: run10 stays
  EXPECT_EQ(bytes, 100u);
  EXPECT_EQ(entries, 1u);
  EXPECT_FALSE(c.Lookup("/ck/run1/0.st", st, 0, 1).has_value());  // never served again
  EXPECT_TRUE(c.Lookup("/ck/run10/0.st", st, 0, 1).has_value());
  EXPECT_EQ(a.data[42], 7);  // the load's bytes stay valid
  // The memory is still held: it counts in the figures and against the budget.
  EXPECT_EQ(c.stats().bytes, 150u);
  // 150 would fit beside run10's 50 were run1's 100 not still held.
  EXPECT_EQ(c.Reserve(150), nullptr);  // (evicts the unpinned run10 trying)
  EXPECT_EQ(c.stats().bytes, 100u);
  a = RangeView{};  // the load lets go: the memory and its count are gone
  EXPECT_EQ(c.stats().bytes, 0u);
  EXPECT_NE(c.Reserve(200), nullptr);
}

TEST(CachingSource, DetectsChangedFiles) {
  testing::TempDir tmp;
  {
    std::ofstream f(tmp.Sub("d.bin"));
    f << std::string(64, 'a');
  }
  auto stamp = StatFile(tmp.Sub("d.bin"));
  ASSERT_TRUE(stamp.ok());
  HostCache cache(1 << 20);
  std::vector<uint8_t> scratch;
  // A verified read is kept (a read without a verify function would not be).
  auto verified = [](const uint8_t*) { return absl::OkStatus(); };
  {
    CachingSource src(tmp.path(), &cache, {{"d.bin", *stamp}});
    auto v = src.Fetch("d.bin", 0, 64, scratch, verified);
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_TRUE(v->from_storage);
    auto again = src.Fetch("d.bin", 8, 8, scratch, nullptr);
    ASSERT_TRUE(again.ok());
    EXPECT_FALSE(again->from_storage);
  }
  {
    std::ofstream f(tmp.Sub("d.bin"), std::ios::app);
    f << "more";
  }
  CachingSource src(tmp.path(), &cache, {{"d.bin", *stamp}});
  auto v = src.Fetch("d.bin", 0, 8, scratch, nullptr);
  ASSERT_FALSE(v.ok());
  EXPECT_THAT(std::string(v.status().message()), HasSubstr("d.bin: file changed"));
}

}  // namespace
}  // namespace ckpt

namespace ckpt {
namespace {

TEST(Executor, DeadlineStopsTheLoad) {
  testing::TempDir tmp;
  std::vector<float> w(1024, 1.f);
  ASSERT_TRUE(WriteSafetensors(tmp.Sub("model.safetensors"), {{"w", DType::kF32, {1024}, w.data()}}, {}).ok());
  auto ck = OpenCheckpoint(tmp.path());
  ASSERT_TRUE(ck.ok());
  RankTargets rt{0, {TargetTensor{"w", DType::kF32, {1024}, Box{{0}, {1024}}, std::nullopt}}};
  PlanOptions po;
  po.max_read_bytes = 512;  // several reads
  auto plan = PlanLoad(ck->metadata, {rt}, po);
  ASSERT_TRUE(plan.ok());
  std::vector<float> out(1024);
  DirectorySource src(tmp.path());
  ExecuteOptions eo;
  eo.deadline = std::chrono::steady_clock::now() - std::chrono::seconds(1);
  auto st = ExecutePlan(*plan, src, {{out.data()}}, eo);
  EXPECT_EQ(st.status().code(), absl::StatusCode::kDeadlineExceeded) << st.status();
  eo.deadline.reset();
  EXPECT_TRUE(ExecutePlan(*plan, src, {{out.data()}}, eo).ok());
  EXPECT_EQ(out[1023], 1.f);
}

}  // namespace
}  // namespace ckpt
