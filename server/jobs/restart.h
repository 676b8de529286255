// Errors a client retries once the daemon is back: a drain ended the call
// (the daemon is stopping or restarting), not anything in the request. The
// gRPC answer of such a status carries the trailing metadata
// "ckptd-retry: restart" (CkptdService::Guard); every status the daemon
// itself answers carries "ckptd-status: daemon", so a client tells them from
// the transport's UNAVAILABLE (the daemon went away), which it retries too.
// docs/operations.md, "Upgrades and restarts".
#ifndef CKPTD_SERVER_JOBS_RESTART_H_
#define CKPTD_SERVER_JOBS_RESTART_H_

#include "absl/status/status.h"

namespace ckptd {

// `s` marked as retryable after a restart (a no-op for OK).
absl::Status RetryAfterRestart(absl::Status s);
bool IsRetryAfterRestart(const absl::Status& s);

}  // namespace ckptd

#endif  // CKPTD_SERVER_JOBS_RESTART_H_
