// Executes a LoadPlan: reads each planned byte range once and copies every
// rank's slices into the buffers the caller owns.
//
// Reads run on a few threads; each read's copies run right after it on the
// same thread while its bytes are hot in cache. Shards entirely inside a read
// are checked against their XXH3 checksum. On any error nothing is reported
// as loaded: the caller gets the error (naming file, tensor and rank).
#ifndef CKPTD_CORE_EXECUTOR_H_
#define CKPTD_CORE_EXECUTOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/file.h"
#include "core/planner.h"

namespace ckpt {

// Where planned bytes come from. Implementations must be thread-safe.
class RangeSource {
 public:
  virtual ~RangeSource() = default;
  // Reads `n` bytes at `offset` of checkpoint file `file` into `dst`.
  virtual absl::Status Read(const std::string& file, uint64_t offset, uint64_t n, void* dst) = 0;
};

// Reads files of one checkpoint directory with pread; opens each file once.
class DirectorySource final : public RangeSource {
 public:
  explicit DirectorySource(std::string dir) : dir_(std::move(dir)) {}
  absl::Status Read(const std::string& file, uint64_t offset, uint64_t n, void* dst) override;

 private:
  absl::StatusOr<const RandomAccessFile*> Get(const std::string& file);
  const std::string dir_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<RandomAccessFile>> files_ ABSL_GUARDED_BY(mu_);
};

struct ExecuteOptions {
  int threads = 2;
  bool verify_checksums = true;
};

struct LoadStats {
  uint64_t bytes_read = 0;       // from the source (storage)
  uint64_t bytes_delivered = 0;  // written into destination buffers
  int64_t checksums_verified = 0;
  double read_seconds = 0;  // summed over threads
  double copy_seconds = 0;
};

// destinations[i][j] is the buffer of plan.ranks[i].targets[j]
// (targets[j].num_bytes() bytes); it may be null for a missing key.
absl::StatusOr<LoadStats> ExecutePlan(const LoadPlan& plan, RangeSource& source,
                                      const std::vector<std::vector<void*>>& destinations,
                                      const ExecuteOptions& options = {});

}  // namespace ckpt

#endif  // CKPTD_CORE_EXECUTOR_H_
