// Delivery by views: instead of writing cached bytes into a client process,
// the loader records which bytes of which data-cache block go where, and the
// client copies them itself from read-only mappings of those blocks
// (HostCache::Export): one copy of every byte, made in every rank's own
// process in parallel, and no page of the client's pinned by the kernel as
// process_vm_writev does.
//
//   auto rec = std::make_shared<ViewRecorder>(&cache, uid, process_memory);
//   RemoteRank{rec, targets}                 // the rank's destination (process_memory.h)
//   ExecutePlan(...);                        // cached bytes recorded, the rest written
//   rec->TakeBatch()                         // sent to the client, which copies
//   rec->Release();                          // once the client is done
//
// A client may copy while the plan still runs: TakeBatch hands out the
// copies recorded since the last batch (each names bytes already in their
// block), NotifyWhenPending says when enough of them wait. Recorded bytes
// may not be verified yet (a checksum range ends in a later piece): a read
// that then fails fails the load, as for bytes written into process memory.
//
// Bytes that are not in an exportable cache block (a read not kept, a cast
// converted on the way, bytes from a peer) are written through `fallback`
// (the rank's ProcessMemory); without one they fail the load. Bytes the
// cache does not hold may instead be left to the client to read from the
// checkpoint's file itself (RecordFile: the loader decides which, before the
// plan runs; server/load/file_views.cc).
#ifndef CKPTD_CORE_CACHE_VIEW_H_
#define CKPTD_CORE_CACHE_VIEW_H_

#include <sys/uio.h>

#include <cstdint>
#include <functional>
#include <map>
#include <utility>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "core/cache/cache.h"
#include "core/plan/planner.h"
#include "core/exec/executor.h"

namespace ckpt {

class ViewRecorder final : public RemoteMemory {
 public:
  // The most blocks one rank's load may view (one fd each, passed in one
  // SCM_RIGHTS message); bytes of further blocks go through the fallback.
  static constexpr size_t kMaxViews = 200;
  // The most copies one rank's list holds (about 40 bytes each in the
  // message that carries them); runs past it are written through the fallback.
  static constexpr size_t kMaxCopies = 65536;

  struct View {
    uint64_t key = 0;    // ExportedRange::key: names the block to the client (0: a file)
    int fd = -1;         // read-only; valid until Release (not to be closed)
    uint64_t bytes = 0;  // the block's size (a file's: its size)
    bool file = false;   // a checkpoint file the client reads (RecordFile), not a block
    uint64_t serial = 0;  // ExportedRange::serial (0: a file)
  };
  // `count` runs of `length` bytes: run i is bytes [offset + i * src_stride,
  // + length) of view `view`, for address + i * dst_stride in the client.
  struct Copy {
    uint32_t view = 0;
    uint64_t offset = 0;
    uint64_t address = 0;
    uint64_t length = 0;
    uint64_t count = 1;
    uint64_t src_stride = 0;
    uint64_t dst_stride = 0;
  };

  // `targets`: the client's destination ranges [begin, end) (addresses
  // there), in the order of the request's targets; no recorded copy spans
  // two of them.
  ViewRecorder(HostCache* cache, uint32_t tenant, std::shared_ptr<RemoteMemory> fallback,
               std::vector<std::pair<uint64_t, uint64_t>> targets, size_t max_views = kMaxViews);

  // Records every pair whose local bytes lie in an exportable cache block;
  // writes the others through the fallback.
  absl::Status Write(const struct iovec* local, const struct iovec* remote, size_t n) override;

  // Bytes of a checkpoint file the client reads itself (pread, not a
  // mapping): run i is `length` bytes at file offset `offset` for client
  // `address` (inside one target).
  struct FileRun {
    uint64_t offset = 0;
    uint64_t address = 0;
    uint64_t length = 0;
  };
  // Whether RecordFile of `runs` runs of a file not viewed yet would fit
  // within the view and copy limits, whatever they coalesce to.
  bool Room(size_t runs) const;
  // Records `runs` of the file open read-only as `fd` (`file_bytes` long,
  // `path` at `stamp`), all of them; `fd` is closed at Release (or at once
  // if this recorder already views the file under another descriptor:
  // `file_key` names the file, e.g. its index in the plan). Check Room
  // first: false (nothing recorded, fd closed) when the limits do not allow
  // them.
  bool RecordFile(uint64_t file_key, int fd, uint64_t file_bytes, const std::string& path,
                  const FileStamp& stamp, const std::vector<FileRun>& runs);
  // Once the client read its file views: ABORTED naming a file that changed
  // since its stamp (a write in place while the client read it).
  absl::Status CheckFilesUnchanged() const;

  // The copies recorded since the last batch (every one at first), with the
  // views they read (Copy::view indexes `views`); later records never
  // extend them. Empty when there is none.
  struct Batch {
    std::vector<View> views;
    std::vector<Copy> copies;
    uint64_t bytes = 0;  // the copies' bytes
    bool files = false;  // some view is a file
  };
  // `last`: the job is done (nothing more is recorded); then a first batch
  // may be served from a laid-out copy (EnableLaidOut).
  Batch TakeBatch(bool last = false);

  // Laid-out copies (HostCache::PublishLaidOut): the targets whose bytes
  // come from the cache in pieces averaging under kLaidOutMaxPiece (a tensor
  // split on another dimension than the checkpoint's: every row a piece) are
  // gathered into one block after the load, once, and a later load of this
  // rank that would copy the very same bytes (same blocks and serials, same
  // runs) copies each of them from one contiguous range of that block
  // instead: a new process then maps and faults in only its own bytes, not
  // every page its pieces share with other ranks' pieces. `dir`: the
  // checkpoint's path (what EvictPrefix drops). Call before anything is
  // recorded.
  static constexpr uint64_t kLaidOutMaxPiece = 1 << 20;
  static constexpr uint64_t kLaidOutMinBytes = 1 << 20;
  static constexpr uint64_t kLaidOutMaxPieces = 1 << 20;
  void EnableLaidOut(std::string dir);
  // Bytes of this load copied from a laid-out copy.
  uint64_t bytes_laid_out() const;
  // After the last batch of a load that succeeded (every block it viewed
  // then holds verified bytes that no longer change): the work that copies this
  // rank's fragmented targets into a laid-out copy, where the budget has room
  // (run it on a background thread; it holds the blocks it copies from), or
  // an empty function when there is nothing to gather (no such target, or the
  // load was served from a laid-out copy). Bytes the client read from files
  // are taken from the cache entries that hold them when the work runs
  // (queue it after the load's cache fill); where one does not, it gathers
  // nothing.
  // `pause` (may be empty) is called between pieces of the copy (every
  // kLaidOutPauseBytes): the caller returns from it when the work may go on.
  static constexpr uint64_t kLaidOutPauseBytes = 8 << 20;
  using Work = std::function<void(const std::function<void()>& pause)>;
  Work TakeLaidOutWork();
  // Whether TakeLaidOutWork will find a target to gather (the recipe's
  // choice of targets, without expanding their pieces); when none, the
  // blocks kept for it are let go here.
  bool WantsLaidOut();
  // `ready` runs (on the recording thread, no lock of this recorder held)
  // once the bytes recorded since the last batch reach `min_bytes`, then not
  // again before the next TakeBatch. Set before anything is recorded.
  void NotifyWhenPending(uint64_t min_bytes, std::function<void()> ready);

  // Everything recorded (tests).
  std::vector<View> views() const;
  std::vector<Copy> copies() const;
  uint64_t bytes_recorded() const;    // from cache blocks
  uint64_t bytes_from_files() const;  // from files (RecordFile)
  uint64_t bytes_written() const;
  // Lets go of every block (their fds are then no longer valid here).
  void Release();

 private:
  // Records [p, p + n) -> address if its block is (or can be) viewed.
  bool Record(const uint8_t* p, uint64_t n, uint64_t address) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records bytes [off, off + n) of view v -> address, extending the view's
  // latest copy where it continues it; false when a new copy is over the limit.
  bool Append(uint32_t v, uint64_t off, uint64_t n, uint64_t address)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Whether `ready_` is due (counts `n` more bytes pending).
  bool Pending(uint64_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Index of the target holding `address` (npos when none).
  size_t TargetOf(uint64_t address) const;

  // The targets a laid-out copy would hold (core/cache/laid_out.cc), from
  // copies_ (every one recorded): where each goes in the block and its
  // copies. `files`: targets with bytes the client read from files too (a
  // cold load's; the work finds them in the cache once it filled them).
  struct LaidOut {
    uint64_t bytes = 0;
    struct Part {
      size_t target = 0;  // index into targets_
      uint64_t at = 0;    // offset in the block
      std::vector<size_t> copies;  // into copies_
    };
    std::vector<Part> parts;
  };
  LaidOut LaidOutRecipe(bool files) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Replaces the copies of `r`'s targets with copies from a laid-out copy
  // the cache holds, if it does.
  void ServeLaidOut(const LaidOut& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Calls fn(view, offset in it, offset in the laid-out block, length) for
  // every run of `r`'s targets' copies; returns the targets as a laid-out
  // copy's fingerprint names them (place in the request, size), in block order.
  template <typename Fn>
  std::vector<std::pair<uint64_t, uint64_t>> ForEachRun(const LaidOut& r, Fn fn) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  HostCache* const cache_;
  const uint32_t tenant_;
  const std::shared_ptr<RemoteMemory> fallback_;
  const size_t max_views_;
  const std::vector<std::pair<uint64_t, uint64_t>> targets_;  // sorted
  const std::vector<size_t> order_;  // per target (sorted): its index in the request
  mutable absl::Mutex mu_;
  std::vector<View> views_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<const void>> holds_ ABSL_GUARDED_BY(mu_);
  // First byte (in this process) -> view index, for blocks held.
  std::map<uintptr_t, uint32_t> by_address_ ABSL_GUARDED_BY(mu_);
  std::vector<const uint8_t*> base_ ABSL_GUARDED_BY(mu_);  // per view
  std::vector<Copy> copies_ ABSL_GUARDED_BY(mu_);
  std::vector<size_t> last_ ABSL_GUARDED_BY(mu_);  // per view: its latest copy
  std::map<uint64_t, uint32_t> files_ ABSL_GUARDED_BY(mu_);  // file_key -> view
  // Per file view: its path and stamp (CheckFilesUnchanged).
  std::vector<std::pair<std::string, FileStamp>> file_stamps_ ABSL_GUARDED_BY(mu_);
  std::vector<int> file_fds_ ABSL_GUARDED_BY(mu_);
  uint64_t recorded_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t file_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t written_ ABSL_GUARDED_BY(mu_) = 0;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
  size_t batched_ ABSL_GUARDED_BY(mu_) = 0;  // copies_ handed out by TakeBatch
  uint64_t pending_ ABSL_GUARDED_BY(mu_) = 0;  // bytes recorded since then
  uint64_t min_pending_ ABSL_GUARDED_BY(mu_) = 0;
  bool notified_ ABSL_GUARDED_BY(mu_) = false;
  std::function<void()> ready_;  // set before any record
  std::string laid_out_dir_ ABSL_GUARDED_BY(mu_);  // empty: no laid-out copies
  std::vector<bool> replaced_ ABSL_GUARDED_BY(mu_);  // copies_ served from a laid-out copy
  uint64_t laid_out_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Blocks a laid-out copy would be gathered from, kept past Release for
  // TakeLaidOutWork.
  std::vector<std::shared_ptr<const void>> kept_ ABSL_GUARDED_BY(mu_);
};

// Appends the runs rank copy `op` makes (into `target`, whose first byte is
// `address` in the client) as bytes of the read's file, when it is a plain
// byte copy (same dtype, no permutation) of at most `max_runs` runs; false
// (nothing appended) else: a cast or a transposition is the daemon's to make.
bool AppendFileRuns(const CopyOp& op, const TargetTensor& target, uint64_t address,
                    size_t max_runs, std::vector<ViewRecorder::FileRun>* out);

}  // namespace ckpt

#endif  // CKPTD_CORE_CACHE_VIEW_H_
