#include "core/file.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <random>

#include "absl/strings/str_cat.h"

namespace ckpt {
namespace {

absl::Status ErrnoError(int err, absl::string_view what, absl::string_view path) {
  std::string msg = absl::StrCat(path, ": ", what, ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(msg);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  return absl::InternalError(msg);
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
    // in the page cache: probe the first, middle and last page.
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

 private:
  // A second descriptor with O_DIRECT, opened on first use; -1 where the
  // file system refuses it.
  int DirectFd() const {
    std::call_once(direct_once_, [this] {
      direct_fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
    });
    return direct_fd_;
  }

  std::string path_;
  int fd_;
  uint64_t size_;
  mutable std::once_flag direct_once_;
  mutable int direct_fd_ = -1;
};

}  // namespace

absl::StatusOr<uint64_t> RandomAccessFile::ReadDirect(uint64_t offset, uint64_t n,
                                                      void* dst) const {
  const uint64_t have = offset < size() ? std::min(n, size() - offset) : 0;
  absl::Status s = Read(offset, have, dst);
  if (!s.ok()) return s;
  return have;
}

absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "open", path);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoError(err, "stat", path);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat(path, ": not a regular file"));
  }
  return std::unique_ptr<RandomAccessFile>(
      new PosixFile(path, fd, static_cast<uint64_t>(st.st_size)));
}

absl::StatusOr<std::unique_ptr<AtomicFileWriter>> AtomicFileWriter::Create(
    const std::string& path) {
  std::random_device rd;
  std::string tmp = absl::StrCat(path, ".tmp.", ::getpid(), ".", rd() % 1000000);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError(errno, "create", tmp);
  return std::unique_ptr<AtomicFileWriter>(new AtomicFileWriter(path, tmp, fd));
}

AtomicFileWriter::~AtomicFileWriter() {
  if (!committed_) {
    if (fd_ >= 0) ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

absl::Status AtomicFileWriter::Append(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd_, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "write", tmp_);
    }
    p += w;
    n -= static_cast<size_t>(w);
    written_ += static_cast<uint64_t>(w);
  }
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::Commit(bool sync) {
  if (sync && ::fsync(fd_) != 0) return ErrnoError(errno, "fsync", tmp_);
  if (::close(fd_) != 0) {
    fd_ = -1;
    return ErrnoError(errno, "close", tmp_);
  }
  fd_ = -1;
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) return ErrnoError(errno, "rename", path_);
  committed_ = true;
  return absl::OkStatus();
}

absl::Status WriteFileAtomic(const std::string& path, absl::string_view contents) {
  auto w = AtomicFileWriter::Create(path);
  if (!w.ok()) return w.status();
  absl::Status s = (*w)->Append(contents);
  if (!s.ok()) return s;
  return (*w)->Commit();
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, uint64_t max_bytes) {
  auto f = OpenFile(path);
  if (!f.ok()) return f.status();
  if ((*f)->size() > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": file is ", (*f)->size(),
                                                   " bytes, over the limit of ", max_bytes));
  }
  std::string out((*f)->size(), '\0');
  absl::Status s = (*f)->Read(0, out.size(), out.data());
  if (!s.ok()) return s;
  return out;
}

std::string JoinPath(absl::string_view dir, absl::string_view name) {
  if (dir.empty()) return std::string(name);
  if (dir.back() == '/') return absl::StrCat(dir, name);
  return absl::StrCat(dir, "/", name);
}

}  // namespace ckpt
