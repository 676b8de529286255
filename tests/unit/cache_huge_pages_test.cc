// Huge pages for the data cache's shared blocks (HostCache's huge_pages,
// the daemon's cache_huge_pages): asked for, a block gets them where the
// kernel's shmem THP setting honours the request, and not otherwise. Where
// the setting says no and this test runs as root outside a sandbox (its
// BUILD rule), it switches /sys/kernel/mm/transparent_hugepage/shmem_enabled
// to "advise" (which affects only mappings that ask) and back.
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
    HostCache c(4 * kN, nullptr, huge);
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

}  // namespace
}  // namespace ckpt
