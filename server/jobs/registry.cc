#include "server/jobs/registry.h"

#include <exception>
#include <new>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/jobs/restart.h"

namespace ckptd {

void JobRegistry::UnregisterLocked(const Job& job) {
  auto it = jobs_.find(job.id);
  if (it != jobs_.end() && it->second.get() == &job) jobs_.erase(it);
}

void JobRegistry::Fail(Job& job, const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  absl::MutexLock job_lock(&job.mu);
  job.FailLocked(status);
  UnregisterLocked(job);
}

void JobRegistry::RunGuarded(Job& job, const std::function<void()>& run) {
  try {
    run();
    return;
  } catch (const std::bad_alloc&) {
    spdlog::error("job {}: out of memory", job.id);
    Fail(job, absl::ResourceExhaustedError(
                  absl::StrCat("job '", job.id, "': the daemon ran out of memory running it")));
  } catch (const std::exception& e) {
    spdlog::error("job {}: unexpected exception (a ckptd bug): {}", job.id, e.what());
    Fail(job, absl::InternalError(
                  absl::StrCat("job '", job.id, "': internal error (a ckptd bug): ", e.what())));
  }
}

void JobRegistry::Finish(Job& job, const std::function<void()>& answer_ranks) {
  absl::MutexLock lock(&mu_);
  absl::MutexLock job_lock(&job.mu);
  job.state = Job::State::kFinished;
  job.phase = "done";
  UnregisterLocked(job);
  answer_ranks();
}

std::vector<std::string> JobRegistry::AbortLoads(const std::string& why) {
  return Abort(why, [](const Job& job) { return job.kind == JobKind::kLoad; });
}

std::vector<std::string> JobRegistry::AbortWaiting(const std::string& why) {
  {
    absl::MutexLock lock(&mu_);
    closed_ = why;
  }
  return Abort(why, [](const Job& job) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    absl::MutexLock job_lock(&job.mu);
    return job.state == Job::State::kWaiting;
  });
}

std::vector<std::string> JobRegistry::Abort(const std::string& why,
                                            const std::function<bool(const Job&)>& pick) {
  std::vector<std::string> ids;
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Job>> picked;
  for (const auto& [id, job] : jobs_) {
    if (pick(*job)) picked.push_back(job);
  }
  for (const auto& job : picked) {
    const absl::Status s =
        RetryAfterRestart(absl::UnavailableError(absl::StrCat("job '", job->id, "': ", why)));
    {
      absl::MutexLock abort(&job->abort_mu);
      job->aborted = true;
      job->abort_status = s;
    }
    {
      absl::MutexLock job_lock(&job->mu);
      job->FailLocked(s);  // every rank learns it now; the runner stops at its next read
    }
    UnregisterLocked(*job);
    ids.push_back(job->id);
  }
  return ids;
}

absl::StatusOr<std::pair<std::shared_ptr<Job>, bool>> JobRegistry::Register(
    const JobKey& key, const std::shared_ptr<RankSlot>& slot, size_t* registered,
    size_t* expected) {
  absl::MutexLock lock(&mu_);
  if (!closed_.empty()) {
    return RetryAfterRestart(absl::UnavailableError(
        absl::StrCat("job '", key.id, "' rank ", key.rank, ": ", closed_)));
  }
  auto it = jobs_.find(key.id);
  if (it != jobs_.end() && it->second->owner != key.owner) {
    return absl::PermissionDeniedError(absl::StrCat(
        "job '", key.id, "' belongs to another user (uid ", it->second->owner,
        "); rank ", key.rank, " of uid ", key.owner, " may not join it (use another job_id)"));
  }
  std::shared_ptr<Job> job;
  if (it == jobs_.end()) {
    uint64_t owned = 0;
    for (const auto& [id, j] : jobs_) owned += j->owner == key.owner;
    if (owned >= max_jobs_per_uid_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "job '", key.id, "': uid ", key.owner, " already has ", owned,
          " jobs waiting or running (limits.max_jobs_per_uid ", max_jobs_per_uid_, ")"));
    }
    job = std::make_shared<Job>();
    job->id = key.id;
    job->owner = key.owner;
    job->kind = key.kind;
    job->path = key.path;
    job->unique_id = key.unique_id;
    job->world_size = key.world_size;
    job->job_key = key.job_key;
    if (key.node_ranks.empty()) {
      for (int r = 0; r < key.world_size; ++r) job->expected.insert(r);
    } else {
      job->expected.insert(key.node_ranks.begin(), key.node_ranks.end());
    }
    jobs_[job->id] = job;
  } else {
    job = it->second;
  }
  // A job in the registry is waiting or running (it leaves it as it
  // finishes, under mu_).
  absl::MutexLock job_lock(&job->mu);
  if (job->state == Job::State::kRunning) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", key.id, "' is already running; rank ", key.rank,
                     " came too late (use a new job_id)"));
  }
  std::string mismatch;
  if (job->kind != key.kind) {
    mismatch = "one side loads, the other saves";
  } else if (job->path != key.path) {
    mismatch = absl::StrCat("checkpoint ", key.path, " vs ", job->path);
  } else if (job->unique_id != key.unique_id) {
    auto version = [](const std::optional<int64_t>& u) {
      return u ? absl::StrCat(*u) : std::string("unset (the newest)");
    };
    mismatch = absl::StrCat("unique_id ", version(key.unique_id), " vs ", version(job->unique_id));
  } else if (job->world_size != key.world_size) {
    mismatch = absl::StrCat("world_size ", key.world_size, " vs ", job->world_size);
  } else if (job->job_key != key.job_key) {
    mismatch = key.job_key.empty() || job->job_key.empty()
                   ? "job_key (some ranks sent one, others none)"
                   : "job_key (the ranks sent different keys)";
  }
  if (!mismatch.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("job '", job->id, "' rank ", key.rank,
                     " disagrees with the ranks already registered: ", mismatch));
  }
  if (!job->expected.count(key.rank)) {
    return absl::InvalidArgumentError(absl::StrCat("job '", job->id, "' rank ", key.rank,
                                                   " is not among the ranks of this node"));
  }
  if (auto old = job->slots.find(key.rank); old != job->slots.end()) {
    // The same rank again: its earlier call's client went away (a retry
    // after a broken connection) and the call has not noticed yet; the new
    // call takes its place. A rank whose earlier call still waits is a
    // second process claiming it.
    const std::shared_ptr<RankSlot>& was = old->second;
    if (!(was->cancelled && was->cancelled())) {
      return absl::AlreadyExistsError(
          absl::StrCat("job '", job->id, "' rank ", key.rank, " is already registered"));
    }
    {
      absl::MutexLock slot_lock(&was->mu);
      was->status = absl::CancelledError(absl::StrCat(
          "job '", job->id, "' rank ", key.rank, ": replaced by the rank's new call"));
      was->done = true;
    }
    job->slots.erase(old);
  }
  job->slots[key.rank] = slot;
  *registered = job->slots.size();
  *expected = job->expected.size();
  bool runner = false;
  if (*registered == *expected) {
    job->state = Job::State::kRunning;
    job->phase = key.kind == JobKind::kLoad ? "planning" : "writing";
    runner = true;
  }
  return std::make_pair(job, runner);
}

std::optional<absl::Status> JobRegistry::LeaveBarrier(const std::shared_ptr<Job>& job,
                                                      const std::shared_ptr<RankSlot>& slot, int rank,
                                                      absl::Time deadline, absl::Duration barrier,
                                                      const std::function<bool()>& cancelled) {
  absl::MutexLock lock(&mu_);
  absl::MutexLock job_lock(&job->mu);
  if (job->state != Job::State::kWaiting) return std::nullopt;  // it started meanwhile
  if (cancelled()) {
    // (Unless a new call of the rank took the slot's place: Register.)
    if (auto it = job->slots.find(rank); it != job->slots.end() && it->second == slot) {
      job->slots.erase(it);
    }
    if (job->slots.empty()) UnregisterLocked(*job);
    return absl::CancelledError(absl::StrCat("job '", job->id, "' rank ", rank,
                                             ": client went away while waiting"));
  }
  if (absl::Now() < deadline) return std::nullopt;
  std::vector<int> missing;
  for (int r : job->expected) {
    if (!job->slots.count(r)) missing.push_back(r);
  }
  job->FailLocked(absl::DeadlineExceededError(absl::StrCat(
      "job '", job->id, "': ranks ", absl::StrJoin(missing, ","), " never registered within ",
      absl::FormatDuration(barrier), " (", job->slots.size(), " of ", job->expected.size(),
      " ranks came)")));
  UnregisterLocked(*job);
  absl::MutexLock slot_lock(&slot->mu);
  return slot->status;
}

absl::Status JobRegistry::AwaitSlot(const std::shared_ptr<Job>& job,
                               const std::shared_ptr<RankSlot>& slot, int rank,
                               absl::Duration barrier,
                               const std::function<bool(const v1::LoadEvent&)>& send,
                               const std::function<bool()>& cancelled,
                               const std::function<void()>& views_pending) {
  const absl::Time deadline = slot->registered + barrier;
  std::string last_phase;
  uint64_t last_progress = 0;
  auto done_or_views = [](RankSlot* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) {
    return s->done || s->views_pending;
  };
  while (true) {
    bool views = false;
    {
      absl::MutexLock lock(&slot->mu);
      slot->mu.AwaitWithTimeout(absl::Condition(+done_or_views, slot.get()),
                                absl::Milliseconds(100));
      if (slot->done) return slot->status;
      views = std::exchange(slot->views_pending, false);
    }
    if (views && views_pending) {
      views_pending();
      continue;
    }
    std::string phase;
    bool waiting = false;
    {
      absl::MutexLock lock(&job->mu);
      waiting = job->state == Job::State::kWaiting;
      phase = job->phase;
    }
    if (waiting && (cancelled() || absl::Now() >= deadline)) {
      if (auto left = LeaveBarrier(job, slot, rank, deadline, barrier, cancelled)) return *left;
      continue;
    }
    const uint64_t progress = job->progress.load();
    const uint64_t total = job->total.load();
    if (send && (phase != last_phase || progress != last_progress)) {
      v1::LoadEvent ev;
      ev.set_progress(phase);
      ev.set_bytes_done(progress);
      ev.set_bytes_total(total);
      send(ev);  // a closed stream is noticed through cancelled()
      last_phase = phase;
      last_progress = progress;
    }
  }
}

void JobRegistry::Describe(bool all, uid_t uid, v1::StatusResponse* resp) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, job] : jobs_) {
    if (!all && job->owner != uid) continue;  // others' jobs are not its business
    absl::MutexLock job_lock(&job->mu);
    v1::JobStatus* js = resp->add_jobs();
    js->set_job_id(id);
    js->set_path(job->path);
    js->set_world_size(job->world_size);
    for (const auto& [r, s] : job->slots) js->add_registered_ranks(r);
    for (int r : job->expected) {
      if (!job->slots.count(r)) js->add_waiting_for(r);
    }
    js->set_state(job->phase);
  }
}

}  // namespace ckptd
