// The executor's writer of one read's copies run by run (RunWriter) and its
// read-ahead of direct pieces: internal to core/exec (executor.cc), apart
// only to keep the files short.
#ifndef CKPTD_CORE_EXEC_EXECUTOR_RUNS_H_
#define CKPTD_CORE_EXEC_EXECUTOR_RUNS_H_

#include <sys/uio.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/base/xxh3.h"
#include "core/exec/executor.h"

namespace ckpt {
namespace exec_internal {

// DATA_LOSS naming the file, tensor and bytes of a failed checksum.
absl::Status ChecksumError(const std::string& file, const ReadRange::Check& c);
// INTERNAL: a copy that wrote another number of elements than planned.
absl::Status CopyCountError(const RankPlan& rp, const CopyOp& op, int64_t n);

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

}  // namespace exec_internal
}  // namespace ckpt

#endif  // CKPTD_CORE_EXEC_EXECUTOR_RUNS_H_
