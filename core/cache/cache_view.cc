#include "core/cache/cache_view.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace ckpt {

ViewRecorder::ViewRecorder(HostCache* cache, uint32_t tenant,
                           std::shared_ptr<RemoteMemory> fallback,
                           std::vector<std::pair<uint64_t, uint64_t>> targets, size_t max_views)
    : cache_(cache),
      tenant_(tenant),
      fallback_(std::move(fallback)),
      max_views_(max_views),
      targets_([&] {
        std::sort(targets.begin(), targets.end());
        return std::move(targets);
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
    views_.push_back({r->key, r->fd, r->block_bytes});
    holds_.push_back(std::move(r->hold));
    base_.push_back(r->block_data);
    by_address_.emplace(reinterpret_cast<uintptr_t>(r->block_data), v);
    last_.push_back(std::numeric_limits<size_t>::max());
  }
  const uint64_t off = static_cast<uint64_t>(p - base_[v]);
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

absl::Status ViewRecorder::Write(const struct iovec* local, const struct iovec* remote,
                                 size_t n) {
  std::vector<struct iovec> rest_local, rest_remote;
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < n; ++i) {
      const auto* p = static_cast<const uint8_t*>(local[i].iov_base);
      const uint64_t address = reinterpret_cast<uintptr_t>(remote[i].iov_base);
      if (local[i].iov_len == 0 || Record(p, local[i].iov_len, address)) continue;
      rest_local.push_back(local[i]);
      rest_remote.push_back(remote[i]);
      written_ += local[i].iov_len;
    }
  }
  if (rest_local.empty()) return absl::OkStatus();
  if (!fallback_) {
    return absl::FailedPreconditionError(
        absl::StrCat(rest_local.size(), " run(s) of bytes not held in the data cache and no "
                                        "process memory to write them into"));
  }
  return fallback_->Write(rest_local.data(), rest_remote.data(), rest_local.size());
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

uint64_t ViewRecorder::bytes_written() const {
  absl::MutexLock lock(&mu_);
  return written_;
}

void ViewRecorder::Release() {
  std::vector<std::shared_ptr<const void>> holds;
  {
    absl::MutexLock lock(&mu_);
    released_ = true;
    holds.swap(holds_);
  }
}

}  // namespace ckpt
