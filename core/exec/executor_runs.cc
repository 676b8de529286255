#include "core/exec/executor_runs.h"

#include <chrono>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "core/base/checksum.h"
#include "core/base/sorted_append.h"
#include "core/base/status_macros.h"
#include "core/exec/copy.h"

namespace ckpt {
namespace exec_internal {

using Clock = std::chrono::steady_clock;

absl::Status ChecksumError(const std::string& file, const ReadRange::Check& c) {
  return absl::DataLossError(absl::StrCat(file, ": tensor '", c.tensor, "' bytes [", c.offset,
                                          ", ", c.offset + c.nbytes,
                                          ") fail their checksum (file corrupt or torn)"));
}

absl::Status CopyCountError(const RankPlan& rp, const CopyOp& op, int64_t n) {
  return absl::InternalError(absl::StrCat("rank ", rp.rank, " tensor '",
                                          rp.targets[op.target].name, "': copied ", n,
                                          " elements, planned ", op.elements));
}

bool RunWriter::Prepare(const LoadPlan& plan, size_t i,
                        const std::vector<std::pair<uint32_t, uint32_t>>& copies,
                        const std::vector<uint8_t>& skip, Delivery& delivery,
                        absl::Status* error) {
  plan_ = &plan;
  read_ = &plan.reads[i];
  segs_.clear();
  next_ = 0;
  active_.clear();
  // Beyond one run per 256 bytes on average, walking runs costs more than
  // CopyRegion's walk: such reads go copy by copy.
  size_t budget = std::max<uint64_t>(64, read_->length / 256);
  delivered_.assign(plan.ranks.size(), 0);
  // A copy's runs come in offset order as a rule (a box walked row by row):
  // merged into the others' (a column half of a 64 MiB read is thousands of
  // runs per rank), sorted only where they are not.
  SortedAppend<Segment, decltype(&ByOffset)> sorted(&segs_, &ByOffset);
  for (const auto& [r, c] : copies) {
    if (skip[r] == 2) continue;  // the worker's memo: 2 = skip
    const RankPlan& rp = plan.ranks[r];
    const CopyOp& op = rp.copies[c];
    const TargetTensor& t = rp.targets[op.target];
    uint8_t* base = delivery.HostDestination(r, op.target);
    RemoteMemory* remote = nullptr;
    if (base == nullptr) {
      uint64_t address = 0;
      remote = delivery.RemoteDestination(r, op.target, &address);
      if (remote == nullptr) return false;
      base = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(address));
    }
    runs_.clear();
    if (!AppendCopyRuns(op.src, t.layout(), op.region, budget, &runs_)) return false;
    budget -= runs_.size();
    const uint64_t ssz = DTypeSize(op.src.dtype), dsz = DTypeSize(t.dtype);
    const bool cast = op.src.dtype != t.dtype;
    int64_t elements = 0;
    for (const CopyRun& run : runs_) {
      Segment sg;
      sg.off = op.src_offset + static_cast<uint64_t>(run.src) * ssz;
      sg.end = sg.off + static_cast<uint64_t>(run.len) * ssz;
      sg.dst = base + static_cast<uint64_t>(run.dst) * dsz;
      sg.remote = remote;
      sg.sdt = op.src.dtype;
      sg.ddt = t.dtype;
      // A cast converts whole elements: pieces end on 64-byte file offsets,
      // which split no element of a run that starts element-aligned.
      if (cast && sg.off % ssz != 0) return false;
      segs_.push_back(sg);
      elements += run.len;
    }
    if (elements != op.elements) {
      *error = CopyCountError(rp, op, elements);
      return true;
    }
    delivered_[r] += static_cast<uint64_t>(elements) * dsz;
    sorted.Appended();
  }
  sorted.Finish();
  return true;
}

absl::Status RunWriter::Write(const uint8_t* data, uint64_t start, uint64_t stop,
                              bool stream) {
  uint64_t taken = 0;
  absl::Status status = WriteRange(data, start, stop, stream, &taken);
  absl::Status flushed = FlushRemote();
  return status.ok() ? flushed : status;
}

absl::Status RunWriter::WriteRange(const uint8_t* data, uint64_t start, uint64_t stop,
                                   bool stream, uint64_t* taken) {
  while (next_ < segs_.size() && segs_[next_].off < stop) active_.push_back(next_++);
  size_t keep = 0;
  absl::Status status;
  for (uint32_t k : active_) {
    const Segment& sg = segs_[k];
    const uint64_t lo = std::max(sg.off, start), hi = std::min(sg.end, stop);
    if (hi > lo && status.ok()) {
      *taken += hi - lo;
      const uint8_t* src = data + (lo - start);
      if (sg.sdt == sg.ddt) {
        if (sg.remote != nullptr) {
          QueueRemote(sg.remote, src, sg.dst + (lo - sg.off), hi - lo);
        } else if (stream && hi - lo >= kStreamingMinRun) {
          StreamingCopy(sg.dst + (lo - sg.off), src, hi - lo);
        } else {
          std::memcpy(sg.dst + (lo - sg.off), src, hi - lo);
        }
      } else {
        const uint64_t ssz = DTypeSize(sg.sdt), dsz = DTypeSize(sg.ddt);
        const uint64_t count = (hi - lo) / ssz;
        uint8_t* to = sg.dst + (lo - sg.off) / ssz * dsz;
        if (sg.remote != nullptr) {
          absl::StatusOr<uint8_t*> b = Bounce(count * dsz);
          if (b.ok()) {
            ConvertElements(src, sg.sdt, *b, sg.ddt, count);
            QueueRemote(sg.remote, *b, to, count * dsz);
          } else {
            status = b.status();
          }
        } else {
          ConvertElements(src, sg.sdt, to, sg.ddt, count);
        }
      }
    }
    if (sg.end > stop) active_[keep++] = k;
  }
  active_.resize(keep);
  return status;
}

void RunWriter::QueueRemote(RemoteMemory* memory, const uint8_t* from, uint8_t* to, size_t n) {
  RemoteBatch* batch = nullptr;
  for (RemoteBatch& b : batches_) {
    if (b.memory == memory) batch = &b;
  }
  for (size_t i = 0; batch == nullptr && i < batches_.size(); ++i) {
    if (batches_[i].memory == nullptr) batch = &batches_[i];
  }
  if (batch == nullptr) batch = &batches_.emplace_back();
  batch->memory = memory;
  // A run that continues the one before on both sides extends it (rows of
  // a column slice received back to back, for rows back to back in the
  // rank's tensor: one iovec, not one per row).
  if (!batch->local.empty()) {
    iovec& l = batch->local.back();
    iovec& r = batch->remote.back();
    if (static_cast<const uint8_t*>(l.iov_base) + l.iov_len == from &&
        static_cast<uint8_t*>(r.iov_base) + r.iov_len == to) {
      l.iov_len += n;
      r.iov_len += n;
      return;
    }
  }
  batch->local.push_back({const_cast<uint8_t*>(from), n});
  batch->remote.push_back({to, n});
}

absl::StatusOr<uint8_t*> RunWriter::Bounce(size_t n) {
  if (bounce_used_ + n > bounce_.size()) {
    CKPT_RETURN_IF_ERROR(FlushRemote());
    if (n > bounce_.size()) bounce_.resize(std::max<size_t>(n, 8 * piece_));
  }
  uint8_t* p = bounce_.data() + bounce_used_;
  bounce_used_ += n;
  return p;
}

absl::Status RunWriter::FlushRemote() {
  absl::Status status;
  for (RemoteBatch& b : batches_) {
    if (b.memory == nullptr || b.local.empty()) continue;
    absl::Status s = b.memory->Write(b.local.data(), b.remote.data(), b.local.size());
    if (status.ok()) status = s;
    b.memory = nullptr;
    b.local.clear();
    b.remote.clear();
  }
  bounce_used_ = 0;
  return status;
}

absl::Status RunWriter::WriteAll(const uint8_t* data, bool stream) {
  absl::Status s = Write(data, read_->offset, read_->offset + read_->length, stream);
  if (stream) StreamingFence();
  return s;
}

absl::Status RunWriter::WriteSpans(const uint8_t* data, const std::vector<ReadSpan>& spans,
                                   bool stream) {
  uint64_t want = 0, taken = 0, at = 0;
  for (const Segment& sg : segs_) want += sg.end - sg.off;
  absl::Status s;
  for (const ReadSpan& sp : spans) {
    if (sp.end > read_->length || sp.begin >= sp.end) break;  // checked below: bytes missed
    s = WriteRange(data + at, read_->offset + sp.begin, read_->offset + sp.end, stream, &taken);
    if (!s.ok()) break;
    at += sp.end - sp.begin;
  }
  absl::Status flushed = FlushRemote();
  if (s.ok()) s = flushed;
  if (stream) StreamingFence();
  if (s.ok() && taken != want) {
    return absl::DataLossError(absl::StrCat(
        "read of ", plan_->files[read_->file], " bytes [", read_->offset, ", ",
        read_->offset + read_->length, "): the ", spans.size(), " spans received hold ", taken,
        " of the ", want, " bytes its copies take"));
  }
  return s;
}

absl::Status RunWriter::Hash(const uint8_t* data, uint64_t pos, uint64_t n) {
  const ReadRange& rr = *read_;
  const uint64_t end = pos + n;
  while (check_pos_ < checks_.size()) {
    const ReadRange::Check& c = rr.checks[checks_[check_pos_]];
    if (c.offset >= end) break;
    const uint64_t lo = std::max(pos, c.offset), hi = std::min(end, c.offset + c.nbytes);
    if (!hashing_) {
      XXH3_64bits_reset(state_);
      hashing_ = true;
    }
    if (hi > lo) XXH3_64bits_update(state_, data + (lo - pos), hi - lo);
    if (hi < c.offset + c.nbytes) break;  // continues in the next piece
    hashing_ = false;
    ++check_pos_;
    if (XXH3_64bits_digest(state_) != c.xxh3) return ChecksumError(plan_->files[rr.file], c);
  }
  return absl::OkStatus();
}

// Direct pieces: at least 4 MiB (larger device requests; 1-16 MiB measured,
// 4 best on the dev VM's virtio disk), aligned.
uint64_t DirectPiece(uint64_t piece) {
  const uint64_t p = std::max<uint64_t>(piece, 4 << 20);
  return (p + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
}

uint8_t* RunWriter::Scratch(bool direct, uint64_t direct_piece) {
  const uint64_t need = direct ? 2 * std::max(DirectPiece(piece_), direct_piece) + kDirectAlign
                               : piece_;
  if (scratch_.size() < need) scratch_.resize(need);
  if (!direct) return scratch_.data();
  const uintptr_t p = reinterpret_cast<uintptr_t>(scratch_.data());
  return reinterpret_cast<uint8_t*>((p + kDirectAlign - 1) / kDirectAlign * kDirectAlign);
}

absl::Status RunWriter::ReadDirectPieces(const RandomAccessFile& file, bool verify, bool stream,
                                         uint8_t* keep, double* read_s, double* copy_s) {
  const ReadRange& rr = *read_;
  const uint64_t end = rr.offset + rr.length;
  // A file read in requests (object storage) needs no alignment: when the
  // bytes are kept, the read goes straight into the cache's buffer in one
  // request (no bounce, no second copy); else in pieces of at least its
  // request size, two in flight.
  const bool into_keep = keep != nullptr && file.MinReadBytes() > 0;
  const uint64_t piece =
      into_keep ? rr.length
                : std::max(DirectPiece(piece_), DirectPiece(file.MinReadBytes()));
  uint8_t* bufs[2] = {into_keep ? nullptr : Scratch(true, piece), nullptr};
  if (!into_keep) bufs[1] = bufs[0] + piece;
  // The (aligned) file range that holds the read's bytes from `start` on.
  auto range = [&](uint64_t start) {
    if (into_keep) return std::make_pair(start, std::min(piece, end - start));
    const uint64_t at = start / kDirectAlign * kDirectAlign;
    return std::make_pair(
        at, std::min(piece, (end - at + kDirectAlign - 1) / kDirectAlign * kDirectAlign));
  };
  // Where piece k, of the file range from `at` on, is read into.
  auto buffer = [&](uint64_t k, uint64_t at) {
    return into_keep ? keep + (at - rr.offset) : bufs[k % 2];
  };
  auto [at, len] = range(rr.offset);
  ahead_.Submit(&file, at, len, buffer(0, at));
  bool in_flight = true;
  absl::Status status;
  for (uint64_t start = rr.offset, k = 0; start < end; ++k) {
    const auto t0 = Clock::now();
    absl::StatusOr<uint64_t> got = ahead_.Wait();
    in_flight = false;
    if (!got.ok()) return got.status();
    const uint64_t stop = std::min(end, at + len);
    if (at + *got < stop) {
      return absl::OutOfRangeError(absl::StrCat(file.path(), ": truncated: need bytes [", start,
                                                ", ", stop, ") but the file ends at ", at + *got));
    }
    const uint8_t* data = buffer(k, at) + (start - at);
    if (stop < end) {  // read the next piece meanwhile
      std::tie(at, len) = range(stop);
      ahead_.Submit(&file, at, len, buffer(k + 1, at));
      in_flight = true;
    }
    if (keep != nullptr && !into_keep) {
      // Kept: delivered from the cache's copy, which a client may view
      // (core/cache/cache_view.h) instead of having the bytes written.
      std::memcpy(keep + (start - rr.offset), data, stop - start);
      data = keep + (start - rr.offset);
    }
    if (verify) status = Hash(data, start, stop - start);
    if (!status.ok()) break;
    const auto t1 = Clock::now();
    status = Write(data, start, stop, stream);
    if (!status.ok()) break;
    *read_s += std::chrono::duration<double>(t1 - t0).count();
    *copy_s += std::chrono::duration<double>(Clock::now() - t1).count();
    start = stop;
  }
  if (in_flight) ahead_.Wait().IgnoreError();  // its buffer must not be written later
  return status;
}

absl::Status RunWriter::ReadPieces(const RandomAccessFile& file, bool verify, bool stream,
                                   bool direct, LoadStats& stats, uint8_t* keep) {
  const ReadRange& rr = *read_;
  // A file read in requests (object storage) goes the direct way whatever
  // direct_io says: big pieces, the next one fetched while this one is copied.
  direct = direct || file.MinReadBytes() > 0;
  uint8_t* scratch = keep == nullptr && !direct ? Scratch(false, 0) : nullptr;
  checks_.clear();
  if (verify) {
    for (uint32_t k = 0; k < rr.checks.size(); ++k) checks_.push_back(k);
    std::sort(checks_.begin(), checks_.end(), [&](uint32_t a, uint32_t b) {
      return rr.checks[a].offset < rr.checks[b].offset;
    });
  }
  check_pos_ = 0;
  hashing_ = false;
  const uint64_t end = rr.offset + rr.length;
  double read_s = 0, copy_s = 0;
  if (direct) {
    // Aligned file ranges into aligned buffers; bytes outside the read are
    // ignored. Piece ends are 4 KiB file offsets (see the cast rule below).
    CKPT_RETURN_IF_ERROR(ReadDirectPieces(file, verify, stream, keep, &read_s, &copy_s));
  }
  for (uint64_t start = direct ? end : rr.offset; start < end;) {
    const auto t0 = Clock::now();
    // A piece ends on a 64-byte file offset (or the read's end).
    uint64_t stop = std::min(end, (start + piece_) & ~uint64_t{63});
    if (stop <= start) stop = std::min(end, start + piece_);
    uint8_t* piece = keep != nullptr ? keep + (start - rr.offset) : scratch;
    CKPT_RETURN_IF_ERROR(file.Read(start, stop - start, piece));
    if (verify) CKPT_RETURN_IF_ERROR(Hash(piece, start, stop - start));
    const auto t1 = Clock::now();
    CKPT_RETURN_IF_ERROR(Write(piece, start, stop, stream));
    const auto t2 = Clock::now();
    read_s += std::chrono::duration<double>(t1 - t0).count();
    copy_s += std::chrono::duration<double>(t2 - t1).count();
    start = stop;
  }
  if (stream) StreamingFence();
  if (check_pos_ != checks_.size()) {
    return absl::InternalError(absl::StrCat(plan_->files[rr.file], ": checksum range of tensor '",
                                            rr.checks[checks_[check_pos_]].tensor,
                                            "' is not inside its read"));
  }
  stats.bytes_read += rr.length;
  if (direct) stats.bytes_read_direct += rr.length;
  stats.checksums_verified += static_cast<int64_t>(checks_.size());
  stats.read_seconds += read_s;
  stats.copy_seconds += copy_s;
  return absl::OkStatus();
}

void RunWriter::Account(LoadStats& stats) const {
  for (size_t r = 0; r < delivered_.size(); ++r) {
    stats.bytes_delivered += delivered_[r];
    stats.rank_bytes_delivered[r] += delivered_[r];
  }
}

}  // namespace exec_internal
}  // namespace ckpt
