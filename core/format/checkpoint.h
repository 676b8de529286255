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
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/io/file.h"
#include "core/format/metadata.h"

namespace ckpt {

// kPaddle: PaddlePaddle flex_checkpoint (pickled {uid}.metadata + .distcp);
// kTorchDcp: PyTorch DCP (.metadata + __{rank}_{n}.distcp). See core/format/foreign.h.
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
  // Whether its files were opened confined (OpenOptions::confine); readers
  // of its data (DirectorySource, CachingSource) should use the same.
  bool confine = false;
  // Identity (fstat of the descriptor read) of every file OpenCheckpoint
  // read, by name relative to `dir`: the metadata / index file and each
  // data file whose header was read (all of them unless check_data_files is
  // false for a native checkpoint). Taken from the descriptors the headers
  // came from, so they describe exactly the bytes that were validated.
  std::map<std::string, FileStamp> file_stamps;
};

struct OpenOptions {
  std::optional<int64_t> unique_id;  // default: the newest version
  // Read each data file's header and check it agrees with the metadata
  // (files present, dtype, byte ranges). Cheap: two small preads per file.
  bool check_data_files = true;
  // true: every file named by the checkpoint (metadata, index, data files
  // of any format) is opened beneath the checkpoint directory with no
  // symbolic link anywhere in its name (openat2 RESOLVE_BENEATH |
  // RESOLVE_NO_SYMLINKS; see Storage in core/io/file.h). A process that
  // opens checkpoints for others (the daemon) must set it.
  // false (the default, for the offline tools, which run with their user's
  // own rights): symlinks are followed, since real checkpoint directories
  // are often symlink farms — a HuggingFace hub cache snapshot (files are
  // symlinks into ../../blobs), Bazel runfiles.
  // Either way every file must be a regular file and is opened with
  // O_NONBLOCK (a FIFO never blocks). The directory `dir` itself is opened
  // following symlinks (the daemon resolves it against its roots first).
  bool confine = false;
  // A metadata file ({uid}.metadata, .metadata) larger than this is refused
  // (RESOURCE_EXHAUSTED naming the file, its size and this limit) before it
  // is read. A HuggingFace index (model.safetensors.index.json) is bounded by
  // the smaller of this and 256 MiB.
  uint64_t max_metadata_bytes = 1ull << 30;
};

absl::StatusOr<Checkpoint> OpenCheckpoint(const std::string& dir, const OpenOptions& options = {});

// unique_ids of the `{uid}.metadata` files in `dir`, ascending. Matching is
// exact: uid 1 is never `11.metadata`.
absl::StatusOr<std::vector<int64_t>> ListVersions(const std::string& dir);

// Whether the commit file `name` of a checkpoint (`{uid}.metadata`, DCP's
// `.metadata`) is present in `dir` (as any kind of file, so a symlink
// squatting the name counts too). false when `dir` does not exist.
absl::StatusOr<bool> CommitFileExists(const std::string& dir, const std::string& name);
// Whether version `unique_id` exists in `dir`: CommitFileExists of its
// `{uid}.metadata`, the commit point of a save.
absl::StatusOr<bool> VersionExists(const std::string& dir, int64_t unique_id);

// Opens a checkpoint whose metadata file `metadata_file` (in `dir`, the
// open ckpt->dir) is a pickle held in `bytes`: detects Paddle or torch DCP by
// the root record's class and fills ckpt->format, ckpt->metadata,
// ckpt->skipped_items and the stamps of the data files it reads
// (ckpt->file_stamps). Data files are opened through `dir` (Directory::OpenFile).
absl::Status OpenPickledCheckpoint(Checkpoint* ckpt, const Directory& dir,
                                   const std::string& metadata_file, const std::string& bytes);

}  // namespace ckpt

#endif  // CKPTD_CORE_CHECKPOINT_H_
