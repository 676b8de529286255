#include "core/format/checkpoint.h"

#include <algorithm>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_join.h"
#include "core/io/file.h"
#include "core/format/foreign.h"
#include "core/format/paddle_format.h"
#include "core/format/torch_dcp.h"
#include "core/format/safetensors.h"
#include "core/base/parallel.h"
#include "core/base/status_macros.h"

namespace ckpt {
namespace {

constexpr uint64_t kMaxIndexBytes = 256ull << 20;

absl::StatusOr<std::shared_ptr<const Directory>> OpenCheckpointDir(const std::string& dir,
                                                                   bool confine) {
  auto d = Directory::Open(dir, confine);
  if (!d.ok()) {
    return absl::Status(d.status().code(),
                        absl::StrCat("checkpoint ", d.status().message()));
  }
  return d;
}

// "{digits}" -> value; false if not all digits.
bool ParseUid(absl::string_view s, int64_t* out) {
  if (s.empty() || s.size() > 18) return false;
  for (char c : s) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  return absl::SimpleAtoi(s, out);
}

// "{rank}_{uid}.{ext}" -> uid.
bool ParseDataFileName(absl::string_view name, absl::string_view ext, int64_t* uid) {
  if (!absl::ConsumeSuffix(&name, ext)) return false;
  size_t us = name.find('_');
  if (us == absl::string_view::npos) return false;
  int64_t rank;
  return ParseUid(name.substr(0, us), &rank) && ParseUid(name.substr(us + 1), uid);
}

// A data file opened and its safetensors header read (ReadHeaders).
struct HeaderRead {
  absl::Status opened;  // the open's failure (its message as the storage gave it)
  FileStamp stamp;
  absl::StatusOr<SafetensorsHeader> header = absl::UnknownError("not read");
};

// Opens `files` of `dir` and reads their safetensors headers, up to 8 at a
// time: in object storage each is a HEAD and a GET, whose round trips would
// add up over a checkpoint of many files. Results in the order of `files`.
std::vector<HeaderRead> ReadHeaders(const Directory& dir, const std::vector<std::string>& files) {
  std::vector<HeaderRead> out(files.size());
  ParallelFor(files.size(), 8, [&](size_t i) {
    auto f = dir.OpenFile(files[i]);
    if (!f.ok()) {
      out[i].opened = f.status();
      return;
    }
    auto stamp = (*f)->Stamp();
    if (!stamp.ok()) {
      out[i].opened = stamp.status();
      return;
    }
    out[i].stamp = *stamp;
    out[i].header = ReadSafetensorsHeader(**f);
  });
  return out;
}

absl::Status CheckDataFiles(Checkpoint& ckpt, const Directory& dir) {
  std::map<std::string, std::vector<std::pair<std::string, const ShardMeta*>>> by_file;
  for (const auto& [name, t] : ckpt.metadata.tensors) {
    for (const ShardMeta& s : t.shards) by_file[s.file].push_back({name, &s});
  }
  std::vector<std::string> files;
  for (const auto& [file, shards] : by_file) files.push_back(file);
  std::vector<HeaderRead> read = ReadHeaders(dir, files);
  size_t k = 0;
  for (const auto& [file, shards] : by_file) {
    const std::string path = JoinPath(ckpt.dir, file);
    HeaderRead& r = read[k++];
    if (!r.opened.ok()) {
      return absl::Status(r.opened.code(),
                          absl::StrCat("checkpoint ", ckpt.dir, ": data file '", file,
                                       "' named by the metadata cannot be opened: ",
                                       r.opened.message()));
    }
    ckpt.file_stamps[file] = r.stamp;
    CKPT_ASSIGN_OR_RETURN(SafetensorsHeader h, std::move(r.header));
    std::multimap<uint64_t, const SafetensorsTensor*> by_begin;
    for (const auto& t : h.tensors) by_begin.emplace(t.begin, &t);
    for (const auto& [name, s] : shards) {
      const SafetensorsTensor* match = nullptr;
      auto range = by_begin.equal_range(s->data_offset);
      for (auto it = range.first; it != range.second; ++it) {
        if (it->second->end == s->data_offset + s->nbytes) match = it->second;
      }
      if (match == nullptr) {
        return absl::DataLossError(absl::StrCat(
            path, ": tensor '", name, "' shard ", BoxString(s->box), ": no tensor at bytes [",
            s->data_offset, ", ", s->data_offset + s->nbytes, ") as the metadata says"));
      }
      if (match->dtype != s->dtype) {
        return absl::DataLossError(absl::StrCat(path, ": tensor '", name, "': metadata says ",
                                                DTypeName(s->dtype), " but the file holds ",
                                                DTypeName(match->dtype)));
      }
    }
  }
  return absl::OkStatus();
}

// Reads metadata file `name`, bounded by `max_bytes`, and records its stamp.
absl::StatusOr<std::string> ReadMetadataFile(Checkpoint& ckpt, const Directory& dir,
                                             const std::string& name, uint64_t max_bytes,
                                             absl::string_view limit_name) {
  auto f = dir.OpenFile(name);
  if (!f.ok()) return f.status();
  if ((*f)->size() > max_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat((*f)->path(), ": metadata file is ", (*f)->size(), " bytes, over the ",
                     limit_name, " limit of ", max_bytes, " bytes"));
  }
  CKPT_ASSIGN_OR_RETURN(ckpt.file_stamps[name], (*f)->Stamp());
  std::string out((*f)->size(), '\0');
  CKPT_RETURN_IF_ERROR((*f)->Read(0, out.size(), out.data()));
  return out;
}

absl::Status OpenNative(Checkpoint& ckpt, const Directory& dir,
                        const std::vector<std::string>& names, const OpenOptions& options) {
  int64_t uid = options.unique_id ? *options.unique_id : ckpt.versions.back();
  if (std::find(ckpt.versions.begin(), ckpt.versions.end(), uid) == ckpt.versions.end()) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", ckpt.dir, ": no version ", uid,
                                            " (no file ", uid, ".metadata); versions present: ",
                                            absl::StrJoin(ckpt.versions, ", ")));
  }
  ckpt.unique_id = uid;
  // Data files of this version: both .distcp and .safetensors is an error.
  bool distcp = false, st = false;
  for (const std::string& n : names) {
    int64_t u;
    if (ParseDataFileName(n, ".distcp", &u) && u == uid) distcp = true;
    if (ParseDataFileName(n, ".safetensors", &u) && u == uid) st = true;
  }
  if (distcp && st) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", ckpt.dir, ": version ", uid,
                     " has both .distcp and .safetensors data files; keep one kind"));
  }
  ckpt.metadata_file = absl::StrCat(uid, ".metadata");
  const std::string path = JoinPath(ckpt.dir, ckpt.metadata_file);
  CKPT_ASSIGN_OR_RETURN(std::string text,
                        ReadMetadataFile(ckpt, dir, ckpt.metadata_file,
                                         options.max_metadata_bytes, "max_metadata_bytes"));
  if (LooksPickled(text)) return OpenPickledCheckpoint(&ckpt, dir, ckpt.metadata_file, text);
  CKPT_ASSIGN_OR_RETURN(ckpt.metadata, ParseMetadataJson(path, text));
  ckpt.metadata.unique_id = uid;
  return absl::OkStatus();
}

// PyTorch DCP: one unversioned, pickled `.metadata` (detected by content).
absl::Status OpenDotMetadata(Checkpoint& ckpt, const Directory& dir,
                             const OpenOptions& options) {
  if (options.unique_id) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint ", ckpt.dir, ": a PyTorch DCP checkpoint has no versions; drop --unique-id"));
  }
  ckpt.metadata_file = ".metadata";
  const std::string path = JoinPath(ckpt.dir, ckpt.metadata_file);
  CKPT_ASSIGN_OR_RETURN(std::string text,
                        ReadMetadataFile(ckpt, dir, ckpt.metadata_file,
                                         options.max_metadata_bytes, "max_metadata_bytes"));
  if (!LooksPickled(text)) {
    return absl::DataLossError(absl::StrCat(path, ": not a pickle (PyTorch DCP metadata)"));
  }
  return OpenPickledCheckpoint(&ckpt, dir, ckpt.metadata_file, text);
}

absl::Status OpenHuggingFace(Checkpoint& ckpt, const Directory& dir,
                             const std::vector<std::string>& names, const OpenOptions& options) {
  std::vector<std::string> files;
  const bool has_index =
      std::find(names.begin(), names.end(), "model.safetensors.index.json") != names.end();
  if (has_index) {
    const std::string path = JoinPath(ckpt.dir, "model.safetensors.index.json");
    const uint64_t limit = std::min(kMaxIndexBytes, options.max_metadata_bytes);
    CKPT_ASSIGN_OR_RETURN(
        std::string text,
        ReadMetadataFile(ckpt, dir, "model.safetensors.index.json", limit,
                         limit == options.max_metadata_bytes ? "max_metadata_bytes" : "index"));
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
      return absl::DataLossError(absl::StrCat(path, ": not valid JSON: ", e.what()));
    }
    auto wm = j.find("weight_map");
    if (!j.is_object() || wm == j.end() || !wm->is_object()) {
      return absl::DataLossError(absl::StrCat(path, ": no 'weight_map' object"));
    }
    std::set<std::string> set;
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it.value().is_string() || !IsPlainFileName(it.value().get<std::string>())) {
        return absl::DataLossError(absl::StrCat(path, ": weight_map entry for '", it.key(),
                                                "' is not a plain file name"));
      }
      set.insert(it.value().get<std::string>());
    }
    files.assign(set.begin(), set.end());
  } else {
    for (const std::string& n : names) {
      if (absl::EndsWith(n, ".safetensors")) files.push_back(n);
    }
  }
  std::vector<HeaderRead> read = ReadHeaders(dir, files);
  for (size_t k = 0; k < files.size(); ++k) {
    const std::string& file = files[k];
    if (!read[k].opened.ok()) {
      return absl::Status(read[k].opened.code(), absl::StrCat("checkpoint ", ckpt.dir, ": file '",
                                                              file, "': ", read[k].opened.message()));
    }
    ckpt.file_stamps[file] = read[k].stamp;
    CKPT_ASSIGN_OR_RETURN(SafetensorsHeader h, std::move(read[k].header));
    for (const SafetensorsTensor& t : h.tensors) {
      if (ckpt.metadata.tensors.count(t.name)) {
        return absl::DataLossError(absl::StrCat("checkpoint ", ckpt.dir, ": tensor '", t.name,
                                                "' appears in more than one file (", file,
                                                " and another)"));
      }
      TensorMeta tm;
      tm.dtype = t.dtype;
      tm.global_shape = t.shape;
      ShardMeta s;
      s.file = file;
      s.box = Box{Shape(t.shape.size(), 0), t.shape};
      s.dtype = t.dtype;
      s.data_offset = t.begin;
      s.nbytes = t.end - t.begin;
      tm.shards.push_back(std::move(s));
      ckpt.metadata.tensors.emplace(t.name, std::move(tm));
    }
  }
  return ValidateMetadata(ckpt.metadata, ckpt.dir);
}

}  // namespace

const char* FormatName(CheckpointFormat f) {
  switch (f) {
    case CheckpointFormat::kNative: return "ckptd";
    case CheckpointFormat::kHuggingFace: return "huggingface-safetensors";
    case CheckpointFormat::kPaddle: return "paddle-flex-checkpoint";
    case CheckpointFormat::kTorchDcp: return "pytorch-dcp";
  }
  return "unknown";
}

namespace {

std::vector<int64_t> VersionsIn(const std::vector<std::string>& names) {
  std::vector<int64_t> out;
  for (const std::string& n : names) {
    absl::string_view v = n;
    int64_t uid;
    if (absl::ConsumeSuffix(&v, ".metadata") && ParseUid(v, &uid)) out.push_back(uid);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

absl::StatusOr<std::vector<int64_t>> ListVersions(const std::string& dir) {
  CKPT_ASSIGN_OR_RETURN(auto d, OpenCheckpointDir(dir, /*confine=*/true));
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, d->List());
  return VersionsIn(names);
}

absl::StatusOr<bool> CommitFileExists(const std::string& dir, const std::string& name) {
  auto d = Directory::Open(dir, /*confine=*/true);
  if (!d.ok()) {
    if (absl::IsNotFound(d.status())) return false;
    return d.status();
  }
  return (*d)->Exists(name);
}

absl::StatusOr<bool> VersionExists(const std::string& dir, int64_t unique_id) {
  return CommitFileExists(dir, absl::StrCat(unique_id, ".metadata"));
}

absl::StatusOr<Checkpoint> OpenCheckpoint(const std::string& dir, const OpenOptions& options) {
  Checkpoint ckpt;
  ckpt.dir = dir;
  ckpt.confine = options.confine;
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<const Directory> d,
                        OpenCheckpointDir(dir, options.confine));
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, d->List());
  ckpt.versions = VersionsIn(names);
  if (!ckpt.versions.empty()) {
    ckpt.format = CheckpointFormat::kNative;
    CKPT_RETURN_IF_ERROR(OpenNative(ckpt, *d, names, options));
  } else if (std::find(names.begin(), names.end(), ".metadata") != names.end()) {
    CKPT_RETURN_IF_ERROR(OpenDotMetadata(ckpt, *d, options));
  } else {
    bool any_st = false, any_distcp = false;
    for (const std::string& n : names) {
      any_st |= absl::EndsWith(n, ".safetensors");
      any_distcp |= absl::EndsWith(n, ".distcp");
    }
    if (any_distcp) {
      return absl::NotFoundError(absl::StrCat("checkpoint ", dir,
                                              ": .distcp data files but no {unique_id}.metadata"));
    }
    if (!any_st) {
      return absl::NotFoundError(absl::StrCat(
          "checkpoint ", dir, ": no {unique_id}.metadata and no .safetensors files"));
    }
    if (options.unique_id) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint ", dir, ": a HuggingFace checkpoint has no versions; drop --unique-id"));
    }
    ckpt.format = CheckpointFormat::kHuggingFace;
    CKPT_RETURN_IF_ERROR(OpenHuggingFace(ckpt, *d, names, options));
  }
  std::set<std::string> files;
  for (const auto& [name, t] : ckpt.metadata.tensors) {
    for (const ShardMeta& s : t.shards) files.insert(s.file);
  }
  ckpt.data_files.assign(files.begin(), files.end());
  if (options.check_data_files && ckpt.format == CheckpointFormat::kNative) {
    CKPT_RETURN_IF_ERROR(CheckDataFiles(ckpt, *d));
  }
  return ckpt;
}

absl::Status OpenPickledCheckpoint(Checkpoint* ckpt, const Directory& dir,
                                   const std::string& metadata_file, const std::string& bytes) {
  const std::string path = JoinPath(ckpt->dir, metadata_file);
  CKPT_ASSIGN_OR_RETURN(pickle::Document doc,
                        pickle::ParseBuffer(path, bytes, MetadataPickleOptions()));
  CKPT_ASSIGN_OR_RETURN(const pickle::Object* root, doc.Obj(doc.root, "metadata root"));
  CheckpointMetadata m;
  switch (doc.Tag(*root)) {
    case kTagPdMetadata: {
      ckpt->format = CheckpointFormat::kPaddle;
      CKPT_ASSIGN_OR_RETURN(m, PaddleMetadataToModel(doc));
      CKPT_RETURN_IF_ERROR(LocatePaddleData(dir, &m, &ckpt->file_stamps));
      break;
    }
    case kTagTMetadata: {
      ckpt->format = CheckpointFormat::kTorchDcp;
      CKPT_ASSIGN_OR_RETURN(
          m, TorchDcpToModel(doc, dir, &ckpt->skipped_items, &ckpt->file_stamps));
      break;
    }
    default:
      return doc.Error(absl::StrCat("pickled metadata whose root is ", doc.ClassName(*root),
                                    ", neither Paddle's nor PyTorch DCP's Metadata"));
  }
  m.unique_id = ckpt->unique_id.value_or(0);
  CKPT_RETURN_IF_ERROR(ValidateMetadata(m, path));
  ckpt->metadata = std::move(m);
  return absl::OkStatus();
}

}  // namespace ckpt
