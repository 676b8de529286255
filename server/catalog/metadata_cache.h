// MetadataCache: the checkpoints this daemon opened, kept while none of their
// watched files changed (docs/daemon.md, "The metadata cache").
//
// An entry holds a checkpoint's parsed metadata, the identity (FileStamp) of
// each data file as it was opened, and the files whose change invalidates
// it (the directory, the metadata or index file). Open answers from the
// cache after a stat of those files, else reopens. Entries beyond
// `max_entries` go least recently used first. Saves drop the entries of the
// directories they write (Drop).
//
// Called by the load path, Inspect, Prefetch, the multi-node coordinator and
// the saves. Thread-safe: one mutex guards the index; files are stat'ed and
// opened outside it, so one slow mount does not hold up other loads.
#ifndef CKPTD_SERVER_CATALOG_METADATA_CACHE_H_
#define CKPTD_SERVER_CATALOG_METADATA_CACHE_H_

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/format/checkpoint.h"
#include "core/io/file.h"

namespace ckptd {

class MetadataCache {
 public:
  struct Opened {
    ckpt::Checkpoint checkpoint;
    std::map<std::string, ckpt::FileStamp> stamps;   // data file -> identity
    std::map<std::string, ckpt::FileStamp> watched;  // dir + metadata/index files
  };

  // `max_metadata_bytes`: the largest metadata, index or header file opened.
  MetadataCache(uint64_t max_entries, uint64_t max_metadata_bytes)
      : max_entries_(std::max<uint64_t>(1, max_entries)), max_metadata_bytes_(max_metadata_bytes) {}

  // The checkpoint in `dir` (a resolved path; version `unique_id`, else the
  // newest), from the cache when no watched file changed, else reopened
  // (every file beneath `dir`, no symlinks followed). With `all_files_local`
  // false (a multi-node coordinator), data files need not all be here.
  absl::StatusOr<std::shared_ptr<const Opened>> Open(const std::string& dir,
                                                     std::optional<int64_t> unique_id,
                                                     bool all_files_local = true)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Drops the entries of `dir` and of every checkpoint under it.
  void Drop(const std::string& dir) ABSL_LOCKS_EXCLUDED(mu_);
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    std::shared_ptr<const Opened> opened;
    uint64_t last_used = 0;  // LRU tick
  };
  // Whether every file `opened` watches or reads still has its identity.
  static bool Fresh(const std::string& dir, const Opened& opened);
  static absl::StatusOr<std::shared_ptr<Opened>> Reopen(const std::string& dir,
                                                        std::optional<int64_t> unique_id,
                                                        bool all_files_local,
                                                        uint64_t max_metadata_bytes);

  const uint64_t max_entries_;
  const uint64_t max_metadata_bytes_;
  mutable absl::Mutex mu_;
  // (dir, or dir + "\n(partial)" for a partial open; unique_id or -1).
  std::map<std::pair<std::string, int64_t>, Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t tick_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_CATALOG_METADATA_CACHE_H_
