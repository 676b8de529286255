// Converting a checkpoint of any readable format (PaddlePaddle, PyTorch DCP,
// HuggingFace) into ckptd's native format, shard for shard (`ckptctl
// convert`). An offline tool: it opens the source with OpenCheckpoint and
// writes with ShardCheckpoint (offline.h).
#ifndef CKPTD_CORE_CONVERT_H_
#define CKPTD_CORE_CONVERT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/format/checkpoint.h"

namespace ckpt {

struct ConvertOptions {
  std::optional<int64_t> source_unique_id;
  int64_t unique_id = 0;  // version written
  int threads = 2;
  bool confine = false;  // for the source checkpoint (OpenOptions::confine)
  bool overwrite = false;  // as ShardOptions::overwrite
};

struct ConvertReport {
  CheckpointFormat source_format = CheckpointFormat::kNative;
  int files_written = 0;
  size_t tensors = 0;
  uint64_t bytes = 0;
  std::vector<std::string> skipped_items;
};

// Writes the checkpoint at `src_dir` (any readable format) into `out_dir` in
// the native format, shard for shard: each source data file becomes one
// rank's `{rank}_{uid}.safetensors` (pieces of one tensor that a source file
// held apart, such as Paddle's split big params, are joined back; replicas
// are not copied), with checksums.
absl::StatusOr<ConvertReport> ConvertCheckpoint(const std::string& src_dir,
                                                const std::string& out_dir,
                                                const ConvertOptions& options);

}  // namespace ckpt

#endif  // CKPTD_CORE_CONVERT_H_
