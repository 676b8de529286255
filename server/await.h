// Waiting under a mutex with a deadline, for as long as the caller is
// there: shared by the daemon's waits (jobs, saves, multi-node jobs) and the cache
// views' (view_leases.h).
#ifndef CKPTD_SERVER_AWAIT_H_
#define CKPTD_SERVER_AWAIT_H_

#include <algorithm>
#include <functional>

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

}  // namespace ckptd

#endif  // CKPTD_SERVER_AWAIT_H_
