#include "core/cache/cache_view.h"

#include <algorithm>
#include <limits>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "core/exec/copy.h"
#include "core/io/file_posix.h"

namespace ckpt {

ViewRecorder::ViewRecorder(HostCache* cache, uint32_t tenant,
                           std::shared_ptr<RemoteMemory> fallback,
                           std::vector<std::pair<uint64_t, uint64_t>> targets, size_t max_views)
    : cache_(cache),
      tenant_(tenant),
      fallback_(std::move(fallback)),
      max_views_(max_views),
      targets_([&] {
        std::vector<std::pair<uint64_t, uint64_t>> sorted = targets;
        std::sort(sorted.begin(), sorted.end());
        return sorted;
      }()),
      // Each target's place in the request (laid-out copies name targets so:
      // a new process may allocate them in another address order).
      order_([&] {
        std::vector<size_t> by(targets.size());
        for (size_t i = 0; i < by.size(); ++i) by[i] = i;
        std::sort(by.begin(), by.end(),
                  [&](size_t a, size_t b) { return targets[a] < targets[b]; });
        return by;
      }()) {}

size_t ViewRecorder::TargetOf(uint64_t address) const {
  auto it = std::upper_bound(targets_.begin(), targets_.end(),
                             std::make_pair(address, std::numeric_limits<uint64_t>::max()));
  if (it == targets_.begin()) return std::numeric_limits<size_t>::max();
  --it;
  return address < it->second ? static_cast<size_t>(it - targets_.begin())
                              : std::numeric_limits<size_t>::max();
}

bool ViewRecorder::Record(const uint8_t* p, uint64_t n, uint64_t address) {
  if (released_) return false;
  uint32_t v = 0;
  auto it = by_address_.upper_bound(reinterpret_cast<uintptr_t>(p));
  if (it != by_address_.begin() && p + n <= base_[std::prev(it)->second] +
                                               views_[std::prev(it)->second].bytes) {
    v = std::prev(it)->second;
  } else {
    if (views_.size() >= max_views_) return false;
    std::optional<ExportedRange> r = cache_->Export(p, n, tenant_);
    if (!r) return false;
    v = static_cast<uint32_t>(views_.size());
    views_.push_back({r->key, r->fd, r->block_bytes, false, r->serial});
    holds_.push_back(std::move(r->hold));
    base_.push_back(r->block_data);
    by_address_.emplace(reinterpret_cast<uintptr_t>(r->block_data), v);
    last_.push_back(std::numeric_limits<size_t>::max());
  }
  return Append(v, static_cast<uint64_t>(p - base_[v]), n, address);
}

bool ViewRecorder::Append(uint32_t v, uint64_t off, uint64_t n, uint64_t address) {
  recorded_ += n;
  // Extend the view's latest copy where this run continues it: the rest of
  // a run (split where a read piece ended), or the next row of a strided
  // block (same length, same strides).
  if (last_[v] != std::numeric_limits<size_t>::max() &&
      TargetOf(address) == TargetOf(copies_[last_[v]].address)) {
    Copy& c = copies_[last_[v]];
    if (c.count == 1 && off == c.offset + c.length && address == c.address + c.length) {
      c.length += n;
      return true;
    }
    if (c.length == n && off > c.offset && address > c.address) {
      const uint64_t ss = off - c.offset, ds = address - c.address;
      if (c.count == 1 && ds >= n) {  // a second row: sets the strides
        c.src_stride = ss;
        c.dst_stride = ds;
        c.count = 2;
        return true;
      }
      if (c.count > 1 && off == c.offset + c.count * c.src_stride &&
          address == c.address + c.count * c.dst_stride) {
        ++c.count;
        return true;
      }
    }
  }
  if (copies_.size() >= kMaxCopies) {
    recorded_ -= n;
    return false;
  }
  last_[v] = copies_.size();
  copies_.push_back({v, off, address, n, 1, 0, 0});
  return true;
}

bool ViewRecorder::Room(size_t runs) const {
  absl::MutexLock lock(&mu_);
  return !released_ && views_.size() < max_views_ && runs <= kMaxCopies - copies_.size();
}

bool ViewRecorder::RecordFile(uint64_t file_key, int fd, uint64_t file_bytes,
                              const std::string& path, const FileStamp& stamp,
                              const std::vector<FileRun>& runs) {
  bool fire = false;
  {
    absl::MutexLock lock(&mu_);
    auto known = files_.find(file_key);
    const bool fresh = known == files_.end();
    if (released_ || (fresh && views_.size() >= max_views_) ||
        runs.size() > kMaxCopies - copies_.size()) {
      ::close(fd);
      return false;
    }
    uint32_t v = 0;
    if (fresh) {
      v = static_cast<uint32_t>(views_.size());
      views_.push_back({0, fd, file_bytes, true});
      // The descriptor lives as long as the view is held.
      holds_.push_back(std::shared_ptr<const void>(nullptr, [fd](const void*) { ::close(fd); }));
      base_.push_back(nullptr);
      last_.push_back(std::numeric_limits<size_t>::max());
      files_.emplace(file_key, v);
      file_stamps_.push_back({path, stamp});
      file_fds_.push_back(fd);
    } else {
      v = known->second;
      ::close(fd);
    }
    uint64_t bytes = 0;
    for (const FileRun& r : runs) {
      if (r.length == 0) continue;
      Append(v, r.offset, r.length, r.address);  // fits: checked above
      bytes += r.length;
    }
    recorded_ -= bytes;  // counted apart from the cache's
    file_bytes_ += bytes;
    fire = Pending(bytes);
  }
  if (fire) ready_();
  return true;
}

absl::Status ViewRecorder::Write(const struct iovec* local, const struct iovec* remote, size_t n) {
  std::vector<struct iovec> rest_local, rest_remote;
  bool fire = false;
  {
    absl::MutexLock lock(&mu_);
    uint64_t recorded = 0;
    for (size_t i = 0; i < n; ++i) {
      const auto* p = static_cast<const uint8_t*>(local[i].iov_base);
      const uint64_t address = reinterpret_cast<uintptr_t>(remote[i].iov_base);
      if (local[i].iov_len == 0) continue;
      if (Record(p, local[i].iov_len, address)) {
        recorded += local[i].iov_len;
        continue;
      }
      rest_local.push_back(local[i]);
      rest_remote.push_back(remote[i]);
      written_ += local[i].iov_len;
    }
    fire = Pending(recorded);
  }
  if (fire) ready_();
  if (rest_local.empty()) return absl::OkStatus();
  if (!fallback_) {
    return absl::FailedPreconditionError(
        absl::StrCat(rest_local.size(), " run(s) of bytes not held in the data cache and no "
                                        "process memory to write them into"));
  }
  return fallback_->Write(rest_local.data(), rest_remote.data(), rest_local.size());
}

bool ViewRecorder::Pending(uint64_t n) {
  pending_ += n;
  if (!ready_ || notified_ || pending_ == 0 || pending_ < min_pending_) return false;
  notified_ = true;
  return true;
}

void ViewRecorder::NotifyWhenPending(uint64_t min_bytes, std::function<void()> ready) {
  absl::MutexLock lock(&mu_);
  min_pending_ = min_bytes;
  ready_ = std::move(ready);
}

ViewRecorder::Batch ViewRecorder::TakeBatch(bool last) {
  constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
  absl::MutexLock lock(&mu_);
  Batch b;
  if (released_) return b;  // the views' descriptors may be gone
  if (last && batched_ == 0 && !laid_out_dir_.empty()) {
    ServeLaidOut(LaidOutRecipe(/*files=*/false));
  }
  std::vector<uint32_t> local(views_.size(), kNone);
  for (size_t i = batched_; i < copies_.size(); ++i) {
    if (i < replaced_.size() && replaced_[i]) continue;
    Copy c = copies_[i];
    uint32_t& l = local[c.view];
    if (l == kNone) {
      l = static_cast<uint32_t>(b.views.size());
      b.views.push_back(views_[c.view]);
      b.files = b.files || views_[c.view].file;
    }
    c.view = l;
    b.bytes += c.length * c.count;
    b.copies.push_back(c);
  }
  batched_ = copies_.size();
  // The copies handed out are final: what is recorded next starts new ones.
  std::fill(last_.begin(), last_.end(), std::numeric_limits<size_t>::max());
  pending_ = 0;
  notified_ = false;
  return b;
}

std::vector<ViewRecorder::View> ViewRecorder::views() const {
  absl::MutexLock lock(&mu_);
  return views_;
}

std::vector<ViewRecorder::Copy> ViewRecorder::copies() const {
  absl::MutexLock lock(&mu_);
  return copies_;
}

uint64_t ViewRecorder::bytes_recorded() const {
  absl::MutexLock lock(&mu_);
  return recorded_;
}

absl::Status ViewRecorder::CheckFilesUnchanged() const {
  absl::MutexLock lock(&mu_);
  if (released_ && !file_fds_.empty()) {  // the descriptors are closed
    return absl::InternalError("file views checked after they were let go");
  }
  for (size_t i = 0; i < file_fds_.size(); ++i) {
    const auto& [path, stamp] = file_stamps_[i];
    absl::StatusOr<FileStamp> now = StatFd(file_fds_[i], path);
    if (!now.ok()) return now.status();
    if (*now != stamp) {
      return absl::AbortedError(
          absl::StrCat(path, ": file changed during the load (while the client read it)"));
    }
  }
  return absl::OkStatus();
}

uint64_t ViewRecorder::bytes_from_files() const {
  absl::MutexLock lock(&mu_);
  return file_bytes_;
}

uint64_t ViewRecorder::bytes_written() const {
  absl::MutexLock lock(&mu_);
  return written_;
}

void ViewRecorder::Release() {
  std::vector<std::shared_ptr<const void>> holds;
  {
    absl::MutexLock lock(&mu_);
    released_ = true;
    // A laid-out copy may be gathered from these blocks (TakeLaidOutWork).
    if (!laid_out_dir_.empty() && laid_out_bytes_ == 0) {
      kept_ = holds_;
    }
    holds.swap(holds_);
  }
}

bool AppendFileRuns(const CopyOp& op, const TargetTensor& target, uint64_t address,
                    size_t max_runs, std::vector<ViewRecorder::FileRun>* out) {
  if (op.src.dtype != target.dtype) return false;
  std::vector<CopyRun> runs;
  if (!AppendCopyRuns(op.src, target.layout(), op.region, max_runs, &runs)) return false;
  const uint64_t size = DTypeSize(target.dtype);
  for (const CopyRun& r : runs) {
    out->push_back({op.src_offset + static_cast<uint64_t>(r.src) * size,
                    address + static_cast<uint64_t>(r.dst) * size,
                    static_cast<uint64_t>(r.len) * size});
  }
  return true;
}

}  // namespace ckpt
