#include "server/catalog/metadata_cache.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "core/base/status_macros.h"

namespace ckptd {

bool MetadataCache::Fresh(const std::string& dir, const Opened& opened) {
  // An object-storage prefix's stamp is its listing (every object's name,
  // size and ETag one level down): it already covers the files directly
  // beneath it, which need no request each.
  const bool listed = !ckpt::PathScheme(dir).empty();
  auto covered = [&](const std::string& path) {
    return listed && path.size() > dir.size() + 1 && absl::StartsWith(path, dir + "/") &&
           path.find('/', dir.size() + 1) == std::string::npos;
  };
  for (const auto& [path, stamp] : opened.watched) {
    if (covered(path)) continue;
    auto now = ckpt::StatFile(path);
    if (!now.ok() || *now != stamp) return false;
  }
  for (const auto& [file, stamp] : opened.stamps) {
    const std::string path = ckpt::JoinPath(dir, file);
    if (covered(path)) continue;
    auto now = ckpt::StatFile(path);
    if (!now.ok() || *now != stamp) return false;
  }
  return true;
}

absl::StatusOr<std::shared_ptr<MetadataCache::Opened>> MetadataCache::Reopen(
    const std::string& dir, std::optional<int64_t> unique_id, bool all_files_local,
    uint64_t max_metadata_bytes) {
  auto opened = std::make_shared<Opened>();
  // Stamp the directory first: a change racing with the open invalidates.
  CKPT_ASSIGN_OR_RETURN(opened->watched[dir], ckpt::StatFile(dir));
  ckpt::OpenOptions oo;
  oo.unique_id = unique_id;
  oo.check_data_files = all_files_local;
  oo.max_metadata_bytes = max_metadata_bytes;
  oo.confine = true;  // every file beneath the checkpoint directory, no symlinks
  CKPT_ASSIGN_OR_RETURN(opened->checkpoint, ckpt::OpenCheckpoint(dir, oo));
  // The identity of each file as OpenCheckpoint read it (from its
  // descriptor); a stat only for files it did not read.
  const auto& read = opened->checkpoint.file_stamps;
  auto stamp_of = [&](const std::string& name) -> absl::StatusOr<ckpt::FileStamp> {
    auto it = read.find(name);
    if (it != read.end()) return it->second;
    return ckpt::StatFile(ckpt::JoinPath(dir, name));
  };
  if (!opened->checkpoint.metadata_file.empty()) {
    const std::string mp = ckpt::JoinPath(dir, opened->checkpoint.metadata_file);
    CKPT_ASSIGN_OR_RETURN(opened->watched[mp], stamp_of(opened->checkpoint.metadata_file));
  }
  // The HF index, where OpenCheckpoint read one (one appearing later changes
  // the directory's stamp; asking for a missing one costs object storage a
  // HEAD and a listing per open).
  if (auto it = read.find("model.safetensors.index.json"); it != read.end()) {
    opened->watched[ckpt::JoinPath(dir, it->first)] = it->second;
  }
  for (const std::string& f : opened->checkpoint.data_files) {
    auto st = stamp_of(f);
    if (!st.ok() && !all_files_local && absl::IsNotFound(st.status())) continue;
    CKPT_RETURN_IF_ERROR(st.status());
    opened->stamps[f] = *st;
  }
  return opened;
}

absl::StatusOr<std::shared_ptr<const MetadataCache::Opened>> MetadataCache::Open(
    const std::string& dir, std::optional<int64_t> unique_id, bool all_files_local) {
  const auto key = std::make_pair(dir + (all_files_local ? "" : "\n(partial)"),
                                  unique_id.value_or(-1));
  std::shared_ptr<const Opened> cached;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it != entries_.end()) {
      cached = it->second.opened;
      it->second.last_used = ++tick_;
    }
  }
  if (cached != nullptr) {
    // Stat outside the lock: one slow mount must not hold up other loads.
    if (Fresh(dir, *cached)) return cached;
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it != entries_.end() && it->second.opened == cached) entries_.erase(it);
    spdlog::info("metadata of {} changed on disk; reopening", dir);
  }
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<Opened> opened,
                        Reopen(dir, unique_id, all_files_local, max_metadata_bytes_));
  absl::MutexLock lock(&mu_);
  entries_[key] = Entry{opened, ++tick_};
  // Least recently used entries beyond max_entries go.
  while (entries_.size() > max_entries_) {
    auto oldest = entries_.begin();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->second.last_used < oldest->second.last_used) oldest = it;
    }
    entries_.erase(oldest);
  }
  return std::shared_ptr<const Opened>(std::move(opened));
}

void MetadataCache::Drop(const std::string& dir) {
  // By path component: ".../run1" keeps ".../run10"; keys of partial opens
  // are the directory + "\n(partial)".
  const std::string prefix = dir == "/" ? dir : dir + "/";
  absl::MutexLock lock(&mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    const std::string& p = it->first.first;
    const bool under = p == dir || absl::StartsWith(p, dir + "\n") || absl::StartsWith(p, prefix);
    it = under ? entries_.erase(it) : std::next(it);
  }
}

size_t MetadataCache::size() const {
  absl::MutexLock lock(&mu_);
  return entries_.size();
}

}  // namespace ckptd
