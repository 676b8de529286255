#include "core/checkpoint.h"

#include <dirent.h>

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
#include "core/file.h"
#include "core/foreign.h"
#include "core/safetensors.h"
#include "core/status_macros.h"

namespace ckpt {
namespace {

constexpr uint64_t kMaxMetadataBytes = 4ull << 30;
constexpr uint64_t kMaxIndexBytes = 256ull << 20;

absl::StatusOr<std::vector<std::string>> ListDir(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    int err = errno;
    std::string msg = absl::StrCat(dir, ": cannot open checkpoint directory: ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(msg);
    if (err == ENOTDIR) return absl::InvalidArgumentError(msg);
    if (err == EACCES) return absl::PermissionDeniedError(msg);
    return absl::InternalError(msg);
  }
  std::vector<std::string> names;
  while (struct dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(std::move(n));
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
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

absl::Status CheckDataFiles(Checkpoint& ckpt) {
  std::map<std::string, std::vector<std::pair<std::string, const ShardMeta*>>> by_file;
  for (const auto& [name, t] : ckpt.metadata.tensors) {
    for (const ShardMeta& s : t.shards) by_file[s.file].push_back({name, &s});
  }
  for (const auto& [file, shards] : by_file) {
    const std::string path = JoinPath(ckpt.dir, file);
    auto f = OpenFile(path);
    if (!f.ok()) {
      return absl::Status(f.status().code(),
                          absl::StrCat("checkpoint ", ckpt.dir, ": data file '", file,
                                       "' named by the metadata cannot be opened: ",
                                       f.status().message()));
    }
    CKPT_ASSIGN_OR_RETURN(SafetensorsHeader h, ReadSafetensorsHeader(**f));
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

absl::Status OpenNative(Checkpoint& ckpt, const std::vector<std::string>& names,
                        const OpenOptions& options) {
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
  CKPT_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, kMaxMetadataBytes));
  if (LooksPickled(text)) return OpenPickledCheckpoint(&ckpt, ckpt.metadata_file, text);
  CKPT_ASSIGN_OR_RETURN(ckpt.metadata, ParseMetadataJson(path, text));
  ckpt.metadata.unique_id = uid;
  return absl::OkStatus();
}

// PyTorch DCP: one unversioned, pickled `.metadata` (detected by content).
absl::Status OpenDotMetadata(Checkpoint& ckpt, const OpenOptions& options) {
  if (options.unique_id) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint ", ckpt.dir, ": a PyTorch DCP checkpoint has no versions; drop --unique-id"));
  }
  ckpt.metadata_file = ".metadata";
  const std::string path = JoinPath(ckpt.dir, ckpt.metadata_file);
  CKPT_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, kMaxMetadataBytes));
  if (!LooksPickled(text)) {
    return absl::DataLossError(absl::StrCat(path, ": not a pickle (PyTorch DCP metadata)"));
  }
  return OpenPickledCheckpoint(&ckpt, ckpt.metadata_file, text);
}

absl::Status OpenHuggingFace(Checkpoint& ckpt, const std::vector<std::string>& names) {
  std::vector<std::string> files;
  const bool has_index =
      std::find(names.begin(), names.end(), "model.safetensors.index.json") != names.end();
  if (has_index) {
    const std::string path = JoinPath(ckpt.dir, "model.safetensors.index.json");
    CKPT_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, kMaxIndexBytes));
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
  for (const std::string& file : files) {
    const std::string path = JoinPath(ckpt.dir, file);
    auto f = OpenFile(path);
    if (!f.ok()) {
      return absl::Status(f.status().code(), absl::StrCat("checkpoint ", ckpt.dir, ": file '",
                                                          file, "': ", f.status().message()));
    }
    CKPT_ASSIGN_OR_RETURN(SafetensorsHeader h, ReadSafetensorsHeader(**f));
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

absl::StatusOr<std::vector<int64_t>> ListVersions(const std::string& dir) {
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(dir));
  std::vector<int64_t> out;
  for (const std::string& n : names) {
    absl::string_view v = n;
    int64_t uid;
    if (absl::ConsumeSuffix(&v, ".metadata") && ParseUid(v, &uid)) out.push_back(uid);
  }
  std::sort(out.begin(), out.end());
  return out;
}

absl::StatusOr<Checkpoint> OpenCheckpoint(const std::string& dir, const OpenOptions& options) {
  Checkpoint ckpt;
  ckpt.dir = dir;
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(dir));
  CKPT_ASSIGN_OR_RETURN(ckpt.versions, ListVersions(dir));
  if (!ckpt.versions.empty()) {
    ckpt.format = CheckpointFormat::kNative;
    CKPT_RETURN_IF_ERROR(OpenNative(ckpt, names, options));
  } else if (std::find(names.begin(), names.end(), ".metadata") != names.end()) {
    CKPT_RETURN_IF_ERROR(OpenDotMetadata(ckpt, options));
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
    CKPT_RETURN_IF_ERROR(OpenHuggingFace(ckpt, names));
  }
  std::set<std::string> files;
  for (const auto& [name, t] : ckpt.metadata.tensors) {
    for (const ShardMeta& s : t.shards) files.insert(s.file);
  }
  ckpt.data_files.assign(files.begin(), files.end());
  if (options.check_data_files && ckpt.format == CheckpointFormat::kNative) {
    CKPT_RETURN_IF_ERROR(CheckDataFiles(ckpt));
  }
  return ckpt;
}

}  // namespace ckpt
