#include "server/catalog/cache_filler.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <utility>
#include <vector>

#include <spdlog/spdlog.h>

#include "absl/strings/match.h"
#include "core/exec/executor.h"

namespace ckptd {
namespace {

// A fill plan has no ranks: nothing is ever delivered.
class NoCopies final : public ckpt::Delivery {
 public:
  absl::StatusOr<int64_t> Copy(size_t, const ckpt::RankPlan&, const ckpt::CopyOp&,
                               const uint8_t*) override {
    return absl::InternalError("cache fill: a copy in a plan without ranks");
  }
};

// Ends the fill at its next read once the filler stops.
class StoppableSource final : public ckpt::RangeSource {
 public:
  StoppableSource(ckpt::RangeSource* inner, const std::atomic<bool>* stop)
      : inner_(inner), stop_(stop) {}
  absl::StatusOr<ckpt::RangeView> Fetch(
      const std::string& file, uint64_t offset, uint64_t n, std::vector<uint8_t>& scratch,
      const std::function<absl::Status(const uint8_t*)>& verify) override {
    if (Stopped()) return absl::CancelledError("ckptd is stopping");
    return inner_->Fetch(file, offset, n, scratch, verify);
  }
  absl::StatusOr<std::unique_ptr<Fill>> BeginFill(const std::string& file, uint64_t offset,
                                                  uint64_t n, bool verify,
                                                  std::optional<ckpt::RangeView>* served) override {
    if (Stopped()) return absl::CancelledError("ckptd is stopping");
    return inner_->BeginFill(file, offset, n, verify, served);
  }

 private:
  bool Stopped() const { return stop_->load(); }
  ckpt::RangeSource* const inner_;
  const std::atomic<bool>* const stop_;
};

}  // namespace

CacheFiller::CacheFiller(ckpt::HostCache* cache, std::function<bool()> busy)
    : cache_(cache), busy_(std::move(busy)) {
  thread_ = std::thread([this] { Run(); });
}

CacheFiller::~CacheFiller() { Stop(); }

void CacheFiller::Submit(std::string dir, std::map<std::string, ckpt::FileStamp> stamps,
                         ckpt::LoadPlan plan, uint32_t tenant, std::weak_ptr<const void> after,
                         absl::Duration max_wait) {
  plan.ranks.clear();
  absl::MutexLock lock(&mu_);
  if (stopping_ || plan.reads.empty()) return;
  queue_.push_back(
      {std::move(dir), std::move(stamps), std::move(plan), tenant, std::move(after), max_wait});
}

void CacheFiller::SubmitWork(std::string dir, Work work) {
  absl::MutexLock lock(&mu_);
  if (stopping_ || !work) return;
  Task t;
  t.dir = std::move(dir);
  t.work = std::move(work);
  t.queued = absl::Now();
  queue_.push_back(std::move(t));
}

bool CacheFiller::Under(const std::string& dir, const std::string& prefix) {
  return !dir.empty() && (dir == prefix || absl::StartsWith(dir + "/", prefix));
}

bool CacheFiller::Busy(const std::string& prefix, bool work) const {
  if (Under(running_, prefix) && (work || !running_work_)) return true;
  for (const Task& t : queue_) {
    if (Under(t.dir, prefix) && (work || !t.work)) return true;
  }
  return false;
}

void CacheFiller::DropWork(const std::string& prefix) {
  std::vector<Task> dropped;  // what they hold goes after the lock
  absl::MutexLock lock(&mu_);
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (it->work && Under(it->dir, prefix)) {
      dropped.push_back(std::move(*it));
      it = queue_.erase(it);
    } else {
      ++it;
    }
  }
}

bool CacheFiller::Wait(const std::string& prefix, absl::Duration timeout, bool work) {
  absl::MutexLock lock(&mu_);
  auto idle = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || !Busy(prefix, work); };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

void CacheFiller::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    stop_ = true;
    queue_.clear();
  }
  if (thread_.joinable()) thread_.join();
}

CacheFiller::Stats CacheFiller::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

bool CacheFiller::FillQueued() const {
  for (const Task& t : queue_) {
    if (!t.work) return true;
  }
  return false;
}

bool CacheFiller::Held(const Task& work) const {
  return busy_ && busy_() && absl::Now() < work.queued + kMaxWorkHold;
}

std::optional<CacheFiller::Task> CacheFiller::Next() {
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    // Work never runs before a fill queued ahead of it (it may gather what
    // that fill caches); fills may pass held work.
    if (it->work && Held(*it)) continue;
    Task t = std::move(*it);
    queue_.erase(it);
    return t;
  }
  return std::nullopt;
}

void CacheFiller::CollapseHugePages() {
  // Until a task is queued, a load runs, or none is left (a step is 2 MiB).
  auto go_on = [&] {
    absl::MutexLock lock(&mu_);
    return !stopping_ && queue_.empty() && !(busy_ && busy_());
  };
  const auto t0 = std::chrono::steady_clock::now();
  const ckpt::HostCache::CollapseStats s = cache_->CollapseHugePages(go_on);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!s.unsupported.empty()) {
    spdlog::warn("cache: shared blocks stay on 4 KiB pages: the kernel refused to collapse them "
                 "({})",
                 s.unsupported);
  } else if (s.blocks > 0 || s.failed > 0) {
    spdlog::info("cache: {} MiB of shared blocks collapsed into huge pages ({} blocks done, {} "
                 "ranges of 2 MiB left on 4 KiB pages: no huge page free) in {:.3f}s",
                 s.bytes >> 20, s.blocks, s.failed, secs);
  }
}

void CacheFiller::Run() {
  // Lowest CPU priority: loads win whenever both want a core.
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 19);
  while (true) {
    Task task;
    bool collapse = false;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); };
      std::optional<Task> next;
      while (!next) {
        // Nothing queued: new shared blocks of the cache are collapsed into
        // huge pages meanwhile, while nothing is busy. Loads make new
        // blocks without queueing anything here: looked at once a second.
        if (!ready()) {
          const bool pending = cache_->HugePagesPending();
          if (pending && !(busy_ && busy_())) {
            collapse = true;
            break;
          }
          mu_.AwaitWithTimeout(absl::Condition(&ready),
                               pending ? absl::Milliseconds(20) : absl::Seconds(1));
          continue;
        }
        if (stopping_) return;
        next = Next();
        // Only held work queued: look again shortly (busy_ has no signal),
        // or at once when a fill comes.
        auto wake = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || FillQueued(); };
        if (!next) mu_.AwaitWithTimeout(absl::Condition(&wake), absl::Milliseconds(5));
      }
      if (!collapse) {
        task = std::move(*next);
        running_ = task.dir;
        running_work_ = static_cast<bool>(task.work);
      }
    }
    if (collapse) {
      CollapseHugePages();
      continue;
    }
    // Not while the load's clients still read these bytes themselves (the
    // hold goes when the last of them is done; bounded by max_wait).
    const absl::Time until = absl::Now() + task.max_wait;
    while (!task.after.expired() && !stop_.load() && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(2));
    }
    if (task.work) {
      // Loads that start meanwhile pause it, but never while a fill waits
      // (a load may be waiting for that fill: it would wait for itself);
      // held kMaxWorkHold in all since it was queued.
      task.work([&] {
        absl::MutexLock lock(&mu_);
        auto go_on = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
          return stopping_ || FillQueued() || !Held(task);
        };
        while (!go_on()) mu_.AwaitWithTimeout(absl::Condition(&go_on), absl::Milliseconds(2));
      });
      task.work = nullptr;  // lets go of what it held before the next waits end
      absl::MutexLock lock(&mu_);
      running_.clear();
      running_work_ = false;
      continue;
    }
    const auto t0 = std::chrono::steady_clock::now();
    ckpt::SourceOptions options;
    options.tenant = task.tenant;
    ckpt::CachingSource cached(task.dir, cache_, task.stamps, options);
    StoppableSource source(&cached, &stop_);
    NoCopies none;
    ckpt::ExecuteOptions eo;
    eo.threads = 1;
    eo.verify_checksums = true;  // only verified bytes are cached
    auto stats = ckpt::ExecutePlan(task.plan, source, none, eo);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    absl::MutexLock lock(&mu_);
    running_.clear();
    if (stats.ok()) {
      ++stats_.fills;
      stats_.bytes += stats->bytes_read;
      spdlog::info("cache fill path={} read={}B reads={} in {:.3f}s", task.dir, stats->bytes_read,
                   task.plan.reads.size(), secs);
    } else {
      // A file changed or vanished since the load: its next load reads it.
      ++stats_.failed;
      spdlog::warn("cache fill path={} failed: {}", task.dir, stats.status().ToString());
    }
  }
}

}  // namespace ckptd
