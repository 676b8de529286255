// Test-only fault injection at the I/O layer, preloaded into a real ckptd or
// ckptctl process (LD_PRELOAD=libfault_shim.so). Every file read, write and
// fsync of the engine goes through pread/write/fsync (core/io/file.cc); this
// shim wraps them and, for files whose path contains a pattern, fails them
// as a bad disk, a full disk or a racing writer would.
//
// $CKPTD_FAULT: one rule "OP:PATTERN[:ARG]", OP one of
//   pread-eio:PAT:N     pread of a byte at offset >= N fails with EIO
//   pread-short:PAT:N   every pread returns at most N bytes (short reads)
//   pread-truncate:PAT:N  the first pread at offset >= N truncates the file
//                       to N bytes first (the file shrinks mid-read)
//   write-enospc:PAT:N  write past N bytes of the file fails with ENOSPC
//   write-eio:PAT:N     write past N bytes fails with EIO
//   fsync-eio:PAT       fsync fails with EIO
// $CKPTD_FAULT_TIMES (default: unlimited): how many faults to inject; then
// the process runs clean (a daemon serves the next request).
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <string>

namespace {

struct Rule {
  std::string op, pattern;
  uint64_t arg = 0;
  bool active = false;
};

const Rule& TheRule() {
  static const Rule rule = [] {
    Rule r;
    const char* spec = getenv("CKPTD_FAULT");
    if (spec == nullptr || *spec == '\0') return r;
    std::string s(spec);
    const size_t a = s.find(':');
    if (a == std::string::npos) return r;
    r.op = s.substr(0, a);
    const size_t b = s.find(':', a + 1);
    r.pattern = s.substr(a + 1, b == std::string::npos ? std::string::npos : b - a - 1);
    if (b != std::string::npos) r.arg = strtoull(s.c_str() + b + 1, nullptr, 10);
    r.active = !r.pattern.empty();
    return r;
  }();
  return rule;
}

std::atomic<long> g_left{-2};  // -2: not read yet; -1: unlimited

// Whether one more fault may be injected (and count it).
bool TakeFault() {
  long left = g_left.load();
  if (left == -2) {
    const char* t = getenv("CKPTD_FAULT_TIMES");
    long want = t != nullptr ? strtol(t, nullptr, 10) : -1;
    g_left.compare_exchange_strong(left, want);
    left = g_left.load();
  }
  while (true) {
    if (left == -1) return true;
    if (left <= 0) return false;
    if (g_left.compare_exchange_weak(left, left - 1)) return true;
  }
}

bool Matches(int fd, const char* op_prefix) {
  const Rule& r = TheRule();
  if (!r.active || r.op.rfind(op_prefix, 0) != 0) return false;
  char link[64], path[4096];
  snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(link, path, sizeof(path) - 1);
  if (n <= 0) return false;
  path[n] = '\0';
  return strstr(path, r.pattern.c_str()) != nullptr;
}

template <typename F>
F Real(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_NEXT, name));
}

ssize_t FaultyPread(ssize_t (*real)(int, void*, size_t, off_t), int fd, void* buf, size_t n,
                    off_t off) {
  if (Matches(fd, "pread")) {
    const Rule& r = TheRule();
    const uint64_t end = static_cast<uint64_t>(off) + n;
    if (r.op == "pread-eio" && end > r.arg && TakeFault()) {
      errno = EIO;
      return -1;
    }
    if (r.op == "pread-short" && n > r.arg && r.arg > 0 && TakeFault()) n = r.arg;
    if (r.op == "pread-truncate" && end > r.arg && TakeFault()) {
      if (ftruncate(fd, static_cast<off_t>(r.arg)) != 0) {
        // Read-only descriptor: truncate through the path.
        char link[64], path[4096];
        snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
        const ssize_t m = readlink(link, path, sizeof(path) - 1);
        if (m > 0) {
          path[m] = '\0';
          if (truncate(path, static_cast<off_t>(r.arg)) != 0) perror("fault_shim: truncate");
        }
      }
    }
  }
  return real(fd, buf, n, off);
}

}  // namespace

extern "C" {

ssize_t pread(int fd, void* buf, size_t n, off_t off) {
  static auto real = Real<ssize_t (*)(int, void*, size_t, off_t)>("pread");
  return FaultyPread(real, fd, buf, n, off);
}

ssize_t pread64(int fd, void* buf, size_t n, off_t off) {
  static auto real = Real<ssize_t (*)(int, void*, size_t, off_t)>("pread64");
  return FaultyPread(real, fd, buf, n, off);
}

ssize_t write(int fd, const void* buf, size_t n) {
  static auto real = Real<ssize_t (*)(int, const void*, size_t)>("write");
  if (Matches(fd, "write")) {
    const Rule& r = TheRule();
    const off_t pos = lseek(fd, 0, SEEK_CUR);
    if (pos >= 0 && static_cast<uint64_t>(pos) + n > r.arg && TakeFault()) {
      errno = r.op == "write-enospc" ? ENOSPC : EIO;
      return -1;
    }
  }
  return real(fd, buf, n);
}

int fsync(int fd) {
  static auto real = Real<int (*)(int)>("fsync");
  if (Matches(fd, "fsync") && TakeFault()) {
    errno = EIO;
    return -1;
  }
  return real(fd);
}

int fdatasync(int fd) {
  static auto real = Real<int (*)(int)>("fdatasync");
  if (Matches(fd, "fsync") && TakeFault()) {
    errno = EIO;
    return -1;
  }
  return real(fd);
}

}  // extern "C"
