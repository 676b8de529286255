#include "core/exec/executor.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>
#include <thread>
#include <tuple>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "core/base/checksum.h"
#include "core/base/sorted_append.h"
#include "core/base/status_macros.h"
#include "core/base/xxh3.h"

namespace ckpt {
namespace {

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

// Reads one direct piece on a helper thread while the worker hashes and
// copies the previous one: O_DIRECT reads wait on the device, not the CPU,
// so this keeps one more request in flight per worker.
class ReadAhead {
 public:
  ReadAhead() = default;
  ReadAhead(const ReadAhead&) = delete;
  ReadAhead& operator=(const ReadAhead&) = delete;
  ~ReadAhead() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    if (thread_.joinable()) thread_.join();
  }
  // Starts ReadDirect(at, len, dst) of `file`; one at a time.
  void Submit(const RandomAccessFile* file, uint64_t at, uint64_t len, uint8_t* dst) {
    absl::MutexLock lock(&mu_);
    if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
    job_ = Job{file, at, len, dst};
    queued_ = true;
    done_ = false;
  }
  // The result of the last Submit, once it is in.
  absl::StatusOr<uint64_t> Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
    return result_;
  }

 private:
  struct Job {
    const RandomAccessFile* file = nullptr;
    uint64_t at = 0, len = 0;
    uint8_t* dst = nullptr;
  };
  void Loop() {
    while (true) {
      Job job;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queued_ || stop_; };
        mu_.Await(absl::Condition(&ready));
        if (stop_) return;
        job = job_;
        queued_ = false;
      }
      absl::StatusOr<uint64_t> got = job.file->ReadDirect(job.at, job.len, job.dst);
      absl::MutexLock lock(&mu_);
      result_ = std::move(got);
      done_ = true;
    }
  }

  absl::Mutex mu_;
  std::thread thread_;
  Job job_ ABSL_GUARDED_BY(mu_);
  bool queued_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::StatusOr<uint64_t> result_ ABSL_GUARDED_BY(mu_) = uint64_t{0};
};

// Writes the copies of one read into host destinations run by run: the
// copies are expanded into runs (segments of the file) once, then fed the
// read's bytes in increasing pieces. Serves the piece-wise reads and staged
// reads into host memory; kept across reads by one worker thread.
class RunWriter {
 public:
  explicit RunWriter(uint64_t piece)
      : piece_(std::max<uint64_t>(piece, 64)), state_(XXH3_createState()) {}
  ~RunWriter() { XXH3_freeState(state_); }
  RunWriter(const RunWriter&) = delete;
  RunWriter& operator=(const RunWriter&) = delete;

  // Expands the copies of read `i` (skipping ranks whose memo entry is 2).
  // False (nothing to do here) when a copy cannot go run by run: a layout
  // with a permutation, a destination that is not host memory, a cast of a
  // run not aligned to its elements, or too many short runs. A copy whose
  // runs do not add up to its plan is an error in *error.
  bool Prepare(const LoadPlan& plan, size_t i,
               const std::vector<std::pair<uint32_t, uint32_t>>& copies,
               const std::vector<uint8_t>& skip, Delivery& delivery, absl::Status* error);
  // Reads the prepared read from `file` in pieces into an L2-sized scratch
  // buffer (or into `keep`, which holds the whole read), verifies its
  // checksums (when `verify`) and writes the runs. `direct`: pieces are
  // read around the page cache (aligned, into the scratch, then copied to
  // `keep`).
  absl::Status ReadPieces(const RandomAccessFile& file, bool verify, bool stream, bool direct,
                          LoadStats& stats, uint8_t* keep = nullptr);
  // Writes the runs of the prepared read from `data`, its bytes in memory.
  absl::Status WriteAll(const uint8_t* data, bool stream);
  // The same from only `spans` of the read, back to back at `data`
  // (RangeView::spans): DATA_LOSS when they miss bytes a run takes.
  absl::Status WriteSpans(const uint8_t* data, const std::vector<ReadSpan>& spans, bool stream);
  // Adds the prepared read's delivered bytes to `stats`.
  void Account(LoadStats& stats) const;

 private:
  // One run of one copy: source bytes [off, end) of the file go to dst.
  struct Segment {
    uint64_t off = 0;
    uint64_t end = 0;
    uint8_t* dst = nullptr;  // in this process, or an address in `remote`
    RemoteMemory* remote = nullptr;
    DType sdt = DType::kU8, ddt = DType::kU8;
  };
  static bool ByOffset(const Segment& a, const Segment& b) { return a.off < b.off; }
  // Writes to other processes queued by one Write call, per process.
  struct RemoteBatch {
    RemoteMemory* memory = nullptr;
    std::vector<iovec> local, remote;
  };

  // Writes every run's part inside file bytes [start, stop), held at `data`.
  // Calls cover the read in increasing order.
  absl::Status Write(const uint8_t* data, uint64_t start, uint64_t stop, bool stream);
  // Write without sending the writes queued for other processes (the
  // caller flushes); adds the bytes of runs written to *taken.
  absl::Status WriteRange(const uint8_t* data, uint64_t start, uint64_t stop, bool stream,
                          uint64_t* taken);
  // Queues `n` bytes at `from` for address `to` of `memory`; `from` must
  // stay valid until FlushRemote.
  void QueueRemote(RemoteMemory* memory, const uint8_t* from, uint8_t* to, size_t n);
  // `n` bytes of the bounce buffer for a cast run to another process
  // (queued writes are flushed first when it is full).
  absl::StatusOr<uint8_t*> Bounce(size_t n);
  absl::Status FlushRemote();
  absl::Status Hash(const uint8_t* data, uint64_t pos, uint64_t n);

  // The scratch buffer: `piece_` bytes, or (direct) two aligned pieces of
  // DirectPiece(piece_) or `direct_piece` bytes, whichever is larger.
  uint8_t* Scratch(bool direct, uint64_t direct_piece);
  // ReadPieces with direct reads: two aligned buffers, the next piece read
  // ahead while the current one is hashed and copied.
  absl::Status ReadDirectPieces(const RandomAccessFile& file, bool verify, bool stream,
                                uint8_t* keep, double* read_s, double* copy_s);

  const uint64_t piece_;
  std::vector<uint8_t> scratch_;   // piece_ bytes, or two direct pieces + alignment
  ReadAhead ahead_;
  XXH3_state_t* state_;
  const LoadPlan* plan_ = nullptr;
  const ReadRange* read_ = nullptr;
  std::vector<Segment> segs_;  // sorted by offset
  std::vector<CopyRun> runs_;
  size_t next_ = 0;               // first segment not yet active
  std::vector<uint32_t> active_;  // segments the next piece may feed
  std::vector<uint32_t> checks_;  // indices into read_->checks, by offset
  size_t check_pos_ = 0;          // next check not yet complete
  bool hashing_ = false;          // state_ holds a partial check
  std::vector<uint64_t> delivered_;  // per plan rank, this read
  std::vector<RemoteBatch> batches_;
  std::vector<uint8_t> bounce_;
  size_t bounce_used_ = 0;
};

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

}  // namespace

absl::StatusOr<DirectIo> ParseDirectIo(const std::string& text) {
  if (text == "never") return DirectIo::kNever;
  if (text == "auto") return DirectIo::kAuto;
  if (text == "always") return DirectIo::kAlways;
  return absl::InvalidArgumentError(
      absl::StrCat("direct I/O mode '", text, "' is not one of never, auto, always"));
}

absl::StatusOr<const RandomAccessFile*> DirectorySource::Get(const std::string& file) {
  absl::MutexLock lock(&mu_);
  auto it = files_.find(file);
  if (it != files_.end()) return it->second.get();
  if (directory_ == nullptr) {
    CKPT_ASSIGN_OR_RETURN(directory_, Directory::Open(dir_, options_.confine));
  }
  CKPT_ASSIGN_OR_RETURN(auto f, directory_->OpenFile(file));
  const RandomAccessFile* p = f.get();
  files_.emplace(file, std::move(f));
  return p;
}

absl::StatusOr<std::unique_ptr<RangeSource::Fill>> DirectorySource::BeginFill(
    const std::string& file, uint64_t offset, uint64_t n, bool verify,
    std::optional<RangeView>* served) {
  auto fill = std::make_unique<Fill>();
  CKPT_ASSIGN_OR_RETURN(fill->file, Get(file));
  return fill;
}

absl::StatusOr<RangeView> DirectorySource::Fetch(
    const std::string& file, uint64_t offset, uint64_t n, std::vector<uint8_t>& scratch,
    const std::function<absl::Status(const uint8_t*)>& verify) {
  CKPT_ASSIGN_OR_RETURN(const RandomAccessFile* f, Get(file));
  if (scratch.size() < n) scratch.resize(n);
  CKPT_RETURN_IF_ERROR(f->Read(offset, n, scratch.data()));
  if (verify) CKPT_RETURN_IF_ERROR(verify(scratch.data()));
  return RangeView{scratch.data(), nullptr, true};
}

absl::StatusOr<int64_t> HostDelivery::Copy(size_t rank_index, const RankPlan& rank,
                                           const CopyOp& op, const uint8_t* src) {
  void* dst = dests_[rank_index][op.target];
  if (dst == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank.rank, " tensor '",
                                                   rank.targets[op.target].name,
                                                   "' has no destination buffer"));
  }
  return CopyRegion(op.src, src, rank.targets[op.target].layout(), dst, op.region);
}

absl::StatusOr<LoadStats> ExecutePlan(const LoadPlan& plan, RangeSource& source,
                                      const std::vector<std::vector<void*>>& destinations,
                                      const ExecuteOptions& options) {
  if (destinations.size() != plan.ranks.size()) {
    return absl::InvalidArgumentError("ExecutePlan: one destination list per rank is required");
  }
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    if (destinations[r].size() != plan.ranks[r].targets.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("ExecutePlan: rank ", plan.ranks[r].rank, " has ",
                       plan.ranks[r].targets.size(), " targets but ", destinations[r].size(),
                       " destinations"));
    }
  }
  HostDelivery delivery(destinations);
  return ExecutePlan(plan, source, delivery, options);
}

namespace {

// One execution of a plan: the reads are claimed in order by every worker
// thread; each read's bytes are filled piece by piece (a Fill), served from
// memory, or fetched whole, then copied into the ranks' destinations.
class PlanRun {
 public:
  PlanRun(const LoadPlan& plan, RangeSource& source, Delivery& delivery,
          const ExecuteOptions& options)
      : plan_(plan), source_(source), delivery_(delivery), options_(options),
        by_read_(plan.reads.size()),
        // Loads far larger than the caches write their destinations with
        // streaming stores (as CopyRegion does for one large region).
        stream_(plan.bytes_to_deliver() >= kStreamingBytes) {
    for (uint32_t r = 0; r < plan.ranks.size(); ++r) {
      const RankPlan& rp = plan.ranks[r];
      for (uint32_t c = 0; c < rp.copies.size(); ++c) by_read_[rp.copies[c].read].push_back({r, c});
    }
    total_.rank_bytes_delivered.assign(plan.ranks.size(), 0);
  }

  // Claims and runs reads until none is left or one failed.
  void Worker();
  absl::StatusOr<LoadStats> Result() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (!first_error_.ok()) return first_error_;
    return total_;
  }

 private:
  // What one worker thread keeps across its reads.
  struct WorkerState {
    explicit WorkerState(const LoadPlan& plan, uint64_t piece_bytes)
        : writer(piece_bytes), skip_memo(plan.ranks.size(), 0) {
      local.rank_bytes_delivered.assign(plan.ranks.size(), 0);
    }
    LoadStats local;
    std::vector<uint8_t> scratch;
    RunWriter writer;
    std::vector<uint8_t> skip_memo;  // per rank: 0 unknown, 1 run, 2 skip
    std::vector<uint32_t> memo_touched;
  };
  absl::Status RunRead(size_t i, WorkerState& w);
  // The read's bytes fetched whole (or served from memory), then copied.
  absl::Status FetchAndCopy(size_t i, bool by_runs, std::optional<RangeView> served,
                            WorkerState& w);
  absl::Status CopyEach(size_t i, const RangeView& view, WorkerState& w);
  void Fail(const absl::Status& s) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (first_error_.ok()) first_error_ = s;
    failed_ = true;
  }
  void Merge(const LoadStats& local) ABSL_LOCKS_EXCLUDED(mu_);

  const LoadPlan& plan_;
  RangeSource& source_;
  Delivery& delivery_;
  const ExecuteOptions& options_;
  // Copies grouped by the read that feeds them: (rank, copy).
  std::vector<std::vector<std::pair<uint32_t, uint32_t>>> by_read_;
  const bool stream_;
  std::atomic<size_t> next_{0};
  std::atomic<bool> failed_{false};
  absl::Mutex mu_;
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
  LoadStats total_ ABSL_GUARDED_BY(mu_);
};

void PlanRun::Worker() {
  WorkerState w(plan_, options_.piece_bytes);
  while (!failed_.load(std::memory_order_relaxed)) {
    for (uint32_t r : w.memo_touched) w.skip_memo[r] = 0;
    w.memo_touched.clear();
    size_t i = next_.fetch_add(1);
    if (i >= plan_.reads.size()) break;
    if (options_.deadline && std::chrono::steady_clock::now() > *options_.deadline) {
      Fail(absl::DeadlineExceededError(absl::StrCat(
          "load did not finish in time: ", i, " of ", plan_.reads.size(), " reads done")));
      break;
    }
    // skip_rank may be costly (a gRPC cancellation check): ask once per
    // rank per read.
    for (const auto& rc : by_read_[i]) {
      const uint32_t r = rc.first;
      if (w.skip_memo[r] == 0) {
        w.skip_memo[r] = options_.skip_rank && options_.skip_rank(r) ? 2 : 1;
        w.memo_touched.push_back(r);
      }
    }
    if (absl::Status s = RunRead(i, w); !s.ok()) {
      Fail(s);
      break;
    }
  }
  Merge(w.local);
}

absl::Status PlanRun::RunRead(size_t i, WorkerState& w) {
  const ReadRange& rr = plan_.reads[i];
  absl::Status prepared;
  const bool by_runs = w.writer.Prepare(plan_, i, by_read_[i], w.skip_memo, delivery_, &prepared);
  CKPT_RETURN_IF_ERROR(prepared);
  // The read's bytes: read piece by piece here (a Fill), served from
  // memory (a cache hit), or fetched whole by the source.
  std::optional<RangeView> served;
  if (by_runs) {
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<RangeSource::Fill> fill,
                          source_.BeginFill(plan_.files[rr.file], rr.offset, rr.length,
                                            options_.verify_checksums, &served));
    if (fill != nullptr) {
      const RandomAccessFile& f = *fill->file;
      const bool direct = options_.direct_io == DirectIo::kAlways ||
                          (options_.direct_io == DirectIo::kAuto && !f.Cached(rr.offset, rr.length));
      absl::Status s = w.writer.ReadPieces(f, options_.verify_checksums, stream_, direct, w.local,
                                           fill->keep);
      if (s.ok()) s = fill->Finish();
      if (s.ok()) w.writer.Account(w.local);
      absl::Status flushed = delivery_.Flush();
      if (s.ok()) s = flushed;
      if (options_.progress_bytes) options_.progress_bytes->fetch_add(rr.length);
      return s;
    }
  }
  return FetchAndCopy(i, by_runs, std::move(served), w);
}

absl::Status PlanRun::FetchAndCopy(size_t i, bool by_runs, std::optional<RangeView> served,
                                   WorkerState& w) {
  const ReadRange& rr = plan_.reads[i];
  const std::string& file = plan_.files[rr.file];
  int64_t verified = 0;
  auto verify = [&](const uint8_t* data) -> absl::Status {
    if (!options_.verify_checksums) return absl::OkStatus();
    for (const auto& c : rr.checks) {
      if (Checksum(data + (c.offset - rr.offset), c.nbytes) != c.xxh3) {
        return ChecksumError(file, c);
      }
      ++verified;
    }
    return absl::OkStatus();
  };
  // Without verification the source gets no verify function, so it knows
  // these bytes are unverified (and a cache does not keep them).
  static const std::function<absl::Status(const uint8_t*)> kNoVerify;
  auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<RangeView> view =
      served ? *std::move(served)
             : source_.Fetch(file, rr.offset, rr.length, w.scratch,
                             options_.verify_checksums
                                 ? std::function<absl::Status(const uint8_t*)>(verify)
                                 : kNoVerify);
  auto t1 = std::chrono::steady_clock::now();
  absl::Status s = view.status();
  if (s.ok()) {
    w.local.checksums_verified += verified;
    (view->from_storage ? w.local.bytes_read : w.local.bytes_from_cache) += rr.length;
    if (by_runs) {
      s = view->spans ? w.writer.WriteSpans(view->data, *view->spans, stream_)
                      : w.writer.WriteAll(view->data, stream_);
      if (s.ok()) w.writer.Account(w.local);
    } else if (view->spans) {
      // Copy by copy needs the read laid out: its spans put in place first.
      w.scratch.resize(rr.length);
      uint64_t at = 0;
      for (const ReadSpan& sp : *view->spans) {
        if (sp.end > rr.length || sp.begin >= sp.end) {
          return absl::DataLossError(absl::StrCat("read of ", file, " bytes [", rr.offset, ", ",
                                                  rr.offset + rr.length, "): a span [", sp.begin,
                                                  ", ", sp.end, ") outside it"));
        }
        std::memcpy(w.scratch.data() + sp.begin, view->data + at, sp.end - sp.begin);
        at += sp.end - sp.begin;
      }
      s = CopyEach(i, RangeView{w.scratch.data(), nullptr, view->from_storage}, w);
    } else {
      s = CopyEach(i, *view, w);
    }
    absl::Status flushed = delivery_.Flush();
    if (s.ok()) s = flushed;
  }
  auto t2 = std::chrono::steady_clock::now();
  w.local.read_seconds += std::chrono::duration<double>(t1 - t0).count();
  w.local.copy_seconds += std::chrono::duration<double>(t2 - t1).count();
  if (options_.progress_bytes) options_.progress_bytes->fetch_add(rr.length);
  return s;
}

// Read `i`'s copies one by one through the delivery (no run writer).
absl::Status PlanRun::CopyEach(size_t i, const RangeView& view, WorkerState& w) {
  const ReadRange& rr = plan_.reads[i];
  for (const auto& [r, c] : by_read_[i]) {
    if (w.skip_memo[r] == 2) continue;
    const RankPlan& rp = plan_.ranks[r];
    const CopyOp& op = rp.copies[c];
    CKPT_ASSIGN_OR_RETURN(int64_t n,
                          delivery_.Copy(r, rp, op, view.data + (op.src_offset - rr.offset)));
    if (n != op.elements) return CopyCountError(rp, op, n);
    uint64_t bytes = static_cast<uint64_t>(n) * DTypeSize(rp.targets[op.target].dtype);
    w.local.bytes_delivered += bytes;
    w.local.rank_bytes_delivered[r] += bytes;
  }
  return absl::OkStatus();
}

void PlanRun::Merge(const LoadStats& local) {
  absl::MutexLock lock(&mu_);
  total_.bytes_read += local.bytes_read;
  total_.bytes_read_direct += local.bytes_read_direct;
  total_.bytes_from_cache += local.bytes_from_cache;
  total_.bytes_delivered += local.bytes_delivered;
  for (size_t r = 0; r < plan_.ranks.size(); ++r) {
    total_.rank_bytes_delivered[r] += local.rank_bytes_delivered[r];
  }
  total_.checksums_verified += local.checksums_verified;
  total_.read_seconds += local.read_seconds;
  total_.copy_seconds += local.copy_seconds;
}

}  // namespace

absl::StatusOr<LoadStats> ExecutePlan(const LoadPlan& plan, RangeSource& source,
                                      Delivery& delivery, const ExecuteOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  PlanRun run(plan, source, delivery, options);
  int n_threads = std::max(1, std::min<int>(options.threads, static_cast<int>(plan.reads.size())));
  std::vector<std::thread> threads;
  for (int i = 1; i < n_threads; ++i) threads.emplace_back([&run] { run.Worker(); });
  run.Worker();
  for (auto& t : threads) t.join();
  absl::StatusOr<LoadStats> total = run.Result();
  if (total.ok()) {
    total->wall_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return total;
}

}  // namespace ckpt
