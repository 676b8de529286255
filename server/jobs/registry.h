// The job registry and barrier: every Load and Save rank registers into its
// job by id (Register); the rank that completes the barrier runs the job
// (the load and save runners), the others wait for their slot to be filled
// or the barrier's deadline (AwaitSlot). A failure reaches every rank of the
// job (Fail, AbortLoads); a finished job leaves the registry (Finish).
//
// Owned by the daemon; called by the Load and Save RPC threads, the job
// runners, Status and the drain. Thread-safe: `mu_` guards the map of jobs;
// each Job and RankSlot has its own mutex (job.h). Lock order: mu_ before
// Job::mu before RankSlot::mu; mu_ before Job::abort_mu.
#ifndef CKPTD_SERVER_JOBS_REGISTRY_H_
#define CKPTD_SERVER_JOBS_REGISTRY_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/ckpt.pb.h"
#include "server/jobs/job.h"

namespace ckptd {

// Who a rank is, as Register compares it with the ranks already there.
struct JobKey {
  JobKind kind;
  std::string id;
  std::string path;
  std::optional<int64_t> unique_id;
  uid_t owner;
  int world_size;
  int rank;
  std::vector<int> node_ranks;  // empty: every rank of the world is on this node
  std::string job_key;          // the request's job_key (checked: CheckJobKey)
};

// A request's barrier_timeout_ms, or `configured` (barrier_timeout) when 0.
inline absl::Duration BarrierTimeout(uint32_t barrier_timeout_ms, absl::Duration configured) {
  return barrier_timeout_ms > 0 ? absl::Milliseconds(barrier_timeout_ms) : configured;
}

class JobRegistry {
 public:
  // A uid may have at most `max_jobs_per_uid` jobs waiting or running.
  explicit JobRegistry(uint64_t max_jobs_per_uid) : max_jobs_per_uid_(max_jobs_per_uid) {}

  // Adds `slot` to its job (created on first use); returns the job and
  // whether this caller completed the barrier and must run the job.
  // *registered and *expected count the job's ranks on this node.
  absl::StatusOr<std::pair<std::shared_ptr<Job>, bool>> Register(
      const JobKey& key, const std::shared_ptr<RankSlot>& slot, size_t* registered,
      size_t* expected) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until the job has filled `slot` (progress events through `send`,
  // which may be null), the client leaves, or `barrier` after the slot's
  // registration passes while the job still waits for ranks (failing the
  // job for every waiting rank, naming the ranks that never came). The
  // rank's status. Meanwhile `views_pending` (may be null) runs each time
  // the job marks the slot's views pending (RankSlot::views_pending).
  absl::Status AwaitSlot(const std::shared_ptr<Job>& job, const std::shared_ptr<RankSlot>& slot,
                         int rank, absl::Duration barrier,
                         const std::function<bool(const v1::LoadEvent&)>& send,
                         const std::function<bool()>& cancelled,
                         const std::function<void()>& views_pending = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Runs `run` (the job's runner: a load or a save) failing the job for
  // every rank on any exception (a ckptd bug or out of memory), so no rank
  // waits for ever.
  void RunGuarded(Job& job, const std::function<void()>& run) ABSL_LOCKS_EXCLUDED(mu_);
  // Every rank of the job not done yet fails with `status`; the job leaves
  // the registry.
  void Fail(Job& job, const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);
  // The job succeeded: it is finished and leaves the registry;
  // `answer_ranks` runs meanwhile with the registry's and the job's locks
  // held, so no one sees the job gone with ranks not answered.
  void Finish(Job& job, const std::function<void()>& answer_ranks) ABSL_LOCKS_EXCLUDED(mu_);
  // The drain ran out: every load job still waiting or running fails now,
  // each of its ranks with UNAVAILABLE "job '<id>': <why>" marked
  // RetryAfterRestart (restart.h); a running job stops before its next read
  // (Job::aborted). The ids of the jobs failed.
  std::vector<std::string> AbortLoads(const std::string& why) ABSL_LOCKS_EXCLUDED(mu_);
  // The drain began: every job (load or save) still waiting for ranks fails
  // now, as AbortLoads (its missing ranks cannot come any more: the daemon
  // takes no new calls), so its ranks retry on the restarted daemon at once
  // instead of waiting out drain_timeout; and from now on Register refuses
  // every rank the same way (a call on a connection made before the drain
  // would start a job that waits for ranks going elsewhere). The ids of the
  // jobs failed.
  std::vector<std::string> AbortWaiting(const std::string& why) ABSL_LOCKS_EXCLUDED(mu_);
  // Status: the jobs waiting or running, only `uid`'s unless `all`.
  void Describe(bool all, uid_t uid, v1::StatusResponse* resp) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // AwaitSlot's rank while its job still waits for ranks: its client went
  // away (the rank leaves, the job too once empty) or `deadline` passed (the
  // job fails for every rank; `barrier` is named). The rank's status then;
  // nullopt when neither holds or the job started meanwhile.
  std::optional<absl::Status> LeaveBarrier(const std::shared_ptr<Job>& job,
                                           const std::shared_ptr<RankSlot>& slot, int rank,
                                           absl::Time deadline, absl::Duration barrier,
                                           const std::function<bool()>& cancelled)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Drops `job` from the map (if it is the one registered under its id).
  void UnregisterLocked(const Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // AbortLoads and AbortWaiting: the jobs `pick` selects fail as they say.
  std::vector<std::string> Abort(const std::string& why,
                                 const std::function<bool(const Job&)>& pick)
      ABSL_LOCKS_EXCLUDED(mu_);

  const uint64_t max_jobs_per_uid_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  std::string closed_ ABSL_GUARDED_BY(mu_);  // AbortWaiting's reason, once it ran
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_JOBS_REGISTRY_H_
