// SourceOptions::defer_fresh_memory (core/cache/cache.h) and the daemon's
// background CacheFiller (server/catalog/cache_filler.h): a load that would wait
// for fresh cache memory delivers without keeping, the filler fills the
// cache afterwards, and what the next load finds does not depend on timing.
#include "server/catalog/cache_filler.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <numeric>
#include <thread>
#include <vector>

#include "core/cache/cache.h"
#include "core/format/checkpoint.h"
#include "core/exec/executor.h"
#include "core/plan/planner.h"
#include "core/format/safetensors.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace ckptd {
namespace {

using ckpt::DType;

// `w` (kN float32) written as one tensor "w" in `dir`, and a plan of
// 4 reads of it into one rank.
constexpr int64_t kN = 1 << 20;  // 4 MiB of float32
void WriteAndPlan(const ckpt::testing::TempDir& tmp, const std::vector<float>& w,
                  std::map<std::string, ckpt::FileStamp>* stamps, ckpt::LoadPlan* plan) {
  // Just written: in the page cache, so its reads may be deferred.
  ASSERT_TRUE(ckpt::WriteSafetensors(tmp.Sub("model.safetensors"),
                                     {{"w", DType::kF32, {kN}, w.data()}}, {})
                  .ok());
  auto ck = ckpt::OpenCheckpoint(tmp.path());
  ASSERT_TRUE(ck.ok()) << ck.status();
  auto stamp = ckpt::StatFile(tmp.Sub("model.safetensors"));
  ASSERT_TRUE(stamp.ok());
  *stamps = {{"model.safetensors", *stamp}};
  ckpt::RankTargets rt{0, {ckpt::TargetTensor{"w", DType::kF32, {kN}, ckpt::Box{{0}, {kN}},
                                              std::nullopt}}};
  ckpt::PlanOptions po;
  po.max_read_bytes = 1 << 20;  // 4 reads
  auto planned = ckpt::PlanLoad(ck->metadata, {rt}, po);
  ASSERT_TRUE(planned.ok()) << planned.status();
  ASSERT_EQ(planned->reads.size(), 4u);
  *plan = std::move(*planned);
}

TEST(CacheFiller, DeferredReadsAreFilledInTheBackgroundThenServedFromMemory) {
  ckpt::testing::TempDir tmp;
  constexpr uint64_t kBytes = kN * 4;
  std::vector<float> w(kN);
  std::iota(w.begin(), w.end(), 0.f);
  std::map<std::string, ckpt::FileStamp> stamps;
  ckpt::LoadPlan plan;
  ASSERT_NO_FATAL_FAILURE(WriteAndPlan(tmp, w, &stamps, &plan));

  ckpt::HostCache cache(64 << 20);
  ckpt::SourceOptions defer;
  defer.defer_fresh_memory = true;
  auto load = [&](uint64_t* deferred) {
    std::vector<float> out(kN, -1.f);
    ckpt::CachingSource src(tmp.path(), &cache, stamps, defer);
    auto st = ckpt::ExecutePlan(plan, src, {{out.data()}}, ckpt::ExecuteOptions{});
    EXPECT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(out, w);
    *deferred = src.Deferred().size();
    return st.ok() ? *st : ckpt::LoadStats{};
  };

  // 1. No memory used before: every read is delivered, none kept.
  uint64_t deferred = 0;
  ckpt::LoadStats first = load(&deferred);
  EXPECT_EQ(first.bytes_read, kBytes);
  EXPECT_EQ(deferred, 4u);
  EXPECT_EQ(cache.stats().bytes, 0u);

  // 2. The filler reads them again, verified, into the cache; Wait returns
  // once it is done (and at once for a checkpoint it does not fill).
  CacheFiller filler(&cache);
  EXPECT_TRUE(filler.Wait("/nowhere", absl::ZeroDuration()));
  filler.Submit(tmp.path(), stamps, plan, ckpt::kNoTenant);
  ASSERT_TRUE(filler.Wait(tmp.path(), absl::Seconds(30)));
  EXPECT_EQ(cache.stats().bytes, kBytes);
  EXPECT_EQ(filler.stats().fills, 1u);
  EXPECT_EQ(filler.stats().bytes, kBytes);

  // 3. The next load: all from memory.
  ckpt::LoadStats warm = load(&deferred);
  EXPECT_EQ(warm.bytes_read, 0u);
  EXPECT_EQ(warm.bytes_from_cache, kBytes);
  EXPECT_EQ(deferred, 0u);

  // 4. Evicted: the freed blocks are reused, so a cold load keeps its reads.
  cache.EvictPrefix(tmp.path() + "/");
  EXPECT_EQ(cache.stats().bytes, 0u);
  ckpt::LoadStats cold = load(&deferred);
  EXPECT_EQ(cold.bytes_read, kBytes);
  EXPECT_EQ(deferred, 0u);
  EXPECT_EQ(cache.stats().bytes, kBytes);

  // 5. Stop drops what is queued and returns; Submit after it does nothing.
  filler.Stop();
  filler.Submit(tmp.path(), stamps, plan, ckpt::kNoTenant);
  EXPECT_TRUE(filler.Wait(tmp.path(), absl::ZeroDuration()));
}

// Work (a laid-out copy to gather) runs on the filler's thread in order;
// loads do not wait for it (Wait without work), evictions do.
TEST(CacheFiller, WorkIsWaitedForByEvictionsNotByLoads) {
  ckpt::HostCache cache(1 << 20);
  CacheFiller filler(&cache);
  // std::promise, not absl::Notification: Debian's Abseil is not built for
  // ThreadSanitizer, which would see its unlocks without the locks.
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> ran{false};
  filler.SubmitWork("/ck", [&](const std::function<void()>&) {
    released.wait();
    ran = true;
  });
  EXPECT_TRUE(filler.Wait("/ck/", absl::Milliseconds(50), /*work=*/false));
  EXPECT_FALSE(filler.Wait("/ck/", absl::Milliseconds(50)));
  EXPECT_TRUE(filler.Wait("/other/", absl::Milliseconds(50)));
  release.set_value();
  EXPECT_TRUE(filler.Wait("/ck/", absl::Seconds(30)));
  EXPECT_TRUE(ran.load());
}

// Work waits while the filler's busy() says loads run (a laid-out copy
// gathered beside a load slows that load's copies) and pauses when one
// starts; a fill queued behind held work runs first (a load waits for its
// fill, and the load is what holds the work); DropWork (an eviction) drops
// work not begun.
TEST(CacheFiller, WorkWaitsAndPausesWhileLoadsRunFillsPassItEvictionsDropIt) {
  ckpt::testing::TempDir tmp;
  std::vector<float> w(kN, 1.f);
  std::map<std::string, ckpt::FileStamp> stamps;
  ckpt::LoadPlan plan;
  ASSERT_NO_FATAL_FAILURE(WriteAndPlan(tmp, w, &stamps, &plan));
  ckpt::HostCache cache(64 << 20);
  std::atomic<bool> busy{true};
  std::atomic<int> ran{0}, step{0};  // before the filler: its work uses them
  CacheFiller filler(&cache, [&] { return busy.load(); });
  filler.SubmitWork(tmp.path(), [&](const std::function<void()>&) { ++ran; });
  filler.Submit(tmp.path(), stamps, plan, ckpt::kNoTenant);
  // The fill behind the held work is done; the work is not.
  ASSERT_TRUE(filler.Wait(tmp.path() + "/", absl::Seconds(30), /*work=*/false));
  EXPECT_EQ(filler.stats().fills, 1u);
  EXPECT_EQ(cache.stats().bytes, uint64_t{kN} * 4);
  EXPECT_FALSE(filler.Wait(tmp.path() + "/", absl::Milliseconds(100)));
  EXPECT_EQ(ran.load(), 0);
  // No load runs: it runs.
  busy = false;
  ASSERT_TRUE(filler.Wait(tmp.path() + "/", absl::Seconds(30)));
  EXPECT_EQ(ran.load(), 1);
  // Held again, then dropped by an eviction of its checkpoint (not of another).
  busy = true;
  filler.SubmitWork(tmp.path(), [&](const std::function<void()>&) { ++ran; });
  filler.DropWork("/elsewhere/");
  EXPECT_FALSE(filler.Wait(tmp.path() + "/", absl::Milliseconds(50)));
  filler.DropWork(tmp.path() + "/");
  EXPECT_TRUE(filler.Wait(tmp.path() + "/", absl::ZeroDuration()));
  busy = false;
  filler.SubmitWork("/other", [](const std::function<void()>&) {});
  EXPECT_TRUE(filler.Wait("/other/", absl::Seconds(30)));
  EXPECT_EQ(ran.load(), 1);
  // A load that starts while work runs pauses it at its next pause() until
  // no load runs, or until a fill is queued (the load may wait for it).
  // paused(): work that runs until a load starts (busy), then calls pause().
  auto paused = [&] {
    step = 0;
    filler.SubmitWork("/paused", [&](const std::function<void()>& pause) {
      step = 1;
      while (step.load() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      pause();
      step = 3;
    });
    while (step.load() != 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    busy = true;
    step = 2;
    EXPECT_FALSE(filler.Wait("/paused/", absl::Milliseconds(100)));
    EXPECT_EQ(step.load(), 2);
  };
  paused();
  cache.EvictPrefix(tmp.path() + "/");
  filler.Submit(tmp.path(), stamps, plan, ckpt::kNoTenant);
  ASSERT_TRUE(filler.Wait(tmp.path() + "/", absl::Seconds(30), /*work=*/false));
  EXPECT_EQ(step.load(), 3);
  EXPECT_EQ(filler.stats().fills, 2u);
  // Paused again by a load, until it ends.
  busy = false;
  paused();
  busy = false;
  ASSERT_TRUE(filler.Wait("/paused/", absl::Seconds(30)));
  EXPECT_EQ(step.load(), 3);
}

// With nothing queued, the filler collapses the cache's new shared blocks
// into huge pages (CacheHugePages::kCollapse), but not while busy.
TEST(CacheFiller, CollapsesNewSharedBlocksOnlyWhileNothingIsBusy) {
  const std::string why_not = ckpt::ProbeShmemCollapse();
  if (!why_not.empty()) GTEST_SKIP() << "this kernel does not collapse shared memory: " << why_not;
  constexpr uint64_t kBlock = 8 << 20;
  ckpt::HostCache cache(64 << 20, nullptr, ckpt::CacheHugePages::kCollapse);
  std::atomic<bool> busy{true};
  CacheFiller filler(&cache, [&] { return busy.load(); });
  auto p = cache.Reserve(kBlock, 7);
  ASSERT_NE(p, nullptr);
  std::memset(cache.PendingData(p), 3, kBlock);
  cache.Publish(p, "x", ckpt::FileStamp{}, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // the filler looked at least once
  EXPECT_TRUE(cache.HugePagesPending());
  EXPECT_EQ(cache.stats().huge_page_bytes, 0u);
  busy = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  auto done = [&] {  // counted as each step ends
    const ckpt::CacheStats s = cache.stats();
    return s.huge_page_bytes + s.huge_page_failed * (2 << 20) >= kBlock;
  };
  while (!done() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_FALSE(cache.HugePagesPending());
  const ckpt::CacheStats s = cache.stats();
  EXPECT_EQ(s.huge_page_bytes + s.huge_page_failed * (2 << 20), kBlock);
}

}  // namespace
}  // namespace ckptd
