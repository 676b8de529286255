#include "core/io/file_posix.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/openat2.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace ckpt {
namespace {

absl::Status ErrnoError(int err, absl::string_view what, absl::string_view path) {
  std::string msg = absl::StrCat(path, ": ", what, ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(msg);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  // A full disk or quota: the caller may free space and retry.
  if (err == ENOSPC || err == EDQUOT) return absl::ResourceExhaustedError(msg);
  // The device failed the I/O: those bytes could not be read or kept.
  if (err == EIO) return absl::DataLossError(msg);
  return absl::InternalError(msg);
}

FileStamp FromStat(const struct stat& st) {
  FileStamp s;
  s.dev = st.st_dev;
  s.ino = st.st_ino;
  s.size = static_cast<uint64_t>(st.st_size);
  s.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  s.ctime_ns = static_cast<int64_t>(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec;
  s.has_owner = true;
  s.mode = static_cast<uint32_t>(st.st_mode & 07777);
  s.uid = st.st_uid;
  s.gid = st.st_gid;
  return s;
}

// "a FIFO", "a directory", ... for a file type from st_mode.
const char* KindOf(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

// pread until `n` bytes, the end of the file, or an error (EINTR retried):
// the bytes read, and errno of the failing call (0: none).
struct Preads {
  uint64_t done = 0;
  int err = 0;
};
Preads PreadAll(int fd, uint64_t offset, uint64_t n, void* dst) {
  Preads r;
  char* p = static_cast<char*>(dst);
  while (r.done < n) {
    const ssize_t got = ::pread(fd, p + r.done, n - r.done, static_cast<off_t>(offset + r.done));
    if (got < 0) {
      if (errno == EINTR) continue;
      r.err = errno;
      break;
    }
    if (got == 0) break;  // end of file
    r.done += static_cast<uint64_t>(got);
  }
  return r;
}

class PosixFile final : public RandomAccessFile {
 public:
  PosixFile(std::string path, int fd, uint64_t size)
      : path_(std::move(path)), fd_(fd), size_(size) {}
  ~PosixFile() override {
    ::close(fd_);
    if (direct_fd_ >= 0) ::close(direct_fd_);
  }

  const std::string& path() const override { return path_; }
  uint64_t size() const override { return size_; }

  absl::Status Read(uint64_t offset, uint64_t n, void* dst) const override {
    if (offset > size_ || n > size_ - offset) {
      return absl::OutOfRangeError(absl::StrCat(path_, ": truncated: need bytes [", offset, ", ",
                                                offset + n, ") but the file has ", size_,
                                                " bytes"));
    }
    const Preads r = PreadAll(fd_, offset, n, dst);
    if (r.err != 0) return ErrnoError(r.err, absl::StrCat("pread at ", offset + r.done), path_);
    if (r.done < n) {
      return absl::OutOfRangeError(
          absl::StrCat(path_, ": truncated while reading at offset ", offset + r.done));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<uint64_t> ReadDirect(uint64_t offset, uint64_t n, void* dst) const override {
    const int dfd = DirectFd();
    if (dfd < 0) return RandomAccessFile::ReadDirect(offset, n, dst);
    const Preads r = PreadAll(dfd, offset, n, dst);
    if (r.err == EINVAL && r.done == 0) return RandomAccessFile::ReadDirect(offset, n, dst);
    if (r.err != 0) {
      return ErrnoError(r.err, absl::StrCat("pread (O_DIRECT) at ", offset + r.done), path_);
    }
    if (r.done < n && offset + r.done < size_) {  // short of the end it had when opened
      return absl::OutOfRangeError(
          absl::StrCat(path_, ": truncated while reading at offset ", offset + r.done));
    }
    return r.done;
  }

  bool Cached(uint64_t offset, uint64_t n) const override {
#ifdef RWF_NOWAIT
    // A buffered read with RWF_NOWAIT fails with EAGAIN unless the page is
    // in the page cache: probe the first, middle and last page. (The kernel
    // starts readahead of a page it did not find: a probe of an uncached
    // range reads a little of it in.)
    char byte;
    for (uint64_t at : {offset, offset + n / 2, offset + (n > 0 ? n - 1 : 0)}) {
      if (at >= size_) continue;
      iovec iov{&byte, 1};
      const ssize_t r = ::preadv2(fd_, &iov, 1, static_cast<off_t>(at), RWF_NOWAIT);
      if (r == 1) continue;
      return !(r < 0 && errno == EAGAIN);
    }
#endif
    return true;
  }

  absl::StatusOr<FileStamp> Stamp() const override { return StatFd(fd_, path_); }

  absl::StatusOr<int> ShareReadOnly() const override {
    // Through /proc/self/fd/N: the inode `fd_` holds, never the path again,
    // with an open file description of its own (no flags shared with ours);
    // where /proc is missing, a duplicate (the same description).
    const int fd = ReopenSelf(O_RDONLY | O_CLOEXEC | O_NOCTTY);
    if (fd >= 0) return fd;
    const int dup = ::fcntl(fd_, F_DUPFD_CLOEXEC, 0);
    if (dup < 0) return ErrnoError(errno, "sharing its descriptor", path_);
    return dup;
  }

 private:
  // A second descriptor with O_DIRECT, opened on first use; -1 where the
  // file system refuses it. It is opened through /proc/self/fd/N, i.e. the
  // very inode `fd_` holds (never the path again: the path may have been
  // swapped for a symlink since), and checked to be that inode.
  int DirectFd() const {
    std::call_once(direct_once_,
                   [this] { direct_fd_ = ReopenSelf(O_RDONLY | O_CLOEXEC | O_DIRECT | O_NOCTTY); });
    return direct_fd_;
  }

  // A new open file description of the inode `fd_` holds, with `flags`,
  // through /proc/self/fd/N (never the path again) and checked to be that
  // inode; -1 where it cannot be opened so.
  int ReopenSelf(int flags) const {
    const int fd = ::open(absl::StrCat("/proc/self/fd/", fd_).c_str(), flags);
    if (fd < 0) return -1;
    struct stat a, b;
    if (::fstat(fd_, &a) != 0 || ::fstat(fd, &b) != 0 || a.st_dev != b.st_dev ||
        a.st_ino != b.st_ino) {
      ::close(fd);
      return -1;
    }
    return fd;
  }

  std::string path_;
  int fd_;
  uint64_t size_;
  mutable std::once_flag direct_once_;
  mutable int direct_fd_ = -1;
};

std::atomic<bool> g_openat2_disabled{false};  // tests
// Set once openat2 turned out to be missing (ENOSYS) or filtered (EPERM from
// a seccomp profile that predates it): later opens go straight to the walk.
std::atomic<bool> g_openat2_missing{false};

constexpr int kReadFlags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY;

int SysOpenat2(int dirfd, const char* name, int flags, uint64_t resolve) {
  if (g_openat2_disabled.load(std::memory_order_relaxed) ||
      g_openat2_missing.load(std::memory_order_relaxed)) {
    errno = ENOSYS;
    return -1;
  }
  struct open_how how;
  std::memset(&how, 0, sizeof how);
  how.flags = static_cast<uint64_t>(flags);
  how.resolve = resolve;
  long r;
  do {
    r = ::syscall(SYS_openat2, dirfd, name, &how, sizeof how);
  } while (r < 0 && errno == EINTR);
  if (r < 0 && errno == ENOSYS) g_openat2_missing = true;
  return static_cast<int>(r);
}

int OpenatRetry(int dirfd, const char* name, int flags) {
  int fd;
  do {
    fd = ::openat(dirfd, name, flags);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// Why an open of `name` under `dirfd` failed with `err`, as a status naming
// `path`: with `confine`, the first component of `name` that is a symlink;
// what the file is when it is no regular file (a socket gives ENXIO).
absl::Status DescribeRefusal(int dirfd, const std::string& dir, const std::string& name,
                             const std::string& path, int err, bool confine) {
  if (confine && err == EXDEV) {
    return absl::PermissionDeniedError(
        absl::StrCat(path, ": resolves outside the checkpoint directory ", dir));
  }
  if (!confine) {
    struct stat st;
    if (err != ENOENT && ::fstatat(dirfd, name.c_str(), &st, 0) == 0 && !S_ISREG(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, ": is ", KindOf(st.st_mode), ", not a regular file"));
    }
    return ErrnoError(err, "open", path);
  }
  if (err != ENOENT && err != EACCES) {
    // The first component that is a symlink (prefixes in order: one found is
    // the first, since the shorter prefixes were not symlinks).
    std::string prefix;
    for (absl::string_view c : absl::StrSplit(name, '/', absl::SkipEmpty())) {
      if (!prefix.empty()) prefix += '/';
      prefix.append(c.data(), c.size());
      struct stat st;
      if (::fstatat(dirfd, prefix.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) break;
      const bool last = prefix.size() == name.size();
      if (S_ISLNK(st.st_mode)) {
        if (last) {
          return absl::PermissionDeniedError(absl::StrCat(
              path, ": is a symbolic link (files of a checkpoint must be regular files "
                    "inside its directory; symlinks are not followed)"));
        }
        return absl::PermissionDeniedError(absl::StrCat(
            path, ": its path component '", prefix,
            "' is a symbolic link (symlinks inside a checkpoint directory are not followed)"));
      }
      if (last && !S_ISREG(st.st_mode)) {
        return absl::FailedPreconditionError(
            absl::StrCat(path, ": is ", KindOf(st.st_mode), ", not a regular file"));
      }
    }
  }
  return ErrnoError(err, "open", path);
}

// Opens `name` beneath `dirfd` component by component with O_NOFOLLOW (for
// kernels without openat2). Returns the fd or -1 with errno set (ELOOP /
// ENOTDIR for a symlink, EXDEV for "..", "." or an absolute name).
int WalkBeneath(int dirfd, const std::string& name, int last_flags) {
  if (name.empty() || name[0] == '/') {
    errno = EXDEV;
    return -1;
  }
  std::vector<std::string> parts = absl::StrSplit(name, '/', absl::SkipEmpty());
  if (parts.empty()) {
    errno = EXDEV;
    return -1;
  }
  for (const std::string& c : parts) {
    if (c == "." || c == "..") {
      errno = EXDEV;
      return -1;
    }
  }
  int cur = dirfd;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    const int next =
        OpenatRetry(cur, parts[i].c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    const int err = errno;
    if (cur != dirfd) ::close(cur);
    if (next < 0) {
      errno = err;
      return -1;
    }
    cur = next;
  }
  const int fd = OpenatRetry(cur, parts.back().c_str(), last_flags | O_NOFOLLOW);
  const int err = errno;
  if (cur != dirfd) ::close(cur);
  errno = err;
  return fd;
}

// The confined or plain open of `name` under `dirfd` with `flags`; -1 and
// errno on failure.
int OpenRaw(int dirfd, const std::string& name, bool confine, int flags) {
  if (!confine) return OpenatRetry(dirfd, name.c_str(), flags);
  const int fd = SysOpenat2(dirfd, name.c_str(), flags, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS);
  if (fd >= 0) return fd;
  // ENOSYS: a kernel before 5.6. EPERM: for these flags only a seccomp
  // filter (older container runtimes deny syscalls they do not know) or an
  // LSM says it; the walk is as strict, and an LSM denial repeats there.
  if (errno != ENOSYS && errno != EPERM) return fd;
  return WalkBeneath(dirfd, name, flags);
}


// A file being written beside its final name (file.h: AtomicFileWriter).
class PosixAtomicFileWriter final : public AtomicFileWriter {
 public:
  PosixAtomicFileWriter(std::shared_ptr<const Directory> dir, int dirfd, std::string name,
                        std::string tmp, int fd)
      : dir_(std::move(dir)), dirfd_(dirfd), name_(std::move(name)), tmp_(std::move(tmp)),
        fd_(fd) {
    path_ = JoinPath(dir_->path(), name_);
  }
  ~PosixAtomicFileWriter() override {
    if (!committed_) {
      if (fd_ >= 0) ::close(fd_);
      ::unlinkat(dirfd_, tmp_.c_str(), 0);
    }
  }

  absl::Status Append(const void* data, size_t n) override {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      ssize_t w = ::write(fd_, p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        return ErrnoError(errno, "write", JoinPath(dir_->path(), tmp_));
      }
      p += w;
      n -= static_cast<size_t>(w);
      written_ += static_cast<uint64_t>(w);
    }
    return absl::OkStatus();
  }

  absl::Status WriteAt(uint64_t offset, const void* data, size_t n) override {
    if (offset > written_ || n > written_ - offset) {
      return absl::InternalError(absl::StrCat(JoinPath(dir_->path(), tmp_), ": WriteAt ", offset,
                                              "+", n, " past the ", written_, " bytes written"));
    }
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      ssize_t w = ::pwrite(fd_, p, n, static_cast<off_t>(offset));
      if (w < 0) {
        if (errno == EINTR) continue;
        return ErrnoError(errno, "pwrite", JoinPath(dir_->path(), tmp_));
      }
      p += w;
      n -= static_cast<size_t>(w);
      offset += static_cast<uint64_t>(w);
    }
    return absl::OkStatus();
  }

  uint64_t bytes_written() const override { return written_; }
  const std::string& path() const override { return path_; }

  absl::Status Commit(bool sync) override {
    const std::string tmp_path = JoinPath(dir_->path(), tmp_);
    if (sync && ::fsync(fd_) != 0) return ErrnoError(errno, "fsync", tmp_path);
    if (::close(fd_) != 0) {
      fd_ = -1;
      return ErrnoError(errno, "close", tmp_path);
    }
    fd_ = -1;
    if (::renameat(dirfd_, tmp_.c_str(), dirfd_, name_.c_str()) != 0) {
      return ErrnoError(errno, "rename", path_);
    }
    committed_ = true;
    if (sync) return dir_->Sync();
    return absl::OkStatus();
  }

 private:
  std::shared_ptr<const Directory> dir_;  // keeps dirfd_ open
  const int dirfd_;
  std::string name_, tmp_, path_;
  int fd_;
  uint64_t written_ = 0;
  bool committed_ = false;
};

// A directory held open by its descriptor (O_DIRECTORY).
class PosixDirectory final : public Directory {
 public:
  PosixDirectory(std::string path, int fd, bool confine)
      : Directory(std::move(path), confine), fd_(fd) {}
  ~PosixDirectory() override { ::close(fd_); }
  int fd() const { return fd_; }

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFile(
      const std::string& name) const override {
    return OpenFileAt(fd_, path(), name, confine());
  }

  absl::StatusOr<FileStamp> Stat(const std::string& name) const override {
    const std::string p = JoinPath(path(), name);
    const int fd = OpenRaw(fd_, name, confine(), O_PATH | O_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      if (err == ENOENT) return ErrnoError(err, "stat", p);
      return DescribeRefusal(fd_, path(), name, p, err, confine());
    }
    struct stat st;
    const int r = ::fstat(fd, &st);
    const int err = errno;
    ::close(fd);
    if (r != 0) return ErrnoError(err, "fstat", p);
    // (The O_NOFOLLOW walk gives an O_PATH descriptor of a final symlink.)
    if (confine() && S_ISLNK(st.st_mode)) {
      return DescribeRefusal(fd_, path(), name, p, ELOOP, confine());
    }
    return FromStat(st);
  }

  absl::StatusOr<bool> Exists(const std::string& name) const override {
    struct stat st;
    if (::fstatat(fd_, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) return true;
    if (errno == ENOENT) return false;
    return ErrnoError(errno, "stat", JoinPath(path(), name));
  }

  absl::StatusOr<std::vector<std::string>> List() const override {
    const int fd = OpenatRetry(fd_, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return ErrnoError(errno, "open directory", path());
    DIR* d = ::fdopendir(fd);
    if (d == nullptr) {
      const int err = errno;
      ::close(fd);
      return ErrnoError(err, "opendir", path());
    }
    std::vector<std::string> names;
    errno = 0;
    while (struct dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(std::move(n));
    }
    const int err = errno;
    ::closedir(d);
    if (err != 0) return ErrnoError(err, "readdir", path());
    std::sort(names.begin(), names.end());
    return names;
  }

  absl::Status Sync() const override {
    if (::fsync(fd_) != 0 && errno != EINVAL) return ErrnoError(errno, "fsync directory", path());
    return absl::OkStatus();
  }

  absl::Status Remove(const std::string& name) const override {
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot remove '", name, "' in ", path(), ": not a plain file name"));
    }
    if (::unlinkat(fd_, name.c_str(), 0) != 0 && errno != ENOENT) {
      return ErrnoError(errno, "remove", JoinPath(path(), name));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<AtomicFileWriter>> NewAtomicFile(
      std::shared_ptr<const Directory> self, const std::string& name) const override {
    static std::atomic<uint64_t> counter{0};
    std::random_device rd;
    for (int attempt = 0;; ++attempt) {
      std::string tmp = absl::StrCat(name, ".tmp.", ::getpid(), ".", rd() % 1000000,
                                     counter.fetch_add(1));
      const int fd =
          ::openat(fd_, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
      if (fd >= 0) {
        return std::unique_ptr<AtomicFileWriter>(
            new PosixAtomicFileWriter(std::move(self), fd_, name, std::move(tmp), fd));
      }
      if ((errno == EEXIST || errno == EINTR) && attempt < 16) continue;
      return ErrnoError(errno, "create", JoinPath(path(), tmp));
    }
  }

 private:
  const int fd_;
};

// The open lock file; closing it releases the flock.
class FlockHeld final : public DirLock::Held {
 public:
  explicit FlockHeld(int fd) : fd_(fd) {}
  ~FlockHeld() override { ::close(fd_); }

 private:
  const int fd_;
};

class PosixStorage final : public Storage {
 public:
  absl::StatusOr<std::shared_ptr<const Directory>> OpenDirectory(const std::string& path,
                                                                 bool confine,
                                                                 bool follow_last) override {
    int flags = O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY;
    if (!follow_last) flags |= O_NOFOLLOW;
    const std::string p = path.empty() ? "." : path;
    const int fd = OpenatRetry(AT_FDCWD, p.c_str(), flags);
    if (fd < 0) {
      const int err = errno;
      struct stat st;
      if (!follow_last && (err == ELOOP || err == ENOTDIR) && ::lstat(p.c_str(), &st) == 0 &&
          S_ISLNK(st.st_mode)) {
        return absl::PermissionDeniedError(
            absl::StrCat(path, ": is a symbolic link (refusing to follow it)"));
      }
      std::string msg = absl::StrCat(path, ": cannot open directory: ", std::strerror(err));
      if (err == ENOENT) return absl::NotFoundError(msg);
      if (err == ENOTDIR) return absl::InvalidArgumentError(msg);
      if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
      return absl::InternalError(msg);
    }
    return std::shared_ptr<const Directory>(new PosixDirectory(path, fd, confine));
  }

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFile(const std::string& path) override {
    return OpenFileAt(AT_FDCWD, "", path, /*confine=*/false);
  }

  absl::StatusOr<FileStamp> Stat(const std::string& path) override {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
      std::string msg = absl::StrCat(path, ": stat: ", std::strerror(errno));
      return errno == ENOENT ? absl::NotFoundError(msg) : absl::InternalError(msg);
    }
    return FromStat(st);
  }

  absl::StatusOr<PathKind> Kind(const std::string& path) override {
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) {
      if (errno == ENOENT || errno == ENOTDIR) return PathKind::kMissing;
      return ErrnoError(errno, "stat", path);
    }
    if (S_ISREG(st.st_mode)) return PathKind::kFile;
    if (S_ISDIR(st.st_mode)) return PathKind::kDirectory;
    if (S_ISLNK(st.st_mode)) return PathKind::kSymlink;
    return PathKind::kOther;
  }

  absl::StatusOr<std::string> Canonical(const std::string& path) override {
    char buf[PATH_MAX];
    if (::realpath(path.c_str(), buf) == nullptr) {
      const int err = errno;
      std::string msg = absl::StrCat(path, ": ", std::strerror(err));
      if (err == ENOENT) return absl::NotFoundError(msg);
      if (err == EACCES) return absl::PermissionDeniedError(msg);
      return absl::InvalidArgumentError(msg);
    }
    return std::string(buf);
  }

  absl::Status CreateDirectories(const std::string& dir) override {
    std::string cur;
    for (size_t i = 0; i <= dir.size(); ++i) {
      if ((i == dir.size() || dir[i] == '/') && !cur.empty()) {
        if (::mkdir(cur.c_str(), 0755) == 0) {
          // A new directory is durable once its parent's entry is: fsync the
          // parent, so a save reported done survives a power loss.
          const size_t slash = cur.rfind('/');
          const std::string parent =
              slash == std::string::npos ? "." : (slash == 0 ? "/" : cur.substr(0, slash));
          const int pfd = ::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
          if (pfd >= 0) {
            ::fsync(pfd);
            ::close(pfd);
          }
        } else if (errno != EEXIST) {
          return absl::InternalError(absl::StrCat(cur, ": mkdir: ", std::strerror(errno)));
        }
      }
      if (i < dir.size()) cur.push_back(dir[i]);
    }
    struct stat st;
    if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat(dir, ": not a directory"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<DirLock> LockDirectory(const std::string& dir, int64_t wait_ms) override {
    auto opened = OpenDirectory(dir, /*confine=*/true, /*follow_last=*/false);
    if (!opened.ok()) return opened.status();
    const auto* d = static_cast<const PosixDirectory*>(opened->get());
    const std::string lock_path = JoinPath(dir, kLockFileName);
    // 0600: flock works on a descriptor opened for reading, so a lock file
    // anyone may open is one anyone who can read the directory could hold
    // forever, blocking every save into it.
    const int fd =
        ::openat(d->fd(), kLockFileName,
                 O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY, 0600);
    if (fd < 0) {
      if (errno == ELOOP) {
        return absl::PermissionDeniedError(
            absl::StrCat(lock_path, ": is a symbolic link (refusing to lock through it)"));
      }
      return ErrnoError(errno, "open lock file", lock_path);
    }
    auto held = std::make_unique<FlockHeld>(fd);
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat(lock_path, ": not a regular file"));
    }
    // A lock file an earlier version made 0644: closed to others from now on
    // (by its owner, or root; a process that opened it before keeps its
    // descriptor).
    if ((st.st_mode & 077) != 0) (void)::fchmod(fd, 0600);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
    while (true) {
      if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return DirLock(*std::move(opened), std::move(held));
      const int err = errno;
      if (err == EINTR) continue;
      if (err != EWOULDBLOCK) return ErrnoError(err, "flock", lock_path);
      if (std::chrono::steady_clock::now() >= deadline) {
        return absl::AbortedError(absl::StrCat(
            dir, ": another writer holds its lock ", lock_path,
            " (a save into this directory is in progress)",
            wait_ms > 0 ? absl::StrCat("; waited ", wait_ms, " ms") : std::string()));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
};

std::atomic<Storage*> g_default_storage{nullptr};

}  // namespace

absl::StatusOr<FileStamp> StatFd(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return absl::InternalError(absl::StrCat(path, ": fstat: ", std::strerror(errno)));
  }
  return FromStat(st);
}

namespace internal {
void SetOpenat2DisabledForTesting(bool disabled) { g_openat2_disabled = disabled; }

Storage* SetDefaultStorageForTesting(Storage* storage) {
  Storage* before = g_default_storage.exchange(storage);
  return before != nullptr ? before : SchemeRouter();
}
}  // namespace internal

absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFileAt(int dirfd, const std::string& dir,
                                                             const std::string& name,
                                                             bool confine) {
  const std::string path = dirfd == AT_FDCWD && dir.empty() ? name : JoinPath(dir, name);
  if (name.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("file name '", path, "' holds a NUL byte"));
  }
  const int fd = OpenRaw(dirfd, name, confine, kReadFlags);
  if (fd < 0) {
    const int err = errno;
    return DescribeRefusal(dirfd, dir, name, path, err, confine);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoError(err, "stat", path);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": is ", KindOf(st.st_mode), ", not a regular file"));
  }
  // Reads of a regular file ignore O_NONBLOCK, but nothing downstream should
  // see it (e.g. preadv2 flags).
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl >= 0) ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  return std::unique_ptr<RandomAccessFile>(
      new PosixFile(path, fd, static_cast<uint64_t>(st.st_size)));
}

Storage* Storage::Posix() {
  static Storage* const posix = new PosixStorage();
  return posix;
}

Storage* Storage::Default() {
  Storage* s = g_default_storage.load(std::memory_order_acquire);
  return s != nullptr ? s : internal::SchemeRouter();
}

}  // namespace ckpt
