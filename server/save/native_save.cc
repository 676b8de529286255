#include "server/save/native_save.h"

#include "core/base/status_macros.h"

namespace ckptd {

using ckpt::TargetTensor;

NativeSave NativeSaveOf(const Job& job, const std::vector<std::shared_ptr<RankSlot>>& slots,
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

absl::StatusOr<NativeSaved> WriteNativeFiles(
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

absl::StatusOr<NativeSaved> WriteNativeSave(
    const NativeSave& save, std::shared_ptr<const ckpt::Directory> dir,
    std::atomic<uint64_t>* persisted, const std::function<absl::Status()>& between) {
  CKPT_ASSIGN_OR_RETURN(NativeSaved out, WriteNativeFiles(save, dir, persisted, between));
  if (between) CKPT_RETURN_IF_ERROR(between());
  CKPT_RETURN_IF_ERROR(ckpt::FinishSave(dir, save.plan, out.shards, save.flat_mapping));
  return out;
}

}  // namespace ckptd
