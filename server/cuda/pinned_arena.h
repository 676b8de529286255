// Page-locked host memory for the data cache, carved out of large chunks.
//
// HostCache (core/cache/cache.h) allocates one buffer per cached read. Pinning
// (cudaHostRegister) costs time per call, so this allocator maps chunks of
// `chunk_bytes` lazily, on the first allocation that needs room, pins each
// chunk once, and hands out page-aligned pieces (first fit, coalescing
// frees). Start-up pins nothing. Past `limit_bytes` of chunks it returns
// nullptr and the cache falls back to ordinary memory. The pin/unpin
// functions are injected (server/cuda provides cudaHostRegister), so the
// logic is plain C++ and tested without a GPU. Thread-safe; a new chunk is
// mapped and pinned outside the lock (other threads keep allocating).
#ifndef CKPTD_SERVER_CUDA_PINNED_ARENA_H_
#define CKPTD_SERVER_CUDA_PINNED_ARENA_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/cache/cache.h"

namespace ckptd::gpu {

class ChunkedHostAllocator final : public ckpt::HostAllocator {
 public:
  struct Options {
    uint64_t chunk_bytes = 256ull << 20;
    uint64_t limit_bytes = 0;  // 0: no limit
  };
  // `pin` returns whether the range is now page-locked; a chunk it fails on
  // is still used, unpinned.
  using PinFn = std::function<bool(void*, uint64_t)>;
  using UnpinFn = std::function<void(void*, uint64_t)>;

  ChunkedHostAllocator(Options options, PinFn pin, UnpinFn unpin);
  // Every allocation must have been freed.
  ~ChunkedHostAllocator() override;

  uint8_t* Allocate(uint64_t n) override;
  void Free(uint8_t* p, uint64_t n) override;

  uint64_t pinned_bytes() const;  // bytes of pinned chunks
  uint64_t mapped_bytes() const;  // bytes of all chunks
  uint64_t used_bytes() const;    // bytes handed out (page-rounded)
  size_t chunks() const;

 private:
  struct Chunk {
    uint8_t* base = nullptr;
    uint64_t size = 0;
    bool pinned = false;
    uint64_t used = 0;
    std::map<uint64_t, uint64_t> free;  // offset -> length
  };
  uint8_t* TakeLocked(Chunk& c, uint64_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseLocked(std::map<uint8_t*, std::unique_ptr<Chunk>>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  const PinFn pin_;
  const UnpinFn unpin_;
  mutable absl::Mutex mu_;
  std::map<uint8_t*, std::unique_ptr<Chunk>> chunks_ ABSL_GUARDED_BY(mu_);  // by base
  uint64_t mapped_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t pinned_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ckptd::gpu

#endif  // CKPTD_SERVER_CUDA_PINNED_ARENA_H_
