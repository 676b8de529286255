#include "core/cache/cache_view.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "core/base/xxh3.h"
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
      }()) {
  // Each target's place in the request (laid-out copies name targets so:
  // a new process may allocate them in another address order).
  std::vector<size_t> by(targets.size());
  for (size_t i = 0; i < by.size(); ++i) by[i] = i;
  std::sort(by.begin(), by.end(), [&](size_t a, size_t b) { return targets[a] < targets[b]; });
  order_.resize(by.size());
  for (size_t i = 0; i < by.size(); ++i) order_[i] = by[i];
}

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
  if (last && batched_ == 0 && !laid_out_dir_.empty()) ServeLaidOut(LaidOutRecipe());
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

void ViewRecorder::EnableLaidOut(std::string dir) { laid_out_dir_ = std::move(dir); }

uint64_t ViewRecorder::bytes_laid_out() const {
  absl::MutexLock lock(&mu_);
  return laid_out_bytes_;
}

ViewRecorder::LaidOut ViewRecorder::LaidOutRecipe() const {
  LaidOut r;
  constexpr size_t kNone = std::numeric_limits<size_t>::max();
  struct PerTarget {
    uint64_t bytes = 0, pieces = 0;
    bool out = false;  // a file's bytes, or not the recorder's to say
    std::vector<size_t> copies;
  };
  std::vector<PerTarget> per(targets_.size());
  for (size_t i = 0; i < copies_.size(); ++i) {
    const Copy& c = copies_[i];
    const size_t t = TargetOf(c.address);
    if (t == kNone) continue;
    PerTarget& p = per[t];
    p.out = p.out || views_[c.view].file || (i < replaced_.size() && replaced_[i]);
    p.bytes += c.length * c.count;
    p.pieces += c.count;
    p.copies.push_back(i);
  }
  // In the request's order of targets.
  std::vector<size_t> chosen;
  for (size_t t = 0; t < per.size(); ++t) {
    const PerTarget& p = per[t];
    const uint64_t size = targets_[t].second - targets_[t].first;
    // Every byte from the cache (the copies add up to the target: no byte
    // went through the fallback), and in pieces.
    if (p.out || p.bytes != size || p.pieces < 2 || size / p.pieces >= kLaidOutMaxPiece) continue;
    chosen.push_back(t);
  }
  std::sort(chosen.begin(), chosen.end(), [&](size_t a, size_t b) { return order_[a] < order_[b]; });
  if (chosen.empty()) return r;
  XXH3_state_t* h = XXH3_createState();
  XXH3_64bits_reset(h);
  auto put = [&](uint64_t v) { XXH3_64bits_update(h, &v, sizeof(v)); };
  put(1);  // the recipe's version
  for (size_t t : chosen) {
    LaidOut::Part part;
    part.target = t;
    part.at = r.bytes;
    part.copies = per[t].copies;
    std::sort(part.copies.begin(), part.copies.end(),
              [&](size_t a, size_t b) { return copies_[a].address < copies_[b].address; });
    const uint64_t size = targets_[t].second - targets_[t].first;
    put(order_[t]);
    put(size);
    put(part.copies.size());
    for (size_t i : part.copies) {
      const Copy& c = copies_[i];
      for (uint64_t v : {views_[c.view].serial, c.offset, c.address - targets_[t].first, c.length,
                         c.count, c.src_stride, c.dst_stride}) {
        put(v);
      }
    }
    r.bytes += (size + 4095) & ~uint64_t{4095};  // each target page-aligned in the block
    r.parts.push_back(std::move(part));
  }
  r.fingerprint = XXH3_64bits_digest(h);
  XXH3_freeState(h);
  if (r.bytes < kLaidOutMinBytes) r.parts.clear();
  return r;
}

void ViewRecorder::ServeLaidOut(const LaidOut& r) {
  if (r.parts.empty() || views_.size() >= max_views_) return;
  std::optional<RangeView> found = cache_->FindLaidOut(laid_out_dir_, r.fingerprint, r.bytes);
  if (!found) return;
  std::optional<ExportedRange> ex = cache_->Export(found->data, r.bytes, tenant_);
  if (!ex) return;
  const auto v = static_cast<uint32_t>(views_.size());
  views_.push_back({ex->key, ex->fd, ex->block_bytes, false, ex->serial});
  holds_.push_back(std::move(ex->hold));
  holds_.push_back(std::move(found->pin));  // the entry, while the client copies
  base_.push_back(ex->block_data);
  last_.push_back(std::numeric_limits<size_t>::max());
  replaced_.assign(copies_.size(), false);
  for (const LaidOut::Part& part : r.parts) {
    for (size_t i : part.copies) replaced_[i] = true;
    const auto& [begin, end] = targets_[part.target];
    copies_.push_back({v, ex->offset + part.at, begin, end - begin, 1, 0, 0});
    laid_out_bytes_ += end - begin;
  }
}

std::function<void()> ViewRecorder::TakeLaidOutWork() {
  absl::MutexLock lock(&mu_);
  if (laid_out_dir_.empty() || laid_out_bytes_ > 0 || kept_.empty()) return nullptr;
  const LaidOut r = LaidOutRecipe();
  if (r.parts.empty()) {
    kept_.clear();
    return nullptr;
  }
  struct Piece {
    const uint8_t* src;
    uint64_t dst, length, count, src_stride, dst_stride;
  };
  std::vector<Piece> pieces;
  std::vector<std::pair<uint64_t, uint64_t>> gaps;
  for (size_t k = 0; k < r.parts.size(); ++k) {
    const LaidOut::Part& part = r.parts[k];
    const uint64_t end = part.at + targets_[part.target].second - targets_[part.target].first;
    const uint64_t next = k + 1 < r.parts.size() ? r.parts[k + 1].at : r.bytes;
    if (next > end) gaps.push_back({end, next - end});
    for (size_t i : part.copies) {
      const Copy& c = copies_[i];
      pieces.push_back({base_[c.view] + c.offset, part.at + (c.address - targets_[part.target].first),
                        c.length, c.count, c.src_stride, c.dst_stride});
    }
  }
  return [cache = cache_, tenant = tenant_, dir = laid_out_dir_, fingerprint = r.fingerprint,
          bytes = r.bytes, pieces = std::move(pieces), gaps = std::move(gaps),
          holds = std::move(kept_)]() {
    std::shared_ptr<HostCache::Pending> p = cache->ReserveFree(bytes, tenant);
    if (!p) return;  // no room to spare: the cache keeps checkpoint bytes first
    uint8_t* out = cache->PendingData(p);
    for (const auto& [at, n] : gaps) std::memset(out + at, 0, n);  // padding after targets
    for (const Piece& q : pieces) {
      for (uint64_t k = 0; k < q.count; ++k) {
        std::memcpy(out + q.dst + k * q.dst_stride, q.src + k * q.src_stride, q.length);
      }
    }
    cache->PublishLaidOut(std::move(p), dir, fingerprint);
  };
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
