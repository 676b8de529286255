// Shared mappings that start on a 2 MiB boundary.
#ifndef CKPTD_CORE_BASE_ALIGNED_MAP_H_
#define CKPTD_CORE_BASE_ALIGNED_MAP_H_

#include <cstdint>

namespace ckpt {

// Maps `n` bytes of `fd` from offset 0, shared, with protection `prot`, at
// an address aligned to 2 MiB when `n` is 2 MiB or more, so that the file's
// huge pages (a collapsed cache block's, a page cache's large folios) map
// whole, one page-table entry per 2 MiB: a mapping the kernel places itself
// is aligned only where shmem THP is on. MAP_FAILED (errno set) on failure;
// munmap(p, n) unmaps it.
void* MapSharedAligned(int fd, uint64_t n, int prot);

}  // namespace ckpt

#endif  // CKPTD_CORE_BASE_ALIGNED_MAP_H_
