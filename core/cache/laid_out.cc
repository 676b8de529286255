// Laid-out copies (ViewRecorder::EnableLaidOut, core/cache/cache_view.h;
// HostCache::PublishLaidOut): a rank's bytes that it took in pieces,
// gathered into one block for its next load.
#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "core/base/xxh3.h"
#include "core/cache/cache_view.h"

namespace ckpt {
namespace {

// `length` bytes at `offset` of the block whose contents are `serial` (at
// `src` in this process) go to `dst` in the laid-out copy.
struct Piece {
  uint64_t serial = 0;
  uint64_t offset = 0;
  uint64_t dst = 0;
  uint64_t length = 0;
  const uint8_t* src = nullptr;
};

// Sorted by destination, neighbours in both joined: the same bytes give the
// same list however a load's copies were cut (a warm load's copies out of
// blocks, a cold load's runs of files found in the blocks its fill made).
void Canonical(std::vector<Piece>* pieces) {
  auto by_dst = [](const Piece& a, const Piece& b) { return a.dst < b.dst; };
  // As a rule already in order (a strided copy's pieces, copies in target
  // order): checked in one pass before tens of thousands are sorted.
  if (!std::is_sorted(pieces->begin(), pieces->end(), by_dst)) {
    std::sort(pieces->begin(), pieces->end(), by_dst);
  }
  size_t out = 0;
  for (const Piece& p : *pieces) {
    if (out > 0) {
      Piece& last = (*pieces)[out - 1];
      if (p.serial == last.serial && p.offset == last.offset + last.length &&
          p.dst == last.dst + last.length) {
        last.length += p.length;
        continue;
      }
    }
    (*pieces)[out++] = p;
  }
  pieces->resize(out);
}

// Names a laid-out copy: its targets (place in the request, size) in block
// order and the canonical pieces it is copied from.
// Hashed in one call over the words laid out in a buffer (a streaming
// update per word cost milliseconds for a column half of a large tensor).
uint64_t Fingerprint(const std::vector<std::pair<uint64_t, uint64_t>>& targets,
                     const std::vector<Piece>& pieces) {
  std::vector<uint64_t> words;
  words.reserve(2 + 2 * targets.size() + 4 * pieces.size());
  words.push_back(3);  // the recipe's version
  words.push_back(targets.size());
  for (const auto& [index, size] : targets) {
    words.push_back(index);
    words.push_back(size);
  }
  for (const Piece& p : pieces) {
    for (uint64_t v : {p.serial, p.offset, p.dst, p.length}) words.push_back(v);
  }
  return XXH3_64bits(words.data(), words.size() * sizeof(uint64_t));
}

}  // namespace

void ViewRecorder::EnableLaidOut(std::string dir) {
  absl::MutexLock lock(&mu_);
  laid_out_dir_ = std::move(dir);
}

uint64_t ViewRecorder::bytes_laid_out() const {
  absl::MutexLock lock(&mu_);
  return laid_out_bytes_;
}

ViewRecorder::LaidOut ViewRecorder::LaidOutRecipe(bool files) const {
  LaidOut r;
  constexpr size_t kNone = std::numeric_limits<size_t>::max();
  struct PerTarget {
    uint64_t bytes = 0, pieces = 0;
    bool out = false;
    std::vector<size_t> copies;
  };
  std::vector<PerTarget> per(targets_.size());
  for (size_t i = 0; i < copies_.size(); ++i) {
    const Copy& c = copies_[i];
    const size_t t = TargetOf(c.address);
    if (t == kNone) continue;
    PerTarget& p = per[t];
    p.out = p.out || (views_[c.view].file && !files) || (i < replaced_.size() && replaced_[i]);
    p.bytes += c.length * c.count;
    p.pieces += c.count;
    p.copies.push_back(i);
  }
  std::vector<size_t> chosen;
  uint64_t pieces = 0;
  for (size_t t = 0; t < per.size(); ++t) {
    const PerTarget& p = per[t];
    const uint64_t size = targets_[t].second - targets_[t].first;
    // Every byte from the cache or a file (the copies add up to the target:
    // none went through the fallback), and in pieces.
    if (p.out || p.bytes != size || p.pieces < 2 || size / p.pieces >= kLaidOutMaxPiece) continue;
    chosen.push_back(t);
    pieces += p.pieces;
  }
  if (pieces > kLaidOutMaxPieces) return r;
  // In the request's order of targets (a new process may allocate them in
  // another address order), each page-aligned in the block.
  std::sort(chosen.begin(), chosen.end(),
            [&](size_t a, size_t b) { return order_[a] < order_[b]; });
  for (size_t t : chosen) {
    r.parts.push_back({t, r.bytes, std::move(per[t].copies)});
    r.bytes += (targets_[t].second - targets_[t].first + 4095) & ~uint64_t{4095};
  }
  if (r.bytes < kLaidOutMinBytes) r.parts.clear();
  return r;
}

template <typename Fn>
std::vector<std::pair<uint64_t, uint64_t>> ViewRecorder::ForEachRun(const LaidOut& r,
                                                                    Fn fn) const {
  std::vector<std::pair<uint64_t, uint64_t>> targets;
  for (const LaidOut::Part& part : r.parts) {
    const auto& [begin, end] = targets_[part.target];
    targets.push_back({order_[part.target], end - begin});
    for (size_t i : part.copies) {
      const Copy& c = copies_[i];
      for (uint64_t k = 0; k < c.count; ++k) {
        fn(c.view, c.offset + k * c.src_stride, part.at + c.address + k * c.dst_stride - begin,
           c.length);
      }
    }
  }
  return targets;
}

void ViewRecorder::ServeLaidOut(const LaidOut& r) {
  // Nothing to look for (the first warm loads): no expanding and sorting
  // the pieces (tens of thousands for a column half of a large tensor).
  if (r.parts.empty() || views_.size() >= max_views_ || cache_->stats().laid_out_entries == 0) {
    return;
  }
  std::vector<Piece> pieces;
  size_t count = 0;
  for (const LaidOut::Part& part : r.parts) {
    for (size_t i : part.copies) count += copies_[i].count;
  }
  pieces.reserve(count);
  const std::vector<std::pair<uint64_t, uint64_t>> targets =
      ForEachRun(r, [&](uint32_t v, uint64_t offset, uint64_t dst, uint64_t length)
                           ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        pieces.push_back({views_[v].serial, offset, dst, length, nullptr});
      });
  Canonical(&pieces);
  std::optional<RangeView> found =
      cache_->FindLaidOut(laid_out_dir_, Fingerprint(targets, pieces), r.bytes);
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

bool ViewRecorder::WantsLaidOut() {
  absl::MutexLock lock(&mu_);
  if (laid_out_dir_.empty() || laid_out_bytes_ > 0 || kept_.empty()) return false;
  if (!LaidOutRecipe(/*files=*/true).parts.empty()) return true;
  kept_.clear();
  return false;
}

ViewRecorder::Work ViewRecorder::TakeLaidOutWork() {
  absl::MutexLock lock(&mu_);
  if (laid_out_dir_.empty() || laid_out_bytes_ > 0 || kept_.empty()) return nullptr;
  const LaidOut r = LaidOutRecipe(/*files=*/true);
  if (r.parts.empty()) {
    kept_.clear();
    return nullptr;
  }
  // Pieces of blocks as recorded; pieces of files (file: index into
  // file_stamps_) looked up in the cache when the work runs.
  struct Run {
    Piece piece;
    int file = -1;
  };
  std::vector<Run> runs;
  std::vector<std::pair<uint64_t, uint64_t>> targets =
      ForEachRun(r, [&](uint32_t v, uint64_t offset, uint64_t dst, uint64_t length)
                           ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        Run run;
        run.piece = {views_[v].serial, offset, dst, length, nullptr};
        if (views_[v].file) {
          run.file = static_cast<int>(v);
        } else {
          run.piece.src = base_[v] + offset;
        }
        runs.push_back(run);
      });
  std::vector<std::pair<uint64_t, uint64_t>> gaps;  // padding after each target
  for (size_t k = 0; k < r.parts.size(); ++k) {
    const auto& [begin, end] = targets_[r.parts[k].target];
    const uint64_t stop = r.parts[k].at + (end - begin);
    const uint64_t next = k + 1 < r.parts.size() ? r.parts[k + 1].at : r.bytes;
    if (next > stop) gaps.push_back({stop, next - stop});
  }
  // Per file view: the cache path and stamp its bytes are filed under.
  std::vector<std::pair<std::string, FileStamp>> files(views_.size());
  {
    size_t n = 0;  // file views are numbered in the order they were made
    for (size_t v = 0; v < views_.size(); ++v) {
      if (views_[v].file && n < file_stamps_.size()) files[v] = file_stamps_[n++];
    }
  }
  return [cache = cache_, tenant = tenant_, dir = laid_out_dir_, bytes = r.bytes,
          runs = std::move(runs), targets = std::move(targets), gaps = std::move(gaps),
          files = std::move(files),
          holds = std::move(kept_)](const std::function<void()>& pause) {
    std::vector<Piece> pieces;
    pieces.reserve(runs.size());
    std::vector<std::shared_ptr<const void>> pins;
    for (const Run& run : runs) {
      Piece p = run.piece;
      if (run.file >= 0) {
        // Filled into the cache after the load (its fill ran before this).
        const auto& [path, stamp] = files[run.file];
        std::optional<RangeView> hit = cache->Peek(path, stamp, p.offset, p.length);
        if (!hit) return;  // not kept (the budget, a changed file): nothing to gather
        std::optional<std::pair<uint64_t, uint64_t>> at = cache->BlockSerial(hit->data, p.length);
        if (!at) return;
        p.serial = at->first;
        p.offset = at->second;
        p.src = hit->data;
        pins.push_back(std::move(hit->pin));
      }
      pieces.push_back(p);
    }
    Canonical(&pieces);
    const uint64_t fingerprint = Fingerprint(targets, pieces);
    // Made already (a load in between took the same pieces before this ran).
    if (cache->FindLaidOut(dir, fingerprint, bytes, /*serve=*/false)) return;
    std::shared_ptr<HostCache::Pending> pending = cache->ReserveFree(bytes, tenant);
    if (!pending) return;  // no room to spare: the cache keeps checkpoint bytes first
    uint8_t* out = cache->PendingData(pending);
    for (const auto& [at, n] : gaps) std::memset(out + at, 0, n);  // padding after targets
    uint64_t since = 0;  // bytes copied since the last pause
    for (const Piece& p : pieces) {
      std::memcpy(out + p.dst, p.src, p.length);
      since += p.length;
      if (pause && since >= kLaidOutPauseBytes) {
        pause();
        since = 0;
      }
    }
    cache->PublishLaidOut(std::move(pending), dir, fingerprint);
  };
}

}  // namespace ckpt
