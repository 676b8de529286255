// Native saves, and asynchronous saves (SaveRequest.async_save): the job's
// ranks hand their bytes over, get their answer once the daemon holds a
// consistent copy, and one persist thread writes the versions in the
// background, in the order their jobs completed. docs/saving.md tells the
// rules; the code follows them:
//  - staged bytes count against save_buffer, charged per rank before any
//    copy; a rank waits (bounded by its barrier timeout) while it is full;
//  - a version is written as any native save is (core/write/writer.h: data files
//    under temporary names, fsynced, renamed; the metadata last), so a
//    daemon killed at any point leaves no part of it visible;
//  - the persist thread runs at a low CPU and I/O priority: loads win;
//  - once durable, the version's files are put into the data cache, and a
//    load of a directory with a save still persisting waits for it.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "core/io/file.h"
#include "core/base/status_macros.h"
#include "core/write/writer.h"
#include "server/daemon.h"
#include "server/daemon_internal.h"
#include "server/delivery/destination.h"

namespace ckptd {

using ckpt::TargetTensor;

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

Daemon::NativeSave Daemon::NativeSaveOf(const Job& job,
                                        const std::vector<std::shared_ptr<RankSlot>>& slots,
                                        ckpt::SavePlan plan) {
  NativeSave save;
  save.id = job.id;
  save.path = job.path;
  save.world_size = job.world_size;
  save.expected = job.expected;
  save.plan = std::move(plan);
  save.overwrite = slots.front()->save_request.overwrite();
  for (const auto& s : slots) {
    save.ranks.push_back(s->targets);
    for (int t = 0; t < s->save_request.targets_size(); ++t) {
      save.where[{s->targets.rank, s->targets.tensors[t].name}] =
          s->destination->segment()->data() + s->save_request.targets(t).dest_offset();
    }
    for (const auto& [k, v] : s->save_request.flat_mapping()) {
      save.flat_mapping[k] = std::vector<std::string>(v.parts().begin(), v.parts().end());
    }
  }
  return save;
}

absl::StatusOr<Daemon::NativeSaved> Daemon::WriteNativeFiles(
    const NativeSave& save, std::shared_ptr<const ckpt::Directory> dir,
    std::atomic<uint64_t>* persisted, const std::function<absl::Status()>& between) {
  NativeSaved out;
  std::vector<std::pair<std::string, ckpt::ShardMeta>>& written = out.shards;
  for (int r = 0; r < save.world_size; ++r) {
    if (!save.expected.count(r)) continue;
    if (between) CKPT_RETURN_IF_ERROR(between());
    std::vector<const void*> data;
    for (const TargetTensor& t : save.plan.writes[r]) data.push_back(save.where.at({r, t.name}));
    CKPT_ASSIGN_OR_RETURN(auto shards, ckpt::WriteRankFile(dir, save.plan, r, data));
    std::set<std::string> files;
    for (auto& sh : shards) {
      out.bytes += sh.second.nbytes;
      if (persisted) *persisted += sh.second.nbytes;
      files.insert(sh.second.file);
      written.push_back(std::move(sh));
    }
    out.files.insert(out.files.end(), files.begin(), files.end());
  }
  // Every rank learns which files hold the shards it handed over.
  for (const auto& [name, meta] : written) {
    for (const ckpt::RankTargets& rank : save.ranks) {
      for (const TargetTensor& t : rank.tensors) {
        if (t.name == name && t.box == meta.box && t.flat_range == meta.flat_range) {
          out.files_of_rank[rank.rank].insert(meta.file);
        }
      }
    }
  }
  return out;
}

absl::StatusOr<Daemon::NativeSaved> Daemon::WriteNativeSave(
    const NativeSave& save, std::shared_ptr<const ckpt::Directory> dir,
    std::atomic<uint64_t>* persisted, const std::function<absl::Status()>& between) {
  CKPT_ASSIGN_OR_RETURN(NativeSaved out, WriteNativeFiles(save, dir, persisted, between));
  if (between) CKPT_RETURN_IF_ERROR(between());
  CKPT_RETURN_IF_ERROR(ckpt::FinishSave(dir, save.plan, out.shards, save.flat_mapping));
  return out;
}

void Daemon::StartAsyncSave(const std::shared_ptr<Job>& job,
                            const std::vector<std::shared_ptr<RankSlot>>& slots,
                            ckpt::SavePlan plan) {
  auto pending = std::make_shared<PendingSave>();
  pending->save = NativeSaveOf(*job, slots, std::move(plan));
  pending->owner = job->owner;
  pending->staged = std::chrono::steady_clock::now();
  const int64_t version = pending->save.plan.unique_id;
  absl::Status refused;  // decided under save_mu_, reported after (jobs_.Fail takes the registry lock)
  std::vector<std::shared_ptr<PendingSave>> forgotten;
  {
    absl::MutexLock lock(&save_mu_);
    if (persist_stop_) {
      refused = absl::UnavailableError(
          absl::StrCat("save job '", job->id, "': the daemon is stopping"));
    }
    // Saves persisting count among the owner's jobs (limits.max_jobs_per_uid):
    // each holds its ranks' segments mapped until it is durable.
    uint64_t owned = 0;
    for (const auto& [id, other] : saves_) {
      owned += other->owner == job->owner && other->Persisting();
    }
    if (refused.ok() && owned >= config_.limits.max_jobs_per_uid) {
      refused = absl::ResourceExhaustedError(absl::StrCat(
          "save job '", job->id, "': uid ", job->owner, " already has ", owned,
          " asynchronous saves persisting (limits.max_jobs_per_uid ",
          config_.limits.max_jobs_per_uid, "); wait for one (SaveFuture.result)"));
    }
    for (const auto& [id, other] : saves_) {
      if (!refused.ok() || !other->Persisting()) continue;
      if (id == job->id) {
        refused = absl::AlreadyExistsError(absl::StrCat(
            "save job '", job->id, "': an asynchronous save job of that id is still persisting"));
      } else if (other->save.path == job->path && other->save.plan.unique_id == version) {
        refused = absl::AlreadyExistsError(absl::StrCat(
            "save job '", job->id, "': version ", version, " of ", job->path,
            " is being saved by job '", id, "' (still persisting); choose another unique_id"));
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
      }
      for (auto& [rank, r] : pending->first_answers) r.set_bytes_staged(pending->bytes_staged);
      // Forget finished saves past their time (the oldest first when too many).
      std::vector<std::pair<absl::Time, std::string>> finished;
      for (const auto& [id, other] : saves_) {
        absl::MutexLock other_lock(&other->mu);
        if (other->state != PendingSave::State::kPersisting) finished.push_back({other->finished, id});
      }
      std::sort(finished.begin(), finished.end());
      for (size_t i = 0; i < finished.size(); ++i) {
        if (finished[i].first < absl::Now() - kKeepFinished || finished.size() - i > kMaxFinished) {
          auto it = saves_.find(finished[i].second);
          forgotten.push_back(std::move(it->second));  // destroyed after save_mu_ is released
          saves_.erase(it);
        }
      }
      if (auto it = saves_.find(job->id); it != saves_.end()) forgotten.push_back(it->second);
      saves_[job->id] = pending;
      persist_queue_.push_back(pending);
      if (!persist_thread_.joinable()) persist_thread_ = std::thread([this] { PersistLoop(); });
    }
  }
  if (!refused.ok()) return jobs_.Fail(*job, refused);
  FinishSaveJob(job, slots, [&](const RankSlot& s, v1::SaveResponse& r) {
    r = pending->first_answers.at(s.targets.rank);
  });
  spdlog::info("save job={} path={} version={} ranks={}: {}B staged, persisting in the background",
               job->id, job->path, version, slots.size(), pending->bytes_staged);
}

void Daemon::PersistLoop() {
  LowerPriority();
  while (true) {
    std::shared_ptr<PendingSave> next;
    std::deque<std::shared_ptr<PendingSave>> abandoned;
    {
      absl::MutexLock lock(&save_mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(save_mu_) {
        return persist_stop_ || !persist_queue_.empty();
      };
      save_mu_.Await(absl::Condition(&ready));
      if (persist_stop_) {
        // Saves not begun are abandoned untouched (no directory, lock or
        // old metadata touched): their versions never appear.
        for (const auto& p : persist_queue_) {
          absl::MutexLock save_lock(&p->mu);
          p->state = PendingSave::State::kFailed;
          p->status = absl::UnavailableError(absl::StrCat(
              "save job '", p->save.id, "': the daemon stopped before its version was written"));
          p->finished = absl::Now();
          ++saves_failed_;
          spdlog::warn("save job={} path={} version={}: abandoned at stop, not written", p->save.id,
                       p->save.path, p->save.plan.unique_id);
        }
        abandoned.swap(persist_queue_);
      } else {
        next = persist_queue_.front();
        persist_queue_.pop_front();
      }
    }
    if (next == nullptr) {
      for (const auto& p : abandoned) {  // memory and save_buffer back (outside save_mu_)
        p->held.clear();
        p->charges.clear();
      }
      return;
    }
    Persist(*next);
  }
}

void Daemon::Persist(PendingSave& p) {
  const NativeSave& save = p.save;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string what = absl::StrCat("save job '", save.id, "'");
  auto between = [&]() -> absl::Status {
    if (config_.testing_delay_persist > absl::ZeroDuration()) {
      absl::SleepFor(config_.testing_delay_persist);
    }
    absl::MutexLock lock(&save_mu_);
    if (persist_stop_) {
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
    return WriteNativeSave(save, lock.directory(), &p.bytes_persisted, between);
  };
  absl::StatusOr<NativeSaved> saved = run();
  const double persist_s = Seconds(t0);
  if (saved.ok()) {
    metadata_.Drop(save.path);
    PublishSaved(save.path, saved->files);
  }
  const double total_s = Seconds(p.staged);
  // The bytes are no longer needed: the memory and save_buffer go back
  // before anyone can see the save finished.
  p.held.clear();
  p.charges.clear();
  // The counters move before the outcome is visible (a caller that saw it
  // finished sees them counted).
  save_persist_us_ += static_cast<uint64_t>(persist_s * 1e6);
  if (saved.ok()) {
    ++saves_durable_;
    save_bytes_persisted_ += saved->bytes;
  } else {
    ++saves_failed_;
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

void Daemon::PublishSaved(const std::string& dir, const std::vector<std::string>& files) {
  for (const std::string& name : files) {
    const std::string path = ckpt::JoinPath(dir, name);
    auto f = ckpt::OpenFile(path);
    if (!f.ok()) continue;
    auto before = (*f)->Stamp();
    const uint64_t n = (*f)->size();
    if (!before.ok() || !cache_.CanHold(n)) continue;
    auto pending = cache_.Reserve(n);
    if (pending == nullptr) continue;
    if (!(*f)->Read(0, n, cache_.PendingData(pending)).ok()) continue;
    // Published only when the file is still the one just written.
    auto after = ckpt::StatFile(path);
    if (!after.ok() || !(*after == *before)) continue;
    cache_.Publish(std::move(pending), path, *before, 0);
  }
}

std::map<std::string, std::shared_ptr<Daemon::PendingSave>> Daemon::PersistingLocked(
    const std::string* dir) const {
  std::map<std::string, std::shared_ptr<PendingSave>> persisting;
  for (const auto& [id, p] : saves_) {
    if ((dir == nullptr || p->save.path == *dir) && p->Persisting()) persisting[id] = p;
  }
  return persisting;
}

std::vector<std::string> Daemon::AwaitPersisting(const std::string* dir, absl::Time deadline) {
  while (true) {
    std::map<std::string, std::shared_ptr<PendingSave>> persisting;
    {
      absl::MutexLock lock(&save_mu_);
      persisting = PersistingLocked(dir);
    }
    if (persisting.empty() || absl::Now() >= deadline) {
      std::vector<std::string> ids;
      for (const auto& [id, p] : persisting) ids.push_back(id);
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

void Daemon::AwaitPersistsInto(const std::string& dir, absl::Time deadline) {
  AwaitPersisting(&dir, deadline);
}

absl::StatusOr<v1::SaveResponse> Daemon::AwaitSave(const Caller& caller,
                                                   const v1::AwaitSaveRequest& request,
                                                   const std::function<bool()>& cancelled) {
  const std::string what = absl::StrCat("save job '", request.job_id(), "'");
  // A call holds a handler thread while it waits: at most max_barrier_timeout.
  const absl::Time deadline =
      absl::Now() + std::min(absl::Milliseconds(request.timeout_ms()),
                             config_.limits.max_barrier_timeout);
  std::shared_ptr<PendingSave> p;
  {
    absl::MutexLock lock(&save_mu_);
    auto it = saves_.find(request.job_id());
    if (it == saves_.end() || (it->second->owner != caller.uid && !policy_.IsAdmin(caller))) {
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
  AwaitOrCancel(&p->mu, absl::Condition(&finished), deadline, cancelled);
  if (p->state == PendingSave::State::kFailed) return p->status;
  if (p->state == PendingSave::State::kDurable) return p->final.at(request.rank());
  return absl::DeadlineExceededError(absl::StrCat(
      what, " is still persisting (", p->bytes_persisted.load(), " of ", p->bytes_staged,
      " bytes written; the version becomes visible once durable)"));
}

std::vector<std::string> Daemon::AwaitPersists(absl::Duration timeout) {
  return AwaitPersisting(nullptr, absl::Now() + timeout);
}

void Daemon::FillSaveStatus(const Caller& caller, v1::StatusResponse* resp) {
  const bool admin = policy_.IsAdmin(caller);
  absl::MutexLock lock(&save_mu_);
  resp->set_save_buffer_bytes(config_.save_buffer);
  resp->set_save_staged_bytes(save_buffer_.held());
  for (const auto& [id, p] : saves_) {
    if (!admin && p->owner != caller.uid) continue;
    absl::MutexLock save_lock(&p->mu);
    v1::SaveStatus* s = resp->add_saves();
    s->set_job_id(id);
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
  resp->set_saves_durable(saves_durable_);
  resp->set_saves_failed(saves_failed_);
  resp->set_save_bytes_persisted_total(save_bytes_persisted_);
  resp->set_save_persist_seconds_total(static_cast<double>(save_persist_us_) / 1e6);
  resp->set_save_stall_seconds_total(static_cast<double>(save_stall_us_) / 1e6);
}

absl::StatusOr<std::pair<std::string, std::string>> Daemon::ResolveSaveDir(
    const v1::SaveRequest& request) const {
  // The output directory may not exist yet: resolve its parent. A relative
  // path is under the first root (as for loads), so the nodes of a
  // multi-node save can name node-local directories that live at different
  // places.
  std::string out = request.path();
  if (!out.empty() && out[0] != '/') out = ckpt::JoinPath(config_.roots.front(), out);
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  const size_t slash = out.rfind('/');
  if (out.empty() || slash == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("Save: path '", request.path(), "' names no directory"));
  }
  const std::string leaf = out.substr(slash + 1);
  auto parent = policy_.ResolvePath(slash == 0 ? "/" : out.substr(0, slash));
  if (!parent.ok()) return parent.status();
  if (!ckpt::IsPlainFileName(leaf)) {
    return absl::InvalidArgumentError(absl::StrCat("Save: bad directory name '", leaf, "'"));
  }
  return std::make_pair(*parent, ckpt::JoinPath(*parent, leaf));
}

absl::Status Daemon::CheckSaveDir(const Caller& caller, const v1::SaveRequest& request,
                                  const std::string& dir, bool dcp) const {
  auto kind = ckpt::Storage::Default()->Kind(dir);
  if (kind.ok() && *kind != ckpt::PathKind::kMissing) {
    if (*kind != ckpt::PathKind::kDirectory) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Save: ", dir,
          *kind == ckpt::PathKind::kSymlink ? " is a symbolic link" : " is not a directory",
          "; save into a real directory inside a root"));
    }
    if (absl::Status a = policy_.CheckAccess(caller, dir, Policy::Access::kSave); !a.ok()) return a;
    // Early answer for the ranks; RunSaveJob checks again under the directory lock.
    auto exists = dcp ? ckpt::CommitFileExists(dir, ".metadata")
                      : ckpt::VersionExists(dir, request.unique_id());
    if (!request.overwrite() && exists.ok() && *exists) {
      return absl::AlreadyExistsError(
          dcp ? absl::StrCat("Save: ", DcpCheckpointExists(dir))
              : absl::StrCat("Save: version ", request.unique_id(), " already exists in ", dir,
                             " (", request.unique_id(),
                             ".metadata); choose another unique_id or set overwrite"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<RankSlot>> Daemon::PrepareSaveSlot(
    const Caller& caller, const v1::SaveRequest& request, const std::string& who, uint64_t bytes,
    const std::function<bool()>& cancelled) {
  // The rank and its targets checked as a Load's; its bytes in a segment
  // (or device tensors, staged below), checked as a Load's destination.
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<RankSlot> slot,
                        NewRankSlot("Save", request.job_id(), request.rank(),
                                    request.world_size(), request.node_ranks(),
                                    request.targets()));
  const std::string rank_who = absl::StrCat("job '", request.job_id(), "' rank ", request.rank());
  std::vector<TargetPlace> places = PlacesOf(request.targets(), slot->targets);
  if (request.has_cuda_ipc()) {
    CKPT_ASSIGN_OR_RETURN(slot->destination, OpenDeviceDestination(caller, request.cuda_ipc(),
                                                                   std::move(places), rank_who));
  } else {
    CKPT_ASSIGN_OR_RETURN(SegmentSource source, SegmentSourceOf(caller, request.shm(), rank_who));
    CKPT_ASSIGN_OR_RETURN(slot->destination,
                          SegmentDestination::Open(rank_who, std::move(source), std::move(places)));
  }
  if (request.async_save()) {
    // The rank's bytes must outlive its call: save_buffer room first (the
    // call waits here while earlier persists hold it), then the daemon's own
    // copy unless the client handed its segment over for good.
    auto charge = save_buffer_.Reserve(who, bytes,
                                   absl::Now() + BarrierTimeout(request.barrier_timeout_ms()),
                                   cancelled, &slot->buffer_wait_s);
    if (!charge.ok()) return charge.status();
    slot->save_charge = std::move(*charge);
    // (Device tensors are copied when staged, below.)
    if (!request.handed_over() && !request.has_cuda_ipc()) {
      std::vector<std::pair<uint64_t, uint64_t>> ranges;
      for (int t = 0; t < request.targets_size(); ++t) {
        ranges.emplace_back(request.targets(t).dest_offset(), slot->targets.tensors[t].num_bytes());
      }
      auto copy = MappedSegment::CopyOf(*slot->destination->segment(), ranges, who);
      if (!copy.ok()) return copy.status();
      slot->destination = std::make_unique<SegmentDestination>(
          std::move(*copy), PlacesOf(request.targets(), slot->targets));
    }
  }
  slot->save_request = request;
  if (request.has_cuda_ipc()) {  // its targets then point into the daemon's own copy
    if (absl::Status s = StageDeviceSave(who, slot->save_request, *slot); !s.ok()) return s;
  }
  return slot;
}

absl::StatusOr<v1::SaveResponse> Daemon::Save(const Caller& caller, const v1::SaveRequest& request,
                                              const std::function<bool()>& cancelled) {
  const auto t0 = std::chrono::steady_clock::now();
  auto fail = [&](absl::Status s) {
    spdlog::warn("save job={} rank={} path={} failed: {}", request.job_id(), request.rank(),
                 request.path(), s.ToString());
    return s;
  };
  auto where = ResolveSaveDir(request);
  if (!where.ok()) return fail(where.status());
  const auto& [parent, dir] = *where;
  const bool dcp = request.format() == kDcpFormat;
  if (!dcp && !request.format().empty() && request.format() != "ckptd") {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "Save: unknown format '", request.format(), "' (\"ckptd\" or \"", kDcpFormat, "\")")));
  }
  if (!request.dcp_metadata().empty() || !request.raw_targets().empty()) {
    if (!dcp) {
      return fail(absl::InvalidArgumentError(
          "Save: dcp_metadata and raw_targets are for format \"pytorch-dcp\" only"));
    }
  }
  if (!request.dcp_metadata().empty()) {
    auto committed = CommitDcp(caller, request, parent, dir);
    if (!committed.ok()) return fail(committed.status());
    v1::SaveResponse resp = *committed;
    resp.set_seconds(Seconds(t0));
    return resp;
  }
  const std::string who = absl::StrCat("save job '", request.job_id(), "' rank ", request.rank());
  auto bytes = policy_.CheckRequestLimits(who, request.targets(), request.world_size(),
                                  request.node_ranks_size(), request.barrier_timeout_ms());
  if (!bytes.ok()) return fail(bytes.status());
  if (absl::Status a = policy_.CheckAccess(caller, parent, Policy::Access::kSave); !a.ok()) return fail(a);
  if (request.async_save() && dcp) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        who, ": async_save is for the native format (PyTorch DCP's own async_save stages on the "
             "client side and calls ckptd.torch.DaemonStorageWriter from a thread)")));
  }
  if (absl::Status e = CheckSaveDir(caller, request, dir, dcp); !e.ok()) return fail(e);
  auto reservation = policy_.Reserve(caller, who, *bytes, 0);
  if (!reservation.ok()) return fail(reservation.status());
  auto prepared = PrepareSaveSlot(caller, request, who, *bytes, cancelled);
  if (!prepared.ok()) return fail(prepared.status());
  std::shared_ptr<RankSlot> slot = *prepared;
  slot->cancelled = cancelled;
  slot->registered = absl::Now();
  slot->start = t0;
  JobKey key{JobKind::kSave, request.job_id(), dir, request.unique_id(), caller.uid,
             request.world_size(),
             request.rank(), std::vector<int>(request.node_ranks().begin(), request.node_ranks().end())};
  size_t registered = 0, expected = 0;
  auto reg = jobs_.Register(key, slot, &registered, &expected);
  if (!reg.ok()) return fail(reg.status());
  auto [job, runner] = *reg;
  if (runner) RunGuarded(job, &Daemon::RunSaveJob);
  absl::Status status = jobs_.AwaitSlot(job, slot, request.rank(),
                                         BarrierTimeout(request.barrier_timeout_ms()), nullptr, cancelled);
  if (!status.ok()) return fail(status);
  absl::MutexLock lock(&slot->mu);
  v1::SaveResponse resp = slot->save_result;
  resp.set_seconds(Seconds(t0));
  if (request.async_save()) save_stall_us_ += static_cast<uint64_t>(resp.seconds() * 1e6);
  return resp;
}

void Daemon::RunSaveJob(const std::shared_ptr<Job>& job) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<std::shared_ptr<RankSlot>> slots = SlotsOf(*job);
  auto fail_all = [&](const absl::Status& s) { jobs_.Fail(*job, s); };
  std::vector<ckpt::RankTargets> ranks;
  for (const auto& s : slots) ranks.push_back(s->targets);
  auto plan = ckpt::PlanSave(ranks, job->world_size, job->unique_id.value_or(0));
  if (!plan.ok()) return fail_all(plan.status());
  bool overwrite = slots.front()->save_request.overwrite();
  const bool async = slots.front()->save_request.async_save();
  const std::string format = slots.front()->save_request.format();
  for (const auto& s : slots) {
    if (s->save_request.overwrite() != overwrite) {
      return fail_all(absl::InvalidArgumentError(absl::StrCat(
          "save job '", job->id, "': ranks disagree on overwrite (all must set it or none)")));
    }
    if (s->save_request.async_save() != async) {
      return fail_all(absl::InvalidArgumentError(absl::StrCat(
          "save job '", job->id, "': ranks disagree on async_save (all must set it or none)")));
    }
    if (s->save_request.format() != format) {
      return fail_all(absl::InvalidArgumentError(absl::StrCat(
          "save job '", job->id, "': ranks ", slots.front()->targets.rank, " and ",
          s->targets.rank, " send different formats ('", format, "', '",
          s->save_request.format(), "')")));
    }
  }
  const bool dcp = format == kDcpFormat;
  // Ranks on several daemons: a two-phase save with the others (a PyTorch
  // DCP save's data files are per rank; its coordinator commits .metadata).
  if (!dcp && static_cast<int>(job->expected.size()) < job->world_size) {
    return RunDistributedSave(job, slots);
  }
  if (async) return StartAsyncSave(job, slots, *std::move(plan));
  if (absl::Status s = ckpt::MakeDirs(job->path); !s.ok()) return fail_all(s);
  // One writer per directory; the files go into the directory that is locked
  // (opened without following a symlink), the version checked under the lock.
  auto lock = ckpt::LockDirectory(job->path, 0);
  if (!lock.ok()) {
    return fail_all(ckpt::Annotate(lock.status(), absl::StrCat("save job '", job->id, "'")));
  }
  // The old checkpoint stops existing first: a save that dies midway leaves
  // no commit file over new data files.
  if (absl::Status s =
          dcp ? ckpt::PrepareCommitFile(*lock->directory(), ".metadata",
                                        DcpCheckpointExists(lock->directory()->path()), overwrite)
              : ckpt::PrepareSave(*lock->directory(), plan->unique_id, overwrite);
      !s.ok()) {
    return fail_all(s);
  }
  const NativeSave save = NativeSaveOf(*job, slots, *std::move(plan));
  if (dcp) return WriteDcpSave(job, slots, save.plan, lock->directory(), save.where, t0);
  auto saved = WriteNativeSave(save, lock->directory(), nullptr, nullptr);
  if (!saved.ok()) return fail_all(saved.status());
  metadata_.Drop(job->path);  // new files under a cached directory
  FinishSaveJob(job, slots, [&](const RankSlot& s, v1::SaveResponse& r) {
    for (const auto& f : saved->files_of_rank[s.targets.rank]) r.add_files(f);
    r.set_bytes_written(saved->bytes);
    r.set_metadata_file(absl::StrCat(save.plan.unique_id, ".metadata"));
    r.set_persisted(true);
  });
  spdlog::info("save job={} path={} ranks={} written={}B in {:.3f}s", job->id, job->path,
               slots.size(), saved->bytes, Seconds(t0));
}

void Daemon::FinishSaveJob(const std::shared_ptr<Job>& job,
                           const std::vector<std::shared_ptr<RankSlot>>& slots,
                           const std::function<void(const RankSlot&, v1::SaveResponse&)>& answer) {
  jobs_.Finish(*job, [&] {
    for (const auto& s : slots) {
      absl::MutexLock slot_lock(&s->mu);
      answer(*s, s->save_result);
      s->done = true;
    }
  });
}

}  // namespace ckptd
