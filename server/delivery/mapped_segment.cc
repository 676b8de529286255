#include "server/delivery/mapped_segment.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/base/status_macros.h"
#include "proto/fd_socket.h"
#include "server/delivery/target_ranges.h"

namespace ckptd {

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

std::vector<uint64_t> PackedOffsets(const std::vector<uint64_t>& sizes, uint64_t* total) {
  std::vector<uint64_t> at(sizes.size());
  uint64_t next = 0;
  for (uint64_t align : {8, 4, 2, 1}) {
    for (size_t i = 0; i < sizes.size(); ++i) {
      const uint64_t n = sizes[i];
      // The largest of 8, 4, 2, 1 that divides n (0 counts as a multiple of 8).
      const uint64_t fits = n % 8 == 0 ? 8 : n % 4 == 0 ? 4 : n % 2 == 0 ? 2 : 1;
      if (fits != align) continue;
      at[i] = next;
      next += n;
    }
  }
  *total = next;
  return at;
}

absl::StatusOr<std::unique_ptr<MappedSegment>> MappedSegment::Map(
    int fd, uint64_t size, const std::vector<std::pair<uint64_t, uint64_t>>& used,
    const std::string& what) {
  // A segment the client could shrink would fault (SIGBUS) under our copies,
  // and a hugetlbfs or on-disk file can fault for lack of memory or space:
  // only sealed memfds on tmpfs (checked before anything else is asked of it).
  if (absl::Status sealed = CheckSealedSegment(fd, what); !sealed.ok()) {
    ::close(fd);
    return sealed;
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(what, ": fstat: ", std::strerror(errno)));
  }
  if (static_cast<uint64_t>(st.st_size) < size) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(what, " holds ", st.st_size,
                                                   " bytes but the request declares ", size));
  }
  if (size == 0) {
    ::close(fd);
    return std::unique_ptr<MappedSegment>(new MappedSegment(nullptr, 0));
  }
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": mmap: ", std::strerror(errno)));
  }
  std::unique_ptr<MappedSegment> segment(new MappedSegment(static_cast<uint8_t*>(p), size));
  // Page tables for the targets' pages up front (several times faster than
  // one fault per 4 KiB during copies), and for nothing else: MAP_POPULATE
  // would fault in every page of the mapping, holes of a sparse memfd
  // included, charged to the daemon. Adjacent ranges go in one call.
  // Without MADV_POPULATE_WRITE (before Linux 5.14) pages fault as written.
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // [begin, end) inside the mapping
  for (const auto& [offset, n] : used) {
    if (offset < size) ranges.emplace_back(offset, std::min(size, offset + n));  // CheckTargetRanges
  }
  for (const auto& [begin, end] :
       PageRuns(std::move(ranges), static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)))) {
    if (::madvise(segment->data_ + begin, end - begin, MADV_POPULATE_WRITE) != 0 &&
        errno != EINVAL) {
      // EFAULT/ENOMEM: the memfd cannot hold the pages (out of memory or
      // shmem space); the copies would die of SIGBUS.
      return absl::ResourceExhaustedError(absl::StrCat(
          what, ": cannot fault in bytes [", begin, ", ", end, "): ", std::strerror(errno)));
    }
  }
  return segment;
}

namespace {
// Unmaps client segments on a background thread: tearing down the page
// tables of a job's segments (8 x 64 MiB: ~20 ms) would otherwise delay
// the reply of the handler that drops the job last.
class Unmapper {
 public:
  static Unmapper& Get() {
    static Unmapper* u = new Unmapper;  // never destroyed: its thread outlives main
    return *u;
  }
  void Unmap(void* p, size_t n) {
    absl::MutexLock lock(&mu_);
    if (queue_.size() >= kMaxQueued) {  // behind: do it here
      ::munmap(p, n);
      return;
    }
    queue_.push_back({p, n});
  }

 private:
  static constexpr size_t kMaxQueued = 256;
  Unmapper() {
    std::thread([this] {
      while (true) {
        std::pair<void*, size_t> job;
        {
          absl::MutexLock lock(&mu_);
          mu_.Await(absl::Condition(
              +[](std::deque<std::pair<void*, size_t>>* q) { return !q->empty(); }, &queue_));
          job = queue_.front();
          queue_.pop_front();
        }
        ::munmap(job.first, job.second);
      }
    }).detach();
  }
  absl::Mutex mu_;
  std::deque<std::pair<void*, size_t>> queue_ ABSL_GUARDED_BY(mu_);
};
}  // namespace

std::unique_ptr<MappedSegment> MappedSegment::Borrow(std::shared_ptr<Arena> arena) {
  std::unique_ptr<MappedSegment> m(new MappedSegment(arena->data(), arena->size()));
  m->arena_ = std::move(arena);
  return m;
}

MappedSegment::~MappedSegment() {
  if (data_ != nullptr && arena_ == nullptr && owner_ == nullptr) {
    Unmapper::Get().Unmap(data_, size_);
  }
}

absl::StatusOr<std::unique_ptr<MappedSegment>> MappedSegment::CopyOf(
    const MappedSegment& src, const std::vector<std::pair<uint64_t, uint64_t>>& ranges,
    const std::string& what, std::vector<uint64_t>* at) {
  std::vector<uint64_t> sizes;
  sizes.reserve(ranges.size());
  for (const auto& [offset, n] : ranges) {
    if (offset > src.size() || n > src.size() - offset) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": bytes [", offset, ", ", offset + n,
                                                     ") lie outside its ", src.size(),
                                                     "-byte segment"));
    }
    sizes.push_back(n);
  }
  uint64_t size = 0;
  *at = PackedOffsets(sizes, &size);
  CKPT_ASSIGN_OR_RETURN(auto copy, Private(nullptr, size, absl::StrCat(what, ": a copy of its bytes")));
  for (size_t i = 0; i < ranges.size(); ++i) {
    if (ranges[i].second > 0) {
      std::memcpy(copy->data() + (*at)[i], src.data() + ranges[i].first, ranges[i].second);
    }
  }
  return copy;
}

absl::StatusOr<std::unique_ptr<MappedSegment>> MappedSegment::Private(
    ckpt::HostAllocator* allocator, uint64_t size, const std::string& what) {
  if (size == 0) return std::unique_ptr<MappedSegment>(new MappedSegment(nullptr, 0));
  if (allocator != nullptr) {
    if (uint8_t* p = allocator->Allocate(size)) {
      auto seg = std::unique_ptr<MappedSegment>(new MappedSegment(p, size));
      seg->owner_ = std::shared_ptr<void>(p, [allocator, size](void* q) {
        allocator->Free(static_cast<uint8_t*>(q), size);
      });
      return seg;
    }
  }
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                   -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": no memory for ", size,
                                                     " bytes: ", std::strerror(errno)));
  }
  return std::unique_ptr<MappedSegment>(new MappedSegment(static_cast<uint8_t*>(p), size));
}

}  // namespace ckptd
