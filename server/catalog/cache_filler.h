// Fills the data cache in the background with reads a load delivered
// without keeping (SourceOptions::defer_fresh_memory): the first load after
// start does not wait for fresh memory to be faulted in; this thread, at the
// lowest CPU priority, reads those ranges again (from the page cache),
// verifies them and publishes them, so the next load is a warm one.
//
// A load or an eviction of a checkpoint first waits for that checkpoint's
// fills (Wait), so what a load finds in the cache does not depend on timing:
// a second load right after the first is served from memory, and an evicted
// checkpoint is not refilled behind the eviction's back.
//
// With nothing queued and nothing busy, the same thread collapses the
// cache's new shared blocks into huge pages (CacheHugePages::kCollapse), so
// that a client's copy out of a cache view takes one page fault per 2 MiB.
#ifndef CKPTD_SERVER_CATALOG_CACHE_FILLER_H_
#define CKPTD_SERVER_CATALOG_CACHE_FILLER_H_

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/cache/cache.h"
#include "core/plan/planner.h"

namespace ckptd {

// A SubmitWork's work starts only while busy() is false (the daemon's:
// no load runs nor ended in the last 50 ms: a laid-out copy gathered
// beside a load takes memory bandwidth that load's copies need) and pauses
// while busy() again, unless a fill is queued (fills behind held work go
// first: a load may be waiting for one). Held at most kMaxWorkHold in all.
inline constexpr absl::Duration kMaxWorkHold = absl::Seconds(30);

class CacheFiller {
 public:
  // `busy` (may be empty: never): whether work should wait; called with
  // this filler's lock held, so it must take no lock that could wait on it.
  explicit CacheFiller(ckpt::HostCache* cache, std::function<bool()> busy = {});
  ~CacheFiller();  // Stop()
  CacheFiller(const CacheFiller&) = delete;
  CacheFiller& operator=(const CacheFiller&) = delete;

  // Queues the reads of `plan` (its ranks are ignored) of checkpoint `dir`,
  // files at `stamps`, for filling. Nothing happens after Stop().
  // `tenant`: whom the entries are reserved for (HostCache::Reserve).
  // The fill starts once `after` has expired (the load's clients that read
  // those bytes from the files themselves are done: the fill would compete
  // with them for cores and memory bandwidth), or `max_wait` passed.
  void Submit(std::string dir, std::map<std::string, ckpt::FileStamp> stamps, ckpt::LoadPlan plan,
              uint32_t tenant, std::weak_ptr<const void> after = {},
              absl::Duration max_wait = absl::ZeroDuration());
  // Queues `work` (a laid-out copy to gather, ViewRecorder::TakeLaidOutWork)
  // for checkpoint `dir`, to run once nothing is busy (see the constructor)
  // and the fills queued before it are done. Loads do not wait for it (a
  // laid-out copy holds the same bytes as the pieces it is gathered from: a
  // load finds the same bytes either way, only faster once it is there);
  // evictions do.
  // `work` calls its argument between pieces of its own (it returns once
  // the work may go on: ViewRecorder::Work).
  using Work = std::function<void(const std::function<void()>& pause)>;
  void SubmitWork(std::string dir, Work work);
  // Waits until no fill of a checkpoint whose directory is `prefix` or
  // under it (prefix ending in '/') is queued or running, nor (`work`) any
  // SubmitWork's, at most `timeout`. False on timeout.
  bool Wait(const std::string& prefix, absl::Duration timeout, bool work = true);
  // Drops the work queued (not running) for checkpoints at or under
  // `prefix` (as Wait): an eviction's, which then waits for the rest.
  void DropWork(const std::string& prefix);
  // Drops queued fills, stops the running one at its next read, joins.
  void Stop();

  struct Stats {
    uint64_t fills = 0;
    uint64_t bytes = 0;
    uint64_t failed = 0;
  };
  Stats stats() const;

 private:
  struct Task {
    std::string dir;
    std::map<std::string, ckpt::FileStamp> stamps;
    ckpt::LoadPlan plan;
    uint32_t tenant = 0;
    std::weak_ptr<const void> after;
    absl::Duration max_wait;
    Work work;                   // instead of the plan (SubmitWork)
    absl::Time queued;           // work: when SubmitWork queued it
  };
  void Run();
  // While nothing is queued or busy: the cache's new shared blocks onto
  // huge pages (HostCache::CollapseHugePages, CacheHugePages::kCollapse).
  void CollapseHugePages();
  // The next task to run: the first fill, or the first work queued before
  // it if nothing is busy (or it waited kMaxWorkHold); none while every
  // queued task is work held back.
  std::optional<Task> Next() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool FillQueued() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Whether `work` waits now: busy_() and not yet kMaxWorkHold since queued.
  bool Held(const Task& work) const;
  bool Busy(const std::string& prefix, bool work) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  static bool Under(const std::string& dir, const std::string& prefix);

  ckpt::HostCache* const cache_;
  const std::function<bool()> busy_;
  mutable absl::Mutex mu_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  std::string running_ ABSL_GUARDED_BY(mu_);  // dir of the fill running now; "" if none
  bool running_work_ ABSL_GUARDED_BY(mu_) = false;  // and whether it is a SubmitWork's
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> stop_{false};  // stopping_, read by the running fill
  Stats stats_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_CATALOG_CACHE_FILLER_H_
