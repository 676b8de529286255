// CachingSource (core/cache/cache.h): a checkpoint directory's reads served
// from the HostCache and filled into it.
#include "core/cache/cache.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/base/parallel.h"
#include "core/base/status_macros.h"

namespace ckpt {

absl::StatusOr<const RandomAccessFile*> CachingSource::Get(const std::string& file) {
  absl::MutexLock lock(&mu_);
  auto it = files_.find(file);
  if (it != files_.end()) return it->second.get();
  if (directory_ == nullptr) {
    CKPT_ASSIGN_OR_RETURN(directory_, Directory::Open(dir_, options_.confine));
  }
  auto opened = directory_->OpenFile(file);
  if (!opened.ok() && absl::IsNotFound(opened.status()) && stamps_.count(file) != 0) {
    // It was there when the checkpoint was opened: it vanished during the
    // load (renamed away or deleted), which is a change, not a bad request.
    return absl::AbortedError(absl::StrCat(JoinPath(dir_, file),
                                           ": file vanished since the checkpoint was opened"));
  }
  CKPT_RETURN_IF_ERROR(opened.status());
  std::unique_ptr<RandomAccessFile> f = std::move(*opened);
  // The stamp of the descriptor the bytes will come from.
  CKPT_ASSIGN_OR_RETURN(FileStamp now, f->Stamp());
  auto want = stamps_.find(file);
  if (want != stamps_.end() && want->second != now) {
    return absl::AbortedError(
        absl::StrCat(f->path(), ": file changed since the checkpoint was opened "
                                "(size/mtime/ctime/inode differ)"));
  }
  const RandomAccessFile* p = f.get();
  files_.emplace(file, std::move(f));
  return p;
}

absl::Status CachingSource::CheckUnchanged(const std::string& file, const RandomAccessFile& f) {
  auto want = stamps_.find(file);
  // The open descriptor: a write into the file (even one that puts mtime
  // back) moves its ctime.
  auto now = f.Stamp();
  if (!now.ok()) return now.status();
  if (want != stamps_.end() && want->second != *now) {
    return absl::AbortedError(absl::StrCat(f.path(), ": file changed during the load"));
  }
  // The name: replaced (renamed over) or removed.
  std::shared_ptr<const Directory> dir;
  {
    absl::MutexLock lock(&mu_);
    dir = directory_;
  }
  auto named = dir->Stat(file);
  if (!named.ok()) {
    if (absl::IsNotFound(named.status())) {
      return absl::AbortedError(absl::StrCat(f.path(), ": file vanished during the load"));
    }
    return absl::AbortedError(absl::StrCat(f.path(), ": file changed during the load: ",
                                           named.status().message()));
  }
  if (want != stamps_.end() && want->second != *named) {
    return absl::AbortedError(absl::StrCat(f.path(), ": file changed during the load"));
  }
  return absl::OkStatus();
}

absl::Status CachingSource::CheckOpenedFilesUnchanged() {
  std::vector<std::pair<std::string, const RandomAccessFile*>> opened;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, f] : files_) opened.emplace_back(name, f.get());
  }
  std::sort(opened.begin(), opened.end());  // the same file named first every time
  // Up to 8 at once (in object storage each check is a HEAD, a round trip).
  std::vector<absl::Status> checked(opened.size());
  ParallelFor(opened.size(), 8,
              [&](size_t i) { checked[i] = CheckUnchanged(opened[i].first, *opened[i].second); });
  for (const absl::Status& s : checked) CKPT_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

class CachingSource::CacheFill final : public Fill {
 public:
  CacheFill(CachingSource* source, std::string file, std::string path, uint64_t offset,
            std::shared_ptr<HostCache::Pending> pending)
      : source_(source),
        file_(std::move(file)),
        path_(std::move(path)),
        offset_(offset),
        pending_(std::move(pending)) {}
  absl::Status Finish() override {
    // A read pinned to the version opened needs no check of the name here
    // (one per read: a HEAD in object storage); CheckOpenedFilesUnchanged
    // still checks every file once the load is done.
    if (!file->ReadsPinned()) CKPT_RETURN_IF_ERROR(source_->CheckUnchanged(file_, *file));
    if (pending_) {
      source_->cache_->Publish(std::move(pending_), path_, source_->stamps_.at(file_), offset_);
    }
    return absl::OkStatus();
  }

 private:
  CachingSource* source_;
  std::string file_, path_;
  uint64_t offset_;
  // null: nothing is kept (no room in the cache, or the fill is unverified).
  std::shared_ptr<HostCache::Pending> pending_;
};

absl::StatusOr<CachingSource::Probed> CachingSource::Probe(const std::string& file,
                                                          uint64_t offset, uint64_t n) {
  Probed p;
  p.path = JoinPath(dir_, file);
  auto stamp_it = stamps_.find(file);
  if (stamp_it == stamps_.end()) {
    return absl::InternalError(absl::StrCat(p.path, ": no file stamp for a planned read"));
  }
  p.stamp = &stamp_it->second;
  // Opening checks the file still has the stamp the plan was made against,
  // so even cache hits never outlive a rewritten file.
  CKPT_ASSIGN_OR_RETURN(p.file, Get(file));
  p.hit = cache_->Lookup(p.path, *p.stamp, offset, n);
  return p;
}

absl::StatusOr<std::unique_ptr<RangeSource::Fill>> CachingSource::BeginFill(
    const std::string& file, uint64_t offset, uint64_t n, bool verify,
    std::optional<RangeView>* served) {
  CKPT_ASSIGN_OR_RETURN(Probed p, Probe(file, offset, n));
  if (p.hit) {
    *served = std::move(*p.hit);
    return nullptr;
  }
  // Unverified bytes are never kept: no reservation (which could evict
  // verified entries) for them. Nor, with defer_fresh_memory, bytes that
  // would wait for fresh memory while the page cache holds them.
  bool keep_them = verify;
  if (keep_them && options_.defer_fresh_memory && cache_->CanHold(n) &&
      !cache_->HasRecycled(n, options_.tenant) && p.file->Cached(offset, n)) {
    keep_them = false;
    absl::MutexLock lock(&mu_);
    deferred_.emplace_back(file, offset);
  }
  auto pending = keep_them ? cache_->Reserve(n, options_.tenant) : nullptr;
  uint8_t* keep = pending ? cache_->PendingData(pending) : nullptr;
  auto fill = std::make_unique<CacheFill>(this, file, p.path, offset, std::move(pending));
  fill->file = p.file;
  fill->keep = keep;
  return fill;
}

absl::StatusOr<RangeView> CachingSource::Fetch(
    const std::string& file, uint64_t offset, uint64_t n, std::vector<uint8_t>& scratch,
    const std::function<absl::Status(const uint8_t*)>& verify) {
  CKPT_ASSIGN_OR_RETURN(Probed p, Probe(file, offset, n));
  if (p.hit) return *std::move(p.hit);
  // Without a verify function the bytes are read into scratch and not kept.
  auto pending = verify ? cache_->Reserve(n, options_.tenant) : nullptr;
  uint8_t* dst;
  if (pending) {
    dst = cache_->PendingData(pending);
  } else {
    if (scratch.size() < n) scratch.resize(n);
    dst = scratch.data();
  }
  CKPT_RETURN_IF_ERROR(p.file->Read(offset, n, dst));
  if (!p.file->ReadsPinned()) CKPT_RETURN_IF_ERROR(CheckUnchanged(file, *p.file));
  if (verify) CKPT_RETURN_IF_ERROR(verify(dst));
  if (!pending) return RangeView{dst, nullptr, true};
  RangeView v = cache_->Publish(std::move(pending), p.path, *p.stamp, offset);
  v.from_storage = true;
  return v;
}

absl::StatusOr<std::optional<CachingSource::SharedFile>> CachingSource::ShareUncached(
    const std::string& file, uint64_t offset, uint64_t n) {
  CKPT_ASSIGN_OR_RETURN(Probed p, Probe(file, offset, n));
  if (p.hit) return std::nullopt;
  absl::StatusOr<int> fd = p.file->ShareReadOnly();
  if (absl::IsUnimplemented(fd.status())) return std::nullopt;  // object storage: ours to read
  if (!fd.ok()) return fd.status();
  absl::MutexLock lock(&mu_);
  deferred_.emplace_back(file, offset);
  return SharedFile{*fd, p.file->size(), p.path, *p.stamp};
}

bool CachingSource::Holds(const std::string& file, uint64_t offset, uint64_t n) const {
  auto stamp = stamps_.find(file);
  return stamp != stamps_.end() &&
         cache_->Peek(JoinPath(dir_, file), stamp->second, offset, n).has_value();
}

std::vector<std::pair<std::string, uint64_t>> CachingSource::Deferred() const {
  absl::MutexLock lock(&mu_);
  return deferred_;
}

}  // namespace ckpt
