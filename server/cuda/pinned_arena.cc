#include "server/cuda/pinned_arena.h"

#include <sys/mman.h>

#include <algorithm>

namespace ckptd::gpu {
namespace {

constexpr uint64_t kPage = 4096;
constexpr uint64_t kHuge = 2ull << 20;

uint64_t RoundUp(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

}  // namespace

ChunkedHostAllocator::ChunkedHostAllocator(Options options, PinFn pin, UnpinFn unpin)
    : options_(options), pin_(std::move(pin)), unpin_(std::move(unpin)) {}

ChunkedHostAllocator::~ChunkedHostAllocator() {
  absl::MutexLock lock(&mu_);
  while (!chunks_.empty()) ReleaseLocked(chunks_.begin());
}

uint8_t* ChunkedHostAllocator::TakeLocked(Chunk& c, uint64_t n) {
  for (auto it = c.free.begin(); it != c.free.end(); ++it) {
    if (it->second < n) continue;
    const uint64_t off = it->first, len = it->second;
    c.free.erase(it);
    if (len > n) c.free.emplace(off + n, len - n);
    c.used += n;
    used_ += n;
    return c.base + off;
  }
  return nullptr;
}

void ChunkedHostAllocator::ReleaseLocked(std::map<uint8_t*, std::unique_ptr<Chunk>>::iterator it) {
  Chunk& c = *it->second;
  if (c.pinned && unpin_) unpin_(c.base, c.size);
  ::munmap(c.base, c.size);
  mapped_ -= c.size;
  if (c.pinned) pinned_ -= c.size;
  chunks_.erase(it);
}

uint8_t* ChunkedHostAllocator::Allocate(uint64_t n) {
  if (n == 0) return nullptr;
  const uint64_t want = RoundUp(n, kPage);
  const uint64_t size = std::max(RoundUp(options_.chunk_bytes, kHuge), RoundUp(want, kHuge));
  {
    absl::MutexLock lock(&mu_);
    for (auto& [base, c] : chunks_) {
      if (c->size - c->used < want) continue;
      if (uint8_t* p = TakeLocked(*c, want)) return p;
    }
    if (options_.limit_bytes > 0 && mapped_ + size > options_.limit_bytes) {
      // Give back chunks nothing uses before refusing.
      for (auto it = chunks_.begin(); it != chunks_.end() && mapped_ + size > options_.limit_bytes;) {
        auto next = std::next(it);
        if (it->second->used == 0) ReleaseLocked(it);
        it = next;
      }
      if (mapped_ + size > options_.limit_bytes) return nullptr;
    }
    mapped_ += size;  // reserved: the new chunk is mapped and pinned outside the lock
  }
  // mmap and the pin (cudaHostRegister: tens of ms per GiB) run without the
  // lock, so other I/O threads keep allocating from the existing chunks.
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  const bool pinned = p != MAP_FAILED && pin_ ? pin_(p, size) : false;
  absl::MutexLock lock(&mu_);
  if (p == MAP_FAILED) {
    mapped_ -= size;
    return nullptr;
  }
  auto c = std::make_unique<Chunk>();
  c->base = static_cast<uint8_t*>(p);
  c->size = size;
  c->pinned = pinned;
  c->free.emplace(0, size);
  if (c->pinned) pinned_ += size;
  Chunk& ref = *c;
  chunks_.emplace(c->base, std::move(c));
  return TakeLocked(ref, want);
}

void ChunkedHostAllocator::Free(uint8_t* p, uint64_t n) {
  if (p == nullptr) return;
  const uint64_t len = RoundUp(n, kPage);
  absl::MutexLock lock(&mu_);
  auto it = chunks_.upper_bound(p);
  if (it == chunks_.begin()) return;  // not ours (cannot happen)
  --it;
  Chunk& c = *it->second;
  uint64_t off = static_cast<uint64_t>(p - c.base);
  if (off >= c.size) return;
  uint64_t size = len;
  c.used -= len;
  used_ -= len;
  // Coalesce with the free neighbours.
  auto next = c.free.lower_bound(off);
  if (next != c.free.end() && next->first == off + size) {
    size += next->second;
    next = c.free.erase(next);
  }
  if (next != c.free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      off = prev->first;
      size += prev->second;
      c.free.erase(prev);
    }
  }
  c.free.emplace(off, size);
}

uint64_t ChunkedHostAllocator::pinned_bytes() const {
  absl::MutexLock lock(&mu_);
  return pinned_;
}
uint64_t ChunkedHostAllocator::mapped_bytes() const {
  absl::MutexLock lock(&mu_);
  return mapped_;
}
uint64_t ChunkedHostAllocator::used_bytes() const {
  absl::MutexLock lock(&mu_);
  return used_;
}
size_t ChunkedHostAllocator::chunks() const {
  absl::MutexLock lock(&mu_);
  return chunks_.size();
}

}  // namespace ckptd::gpu
