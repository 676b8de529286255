// Save's checks and a save job's run (saves.h).
#include "server/save/saves.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/format/checkpoint.h"
#include "core/io/file.h"
#include "core/write/writer.h"
#include "server/save/dcp.h"
#include "server/save/native_save.h"

namespace ckptd {

void FinishSaveJob(JobRegistry& jobs, Job& job, const std::vector<std::shared_ptr<RankSlot>>& slots,
                   const std::function<void(const RankSlot&, v1::SaveResponse&)>& answer) {
  jobs.Finish(job, [&] {
    for (const auto& s : slots) {
      absl::MutexLock slot_lock(&s->mu);
      answer(*s, s->save_result);
      s->done = true;
    }
  });
}

void PublishSaved(ckpt::HostCache* cache, const ckpt::Directory& dir,
                  const std::vector<std::string>& files) {
  for (const std::string& name : files) {
    // Beneath the directory the save locked and wrote (confined as it was
    // opened), not by path: a path could lead elsewhere by now.
    auto f = dir.OpenFile(name);
    if (!f.ok()) continue;
    auto before = (*f)->Stamp();
    const uint64_t n = (*f)->size();
    if (!before.ok() || !cache->CanHold(n)) continue;
    auto pending = cache->Reserve(n);
    if (pending == nullptr) continue;
    if (!(*f)->Read(0, n, cache->PendingData(pending)).ok()) continue;
    // Published only when the file is still the one just written.
    auto after = dir.Stat(name);
    if (!after.ok() || !(*after == *before)) continue;
    cache->Publish(std::move(pending), ckpt::JoinPath(dir.path(), name), *before, 0);
  }
}

absl::StatusOr<std::pair<std::string, std::string>> Saves::ResolveSaveDir(
    const v1::SaveRequest& request) const {
  // The output directory may not exist yet: resolve its parent. A relative
  // path is under the first root (as for loads), so the nodes of a
  // multi-node save can name node-local directories that live at different
  // places.
  std::string out = request.path().empty() ? std::string() : p_.policy->Absolute(request.path());
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  const size_t slash = out.rfind('/');
  if (out.empty() || slash == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("Save: path '", request.path(), "' names no directory"));
  }
  const std::string leaf = out.substr(slash + 1);
  auto parent = p_.policy->ResolvePath(slash == 0 ? "/" : out.substr(0, slash));
  if (!parent.ok()) return parent.status();
  if (!ckpt::IsPlainFileName(leaf)) {
    return absl::InvalidArgumentError(absl::StrCat("Save: bad directory name '", leaf, "'"));
  }
  return std::make_pair(*parent, ckpt::JoinPath(*parent, leaf));
}

absl::StatusOr<int64_t> Saves::NextVersion(const std::string& dir) const {
  int64_t newest = -1;
  auto kind = ckpt::Storage::Default()->Kind(dir);
  if (kind.ok() && *kind == ckpt::PathKind::kDirectory) {
    CKPT_ASSIGN_OR_RETURN(std::vector<int64_t> versions, ckpt::ListVersions(dir));
    if (!versions.empty()) newest = versions.back();
  }
  if (auto persisting = p_.async_saves->NewestPersisting(dir)) newest = std::max(newest, *persisting);
  if (newest == INT64_MAX) {
    return absl::OutOfRangeError(absl::StrCat(dir, " holds version ", newest, ": no next one"));
  }
  return newest + 1;
}

absl::Status Saves::CheckSaveDir(const Caller& caller, const v1::SaveRequest& request,
                                  const std::string& dir, bool dcp) const {
  auto kind = ckpt::Storage::Default()->Kind(dir);
  if (kind.ok() && *kind != ckpt::PathKind::kMissing) {
    if (*kind != ckpt::PathKind::kDirectory) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Save: ", dir,
          *kind == ckpt::PathKind::kSymlink ? " is a symbolic link" : " is not a directory",
          "; save into a real directory inside a root"));
    }
    if (absl::Status a = p_.policy->CheckAccess(caller, dir, Policy::Access::kSave); !a.ok()) return a;
    // Early answer for the ranks; RunSaveJob checks again under the directory lock.
    auto exists = dcp ? ckpt::CommitFileExists(dir, ".metadata")
                      : ckpt::VersionExists(dir, request.unique_id());
    if (!request.overwrite() && !request.next_unique_id() && exists.ok() && *exists) {
      return absl::AlreadyExistsError(
          dcp ? absl::StrCat("Save: ", DcpCheckpointExists(dir))
              : absl::StrCat("Save: version ", request.unique_id(), " already exists in ", dir,
                             " (", request.unique_id(),
                             ".metadata); choose another unique_id or set overwrite"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<RankSlot>> Saves::PrepareSaveSlot(
    const Caller& caller, const v1::SaveRequest& request, const std::string& who, uint64_t bytes) {
  // The rank and its targets checked as a Load's; its bytes in a segment
  // (or device tensors, staged below), checked as a Load's destination.
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<RankSlot> slot,
                        NewRankSlot("Save", request.job_id(), request.rank(),
                                    request.world_size(), request.node_ranks(),
                                    request.targets()));
  const std::string rank_who = absl::StrCat("job '", request.job_id(), "' rank ", request.rank());
  std::vector<TargetPlace> places = PlacesOf(request.targets(), slot->targets);
  if (request.has_cuda_ipc()) {
    CKPT_ASSIGN_OR_RETURN(slot->destination, p_.opener->OpenDevice(caller, request.cuda_ipc(),
                                                                   std::move(places), rank_who));
  } else {
    CKPT_ASSIGN_OR_RETURN(SegmentSource source, p_.opener->SegmentSourceOf(caller, request.shm(), rank_who));
    CKPT_ASSIGN_OR_RETURN(slot->destination,
                          SegmentDestination::Open(rank_who, std::move(source), std::move(places)));
  }
  if (request.async_save()) {
    // What the rank will hold of save_buffer once staged (after the barrier,
    // StageAsyncSave): its handed-over segment's mapped pages (`bytes`, as
    // charged), else its copy, packed (exactly the targets' bytes).
    slot->save_buffer_bytes = bytes;
    if (!request.handed_over() || request.has_cuda_ipc()) {
      slot->save_buffer_bytes = 0;
      for (const ckpt::TargetTensor& t : slot->targets.tensors) {
        slot->save_buffer_bytes += t.num_bytes();
      }
    }
    if (absl::Status s = p_.save_buffer->CheckSize(who, slot->save_buffer_bytes); !s.ok()) return s;
  }
  slot->save_request = request;
  if (request.has_cuda_ipc()) {  // its targets then point into the daemon's own copy
    if (absl::Status s = p_.opener->StageDeviceSave(who, slot->save_request, slot->targets,
                                                        &slot->destination); !s.ok()) return s;
  }
  return slot;
}

absl::StatusOr<v1::SaveResponse> Saves::Save(const Caller& caller, const v1::SaveRequest& request,
                                              const std::function<bool()>& cancelled) {
  const auto t0 = std::chrono::steady_clock::now();
  auto fail = [&](absl::Status s) {
    spdlog::warn("save request failed: job={} rank={} path={} code={}: {}", request.job_id(), request.rank(),
                 request.path(), absl::StatusCodeToString(s.code()), std::string(s.message()));
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
  auto bytes = p_.policy->CheckRequestLimits(
      who, request.targets(), request.world_size(), request.node_ranks_size(),
      request.barrier_timeout_ms(),
      request.has_cuda_ipc() ? Policy::Mapped::kHostOnly : Policy::Mapped::kAll);
  if (!bytes.ok()) return fail(bytes.status());
  if (absl::Status a = p_.policy->CheckAccess(caller, parent, Policy::Access::kSave); !a.ok()) return fail(a);
  if (request.async_save() && dcp) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        who, ": async_save is for the native format (PyTorch DCP's own async_save stages on the "
             "client side and calls ckptd.torch.DaemonStorageWriter from a thread)")));
  }
  if (request.next_unique_id() && (dcp || request.unique_id() != 0)) {
    // A save across daemons picks too: each node proposes, the coordinator
    // takes the largest (MultiNodeSave).
    return fail(absl::InvalidArgumentError(absl::StrCat(
        who, ": next_unique_id (the daemon picks the version) is for native saves, with "
             "unique_id 0",
        dcp ? "; this is a pytorch-dcp save" : "")));
  }
  if (absl::Status e = CheckSaveDir(caller, request, dir, dcp); !e.ok()) return fail(e);
  auto reservation = p_.policy->Reserve(caller, who, *bytes, 0);
  if (!reservation.ok()) return fail(reservation.status());
  if (absl::Status k = CheckJobKey(who, request.job_key()); !k.ok()) return fail(k);
  auto prepared = PrepareSaveSlot(caller, request, who, *bytes);
  if (!prepared.ok()) return fail(prepared.status());
  std::shared_ptr<RankSlot> slot = *prepared;
  slot->cancelled = cancelled;
  slot->registered = absl::Now();
  slot->start = t0;
  // No version yet when the daemon picks it (the job's runner does).
  JobKey key{JobKind::kSave, request.job_id(), dir,
             request.next_unique_id() ? std::nullopt : std::optional<int64_t>(request.unique_id()),
             caller.uid,
             request.world_size(),
             request.rank(), std::vector<int>(request.node_ranks().begin(), request.node_ranks().end()),
             request.job_key()};
  size_t registered = 0, expected = 0;
  auto reg = p_.jobs->Register(key, slot, &registered, &expected);
  if (!reg.ok()) return fail(reg.status());
  const std::shared_ptr<Job> job = reg->first;
  const bool runner = reg->second;
  if (runner) p_.jobs->RunGuarded(*job, [&] { RunSaveJob(job); });
  absl::Status status = p_.jobs->AwaitSlot(
      job, slot, request.rank(),
      BarrierTimeout(request.barrier_timeout_ms(), p_.config->barrier_timeout), nullptr, cancelled);
  if (!status.ok()) return fail(status);
  absl::MutexLock lock(&slot->mu);
  v1::SaveResponse resp = slot->save_result;
  resp.set_seconds(Seconds(t0));
  if (request.async_save()) p_.async_saves->AddStall(resp.seconds());
  return resp;
}

void Saves::RunSaveJob(const std::shared_ptr<Job>& job) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<std::shared_ptr<RankSlot>> slots = SlotsOf(*job);
  auto fail_all = [&](const absl::Status& s) { p_.jobs->Fail(*job, s); };
  std::vector<ckpt::RankTargets> ranks;
  for (const auto& s : slots) ranks.push_back(s->targets);
  int64_t version = job->unique_id.value_or(0);
  if (!job->unique_id) {  // SaveRequest.next_unique_id: the daemon picks it
    auto next = NextVersion(job->path);
    if (!next.ok()) return fail_all(ckpt::Annotate(next.status(), absl::StrCat("save job '", job->id, "'")));
    version = *next;
  }
  auto plan = ckpt::PlanSave(ranks, job->world_size, version);
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
  if (!dcp && job->SpansNodes()) {
    return multi_node_(job, slots, version);
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
  p_.metadata->Drop(job->path);  // new files under a cached directory
  FinishSaveJob(*p_.jobs, *job, slots, [&](const RankSlot& s, v1::SaveResponse& r) {
    for (const auto& f : saved->files_of_rank[s.targets.rank]) r.add_files(f);
    r.set_bytes_written(saved->bytes);
    r.set_metadata_file(absl::StrCat(save.plan.unique_id, ".metadata"));
    r.set_unique_id(save.plan.unique_id);
    r.set_persisted(true);
  });
  spdlog::info("save job={} path={} version={} ranks={} written={}B in {:.3f}s", job->id, job->path,
               save.plan.unique_id, slots.size(), saved->bytes, Seconds(t0));
}

absl::Status Saves::StageAsyncSave(Job& job,
                                   const std::vector<std::shared_ptr<RankSlot>>& slots) {
  const std::string who = absl::StrCat("save job '", job.id, "'");
  uint64_t bytes = 0;
  for (const auto& s : slots) bytes += s->save_buffer_bytes;
  // Room first (waiting while earlier persists hold it), charged now that
  // every rank is in: a rank that never comes holds none of it.
  const v1::SaveRequest& first = slots.front()->save_request;
  const absl::Time deadline =
      absl::Now() + BarrierTimeout(first.barrier_timeout_ms(), p_.config->barrier_timeout);
  auto any_left = [&slots] {
    for (const auto& s : slots) {
      if (s->cancelled && s->cancelled()) return true;
    }
    return false;
  };
  double waited_s = 0;
  job.SetPhase("waiting for save_buffer room (earlier saves persisting)");
  CKPT_ASSIGN_OR_RETURN(auto charge,
                        p_.save_buffer->Reserve(who, bytes, deadline, any_left, &waited_s));
  for (const auto& s : slots) s->buffer_wait_s = waited_s;
  slots.front()->save_charge = std::move(charge);
  job.SetPhase("staging");
  // The daemon's own copy of each rank's bytes whose segment was not handed
  // over for good (device tensors were copied when staged): only the
  // targets' bytes, packed. The ranks' copies run in parallel.
  std::vector<RankSlot*> to_copy;
  for (const auto& s : slots) {
    if (!s->save_request.handed_over() && !s->save_request.has_cuda_ipc()) to_copy.push_back(s.get());
  }
  std::vector<absl::Status> copied(to_copy.size());
  std::atomic<size_t> next{0};
  auto copy_ranks = [&] {
    for (size_t i = next++; i < to_copy.size(); i = next++) {
      RankSlot& s = *to_copy[i];
      std::vector<std::pair<uint64_t, uint64_t>> ranges;
      for (int t = 0; t < s.save_request.targets_size(); ++t) {
        ranges.emplace_back(s.save_request.targets(t).dest_offset(),
                            s.targets.tensors[t].num_bytes());
      }
      std::vector<uint64_t> at;
      auto copy = MappedSegment::CopyOf(*s.destination->segment(), ranges,
                                        absl::StrCat(who, " rank ", s.targets.rank), &at);
      if (!copy.ok()) {
        copied[i] = copy.status();
        continue;
      }
      for (int t = 0; t < s.save_request.targets_size(); ++t) {
        s.save_request.mutable_targets(t)->set_dest_offset(at[t]);
      }
      s.destination = std::make_unique<SegmentDestination>(
          std::move(*copy), PlacesOf(s.save_request.targets(), s.targets));
    }
  };
  const size_t threads = std::min<size_t>(to_copy.size(), kStageThreads);
  std::vector<std::thread> helpers;
  for (size_t i = 1; i < threads; ++i) helpers.emplace_back(copy_ranks);
  copy_ranks();
  for (std::thread& t : helpers) t.join();
  for (const absl::Status& s : copied) CKPT_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

void Saves::StartAsyncSave(const std::shared_ptr<Job>& job,
                            const std::vector<std::shared_ptr<RankSlot>>& slots,
                            ckpt::SavePlan plan) {
  if (absl::Status staged = StageAsyncSave(*job, slots); !staged.ok()) {
    return p_.jobs->Fail(*job, staged);
  }
  auto pending = p_.async_saves->Start(*job, slots, std::move(plan));
  if (!pending.ok()) return p_.jobs->Fail(*job, pending.status());
  const PendingSave& p = **pending;
  FinishSaveJob(*p_.jobs, *job, slots, [&](const RankSlot& s, v1::SaveResponse& r) {
    r = p.first_answers.at(s.targets.rank);
  });
  spdlog::info("save job={} path={} version={} ranks={}: {}B staged, persisting in the background",
               job->id, job->path, p.save.plan.unique_id, slots.size(), p.bytes_staged);
}

}  // namespace ckptd
