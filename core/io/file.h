// Positional file access behind a small interface, so formats, the planner's
// executor and tests do not call the OS directly.
//
// RandomAccessFile is thread-safe: Read() uses pread and keeps no cursor.
#ifndef CKPTD_CORE_FILE_H_
#define CKPTD_CORE_FILE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ckpt {

// Offsets, lengths and buffers of direct reads are multiples of this.
inline constexpr uint64_t kDirectAlign = 4096;

// Identity of a file as opened: device, inode, size, mtime and ctime. A
// file rewritten in place (even to the same size with its mtime restored,
// `touch -d`) gets a new ctime, so any rewrite changes the stamp; a file
// replaced by rename changes inode.
struct FileStamp {
  uint64_t dev = 0;
  uint64_t ino = 0;
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  int64_t ctime_ns = 0;
  bool operator==(const FileStamp& o) const {
    return dev == o.dev && ino == o.ino && size == o.size && mtime_ns == o.mtime_ns &&
           ctime_ns == o.ctime_ns;
  }
  bool operator!=(const FileStamp& o) const { return !(*this == o); }
};

class RandomAccessFile {
 public:
  virtual ~RandomAccessFile() = default;
  virtual const std::string& path() const = 0;
  virtual uint64_t size() const = 0;
  // Reads exactly `n` bytes at `offset` into `dst`. A range past the end of
  // the file is an OUT_OF_RANGE error naming the file ("truncated").
  virtual absl::Status Read(uint64_t offset, uint64_t n, void* dst) const = 0;
  // Reads up to `n` bytes at `offset` into `dst` bypassing the page cache
  // (O_DIRECT) where the file system allows it, through it otherwise;
  // `offset`, `n` and `dst` are multiples of kDirectAlign. Returns the bytes
  // read: `n`, or fewer only where the file ends. The default uses Read.
  virtual absl::StatusOr<uint64_t> ReadDirect(uint64_t offset, uint64_t n, void* dst) const;
  // Whether bytes [offset, offset + n) seem to be in the page cache (a
  // non-blocking probe of a few pages); true when it cannot tell.
  virtual bool Cached(uint64_t offset, uint64_t n) const { return true; }
  // The identity of the open file now (fstat); UNIMPLEMENTED for files not
  // backed by a descriptor.
  virtual absl::StatusOr<FileStamp> Stamp() const;
};

// stat(2) of `path` (symlinks followed) / fstat(2) of `fd`.
absl::StatusOr<FileStamp> StatFile(const std::string& path);
absl::StatusOr<FileStamp> StatFd(int fd, const std::string& path);

// ---- Opening the files of a checkpoint --------------------------------------
//
// Every file a checkpoint names (metadata, index, data files of every
// format) is opened by OpenFileAt, relative to its directory:
//  - always O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY, so a FIFO or device
//    never blocks the open, and the result must be a regular file (fstat
//    S_ISREG), else FAILED_PRECONDITION "<path>: is a FIFO, not a regular
//    file" (directory, socket, device alike); O_NONBLOCK is then cleared;
//  - `confine` (what the daemon uses, see OpenOptions::confine):
//    openat2(dirfd, name, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS), so the name
//    resolves beneath the directory with no symbolic link anywhere in it
//    (PERMISSION_DENIED "<path>: is a symbolic link" / "... resolves outside
//    the checkpoint directory <dir>"). Where the kernel has no openat2
//    (ENOSYS, or EPERM from a seccomp filter that does not know it) the name
//    is walked component by component with O_NOFOLLOW, refusing "." / ".."
//    components, with the same errors;
//  - not `confine`: openat(dirfd, name), symlinks followed (the offline tools
//    on a HuggingFace hub cache, whose snapshot files are symlinks to blobs).
// The directory itself is opened following symlinks: callers that must not
// (the daemon) resolve it first.

// Opens `name` relative to the directory open at `dirfd` (AT_FDCWD: the
// working directory); `dir` is its path, for messages and the file's path().
absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFileAt(int dirfd, const std::string& dir,
                                                             const std::string& name,
                                                             bool confine);

// A directory held open (O_DIRECTORY) whose files are opened beneath it with
// OpenFileAt, so every file of one checkpoint comes from the same directory
// even if its path is renamed meanwhile. Thread-safe; not copyable.
class Directory {
 public:
  // Opens `path` as a directory. `follow_last`: false refuses a path whose
  // last component is a symbolic link ("<path>: is a symbolic link").
  static absl::StatusOr<std::shared_ptr<const Directory>> Open(const std::string& path,
                                                               bool confine,
                                                               bool follow_last = true);
  ~Directory();
  Directory(const Directory&) = delete;
  Directory& operator=(const Directory&) = delete;

  const std::string& path() const { return path_; }
  bool confine() const { return confine_; }
  int fd() const { return fd_; }

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFile(const std::string& name) const;
  // The whole of file `name`, refused (RESOURCE_EXHAUSTED, naming the file,
  // its size and the limit) when larger than `max_bytes`; `what` names the
  // limit in that message (e.g. "max_metadata_bytes").
  absl::StatusOr<std::string> ReadSmallFile(const std::string& name, uint64_t max_bytes,
                                            absl::string_view what = "limit") const;
  // The stamp of `name` resolved as OpenFile would resolve it (with
  // `confine`: no symlink followed, beneath the directory), without opening
  // it for reading (O_PATH: a FIFO is not opened).
  absl::StatusOr<FileStamp> Stat(const std::string& name) const;
  // Whether `name` exists (lstat-like; a dangling symlink exists).
  absl::StatusOr<bool> Exists(const std::string& name) const;
  // Entry names, sorted, without "." and "..".
  absl::StatusOr<std::vector<std::string>> List() const;
  // fsync(2) of the directory (makes renames and creations in it durable).
  absl::Status Sync() const;

 private:
  Directory(std::string path, int fd, bool confine)
      : path_(std::move(path)), fd_(fd), confine_(confine) {}
  std::string path_;
  int fd_;
  bool confine_;
};

// Opens `path` read-only (O_CLOEXEC | O_NONBLOCK, symlinks followed); must be
// a regular file (see OpenFileAt). NOT_FOUND if it does not exist.
absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFile(const std::string& path);

namespace internal {
// Tests: pretend the kernel has no openat2, so OpenFileAt walks names with
// O_NOFOLLOW instead. Not for production use.
void SetOpenat2DisabledForTesting(bool disabled);
}  // namespace internal

// Writes a file atomically and durably: data goes to a temporary file
// "{name}.tmp.{pid}.{random}" created beside it (O_CREAT | O_EXCL |
// O_NOFOLLOW, mode 0644) which Commit() fsyncs and renames over `name` (a
// symlink there is replaced, never followed), then fsyncs the directory. All
// of it goes through one directory descriptor, so the temp file, the rename
// and the directory sync concern the same directory. Destroying an
// uncommitted writer removes the temporary, so a failed write never leaves
// a half-written file under `name`; a process killed mid-write leaves only
// the temporary (never a name any reader looks for).
class AtomicFileWriter {
 public:
  // `path`'s directory is opened following symlinks.
  static absl::StatusOr<std::unique_ptr<AtomicFileWriter>> Create(const std::string& path);
  // `name` (a plain file name) in `dir`.
  static absl::StatusOr<std::unique_ptr<AtomicFileWriter>> CreateIn(
      std::shared_ptr<const Directory> dir, const std::string& name);
  ~AtomicFileWriter();

  absl::Status Append(const void* data, size_t n);
  absl::Status Append(absl::string_view s) { return Append(s.data(), s.size()); }
  // Overwrites bytes already appended (a header field known only after the
  // data behind it was written, such as a zip entry's CRC-32).
  absl::Status WriteAt(uint64_t offset, const void* data, size_t n);
  uint64_t bytes_written() const { return written_; }
  const std::string& path() const { return path_; }
  // fsync(file) (when `sync`), close, rename into place, fsync(directory)
  // (when `sync`). Without `sync` the result is atomic but not durable.
  absl::Status Commit(bool sync = true);

 private:
  AtomicFileWriter(std::shared_ptr<const Directory> dir, std::string name, std::string tmp,
                   int fd);
  std::shared_ptr<const Directory> dir_;
  std::string name_, tmp_, path_;
  int fd_;
  uint64_t written_ = 0;
  bool committed_ = false;
};

// Writes `contents` to `path` atomically (and durably when `sync`).
absl::Status WriteFileAtomic(const std::string& path, absl::string_view contents,
                             bool sync = true);
absl::Status WriteFileAtomicIn(std::shared_ptr<const Directory> dir, const std::string& name,
                               absl::string_view contents, bool sync = true);

// An exclusive advisory lock (flock(LOCK_EX)) on "{dir}/.ckptd.lock" that
// serialises writers of one checkpoint directory (two Saves, a Save and a
// `ckptctl shard` into the same directory). Released when destroyed (or
// when the process dies: flock locks go with their open file description).
// The lock file is left in place (unlinking it would race with the next
// locker). Movable.
inline constexpr char kLockFileName[] = ".ckptd.lock";
class DirLock {
 public:
  DirLock(DirLock&& o) noexcept : dir_(std::move(o.dir_)), fd_(o.fd_) { o.fd_ = -1; }
  DirLock& operator=(DirLock&& o) noexcept;
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  ~DirLock();
  // The locked directory, opened without following a symlink as its last
  // component; write through it (AtomicFileWriter::CreateIn) so the files
  // land in the directory that is locked.
  const std::shared_ptr<const Directory>& directory() const { return dir_; }

 private:
  friend absl::StatusOr<DirLock> LockDirectory(const std::string& dir, int64_t wait_ms);
  DirLock(std::shared_ptr<const Directory> dir, int fd) : dir_(std::move(dir)), fd_(fd) {}
  std::shared_ptr<const Directory> dir_;
  int fd_ = -1;
};

// Locks directory `dir` (which must exist; a symlink as its last component
// is refused: PERMISSION_DENIED "<dir>: is a symbolic link"). Waits up to
// `wait_ms` milliseconds (0: one try) while another writer holds it, then
// fails with ABORTED "<dir>: another writer holds its lock <dir>/.ckptd.lock
// (a save into it is in progress)".
absl::StatusOr<DirLock> LockDirectory(const std::string& dir, int64_t wait_ms = 0);

// Reads a whole small file (metadata, JSON), refusing files over `max_bytes`.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, uint64_t max_bytes);

// A RandomAccessFile over memory (pickles embedded in other files, tests).
class MemoryFile : public RandomAccessFile {
 public:
  MemoryFile(std::string path, absl::string_view data) : path_(std::move(path)), data_(data) {}
  const std::string& path() const override { return path_; }
  uint64_t size() const override { return data_.size(); }
  absl::Status Read(uint64_t offset, uint64_t n, void* dst) const override;

 private:
  std::string path_;
  absl::string_view data_;
};

// Joins a directory and a file name with exactly one '/'.
std::string JoinPath(absl::string_view dir, absl::string_view name);

}  // namespace ckpt

#endif  // CKPTD_CORE_FILE_H_
