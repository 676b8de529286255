// An S3 client over libcurl: HEAD, ranged GET, ListObjectsV2, PUT,
// multipart uploads and DELETE, signed with AWS signature V4 (libcurl's
// CURLOPT_AWS_SIGV4), connections kept alive in a pool of handles, and
// retries with exponential backoff and jitter on 5xx, SlowDown, resets,
// stalls and short bodies, within the caller's deadline. Errors name the
// object ("s3://bucket/key: ...") and what the server said; 404 is
// NOT_FOUND, 403 PERMISSION_DENIED, a precondition that failed (If-Match: the
// object changed) ABORTED. Thread-safe. Knows nothing of checkpoints.
#ifndef CKPTD_CORE_IO_S3_S3_CLIENT_H_
#define CKPTD_CORE_IO_S3_S3_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/io/s3/s3_config.h"
#include "core/io/s3/s3_xml.h"

namespace ckpt {
namespace s3 {

struct ObjectInfo {
  uint64_t size = 0;
  std::string etag;  // quotes removed
  int64_t mtime_ns = 0;
};

// Requests made and bytes moved, for metrics and benchmarks.
struct ClientStats {
  std::atomic<uint64_t> heads{0}, gets{0}, lists{0}, puts{0}, deletes{0}, retries{0};
  std::atomic<uint64_t> bytes_in{0}, bytes_out{0};
};

// Paces bytes to `rate` per second, all callers together (a virtual clock:
// each Acquire books its bytes after the previous ones and sleeps until its
// slot, with up to 50 ms of burst). rate 0: never waits. Thread-safe.
class RateLimiter {
 public:
  explicit RateLimiter(uint64_t rate) : rate_(rate) {}
  void Acquire(uint64_t n);

 private:
  const uint64_t rate_;
  absl::Mutex mu_;
  int64_t next_ns_ ABSL_GUARDED_BY(mu_) = 0;  // when the booked bytes are through
};

// Bounds the requests in flight, all callers together (max 0: no bound), so
// that a node asks a store for at most so many at once however many loads
// and I/O threads it runs. A caller waits for a slot while the holders move
// bytes; it gives up (UNAVAILABLE, naming what it waited for) once none has
// finished or moved a byte for twice `stall_ns` plus a second (a stalled
// holder is cut after `stall_ns` and frees its slot, so only a wedged one
// gets there). Thread-safe.
class RequestSlots {
 public:
  RequestSlots(int max, int64_t stall_ns) : max_(max), stall_ns_(stall_ns) {}
  absl::Status Acquire(const std::string& what);
  void Release();
  // A holder moved bytes (OnProgress): waiters keep waiting.
  void Moved() { moved_ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_relaxed); }
  int max() const { return max_; }
  // Most requests in flight at once so far, and the seconds callers waited.
  int peak() const;
  double waited_s() const;

 private:
  const int max_;
  const int64_t stall_ns_;
  std::atomic<int64_t> moved_ns_{0};
  mutable absl::Mutex mu_;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int peak_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t waited_ns_ ABSL_GUARDED_BY(mu_) = 0;
};

class S3Client {
 public:
  // The bounds a client paces its requests by: its own (made from its
  // settings' max_bytes_per_s and max_requests), or ones it shares with
  // other clients (a daemon's roots with settings of their own: one bound
  // for the whole daemon).
  struct Bounds {
    std::shared_ptr<RateLimiter> limiter;
    std::shared_ptr<RequestSlots> slots;
  };
  // `shared`: bounds to use instead of making its own (either may be null).
  static absl::StatusOr<std::unique_ptr<S3Client>> Create(const S3Settings& settings,
                                                          const Getenv& env,
                                                          Bounds shared = {});
  ~S3Client();
  S3Client(const S3Client&) = delete;
  S3Client& operator=(const S3Client&) = delete;

  const Endpoint& endpoint() const { return endpoint_; }
  const ClientStats& stats() const { return stats_; }
  const Bounds& bounds() const { return bounds_; }
  const RequestSlots& slots() const { return *bounds_.slots; }
  // Where the credentials come from (never what they are).
  std::string CredentialsSource();

  absl::StatusOr<ObjectInfo> Head(const std::string& bucket, const std::string& key);
  // Reads exactly `n` bytes at `offset` into `dst`. `if_match`: the ETag the
  // object must still have (ABORTED "changed" otherwise); empty: any.
  absl::Status GetRange(const std::string& bucket, const std::string& key, uint64_t offset,
                        uint64_t n, void* dst, const std::string& if_match);
  // One ListObjectsV2 page.
  absl::StatusOr<ListPage> List(const std::string& bucket, const std::string& prefix,
                                const std::string& delimiter, const std::string& token,
                                int max_keys);
  // Every page, refusing more than `max_entries` objects and prefixes.
  absl::StatusOr<ListPage> ListAll(const std::string& bucket, const std::string& prefix,
                                   const std::string& delimiter, size_t max_entries);
  absl::Status Put(const std::string& bucket, const std::string& key, const void* data,
                   uint64_t n);
  absl::StatusOr<std::string> CreateMultipart(const std::string& bucket, const std::string& key);
  // Returns the part's ETag.
  absl::StatusOr<std::string> UploadPart(const std::string& bucket, const std::string& key,
                                         const std::string& upload_id, int part_number,
                                         const void* data, uint64_t n);
  absl::Status CompleteMultipart(const std::string& bucket, const std::string& key,
                                 const std::string& upload_id,
                                 const std::vector<std::string>& part_etags);
  absl::Status AbortMultipart(const std::string& bucket, const std::string& key,
                              const std::string& upload_id);
  absl::Status Delete(const std::string& bucket, const std::string& key);

  // One request, described to the transport (s3_client.cc).
  struct Call;

 private:
  S3Client(S3Settings settings, Endpoint endpoint, Getenv env, Bounds bounds);
  absl::Status Perform(Call& call);
  absl::Status PerformOnce(Call& call, void* handle);
  void* TakeHandle();
  void ReturnHandle(void* h);

  const S3Settings settings_;
  const Endpoint endpoint_;
  CredentialSource credentials_;
  ClientStats stats_;
  const Bounds bounds_;  // both set
  absl::Mutex mu_;
  std::vector<void*> idle_ ABSL_GUARDED_BY(mu_);  // CURL* kept alive for reuse
};

}  // namespace s3
}  // namespace ckpt

#endif  // CKPTD_CORE_IO_S3_S3_CLIENT_H_
