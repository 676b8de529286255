// Executes a LoadPlan: fetches each planned byte range once and copies every
// rank's slices into its destination.
//
// Reads run on a few threads; each read's copies run right after it on the
// same thread while its bytes are hot in cache. Checksum blocks entirely
// inside a read from storage are verified (ExecuteOptions::verify_checksums);
// a source that caches keeps only verified reads (the executor tells it
// whether a read is verified: BeginFill's `verify`, Fetch's `verify`). On any error the caller gets the
// error (naming file, tensor and rank) and must treat every destination as
// unfilled.
//
// Three ways to run a read:
//  - piece-wise (host destinations, no axis permutation, a source that
//    lets the executor read: RangeSource::BeginFill): the read's copies are
//    expanded into runs once; the read is pread in L2-sized pieces into a
//    small scratch buffer (or straight into the cache entry that keeps the
//    bytes), each piece hashed (streaming XXH3) and its runs copied or cast
//    out while it is still in the CPU cache, with streaming stores for large
//    loads: the kernel's copy plus one write of each destination byte,
//    instead of three passes over a 64 MiB buffer. With direct I/O
//    (ExecuteOptions::direct_io) pieces are 4 MiB, aligned, read around the
//    page cache, the next one read ahead while the current one is used.
//  - by runs from memory (the same destinations, bytes served by a cache):
//    the runs are copied from the cached bytes (verified when the cache
//    entry was filled, not hashed again: see core/cache/cache.h).
//  - staged (device deliveries, transposes, peers): the whole read is
//    fetched into a buffer (or served by a cache), verified, and each copy
//    runs CopyRegion from it.
#ifndef CKPTD_CORE_EXECUTOR_H_
#define CKPTD_CORE_EXECUTOR_H_

#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/io/file.h"
#include "core/plan/planner.h"

namespace ckpt {

// Bytes of one planned read, valid while `pin` is held.
struct RangeView {
  const uint8_t* data = nullptr;
  std::shared_ptr<const void> pin;  // keeps cached bytes alive; may be null
  bool from_storage = true;         // false when served from a cache
  // Set where the source holds only some of the read's bytes (a node's
  // share of a read a peer sent it): these spans of the read (offsets in the
  // read, ascending, disjoint), back to back at `data`. They must cover
  // every byte the read's copies take (the executor checks). Null: `data`
  // holds the whole read.
  std::shared_ptr<const std::vector<ReadSpan>> spans;
};

// Where planned bytes come from. Implementations must be thread-safe.
class RangeSource {
 public:
  virtual ~RangeSource() = default;
  // Returns `n` bytes at `offset` of checkpoint file `file`, either in
  // `scratch` (resized as needed) or in memory the source owns. Bytes read
  // from storage are passed to `verify` before they are kept or returned.
  // An empty `verify` means the caller does not verify these bytes: a
  // source that keeps bytes for later reads (a cache) must then not keep
  // them (see CachingSource).
  virtual absl::StatusOr<RangeView> Fetch(
      const std::string& file, uint64_t offset, uint64_t n, std::vector<uint8_t>& scratch,
      const std::function<absl::Status(const uint8_t*)>& verify) = 0;

  // A read the source lets the executor do itself, piece by piece (see
  // ExecutePlan): bytes from `file` go into `keep` (the source's memory
  // for them, e.g. a cache entry; null: nothing is kept), each piece
  // verified (when `verify`) and delivered while hot; then Finish() (e.g.
  // checks the file did not change and publishes the entry). Destroying an
  // unfinished Fill drops what was kept. A source must not keep bytes of a
  // fill begun with `verify` false.
  class Fill {
   public:
    virtual ~Fill() = default;
    const RandomAccessFile* file = nullptr;
    uint8_t* keep = nullptr;
    virtual absl::Status Finish() { return absl::OkStatus(); }
  };
  // Either sets *served (the bytes are in memory already, e.g. a cache
  // hit), returns a Fill, or returns null (use Fetch). `verify`: whether
  // the executor will verify the fill's bytes against every checksum block
  // entirely inside it. The default: null.
  virtual absl::StatusOr<std::unique_ptr<Fill>> BeginFill(const std::string& file, uint64_t offset,
                                                          uint64_t n, bool verify,
                                                          std::optional<RangeView>* served) {
    return nullptr;
  }
};

// How the sources below open the files of their checkpoint directory.
struct SourceOptions {
  // Open every file beneath the directory with no symlink followed
  // (Directory::OpenFile with confine; see core/io/file.h and OpenOptions::confine).
  // On by default here (CachingSource is the daemon's); the offline tools
  // pass their checkpoint's choice (Checkpoint::confine).
  bool confine = true;
  // CachingSource only: a read missing from the cache whose entry would need
  // memory never used before (no recycled block of its size, see
  // HostCache::HasRecycled), and whose bytes are in the page cache, is
  // delivered from the read pieces and not kept. First-touch page faults
  // (the slowest thing on a VM, slower than reading the page cache) then
  // stay off the load's path; the caller fills the cache afterwards from
  // CachingSource::Deferred() (the daemon does, on a background thread).
  bool defer_fresh_memory = false;
  // CachingSource only: whom new cache entries are reserved for
  // (HostCache::Reserve; the daemon passes the caller's uid).
  uint32_t tenant = 0xffffffffu;  // kNoTenant (core/cache/cache.h)
};

// Reads files of one checkpoint directory with pread; opens each file once
// (beneath the directory, see SourceOptions).
class DirectorySource final : public RangeSource {
 public:
  explicit DirectorySource(std::string dir, SourceOptions options = {})
      : dir_(std::move(dir)), options_(options) {}
  absl::StatusOr<RangeView> Fetch(
      const std::string& file, uint64_t offset, uint64_t n, std::vector<uint8_t>& scratch,
      const std::function<absl::Status(const uint8_t*)>& verify) override;
  absl::StatusOr<std::unique_ptr<Fill>> BeginFill(const std::string& file, uint64_t offset,
                                                  uint64_t n, bool verify,
                                                  std::optional<RangeView>* served) override;

 private:
  absl::StatusOr<const RandomAccessFile*> Get(const std::string& file);
  const std::string dir_;
  const SourceOptions options_;
  absl::Mutex mu_;
  std::shared_ptr<const Directory> directory_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::unique_ptr<RandomAccessFile>> files_ ABSL_GUARDED_BY(mu_);
};

// Memory of another process, written by address (core/exec/process_memory.h).
// Thread-safe.
class RemoteMemory {
 public:
  virtual ~RemoteMemory() = default;
  // Writes local[i] to remote[i] (iov_base there is an address in the other
  // process), for every i < n: every byte, or an error naming the process.
  virtual absl::Status Write(const struct iovec* local, const struct iovec* remote,
                             size_t n) = 0;
};

// Where copies go. Implementations must be thread-safe across distinct
// (rank, target) elements: copies never overlap in the destination.
class Delivery {
 public:
  virtual ~Delivery() = default;
  // Copies `op` of plan rank `rank_index` from `src` (the bytes of the
  // op's source span). Returns the number of elements written.
  virtual absl::StatusOr<int64_t> Copy(size_t rank_index, const RankPlan& rank, const CopyOp& op,
                                       const uint8_t* src) = 0;
  // Called on the same thread after the copies fed by one read (also after
  // a failed one) and before that read's bytes are released: a delivery
  // that copies asynchronously (server/cuda) waits for its copies here.
  virtual absl::Status Flush() { return absl::OkStatus(); }
  // The host buffer of plan rank `rank_index`'s target `target` when
  // copies into it are plain CPU stores (the executor may then write it
  // run by run); null when Copy must be used.
  virtual uint8_t* HostDestination(size_t rank_index, uint32_t target) { return nullptr; }
  // The memory of another process that copies into plan rank
  // `rank_index`'s target `target` go to, the target's first byte at
  // *address there (the executor then writes it run by run, in batches);
  // null when the target is not there (HostDestination or Copy).
  virtual RemoteMemory* RemoteDestination(size_t rank_index, uint32_t target,
                                          uint64_t* address) {
    return nullptr;
  }
};

// Delivery into host memory: dests[i][j] is the buffer of plan.ranks[i]
// target j (targets[j].num_bytes() bytes).
class HostDelivery final : public Delivery {
 public:
  explicit HostDelivery(std::vector<std::vector<void*>> dests) : dests_(std::move(dests)) {}
  absl::StatusOr<int64_t> Copy(size_t rank_index, const RankPlan& rank, const CopyOp& op,
                               const uint8_t* src) override;
  uint8_t* HostDestination(size_t rank_index, uint32_t target) override {
    return static_cast<uint8_t*>(dests_[rank_index][target]);
  }
  const std::vector<std::vector<void*>>& dests() const { return dests_; }

 private:
  std::vector<std::vector<void*>> dests_;
};

// Reading storage around the page cache (O_DIRECT; piece-wise reads only).
enum class DirectIo {
  kNever,   // always through the page cache
  kAuto,    // a read whose bytes are not in the page cache (probed) bypasses
            // it: for data that is kept elsewhere (a cache) or read once
  kAlways,  // every piece-wise read bypasses it
};
// "never", "auto", "always".
absl::StatusOr<DirectIo> ParseDirectIo(const std::string& text);

struct ExecuteOptions {
  int threads = 2;
  DirectIo direct_io = DirectIo::kNever;
  bool verify_checksums = true;
  // Bytes per pread in the piece-wise way (at least 64): small enough that
  // a piece stays in L2 while it is hashed and copied out (128 KiB-1 MiB
  // measure the same on the dev VM). Tests make it tiny.
  uint64_t piece_bytes = 256 << 10;
  // Ranks (plan indices) whose copies are skipped, e.g. a client that left.
  std::function<bool(size_t rank_index)> skip_rank;
  // Bytes of reads completed so far, for progress reports.
  std::atomic<uint64_t>* progress_bytes = nullptr;
  // No read starts after this; the load then fails with DEADLINE_EXCEEDED.
  std::optional<std::chrono::steady_clock::time_point> deadline;
};

struct LoadStats {
  uint64_t bytes_read = 0;        // from storage
  uint64_t bytes_read_direct = 0;  // of which around the page cache (O_DIRECT)
  uint64_t bytes_from_cache = 0;  // served by the source from memory
  uint64_t bytes_delivered = 0;   // written into destinations
  // Of bytes_delivered: read by the ranks' clients from the files themselves
  // (the daemon's file views; set by the daemon, not by ExecutePlan).
  uint64_t bytes_from_files = 0;
  std::vector<uint64_t> rank_bytes_delivered;  // per plan rank
  int64_t checksums_verified = 0;
  double read_seconds = 0;  // summed over threads
  double copy_seconds = 0;
  double wall_seconds = 0;
};

absl::StatusOr<LoadStats> ExecutePlan(const LoadPlan& plan, RangeSource& source,
                                      Delivery& delivery, const ExecuteOptions& options = {});

// Convenience: host buffers.
absl::StatusOr<LoadStats> ExecutePlan(const LoadPlan& plan, RangeSource& source,
                                      const std::vector<std::vector<void*>>& destinations,
                                      const ExecuteOptions& options = {});

}  // namespace ckpt

#endif  // CKPTD_CORE_EXECUTOR_H_
