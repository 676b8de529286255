// Whole-job operations run in one process, without a daemon: what the
// offline `ckptctl` subcommands and the benchmarks call.
#ifndef CKPTD_CORE_OFFLINE_H_
#define CKPTD_CORE_OFFLINE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/format/checkpoint.h"
#include "core/exec/executor.h"
#include "core/tools/layout.h"
#include "core/plan/planner.h"

namespace ckpt {

struct OfflineLoadOptions {
  std::optional<int64_t> unique_id;
  int threads = 2;
  bool verify_checksums = true;
  uint64_t piece_bytes = ExecuteOptions{}.piece_bytes;  // see ExecuteOptions
  DirectIo direct_io = DirectIo::kNever;                // see ExecuteOptions
  PlanOptions plan;
  // AOA statements applied while loading (the text of a config, see
  // core/plan/aoa.h); empty: none. `aoa_where` names it in error messages.
  std::string aoa;
  std::string aoa_where = "aoa";
  // Open the checkpoint's files confined beneath its directory, no symlink
  // followed (OpenOptions::confine; off by default like there: the offline
  // tools follow symlinks, e.g. into a HuggingFace hub cache's blobs).
  bool confine = false;
  // Fill every destination buffer with this byte before the load (the
  // buffers are zero-filled otherwise): an element the load fails to write
  // then shows as the fill value, not as a plausible 0. For tests and
  // `ckptctl load --fill_byte`.
  std::optional<uint8_t> fill_byte;
  // Deliver through the daemon's process_memory path (process_vm_writev,
  // core/exec/process_memory.h) into this process's own buffers: the executor's
  // remote runs, batches and bounce copies, checked offline (tests).
  bool via_process_memory = false;
};

struct PhaseTimes {
  double open_seconds = 0;  // list + metadata + headers
  double plan_seconds = 0;
  double load_seconds = 0;  // reads + copies (wall)
  double write_seconds = 0;
};

// Buffers of one rank's loaded targets, in RankPlan::targets order; empty
// for missing keys.
struct RankBuffers {
  std::vector<std::vector<uint8_t>> tensors;
};

struct OfflineLoadResult {
  Checkpoint checkpoint;
  LoadPlan plan;
  LoadStats stats;
  PhaseTimes times;
  std::vector<RankBuffers> buffers;  // per rank
};

// Opens `dir`, plans every rank of `layout`, reads and copies.
absl::StatusOr<OfflineLoadResult> LoadOffline(const std::string& dir, const Layout& layout,
                                              const OfflineLoadOptions& options);

// Writes each rank's loaded tensors to `out_dir/rank{r}.safetensors`
// (flattened targets as 1-D tensors of their range; missing keys omitted).
absl::Status WriteRankOutputs(const OfflineLoadResult& result, const std::string& out_dir);

// The load report as JSON: bytes_read, bytes_delivered, missing_keys,
// unexpected_keys, renamed_keys, checksums_verified, per-phase timings,
// per-rank summaries.
std::string LoadReportJson(const OfflineLoadResult& result);

struct ShardOptions {
  std::optional<int64_t> source_unique_id;
  int64_t unique_id = 0;  // of the written checkpoint
  int threads = 2;
  uint64_t checksum_block = 64ull << 20;
  bool confine = false;  // for the source checkpoint (OpenOptions::confine)
  // Replace version unique_id when `out_dir` holds it (else ALREADY_EXISTS, as
  // a daemon's Save answers).
  bool overwrite = false;
};

// Cuts the tensors of the checkpoint at `src_dir` per `layout` and writes a
// native checkpoint into `out_dir`, as if each rank had saved its part
// (replicas written once). Keys of the layout missing in the source are an
// error. `out_dir` is locked (LockDirectory, after resolving symlinks in its
// path) while writing, so it never interleaves with a daemon's Save; an
// existing version is ALREADY_EXISTS unless options.overwrite (PrepareSave).
absl::Status ShardCheckpoint(const std::string& src_dir, const Layout& layout,
                             const std::string& out_dir, const ShardOptions& options);

}  // namespace ckpt

#endif  // CKPTD_CORE_OFFLINE_H_
