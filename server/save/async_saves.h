// Asynchronous saves (SaveRequest.async_save): the job's ranks hand their
// bytes over and get their answer once the daemon holds a consistent copy
// (Start); one persist thread writes the versions in the background, in the
// order their jobs completed, at a low CPU and I/O priority (loads win).
// docs/saving.md tells the rules: staged bytes count against save_buffer
// (charged per rank before any copy, SaveBuffer); a version is written as
// any native save is (native_save.h), so a daemon killed at any point leaves
// no part of it visible; once durable the caller's `durable` hook runs (the
// daemon drops the cached metadata and puts the files into its data cache),
// and a load of a directory with a save still persisting waits for it
// (AwaitPersisting).
//
// Owned by the daemon; called by the save runner (Start), AwaitSave, Status,
// loads (AwaitPersisting) and the drain. Thread-safe: `mu_` guards the saves
// by id, the queue and the stop flag; each PendingSave's `mu` its outcome.
// Lock order: mu_ before PendingSave::mu.
#ifndef CKPTD_SERVER_SAVE_ASYNC_SAVES_H_
#define CKPTD_SERVER_SAVE_ASYNC_SAVES_H_

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/plan/save_plan.h"
#include "proto/ckpt.pb.h"
#include "server/api/caller.h"
#include "server/delivery/destination.h"
#include "server/jobs/job.h"
#include "server/save/native_save.h"
#include "server/save/save_buffer.h"

namespace ckptd {

// An asynchronous save between its ranks' answer and its end: the bytes it
// holds, the plan, and how it stands. All but the outcome is set before it
// is registered in AsyncSaves and read-only after, except `held` and
// `charges`, which the persist thread releases; `mu` guards the outcome.
struct PendingSave {
  NativeSave save;
  uid_t owner = 0;
  // The ranks' destinations holding their bytes (their own segments, or the
  // daemon's copies) and the save_buffer room they hold, released once
  // persisted.
  std::vector<std::unique_ptr<Destination>> held;
  std::vector<std::unique_ptr<SaveBuffer::Charge>> charges;
  uint64_t bytes_staged = 0;
  std::atomic<uint64_t> bytes_persisted{0};
  std::chrono::steady_clock::time_point staged;
  std::map<int, v1::SaveResponse> first_answers;  // per rank, for the final ones
  enum class State { kPersisting, kDurable, kFailed };
  mutable absl::Mutex mu;
  State state ABSL_GUARDED_BY(mu) = State::kPersisting;
  absl::Status status ABSL_GUARDED_BY(mu);
  std::map<int, v1::SaveResponse> final ABSL_GUARDED_BY(mu);
  absl::Time finished ABSL_GUARDED_BY(mu);
  bool Persisting() const ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    return state == State::kPersisting;
  }
};

class AsyncSaves {
 public:
  struct Options {
    uint64_t max_jobs_per_uid = 64;        // limits.max_jobs_per_uid: saves persisting count
    absl::Duration max_wait;               // limits.max_barrier_timeout: AwaitSave's longest
    absl::Duration testing_delay_persist;  // tests only: a pause before each file
  };
  // `durable(dir, files)` runs on the persist thread once a version is
  // durable, before its outcome is visible, with the directory still locked.
  using DurableFn =
      std::function<void(const ckpt::Directory& dir, const std::vector<std::string>& files)>;
  AsyncSaves(Options options, const SaveBuffer* buffer, DurableFn durable);
  ~AsyncSaves();  // Stop

  // Job `job`'s ranks are all in and its plan holds: their bytes (each
  // slot's destination and save_buffer charge) move into a PendingSave
  // queued for the persist thread, whose first_answers the ranks get now
  // (persisted false). Refused (the slots left as they were) while the
  // daemon stops, when the owner has max_jobs_per_uid saves persisting, or
  // when the owner's job of that id or the version is being saved already.
  absl::StatusOr<std::shared_ptr<const PendingSave>> Start(
      const Job& job, const std::vector<std::shared_ptr<RankSlot>>& slots, ckpt::SavePlan plan)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The outcome of the caller's save job `request.job_id()` for one of its
  // ranks, waiting up to request.timeout_ms() (at most max_wait) for it to
  // become durable (DEADLINE_EXCEEDED while it still persists). An admin
  // (`admin`) may ask for another uid's job of that id (its own first).
  absl::StatusOr<v1::SaveResponse> Await(const Caller& caller, bool admin,
                                         const v1::AwaitSaveRequest& request,
                                         const std::function<bool()>& cancelled)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The daemon is draining until `until`: Await calls wait no longer than
  // that, then answer UNAVAILABLE for a save still persisting (its outcome
  // is then the drain's: durable, or abandoned).
  void Drain(absl::Time until);
  // Waits (at most until `deadline`) until no save (into `dir` if given) is
  // persisting; returns the ids of those still persisting.
  std::vector<std::string> AwaitPersisting(const std::string* dir, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The newest version still persisting into `dir`, if any.
  std::optional<int64_t> NewestPersisting(const std::string& dir) const ABSL_LOCKS_EXCLUDED(mu_);
  // Status: the saves (only `caller`'s unless `admin`) and the counters.
  void Describe(const Caller& caller, bool admin, v1::StatusResponse* resp) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // How long a rank of an asynchronous save waited for its answer.
  void AddStall(double seconds) { stall_us_ += static_cast<uint64_t>(seconds * 1e6); }
  // Saves not begun are abandoned (their versions never appear), the one
  // being written stops before its next file; joins the persist thread.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void PersistLoop() ABSL_LOCKS_EXCLUDED(mu_);
  void Persist(PendingSave& save) ABSL_LOCKS_EXCLUDED(mu_);
  // A save's record: its owner and job id (job ids are the clients' own
  // names: two uids may pick the same one).
  using SaveKey = std::pair<uid_t, std::string>;
  // The saves still persisting (into `dir` if given).
  std::map<SaveKey, std::shared_ptr<PendingSave>> PersistingLocked(const std::string* dir) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  const SaveBuffer* const buffer_;
  const DurableFn durable_;
  mutable absl::Mutex mu_;
  // By owner and job id: those persisting and those finished in the last
  // minutes (Await, Describe); the persist thread's queue.
  std::map<SaveKey, std::shared_ptr<PendingSave>> saves_ ABSL_GUARDED_BY(mu_);
  std::deque<std::shared_ptr<PendingSave>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // Drain's `until` (absl::ToUnixNanos; INT64_MAX: not draining); atomic: the
  // waits in Await read it under a PendingSave's mu (lock order).
  std::atomic<int64_t> drain_until_ns_{INT64_MAX};
  std::thread thread_;  // started by the first save (under mu_)
  std::atomic<uint64_t> durable_count_{0}, failed_{0}, bytes_persisted_{0};
  std::atomic<uint64_t> stall_us_{0}, persist_us_{0};
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_SAVE_ASYNC_SAVES_H_
