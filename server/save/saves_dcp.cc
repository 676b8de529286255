// PyTorch DCP saves (SaveRequest.format "pytorch-dcp",
// ckptd.torch.DaemonStorageWriter): the job's data files, written as DCP
// lays them out, and the commit of its `.metadata` (SaveRequest.dcp_metadata)
// by the job that wrote them.
#include <algorithm>
#include <chrono>
#include <set>

#include <spdlog/spdlog.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/base/status_macros.h"
#include "core/format/foreign.h"
#include "core/format/torch_dcp.h"
#include "core/io/file.h"
#include "core/write/writer.h"
#include "server/save/dcp.h"
#include "server/save/saves.h"

namespace ckptd {

using ckpt::TargetTensor;

void Saves::WriteDcpSave(const std::shared_ptr<Job>& job,
                          const std::vector<std::shared_ptr<RankSlot>>& slots,
                          const ckpt::SavePlan& plan,
                          std::shared_ptr<const ckpt::Directory> dir,
                          const std::map<std::pair<int, std::string>, const uint8_t*>& where,
                          std::chrono::steady_clock::time_point t0) {
  std::set<std::string> raw;
  for (const auto& s : slots) {
    for (const auto& name : s->save_request.raw_targets()) raw.insert(name);
  }
  std::map<int, std::vector<v1::SavedItem>> items_of_rank;
  uint64_t bytes = 0;
  if (absl::Status s = ckpt::WriteFileAtomicIn(dir, kDcpPending, job->id); !s.ok()) {
    return p_.jobs->Fail(*job, s);
  }
  for (int r = 0; r < job->world_size; ++r) {
    if (!job->expected.count(r) || plan.writes[r].empty()) continue;
    std::vector<ckpt::DcpItemToWrite> items;
    for (const TargetTensor& t : plan.writes[r]) {
      const std::string what = absl::StrCat("save job '", job->id, "' rank ", r, " tensor '",
                                            t.name, "'");
      if (t.flat_range) {
        return p_.jobs->Fail(*job, absl::InvalidArgumentError(absl::StrCat(
                                 what, ": a flat range cannot be saved as PyTorch DCP (its "
                                 "chunks are boxes)")));
      }
      ckpt::DcpItemToWrite w;
      w.name = t.name;
      w.dtype = t.dtype;
      w.shape = t.box.shape;
      w.data = where.at({r, t.name});
      w.nbytes = t.num_bytes();
      w.raw = raw.count(t.name) > 0;
      if (w.raw && (t.dtype != ckpt::DType::kU8 || t.global_shape.size() != 1 ||
                    t.box.shape != t.global_shape)) {
        return p_.jobs->Fail(*job, absl::InvalidArgumentError(absl::StrCat(
                                 what, ": a raw target must be a whole 1-D U8 tensor")));
      }
      items.push_back(std::move(w));
    }
    const std::string file = absl::StrCat("__", r, "_", plan.unique_id, ".distcp");
    auto written = ckpt::WriteDcpDataFile(dir, file, items);
    if (!written.ok()) return p_.jobs->Fail(*job, written.status());
    for (size_t i = 0; i < items.size(); ++i) {
      v1::SavedItem it;
      it.set_name(items[i].name);
      it.set_file(file);
      it.set_offset((*written)[i].offset);
      it.set_length((*written)[i].length);
      items_of_rank[r].push_back(std::move(it));
      bytes += items[i].nbytes;
    }
  }
  FinishSaveJob(*p_.jobs, *job, slots, [&](const RankSlot& s, v1::SaveResponse& resp) {
    for (const auto& it : items_of_rank[s.targets.rank]) {
      if (resp.files_size() == 0) resp.add_files(it.file());
      *resp.add_items() = it;
    }
    resp.set_bytes_written(bytes);
  });
  spdlog::info("save job={} path={} format={} ranks={} written={}B in {:.3f}s (not committed "
               "until its .metadata)", job->id, job->path, kDcpFormat, slots.size(), bytes,
               Seconds(t0));
}

absl::StatusOr<v1::SaveResponse> Saves::CommitDcp(const Caller& caller,
                                                   const v1::SaveRequest& request,
                                                   const std::string& parent,
                                                   const std::string& dir) {
  const std::string what = absl::StrCat("commit of ", dir);
  if (request.targets_size() > 0 || request.world_size() > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": a dcp_metadata request carries no targets (world_size 1)"));
  }
  if (request.dcp_metadata().size() > p_.config->limits.max_metadata_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": dcp_metadata of ", request.dcp_metadata().size(), " bytes is over "
        "limits.max_metadata_bytes (", p_.config->limits.max_metadata_bytes, ")"));
  }
  auto kind = ckpt::Storage::Default()->Kind(dir);
  if (!kind.ok() || *kind != ckpt::PathKind::kDirectory) {
    return absl::NotFoundError(absl::StrCat(what, ": no such directory (save the data first)"));
  }
  CKPT_RETURN_IF_ERROR(p_.policy->CheckAccess(caller, parent, Policy::Access::kSave));
  CKPT_RETURN_IF_ERROR(p_.policy->CheckAccess(caller, dir, Policy::Access::kSave));
  // A commit reads the whole checkpoint's metadata back: it counts as one of
  // the caller's calls in flight, its metadata bytes against its share.
  CKPT_ASSIGN_OR_RETURN(auto reservation,
                        p_.policy->Reserve(caller, what, request.dcp_metadata().size(), 0));
  auto lock = ckpt::LockDirectory(dir, 0);
  if (!lock.ok()) return ckpt::Annotate(lock.status(), what);
  const ckpt::Directory& d = *lock->directory();
  CKPT_ASSIGN_OR_RETURN(bool exists, d.Exists(".metadata"));
  if (exists && !request.overwrite()) {
    return absl::AlreadyExistsError(absl::StrCat(
        what, ": .metadata already exists; set overwrite to replace the checkpoint"));
  }
  // Only the save job that wrote the data files there last may commit them.
  std::string pending;
  {
    auto f = d.OpenFile(kDcpPending);
    if (!f.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": no pytorch-dcp save wrote data files there since the last commit"));
    }
    const uint64_t n = std::min<uint64_t>((*f)->size(), 4096);
    pending.resize(n);
    CKPT_RETURN_IF_ERROR((*f)->Read(0, n, pending.data()));
  }
  if (pending != request.job_id()) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": its data files were last written by save job '", pending, "', not by '",
        request.job_id(), "' (another save into the same directory replaced them); save again"));
  }
  // Read the checkpoint back through the new metadata before it exists for
  // anyone: every item located and parsed, every tensor covered.
  ckpt::Checkpoint c;
  c.dir = dir;
  c.confine = true;
  if (absl::Status s = ckpt::OpenPickledCheckpoint(&c, d, ".metadata", request.dcp_metadata());
      !s.ok()) {
    return ckpt::Annotate(s, absl::StrCat(what, ": the DCP metadata does not describe the files "
                                          "there"));
  }
  if (c.format != ckpt::CheckpointFormat::kTorchDcp) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": dcp_metadata is not a PyTorch DCP Metadata"));
  }
  CKPT_RETURN_IF_ERROR(
      ckpt::WriteFileAtomicIn(lock->directory(), ".metadata", request.dcp_metadata()));
  if (absl::Status s = d.Remove(kDcpPending); !s.ok()) spdlog::warn("{}", s.ToString());
  CKPT_RETURN_IF_ERROR(d.Sync());
  p_.metadata->Drop(dir);
  spdlog::info("save commit path={} format={} tensors={} bytes={}", dir, kDcpFormat,
               c.metadata.tensors.size(), request.dcp_metadata().size());
  v1::SaveResponse resp;
  resp.set_metadata_file(".metadata");
  return resp;
}

}  // namespace ckptd
