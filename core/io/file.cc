#include "core/io/file.h"

#include <algorithm>
#include <cstring>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace ckpt {

// Calls `call` on the storage that serves `path` (SchemeRouterStorage).
#define CKPT_ROUTE(path, call)        \
  do {                                \
    auto storage = For(path);         \
    if (!storage.ok()) return storage.status(); \
    return (*storage)->call;          \
  } while (0)

absl::StatusOr<FileStamp> RandomAccessFile::Stamp() const {
  return absl::UnimplementedError(absl::StrCat(path(), ": no file descriptor to stat"));
}

absl::StatusOr<int> RandomAccessFile::ShareReadOnly() const {
  return absl::UnimplementedError(absl::StrCat(path(), ": no file descriptor to share"));
}

absl::StatusOr<uint64_t> RandomAccessFile::ReadDirect(uint64_t offset, uint64_t n,
                                                      void* dst) const {
  const uint64_t have = offset < size() ? std::min(n, size() - offset) : 0;
  absl::Status s = Read(offset, have, dst);
  if (!s.ok()) return s;
  return have;
}

absl::StatusOr<std::shared_ptr<const Directory>> Directory::Open(const std::string& path,
                                                                  bool confine,
                                                                  bool follow_last) {
  return Storage::Default()->OpenDirectory(path, confine, follow_last);
}

absl::StatusOr<std::string> Directory::ReadSmallFile(const std::string& name, uint64_t max_bytes,
                                                     absl::string_view what) const {
  auto f = OpenFile(name);
  if (!f.ok()) return f.status();
  if ((*f)->size() > max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat((*f)->path(), ": file is ", (*f)->size(),
                                                     " bytes, over the ", what, " of ",
                                                     max_bytes, " bytes"));
  }
  std::string out((*f)->size(), '\0');
  absl::Status s = (*f)->Read(0, out.size(), out.data());
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<std::unique_ptr<AtomicFileWriter>> AtomicFileWriter::Create(
    const std::string& path) {
  const size_t slash = path.rfind('/');
  std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
  if (dir.empty()) dir = "/";
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  auto d = Directory::Open(dir, /*confine=*/false);
  if (!d.ok()) return d.status();
  return CreateIn(*std::move(d), name);
}

absl::StatusOr<std::unique_ptr<AtomicFileWriter>> AtomicFileWriter::CreateIn(
    std::shared_ptr<const Directory> dir, const std::string& name) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot write '", name, "' in ", dir->path(), ": not a plain file name"));
  }
  const Directory* d = dir.get();
  return d->NewAtomicFile(std::move(dir), name);
}

absl::Status WriteFileAtomicIn(std::shared_ptr<const Directory> dir, const std::string& name,
                               absl::string_view contents, bool sync) {
  auto w = AtomicFileWriter::CreateIn(std::move(dir), name);
  if (!w.ok()) return w.status();
  absl::Status s = (*w)->Append(contents);
  if (!s.ok()) return s;
  return (*w)->Commit(sync);
}

absl::Status WriteFileAtomic(const std::string& path, absl::string_view contents, bool sync) {
  auto w = AtomicFileWriter::Create(path);
  if (!w.ok()) return w.status();
  absl::Status s = (*w)->Append(contents);
  if (!s.ok()) return s;
  return (*w)->Commit(sync);
}

absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFile(const std::string& path) {
  return Storage::Default()->OpenFile(path);
}

absl::StatusOr<FileStamp> StatFile(const std::string& path) {
  return Storage::Default()->Stat(path);
}

absl::StatusOr<DirLock> LockDirectory(const std::string& dir, int64_t wait_ms) {
  return Storage::Default()->LockDirectory(dir, wait_ms);
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

absl::Status MemoryFile::Read(uint64_t offset, uint64_t n, void* dst) const {
  if (offset > data_.size() || n > data_.size() - offset) {
    return absl::OutOfRangeError(absl::StrCat(path_, ": truncated: read of ", n,
                                              " bytes at offset ", offset, " past the end (",
                                              data_.size(), " bytes)"));
  }
  if (n > 0) std::memcpy(dst, data_.data() + offset, n);
  return absl::OkStatus();
}

std::string PathScheme(absl::string_view path) {
  const size_t sep = path.find("://");
  if (sep == absl::string_view::npos || sep == 0) return std::string();
  for (char c : path.substr(0, sep)) {
    if (!(absl::ascii_isalnum(c) || c == '+' || c == '-' || c == '.')) return std::string();
  }
  return absl::AsciiStrToLower(path.substr(0, sep));
}

namespace {

absl::Mutex g_schemes_mu(absl::kConstInit);
absl::flat_hash_map<std::string, Storage*>* g_schemes ABSL_GUARDED_BY(g_schemes_mu) = nullptr;

// Routes URL paths to their scheme's storage, others to POSIX.
class SchemeRouterStorage final : public Storage {
 public:
  absl::StatusOr<std::shared_ptr<const Directory>> OpenDirectory(const std::string& path,
                                                                 bool confine,
                                                                 bool follow_last) override {
    CKPT_ROUTE(path, OpenDirectory(path, confine, follow_last));
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFile(const std::string& path) override {
    CKPT_ROUTE(path, OpenFile(path));
  }
  absl::StatusOr<FileStamp> Stat(const std::string& path) override { CKPT_ROUTE(path, Stat(path)); }
  absl::StatusOr<PathKind> Kind(const std::string& path) override { CKPT_ROUTE(path, Kind(path)); }
  absl::StatusOr<std::string> Canonical(const std::string& path) override {
    CKPT_ROUTE(path, Canonical(path));
  }
  absl::Status CreateDirectories(const std::string& path) override {
    CKPT_ROUTE(path, CreateDirectories(path));
  }
  absl::StatusOr<DirLock> LockDirectory(const std::string& dir, int64_t wait_ms) override {
    CKPT_ROUTE(dir, LockDirectory(dir, wait_ms));
  }

 private:
  // The storage for `path`, or the error for a URL nobody serves.
  static absl::StatusOr<Storage*> For(const std::string& path) {
    const std::string scheme = PathScheme(path);
    if (scheme.empty()) return Storage::Posix();
    absl::MutexLock lock(&g_schemes_mu);
    if (g_schemes != nullptr) {
      auto it = g_schemes->find(scheme);
      if (it != g_schemes->end()) return it->second;
    }
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": no storage for scheme '", scheme,
                     "' in this process (ckptd, ckptctl and the offline tools serve s3://)"));
  }
};

}  // namespace

void RegisterSchemeStorage(const std::string& scheme, Storage* storage) {
  absl::MutexLock lock(&g_schemes_mu);
  if (g_schemes == nullptr) g_schemes = new absl::flat_hash_map<std::string, Storage*>();
  if (storage == nullptr) {
    g_schemes->erase(scheme);
  } else {
    (*g_schemes)[scheme] = storage;
  }
}

namespace internal {
Storage* SchemeRouter() {
  static Storage* const router = new SchemeRouterStorage();
  return router;
}
}  // namespace internal

}  // namespace ckpt
