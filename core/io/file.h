// Checkpoint storage behind a small interface (Storage, Directory,
// RandomAccessFile, AtomicFileWriter, DirLock), so formats, the planner's
// executor, the daemon and tests do not call the OS directly.
//
// RandomAccessFile is thread-safe: Read() keeps no cursor.
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
  // Permissions, where the storage has them (POSIX: st_mode's permission
  // bits, st_uid, st_gid); not part of the identity. has_owner false: the
  // storage decides access itself (object stores).
  bool has_owner = false;
  uint32_t mode = 0;
  uint32_t uid = 0;
  uint32_t gid = 0;
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
  // Reads of fewer bytes than this cost more round trips than they save
  // (object stores: every Read is a request): the executor reads such a
  // file in pieces of at least this size. 0: no such floor (local files).
  virtual uint64_t MinReadBytes() const { return 0; }
  // Whether bytes [offset, offset + n) seem to be in the page cache (a
  // non-blocking probe of a few pages); true when it cannot tell.
  virtual bool Cached(uint64_t offset, uint64_t n) const { return true; }
  // Whether every Read is pinned to the version opened: it fails (ABORTED)
  // rather than return bytes of a file replaced since (object stores: each
  // GET carries If-Match with the ETag opened). A reader of such a file
  // needs no check of its name after each read, only once the load is done.
  virtual bool ReadsPinned() const { return false; }
  // The identity of the open file now (fstat); UNIMPLEMENTED for files not
  // backed by a descriptor.
  virtual absl::StatusOr<FileStamp> Stamp() const;
  // A new read-only descriptor of this very file (its own open file
  // description), for another process to read it with pread (a client
  // reading bytes the data cache does not hold itself); the caller owns it.
  // UNIMPLEMENTED for files not backed by a descriptor (object storage).
  virtual absl::StatusOr<int> ShareReadOnly() const;
};

// ---- Checkpoint storage ----------------------------------------------------
//
// Everything ckptd reads or writes of a checkpoint goes through the Storage
// interface below, in the manner of LevelDB's Env: directories held open,
// files opened beneath them for positional reads, identities, listings,
// atomic and durable writes and writers' locks. Core and the daemon take the
// process's Storage (Storage::Default()); POSIX files (file_posix.cc) are
// the first implementation, and tests install wrappers that inject faults
// (tests/unit/storage_test.cc).
//
// POSIX semantics, which other implementations keep where they can:
//  - every file a checkpoint names is opened read-only, never blocking on a
//    FIFO or device, and must be a regular file, else FAILED_PRECONDITION
//    "<path>: is a FIFO, not a regular file" (directory, socket, device
//    alike);
//  - `confine` (what the daemon uses, see OpenOptions::confine): the name
//    resolves beneath the directory with no symbolic link anywhere in it
//    (PERMISSION_DENIED "<path>: is a symbolic link" / "... resolves outside
//    the checkpoint directory <dir>"); POSIX uses openat2(RESOLVE_BENEATH |
//    RESOLVE_NO_SYMLINKS), or where the kernel has none walks the name
//    component by component with O_NOFOLLOW, refusing "." / "..";
//  - not `confine`: symlinks followed (the offline tools on a HuggingFace hub
//    cache, whose snapshot files are symlinks to blobs).
// A directory itself is opened following symlinks unless `follow_last` is
// false: callers that must not (the daemon) resolve it first.

class AtomicFileWriter;

// A directory held open whose files are opened beneath it, so every file of
// one checkpoint comes from the same directory even if its path is renamed
// meanwhile. Thread-safe; not copyable.
class Directory {
 public:
  // Storage::Default()->OpenDirectory.
  static absl::StatusOr<std::shared_ptr<const Directory>> Open(const std::string& path,
                                                               bool confine,
                                                               bool follow_last = true);
  virtual ~Directory() = default;
  Directory(const Directory&) = delete;
  Directory& operator=(const Directory&) = delete;

  const std::string& path() const { return path_; }
  bool confine() const { return confine_; }

  virtual absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFile(
      const std::string& name) const = 0;
  // The stamp of `name` resolved as OpenFile would resolve it (with
  // `confine`: no symlink followed, beneath the directory), without opening
  // it for reading (a FIFO is not opened).
  virtual absl::StatusOr<FileStamp> Stat(const std::string& name) const = 0;
  // Whether `name` exists (lstat-like; a dangling symlink exists).
  virtual absl::StatusOr<bool> Exists(const std::string& name) const = 0;
  // Entry names, sorted, without "." and "..".
  virtual absl::StatusOr<std::vector<std::string>> List() const = 0;
  // Makes renames and creations in the directory durable (fsync(2)).
  virtual absl::Status Sync() const = 0;
  // Removes file `name` (a plain name); one that does not exist is fine.
  // Not durable until Sync().
  virtual absl::Status Remove(const std::string& name) const = 0;
  // A writer of file `name` (a plain name) in this directory: see
  // AtomicFileWriter. `self` is this directory, which the writer keeps.
  virtual absl::StatusOr<std::unique_ptr<AtomicFileWriter>> NewAtomicFile(
      std::shared_ptr<const Directory> self, const std::string& name) const = 0;

  // The whole of file `name`, refused (RESOURCE_EXHAUSTED, naming the file,
  // its size and the limit) when larger than `max_bytes`; `what` names the
  // limit in that message (e.g. "max_metadata_bytes").
  absl::StatusOr<std::string> ReadSmallFile(const std::string& name, uint64_t max_bytes,
                                            absl::string_view what = "limit") const;

 protected:
  Directory(std::string path, bool confine) : path_(std::move(path)), confine_(confine) {}

 private:
  std::string path_;
  bool confine_;
};

// Writes a file atomically and durably: data goes to a temporary file
// "{name}.tmp.{pid}.{random}" created beside it (exclusively, never through
// a symlink, mode 0644) which Commit() makes durable and renames over `name`
// (a symlink there is replaced, never followed), then syncs the directory.
// All of it goes through one directory, so the temporary, the rename and the
// directory sync concern the same directory. Destroying an uncommitted
// writer removes the temporary, so a failed write never leaves a
// half-written file under `name`; a process killed mid-write leaves only the
// temporary (never a name any reader looks for).
class AtomicFileWriter {
 public:
  // `path`'s directory is opened following symlinks.
  static absl::StatusOr<std::unique_ptr<AtomicFileWriter>> Create(const std::string& path);
  // `name` (a plain file name) in `dir`.
  static absl::StatusOr<std::unique_ptr<AtomicFileWriter>> CreateIn(
      std::shared_ptr<const Directory> dir, const std::string& name);
  virtual ~AtomicFileWriter() = default;

  virtual absl::Status Append(const void* data, size_t n) = 0;
  absl::Status Append(absl::string_view s) { return Append(s.data(), s.size()); }
  // Overwrites bytes already appended (a header field known only after the
  // data behind it was written, such as a zip entry's CRC-32).
  virtual absl::Status WriteAt(uint64_t offset, const void* data, size_t n) = 0;
  virtual uint64_t bytes_written() const = 0;
  // Where the file will be once committed.
  virtual const std::string& path() const = 0;
  // Durable file (when `sync`), rename into place, durable directory (when
  // `sync`). Without `sync` the result is atomic but not durable.
  virtual absl::Status Commit(bool sync = true) = 0;
};

// Writes `contents` to `path` atomically (and durably when `sync`).
absl::Status WriteFileAtomic(const std::string& path, absl::string_view contents,
                             bool sync = true);
absl::Status WriteFileAtomicIn(std::shared_ptr<const Directory> dir, const std::string& name,
                               absl::string_view contents, bool sync = true);

// An exclusive lock on "{dir}/.ckptd.lock" that serialises writers of one
// checkpoint directory (two Saves, a Save and a `ckptctl shard` into the same
// directory); POSIX: flock(LOCK_EX). Released when destroyed (or when the
// process dies: flock locks go with their open file description). The lock
// file is left in place (unlinking it would race with the next locker).
// It is mode 0600 (made so if an earlier version left it open to others):
// flock works on a read-only descriptor, so only its owner (the daemon's
// uid, or whoever ran `ckptctl shard` first) and root may open it.
// Movable.
inline constexpr char kLockFileName[] = ".ckptd.lock";
class DirLock {
 public:
  // What a Storage holds while the lock is taken; releases it when destroyed.
  class Held {
   public:
    virtual ~Held() = default;
  };
  DirLock(std::shared_ptr<const Directory> dir, std::unique_ptr<Held> held)
      : dir_(std::move(dir)), held_(std::move(held)) {}
  DirLock(DirLock&&) noexcept = default;
  DirLock& operator=(DirLock&&) noexcept = default;
  // The locked directory, opened without following a symlink as its last
  // component; write through it (AtomicFileWriter::CreateIn) so the files
  // land in the directory that is locked.
  const std::shared_ptr<const Directory>& directory() const { return dir_; }

 private:
  std::shared_ptr<const Directory> dir_;
  std::unique_ptr<Held> held_;
};

// What a path names, its last component not followed (lstat).
enum class PathKind { kMissing, kFile, kDirectory, kSymlink, kOther };

// Where checkpoints live (see above). Implementations are thread-safe.
class Storage {
 public:
  virtual ~Storage() = default;
  // The process's storage: POSIX files unless a test installed another
  // (internal::SetDefaultStorageForTesting).
  static Storage* Default();
  // The POSIX implementation (file_posix.cc).
  static Storage* Posix();

  // Opens `path` as a directory. `follow_last`: false refuses a path whose
  // last component is a symbolic link ("<path>: is a symbolic link").
  virtual absl::StatusOr<std::shared_ptr<const Directory>> OpenDirectory(const std::string& path,
                                                                         bool confine,
                                                                         bool follow_last) = 0;
  // Opens `path` read-only, symlinks followed; must be a regular file.
  // NOT_FOUND if it does not exist.
  virtual absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFile(const std::string& path) = 0;
  // The identity of `path` (symlinks followed); NOT_FOUND if it is missing.
  virtual absl::StatusOr<FileStamp> Stat(const std::string& path) = 0;
  // What `path` is, its last component not followed.
  virtual absl::StatusOr<PathKind> Kind(const std::string& path) = 0;
  // The absolute path `path` names with every symlink resolved (realpath):
  // NOT_FOUND "<path>: <why>" when it does not exist, PERMISSION_DENIED when
  // a component may not be searched, INVALID_ARGUMENT otherwise.
  virtual absl::StatusOr<std::string> Canonical(const std::string& path) = 0;
  // Creates `path` and its missing parents (mode 0755), each new one made
  // durable in its parent; FAILED_PRECONDITION when `path` ends up no
  // directory.
  virtual absl::Status CreateDirectories(const std::string& path) = 0;
  // Locks directory `dir` (which must exist; a symlink as its last component
  // is refused: PERMISSION_DENIED "<dir>: is a symbolic link"). Waits up to
  // `wait_ms` milliseconds (0: one try) while another writer holds it, then
  // fails with ABORTED "<dir>: another writer holds its lock
  // <dir>/.ckptd.lock (a save into it is in progress)".
  virtual absl::StatusOr<DirLock> LockDirectory(const std::string& dir, int64_t wait_ms) = 0;
};

// Storage for "<scheme>://" paths ("s3": core/io/s3): Storage::Default()
// hands a path that starts with a registered scheme to that storage, other
// paths to POSIX, and refuses a URL of a scheme nobody registered
// (INVALID_ARGUMENT "<path>: no storage for scheme '<scheme>' ..."). Binaries
// that link an implementation register it at start; `storage` is not owned
// and lives as long as the process. nullptr unregisters.
void RegisterSchemeStorage(const std::string& scheme, Storage* storage);
// The scheme of a URL path ("s3" of "s3://b/k"); empty for a file path.
std::string PathScheme(absl::string_view path);

namespace internal {
// Tests: makes `storage` (not owned; nullptr: POSIX again) what
// Storage::Default() returns, for faults injected into core and the daemon's
// libraries. Returns the one it replaces. Not for production use.
Storage* SetDefaultStorageForTesting(Storage* storage);
// What Storage::Default() is when no test replaced it: POSIX files and the
// registered schemes.
Storage* SchemeRouter();
}  // namespace internal

// Shorthands on Storage::Default().
absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFile(const std::string& path);
absl::StatusOr<FileStamp> StatFile(const std::string& path);
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
