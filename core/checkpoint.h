// Opening a checkpoint directory: version choice, format detection, and the
// metadata every later stage (planner, daemon caches) works from.
//
// Native checkpoints hold `{rank}_{uid}.safetensors` data files and one
// `{uid}.metadata` JSON file. A directory without metadata that holds
// `model.safetensors.index.json` or `*.safetensors` files is read as a
// HuggingFace checkpoint (each tensor one whole shard); nothing is written
// into it. Opening reads only headers (two preads per data file), never data.
#ifndef CKPTD_CORE_CHECKPOINT_H_
#define CKPTD_CORE_CHECKPOINT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/metadata.h"

namespace ckpt {

// kPaddle: PaddlePaddle flex_checkpoint (pickled {uid}.metadata + .distcp);
// kTorchDcp: PyTorch DCP (.metadata + __{rank}_{n}.distcp). See core/foreign.h.
enum class CheckpointFormat { kNative, kHuggingFace, kPaddle, kTorchDcp };
const char* FormatName(CheckpointFormat f);

struct Checkpoint {
  std::string dir;
  CheckpointFormat format = CheckpointFormat::kNative;
  std::optional<int64_t> unique_id;  // native only
  std::string metadata_file;         // native only: name of the metadata file
  CheckpointMetadata metadata;
  std::vector<std::string> data_files;  // files the metadata references, sorted
  std::vector<int64_t> versions;        // every unique_id present (native)
  // Items of a foreign checkpoint that are not tensors (PyTorch DCP bytes
  // items), left out of `metadata`.
  std::vector<std::string> skipped_items;
};

struct OpenOptions {
  std::optional<int64_t> unique_id;  // default: the newest version
  // Read each data file's header and check it agrees with the metadata
  // (files present, dtype, byte ranges). Cheap: two small preads per file.
  bool check_data_files = true;
};

absl::StatusOr<Checkpoint> OpenCheckpoint(const std::string& dir, const OpenOptions& options = {});

// unique_ids of the `{uid}.metadata` files in `dir`, ascending. Matching is
// exact: uid 1 is never `11.metadata`.
absl::StatusOr<std::vector<int64_t>> ListVersions(const std::string& dir);

}  // namespace ckpt

#endif  // CKPTD_CORE_CHECKPOINT_H_
