// Huge pages for the data cache's shared blocks (HostCache's huge_pages,
// the daemon's cache_huge_pages): asked for, a block gets them where the
// kernel's shmem THP setting honours the request, and not otherwise. Where
// the setting says no and this test runs as root outside a sandbox (its
// BUILD rule), it switches /sys/kernel/mm/transparent_hugepage/shmem_enabled
// to "advise" (which affects only mappings that ask) and back. Collapsed
// (kCollapse), a block gets them whatever that setting says, where the
// kernel collapses on request (MADV_COLLAPSE, Linux 6.1).
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>

#include "core/cache/cache.h"
#include "gtest/gtest.h"

namespace ckpt {
namespace {

// The kB of huge pages (ShmemPmdMapped) of this process's mapping holding `p`.
int64_t ShmemPmdKb(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  const auto at = reinterpret_cast<uintptr_t>(p);
  bool in = false;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(' ') != std::string::npos &&
        line.find('-') < line.find(' ')) {
      in = lo <= at && at < hi;
      continue;
    }
    int64_t kb = 0;
    if (in && std::sscanf(line.c_str(), "ShmemPmdMapped: %ld kB", &kb) == 1) return kb;
  }
  return -1;
}

TEST(HostCacheHugePages, SharedBlocksGetHugePagesOnlyWhereAskedAndHonoured) {
  constexpr uint64_t kN = 8 << 20;
  auto block_kb = [&](bool huge) {
    HostCache c(4 * kN, nullptr, huge ? CacheHugePages::kAdvise : CacheHugePages::kOff);
    auto pending = c.Reserve(kN, 7);
    EXPECT_NE(pending, nullptr);
    return pending ? ShmemPmdKb(c.PendingData(pending)) : -1;
  };
  EXPECT_EQ(block_kb(false), 0);  // not asked: 4 KiB pages whatever the kernel says
  const std::string knob = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";
  const ShmemHugePages before = ProbeShmemHugePages();
  if (before.honoured) {
    EXPECT_GT(block_kb(true), 0) << "shmem THP: " << before.setting;
    return;
  }
  EXPECT_EQ(block_kb(true), 0) << "shmem THP: " << before.setting;  // asked, not honoured
  // Where this test may (root, a writable knob), the kernel's setting is
  // switched to "advise" (only mappings that ask are affected) and back.
  if (::geteuid() != 0 || ::access(knob.c_str(), W_OK) != 0) {
    GTEST_SKIP() << "shmem THP is '" << before.setting << "' and not ours to change here";
  }
  auto set = [&](const std::string& v) {
    std::ofstream out(knob);
    out << v;
    return static_cast<bool>(out.flush());
  };
  if (!set("advise")) GTEST_SKIP() << "the kernel refused shmem_enabled=advise";
  const ShmemHugePages now = ProbeShmemHugePages();
  const int64_t kb = now.honoured ? block_kb(true) : -1;
  set(before.setting);
  EXPECT_EQ(ProbeShmemHugePages().setting, before.setting);
  EXPECT_TRUE(now.honoured) << now.setting;
  EXPECT_GT(kb, 0);
}

constexpr uint64_t kHuge = 2 << 20;

// A cache in kCollapse mode: a new block is pending until collapsed, which
// stops when go_on says so and resumes where it stopped; the bytes stay;
// a client's aligned mapping of the block's descriptor maps huge pages; a
// block evicted while it is collapsed is held until its step ends and then
// recycled with its huge pages.
TEST(HostCacheHugePages, BlocksCollapsedAfterTheyFillStepByStep) {
  const std::string why_not = ProbeShmemCollapse();
  if (!why_not.empty()) GTEST_SKIP() << "this kernel does not collapse shared memory: " << why_not;
  constexpr uint64_t kN = 4 * kHuge + 12345;  // the tail past the last 2 MiB stays as it is
  HostCache c(4 * kN, nullptr, CacheHugePages::kCollapse);
  EXPECT_EQ(c.huge_pages(), CacheHugePages::kCollapse);
  EXPECT_FALSE(c.HugePagesPending());
  auto pending = c.Reserve(kN, 7);
  ASSERT_NE(pending, nullptr);
  uint8_t* data = c.PendingData(pending);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(data) % kHuge, 0u) << "the block's mapping is aligned";
  for (uint64_t i = 0; i < kN; ++i) data[i] = static_cast<uint8_t>(i * 7 + i / 4096);
  EXPECT_TRUE(c.HugePagesPending());
  c.Publish(pending, "f", FileStamp{}, 0);
  EXPECT_EQ(ShmemPmdKb(data), 0);

  // Two steps, then go_on says stop.
  int asked = 0;
  HostCache::CollapseStats a = c.CollapseHugePages([&] { return ++asked <= 2; });
  EXPECT_TRUE(a.unsupported.empty()) << a.unsupported;
  EXPECT_EQ(a.bytes + a.failed * kHuge, 2 * kHuge);
  EXPECT_EQ(a.blocks, 0u);
  EXPECT_TRUE(c.HugePagesPending());
  // The rest; the entry is evicted while the second call collapses it.
  asked = 0;
  HostCache::CollapseStats b = c.CollapseHugePages([&] {
    if (++asked == 2) {
      EXPECT_EQ(c.EvictPrefix("f").second, 1u);
      EXPECT_EQ(c.blocks(), 1u) << "held while collapsed";
    }
    return true;
  });
  EXPECT_EQ(b.bytes + b.failed * kHuge, 2 * kHuge);
  EXPECT_EQ(b.blocks, 1u);
  EXPECT_FALSE(c.HugePagesPending());
  EXPECT_EQ(c.stats().huge_page_bytes, a.bytes + b.bytes);
  EXPECT_EQ(c.stats().huge_page_failed, a.failed + b.failed);
  bool same = true;
  for (uint64_t i = 0; i < kN && same; ++i) same = data[i] == static_cast<uint8_t>(i * 7 + i / 4096);
  EXPECT_TRUE(same) << "a collapse keeps the bytes";
  if (a.failed + b.failed > 0) GTEST_SKIP() << "no huge page free for " << a.failed + b.failed << " ranges";
  EXPECT_EQ(ShmemPmdKb(data), static_cast<int64_t>(4 * kHuge >> 10));

  // Recycled for the next entry of its size, huge pages and all; a client's
  // aligned read-only mapping of its descriptor maps them whole.
  EXPECT_TRUE(c.HasRecycled(kN, 7));
  auto again = c.Reserve(kN, 7);
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(c.PendingData(again), data);
  EXPECT_FALSE(c.HugePagesPending()) << "a recycled block keeps its huge pages";
  auto exported = c.Export(data, kN, 7);
  ASSERT_TRUE(exported.has_value());
  void* view = MapSharedAligned(exported->fd, kN, PROT_READ);
  ASSERT_NE(view, MAP_FAILED);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(view) % kHuge, 0u);
  uint64_t sum = 0;
  for (uint64_t i = 0; i < kN; i += 4096) sum += static_cast<const uint8_t*>(view)[i];
  EXPECT_GT(sum, 0u);
  EXPECT_EQ(ShmemPmdKb(view), static_cast<int64_t>(4 * kHuge >> 10));
  ::munmap(view, kN);
}

TEST(HostCacheHugePages, NothingPendingUnlessCollapsing) {
  for (CacheHugePages mode : {CacheHugePages::kOff, CacheHugePages::kAdvise}) {
    HostCache c(64 << 20, nullptr, mode);
    auto pending = c.Reserve(8 << 20, 7);
    ASSERT_NE(pending, nullptr);
    c.PendingData(pending);
    EXPECT_FALSE(c.HugePagesPending());
    EXPECT_EQ(c.CollapseHugePages([] { return true; }).bytes, 0u);
  }
  // Blocks under 2 MiB have nothing to collapse.
  HostCache small(64 << 20, nullptr, CacheHugePages::kCollapse);
  auto p = small.Reserve(1 << 20, 7);
  ASSERT_NE(p, nullptr);
  small.PendingData(p);
  EXPECT_FALSE(small.HugePagesPending());
}

}  // namespace
}  // namespace ckpt
