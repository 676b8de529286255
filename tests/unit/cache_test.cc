#include "core/cache/cache.h"
#include "core/cache/cache_view.h"
#include "core/format/checkpoint.h"
#include "core/exec/process_memory.h"
#include "core/plan/planner.h"
#include "core/format/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;

RangeView Put(HostCache& c, const std::string& path, uint64_t off, uint64_t n, uint8_t fill,
              uint32_t tenant = kNoTenant) {
  auto p = c.Reserve(n, tenant);
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

// --- Export: cache blocks a client maps read-only (core/cache/cache_view.h) -------

constexpr uint64_t kBlock = 1 << 20;

TEST(HostCacheExport, GivesAReadOnlyDescriptorOfTheEntrysBlockThatCannotChangeIt) {
  HostCache c(8 * kBlock);
  RangeView v = Put(c, "/a", 0, kBlock, 5, /*tenant=*/7);
  EXPECT_FALSE(c.Export(v.data, 10, kNoTenant).has_value());  // nobody in particular
  std::vector<uint8_t> scratch(64);
  EXPECT_FALSE(c.Export(scratch.data(), 64, 7).has_value());  // not cache memory
  EXPECT_FALSE(c.Export(v.data + kBlock - 4, 8, 7).has_value());  // past the block's end
  std::optional<ExportedRange> r = c.Export(v.data + 4096, 100, 7);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->offset, 4096u);
  EXPECT_EQ(r->block_bytes, kBlock);
  EXPECT_EQ(r->block_data, v.data);
  // What a client gets: read-only, mode 0400, sealed against resizing.
  EXPECT_EQ(::fcntl(r->fd, F_GETFL) & O_ACCMODE, O_RDONLY);
  struct stat st;
  ASSERT_EQ(::fstat(r->fd, &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0400u);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), kBlock);
  const int seals = ::fcntl(r->fd, F_GET_SEALS);
  EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW), F_SEAL_SHRINK | F_SEAL_GROW);
  EXPECT_EQ(::mmap(nullptr, kBlock, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd, 0), MAP_FAILED);
  EXPECT_EQ(errno, EACCES);
  EXPECT_NE(::ftruncate(r->fd, 0), 0);
  EXPECT_NE(::fallocate(r->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096), 0);
  EXPECT_LT(::pwrite(r->fd, "x", 1, 0), 0);
  void* m = ::mmap(nullptr, kBlock, PROT_READ, MAP_SHARED, r->fd, 0);
  ASSERT_NE(m, MAP_FAILED);
  EXPECT_EQ(static_cast<uint8_t*>(m)[4096], 5);  // the entry's bytes
  EXPECT_NE(::mprotect(m, kBlock, PROT_READ | PROT_WRITE), 0);
  // A holder of the daemon's uid (which owns the memfd) makes it writable
  // again and reopens it read-write through /proc: the seal still refuses
  // every write and every writable mapping, and further seals.
  EXPECT_EQ(seals & (F_SEAL_FUTURE_WRITE | F_SEAL_SEAL), F_SEAL_FUTURE_WRITE | F_SEAL_SEAL);
  ASSERT_EQ(::fchmod(r->fd, 0600), 0);
  const int rw = ::open(("/proc/self/fd/" + std::to_string(r->fd)).c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(rw, 0) << std::strerror(errno);
  EXPECT_LT(::pwrite(rw, "x", 1, 4096), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(::mmap(nullptr, kBlock, PROT_READ | PROT_WRITE, MAP_SHARED, rw, 0), MAP_FAILED);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(::fallocate(rw, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096), 0);
  EXPECT_NE(::fcntl(rw, F_ADD_SEALS, F_SEAL_WRITE), 0);
  ::close(rw);
  EXPECT_EQ(static_cast<uint8_t*>(m)[4096], 5);  // unchanged
  // The daemon's own mapping, made before the seal, still fills it.
  const_cast<uint8_t*>(v.data)[4096] = 6;
  EXPECT_EQ(static_cast<uint8_t*>(m)[4096], 6);
  ::munmap(m, kBlock);
}

TEST(HostCacheExport, ABlockIsRecycledOnlyForTheTenantItWasExportedTo) {
  HostCache c(8 * kBlock);
  FileStamp st{1, 2, 3, 4};
  RangeView v = Put(c, "/a", 0, kBlock, 1, 7);
  const uint8_t* block = v.data;
  c.Export(v.data, kBlock, 7).reset();  // shown to tenant 7, then let go
  v = RangeView{};
  c.EvictPrefix("/a");
  EXPECT_TRUE(c.HasRecycled(kBlock, 7));
  EXPECT_FALSE(c.HasRecycled(kBlock, 8));          // its bytes could show through 7's mapping
  EXPECT_FALSE(c.HasRecycled(kBlock, kNoTenant));
  RangeView w = Put(c, "/b", 0, kBlock, 2, 8);     // another tenant: new memory
  EXPECT_NE(w.data, block);
  RangeView x = Put(c, "/c", 0, kBlock, 3, 7);     // tenant 7: its own block back
  EXPECT_EQ(x.data, block);
  // A never-exported block goes to anyone.
  w = RangeView{};
  c.EvictPrefix("/b");
  EXPECT_TRUE(c.HasRecycled(kBlock, 9));
  EXPECT_TRUE(c.HasRecycled(kBlock, kNoTenant));
  EXPECT_TRUE(c.Lookup("/c", st, 0, 1).has_value());
}

// Its pages cannot be punched out (the write seal refuses that too): a
// client's mapping keeps the bytes it was shown, and nothing is ever written
// there again.
TEST(HostCacheExport, ABlockShownToTwoTenantsIsClosedWhenFreedAndNeverWrittenAgain) {
  HostCache c(8 * kBlock);
  RangeView v = Put(c, "/a", 0, kBlock, 9, 7);
  std::optional<ExportedRange> r7 = c.Export(v.data, kBlock, 7);
  std::optional<ExportedRange> r8 = c.Export(v.data, kBlock, 8);
  ASSERT_TRUE(r7 && r8);
  // A client's mapping of it, kept after its load.
  void* m = ::mmap(nullptr, kBlock, PROT_READ, MAP_SHARED, r7->fd, 0);
  ASSERT_NE(m, MAP_FAILED);
  const auto* seen = static_cast<const uint8_t*>(m);
  EXPECT_EQ(seen[100], 9);
  const uint64_t blocks = c.blocks();
  v = RangeView{};
  c.EvictPrefix("/a");
  // Held by the exports: neither recycled nor punched yet.
  EXPECT_FALSE(c.HasRecycled(kBlock, 7));
  EXPECT_EQ(seen[100], 9);
  EXPECT_EQ(c.blocks(), blocks);
  r7->hold.reset();
  EXPECT_EQ(seen[100], 9);
  r8->hold.reset();  // the last hold: the block goes
  EXPECT_EQ(c.blocks(), blocks - 1);
  EXPECT_FALSE(c.HasRecycled(kBlock, 7));
  EXPECT_FALSE(c.HasRecycled(kBlock, 8));
  EXPECT_EQ(seen[100], 9);  // what it was shown, nothing newer
  RangeView w = Put(c, "/b", 0, kBlock, 3, 7);  // the next entry: other memory
  EXPECT_EQ(w.data[100], 3);
  EXPECT_EQ(seen[100], 9);
  ::munmap(m, kBlock);
}

TEST(HostCacheExport, AHeldBlockIsNotRecycledUntilLetGo) {
  HostCache c(8 * kBlock);
  RangeView v = Put(c, "/a", 0, kBlock, 4, 7);
  std::optional<ExportedRange> r = c.Export(v.data + 10, 10, 7);
  ASSERT_TRUE(r.has_value());
  v = RangeView{};
  c.EvictPrefix("/a");  // the entry goes; the client still copies from it
  EXPECT_FALSE(c.HasRecycled(kBlock, 7));
  EXPECT_EQ(r->block_data[10], 4);
  EXPECT_FALSE(c.Export(r->block_data, 10, 7).has_value());  // freed: no new exports
  // Still memory: counted, and against the budget.
  EXPECT_EQ(c.stats().bytes, kBlock);
  EXPECT_EQ(c.Reserve(8 * kBlock, 7), nullptr);
  r->hold.reset();
  EXPECT_EQ(c.stats().bytes, 0u);
  EXPECT_TRUE(c.HasRecycled(kBlock, 7));
  EXPECT_NE(c.Reserve(8 * kBlock, 7), nullptr);  // the free block is trimmed for it
}

// ProcessMemory::Write (process_vm_writev into this process): runs whose
// destinations follow each other go as one remote iovec, across its 1,024
// entry calls; every byte lands where its pair says, none elsewhere.
TEST(ProcessMemory, StridedRunsIntoContiguousAndScatteredDestinationsExactly) {
  auto self = ProcessMemory::Open({::getpid(), "this test"});
  ASSERT_TRUE(self.ok()) << self.status();
  constexpr int kRows = 3000;  // three calls' worth of pairs
  std::vector<uint8_t> src(kRows * 256);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 13 + 5);
  std::vector<uint8_t> dst(kRows * 64 + 4096, 0);
  std::vector<iovec> local, remote;
  // Rows 0-1999 back to back at dst[0...); rows 2000-2999 each one byte
  // further apart (no two remote runs touch).
  for (int r = 0; r < kRows; ++r) {
    const size_t to = r < 2000 ? 64 * r : 64 * r + (r - 1999);
    local.push_back({src.data() + 256 * r, 64});
    remote.push_back({dst.data() + to, 64});
  }
  ASSERT_TRUE((*self)->Write(local.data(), remote.data(), local.size()).ok());
  std::vector<uint8_t> want(dst.size(), 0);
  for (int r = 0; r < kRows; ++r) {
    const size_t to = r < 2000 ? 64 * r : 64 * r + (r - 1999);
    std::memcpy(want.data() + to, src.data() + 256 * r, 64);
  }
  EXPECT_EQ(dst, want);
}

// Short local runs are gathered before the call (up to 256 KiB a call) and
// long ones go as they are, mixed in one write: rows of 64, 1500 and 2048
// bytes, then 64 again, more than one gathered call's worth; every byte lands
// where its pair says. A destination that is not mapped fails, naming the
// process.
TEST(ProcessMemory, ShortRunsGatheredLongRunsAsTheyAreMixedExactly) {
  auto self = ProcessMemory::Open({::getpid(), "this test"});
  ASSERT_TRUE(self.ok()) << self.status();
  std::vector<size_t> lens;
  for (int r = 0; r < 5000; ++r) lens.push_back(64);  // 320,000 bytes: two calls
  for (int r = 0; r < 300; ++r) lens.push_back(1500);
  for (int r = 0; r < 40; ++r) lens.push_back(2048);  // not gathered
  for (int r = 0; r < 100; ++r) lens.push_back(64);
  size_t total = 0;
  for (size_t n : lens) total += n;
  std::vector<uint8_t> src(lens.size() * 4096);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 31 + 7);
  std::vector<uint8_t> dst(total + lens.size(), 0), want(dst.size(), 0);
  std::vector<iovec> local, remote;
  size_t to = 0;
  for (size_t r = 0; r < lens.size(); ++r) {
    local.push_back({src.data() + 4096 * r, lens[r]});
    remote.push_back({dst.data() + to, lens[r]});
    std::memcpy(want.data() + to, src.data() + 4096 * r, lens[r]);
    to += lens[r] + (r % 7 == 0 ? 1 : 0);  // now and then a gap
  }
  ASSERT_TRUE((*self)->Write(local.data(), remote.data(), local.size()).ok());
  EXPECT_EQ(dst, want);

  // 64-byte rows whose destination runs into an unmapped page.
  const long page = ::sysconf(_SC_PAGESIZE);
  void* m = ::mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(m, MAP_FAILED);
  ASSERT_EQ(::munmap(static_cast<uint8_t*>(m) + page, page), 0);
  auto* base = static_cast<uint8_t*>(m);
  local.clear();
  remote.clear();
  for (long r = 0; r < page / 64 + 4; ++r) {
    local.push_back({src.data() + 4096 * r, 64});
    remote.push_back({base + 64 * r, 64});
  }
  absl::Status bad = (*self)->Write(local.data(), remote.data(), local.size());
  EXPECT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.message()), ::testing::HasSubstr("this test: process_vm_writev"));
  ::munmap(m, page);
}

// ViewRecorder over a real cache and this process's own memory as the
// fallback (process_vm_writev into itself).
TEST(ViewRecorder, RecordsCachedRunsCoalescedAndWritesTheRest) {
  HostCache c(8 * kBlock);
  RangeView v = Put(c, "/a", 0, kBlock, 0, 7);
  auto* src = const_cast<uint8_t*>(v.data);
  for (uint64_t i = 0; i < kBlock; ++i) src[i] = static_cast<uint8_t>(i * 7 + 1);
  auto self = ProcessMemory::Open({::getpid(), "this test"});
  ASSERT_TRUE(self.ok()) << self.status();
  std::shared_ptr<RemoteMemory> fallback(std::move(*self));
  std::vector<uint8_t> t1(4096, 0), t2(4096, 0);
  const auto a1 = reinterpret_cast<uint64_t>(t1.data());
  const auto a2 = reinterpret_cast<uint64_t>(t2.data());
  ViewRecorder rec(&c, 7, fallback, {{a2, a2 + t2.size()}, {a1, a1 + t1.size()}});
  // Rows of 64 bytes every 256 bytes of the block into t1 (one run split in
  // two, as at a read piece's end), then t2's first row continuing the same
  // strides (must not join t1's copy), and 100 bytes from outside the cache.
  std::vector<iovec> local, remote;
  auto add = [&](const uint8_t* p, uint64_t n, uint64_t to) {
    local.push_back({const_cast<uint8_t*>(p), n});
    remote.push_back({reinterpret_cast<void*>(to), n});
  };
  add(src, 32, a1);
  add(src + 32, 32, a1 + 32);
  for (int r = 1; r < 64; ++r) add(src + 256 * r, 64, a1 + 64 * r);
  ASSERT_TRUE(rec.Write(local.data(), remote.data(), local.size()).ok());
  local.clear();
  remote.clear();
  add(src + 256 * 64, 64, a2);
  std::vector<uint8_t> scratch(100, 0xab);
  add(scratch.data(), 100, a2 + 1000);
  ASSERT_TRUE(rec.Write(local.data(), remote.data(), local.size()).ok());
  EXPECT_EQ(rec.bytes_recorded(), 65u * 64);
  EXPECT_EQ(rec.bytes_written(), 100u);
  EXPECT_EQ(t2[1000], 0xab);  // written by the fallback
  EXPECT_EQ(t1[0], 0);        // recorded, not written
  ASSERT_EQ(rec.views().size(), 1u);
  EXPECT_EQ(rec.views()[0].bytes, kBlock);
  const std::vector<ViewRecorder::Copy> copies = rec.copies();
  ASSERT_EQ(copies.size(), 2u);
  EXPECT_EQ(copies[0].offset, 0u);
  EXPECT_EQ(copies[0].address, a1);
  EXPECT_EQ(copies[0].length, 64u);
  EXPECT_EQ(copies[0].count, 64u);
  EXPECT_EQ(copies[0].src_stride, 256u);
  EXPECT_EQ(copies[0].dst_stride, 64u);
  EXPECT_EQ(copies[1].address, a2);
  EXPECT_EQ(copies[1].count, 1u);
  // Applying the copies as a client would gives the block's bytes.
  for (const auto& cp : copies) {
    for (uint64_t i = 0; i < cp.count; ++i) {
      std::memcpy(reinterpret_cast<void*>(cp.address + i * cp.dst_stride),
                  src + cp.offset + i * cp.src_stride, cp.length);
    }
  }
  for (int r = 0; r < 64; ++r) {
    ASSERT_EQ(std::memcmp(&t1[64 * r], src + 256 * r, 64), 0) << "row " << r;
  }
  EXPECT_EQ(std::memcmp(t2.data(), src + 256 * 64, 64), 0);
  // Released: the block goes back to the cache (evicted, let go: recyclable).
  v = RangeView{};
  c.EvictPrefix("/a");
  EXPECT_FALSE(c.HasRecycled(kBlock, 7));
  rec.Release();
  EXPECT_TRUE(c.HasRecycled(kBlock, 7));
}

// A client copying while the plan runs: each batch holds the copies recorded
// since the last one, with its own numbering of the views they read, and a
// run continuing a copy already handed out starts a new one.
TEST(ViewRecorder, BatchesHandOutEachCopyOnceAndNotifyWhenEnoughWaits) {
  HostCache c(8 * kBlock);
  RangeView va = Put(c, "/a", 0, kBlock, 3, 7);
  RangeView vb = Put(c, "/b", 0, kBlock, 4, 7);
  std::vector<uint8_t> t(4096, 0);
  const auto at = reinterpret_cast<uint64_t>(t.data());
  ViewRecorder rec(&c, 7, nullptr, {{at, at + t.size()}});
  int notified = 0;
  rec.NotifyWhenPending(128, [&] { ++notified; });
  auto write = [&](const uint8_t* p, uint64_t n, uint64_t to) {
    iovec l{const_cast<uint8_t*>(p), n}, r{reinterpret_cast<void*>(to), n};
    ASSERT_TRUE(rec.Write(&l, &r, 1).ok());
  };
  write(va.data, 64, at);  // 64 bytes waiting: under 128
  EXPECT_EQ(notified, 0);
  write(va.data + 64, 64, at + 64);  // 128: due
  EXPECT_EQ(notified, 1);
  write(vb.data, 64, at + 1024);  // still due, told once
  EXPECT_EQ(notified, 1);
  ViewRecorder::Batch b1 = rec.TakeBatch();
  ASSERT_EQ(b1.views.size(), 2u);
  ASSERT_EQ(b1.copies.size(), 2u);  // /a's two runs joined, /b's run
  EXPECT_EQ(b1.bytes, 192u);
  EXPECT_FALSE(b1.files);
  EXPECT_EQ(b1.copies[0].length, 128u);
  EXPECT_EQ(b1.views[b1.copies[1].view].key, rec.views()[1].key);
  // /b's next run continues its copy of the first batch: a copy of its own,
  // read from view 0 of this batch (the only view it holds).
  write(vb.data + 64, 64, at + 1088);
  write(vb.data + 128, 64, at + 1152);
  EXPECT_EQ(notified, 2);
  ViewRecorder::Batch b2 = rec.TakeBatch();
  ASSERT_EQ(b2.views.size(), 1u);
  EXPECT_EQ(b2.views[0].key, rec.views()[1].key);
  ASSERT_EQ(b2.copies.size(), 1u);
  EXPECT_EQ(b2.copies[0].view, 0u);
  EXPECT_EQ(b2.copies[0].offset, 64u);
  EXPECT_EQ(b2.copies[0].length, 128u);
  EXPECT_EQ(rec.TakeBatch().copies.size(), 0u);  // nothing new
  EXPECT_EQ(rec.copies().size(), 3u);            // every copy recorded, once
  EXPECT_EQ(rec.bytes_recorded(), 320u);
  rec.Release();
  EXPECT_TRUE(rec.TakeBatch().views.empty());  // let go: nothing to hand out
}

// Two ranks' halves of every 4 KiB row of two 2 MiB entries (a tensor split
// on dim 1 of a checkpoint split on dim 0): the first load takes them in
// pieces and leaves work that gathers each rank's bytes into a laid-out
// copy; a load recording the very same pieces gets one copy per target from
// it, with the same bytes; a load of other bytes (an entry read again: new
// serials) does not; and a laid-out copy takes only budget left free.
TEST(ViewRecorder, GathersPiecesIntoALaidOutCopyServedToTheSameRecipeOnly) {
  constexpr uint64_t kEntry = 2 * kBlock, kRow = 4096, kRows = kEntry / kRow;
  HostCache c(16 * kBlock);
  RangeView e0 = Put(c, "/ck/f0", 0, kEntry, 0, 7);
  RangeView e1 = Put(c, "/ck/f1", 0, kEntry, 0, 7);
  for (uint64_t i = 0; i < kEntry; ++i) {
    const_cast<uint8_t*>(e0.data)[i] = static_cast<uint8_t>(i * 13 + 1);
    const_cast<uint8_t*>(e1.data)[i] = static_cast<uint8_t>(i * 29 + 5);
  }
  // Rank 1's two targets: the second halves of e0's and e1's rows.
  std::vector<uint8_t> ta(kEntry / 2), tb(kEntry / 2);
  struct Load {
    ViewRecorder::Batch batch;
    uint64_t laid_out = 0;
    bool wants = false;
    ViewRecorder::Work work;
  };
  auto load = [&](const RangeView& a, const RangeView& b, std::vector<uint8_t>& da,
                  std::vector<uint8_t>& db) {
    const auto aa = reinterpret_cast<uint64_t>(da.data());
    const auto ab = reinterpret_cast<uint64_t>(db.data());
    // In the request's order (a, b), whatever the addresses' order.
    ViewRecorder rec(&c, 7, nullptr, {{aa, aa + da.size()}, {ab, ab + db.size()}});
    rec.EnableLaidOut("/ck");
    for (const auto& [src, to] : {std::pair{a.data, aa}, std::pair{b.data, ab}}) {
      std::vector<iovec> l, r;
      for (uint64_t row = 0; row < kRows; ++row) {
        l.push_back({const_cast<uint8_t*>(src) + row * kRow + kRow / 2, kRow / 2});
        r.push_back({reinterpret_cast<void*>(to + row * kRow / 2), kRow / 2});
      }
      EXPECT_TRUE(rec.Write(l.data(), r.data(), l.size()).ok());
    }
    Load out;
    out.batch = rec.TakeBatch(/*last=*/true);
    // Applied as a client would (its own mappings stand in for the views).
    for (const ViewRecorder::Copy& cp : out.batch.copies) {
      const ViewRecorder::View& v = out.batch.views[cp.view];
      void* m = ::mmap(nullptr, v.bytes, PROT_READ, MAP_SHARED, v.fd, 0);
      EXPECT_NE(m, MAP_FAILED);
      for (uint64_t i = 0; i < cp.count; ++i) {
        std::memcpy(reinterpret_cast<void*>(cp.address + i * cp.dst_stride),
                    static_cast<const uint8_t*>(m) + cp.offset + i * cp.src_stride, cp.length);
      }
      ::munmap(m, v.bytes);
    }
    out.laid_out = rec.bytes_laid_out();
    rec.Release();
    out.wants = rec.WantsLaidOut();
    out.work = rec.TakeLaidOutWork();
    return out;
  };
  auto expect_halves = [&](const RangeView& a, const RangeView& b) {
    for (uint64_t row = 0; row < kRows; ++row) {
      ASSERT_EQ(std::memcmp(&ta[row * kRow / 2], a.data + row * kRow + kRow / 2, kRow / 2), 0);
      ASSERT_EQ(std::memcmp(&tb[row * kRow / 2], b.data + row * kRow + kRow / 2, kRow / 2), 0);
    }
  };
  Load first = load(e0, e1, ta, tb);
  EXPECT_EQ(first.laid_out, 0u);
  EXPECT_EQ(first.batch.copies.size(), 2u);  // one strided copy per target
  expect_halves(e0, e1);
  EXPECT_TRUE(first.wants);
  ASSERT_TRUE(first.work);
  first.work({});
  EXPECT_EQ(c.stats().laid_out_entries, 1u);
  EXPECT_EQ(c.stats().laid_out_bytes, kEntry);
  EXPECT_EQ(c.Files().size(), 2u);  // the checkpoint's files only

  // The same pieces into new memory (another address order): one contiguous
  // copy per target out of the laid-out copy, the same bytes, no new work.
  std::vector<uint8_t> tb2(kEntry / 2), ta2(kEntry / 2);
  std::swap(ta, ta2);
  std::swap(tb, tb2);
  Load second = load(e0, e1, ta, tb);
  EXPECT_EQ(second.laid_out, kEntry);
  ASSERT_EQ(second.batch.copies.size(), 2u);
  ASSERT_EQ(second.batch.views.size(), 1u);
  for (const ViewRecorder::Copy& cp : second.batch.copies) {
    EXPECT_EQ(cp.count, 1u);
    EXPECT_EQ(cp.length, kEntry / 2);
  }
  EXPECT_EQ(second.batch.copies[0].address, reinterpret_cast<uint64_t>(ta.data()));
  expect_halves(e0, e1);
  EXPECT_FALSE(second.wants);
  EXPECT_FALSE(second.work);
  EXPECT_EQ(c.stats().laid_out_hits, 1u);

  // f1 read again (a new entry, new serial): the recipe differs, pieces again.
  RangeView e1b = Put(c, "/ck/f1", 0, kEntry, 9, 7);
  std::fill(ta.begin(), ta.end(), 0);
  std::fill(tb.begin(), tb.end(), 0);
  Load third = load(e0, e1b, ta, tb);
  EXPECT_EQ(third.laid_out, 0u);
  expect_halves(e0, e1b);
  EXPECT_TRUE(third.wants);
  ASSERT_TRUE(third.work);

  // No room to spare (a laid-out copy evicts nothing): no second copy.
  third.work({});
  third.work({});  // made already: not again
  EXPECT_EQ(c.stats().laid_out_entries, 2u);
  EXPECT_EQ(c.stats().laid_out_bytes, 2 * kEntry);
  // Laid-out copies go first when room is needed (not the older f0), and
  // with their checkpoint.
  Put(c, "/other", 0, 7 * kBlock, 1);
  EXPECT_EQ(c.stats().laid_out_entries, 1u);
  EXPECT_TRUE(c.Lookup("/ck/f0", FileStamp{1, 2, 3, 4}, 0, kEntry).has_value());
  EXPECT_EQ(c.ReserveFree(2 * kBlock, 7), nullptr);
  c.EvictPrefix("/ck/");
  EXPECT_EQ(c.stats().laid_out_entries, 0u);
  EXPECT_EQ(c.stats().laid_out_bytes, 0u);
}

// A target copied in one piece has nothing to gather: WantsLaidOut says so
// (the daemon queues no work for it, and the blocks kept for one go).
TEST(ViewRecorder, WantsNoLaidOutCopyOfATargetTakenWhole) {
  constexpr uint64_t kEntry = 2 * kBlock;
  HostCache c(4 * kBlock);
  RangeView e = Put(c, "/ck/f0", 0, kEntry, 0, 7);
  std::vector<uint8_t> t(kEntry);
  const auto at = reinterpret_cast<uint64_t>(t.data());
  ViewRecorder rec(&c, 7, nullptr, {{at, at + t.size()}});
  rec.EnableLaidOut("/ck");
  iovec l{const_cast<uint8_t*>(e.data), kEntry}, r{t.data(), kEntry};
  ASSERT_TRUE(rec.Write(&l, &r, 1).ok());
  ViewRecorder::Batch batch = rec.TakeBatch(/*last=*/true);
  ASSERT_EQ(batch.copies.size(), 1u);
  rec.Release();
  EXPECT_FALSE(rec.WantsLaidOut());
  EXPECT_FALSE(rec.TakeLaidOutWork());
}

// Writes `contents` to `name` in `tmp` and returns the file's stamp.
FileStamp WriteStamped(const testing::TempDir& tmp, const std::string& name,
                       const std::string& contents) {
  {
    std::ofstream f(tmp.Sub(name));
    f << contents;
  }
  auto stamp = StatFile(tmp.Sub(name));
  EXPECT_TRUE(stamp.ok()) << stamp.status();
  return stamp.value_or(FileStamp{});
}

// A cold load's clients read their pieces from the files (file views); the
// work it leaves, run after the fill that cached those files, gathers them
// from the cache, and the next (warm) load of the same pieces is served
// from that laid-out copy. Run before the fill, it gathers nothing.
TEST(ViewRecorder, ACopyIsGatheredFromFileViewsOnceTheFillCachedThem) {
  constexpr uint64_t kEntry = 2 * kBlock, kRow = 4096, kRows = kEntry / kRow;
  const FileStamp st{1, 2, 3, 4};  // Put's
  testing::TempDir tmp;
  WriteStamped(tmp, "f", "x");
  HostCache c(16 * kBlock);
  std::vector<uint8_t> ta(kEntry / 2), tb(kEntry / 2);
  const auto aa = reinterpret_cast<uint64_t>(ta.data());
  const auto ab = reinterpret_cast<uint64_t>(tb.data());
  auto cold = [&] {
    ViewRecorder rec(&c, 7, nullptr, {{aa, aa + ta.size()}, {ab, ab + tb.size()}});
    rec.EnableLaidOut("/ck");
    uint64_t key = 0;
    for (const auto& [path, to] : {std::pair{"/ck/f0", aa}, std::pair{"/ck/f1", ab}}) {
      std::vector<ViewRecorder::FileRun> runs;
      for (uint64_t row = 0; row < kRows; ++row) {
        runs.push_back({row * kRow + kRow / 2, to + row * kRow / 2, kRow / 2});
      }
      const int fd = ::open(tmp.Sub("f").c_str(), O_RDONLY | O_CLOEXEC);
      EXPECT_TRUE(rec.RecordFile(key++, fd, kEntry, path, st, runs));
    }
    EXPECT_EQ(rec.TakeBatch(/*last=*/true).copies.size(), 2u);
    rec.Release();
    return rec.TakeLaidOutWork();
  };
  ViewRecorder::Work early = cold();
  ASSERT_TRUE(early);
  early({});  // the files' bytes are not in the cache yet
  EXPECT_EQ(c.stats().laid_out_entries, 0u);

  ViewRecorder::Work work = cold();
  RangeView f0 = Put(c, "/ck/f0", 0, kEntry, 3, 7);  // the fill
  RangeView f1 = Put(c, "/ck/f1", 0, kEntry, 0, 7);
  for (uint64_t i = 0; i < kEntry; ++i) const_cast<uint8_t*>(f1.data)[i] = static_cast<uint8_t>(i);
  ASSERT_TRUE(work);
  work({});
  EXPECT_EQ(c.stats().laid_out_entries, 1u);

  // The warm load: the same pieces out of the fill's blocks.
  ViewRecorder rec(&c, 7, nullptr, {{aa, aa + ta.size()}, {ab, ab + tb.size()}});
  rec.EnableLaidOut("/ck");
  for (const auto& [src, to] : {std::pair{f0.data, aa}, std::pair{f1.data, ab}}) {
    std::vector<iovec> l, r;
    for (uint64_t row = 0; row < kRows; ++row) {
      l.push_back({const_cast<uint8_t*>(src) + row * kRow + kRow / 2, kRow / 2});
      r.push_back({reinterpret_cast<void*>(to + row * kRow / 2), kRow / 2});
    }
    ASSERT_TRUE(rec.Write(l.data(), r.data(), l.size()).ok());
  }
  ViewRecorder::Batch b = rec.TakeBatch(/*last=*/true);
  EXPECT_EQ(rec.bytes_laid_out(), kEntry);
  ASSERT_EQ(b.views.size(), 1u);
  ASSERT_EQ(b.copies.size(), 2u);
  void* m = ::mmap(nullptr, b.views[0].bytes, PROT_READ, MAP_SHARED, b.views[0].fd, 0);
  ASSERT_NE(m, MAP_FAILED);
  for (const ViewRecorder::Copy& cp : b.copies) {
    EXPECT_EQ(cp.count, 1u);
    std::memcpy(reinterpret_cast<void*>(cp.address), static_cast<const uint8_t*>(m) + cp.offset,
                cp.length);
  }
  ::munmap(m, b.views[0].bytes);
  for (uint64_t row = 0; row < kRows; ++row) {
    ASSERT_EQ(std::memcmp(&ta[row * kRow / 2], f0.data + row * kRow + kRow / 2, kRow / 2), 0);
    ASSERT_EQ(std::memcmp(&tb[row * kRow / 2], f1.data + row * kRow + kRow / 2, kRow / 2), 0);
  }
  rec.Release();
}

TEST(ViewRecorder, WithoutAFallbackBytesOutsideTheCacheFailTheWrite) {
  HostCache c(kBlock);
  ViewRecorder rec(&c, 7, nullptr, {});
  std::vector<uint8_t> scratch(16), dst(16);
  iovec l{scratch.data(), 16}, r{dst.data(), 16};
  absl::Status s = rec.Write(&l, &r, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("not held in the data cache"));
}

TEST(ViewRecorder, PastItsViewLimitBytesGoThroughTheFallback) {
  HostCache c(8 * kBlock);
  RangeView a = Put(c, "/a", 0, kBlock, 1, 7);
  RangeView b = Put(c, "/b", 0, kBlock, 2, 7);
  auto self = ProcessMemory::Open({::getpid(), "this test"});
  ASSERT_TRUE(self.ok());
  std::vector<uint8_t> dst(64, 0);
  const auto at = reinterpret_cast<uint64_t>(dst.data());
  ViewRecorder rec(&c, 7, std::shared_ptr<RemoteMemory>(std::move(*self)), {{at, at + 64}},
                   /*max_views=*/1);
  iovec l[2] = {{const_cast<uint8_t*>(a.data), 32}, {const_cast<uint8_t*>(b.data), 32}};
  iovec r[2] = {{dst.data(), 32}, {dst.data() + 32, 32}};
  ASSERT_TRUE(rec.Write(l, r, 2).ok());
  EXPECT_EQ(rec.views().size(), 1u);
  EXPECT_EQ(rec.bytes_recorded(), 32u);
  EXPECT_EQ(dst[0], 0);
  EXPECT_EQ(dst[32], 2);  // the second block's bytes, written
}


TEST(ViewRecorder, FileViewsCoalesceShareOneViewPerFileAndCheckTheFile) {
  testing::TempDir tmp;
  const FileStamp stamp = WriteStamped(tmp, "d.bin", std::string(4096, 'a'));
  HostCache c(8 * kBlock);
  std::vector<uint8_t> t(4096, 0);
  const auto a = reinterpret_cast<uint64_t>(t.data());
  ViewRecorder rec(&c, 7, nullptr, {{a, a + t.size()}}, /*max_views=*/2);
  auto open_ro = [&] { return ::open(tmp.Sub("d.bin").c_str(), O_RDONLY | O_CLOEXEC); };
  // Rows of 16 bytes every 64 bytes of the file: one strided copy.
  std::vector<ViewRecorder::FileRun> runs;
  for (uint64_t r = 0; r < 8; ++r) runs.push_back({100 + 64 * r, a + 16 * r, 16});
  ASSERT_TRUE(rec.Room(runs.size()));
  ASSERT_TRUE(rec.RecordFile(3, open_ro(), 4096, tmp.Sub("d.bin"), stamp, runs));
  // The same file again (another read of it): the same view, its fd closed.
  ASSERT_TRUE(rec.RecordFile(3, open_ro(), 4096, tmp.Sub("d.bin"), stamp,
                             {{2000, a + 1000, 50}}));
  EXPECT_EQ(rec.bytes_from_files(), 8u * 16 + 50);
  EXPECT_EQ(rec.bytes_recorded(), 0u);  // cache bytes only
  ASSERT_EQ(rec.views().size(), 1u);
  EXPECT_TRUE(rec.views()[0].file);
  EXPECT_EQ(rec.views()[0].key, 0u);
  EXPECT_EQ(rec.views()[0].bytes, 4096u);
  const std::vector<ViewRecorder::Copy> copies = rec.copies();
  ASSERT_EQ(copies.size(), 2u);
  EXPECT_EQ(copies[0].offset, 100u);
  EXPECT_EQ(copies[0].count, 8u);
  EXPECT_EQ(copies[0].src_stride, 64u);
  EXPECT_EQ(copies[0].dst_stride, 16u);
  EXPECT_EQ(copies[1].offset, 2000u);
  EXPECT_TRUE(rec.CheckFilesUnchanged().ok());
  // Past the view limit (2): a second file fits, a third does not (its fd closed).
  ASSERT_TRUE(rec.RecordFile(4, open_ro(), 4096, tmp.Sub("d.bin"), stamp, {{0, a, 1}}));
  EXPECT_FALSE(rec.Room(1));
  const int fd = open_ro();
  EXPECT_FALSE(rec.RecordFile(5, fd, 4096, tmp.Sub("d.bin"), stamp, {{0, a, 1}}));
  EXPECT_EQ(::fcntl(fd, F_GETFD), -1);
  // Written in place while "the client reads": the check names the file.
  {
    std::fstream f(tmp.Sub("d.bin"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(10);
    f << 'b';
  }
  absl::Status changed = rec.CheckFilesUnchanged();
  EXPECT_TRUE(absl::IsAborted(changed)) << changed;
  EXPECT_THAT(std::string(changed.message()), HasSubstr("d.bin: file changed during the load"));
  rec.Release();
}

TEST(CachingSource, SharesUncachedFilesAndDefersThem) {
  testing::TempDir tmp;
  const FileStamp stamp = WriteStamped(tmp, "d.bin", std::string(64, 'a') + std::string(64, 'b'));
  HostCache cache(1 << 20);
  std::vector<uint8_t> scratch;
  CachingSource src(tmp.path(), &cache, {{"d.bin", stamp}});
  auto verified = [](const uint8_t*) { return absl::OkStatus(); };
  ASSERT_TRUE(src.Fetch("d.bin", 0, 64, scratch, verified).ok());  // cached
  auto hit = src.ShareUncached("d.bin", 0, 64);
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_FALSE(hit->has_value());  // the cache's views serve it
  auto miss = src.ShareUncached("d.bin", 64, 64);
  ASSERT_TRUE(miss.ok()) << miss.status();
  ASSERT_TRUE(miss->has_value());
  const int fd = (*miss)->fd;
  EXPECT_EQ((*miss)->size, 128u);
  EXPECT_EQ((*miss)->stamp, stamp);
  char b = 0;
  EXPECT_EQ(::pread(fd, &b, 1, 64), 1);
  EXPECT_EQ(b, 'b');
  EXPECT_EQ(::fcntl(fd, F_GETFL) & O_ACCMODE, O_RDONLY);
  ::close(fd);
  EXPECT_EQ(src.Deferred(), (std::vector<std::pair<std::string, uint64_t>>{{"d.bin", 64}}));
}

TEST(AppendFileRuns, PlainCopiesOnlyAsFileOffsetsAndAddresses) {
  // A [4, 8] f32 shard stored at file offset 1000; the target owns columns 2..5.
  TargetTensor t;
  t.name = "w";
  t.dtype = DType::kF32;
  t.global_shape = {4, 8};
  t.box = Box{{0, 2}, {4, 4}};
  CopyOp op;
  op.src = StoredLayout::Whole(Box{{0, 0}, {4, 8}}, DType::kF32);
  op.src_offset = 1000;
  op.region = t.box;
  op.elements = 16;
  std::vector<ViewRecorder::FileRun> runs;
  ASSERT_TRUE(AppendFileRuns(op, t, 5000, 100, &runs));
  ASSERT_EQ(runs.size(), 4u);
  for (uint64_t r = 0; r < 4; ++r) {
    EXPECT_EQ(runs[r].offset, 1000 + (r * 8 + 2) * 4);
    EXPECT_EQ(runs[r].address, 5000 + r * 16);
    EXPECT_EQ(runs[r].length, 16u);
  }
  runs.clear();
  EXPECT_FALSE(AppendFileRuns(op, t, 5000, 3, &runs));  // more runs than allowed
  t.dtype = DType::kBF16;                                 // a cast: the daemon's
  EXPECT_FALSE(AppendFileRuns(op, t, 5000, 100, &runs));
  EXPECT_TRUE(runs.empty());
}

TEST(CachingSource, DetectsChangedFiles) {
  testing::TempDir tmp;
  const FileStamp stamp = WriteStamped(tmp, "d.bin", std::string(64, 'a'));
  HostCache cache(1 << 20);
  std::vector<uint8_t> scratch;
  // A verified read is kept (a read without a verify function would not be).
  auto verified = [](const uint8_t*) { return absl::OkStatus(); };
  {
    CachingSource src(tmp.path(), &cache, {{"d.bin", stamp}});
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
  CachingSource src(tmp.path(), &cache, {{"d.bin", stamp}});
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
