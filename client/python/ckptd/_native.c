/* The Python client's native copy loop (client/python/ckptd/_native.py loads
 * it with ctypes; no Python headers, so one build serves every interpreter).
 *
 * A load through cache views leaves this process to copy every byte the
 * daemon's cache holds into the rank's tensors: a list of runs, each `count`
 * pieces of `length` bytes at strides (a tensor split on dim 1 is one run of
 * `rows` pieces). numpy copies those with ordinary stores, which read every
 * destination line before writing it; here pieces of 4 KiB and more are
 * written with non-temporal stores (the destination is not read and does not
 * evict the cache), the way glibc copies only above a multi-MiB threshold.
 * Measured on the dev VM, two processes copying 512 MiB each in 16 KiB pieces
 * at once: 8.2 against 6.6 GB/s each.
 *
 * ckptd_pread_runs reads runs from a checkpoint file instead (file views:
 * bytes the cache does not hold), and ckptd_map_runs copies them out of a
 * mapping of the file where its page cache maps whole 2 MiB pages.
 *
 * The caller has checked every run against its source mapping or file and
 * its destination tensor (_views.copy_views); this file trusts them.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

struct ckptd_run {
  uint64_t dst, src, length, count, dst_stride, src_stride;
};

enum { kStreamMin = 4096 };

#if defined(__x86_64__)
/* n a multiple of 64, d 64-byte aligned. SSE2 is part of x86-64. */
static void stream_sse2(uint8_t* d, const uint8_t* s, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    __m128i a = _mm_loadu_si128((const __m128i*)(s + i));
    __m128i b = _mm_loadu_si128((const __m128i*)(s + i + 16));
    __m128i c = _mm_loadu_si128((const __m128i*)(s + i + 32));
    __m128i e = _mm_loadu_si128((const __m128i*)(s + i + 48));
    _mm_stream_si128((__m128i*)(d + i), a);
    _mm_stream_si128((__m128i*)(d + i + 16), b);
    _mm_stream_si128((__m128i*)(d + i + 32), c);
    _mm_stream_si128((__m128i*)(d + i + 48), e);
  }
}

__attribute__((target("avx2"))) static void stream_avx2(uint8_t* d, const uint8_t* s, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    __m256i a = _mm256_loadu_si256((const __m256i*)(s + i));
    __m256i b = _mm256_loadu_si256((const __m256i*)(s + i + 32));
    _mm256_stream_si256((__m256i*)(d + i), a);
    _mm256_stream_si256((__m256i*)(d + i + 32), b);
  }
}

typedef void (*stream_fn)(uint8_t*, const uint8_t*, size_t);

/* One piece: head up to a 64-byte aligned destination and the tail by
 * memcpy, the body streamed. */
static void stream_piece(stream_fn stream_body, uint8_t* d, const uint8_t* s, size_t n) {
  size_t head = (size_t)(-(uintptr_t)d & 63);
  memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  size_t body = n & ~(size_t)63;
  stream_body(d, s, body);
  memcpy(d + body, s + body, n - body);
}
#endif

/* Copies pieces: those of kStreamMin bytes and more with streaming stores
 * (AVX2 where the CPU has it), shorter ones with memcpy; copier_done makes
 * the streamed stores visible. */
struct copier {
#if defined(__x86_64__)
  stream_fn body;
#endif
  int streamed;
};

static void copier_init(struct copier* c) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  c->body = __builtin_cpu_supports("avx2") ? stream_avx2 : stream_sse2;
#endif
  c->streamed = 0;
}

static void copier_copy(struct copier* c, uint8_t* d, const uint8_t* s, size_t n) {
#if defined(__x86_64__)
  if (n >= kStreamMin) {
    stream_piece(c->body, d, s, n);
    c->streamed = 1;
    return;
  }
#endif
  memcpy(d, s, n);
}

static void copier_done(const struct copier* c) {
#if defined(__x86_64__)
  if (c->streamed) _mm_sfence();
#else
  (void)c;
#endif
}

/* Copies every run, each piece's source at run->src + base (the runs'
 * src are addresses when base is 0, file offsets into a mapping at base);
 * returns the bytes copied. */
static uint64_t copy_runs_at(const struct ckptd_run* runs, uint64_t n, uintptr_t base) {
  uint64_t total = 0;
  struct copier c;
  copier_init(&c);
  for (uint64_t r = 0; r < n; ++r) {
    const struct ckptd_run* run = &runs[r];
    uint8_t* d = (uint8_t*)(uintptr_t)run->dst;
    const uint8_t* s = (const uint8_t*)(uintptr_t)(run->src + base);
    for (uint64_t i = 0; i < run->count; ++i) {
      copier_copy(&c, d, s, run->length);
      d += run->dst_stride;
      s += run->src_stride;
    }
    total += run->length * run->count;
  }
  copier_done(&c); /* the stores visible before we return */
  return total;
}

/* Copies every run; returns the bytes copied. */
uint64_t ckptd_copy_runs(const struct ckptd_run* runs, uint64_t n) {
  return copy_runs_at(runs, n, 0);
}

/* SIGBUS while copying out of a file mapping (the file was truncated under
 * it) ends that copy with -ENODATA instead of the process: a handler of our
 * own is installed while any thread copies so (the one before it is put
 * back after the last), and jumps back to the copy of the faulting thread;
 * a SIGBUS of any other thread goes to the handler before ours. */
static pthread_mutex_t bus_mu = PTHREAD_MUTEX_INITIALIZER;
static int bus_users;
static struct sigaction bus_before;
/* initial-exec: read in the signal handler without __tls_get_addr. */
static __thread __attribute__((tls_model("initial-exec"))) sigjmp_buf* bus_jump;

static void on_sigbus(int sig, siginfo_t* info, void* uc) {
  sigjmp_buf* jump = bus_jump;
  if (jump != NULL) siglongjmp(*jump, 1);
  if (bus_before.sa_flags & SA_SIGINFO) {
    if (bus_before.sa_sigaction != NULL) bus_before.sa_sigaction(sig, info, uc);
  } else if (bus_before.sa_handler != SIG_DFL && bus_before.sa_handler != SIG_IGN) {
    bus_before.sa_handler(sig);
  } else {
    /* Not ours and no handler: the default action once the fault repeats. */
    sigaction(SIGBUS, &bus_before, NULL);
  }
}

static int bus_guard(int on) {
  int rc = 0;
  pthread_mutex_lock(&bus_mu);
  if (on && bus_users++ == 0) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &bus_before) != 0) {
      --bus_users;
      rc = -errno;
    }
  } else if (!on && --bus_users == 0) {
    sigaction(SIGBUS, &bus_before, NULL);
  }
  pthread_mutex_unlock(&bus_mu);
  return rc;
}

enum { kHuge = 2 << 20, kMapMin = 4 << 20, kAround = 64 << 10 };

static uint64_t minor_faults(uint64_t* major) {
  struct rusage ru;
  if (getrusage(RUSAGE_THREAD, &ru) != 0) {
    *major = UINT64_MAX; /* unknown: the block is read with pread */
    return 0;
  }
  *major = (uint64_t)ru.ru_majflt;
  return (uint64_t)ru.ru_minflt;
}

/* pread of `n` bytes at file offset `at` into `d`: 0, -errno, or -ENODATA
 * when the file ends first. */
static int64_t pread_all(int fd, uint8_t* d, uint64_t n, uint64_t at) {
  while (n > 0) {
    ssize_t got = pread(fd, d, n, (off_t)at);
    if (got < 0) {
      if (errno == EINTR) continue;
      return -(int64_t)errno;
    }
    if (got == 0) return -(int64_t)ENODATA;
    d += got;
    at += (uint64_t)got;
    n -= (uint64_t)got;
  }
  return 0;
}

/* A 2 MiB block of the file the runs read from: the first and one past the
 * last byte they need in it (offsets in the block; first > last: none), and
 * whether the copy maps it. */
struct block {
  uint32_t first, last;
  uint8_t mapped;
};

/* Marks the bytes [at, at + n) of the file (offsets from `start`) needed. */
static void need(struct block* blocks, uint64_t at, uint64_t n) {
  while (n > 0) {
    const uint64_t b = at / kHuge, in = at % kHuge;
    const uint64_t take = (kHuge - in < n) ? kHuge - in : n;
    if (in < blocks[b].first) blocks[b].first = (uint32_t)in;
    if (in + take > blocks[b].last) blocks[b].last = (uint32_t)(in + take);
    at += take;
    n -= take;
  }
}

/* Copies every run (src: the file offset of piece 0) out of a read-only
 * shared mapping of file `fd` made on a 2 MiB boundary (file offset and
 * address alike) where the page cache holds the bytes in 2 MiB folios
 * (large folios of ext4 and XFS on recent kernels), and with pread where it
 * does not. In a 2 MiB folio, touching the mapping takes one page fault for
 * the 2 MiB and the copy then runs at memcpy speed, against one pread per
 * piece (a tensor split on another dimension: one per row); in 4 KiB or
 * small folios the mapping faults every 64 KiB (fault-around) and pread is
 * faster. A file holds both where parts of it were written or read back in
 * different sizes, so each 2 MiB block the runs need is probed on its own:
 * two bytes the runs need, 64 KiB or more apart, one page fault for both
 * and none major maps it. Returns 0 when copied, 1 when no block maps
 * (nothing copied: read them with ckptd_pread_runs), -errno on an error,
 * -ENODATA when the file ended under the mapping (SIGBUS) or before a piece
 * (it changed since the load began). */
int64_t ckptd_map_runs(int fd, const struct ckptd_run* runs, uint64_t n) {
  uint64_t lo = UINT64_MAX, hi = 0;
  for (uint64_t r = 0; r < n; ++r) {
    const struct ckptd_run* run = &runs[r];
    if (run->count == 0 || run->length == 0) continue;
    const uint64_t end = run->src + (run->count - 1) * run->src_stride + run->length;
    if (run->src < lo) lo = run->src;
    if (end > hi) hi = end;
  }
  if (hi <= lo || hi - lo < kMapMin) return 1;
  const uint64_t start = lo & ~(uint64_t)(kHuge - 1);
  const uint64_t nblocks = (hi - start + kHuge - 1) / kHuge;
  struct block* blocks = calloc(nblocks, sizeof *blocks);
  if (blocks == NULL) return 1;
  for (uint64_t b = 0; b < nblocks; ++b) blocks[b].first = kHuge;
  for (uint64_t r = 0; r < n; ++r) {
    const struct ckptd_run* run = &runs[r];
    for (uint64_t i = 0; i < run->count && run->length > 0; ++i)
      need(blocks, run->src + i * run->src_stride - start, run->length);
  }
  /* Mapped whole 2 MiB blocks only: not past the file's end (a folio there
   * is smaller), so the last block may be read with pread. */
  struct stat st;
  uint64_t file_end = hi;
  if (fstat(fd, &st) == 0 && (uint64_t)st.st_size > file_end) file_end = (uint64_t)st.st_size;
  uint64_t whole = (file_end - start) / kHuge;
  if (whole > nblocks) whole = nblocks;
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  size_t len = (size_t)((hi - start + page - 1) / page * page);
  if (whole * kHuge > len) len = (size_t)(whole * kHuge);
  const size_t span = len + kHuge;
  void* r = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r == MAP_FAILED) {
    free(blocks);
    return 1;
  }
  const uintptr_t base = (uintptr_t)r;
  const uintptr_t at = (base + kHuge - 1) & ~(uintptr_t)(kHuge - 1);
  if (mmap((void*)at, len, PROT_READ, MAP_SHARED | MAP_FIXED, fd, (off_t)start) == MAP_FAILED) {
    munmap(r, span);
    free(blocks);
    return 1;
  }
  if (at > base) munmap(r, at - base);
  if (base + span > at + len) munmap((void*)(at + len), base + span - (at + len));
  if (bus_guard(1) != 0) {
    munmap((void*)at, len);
    free(blocks);
    return 1;
  }
  sigjmp_buf jump;
  volatile int64_t result = 1;
  if (sigsetjmp(jump, 1) == 0) {
    bus_jump = &jump;
    uint64_t mapped = 0, major_before;
    (void)minor_faults(&major_before);
    for (uint64_t b = 0; b < whole; ++b) {
      struct block* k = &blocks[b];
      if (k->first >= k->last || k->first / kAround == (k->last - 1) / kAround) continue;
      const volatile uint8_t* w = (const volatile uint8_t*)(at + b * kHuge);
      uint64_t major0, major1;
      (void)w[k->first];
      const uint64_t minor0 = minor_faults(&major0);
      (void)w[k->last - 1];
      const uint64_t minor1 = minor_faults(&major1);
      k->mapped = major_before == major1 && major1 != UINT64_MAX && minor1 == minor0;
      major_before = major1;
      mapped += k->mapped;
    }
    if (mapped > 0) {
      int64_t rc = 0;
      struct copier c;
      copier_init(&c);
      for (uint64_t q = 0; q < n && rc == 0; ++q) {
        const struct ckptd_run* run = &runs[q];
        for (uint64_t i = 0; i < run->count && run->length > 0 && rc == 0; ++i) {
          uint8_t* d = (uint8_t*)(uintptr_t)(run->dst + i * run->dst_stride);
          uint64_t off = run->src + i * run->src_stride - start, left = run->length;
          while (left > 0 && rc == 0) {
            /* The bytes from `off` in blocks read the same way. */
            const uint8_t how = blocks[off / kHuge].mapped;
            uint64_t take = kHuge - off % kHuge;
            while (take < left && blocks[(off + take) / kHuge].mapped == how) take += kHuge;
            if (take > left) take = left;
            if (how) {
              copier_copy(&c, d, (const uint8_t*)(at + off), take);
            } else {
              rc = pread_all(fd, d, take, start + off);
            }
            d += take;
            off += take;
            left -= take;
          }
        }
      }
      copier_done(&c);
      result = rc;
    }
  } else {
    result = -(int64_t)ENODATA;
  }
  bus_jump = NULL;
  bus_guard(0);
  munmap((void*)at, len);
  free(blocks);
  return result;
}

/* Reads every run from file `fd` (src: the file offset of piece 0) with
 * pread: the bytes of a load the daemon's cache does not hold, read by the
 * client itself (file views). Returns 0, -errno on an error, or -ENODATA
 * when the file ends before a piece does (it changed since the load began). */
int64_t ckptd_pread_runs(int fd, const struct ckptd_run* runs, uint64_t n) {
  for (uint64_t r = 0; r < n; ++r) {
    const struct ckptd_run* run = &runs[r];
    for (uint64_t i = 0; i < run->count; ++i) {
      const int64_t rc = pread_all(fd, (uint8_t*)(uintptr_t)(run->dst + i * run->dst_stride),
                                   run->length, run->src + i * run->src_stride);
      if (rc != 0) return rc;
    }
  }
  return 0;
}
