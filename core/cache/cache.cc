#include "core/cache/cache.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <map>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/base/parallel.h"
#include "core/base/status_macros.h"

namespace ckpt {

namespace {
#ifdef F_SEAL_FUTURE_WRITE
constexpr int kSealFutureWrite = F_SEAL_FUTURE_WRITE;
#else
constexpr int kSealFutureWrite = 0x0010;  // Linux 5.1
#endif
}  // namespace

// madvise(MADV_COLLAPSE) of [p, p + n) (huge_pages.cc).
int CollapseRange(void* p, uint64_t n);

// The default entry memory: blocks recycled across entries. A freed block is
// kept for the next entry of the same size, already faulted in: a cold load
// then writes memory at copy speed instead of taking a page fault per 4 KiB
// (131,072 per 512 MiB), and on VMs whose host reclaims freed guest memory
// the first touch of new memory is slower still. Free blocks count against
// the cache budget (HostCache::Reserve trims them first).
//
// Each block is its own memfd (mapped shared), so a client can copy cached
// bytes itself from a read-only mapping (HostCache::Export, core/cache/cache_view.h).
// The read-only descriptor handed out cannot change the block: the memfd is
// mode 0400 (another uid cannot reopen it for writing through /proc) and
// sealed against shrinking and growing. What a client may still see is the
// block's later contents through a mapping it kept, so a block exported to
// one tenant is recycled only for entries allocated for that tenant (a load
// of that tenant, which may read those bytes), and a block exported to two
// tenants is never recycled: when freed its pages are punched out (dropping
// them from every mapping) and it is closed.
class HostCache::BlockPool final : public HostAllocator {
 public:
  explicit BlockPool(CacheHugePages huge_pages) : huge_pages_(huge_pages) {}
  ~BlockPool() override { Trim(0); }
  uint8_t* Allocate(uint64_t n) override { return Allocate(n, kNoTenant); }
  uint8_t* Allocate(uint64_t n, uint32_t tenant) {
    {
      absl::MutexLock lock(&mu_);
      auto [lo, hi] = free_.equal_range(n);
      for (auto it = lo; it != hi; ++it) {
        Block& b = blocks_.at(Key(it->second));
        if (!Reusable(b, tenant)) continue;
        uint8_t* p = it->second;
        free_.erase(it);
        free_bytes_ -= n;
        b.serial = ++serials_;  // new contents from here on
        return p;
      }
    }
    return NewBlock(n);
  }
  // A new block of `n` bytes, faulted in, registered; nullptr when out of memory.
  uint8_t* NewBlock(uint64_t n) {
    Block b;
    b.n = n;
    // A memfd of its own (exportable) for blocks worth a client's mapping,
    // while the daemon holds fewer than kMaxMemfdBlocks (one fd each); else,
    // or where that fails, anonymous memory.
    int fd = -1;
    bool memfd = false;
    if (n >= kMinMemfdBlock) {
      // At most a quarter of the descriptors this process may open: the
      // rest stay for checkpoint files, sockets and the views handed out.
      struct rlimit rl{};
      const uint64_t fds = ::getrlimit(RLIMIT_NOFILE, &rl) == 0 ? rl.rlim_cur / 4 : 0;
      absl::MutexLock lock(&mu_);
      memfd = memfd_blocks_ < std::min<uint64_t>(kMaxMemfdBlocks, fds);
      if (memfd) ++memfd_blocks_;
    }
    if (memfd) {
      fd = ::memfd_create("ckptd-cache", MFD_CLOEXEC | MFD_ALLOW_SEALING);
      if (fd >= 0 && (::ftruncate(fd, static_cast<off_t>(n)) != 0 || ::fchmod(fd, 0400) != 0 ||
                      ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0)) {
        ::close(fd);
        fd = -1;
      }
    }
    // Faulted in at once: every page is written by the fill anyway; faulting
    // them in here, in one pass in the kernel, beats faulting them one by one
    // under the fill's pread (512 MiB: 0.34 vs 0.41-0.57 s on the dev VM).
    // MAP_POPULATE does that for anonymous memory; a shared mapping it only
    // maps for reading, so a memfd's pages are faulted in for writing with
    // MADV_POPULATE_WRITE (Linux 5.14; older kernels fault them in the fill).
    // A memfd's mapping starts on a 2 MiB boundary, where its huge pages
    // (if it gets any) map whole.
    void* p = fd >= 0 ? MapSharedAligned(fd, n, PROT_READ | PROT_WRITE)
                      : ::mmap(nullptr, n, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) {
      if (fd >= 0) ::close(fd);
      if (memfd) ForgetMemfd();
      return nullptr;
    }
    b.p = static_cast<uint8_t*>(p);
    if (fd >= 0) {
      // Huge pages where asked (HostCache's huge_pages): a client mapping the
      // block faults once per 2 MiB instead of once per 4 KiB (a new
      // process's copy out of a 512 MiB view: 0.053 against 0.100 s on the
      // dev VM). Their first touch here may wait for compaction, once per
      // block: blocks are recycled, and since file views a load does not
      // wait for new cache memory.
      if (huge_pages_ == CacheHugePages::kAdvise && n >= kHugePage) {
        (void)::madvise(p, n, MADV_HUGEPAGE);
      }
      constexpr int kPopulateWrite = 23;  // MADV_POPULATE_WRITE
      (void)::madvise(p, n, kPopulateWrite);
      // Read-only for everyone else from here on: no write() and no new
      // writable mapping, whatever a holder of a view does to its descriptor
      // (fchmod, reopening /proc/self/fd/N read-write); the daemon's own
      // mapping, made above, stays writable. Then no more seals (a holder
      // cannot add F_SEAL_WRITE, which would fail the daemon's next fill).
      if (::fcntl(fd, F_ADD_SEALS, kSealFutureWrite | F_SEAL_SEAL) != 0) {
        // Linux < 5.1 (no F_SEAL_FUTURE_WRITE): not exported, anonymous.
        ::munmap(p, n);
        ::close(fd);
        ForgetMemfd();
        fd = -1;
        memfd = false;
        p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                   -1, 0);
        if (p == MAP_FAILED) return nullptr;
        b.p = static_cast<uint8_t*>(p);
      }
    }
    if (fd >= 0) {
      // The descriptor clients get: read-only (a new open file description).
      // The mapping keeps the memfd itself.
      b.ro_fd = ::open(absl::StrCat("/proc/self/fd/", fd).c_str(), O_RDONLY | O_CLOEXEC);
      b.shared = true;
      ::close(fd);
      // Collapsed into huge pages later (CollapseHugePages), from its start.
      if (huge_pages_ == CacheHugePages::kCollapse && n >= kHugePage) b.collapse_at = 0;
    }
    if (memfd && b.ro_fd < 0) ForgetMemfd();  // counts descriptors held
    // A random key names the block to clients (their kept mappings):
    // unlike a memfd's inode number, never reused by another block.
    if (::getrandom(&b.key, sizeof(b.key), 0) != static_cast<ssize_t>(sizeof(b.key))) {
      b.key = reinterpret_cast<uintptr_t>(b.p) ^ static_cast<uint64_t>(::time(nullptr));
    }
    absl::MutexLock lock(&mu_);
    b.serial = ++serials_;
    if (collapse_off_) b.collapse_at = kCollapsed;
    if (b.collapse_at != kCollapsed) ++collapse_pending_;
    blocks_.emplace(Key(b.p), b);
    return b.p;
  }
  void Free(uint8_t* p, uint64_t n) override {
    Block dead;
    {
      absl::MutexLock lock(&mu_);
      Block& b = blocks_.at(Key(p));
      if (b.holds > 0) {  // a client copies from it: freed when it lets go
        b.freed = true;
        held_free_bytes_ += b.n;  // still counts against the budget
        return;
      }
      if (!FreeLocked(b, &dead)) return;
    }
    Destroy(dead);
  }
  bool HasRecycled(uint64_t n) const override { return HasRecycled(n, kNoTenant); }
  bool HasRecycled(uint64_t n, uint32_t tenant) const {
    absl::MutexLock lock(&mu_);
    auto [lo, hi] = free_.equal_range(n);
    for (auto it = lo; it != hi; ++it) {
      if (Reusable(blocks_.at(Key(it->second)), tenant)) return true;
    }
    return false;
  }
  // See HostCache::Export.
  std::optional<ExportedRange> Export(std::shared_ptr<BlockPool> self, const uint8_t* p,
                                      uint64_t n, uint32_t tenant) {
    absl::MutexLock lock(&mu_);
    auto it = blocks_.upper_bound(Key(p));
    if (it == blocks_.begin()) return std::nullopt;
    --it;
    Block& b = it->second;
    if (b.ro_fd < 0 || p < b.p || p + n > b.p + b.n || b.freed) return std::nullopt;
    if (std::find(b.exported.begin(), b.exported.end(), tenant) == b.exported.end()) {
      b.exported.push_back(tenant);
    }
    ++b.holds;
    ExportedRange r;
    r.key = b.key;
    r.serial = b.serial;
    r.fd = b.ro_fd;
    r.block_bytes = b.n;
    r.offset = static_cast<uint64_t>(p - b.p);
    r.block_data = b.p;
    uint8_t* base = b.p;
    r.hold = std::shared_ptr<const void>(base, [self](const void* q) { self->Unhold(q); });
    return r;
  }
  // See HostCache::BlockSerial.
  std::optional<std::pair<uint64_t, uint64_t>> Serial(const uint8_t* p, uint64_t n) const {
    absl::MutexLock lock(&mu_);
    auto it = blocks_.upper_bound(Key(p));
    if (it == blocks_.begin()) return std::nullopt;
    --it;
    const Block& b = it->second;
    if (b.ro_fd < 0 || p < b.p || p + n > b.p + b.n) return std::nullopt;
    return std::make_pair(b.serial, static_cast<uint64_t>(p - b.p));
  }
  // Unmaps free blocks until at most `keep` bytes are left, not counting
  // one block of `spare` bytes that `tenant` may reuse (about to be), if
  // there is one.
  void Trim(uint64_t keep, uint64_t spare = 0, uint32_t tenant = kNoTenant) {
    std::vector<Block> drop;
    {
      absl::MutexLock lock(&mu_);
      auto spared = free_.end();
      auto [lo, hi] = free_.equal_range(spare);
      for (auto it = lo; it != hi && spared == free_.end(); ++it) {
        if (Reusable(blocks_.at(Key(it->second)), tenant)) spared = it;
      }
      const uint64_t not_counted = spared != free_.end() ? spare : 0;
      for (auto it = free_.end(); free_bytes_ - not_counted > keep && it != free_.begin();) {
        --it;  // largest first
        if (it == spared) continue;
        auto b = blocks_.find(Key(it->second));
        if (b->second.holds > 0) continue;  // CollapseHugePages is at it: kept
        drop.push_back(b->second);
        ForgetLocked(b->second);
        blocks_.erase(b);
        free_bytes_ -= it->first;
        it = free_.erase(it);
      }
    }
    for (const Block& b : drop) Destroy(b);
  }
  // Bytes of blocks the cache freed while a client held them (not yet
  // recycled or unmapped): they count against the cache budget.
  uint64_t held_free_bytes() const {
    absl::MutexLock lock(&mu_);
    return held_free_bytes_;
  }
  uint64_t free_bytes() const {
    absl::MutexLock lock(&mu_);
    return free_bytes_;
  }
  uint64_t blocks() const {
    absl::MutexLock lock(&mu_);
    return blocks_.size();
  }
  CacheHugePages huge_pages() const { return huge_pages_; }
  bool HugePagesPending() const {
    absl::MutexLock lock(&mu_);
    return collapse_pending_ > 0;
  }
  std::pair<uint64_t, uint64_t> Collapsed() const {
    absl::MutexLock lock(&mu_);
    return {collapsed_bytes_, collapse_failed_};
  }
  // See HostCache::CollapseHugePages.
  CollapseStats Collapse(const std::function<bool()>& go_on) {
    CollapseStats s;
    while (go_on()) {
      uint8_t* p = nullptr;
      uint64_t at = 0, end = 0;
      {
        absl::MutexLock lock(&mu_);
        if (collapse_pending_ == 0) break;
        for (auto& [key, b] : blocks_) {
          if (b.collapse_at == kCollapsed || b.freed) continue;
          p = b.p;
          at = b.collapse_at;
          end = b.n / kHugePage * kHugePage;
          ++b.holds;  // not unmapped while collapsed (Unhold frees it if freed meanwhile)
          break;
        }
        if (p == nullptr) break;  // pending ones are all held freed: they leave soon
      }
      bool stopped = false;
      for (; at < end; at += kHugePage) {
        if (s.bytes + s.failed > 0 && !go_on()) {
          stopped = true;
          break;
        }
        if (CollapseRange(p + at, kHugePage) == 0) {
          s.bytes += kHugePage;
          absl::MutexLock lock(&mu_);
          collapsed_bytes_ += kHugePage;
        } else if (errno == EAGAIN || errno == ENOMEM) {
          ++s.failed;  // no huge page to be had now: this range stays on 4 KiB pages
          absl::MutexLock lock(&mu_);
          ++collapse_failed_;
        } else {
          s.unsupported = absl::StrCat("MADV_COLLAPSE: ", std::strerror(errno));
          break;
        }
      }
      {
        absl::MutexLock lock(&mu_);
        Block& b = blocks_.at(Key(p));
        if (!s.unsupported.empty()) {
          collapse_off_ = true;  // none will be: every block counts as done
          collapse_pending_ = 0;
          for (auto& [key, other] : blocks_) other.collapse_at = kCollapsed;
        } else if (stopped) {
          b.collapse_at = at;  // resumed there
        } else if (b.collapse_at != kCollapsed) {
          b.collapse_at = kCollapsed;
          --collapse_pending_;
          ++s.blocks;
        }
      }
      Unhold(p);
      if (stopped || !s.unsupported.empty()) break;
    }
    return s;
  }

 private:
  struct Block {
    uint64_t key = 0;  // random: names the block to clients
    // Which contents: new for every allocation of the block (an entry's
    // bytes never change once published, so (serial, offset) names bytes).
    uint64_t serial = 0;
    uint8_t* p = nullptr;
    uint64_t n = 0;
    bool shared = false;  // a memfd's mapping (else anonymous memory)
    int ro_fd = -1;       // read-only descriptor for clients, or -1: not exportable
    std::vector<uint32_t> exported;  // tenants it was exported to
    int holds = 0;                   // exports not yet let go
    bool freed = false;              // freed by the cache while held
    // Where CollapseHugePages goes on in this block, or kCollapsed (done, or
    // not to be: anonymous, under 2 MiB, not kCollapse).
    uint64_t collapse_at = kCollapsed;
  };
  static constexpr uint64_t kCollapsed = ~uint64_t{0};
  // A block leaving blocks_: no longer pending a collapse.
  void ForgetLocked(const Block& b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (b.collapse_at != kCollapsed && collapse_pending_ > 0) --collapse_pending_;
  }
  static uintptr_t Key(const void* p) { return reinterpret_cast<uintptr_t>(p); }
  static bool Reusable(const Block& b, uint32_t tenant) {
    return b.exported.empty() || (b.exported.size() == 1 && b.exported[0] == tenant);
  }
  // Puts `b` on the free list, or (exported to two tenants) takes it out of
  // blocks_ into *dead for Destroy outside the lock; returns whether it did
  // the latter.
  bool FreeLocked(Block& b, Block* dead) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (b.exported.size() >= 2) {
      *dead = b;
      ForgetLocked(b);
      blocks_.erase(Key(b.p));
      return true;
    }
    free_.emplace(b.n, b.p);
    free_bytes_ += b.n;
    return false;
  }
  void Unhold(const void* p) {
    Block dead;
    {
      absl::MutexLock lock(&mu_);
      Block& b = blocks_.at(Key(p));
      if (--b.holds > 0 || !b.freed) return;
      b.freed = false;
      held_free_bytes_ -= b.n;
      if (!FreeLocked(b, &dead)) return;
    }
    Destroy(dead);
  }
  void ForgetMemfd() {
    absl::MutexLock lock(&mu_);
    --memfd_blocks_;
  }
  // A block exported to anyone cannot have its pages punched out (the
  // write seal refuses that too): they stay while a client maps them (the
  // clients keep only their latest load's mappings) and are never written
  // again, as the memfd is closed here.
  void Destroy(const Block& b) {
    ::munmap(b.p, b.n);
    if (b.ro_fd >= 0) {
      ::close(b.ro_fd);
      ForgetMemfd();
    }
  }

  // Smaller blocks (the ends of files, small tensors) are not worth a
  // client's mapping; each memfd block holds one descriptor.
  static constexpr uint64_t kMinMemfdBlock = 64 << 10;
  static constexpr uint64_t kHugePage = 2 << 20;
  const CacheHugePages huge_pages_;
  static constexpr uint64_t kMaxMemfdBlocks = 4096;
  mutable absl::Mutex mu_;
  uint64_t memfd_blocks_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t serials_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t held_free_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uintptr_t, Block> blocks_ ABSL_GUARDED_BY(mu_);  // every live block, by address
  std::multimap<uint64_t, uint8_t*> free_ ABSL_GUARDED_BY(mu_);
  uint64_t free_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t collapse_pending_ ABSL_GUARDED_BY(mu_) = 0;  // blocks with collapse_at set
  bool collapse_off_ ABSL_GUARDED_BY(mu_) = false;  // the kernel refused MADV_COLLAPSE
  uint64_t collapsed_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // CacheStats::huge_page_bytes
  uint64_t collapse_failed_ ABSL_GUARDED_BY(mu_) = 0;  // CacheStats::huge_page_failed
};

HostCache::HostCache(uint64_t budget_bytes, HostAllocator* allocator, CacheHugePages huge_pages)
    : budget_(budget_bytes),
      pool_(allocator == nullptr ? std::make_shared<BlockPool>(huge_pages) : nullptr),
      allocator_(allocator != nullptr ? allocator : pool_.get()) {}

HostCache::~HostCache() = default;

// Bytes of one entry; freed through the allocator they came from (kept
// alive by `pool` when it is the cache's own).
struct HostCache::Buffer {
  HostAllocator* allocator = nullptr;
  std::shared_ptr<BlockPool> pool;
  uint8_t* p = nullptr;
  uint64_t n = 0;
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (p == nullptr) return;
    if (allocator != nullptr) {
      allocator->Free(p, n);
    } else {
      delete[] p;
    }
  }
};

struct HostCache::Pending {
  HostCache* cache;
  uint64_t n;
  uint32_t tenant = kNoTenant;
  std::unique_ptr<Buffer> data;
  bool published = false;
  ~Pending() {
    if (!published) {
      absl::MutexLock lock(&cache->mu_);
      cache->used_ -= n;
    }
  }
};

namespace {
// Where laid-out copies are filed: under their checkpoint's directory, in a
// name no checkpoint file is looked up by (and with a stamp no file has).
std::string LaidOutPath(const std::string& dir, uint64_t fingerprint) {
  return absl::StrCat(dir, "/\x01laid-out/", absl::Hex(fingerprint, absl::kZeroPad16));
}
bool IsLaidOutPath(const std::string& path) {
  return path.find("/\x01laid-out/") != std::string::npos;
}
}  // namespace

struct HostCache::Entry {
  bool laid_out = false;  // PublishLaidOut
  std::string path;
  FileStamp stamp;
  uint64_t offset = 0;
  uint64_t n = 0;
  std::unique_ptr<Buffer> data;
  std::list<EntryPtr>::iterator lru;
  // Set when dropped from the index while pinned: the cache's count of such
  // bytes, given back here when the memory is.
  std::shared_ptr<std::atomic<uint64_t>> detached;
  ~Entry() {
    if (detached) detached->fetch_sub(n);
  }
};

const HostCache::EntryPtr* HostCache::FindLocked(const std::string& path, const FileStamp& stamp,
                                                 uint64_t offset, uint64_t n) const {
  auto fit = index_.find(path);
  if (fit == index_.end()) return nullptr;
  auto it = fit->second.upper_bound(offset);
  if (it == fit->second.begin()) return nullptr;
  --it;
  const EntryPtr& e = it->second;
  if (e->stamp == stamp && e->offset <= offset && offset + n <= e->offset + e->n) return &e;
  return nullptr;
}

std::optional<RangeView> HostCache::Lookup(const std::string& path, const FileStamp& stamp,
                                           uint64_t offset, uint64_t n) {
  absl::MutexLock lock(&mu_);
  if (const EntryPtr* found = FindLocked(path, stamp, offset, n)) {
    const EntryPtr& e = *found;
    TouchLocked(e);
    ++stats_.hits;
    EntryPtr pin = e;
    return RangeView{e->data->p + (offset - e->offset), std::move(pin), false};
  }
  ++stats_.misses;
  return std::nullopt;
}

void HostCache::TouchLocked(const EntryPtr& e) { lru_.splice(lru_.begin(), lru_, e->lru); }

void HostCache::UncountLocked(const Entry& e) {
  used_ -= e.n;
  --stats_.entries;
  stats_.bytes -= e.n;
  if (e.laid_out) {
    --stats_.laid_out_entries;
    stats_.laid_out_bytes -= e.n;
  }
}

void HostCache::DropLocked(EntryPtr e) {
  lru_.erase(e->lru);
  UncountLocked(*e);
  // Still in the index (the caller erases it after), plus `e`: two
  // references; a third is a load's pin.
  if (e.use_count() > 2) {
    detached_->fetch_add(e->n);
    e->detached = detached_;
  }
}

bool HostCache::EvictOneLocked() {
  for (auto it = lru_.rbegin(); it != lru_.rend(); ++it) {
    EntryPtr e = *it;
    // index + lru + this copy hold 3 references; more means a load pins it.
    if (e.use_count() > 3) continue;
    auto& files = index_[e->path];
    files.erase(e->offset);
    if (files.empty()) index_.erase(e->path);
    lru_.erase(e->lru);
    UncountLocked(*e);
    ++stats_.evictions;
    return true;
  }
  return false;
}

std::shared_ptr<HostCache::Pending> HostCache::Reserve(uint64_t n, uint32_t tenant) {
  return ReserveRoom(n, tenant, /*evict=*/true);
}

std::shared_ptr<HostCache::Pending> HostCache::ReserveFree(uint64_t n, uint32_t tenant) {
  return ReserveRoom(n, tenant, /*evict=*/false);
}

std::shared_ptr<HostCache::Pending> HostCache::ReserveRoom(uint64_t n, uint32_t tenant,
                                                           bool evict) {
  absl::MutexLock lock(&mu_);
  if (n == 0 || n > budget_) return nullptr;
  // Memory of dropped entries still pinned by a load counts too.
  const uint64_t held = pool_ ? pool_->held_free_bytes() : 0;
  while (used_ + detached_->load() + held + n > budget_) {
    if (!evict || !EvictOneLocked()) return nullptr;
  }
  used_ += n;
  // Recycled blocks count against the budget too.
  if (pool_) pool_->Trim(budget_ - used_ - detached_->load() - held, n, tenant);
  auto p = std::make_shared<Pending>();
  p->cache = this;
  p->n = n;
  p->tenant = tenant;
  // Allocation happens outside the lock below.
  return p;
}

void HostCache::PublishLaidOut(std::shared_ptr<Pending> p, const std::string& dir,
                               uint64_t fingerprint) {
  PublishEntry(std::move(p), LaidOutPath(dir, fingerprint), FileStamp{}, 0, true);
}

std::optional<RangeView> HostCache::Peek(const std::string& path, const FileStamp& stamp,
                                         uint64_t offset, uint64_t n) {
  absl::MutexLock lock(&mu_);
  const EntryPtr* found = FindLocked(path, stamp, offset, n);
  if (found == nullptr) return std::nullopt;
  EntryPtr pin = *found;
  return RangeView{pin->data->p + (offset - pin->offset), std::move(pin), false};
}

std::optional<std::pair<uint64_t, uint64_t>> HostCache::BlockSerial(const uint8_t* p,
                                                                    uint64_t n) const {
  if (!pool_) return std::nullopt;
  return pool_->Serial(p, n);
}

std::optional<RangeView> HostCache::FindLaidOut(const std::string& dir, uint64_t fingerprint,
                                                uint64_t n, bool serve) {
  absl::MutexLock lock(&mu_);
  auto fit = index_.find(LaidOutPath(dir, fingerprint));
  if (fit == index_.end()) return std::nullopt;
  auto it = fit->second.find(0);
  if (it == fit->second.end() || !it->second->laid_out || it->second->n != n) return std::nullopt;
  // Not a hit or miss of checkpoint bytes; it stays last in the LRU order.
  if (serve) ++stats_.laid_out_hits;
  EntryPtr pin = it->second;
  return RangeView{pin->data->p, pin, false};
}

uint8_t* HostCache::PendingData(const std::shared_ptr<Pending>& p) {
  if (!p->data) {
    auto b = std::make_unique<Buffer>();
    b->n = p->n;
    b->p = pool_ ? pool_->Allocate(p->n, p->tenant) : allocator_->Allocate(p->n);
    if (b->p != nullptr) {
      b->allocator = allocator_;
      b->pool = pool_;
    } else {
      b->p = new uint8_t[p->n];
    }
    p->data = std::move(b);
  }
  return p->data->p;
}

RangeView HostCache::Publish(std::shared_ptr<Pending> p, const std::string& path,
                             const FileStamp& stamp, uint64_t offset) {
  return PublishEntry(std::move(p), path, stamp, offset, false);
}

RangeView HostCache::PublishEntry(std::shared_ptr<Pending> p, const std::string& path,
                                  const FileStamp& stamp, uint64_t offset, bool laid_out) {
  auto e = std::make_shared<Entry>();
  e->laid_out = laid_out;
  e->path = path;
  e->stamp = stamp;
  e->offset = offset;
  e->n = p->n;
  e->data = std::move(p->data);
  p->published = true;
  absl::MutexLock lock(&mu_);
  auto& files = index_[path];
  auto old = files.find(offset);
  if (old != files.end()) {  // replace a stale or shorter entry at the same offset
    DropLocked(old->second);
    files.erase(old);
  }
  // A laid-out copy is evicted first: it only speeds up a load whose bytes
  // the cache holds anyway.
  e->lru = laid_out ? lru_.insert(lru_.end(), e) : lru_.insert(lru_.begin(), e);
  files.emplace(offset, e);
  ++stats_.entries;
  stats_.bytes += e->n;
  if (laid_out) {
    ++stats_.laid_out_entries;
    stats_.laid_out_bytes += e->n;
  }
  return RangeView{e->data->p, e, false};
}

std::pair<uint64_t, uint64_t> HostCache::EvictPrefix(const std::string& prefix) {
  absl::MutexLock lock(&mu_);
  uint64_t bytes = 0, entries = 0;
  for (auto it = index_.begin(); it != index_.end();) {
    if (!absl::StartsWith(it->first, prefix)) {
      ++it;
      continue;
    }
    for (auto& [off, e] : it->second) {
      bytes += e->n;
      ++entries;
      ++stats_.evictions;
      DropLocked(e);
    }
    it = index_.erase(it);
  }
  return {bytes, entries};
}

CacheStats HostCache::stats() const {
  absl::MutexLock lock(&mu_);
  CacheStats s = stats_;
  s.bytes += detached_->load();  // evicted while pinned: still held
  if (pool_) s.bytes += pool_->held_free_bytes();  // evicted while a client copies from it
  s.budget_bytes = budget_;
  if (pool_) s.recycled_bytes = pool_->free_bytes();
  if (pool_) std::tie(s.huge_page_bytes, s.huge_page_failed) = pool_->Collapsed();
  return s;
}

bool HostCache::HasRecycled(uint64_t n, uint32_t tenant) const {
  return pool_ ? pool_->HasRecycled(n, tenant) : allocator_->HasRecycled(n);
}

std::optional<ExportedRange> HostCache::Export(const uint8_t* p, uint64_t n, uint32_t tenant) {
  if (!pool_ || tenant == kNoTenant) return std::nullopt;
  return pool_->Export(pool_, p, n, tenant);
}

uint64_t HostCache::blocks() const { return pool_ ? pool_->blocks() : 0; }

bool HostCache::HugePagesPending() const { return pool_ && pool_->HugePagesPending(); }

CacheHugePages HostCache::huge_pages() const {
  return pool_ ? pool_->huge_pages() : CacheHugePages::kOff;
}

HostCache::CollapseStats HostCache::CollapseHugePages(const std::function<bool()>& go_on) {
  return pool_ ? pool_->Collapse(go_on) : CollapseStats{};
}

std::map<std::string, std::pair<uint64_t, uint64_t>> HostCache::Files() const {
  absl::MutexLock lock(&mu_);
  std::map<std::string, std::pair<uint64_t, uint64_t>> out;
  for (const auto& [path, entries] : index_) {
    if (IsLaidOutPath(path)) continue;
    for (const auto& [off, e] : entries) {
      out[path].first += e->n;
      ++out[path].second;
    }
  }
  return out;
}

}  // namespace ckpt
