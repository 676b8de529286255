#include "server/save/async_saves.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/io/file.h"
#include "core/write/writer.h"
#include "server/await.h"

namespace ckptd {

namespace {
// Finished asynchronous saves stay for AwaitSave and Status this long (and
// at most this many).
constexpr absl::Duration kKeepFinished = absl::Minutes(10);
constexpr size_t kMaxFinished = 256;

// The persist thread yields to loads: CPU nice 10, best-effort I/O at the
// lowest level (ioprio_set has no glibc wrapper).
void LowerPriority() {
  const pid_t tid = static_cast<pid_t>(::syscall(SYS_gettid));
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(tid), 10);
  constexpr int kWhoProcess = 1, kClassBestEffort = 2, kClassShift = 13;
  ::syscall(SYS_ioprio_set, kWhoProcess, tid, (kClassBestEffort << kClassShift) | 7);
}
}  // namespace

AsyncSaves::AsyncSaves(Options options, const SaveBuffer* buffer, DurableFn durable)
    : options_(std::move(options)), buffer_(buffer), durable_(std::move(durable)) {}

AsyncSaves::~AsyncSaves() { Stop(); }

void AsyncSaves::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

absl::StatusOr<std::shared_ptr<const PendingSave>> AsyncSaves::Start(
    const Job& job, const std::vector<std::shared_ptr<RankSlot>>& slots, ckpt::SavePlan plan) {
  auto pending = std::make_shared<PendingSave>();
  pending->save = NativeSaveOf(job, slots, std::move(plan));
  pending->owner = job.owner;
  pending->staged = std::chrono::steady_clock::now();
  const int64_t version = pending->save.plan.unique_id;
  absl::Status refused;
  std::vector<std::shared_ptr<PendingSave>> forgotten;
  {
    absl::MutexLock lock(&mu_);
    if (stop_) {
      refused = absl::UnavailableError(
          absl::StrCat("save job '", job.id, "': the daemon is stopping"));
    }
    // Saves persisting count among the owner's jobs (limits.max_jobs_per_uid):
    // each holds its ranks' segments mapped until it is durable.
    uint64_t owned = 0;
    for (const auto& [id, other] : saves_) {
      owned += other->owner == job.owner && other->Persisting();
    }
    if (refused.ok() && owned >= options_.max_jobs_per_uid) {
      refused = absl::ResourceExhaustedError(absl::StrCat(
          "save job '", job.id, "': uid ", job.owner, " already has ", owned,
          " asynchronous saves persisting (limits.max_jobs_per_uid ",
          options_.max_jobs_per_uid, "); wait for one (SaveFuture.result)"));
    }
    const SaveKey key{job.owner, job.id};
    for (const auto& [other_key, other] : saves_) {
      if (!refused.ok() || !other->Persisting()) continue;
      const std::string& id = other_key.second;
      if (other_key == key) {
        refused = absl::AlreadyExistsError(absl::StrCat(
            "save job '", job.id, "': an asynchronous save job of that id is still persisting"));
      } else if (other->save.path == job.path && other->save.plan.unique_id == version) {
        refused = absl::AlreadyExistsError(absl::StrCat(
            "save job '", job.id, "': version ", version, " of ", job.path,
            " is being saved by ",
            other->owner == job.owner ? absl::StrCat("job '", id, "'") : "another uid's job",
            " (still persisting); choose another unique_id"));
      }
    }
    if (refused.ok()) {
      for (const auto& s : slots) {
        pending->bytes_staged += s->save_charge ? s->save_charge->bytes() : 0;
        pending->held.push_back(std::move(s->destination));
        if (s->save_charge) pending->charges.push_back(std::move(s->save_charge));
        v1::SaveResponse& r = pending->first_answers[s->targets.rank];
        r.set_persisted(false);
        r.set_buffer_wait_s(s->buffer_wait_s);
        r.set_metadata_file(absl::StrCat(version, ".metadata"));
        r.set_unique_id(version);
      }
      for (auto& [rank, r] : pending->first_answers) r.set_bytes_staged(pending->bytes_staged);
      // Forget finished saves past their time (the oldest first when too many).
      std::vector<std::pair<absl::Time, SaveKey>> finished;
      for (const auto& [other_key, other] : saves_) {
        absl::MutexLock other_lock(&other->mu);
        if (other->state != PendingSave::State::kPersisting) {
          finished.push_back({other->finished, other_key});
        }
      }
      std::sort(finished.begin(), finished.end());
      for (size_t i = 0; i < finished.size(); ++i) {
        if (finished[i].first < absl::Now() - kKeepFinished || finished.size() - i > kMaxFinished) {
          auto it = saves_.find(finished[i].second);
          forgotten.push_back(std::move(it->second));  // destroyed after mu_ is released
          saves_.erase(it);
        }
      }
      if (auto it = saves_.find(key); it != saves_.end()) forgotten.push_back(it->second);
      saves_[key] = pending;
      queue_.push_back(pending);
      if (!thread_.joinable()) thread_ = std::thread([this] { PersistLoop(); });
    }
  }
  if (!refused.ok()) return refused;
  return std::shared_ptr<const PendingSave>(pending);
}

void AsyncSaves::PersistLoop() {
  LowerPriority();
  while (true) {
    std::shared_ptr<PendingSave> next;
    std::deque<std::shared_ptr<PendingSave>> abandoned;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (stop_) {
        // Saves not begun are abandoned untouched (no directory, lock or
        // old metadata touched): their versions never appear.
        for (const auto& p : queue_) {
          absl::MutexLock save_lock(&p->mu);
          p->state = PendingSave::State::kFailed;
          p->status = absl::UnavailableError(absl::StrCat(
              "save job '", p->save.id, "': the daemon stopped before its version was written"));
          p->finished = absl::Now();
          ++failed_;
          spdlog::warn("save job={} path={} version={}: abandoned at stop, not written", p->save.id,
                       p->save.path, p->save.plan.unique_id);
        }
        abandoned.swap(queue_);
      } else {
        next = queue_.front();
        queue_.pop_front();
      }
    }
    if (next == nullptr) {
      for (const auto& p : abandoned) {  // memory and save_buffer back (outside mu_)
        p->held.clear();
        p->charges.clear();
      }
      return;
    }
    Persist(*next);
  }
}

void AsyncSaves::Persist(PendingSave& p) {
  const NativeSave& save = p.save;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string what = absl::StrCat("save job '", save.id, "'");
  auto between = [&]() -> absl::Status {
    if (options_.testing_delay_persist > absl::ZeroDuration()) {
      absl::SleepFor(options_.testing_delay_persist);
    }
    absl::MutexLock lock(&mu_);
    if (stop_) {
      return absl::UnavailableError(
          "the daemon stopped before the version was durable (it was not written)");
    }
    return absl::OkStatus();
  };
  auto run = [&]() -> absl::StatusOr<NativeSaved> {
    CKPT_RETURN_IF_ERROR(ckpt::MakeDirs(save.path));
    // Another writer of the directory (a synchronous save, ckptctl shard)
    // may hold its lock a while: wait for it, within reason.
    CKPT_ASSIGN_OR_RETURN(auto lock, ckpt::LockDirectory(save.path, 60'000));
    CKPT_RETURN_IF_ERROR(ckpt::PrepareSave(*lock.directory(), save.plan.unique_id, save.overwrite));
    auto saved = WriteNativeSave(save, lock.directory(), &p.bytes_persisted, between);
    if (saved.ok()) durable_(*lock.directory(), saved->files);
    return saved;
  };
  absl::StatusOr<NativeSaved> saved = run();
  const double persist_s = Seconds(t0);
  const double total_s = Seconds(p.staged);
  // The bytes are no longer needed: the memory and save_buffer go back
  // before anyone can see the save finished.
  p.held.clear();
  p.charges.clear();
  // The counters move before the outcome is visible (a caller that saw it
  // finished sees them counted).
  persist_us_ += static_cast<uint64_t>(persist_s * 1e6);
  if (saved.ok()) {
    ++durable_count_;
    bytes_persisted_ += saved->bytes;
  } else {
    ++failed_;
  }
  absl::Status failed;
  {
    absl::MutexLock lock(&p.mu);
    p.finished = absl::Now();
    if (saved.ok()) {
      p.state = PendingSave::State::kDurable;
      for (auto& [rank, first] : p.first_answers) {
        v1::SaveResponse r = first;
        for (const auto& f : saved->files_of_rank[rank]) r.add_files(f);
        r.set_bytes_written(saved->bytes);
        r.set_persisted(true);
        r.set_persist_s(persist_s);
        r.set_seconds(total_s);
        p.final[rank] = std::move(r);
      }
    } else {
      p.state = PendingSave::State::kFailed;
      p.status = ckpt::Annotate(saved.status(), what);
      failed = p.status;
    }
  }
  if (saved.ok()) {
    spdlog::info("save job={} path={} version={}: durable, {}B in {:.3f}s ({:.3f}s after staging)",
                 save.id, save.path, save.plan.unique_id, saved->bytes, persist_s, total_s);
  } else {
    spdlog::warn("save job={} path={} version={}: persist failed, the version is not visible: {}",
                 save.id, save.path, save.plan.unique_id, failed.ToString());
  }
}

std::map<AsyncSaves::SaveKey, std::shared_ptr<PendingSave>> AsyncSaves::PersistingLocked(
    const std::string* dir) const {
  std::map<SaveKey, std::shared_ptr<PendingSave>> persisting;
  for (const auto& [key, p] : saves_) {
    if ((dir == nullptr || p->save.path == *dir) && p->Persisting()) persisting[key] = p;
  }
  return persisting;
}

std::optional<int64_t> AsyncSaves::NewestPersisting(const std::string& dir) const {
  std::optional<int64_t> newest;
  absl::MutexLock lock(&mu_);
  for (const auto& [key, p] : PersistingLocked(&dir)) {
    newest = std::max(newest.value_or(INT64_MIN), p->save.plan.unique_id);
  }
  return newest;
}

void AsyncSaves::Drain(absl::Time until) { drain_until_ns_.store(absl::ToUnixNanos(until)); }

std::vector<std::string> AsyncSaves::AwaitPersisting(const std::string* dir, absl::Time deadline) {
  while (true) {
    std::map<SaveKey, std::shared_ptr<PendingSave>> persisting;
    {
      absl::MutexLock lock(&mu_);
      persisting = PersistingLocked(dir);
    }
    if (persisting.empty() || absl::Now() >= deadline) {
      std::vector<std::string> ids;
      for (const auto& [key, p] : persisting) ids.push_back(key.second);
      return ids;
    }
    // One at a time: the others, and saves queued since, are looked at again.
    const std::shared_ptr<PendingSave>& p = persisting.begin()->second;
    absl::MutexLock lock(&p->mu);
    auto finished = [&p]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu) {
      return p->state != PendingSave::State::kPersisting;
    };
    p->mu.AwaitWithDeadline(absl::Condition(&finished), deadline);
  }
}

absl::StatusOr<v1::SaveResponse> AsyncSaves::Await(const Caller& caller, bool admin,
                                                   const v1::AwaitSaveRequest& request,
                                                   const std::function<bool()>& cancelled) {
  const std::string what = absl::StrCat("save job '", request.job_id(), "'");
  // A call holds a handler thread while it waits: at most max_barrier_timeout.
  const absl::Time deadline =
      absl::Now() + std::min(absl::Milliseconds(request.timeout_ms()),
                             options_.max_wait);
  // A drain that begins meanwhile ends the wait at its end.
  auto drain_until = [this] { return absl::FromUnixNanos(drain_until_ns_.load()); };
  auto drained = [&] { return absl::Now() >= drain_until(); };
  auto stop = [&] { return (cancelled && cancelled()) || drained(); };
  std::shared_ptr<PendingSave> p;
  {
    absl::MutexLock lock(&mu_);
    auto it = saves_.find(SaveKey{caller.uid, request.job_id()});
    if (it == saves_.end() && admin) {  // another uid's job of that id
      it = std::find_if(saves_.begin(), saves_.end(),
                        [&](const auto& e) { return e.first.second == request.job_id(); });
    }
    if (it == saves_.end()) {
      return absl::NotFoundError(absl::StrCat(
          "no asynchronous ", what, " of ", caller.Describe(),
          " (finished ones are kept for ", absl::FormatDuration(kKeepFinished), ")"));
    }
    p = it->second;
  }
  if (!p->first_answers.count(request.rank())) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has no rank ", request.rank(), " on this daemon"));
  }
  absl::MutexLock lock(&p->mu);
  auto finished = [&p]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu) {
    return p->state != PendingSave::State::kPersisting;
  };
  AwaitOrCancel(&p->mu, absl::Condition(&finished), deadline, stop);
  if (p->state == PendingSave::State::kFailed) return p->status;
  if (p->state == PendingSave::State::kDurable) return p->final.at(request.rank());
  if (drained()) {
    return absl::UnavailableError(absl::StrCat(
        what, ": ckptd is stopping and the save was still persisting when its drain_timeout "
              "ran out (", p->bytes_persisted.load(), " of ", p->bytes_staged,
        " bytes written); its version appears only if it became durable: inspect the "
              "checkpoint once ckptd is back"));
  }
  return absl::DeadlineExceededError(absl::StrCat(
      what, " is still persisting (", p->bytes_persisted.load(), " of ", p->bytes_staged,
      " bytes written; the version becomes visible once durable)"));
}

void AsyncSaves::Describe(const Caller& caller, bool admin, v1::StatusResponse* resp) const {
  absl::MutexLock lock(&mu_);
  resp->set_save_buffer_bytes(buffer_->capacity());
  resp->set_save_staged_bytes(buffer_->held());
  for (const auto& [key, p] : saves_) {
    if (!admin && p->owner != caller.uid) continue;
    absl::MutexLock save_lock(&p->mu);
    v1::SaveStatus* s = resp->add_saves();
    s->set_job_id(key.second);
    s->set_path(p->save.path);
    s->set_unique_id(p->save.plan.unique_id);
    s->set_state(p->state == PendingSave::State::kPersisting ? "persisting"
                 : p->state == PendingSave::State::kDurable  ? "durable"
                                                             : "failed");
    s->set_bytes_staged(p->bytes_staged);
    s->set_bytes_persisted(p->bytes_persisted.load());
    s->set_age_s(Seconds(p->staged));
    if (!p->status.ok()) s->set_error(std::string(p->status.message()));
    s->set_owner_uid(p->owner);
  }
  resp->set_saves_durable(durable_count_);
  resp->set_saves_failed(failed_);
  resp->set_save_bytes_persisted_total(bytes_persisted_);
  resp->set_save_persist_seconds_total(static_cast<double>(persist_us_) / 1e6);
  resp->set_save_stall_seconds_total(static_cast<double>(stall_us_) / 1e6);
}

}  // namespace ckptd
