// The POSIX implementation of the checkpoint storage (file.h): what only it
// offers beyond the interface. Storage::Posix() is the implementation itself.
#ifndef CKPTD_CORE_IO_FILE_POSIX_H_
#define CKPTD_CORE_IO_FILE_POSIX_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "core/io/file.h"

namespace ckpt {

// Opens `name` relative to the directory open at `dirfd` (AT_FDCWD: the
// working directory) as file.h describes, with or without `confine`; `dir`
// is its path, for messages and the file's path().
absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFileAt(int dirfd, const std::string& dir,
                                                             const std::string& name,
                                                             bool confine);

// fstat(2) of `fd` as a FileStamp; `path` names it in errors.
absl::StatusOr<FileStamp> StatFd(int fd, const std::string& path);

namespace internal {
// Tests: pretend the kernel has no openat2, so OpenFileAt walks names with
// O_NOFOLLOW instead. Not for production use.
void SetOpenat2DisabledForTesting(bool disabled);
}  // namespace internal

}  // namespace ckpt

#endif  // CKPTD_CORE_IO_FILE_POSIX_H_
