#include "core/io/s3/s3_storage.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/base/status_macros.h"
#include "core/base/xxh3.h"
#include "core/io/s3/s3_url.h"

namespace ckpt {
namespace s3 {

FileStamp StampOf(const std::string& bucket, const ObjectInfo& info) {
  FileStamp st;
  st.dev = XXH3_64bits(bucket.data(), bucket.size());
  st.ino = XXH3_64bits(info.etag.data(), info.etag.size());
  st.size = info.size;
  // An object's version is its ETag (and size): every read is pinned to it.
  // Its time is left out where there is one: a listing's and a HEAD's differ
  // in precision and, on some stores, in rounding, and the stamps compared
  // may come from either.
  if (info.etag.empty()) {
    st.mtime_ns = info.mtime_ns;
    st.ctime_ns = info.mtime_ns;
  }
  st.has_owner = false;
  return st;
}

namespace {

// For the reuse of listings: a clock that never steps back.
int64_t MonotonicNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The key of the cached listing that holds object `key` of `bucket` (its
// prefix one level up, as S3Storage::Listing keys a directory's).
std::string ListingKeyOf(const std::string& bucket, const std::string& key) {
  const size_t slash = key.rfind('/');
  return absl::StrCat(bucket, "/", slash == std::string::npos ? "" : key.substr(0, slash + 1));
}

constexpr uint64_t kReadPieceBytes = 16ull << 20;
// Reads that end within an object's first 64 KiB share one GET (headers).
constexpr uint64_t kHeadBytes = 64 << 10;

std::string KeyIn(const S3Url& dir, absl::string_view name) {
  return dir.key.empty() ? std::string(name) : absl::StrCat(dir.key, "/", name);
}

absl::Status CheckName(const S3Url& dir, const std::string& name) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
      name.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("file name '", absl::CHexEscape(name), "' in ",
                                                   dir.ToString(), " is not a plain name"));
  }
  return absl::OkStatus();
}

class S3File final : public RandomAccessFile {
 public:
  S3File(S3Client* client, S3Url url, ObjectInfo info)
      : client_(client), url_(std::move(url)), path_(url_.ToString()), info_(std::move(info)),
        stamp_(StampOf(url_.bucket, info_)) {}
  const std::string& path() const override { return path_; }
  uint64_t size() const override { return info_.size; }
  absl::Status Read(uint64_t offset, uint64_t n, void* dst) const override {
    if (offset > info_.size || n > info_.size - offset) {
      return absl::OutOfRangeError(absl::StrCat(path_, ": truncated: read of ", n,
                                                " bytes at offset ", offset, " past the end (",
                                                info_.size, " bytes)"));
    }
    // Small reads near the start (a header's length, then the header) come
    // from one GET of the object's head, kept.
    if (offset + n <= kHeadBytes) {
      absl::MutexLock lock(&mu_);
      if (!head_loaded_) {
        head_.resize(std::min<uint64_t>(kHeadBytes, info_.size));
        CKPT_RETURN_IF_ERROR(
            client_->GetRange(url_.bucket, url_.key, 0, head_.size(), head_.data(), info_.etag));
        head_loaded_ = true;
      }
      if (n > 0) std::memcpy(dst, head_.data() + offset, n);
      return absl::OkStatus();
    }
    return client_->GetRange(url_.bucket, url_.key, offset, n, dst, info_.etag);
  }
  // Nothing of an object is in this node's page cache.
  bool Cached(uint64_t, uint64_t) const override { return false; }
  // Every GET carries If-Match with the ETag opened (412: ABORTED).
  bool ReadsPinned() const override { return true; }
  // Every Read is a GET (about 1 ms of round trip on a LAN): pieces of
  // 16 MiB keep that under a tenth of a GB/s-class transfer.
  uint64_t MinReadBytes() const override { return kReadPieceBytes; }
  absl::StatusOr<FileStamp> Stamp() const override { return stamp_; }

 private:
  S3Client* const client_;
  const S3Url url_;
  const std::string path_;
  const ObjectInfo info_;
  const FileStamp stamp_;
  mutable absl::Mutex mu_;
  mutable std::string head_ ABSL_GUARDED_BY(mu_);  // the object's first kHeadBytes
  mutable bool head_loaded_ ABSL_GUARDED_BY(mu_) = false;
};

// A file spooled locally (an unlinked temporary), uploaded at Commit.
class S3Writer final : public AtomicFileWriter {
 public:
  S3Writer(S3Storage* storage, std::shared_ptr<const Directory> dir, S3Url url, int fd)
      : storage_(storage), dir_(std::move(dir)), url_(std::move(url)), path_(url_.ToString()),
        fd_(fd) {}
  ~S3Writer() override { ::close(fd_); }

  absl::Status Append(const void* data, size_t n) override { return WriteAt(size_, data, n); }
  absl::Status WriteAt(uint64_t offset, const void* data, size_t n) override {
    if (committed_) return absl::FailedPreconditionError(absl::StrCat(path_, ": already committed"));
    if (offset > size_) {
      return absl::InvalidArgumentError(absl::StrCat(path_, ": write at ", offset,
                                                     " past the end (", size_, " bytes)"));
    }
    const char* p = static_cast<const char*>(data);
    uint64_t at = offset;
    size_t left = n;
    while (left > 0) {
      const ssize_t w = ::pwrite(fd_, p, left, static_cast<off_t>(at));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        return absl::ResourceExhaustedError(absl::StrCat(
            path_, ": spooling the file locally before its upload: ", std::strerror(errno)));
      }
      p += w;
      at += static_cast<uint64_t>(w);
      left -= static_cast<size_t>(w);
    }
    size_ = std::max(size_, offset + n);
    return absl::OkStatus();
  }
  uint64_t bytes_written() const override { return size_; }
  const std::string& path() const override { return path_; }

  absl::Status Commit(bool /*sync: an acknowledged PUT is durable*/) override {
    if (committed_) return absl::FailedPreconditionError(absl::StrCat(path_, ": already committed"));
    void* map = nullptr;
    if (size_ > 0) {
      map = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_, 0);
      if (map == MAP_FAILED) {
        return absl::ResourceExhaustedError(
            absl::StrCat(path_, ": mapping the spooled file: ", std::strerror(errno)));
      }
    }
    storage_->Changed(url_.bucket, url_.key);
    absl::Status s = Upload(static_cast<const uint8_t*>(map));
    storage_->Changed(url_.bucket, url_.key);
    if (map != nullptr) ::munmap(map, size_);
    if (s.ok()) committed_ = true;
    return s;
  }

 private:
  absl::Status Upload(const uint8_t* data) {
    S3Client& c = storage_->ClientFor(url_);
    const uint64_t part = std::max<uint64_t>(storage_->options().part_bytes, 5ull << 20);
    if (size_ <= part) return c.Put(url_.bucket, url_.key, data, size_);
    auto id = c.CreateMultipart(url_.bucket, url_.key);
    if (!id.ok()) return id.status();
    std::vector<std::string> etags;
    absl::Status s;
    for (uint64_t at = 0; at < size_ && s.ok(); at += part) {
      auto etag = c.UploadPart(url_.bucket, url_.key, *id, static_cast<int>(etags.size() + 1),
                               data + at, std::min(part, size_ - at));
      if (etag.ok()) {
        etags.push_back(*etag);
      } else {
        s = etag.status();
      }
    }
    if (s.ok()) s = c.CompleteMultipart(url_.bucket, url_.key, *id, etags);
    // A failed upload leaves no parts behind (they would be billed forever).
    if (!s.ok()) (void)c.AbortMultipart(url_.bucket, url_.key, *id);
    return s;
  }

  S3Storage* const storage_;
  const std::shared_ptr<const Directory> dir_;
  const S3Url url_;
  const std::string path_;
  const int fd_;
  uint64_t size_ = 0;
  bool committed_ = false;
};

absl::StatusOr<int> OpenSpool(const std::string& dir_option, const std::string& what) {
  std::string dir = dir_option;
  if (dir.empty()) {
    const char* t = std::getenv("TMPDIR");
    dir = t != nullptr && *t != '\0' ? t : "/tmp";
  }
  int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": cannot create a spool file in ", dir, " for the upload: ", std::strerror(errno)));
  }
  return fd;
}

class S3Directory final : public Directory {
 public:
  S3Directory(S3Storage* storage, S3Url url)
      : Directory(url.ToString(), /*confine=*/true),
        storage_(storage),
        client_(&storage->ClientFor(url)),
        url_(std::move(url)) {}

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFile(
      const std::string& name) const override {
    CKPT_RETURN_IF_ERROR(CheckName(url_, name));
    S3Url f{url_.bucket, KeyIn(url_, name)};
    if (std::optional<ObjectInfo> listed = storage_->Listed(f)) {
      return std::unique_ptr<RandomAccessFile>(new S3File(client_, std::move(f), *listed));
    }
    auto info = client_->Head(f.bucket, f.key);
    if (!info.ok()) return info.status();
    return std::unique_ptr<RandomAccessFile>(new S3File(client_, std::move(f), *info));
  }
  absl::StatusOr<FileStamp> Stat(const std::string& name) const override {
    CKPT_RETURN_IF_ERROR(CheckName(url_, name));
    auto info = client_->Head(url_.bucket, KeyIn(url_, name));
    if (!info.ok()) return info.status();
    return StampOf(url_.bucket, *info);
  }
  absl::StatusOr<bool> Exists(const std::string& name) const override {
    CKPT_RETURN_IF_ERROR(CheckName(url_, name));
    auto kind = storage_->Kind(S3Url{url_.bucket, KeyIn(url_, name)}.ToString());
    if (!kind.ok()) return kind.status();
    return *kind != PathKind::kMissing;
  }
  absl::StatusOr<std::vector<std::string>> List() const override {
    const std::string prefix = url_.DirPrefix();
    auto all = storage_->Listing(url_);
    if (!all.ok()) return all.status();
    std::vector<std::string> names;
    for (const ListedObject& o : all->objects) {
      if (absl::StartsWith(o.key, prefix) && o.key.size() > prefix.size()) {
        names.push_back(o.key.substr(prefix.size()));
      }
    }
    for (const std::string& p : all->common_prefixes) {
      if (absl::StartsWith(p, prefix) && p.size() > prefix.size() + 1) {
        names.push_back(p.substr(prefix.size(), p.size() - prefix.size() - 1));
      }
    }
    std::sort(names.begin(), names.end());
    names.erase(std::unique(names.begin(), names.end()), names.end());
    return names;
  }
  absl::Status Sync() const override { return absl::OkStatus(); }
  absl::Status Remove(const std::string& name) const override {
    CKPT_RETURN_IF_ERROR(CheckName(url_, name));
    storage_->Changed(url_.bucket, KeyIn(url_, name));
    absl::Status s = client_->Delete(url_.bucket, KeyIn(url_, name));
    storage_->Changed(url_.bucket, KeyIn(url_, name));
    return s;
  }
  absl::StatusOr<std::unique_ptr<AtomicFileWriter>> NewAtomicFile(
      std::shared_ptr<const Directory> self, const std::string& name) const override {
    CKPT_RETURN_IF_ERROR(CheckName(url_, name));
    S3Url f{url_.bucket, KeyIn(url_, name)};
    auto fd = OpenSpool(storage_->options().spool_dir, f.ToString());
    if (!fd.ok()) return fd.status();
    return std::unique_ptr<AtomicFileWriter>(new S3Writer(storage_, std::move(self), f, *fd));
  }

 private:
  S3Storage* const storage_;
  S3Client* const client_;  // the client of the root this prefix is under
  const S3Url url_;
};

class S3LockHeld final : public DirLock::Held {
 public:
  S3LockHeld(S3Storage* storage, std::string dir) : storage_(storage), dir_(std::move(dir)) {}
  ~S3LockHeld() override { storage_->Unlock(dir_); }

 private:
  S3Storage* const storage_;
  const std::string dir_;
};

}  // namespace

S3Storage::S3Storage(std::unique_ptr<S3Client> client, S3StorageOptions options)
    : client_(std::move(client)), options_(std::move(options)) {}

absl::StatusOr<std::shared_ptr<const Directory>> S3Storage::OpenDirectory(const std::string& path,
                                                                          bool /*confine*/,
                                                                          bool /*follow_last*/) {
  auto url = ParseS3Url(path);
  if (!url.ok()) return url.status();
  return std::shared_ptr<const Directory>(new S3Directory(this, *std::move(url)));
}

absl::StatusOr<std::unique_ptr<RandomAccessFile>> S3Storage::OpenFile(const std::string& path) {
  auto url = ParseS3Url(path);
  if (!url.ok()) return url.status();
  S3Client& client = ClientFor(*url);
  if (std::optional<ObjectInfo> listed = Listed(*url)) {
    return std::unique_ptr<RandomAccessFile>(new S3File(&client, *std::move(url), *listed));
  }
  auto info = client.Head(url->bucket, url->key);
  if (!info.ok()) return info.status();
  return std::unique_ptr<RandomAccessFile>(new S3File(&client, *std::move(url), *info));
}

absl::StatusOr<FileStamp> S3Storage::Stat(const std::string& path) {
  auto url = ParseS3Url(path);
  if (!url.ok()) return url.status();
  if (!url->key.empty()) {
    auto info = ClientFor(*url).Head(url->bucket, url->key);
    if (info.ok()) return StampOf(url->bucket, *info);
    if (!absl::IsNotFound(info.status())) return info.status();
  }
  // A prefix: its stamp is its listing's (names, sizes, ETags, one level),
  // so a version written, replaced or removed beneath it changes the stamp,
  // as a POSIX directory's mtime changes.
  auto all = Listing(*url);
  if (!all.ok()) return all.status();
  if (all->objects.empty() && all->common_prefixes.empty()) {
    return absl::NotFoundError(absl::StrCat(path, ": no such object or prefix"));
  }
  XXH3_state_t* h = XXH3_createState();
  XXH3_64bits_reset(h);
  FileStamp st;
  for (const ListedObject& o : all->objects) {
    XXH3_64bits_update(h, o.key.data(), o.key.size() + 1);  // with its NUL: unambiguous
    XXH3_64bits_update(h, o.etag.data(), o.etag.size() + 1);
    XXH3_64bits_update(h, &o.size, sizeof o.size);
    st.mtime_ns = std::max(st.mtime_ns, ParseTimeNs(o.last_modified));
  }
  for (const std::string& p : all->common_prefixes) XXH3_64bits_update(h, p.data(), p.size() + 1);
  st.ino = XXH3_64bits_digest(h);
  XXH3_freeState(h);
  st.dev = XXH3_64bits(url->bucket.data(), url->bucket.size());
  st.size = all->objects.size() + all->common_prefixes.size();
  st.ctime_ns = st.mtime_ns;
  return st;
}

absl::StatusOr<PathKind> S3Storage::Kind(const std::string& path) {
  auto url = ParseS3Url(path);
  if (!url.ok()) return url.status();
  if (!url->key.empty()) {
    auto info = ClientFor(*url).Head(url->bucket, url->key);
    if (info.ok()) return PathKind::kFile;
    if (!absl::IsNotFound(info.status())) return info.status();
  }
  auto page = ClientFor(*url).List(url->bucket, url->DirPrefix(), "", "", 1);
  if (!page.ok()) return page.status();
  return page->objects.empty() ? PathKind::kMissing : PathKind::kDirectory;
}

absl::StatusOr<std::string> S3Storage::Canonical(const std::string& path) {
  auto url = ParseS3Url(path);
  if (!url.ok()) return url.status();
  return url->ToString();
}

absl::Status S3Storage::CreateDirectories(const std::string& path) {
  // Prefixes exist once an object is under them.
  auto url = ParseS3Url(path);
  return url.ok() ? absl::OkStatus() : url.status();
}

absl::StatusOr<DirLock> S3Storage::LockDirectory(const std::string& dir, int64_t wait_ms) {
  auto url = ParseS3Url(dir);
  if (!url.ok()) return url.status();
  const std::string key = url->ToString();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (locked_.insert(key).second) break;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return absl::AbortedError(absl::StrCat(
          key, ": another writer in this daemon holds it (a save into this prefix is in progress)",
          wait_ms > 0 ? absl::StrCat("; waited ", wait_ms, " ms") : std::string()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  auto held = std::make_unique<S3LockHeld>(this, key);
  return DirLock(std::shared_ptr<const Directory>(new S3Directory(this, *std::move(url))),
                 std::move(held));
}

absl::StatusOr<S3Storage*> RegisterS3Storage(
    const S3Settings& settings, const S3StorageOptions& options,
    const std::vector<std::pair<std::string, S3Settings>>& roots) {
  const Getenv env = [](const char* name) { return std::getenv(name); };
  auto client = S3Client::Create(settings, env);
  if (!client.ok()) return client.status();
  auto storage = std::make_unique<S3Storage>(*std::move(client), options);
  for (const auto& [root, root_settings] : roots) {
    auto url = ParseS3Url(root);
    if (!url.ok()) return url.status();
    // The daemon's bandwidth cap and request bound are the section's, for
    // every root: a root's own client shares them.
    auto c = S3Client::Create(root_settings, env, storage->client().bounds());
    if (!c.ok()) {
      return absl::Status(c.status().code(), absl::StrCat(root, ": ", c.status().message()));
    }
    storage->AddRootClient(*std::move(url), *std::move(c));
  }
  S3Storage* s = storage.release();  // lives as long as the process
  RegisterSchemeStorage("s3", s);
  return s;
}

void S3Storage::AddRootClient(S3Url root, std::unique_ptr<S3Client> client) {
  roots_.push_back(RootClient{std::move(root), std::move(client)});
}

S3Client& S3Storage::ClientFor(const S3Url& url) {
  const RootClient* best = nullptr;
  for (const RootClient& r : roots_) {
    const bool under = r.root.bucket == url.bucket &&
                       (r.root.key.empty() || url.key == r.root.key ||
                        absl::StartsWith(url.key, r.root.key + "/"));
    if (under && (best == nullptr || r.root.key.size() > best->root.key.size())) best = &r;
  }
  return best != nullptr ? *best->client : *client_;
}

void S3Storage::ForEachClient(const std::function<void(S3Client&)>& fn) {
  fn(*client_);
  for (RootClient& r : roots_) fn(*r.client);
}

absl::StatusOr<ListPage> S3Storage::Listing(const S3Url& dir) {
  const std::string key = absl::StrCat(dir.bucket, "/", dir.DirPrefix());
  const int64_t now = MonotonicNs();
  uint64_t generation = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = listings_.find(key);
    if (it != listings_.end() && now - it->second.at_ns < kListingReuseMs * 1000000) {
      return it->second.page;
    }
    auto g = generations_.find(key);
    if (g != generations_.end()) generation = g->second;
  }
  auto page = ClientFor(dir).ListAll(dir.bucket, dir.DirPrefix(), "/", options_.max_list_entries);
  if (!page.ok()) return page.status();
  absl::MutexLock lock(&mu_);
  // Not kept when this process changed an object beneath the prefix while
  // it was being listed: it may predate that change.
  auto g = generations_.find(key);
  if ((g == generations_.end() ? 0 : g->second) != generation) return page;
  if (listings_.size() >= 256) listings_.clear();  // a bound, not an LRU: entries live 0.5 s
  listings_[key] = CachedListing{now, *page};
  return page;
}

std::optional<ObjectInfo> S3Storage::Listed(const S3Url& object) {
  const std::string key = ListingKeyOf(object.bucket, object.key);
  const int64_t now = MonotonicNs();
  absl::MutexLock lock(&mu_);
  auto it = listings_.find(key);
  if (it == listings_.end() || now - it->second.at_ns >= kListingReuseMs * 1000000) {
    return std::nullopt;
  }
  // Keys come sorted (ListObjectsV2: UTF-8 binary order); one not found so
  // gets its HEAD.
  const std::vector<ListedObject>& objects = it->second.page.objects;
  auto at = std::lower_bound(objects.begin(), objects.end(), object.key,
                             [](const ListedObject& o, const std::string& k) { return o.key < k; });
  if (at == objects.end() || at->key != object.key || at->etag.empty()) return std::nullopt;
  ObjectInfo info;
  info.size = at->size;
  info.etag = at->etag;
  info.mtime_ns = ParseTimeNs(at->last_modified);  // not in its stamp (StampOf)
  return info;
}

void S3Storage::Changed(const std::string& bucket, const std::string& key) {
  const std::string k = ListingKeyOf(bucket, key);
  absl::MutexLock lock(&mu_);
  listings_.erase(k);
  if (generations_.size() >= 4096) generations_.clear();  // a bound; a listing begun before
                                                          // this clear may be kept (0.5 s)
  ++generations_[k];
}

void S3Storage::Unlock(const std::string& dir) {
  absl::MutexLock lock(&mu_);
  locked_.erase(dir);
}

}  // namespace s3
}  // namespace ckpt
