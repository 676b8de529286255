// MappedSegment: memory a destination's bytes go to or come from, mapped
// into the daemon: a client's sealed memfd (shm destinations and saves), an
// arena the daemon lent (server/arena_pool.h), or the daemon's own private
// memory (the copy an asynchronous save keeps, device saves staged to host).
//
// Owned by the rank's slot for the life of its Load/Save call (or by a
// pending asynchronous save). Not thread-safe: one owner; the bytes may be
// written by several threads at once at disjoint offsets.
#ifndef CKPTD_SERVER_DELIVERY_MAPPED_SEGMENT_H_
#define CKPTD_SERVER_DELIVERY_MAPPED_SEGMENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/cache/cache.h"
#include "server/delivery/arena_pool.h"

namespace ckptd {

// Offsets that pack pieces of `sizes` bytes with no gaps, each aligned as
// its size allows (a multiple of 8 bytes at a multiple of 8, of 4 at 4, of
// 2 at 2: a tensor lands aligned to its element): the pieces whose size is
// a multiple of 8 come first, then 4, then 2, then the rest. `total` gets
// the sum of `sizes`.
std::vector<uint64_t> PackedOffsets(const std::vector<uint64_t>& sizes, uint64_t* total);

// A client's shared-memory segment mapped into the daemon.
class MappedSegment {
 public:
  // Takes ownership of `fd`; maps `size` bytes read-write and populates
  // only the pages of `used` ([offset, offset + length) each): the rest of
  // the segment (a sparse memfd's holes) is never faulted in by the daemon.
  static absl::StatusOr<std::unique_ptr<MappedSegment>> Map(
      int fd, uint64_t size, const std::vector<std::pair<uint64_t, uint64_t>>& used,
      const std::string& what);
  // An arena this daemon lent (already mapped); holds it while alive.
  static std::unique_ptr<MappedSegment> Borrow(std::shared_ptr<Arena> arena);
  // Private memory (anonymous, populated) holding a copy of `src`'s bytes
  // [offset, offset + length) for each of `ranges`, packed (PackedOffsets);
  // `at` gets each range's offset in the copy (the daemon's own copy of an
  // asynchronous save's bytes: exactly their sum, whatever the gaps in
  // `src`).
  static absl::StatusOr<std::unique_ptr<MappedSegment>> CopyOf(
      const MappedSegment& src, const std::vector<std::pair<uint64_t, uint64_t>>& ranges,
      const std::string& what, std::vector<uint64_t>* at);
  // `size` bytes of the daemon's own: from `allocator` (page-locked, when it
  // has room and is not null), else anonymous memory; not initialised.
  static absl::StatusOr<std::unique_ptr<MappedSegment>> Private(ckpt::HostAllocator* allocator,
                                                                uint64_t size,
                                                                const std::string& what);
  ~MappedSegment();
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  MappedSegment(uint8_t* data, uint64_t size) : data_(data), size_(size) {}
  uint8_t* data_;
  uint64_t size_;
  std::shared_ptr<Arena> arena_;  // set when borrowed: nothing to unmap
  std::shared_ptr<void> owner_;   // set when from an allocator: frees it
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_DELIVERY_MAPPED_SEGMENT_H_
