#include "core/base/aligned_map.h"

#include <errno.h>
#include <sys/mman.h>
#include <unistd.h>

namespace ckpt {

namespace {
constexpr uint64_t kHugePage = 2 << 20;
}  // namespace

void* MapSharedAligned(int fd, uint64_t n, int prot) {
  if (n < kHugePage) return ::mmap(nullptr, n, prot, MAP_SHARED, fd, 0);
  // Address space for n + 2 MiB, the file mapped over its aligned part, the
  // rest given back.
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t span = n + kHugePage;
  void* r = ::mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r == MAP_FAILED) return MAP_FAILED;
  const uintptr_t base = reinterpret_cast<uintptr_t>(r);
  const uintptr_t at = (base + kHugePage - 1) & ~(kHugePage - 1);
  void* p = ::mmap(reinterpret_cast<void*>(at), n, prot, MAP_SHARED | MAP_FIXED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    ::munmap(r, span);
    errno = err;
    return MAP_FAILED;
  }
  if (at > base) ::munmap(r, at - base);
  const uintptr_t end = at + (n + page - 1) / page * page;
  if (base + span > end) ::munmap(reinterpret_cast<void*>(end), base + span - end);
  return p;
}

}  // namespace ckpt
