#include "core/write/writer.h"


#include <algorithm>
#include <cstdio>
#include <map>
#include <cstring>
#include <set>
#include <tuple>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/exec/executor.h"
#include "core/io/file.h"
#include "core/base/status_macros.h"

namespace ckpt {
std::string DataFileName(int rank, int64_t unique_id) {
  return absl::StrCat(rank, "_", unique_id, ".safetensors");
}

absl::Status MakeDirs(const std::string& dir) {
  return Storage::Default()->CreateDirectories(dir);
}

absl::Status PrepareCommitFile(const Directory& dir, const std::string& commit_file,
                               const std::string& exists_message, bool overwrite) {
  CKPT_ASSIGN_OR_RETURN(bool exists, dir.Exists(commit_file));
  if (!exists) return absl::OkStatus();
  if (!overwrite) return absl::AlreadyExistsError(exists_message);
  if (absl::Status s = dir.Remove(commit_file); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(s.message(),
                                               " (removing it to overwrite the checkpoint)"));
  }
  return dir.Sync();
}

absl::Status PrepareSave(const Directory& dir, int64_t unique_id, bool overwrite) {
  const std::string name = absl::StrCat(unique_id, ".metadata");
  return PrepareCommitFile(
      dir, name, absl::StrCat(dir.path(), ": version ", unique_id, " already exists (", name, ")"),
      overwrite);
}

absl::StatusOr<std::vector<std::pair<std::string, ShardMeta>>> WriteRankFile(
    const std::string& dir, const SavePlan& plan, int rank, const std::vector<const void*>& data) {
  CKPT_ASSIGN_OR_RETURN(auto d, Directory::Open(dir, /*confine=*/true));
  return WriteRankFile(std::move(d), plan, rank, data);
}

absl::StatusOr<std::vector<std::pair<std::string, ShardMeta>>> WriteRankFile(
    std::shared_ptr<const Directory> dir, const SavePlan& plan, int rank,
    const std::vector<const void*>& data) {
  if (rank < 0 || static_cast<size_t>(rank) >= plan.writes.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is outside the save plan's ", plan.writes.size(), " ranks"));
  }
  const auto& writes = plan.writes.at(rank);
  if (data.size() != writes.size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, ": ", writes.size(),
                                                   " tensors to write but ", data.size(),
                                                   " buffers"));
  }
  std::vector<TensorToWrite> tensors;
  std::map<std::string, std::string> meta;
  meta["ckptd.format"] = kMetadataFormatName;
  meta["ckptd.unique_id"] = absl::StrCat(plan.unique_id);
  for (size_t i = 0; i < writes.size(); ++i) {
    const TargetTensor& t = writes[i];
    TensorToWrite w;
    w.name = t.name;
    w.dtype = t.dtype;
    w.shape = t.flat_range ? Shape{t.num_elements()} : t.box.shape;
    w.data = data[i];
    tensors.push_back(std::move(w));
    nlohmann::json j = {{"global_shape", t.global_shape},
                        {"global_offset", t.box.offset},
                        {"local_shape", t.box.shape}};
    if (t.flat_range) j["flat_range"] = {t.flat_range->begin, t.flat_range->end};
    meta[absl::StrCat("ckptd.tensor.", t.name)] = j.dump();
  }
  const std::string file = DataFileName(rank, plan.unique_id);
  CKPT_ASSIGN_OR_RETURN(std::vector<WrittenTensor> written,
                        WriteSafetensorsIn(std::move(dir), file, tensors, meta,
                                           plan.checksum_block));
  std::vector<std::pair<std::string, ShardMeta>> out;
  for (size_t i = 0; i < writes.size(); ++i) {
    const TargetTensor& t = writes[i];
    ShardMeta s;
    s.file = file;
    s.box = t.box;
    s.dtype = t.dtype;
    s.flat_range = t.flat_range;
    s.data_offset = written[i].begin;
    s.nbytes = written[i].end - written[i].begin;
    s.xxh3 = written[i].xxh3;
    out.push_back({t.name, std::move(s)});
  }
  return out;
}

absl::Status FinishSave(const std::string& dir, const SavePlan& plan,
                        const std::vector<std::pair<std::string, ShardMeta>>& shards,
                        const std::map<std::string, std::vector<std::string>>& flat_mapping) {
  CKPT_ASSIGN_OR_RETURN(auto d, Directory::Open(dir, /*confine=*/true));
  return FinishSave(std::move(d), plan, shards, flat_mapping);
}

absl::StatusOr<std::string> SaveMetadataJson(
    const SavePlan& plan, const std::vector<std::pair<std::string, ShardMeta>>& shards,
    const std::map<std::string, std::vector<std::string>>& flat_mapping, const std::string& where) {
  CheckpointMetadata m;
  m.unique_id = plan.unique_id;
  m.checksum_block = plan.checksum_block;
  m.flat_mapping = flat_mapping;
  for (const auto& [name, dt_shape] : plan.tensors) {
    TensorMeta& t = m.tensors[name];
    t.dtype = dt_shape.first;
    t.global_shape = dt_shape.second;
  }
  for (const auto& [name, s] : shards) {
    auto it = m.tensors.find(name);
    if (it == m.tensors.end()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": unplanned tensor '", name, "'"));
    }
    it->second.shards.push_back(s);
  }
  // The ranks together must hold every tensor whole.
  CKPT_RETURN_IF_ERROR(ValidateMetadata(m, where));
  return MetadataToJson(m);
}

absl::Status FinishSave(std::shared_ptr<const Directory> dir, const SavePlan& plan,
                        const std::vector<std::pair<std::string, ShardMeta>>& shards,
                        const std::map<std::string, std::vector<std::string>>& flat_mapping) {
  CKPT_ASSIGN_OR_RETURN(std::string json, SaveMetadataJson(plan, shards, flat_mapping,
                                                           absl::StrCat("saving into ", dir->path())));
  // The data files were each fsynced, renamed and the directory fsynced;
  // the metadata is written (and made durable) last: the commit point.
  return WriteFileAtomicIn(dir, absl::StrCat(plan.unique_id, ".metadata"), json);
}

absl::StatusOr<MergeReport> MergeToHuggingFace(const Checkpoint& checkpoint,
                                               const std::string& out_dir,
                                               const MergeOptions& options) {
  if (options.shards < 1) return absl::InvalidArgumentError("merge: --shards must be >= 1");
  std::vector<std::pair<std::string, std::string>> keys;  // checkpoint name, output name
  for (const auto& [name, t] : checkpoint.metadata.tensors) {
    bool skip = false;
    for (const std::string& p : options.skip_postfix) skip |= absl::EndsWith(name, p);
    if (skip) continue;
    std::string out = name;
    if (!options.prefix.empty()) {
      if (!absl::StartsWith(name, options.prefix)) continue;
      out = name.substr(options.prefix.size());
      if (absl::StartsWith(out, ".")) out = out.substr(1);
      if (out.empty()) out = name;
    }
    keys.push_back({name, out});
  }
  const int n = options.shards;
  if (static_cast<int>(keys.size()) < n) {
    return absl::InvalidArgumentError(absl::StrCat("merge: ", keys.size(),
                                                   " tensors cannot fill ", n, " output files"));
  }
  CKPT_RETURN_IF_ERROR(MakeDirs(out_dir));
  MergeReport report;
  nlohmann::json weight_map = nlohmann::json::object();
  DirectorySource source(checkpoint.dir, SourceOptions{checkpoint.confine});
  size_t pos = 0;
  const size_t base = keys.size() / n, extra = keys.size() % n;
  for (int f = 0; f < n; ++f) {
    size_t count = base + (static_cast<size_t>(f) < extra ? 1 : 0);
    const std::string file =
        absl::StrFormat("%s-%05d-of-%05d.safetensors", options.file_prefix, f + 1, n);
    RankTargets rt;
    for (size_t i = pos; i < pos + count; ++i) {
      const TensorMeta& tm = checkpoint.metadata.tensors.at(keys[i].first);
      TargetTensor t;
      t.name = keys[i].first;
      t.dtype = tm.dtype;
      t.global_shape = tm.global_shape;
      t.box = Box{Shape(tm.global_shape.size(), 0), tm.global_shape};
      rt.tensors.push_back(std::move(t));
    }
    CKPT_ASSIGN_OR_RETURN(LoadPlan lp, PlanLoad(checkpoint.metadata, {rt}));
    std::vector<std::vector<uint8_t>> bufs(rt.tensors.size());
    std::vector<std::vector<void*>> dests(1);
    for (size_t i = 0; i < rt.tensors.size(); ++i) {
      bufs[i].resize(rt.tensors[i].num_bytes());
      dests[0].push_back(bufs[i].data());
    }
    ExecuteOptions eo;
    eo.threads = options.threads;
    CKPT_RETURN_IF_ERROR(ExecutePlan(lp, source, dests, eo).status());
    std::vector<TensorToWrite> tw;
    for (size_t i = 0; i < rt.tensors.size(); ++i) {
      const std::string& out_name = keys[pos + i].second;
      tw.push_back({out_name, rt.tensors[i].dtype, rt.tensors[i].global_shape, bufs[i].data()});
      weight_map[out_name] = file;
      report.total_size += bufs[i].size();
    }
    CKPT_RETURN_IF_ERROR(
        WriteSafetensors(JoinPath(out_dir, file), tw, {{"format", "pt"}}).status());
    report.files.push_back(file);
    report.tensors += count;
    pos += count;
  }
  nlohmann::json index = {{"metadata", {{"total_size", report.total_size}}},
                          {"weight_map", weight_map}};
  CKPT_RETURN_IF_ERROR(WriteFileAtomic(
      JoinPath(out_dir, absl::StrCat(options.file_prefix, ".safetensors.index.json")),
      index.dump(2) + "\n"));
  return report;
}

}  // namespace ckpt
