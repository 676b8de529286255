// Checkpoints in S3-compatible object storage behind core/io's Storage
// interface: "s3://bucket/prefix" is a directory (a key prefix), its objects
// are files (read by ranged GETs pinned to the ETag they had when opened, so
// an object replaced mid-load aborts it instead of mixing versions), and
// files are written through a local spool then one PUT (multipart above
// `part_bytes`), which S3 makes visible only once complete.
//
// Stat of a prefix (a directory) is the stamp of its one-level listing, so
// a version added, replaced or removed beneath it changes it, as a POSIX
// directory's mtime changes.
//
// What differs from POSIX: no permissions (FileStamp::has_owner false: the
// daemon's per-root rules decide), no symbolic links (`confine` holds
// trivially), and LockDirectory serialises writers in this process only
// (object stores have no locks; two daemons saving into one prefix is the
// operator's to prevent).
#ifndef CKPTD_CORE_IO_S3_S3_STORAGE_H_
#define CKPTD_CORE_IO_S3_S3_STORAGE_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "core/io/file.h"
#include "core/io/s3/s3_client.h"
#include "core/io/s3/s3_url.h"

namespace ckpt {
namespace s3 {

struct S3StorageOptions {
  // Files written up to this size go up in one PUT; larger ones in parts of
  // this size (S3 allows 10,000 parts of 5 MiB to 5 GiB).
  uint64_t part_bytes = 64ull << 20;
  // Where writers spool a file before uploading it (O_TMPFILE); empty:
  // $TMPDIR, else /tmp.
  std::string spool_dir;
  // A listing with more entries than this is refused.
  size_t max_list_entries = 1000000;
};

class S3Storage final : public Storage {
 public:
  S3Storage(std::unique_ptr<S3Client> client, S3StorageOptions options);
  // The default client (the config's `s3` section and the AWS variables).
  S3Client& client() { return *client_; }
  // Paths under `root` (s3://bucket[/prefix]) go through `client` (their own
  // endpoint, region, credentials). Call before the storage is used.
  void AddRootClient(S3Url root, std::unique_ptr<S3Client> client);
  // The client of the longest root holding `url`, else the default one.
  S3Client& ClientFor(const S3Url& url);
  // The default client, then each root's (statistics).
  void ForEachClient(const std::function<void(S3Client&)>& fn);
  const S3StorageOptions& options() const { return options_; }

  absl::StatusOr<std::shared_ptr<const Directory>> OpenDirectory(const std::string& path,
                                                                 bool confine,
                                                                 bool follow_last) override;
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFile(const std::string& path) override;
  absl::StatusOr<FileStamp> Stat(const std::string& path) override;
  absl::StatusOr<PathKind> Kind(const std::string& path) override;
  absl::StatusOr<std::string> Canonical(const std::string& path) override;
  absl::Status CreateDirectories(const std::string& path) override;
  absl::StatusOr<DirLock> LockDirectory(const std::string& dir, int64_t wait_ms) override;

  // For the directory's lock: releases `dir`.
  void Unlock(const std::string& dir);

  // The one-level listing of the objects beneath `dir` (its DirPrefix): a
  // listing made in the last kListingReuse is reused (the stamp of a prefix
  // and the names of a checkpoint opened right after it are one request,
  // not two), unless this process wrote or removed an object beneath it
  // since.
  absl::StatusOr<ListPage> Listing(const S3Url& dir);
  // This process changed an object: listings of its prefix are stale.
  void Changed(const std::string& bucket, const std::string& key);
  // The object's size, ETag and time as a listing of its prefix made in the
  // last kListingReuse shows it: what opening it right after the listing
  // needs, without a HEAD of its own (its reads are pinned to that ETag; its
  // stamp is the one a HEAD gives, see StampOf). nullopt when no such
  // listing holds it; never lists.
  std::optional<ObjectInfo> Listed(const S3Url& object) ABSL_LOCKS_EXCLUDED(mu_);

  static constexpr int64_t kListingReuseMs = 500;

 private:
  struct CachedListing {
    int64_t at_ns = 0;
    ListPage page;
  };
  struct RootClient {
    S3Url root;
    std::unique_ptr<S3Client> client;
  };
  std::unique_ptr<S3Client> client_;
  std::vector<RootClient> roots_;  // set before use, then read-only
  const S3StorageOptions options_;
  absl::Mutex mu_;
  absl::flat_hash_set<std::string> locked_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, CachedListing> listings_ ABSL_GUARDED_BY(mu_);
  // Per listing key: bumped by Changed (a listing made across it is not kept).
  absl::flat_hash_map<std::string, uint64_t> generations_ ABSL_GUARDED_BY(mu_);
};

// Creates an S3Storage from `settings`, the environment and the AWS files,
// and registers it for "s3://" paths (RegisterSchemeStorage): what ckptd and
// ckptctl do at start. The storage lives as long as the process; a later
// call replaces the registration (the earlier storage stays allocated).
// `roots`: s3:// roots with their own settings (endpoint, region, profile,
// ...), each served by a client of its own.
absl::StatusOr<S3Storage*> RegisterS3Storage(
    const S3Settings& settings, const S3StorageOptions& options = {},
    const std::vector<std::pair<std::string, S3Settings>>& roots = {});

// The stamp of an object: size, Last-Modified as mtime and ctime, the
// ETag's hash as the inode (a rewritten object gets a new ETag).
FileStamp StampOf(const std::string& bucket, const ObjectInfo& info);

}  // namespace s3
}  // namespace ckpt

#endif  // CKPTD_CORE_IO_S3_S3_STORAGE_H_
