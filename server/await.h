// Waiting under a mutex with a deadline, for as long as the caller is
// there: shared by the daemon's waits (jobs, saves, multi-node jobs) and the cache
// views' (view_leases.h).
#ifndef CKPTD_SERVER_AWAIT_H_
#define CKPTD_SERVER_AWAIT_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace ckptd {

// With `mu` held: waits until `cond` holds, `deadline` passes or
// `cancelled()` (asked after each 100 ms of waiting, not before: a gRPC
// cancellation check polls the call's queue, and most waits end sooner)
// says the caller went away. Returns whether `cond` holds.
inline bool AwaitOrCancel(absl::Mutex* mu, const absl::Condition& cond, absl::Time deadline,
                          const std::function<bool()>& cancelled)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(*mu) {
  for (bool waited = false; !cond.Eval(); waited = true) {
    const absl::Time now = absl::Now();
    if (now >= deadline || (waited && cancelled && cancelled())) return false;
    mu->AwaitWithDeadline(cond, std::min(deadline, now + absl::Milliseconds(100)));
  }
  return true;
}

// `cancelled` (a gRPC cancellation check) asked at most once per `every`,
// the first time at once; in between, its last answer (true for good once
// it said true). A synchronous call's ServerContext::IsCancelled polls the
// call's completion queue: a pollset pass and often a thread hand-off, which
// a load's workers asking before each read and each batch of writes paid
// hundreds of times per rank and job (about 9% of a node's CPU in a 64-node
// job of column slices). A client that cancels is then noticed within
// `every` plus one batch of writes. Thread-safe; `cancelled` is asked by
// one thread at a time.
inline std::function<bool()> ThrottledCancel(std::function<bool()> cancelled,
                                             absl::Duration every) {
  if (!cancelled) return cancelled;
  struct State {
    std::function<bool()> probe;
    int64_t every_ns = 0;
    std::atomic<int64_t> next_ns{INT64_MIN};  // steady clock: when to ask again
    std::atomic<bool> gone{false};
  };
  auto st = std::make_shared<State>();
  st->probe = std::move(cancelled);
  st->every_ns = absl::ToInt64Nanoseconds(every);
  return [st] {
    if (st->gone.load(std::memory_order_acquire)) return true;
    const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now().time_since_epoch())
                            .count();
    int64_t next = st->next_ns.load(std::memory_order_relaxed);
    // One thread asks; the others take the last answer meanwhile.
    if (now < next || !st->next_ns.compare_exchange_strong(next, INT64_MAX)) return false;
    const bool gone = st->probe();
    if (gone) st->gone.store(true, std::memory_order_release);
    st->next_ns.store(now + st->every_ns, std::memory_order_relaxed);
    return gone;
  };
}

}  // namespace ckptd

#endif  // CKPTD_SERVER_AWAIT_H_
