// server/memory_budget: reading cgroup memory limits (v1 and v2, the
// smallest over the cgroup's ancestors) from a fake /sys/fs/cgroup, and
// fitting the daemon's budgets into a limit.
#include "server/policy/memory_budget.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ckptd {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr uint64_t kGiB = 1ull << 30;

class FakeSysfs {
 public:
  FakeSysfs() {
    const char* t = std::getenv("TEST_TMPDIR");
    root_ = fs::path(t != nullptr ? t : "/tmp") / ("cgroup-" + std::to_string(counter_++));
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void Write(const std::string& rel, const std::string& text) {
    fs::path p = root_ / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  std::string root() const { return root_.string(); }

 private:
  static inline int counter_ = 0;
  fs::path root_;
};

TEST(CgroupMemoryLimit, V2TakesTheSmallestOverAncestors) {
  FakeSysfs s;
  s.Write("kubepods.slice/memory.max", "25769803776\n");       // 24 GiB: the pod's QoS slice
  s.Write("kubepods.slice/pod1/memory.max", "max\n");           // no limit of its own
  s.Write("kubepods.slice/pod1/ckptd/memory.max", "34359738368\n");  // 32 GiB
  auto l = CgroupMemoryLimit("0::/kubepods.slice/pod1/ckptd\n", s.root());
  ASSERT_TRUE(l.has_value());
  EXPECT_EQ(l->bytes, 24 * kGiB);
  EXPECT_EQ(l->source, s.root() + "/kubepods.slice/memory.max");
}

TEST(CgroupMemoryLimit, V2NamespacedRootAndNoLimit) {
  FakeSysfs s;
  s.Write("memory.max", "6442450944\n");  // a container's own cgroup at the root
  auto l = CgroupMemoryLimit("0::/\n", s.root());
  ASSERT_TRUE(l.has_value());
  EXPECT_EQ(l->bytes, 6 * kGiB);
  FakeSysfs none;
  none.Write("a/memory.max", "max\n");
  EXPECT_FALSE(CgroupMemoryLimit("0::/a\n", none.root()).has_value());
  EXPECT_FALSE(CgroupMemoryLimit("", none.root()).has_value());
  EXPECT_FALSE(CgroupMemoryLimit("garbage\n0::relative\n", none.root()).has_value());
}

TEST(CgroupMemoryLimit, V1MemoryControllerAndItsNoLimitValue) {
  FakeSysfs s;  // this machine's layout: v1 memory controller, v2 without it
  s.Write("memory/process_api/memory.limit_in_bytes", "9223372036854771712\n");
  s.Write("memory/process_api/x1/memory.limit_in_bytes", "8589934592\n");
  auto l = CgroupMemoryLimit("9:name=systemd:/\n4:memory:/process_api/x1\n0::/\n", s.root());
  ASSERT_TRUE(l.has_value());
  EXPECT_EQ(l->bytes, 8 * kGiB);
  FakeSysfs free;
  free.Write("memory/process_api/memory.limit_in_bytes", "9223372036854771712\n");
  EXPECT_FALSE(CgroupMemoryLimit("4:memory:/process_api\n", free.root()).has_value());
}

TEST(PhysicalMemory, ReadsMemTotal) {
  auto m = PhysicalMemory("MemFree: 1 kB\nMemTotal:       24576000 kB\n");
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->bytes, 24576000ull * 1024);
  EXPECT_FALSE(PhysicalMemory("MemTotal: lots\n").has_value());
  EXPECT_FALSE(PhysicalMemory("").has_value());
}

// save_buffer keeps its default (8 GiB) unless `save` is given.
DaemonConfig Config(uint64_t cache, uint64_t arena, uint64_t stream,
                    std::set<std::string> set_keys, uint64_t save = 0) {
  DaemonConfig c;
  c.cache_budget = cache;
  c.arena_limit = arena;
  c.limits.max_stream_bytes = stream;
  if (save > 0) c.save_buffer = save;
  c.set_keys = std::move(set_keys);
  return c;
}

TEST(FitMemoryBudgets, FittingBudgetsStayAsTheyAre) {
  DaemonConfig c = Config(16 * kGiB, 4 * kGiB, 2 * kGiB,
                          {"cache_budget", "arena_limit", "save_buffer"}, 1 * kGiB);
  std::vector<std::string> notes;
  ASSERT_TRUE(FitMemoryBudgets(&c, {24 * kGiB, "test"}, &notes).ok());  // 23 + 1 room
  EXPECT_EQ(c.cache_budget, 16 * kGiB);
  EXPECT_EQ(c.arena_limit, 4 * kGiB);
  EXPECT_TRUE(notes.empty());
}

TEST(FitMemoryBudgets, SetKeysThatDoNotFitAreRefusedByName) {
  // The shipped DaemonSet before this check: 16 GiB cache, the 64 GiB default
  // arena_limit, a 24 GiB limit. With arena_limit set it cannot shrink.
  DaemonConfig c = Config(16 * kGiB, 64 * kGiB, 4 * kGiB, {"cache_budget", "arena_limit"});
  std::vector<std::string> notes;
  absl::Status s = FitMemoryBudgets(&c, {24 * kGiB, "/sys/fs/cgroup/pod/memory.max"}, &notes);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("cache_budget 16 GiB (set) + arena_limit 64 GiB (set) + save_buffer 8 GiB "
                        "(default) + limits.max_stream_bytes 4 GiB (default) + 1 GiB working room "
                        "= 93 GiB > 24 GiB (/sys/fs/cgroup/pod/memory.max)"));
  EXPECT_EQ(c.arena_limit, 64 * kGiB);  // unchanged
}

TEST(FitMemoryBudgets, DefaultArenaLimitGivesWayFirst) {
  // cache_budget 16 GiB and save_buffer 2 GiB set, a 24 GiB limit.
  DaemonConfig c = Config(16 * kGiB, 64 * kGiB, 4 * kGiB, {"cache_budget", "save_buffer"},
                          2 * kGiB);
  std::vector<std::string> notes;
  ASSERT_TRUE(FitMemoryBudgets(&c, {24 * kGiB, "test"}, &notes).ok());
  EXPECT_EQ(c.cache_budget, 16 * kGiB);  // set: kept
  EXPECT_EQ(c.save_buffer, 2 * kGiB);    // set: kept
  EXPECT_EQ(c.limits.max_stream_bytes, 4 * kGiB);  // not needed
  EXPECT_EQ(c.arena_limit, 1 * kGiB);  // 24 - 16 - 2 - 4 - 1 working room
  EXPECT_EQ(c.arena_pool, 1 * kGiB);   // no more than arena_limit
  ASSERT_EQ(notes.size(), 2u);
  EXPECT_EQ(notes[0], "arena_limit not set: 1 GiB instead of its default 64 GiB to fit 24 GiB (test)");
}

TEST(FitMemoryBudgets, DefaultsShrinkAlikeWhenArenaLimitIsNotEnough) {
  DaemonConfig c = Config(20 * kGiB, 64 * kGiB, 4 * kGiB, {"cache_budget"});
  std::vector<std::string> notes;
  ASSERT_TRUE(FitMemoryBudgets(&c, {24 * kGiB, "test"}, &notes).ok());
  EXPECT_EQ(c.cache_budget, 20 * kGiB);  // set: kept
  // 24 - 20 - 1 = 3 GiB left for arena_limit (64), save_buffer (8) and
  // max_stream_bytes (4), shared in proportion.
  const uint64_t scaled = c.arena_limit + c.save_buffer + c.limits.max_stream_bytes;
  EXPECT_LE(scaled, 3 * kGiB);
  EXPECT_GT(scaled, 3 * kGiB - (3ull << 20));
  EXPECT_NEAR(static_cast<double>(c.arena_limit) / c.limits.max_stream_bytes, 16.0, 0.1);
  EXPECT_NEAR(static_cast<double>(c.save_buffer) / c.limits.max_stream_bytes, 2.0, 0.05);
  EXPECT_LE(c.arena_pool, c.arena_limit);
  ASSERT_EQ(notes.size(), 4u);
  EXPECT_THAT(notes[1], HasSubstr("save_buffer not set: "));
  EXPECT_THAT(notes[2], HasSubstr("limits.max_stream_bytes not set: "));
}

TEST(FitMemoryBudgets, NothingLeftForTheDefaultsIsRefused) {
  DaemonConfig c = Config(23 * kGiB, 64 * kGiB, 4 * kGiB, {"cache_budget"});
  std::vector<std::string> notes;
  absl::Status s = FitMemoryBudgets(&c, {24 * kGiB, "test"}, &notes);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("cache_budget 23 GiB (set)"));
  // A small machine: the working room is an eighth of the limit.
  DaemonConfig small = Config(4ull << 30, 64 * kGiB, 4 * kGiB, {});
  ASSERT_TRUE(FitMemoryBudgets(&small, {2 * kGiB, "test"}, &notes).ok());
  EXPECT_LE(small.cache_budget + small.arena_limit + small.save_buffer +
                small.limits.max_stream_bytes,
            2 * kGiB - 256 * (1ull << 20));
}

}  // namespace
}  // namespace ckptd
