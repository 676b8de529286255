// Positional file access behind a small interface, so formats, the planner's
// executor and tests do not call the OS directly.
//
// RandomAccessFile is thread-safe: Read() uses pread and keeps no cursor.
#ifndef CKPTD_CORE_FILE_H_
#define CKPTD_CORE_FILE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ckpt {

// Offsets, lengths and buffers of direct reads are multiples of this.
inline constexpr uint64_t kDirectAlign = 4096;

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
};

// Opens `path` read-only (O_CLOEXEC). NOT_FOUND if it does not exist.
absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFile(const std::string& path);

// Writes a file atomically: data goes to a temporary file beside `path`
// which is renamed over `path` by Commit(); destroying an uncommitted writer
// removes the temporary, so a failed write never leaves a half-written file.
class AtomicFileWriter {
 public:
  static absl::StatusOr<std::unique_ptr<AtomicFileWriter>> Create(const std::string& path);
  ~AtomicFileWriter();

  absl::Status Append(const void* data, size_t n);
  absl::Status Append(absl::string_view s) { return Append(s.data(), s.size()); }
  uint64_t bytes_written() const { return written_; }
  // fsyncs (when `sync`), closes and renames into place.
  absl::Status Commit(bool sync = false);

 private:
  AtomicFileWriter(std::string path, std::string tmp, int fd)
      : path_(std::move(path)), tmp_(std::move(tmp)), fd_(fd) {}
  std::string path_, tmp_;
  int fd_;
  uint64_t written_ = 0;
  bool committed_ = false;
};

// Writes `contents` to `path` atomically.
absl::Status WriteFileAtomic(const std::string& path, absl::string_view contents);

// Reads a whole small file (metadata, JSON), refusing files over `max_bytes`.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, uint64_t max_bytes);

// Joins a directory and a file name with exactly one '/'.
std::string JoinPath(absl::string_view dir, absl::string_view name);

}  // namespace ckpt

#endif  // CKPTD_CORE_FILE_H_
