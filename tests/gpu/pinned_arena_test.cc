// CPU test of the data cache's pinned allocator (server/cuda/pinned_arena):
// lazy chunks, first-fit reuse, coalescing, the limit, pin failures, and
// HostCache drawing its entries from it (core/cache/cache.h HostAllocator).
#include "server/cuda/pinned_arena.h"

#include <cstring>
#include <set>

#include <gtest/gtest.h>

#include "core/cache/cache.h"

namespace ckptd::gpu {
namespace {

struct FakePin {
  int pins = 0, unpins = 0;
  bool fail = false;
  std::set<void*> pinned;
  ChunkedHostAllocator::PinFn pin() {
    return [this](void* p, uint64_t) {
      ++pins;
      if (fail) return false;
      pinned.insert(p);
      return true;
    };
  }
  ChunkedHostAllocator::UnpinFn unpin() {
    return [this](void* p, uint64_t) {
      ++unpins;
      pinned.erase(p);
    };
  }
};

constexpr uint64_t kMiB = 1 << 20;

TEST(PinnedArena, ChunksAreMappedLazilyAndReused) {
  FakePin f;
  {
    ChunkedHostAllocator a({8 * kMiB, 0}, f.pin(), f.unpin());
    EXPECT_EQ(a.chunks(), 0u);
    EXPECT_EQ(f.pins, 0);
    uint8_t* x = a.Allocate(1 * kMiB);
    uint8_t* y = a.Allocate(3 * kMiB);
    uint8_t* z = a.Allocate(100);
    ASSERT_NE(x, nullptr);
    ASSERT_NE(y, nullptr);
    ASSERT_NE(z, nullptr);
    EXPECT_EQ(a.chunks(), 1u);
    EXPECT_EQ(f.pins, 1);
    EXPECT_EQ(a.pinned_bytes(), 8 * kMiB);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(z) % 4096, 0u);
    std::memset(x, 1, kMiB);
    std::memset(y, 2, 3 * kMiB);
    std::memset(z, 3, 100);
    EXPECT_EQ(a.used_bytes(), 4 * kMiB + 4096);
    // Freeing x and y (neighbours) lets a 4 MiB piece fit where they were.
    a.Free(x, kMiB);
    a.Free(y, 3 * kMiB);
    uint8_t* w = a.Allocate(4 * kMiB);
    EXPECT_EQ(w, x);
    EXPECT_EQ(a.chunks(), 1u);
    // Larger than a chunk: a chunk of its own.
    uint8_t* big = a.Allocate(20 * kMiB);
    ASSERT_NE(big, nullptr);
    EXPECT_EQ(a.chunks(), 2u);
    EXPECT_EQ(f.pins, 2);
    a.Free(big, 20 * kMiB);
    a.Free(w, 4 * kMiB);
    a.Free(z, 100);
    EXPECT_EQ(a.used_bytes(), 0u);
  }
  EXPECT_EQ(f.unpins, 2);
  EXPECT_TRUE(f.pinned.empty());
}

TEST(PinnedArena, LimitRefusesAndReleasesUnusedChunks) {
  FakePin f;
  ChunkedHostAllocator a({4 * kMiB, 8 * kMiB}, f.pin(), f.unpin());
  uint8_t* p = a.Allocate(4 * kMiB);
  uint8_t* q = a.Allocate(4 * kMiB);
  ASSERT_NE(p, nullptr);
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(a.Allocate(4 * kMiB), nullptr);  // over the limit: the cache uses new[]
  a.Free(p, 4 * kMiB);
  // A piece that does not fit the free chunk forces a new chunk: the unused one goes first.
  uint8_t* r = a.Allocate(6 * kMiB);
  EXPECT_EQ(r, nullptr);  // 4 (q) + 6 > 8 even after releasing p's chunk
  EXPECT_EQ(a.mapped_bytes(), 4 * kMiB);
  EXPECT_EQ(f.unpins, 1);
  a.Free(q, 4 * kMiB);
}

TEST(PinnedArena, PinFailureLeavesUsableMemory) {
  FakePin f;
  f.fail = true;
  ChunkedHostAllocator a({2 * kMiB, 0}, f.pin(), f.unpin());
  uint8_t* p = a.Allocate(1000);
  ASSERT_NE(p, nullptr);
  std::memset(p, 7, 1000);
  EXPECT_EQ(a.pinned_bytes(), 0u);
  EXPECT_EQ(a.mapped_bytes(), 2 * kMiB);
  a.Free(p, 1000);
}

TEST(PinnedArena, HostCacheEntriesComeFromTheAllocator) {
  FakePin f;
  ChunkedHostAllocator a({4 * kMiB, 0}, f.pin(), f.unpin());
  {
    ckpt::HostCache cache(3 * kMiB, &a);
    ckpt::FileStamp stamp{1, 2, 3, 4};
    for (int i = 0; i < 5; ++i) {  // 5 x 1 MiB within a 3 MiB budget: evictions free memory
      auto p = cache.Reserve(kMiB);
      ASSERT_NE(p, nullptr);
      uint8_t* d = cache.PendingData(p);
      ASSERT_NE(d, nullptr);
      std::memset(d, i, kMiB);
      ckpt::RangeView v = cache.Publish(std::move(p), "/ckpt/f", stamp, i * kMiB);
      EXPECT_EQ(v.data, d);
    }
    EXPECT_EQ(a.used_bytes(), 3 * kMiB);
    EXPECT_EQ(a.chunks(), 1u);
    auto hit = cache.Lookup("/ckpt/f", stamp, 4 * kMiB + 10, 100);
    ASSERT_TRUE(hit.has_value());
    EXPECT_EQ(hit->data[0], 4);
  }
  EXPECT_EQ(a.used_bytes(), 0u);
}

}  // namespace
}  // namespace ckptd::gpu
