// SourceOptions::defer_fresh_memory (core/cache/cache.h) and the daemon's
// background CacheFiller (server/catalog/cache_filler.h): a load that would wait
// for fresh cache memory delivers without keeping, the filler fills the
// cache afterwards, and what the next load finds does not depend on timing.
#include "server/catalog/cache_filler.h"

#include <atomic>
#include <chrono>
#include <future>
#include <numeric>
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

TEST(CacheFiller, DeferredReadsAreFilledInTheBackgroundThenServedFromMemory) {
  ckpt::testing::TempDir tmp;
  constexpr int64_t kN = 1 << 20;  // 4 MiB of float32
  constexpr uint64_t kBytes = kN * 4;
  std::vector<float> w(kN);
  std::iota(w.begin(), w.end(), 0.f);
  // Just written: in the page cache, so its reads may be deferred.
  ASSERT_TRUE(ckpt::WriteSafetensors(tmp.Sub("model.safetensors"),
                                     {{"w", DType::kF32, {kN}, w.data()}}, {})
                  .ok());
  auto ck = ckpt::OpenCheckpoint(tmp.path());
  ASSERT_TRUE(ck.ok()) << ck.status();
  auto stamp = ckpt::StatFile(tmp.Sub("model.safetensors"));
  ASSERT_TRUE(stamp.ok());
  const std::map<std::string, ckpt::FileStamp> stamps{{"model.safetensors", *stamp}};
  ckpt::RankTargets rt{0, {ckpt::TargetTensor{"w", DType::kF32, {kN}, ckpt::Box{{0}, {kN}},
                                              std::nullopt}}};
  ckpt::PlanOptions po;
  po.max_read_bytes = 1 << 20;  // 4 reads
  auto plan = ckpt::PlanLoad(ck->metadata, {rt}, po);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->reads.size(), 4u);

  ckpt::HostCache cache(64 << 20);
  ckpt::SourceOptions defer;
  defer.defer_fresh_memory = true;
  auto load = [&](uint64_t* deferred) {
    std::vector<float> out(kN, -1.f);
    ckpt::CachingSource src(tmp.path(), &cache, stamps, defer);
    auto st = ckpt::ExecutePlan(*plan, src, {{out.data()}}, ckpt::ExecuteOptions{});
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
  filler.Submit(tmp.path(), stamps, *plan, ckpt::kNoTenant);
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
  filler.Submit(tmp.path(), stamps, *plan, ckpt::kNoTenant);
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
  filler.SubmitWork("/ck", [&] {
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

}  // namespace
}  // namespace ckptd
