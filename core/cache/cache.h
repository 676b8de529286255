// HostCache: checkpoint bytes kept in host memory across loads, within a
// byte budget, evicted least-recently-used first. Entries that a load is
// using (pinned through a RangeView) are never evicted.
//
// Entries are keyed by file path + FileStamp (device, inode, size, mtime,
// ctime), so a file that is rewritten or replaced never serves stale bytes
// (even a same-size rewrite with its mtime put back: ctime moves): its new
// stamp misses and the old entries age out (or Evict drops them).
//
// What a cache hit has been checked against: CachingSource publishes only
// bytes that were verified when they were read from storage, against every
// checksum block lying entirely inside the read that filled the entry. A
// hit for a range inside that entry is served without hashing again; every
// checksum block entirely inside the hit's range is also entirely inside the
// filling read, so a hit has passed every check a read of that range from
// storage would make. Bytes outside any whole checksum block (the partial
// blocks at the ends of a read; formats without checksums: HuggingFace,
// PaddlePaddle, PyTorch DCP) are cached as read, like a storage read would
// deliver them. A load run without verification reads and delivers but adds
// nothing to the cache (it can still be served by entries already there).
//
// Thread-safe.
#ifndef CKPTD_CORE_CACHE_H_
#define CKPTD_CORE_CACHE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/base/aligned_map.h"
#include "core/exec/executor.h"

namespace ckpt {

struct CacheStats {
  uint64_t budget_bytes = 0;
  uint64_t bytes = 0;
  uint64_t entries = 0;
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t evictions = 0;
  uint64_t recycled_bytes = 0;  // freed entry memory kept for the next entries
  // Laid-out copies (HostCache::PublishLaidOut), counted in bytes and
  // entries too.
  uint64_t laid_out_bytes = 0;
  uint64_t laid_out_entries = 0;
  uint64_t laid_out_hits = 0;
  // Shared blocks collapsed into huge pages (CacheHugePages::kCollapse),
  // counted as each 2 MiB is: bytes now on huge pages, and 2 MiB ranges the
  // kernel left on 4 KiB pages (no huge page free).
  uint64_t huge_page_bytes = 0;
  uint64_t huge_page_failed = 0;
};

// Who an entry's memory is allocated for (a uid, for the daemon): see
// HostCache::Export. kNoTenant: nobody in particular (never exported).
inline constexpr uint32_t kNoTenant = 0xffffffffu;

// Cached bytes a client process may map read-only and copy itself
// (HostCache::Export): bytes [offset, offset + n) of a memory block that
// `fd` (read-only; valid while `hold` is held, not to be closed) maps.
struct ExportedRange {
  uint64_t key = 0;          // random, unique in practice across daemons and restarts
  // The block's contents: a new serial each time the block is allocated to
  // an entry, so (serial, offset) names the same bytes for as long as the
  // block lives (an entry's bytes do not change once it is published).
  uint64_t serial = 0;
  int fd = -1;
  uint64_t block_bytes = 0;  // the block's size (what fd maps)
  uint64_t offset = 0;       // of the exported bytes in the block
  const uint8_t* block_data = nullptr;  // the block's first byte in this process
  // While held, the block is neither recycled nor unmapped (its entry may be
  // evicted meanwhile; the block is freed when the last hold goes).
  std::shared_ptr<const void> hold;
};

// Where HostCache entries get their memory. The default recycles anonymous
// mappings (cache.cc); the daemon plugs in page-locked memory when CUDA is
// present (server/cuda), so cached bytes can be DMA'd to devices directly.
// Thread-safe.
class HostAllocator {
 public:
  virtual ~HostAllocator() = default;
  // Returns `n` bytes, or nullptr when out of memory.
  virtual uint8_t* Allocate(uint64_t n) = 0;
  virtual void Free(uint8_t* p, uint64_t n) = 0;
  // Whether Allocate(n) would now return memory already faulted in (a block
  // used before). Allocators that fault memory in ahead say true.
  virtual bool HasRecycled(uint64_t n) const { return true; }
};

// Whether the kernel backs shared memory with huge pages where a mapping
// asks (MADV_HUGEPAGE), and the setting that decides it:
// /sys/kernel/mm/transparent_hugepage/shmem_enabled ("always", "within_size"
// and "advise" honour the request; "never", "deny" or no such file do not),
// or, where the kernel has one and it does not say "inherit", the per-size
// hugepages-2048kB/shmem_enabled.
struct ShmemHugePages {
  bool honoured = false;
  std::string setting;  // the value that decided, e.g. "advise"; "unknown" without the files
};
ShmemHugePages ProbeShmemHugePages();

// Whether this kernel collapses a memfd's pages into huge pages when asked
// (madvise MADV_COLLAPSE, Linux 6.1), which it does whatever the shmem THP
// setting says: tried once on a 2 MiB memfd (a few ms). "" when it does,
// else why not (e.g. "MADV_COLLAPSE: Invalid argument").
std::string ProbeShmemCollapse();

// How the data cache's shared blocks (what clients map as cache views) get
// huge pages, so that a client's first copy out of a view takes one page
// fault per 2 MiB instead of one per 4 KiB:
enum class CacheHugePages {
  kOff,     // never: 4 KiB pages
  kAdvise,  // asked for at allocation (MADV_HUGEPAGE), where shmem THP honours it
  // 4 KiB pages at allocation, collapsed into huge pages afterwards
  // (HostCache::CollapseHugePages, MADV_COLLAPSE), where shmem THP does not
  // honour MADV_HUGEPAGE but the kernel collapses on request.
  kCollapse,
};

class HostCache {
 public:
  // `allocator` (optional, not owned) must outlive the cache; without one
  // the cache recycles its own blocks of memory (cache.cc, BlockPool), and
  // with `huge_pages` gets huge pages for its shared blocks of 2 MiB and
  // more as that says (see CacheHugePages).
  explicit HostCache(uint64_t budget_bytes, HostAllocator* allocator = nullptr,
                     CacheHugePages huge_pages = CacheHugePages::kOff);
  ~HostCache();
  HostCache(const HostCache&) = delete;
  HostCache& operator=(const HostCache&) = delete;

  // Bytes [offset, offset + n) of `path` at `stamp`, pinned, if an entry
  // holds all of them.
  std::optional<RangeView> Lookup(const std::string& path, const FileStamp& stamp, uint64_t offset,
                                  uint64_t n);

  // Reserves room for an entry of `n` bytes, evicting unpinned entries as
  // needed. Returns nullptr when `n` cannot fit beside the pinned entries.
  // Fill the buffer, then Publish it (or drop it to give the room back).
  struct Pending;
  // The memory comes from a block free for `tenant` (see Export) or a new one.
  std::shared_ptr<Pending> Reserve(uint64_t n, uint32_t tenant = kNoTenant);
  // Whether an entry of `n` bytes would get memory already faulted in (see
  // HostAllocator::HasRecycled and SourceOptions::defer_fresh_memory).
  bool HasRecycled(uint64_t n, uint32_t tenant = kNoTenant) const;
  // Whether an entry of `n` bytes could be kept at all (within the budget).
  bool CanHold(uint64_t n) const { return n > 0 && n <= budget_; }
  uint8_t* PendingData(const std::shared_ptr<Pending>& p);
  RangeView Publish(std::shared_ptr<Pending> p, const std::string& path, const FileStamp& stamp,
                    uint64_t offset);

  // Laid-out copies (ViewRecorder, core/cache/cache_view.h): bytes one rank
  // gathered from pieces of several entries (a tensor split on another
  // dimension than the checkpoint's), kept in one block so that the rank's
  // next load copies them from one contiguous range. One is filed under
  // checkpoint directory `dir` (EvictPrefix of it drops it) and named by the
  // fingerprint of what it was copied from (block serials, offsets, runs),
  // so it is found only by a load that would copy the very same bytes. It
  // takes only room the budget has free (ReserveFree evicts nothing; nullptr
  // when there is not enough) and is the first entry evicted.
  std::shared_ptr<Pending> ReserveFree(uint64_t n, uint32_t tenant);
  void PublishLaidOut(std::shared_ptr<Pending> p, const std::string& dir, uint64_t fingerprint);
  // Bytes [offset, offset + n) of `path` at `stamp`, pinned, if an entry
  // holds them: Lookup without counting a hit or miss or touching the LRU
  // order (the laid-out copies' work looking for bytes a load read).
  std::optional<RangeView> Peek(const std::string& path, const FileStamp& stamp, uint64_t offset,
                                uint64_t n);
  // The contents serial of the exportable block holding [p, p + n) and the
  // offset of p in it (see ExportedRange::serial); nullopt elsewhere.
  std::optional<std::pair<uint64_t, uint64_t>> BlockSerial(const uint8_t* p, uint64_t n) const;
  // The laid-out copy of `n` bytes named `fingerprint` under `dir`, pinned
  // (`serve`: for a load, counted in stats().laid_out_hits).
  std::optional<RangeView> FindLaidOut(const std::string& dir, uint64_t fingerprint, uint64_t n,
                                       bool serve = true);

  // Drops every entry whose path starts with `prefix` from the index.
  // Unpinned ones are freed now; pinned ones (a load is using them) when
  // their last user lets go, and until then their bytes still count against
  // the budget and in stats().bytes (so the figures match the memory held).
  // Returns the bytes and entries dropped.
  std::pair<uint64_t, uint64_t> EvictPrefix(const std::string& prefix);

  // The cache block holding bytes [p, p + n) (an entry's, published or still
  // being filled), exported to `tenant` and held, for a client of that
  // tenant to map read-only and copy from; nullopt when those bytes are not
  // in an exportable block (scratch memory, a custom allocator, no memfd).
  // Once exported to a tenant, a block is recycled only for entries
  // reserved for that tenant; exported to two, it is never recycled (its
  // pages are punched out when freed). Thread-safe.
  std::optional<ExportedRange> Export(const uint8_t* p, uint64_t n, uint32_t tenant);
  // Whether Export can succeed at all (the cache's own pool, not a custom
  // allocator).
  bool CanExport() const { return pool_ != nullptr; }
  // Memory blocks the cache's own pool has mapped (entries, pending fills,
  // free blocks, held blocks); 0 with a custom allocator.
  uint64_t blocks() const;

  // CacheHugePages::kCollapse: whether a shared block of 2 MiB or more has
  // pages not yet collapsed into huge pages (a new block; recycled blocks
  // keep theirs).
  bool HugePagesPending() const;
  struct CollapseStats {
    uint64_t blocks = 0;  // blocks done
    uint64_t bytes = 0;   // bytes now on huge pages
    uint64_t failed = 0;  // 2 MiB ranges the kernel did not collapse (no huge page free)
    std::string unsupported;  // set when the kernel refused MADV_COLLAPSE itself: no more tries
  };
  // Collapses pending blocks into huge pages, 2 MiB at a time (a copy of
  // those bytes in the kernel, 1-3 ms each on the development VM), while
  // `go_on()` says so: it is asked before every 2 MiB, so a load that
  // starts meanwhile waits for one step at most. A block the cache frees
  // meanwhile is held until its step ends. Thread-safe; the bytes never
  // change (clients mapping the block fault onto the huge pages).
  CollapseStats CollapseHugePages(const std::function<bool()>& go_on);

  // The pool's mode (kOff with a custom allocator).
  CacheHugePages huge_pages() const;

  CacheStats stats() const;
  // Bytes and entries per cached file path (laid-out copies not included).
  std::map<std::string, std::pair<uint64_t, uint64_t>> Files() const;

 private:
  struct Entry;
  using EntryPtr = std::shared_ptr<Entry>;
  bool EvictOneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reserve (`evict`: unpinned entries make room) and ReserveFree.
  std::shared_ptr<Pending> ReserveRoom(uint64_t n, uint32_t tenant, bool evict);
  RangeView PublishEntry(std::shared_ptr<Pending> p, const std::string& path,
                         const FileStamp& stamp, uint64_t offset, bool laid_out);
  // Takes `e` off the counters of entries in the index (EvictOneLocked, DropLocked).
  void UncountLocked(const Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes `e` out of the index and LRU list. Its bytes leave used_ now, or,
  // when a load still pins it, move to detached_ until the entry is freed.
  // Call it while `e` is still in the index.
  void DropLocked(EntryPtr e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TouchLocked(const EntryPtr& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The published entry holding [offset, offset + n) of `path` at `stamp`.
  const EntryPtr* FindLocked(const std::string& path, const FileStamp& stamp, uint64_t offset,
                             uint64_t n) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  struct Buffer;  // entry bytes from allocator_ (or new[])
  class BlockPool;

  const uint64_t budget_;
  const std::shared_ptr<BlockPool> pool_;  // null when an allocator is given
  HostAllocator* const allocator_;
  mutable absl::Mutex mu_;
  // Bytes of published entries plus reservations.
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  // Bytes of entries dropped from the index while pinned, not yet freed
  // (decremented by the entry's destructor, which may run on any thread
  // and never takes mu_).
  const std::shared_ptr<std::atomic<uint64_t>> detached_ =
      std::make_shared<std::atomic<uint64_t>>(0);
  // path -> (offset -> entry) for published entries.
  std::map<std::string, std::map<uint64_t, EntryPtr>> index_ ABSL_GUARDED_BY(mu_);
  std::list<EntryPtr> lru_ ABSL_GUARDED_BY(mu_);  // front = most recent
  CacheStats stats_ ABSL_GUARDED_BY(mu_);
};

// A RangeSource for one checkpoint directory that serves from a HostCache
// and reads misses from storage into it. Files are opened beneath the
// directory (SourceOptions::confine, on by default: no symlink followed,
// regular files only). Every file's identity is checked against `stamps`
// (taken when the checkpoint's metadata was validated) when it is opened
// (fstat of the descriptor read from) and after each read (the descriptor
// and the name), and once more for every file at the end of the load
// (CheckOpenedFilesUnchanged), so a file that changes, is replaced or
// vanishes at any point of the load fails it (ABORTED, naming the file)
// instead of delivering stale bytes. Misses are published to the cache
// only when their bytes were verified (see the top of this file): a Fetch
// without a verify function or a fill begun without `verify` reads into
// scratch memory and keeps nothing.
class CachingSource final : public RangeSource {
 public:
  CachingSource(std::string dir, HostCache* cache, std::map<std::string, FileStamp> stamps,
                SourceOptions options = {})
      : dir_(std::move(dir)), cache_(cache), stamps_(std::move(stamps)), options_(options) {}

  absl::StatusOr<RangeView> Fetch(
      const std::string& file, uint64_t offset, uint64_t n, std::vector<uint8_t>& scratch,
      const std::function<absl::Status(const uint8_t*)>& verify) override;
  // A hit is served; a miss is read by the executor straight into a new
  // cache entry, published by Finish once the file is checked unchanged.
  absl::StatusOr<std::unique_ptr<Fill>> BeginFill(const std::string& file, uint64_t offset,
                                                  uint64_t n, bool verify,
                                                  std::optional<RangeView>* served) override;
  // Every file this source opened, checked again (descriptor and name)
  // against its stamp: call it once the plan has run, so a file changed
  // after its last read but before the load ends fails the load too
  // (ABORTED naming the file).
  absl::Status CheckOpenedFilesUnchanged();
  // Reads delivered without being kept (SourceOptions::defer_fresh_memory,
  // ShareUncached), as (file, offset), in no particular order.
  std::vector<std::pair<std::string, uint64_t>> Deferred() const;

  // For a client that reads bytes [offset, offset + n) of `file` itself
  // (cache views of files, core/cache/cache_view.h): nullopt when the cache
  // holds them (the client copies those from the cache) or the file has no
  // descriptor to share (object storage: the daemon reads it); else a new
  // read-only descriptor of the file, opened and checked against its stamp
  // as for a read (CheckOpenedFilesUnchanged covers it), its size, and the
  // range noted in Deferred() (filled into the cache after the load).
  struct SharedFile {
    int fd = -1;  // owned by the caller
    uint64_t size = 0;
    std::string path;
    FileStamp stamp;  // the file as the plan was made (checked again once read)
  };
  absl::StatusOr<std::optional<SharedFile>> ShareUncached(const std::string& file,
                                                          uint64_t offset, uint64_t n);
  // Whether an entry holds bytes [offset, offset + n) of `file` now (a hint:
  // it may be evicted before it is read; BeginFill and Fetch decide).
  bool Holds(const std::string& file, uint64_t offset, uint64_t n) const;

 private:
  class CacheFill;
  // What Fetch and BeginFill both start with: the file checked against its
  // stamp, and the cached bytes if an entry holds them.
  struct Probed {
    std::string path;
    const FileStamp* stamp = nullptr;
    const RandomAccessFile* file = nullptr;
    std::optional<RangeView> hit;
  };
  absl::StatusOr<Probed> Probe(const std::string& file, uint64_t offset, uint64_t n);
  absl::StatusOr<const RandomAccessFile*> Get(const std::string& file);
  absl::Status CheckUnchanged(const std::string& file, const RandomAccessFile& f);

  const std::string dir_;
  HostCache* const cache_;
  const std::map<std::string, FileStamp> stamps_;
  const SourceOptions options_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const Directory> directory_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::unique_ptr<RandomAccessFile>> files_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<std::string, uint64_t>> deferred_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt

#endif  // CKPTD_CORE_CACHE_H_
