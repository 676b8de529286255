// Catalog: the daemon's answers about checkpoints that deliver nothing to a
// rank: Inspect (what a checkpoint holds), ReadCheckpointFile (bytes of its
// own files, for clients that parse a format's metadata themselves),
// Prefetch (read it into the data cache ahead of a job) and Evict (drop it
// from the caches). The gRPC
// service calls them through Daemon; each checks the caller's right to the
// path with the Policy first.
//
// Thread-safe: it keeps no state of its own; the components it uses (policy,
// metadata cache, data cache, cache filler) lock for themselves. Everything
// it points to must outlive it.
#ifndef CKPTD_SERVER_CATALOG_CATALOG_H_
#define CKPTD_SERVER_CATALOG_CATALOG_H_

#include <atomic>
#include <cstdint>

#include "absl/status/statusor.h"
#include "core/cache/cache.h"
#include "core/exec/executor.h"
#include "proto/ckpt.pb.h"
#include "server/api/caller.h"
#include "server/catalog/cache_filler.h"
#include "server/catalog/metadata_cache.h"
#include "server/policy/policy.h"

namespace ckptd {

class Catalog {
 public:
  struct Parts {
    const Policy* policy = nullptr;
    MetadataCache* metadata = nullptr;
    ckpt::HostCache* cache = nullptr;
    CacheFiller* filler = nullptr;
    // How prefetches read (the daemon's io_request_size, io_threads, direct_io).
    uint64_t io_request_size = 0;
    int io_threads = 1;
    ckpt::DirectIo direct_io = ckpt::DirectIo::kNever;
    // The daemon's count of bytes read from storage (Status, metrics).
    std::atomic<uint64_t>* bytes_read_total = nullptr;
  };
  explicit Catalog(Parts parts) : p_(parts) {}

  // The checkpoint's format, versions, tensors and their shards.
  absl::StatusOr<v1::InspectResponse> Inspect(const Caller& caller,
                                              const v1::InspectRequest& request) const;
  // Bytes of one of the checkpoint's own files: its metadata file or a data
  // file the metadata names, checked against the identity the metadata was
  // read with (ABORTED when it changed since), at most kMaxFileRead.
  absl::StatusOr<v1::ReadCheckpointFileResponse> ReadCheckpointFile(
      const Caller& caller, const v1::ReadCheckpointFileRequest& request) const;
  static constexpr uint64_t kMaxFileRead = 2ull << 20;
  // Reads the requested tensors (all when none are named) into the data
  // cache, reserved for the caller's uid.
  absl::StatusOr<v1::PrefetchResponse> Prefetch(const Caller& caller,
                                                const v1::PrefetchRequest& request);
  // Drops the data and metadata cached for the directory and everything
  // under it, once its background fills ended. Admins, or who may save there.
  absl::StatusOr<v1::EvictResponse> Evict(const Caller& caller, const v1::EvictRequest& request);

 private:
  struct Readable {
    std::string dir;  // the resolved path
    std::shared_ptr<const MetadataCache::Opened> opened;
  };
  // The checkpoint a request names (its path and unique_id), once the
  // caller may read it.
  template <typename Request>
  absl::StatusOr<Readable> OpenToRead(const Caller& caller, const Request& request) const;

  const Parts p_;
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_CATALOG_CATALOG_H_
