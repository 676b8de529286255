// Writing checkpoints: the native sharded format and merged HuggingFace
// safetensors.
//
// Saving is split in three steps so callers never hold every rank's data at
// once: PlanSave (core/plan/save_plan.h) decides which rank writes which
// shard (replicated shards once, balanced over the ranks holding them by
// bytes), each rank's file is
// written with WriteRankFile, and FinishSave writes `{uid}.metadata` last —
// the metadata file is the commit point.
//
// Durability and crash safety: every file is written under a temporary name
// ("{name}.tmp.{pid}.{n}"), fsynced, renamed into place and the directory
// fsynced (AtomicFileWriter) — data files first, then the metadata. A
// process killed at any point leaves every earlier version loadable and no
// half version visible: until `{uid}.metadata` is renamed into place the
// new version does not exist for readers (versions are listed by their
// metadata files; leftover temporaries match no name a reader looks for).
// Checksums are computed from a private copy of the bytes that is then
// written (WriteSafetensors), so they match the file even if the source
// memory changes meanwhile.
//
// A writer serving other processes (the daemon) should, per save:
//   auto lock = LockDirectory(dir);              // one writer per directory
//   PrepareSave(*lock->directory(), uid, overwrite);  // ALREADY_EXISTS check
//   WriteRankFile(lock->directory(), ...) per rank; FinishSave(lock->directory(), ...)
#ifndef CKPTD_CORE_WRITER_H_
#define CKPTD_CORE_WRITER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/format/checkpoint.h"
#include "core/io/file.h"
#include "core/format/metadata.h"
#include "core/plan/planner.h"
#include "core/plan/save_plan.h"
#include "core/format/safetensors.h"

namespace ckpt {

// Checks that version `unique_id` may be written into `dir`: when
// `{uid}.metadata` exists, ALREADY_EXISTS "<dir>: version <uid> already
// exists (<uid>.metadata)" unless `overwrite`; with `overwrite` that
// metadata file is removed first and the directory fsynced, so a save that
// dies midway leaves no version `uid` at all rather than the old metadata
// over new data files. Call it with the directory locked (LockDirectory).
absl::Status PrepareSave(const Directory& dir, int64_t unique_id, bool overwrite = false);

// What PrepareSave does, for any format whose checkpoint exists once its
// `commit_file` does (ckptd's `{uid}.metadata`, DCP's `.metadata`): when it
// exists, ALREADY_EXISTS with `exists_message` unless `overwrite`; with
// `overwrite` it is removed and the directory fsynced first.
absl::Status PrepareCommitFile(const Directory& dir, const std::string& commit_file,
                               const std::string& exists_message, bool overwrite);

// Writes rank `rank`'s data file. `data[i]` holds plan.writes[rank][i]
// (num_bytes() bytes). Returns the shard metadata of what was written.
absl::StatusOr<std::vector<std::pair<std::string, ShardMeta>>> WriteRankFile(
    const std::string& dir, const SavePlan& plan, int rank, const std::vector<const void*>& data);
// The same into an open directory (e.g. DirLock::directory()).
absl::StatusOr<std::vector<std::pair<std::string, ShardMeta>>> WriteRankFile(
    std::shared_ptr<const Directory> dir, const SavePlan& plan, int rank,
    const std::vector<const void*>& data);

// The `{uid}.metadata` document for the shards every rank wrote, checked
// (the shards together hold every planned tensor whole; INVALID_ARGUMENT
// naming `where` otherwise). FinishSave writes it; a multi-node save builds
// it on every node from the shards all nodes reported.
absl::StatusOr<std::string> SaveMetadataJson(
    const SavePlan& plan, const std::vector<std::pair<std::string, ShardMeta>>& shards,
    const std::map<std::string, std::vector<std::string>>& flat_mapping, const std::string& where);

// Writes `{uid}.metadata` from the shards every rank wrote (temp name,
// fsync, rename, directory fsync: the commit point of the version).
absl::Status FinishSave(const std::string& dir, const SavePlan& plan,
                        const std::vector<std::pair<std::string, ShardMeta>>& shards,
                        const std::map<std::string, std::vector<std::string>>& flat_mapping = {});
absl::Status FinishSave(std::shared_ptr<const Directory> dir, const SavePlan& plan,
                        const std::vector<std::pair<std::string, ShardMeta>>& shards,
                        const std::map<std::string, std::vector<std::string>>& flat_mapping = {});

// File name of a rank's data file: "{rank}_{uid}.safetensors".
std::string DataFileName(int rank, int64_t unique_id);

struct MergeOptions {
  std::string prefix;                     // keep keys starting with it; strip "prefix."
  std::vector<std::string> skip_postfix;  // drop keys ending with any of these
  int shards = 1;                         // number of output files
  std::string file_prefix = "model";
  int threads = 2;
};

struct MergeReport {
  std::vector<std::string> files;
  uint64_t total_size = 0;
  size_t tensors = 0;
};

// Loads every kept tensor whole and writes HuggingFace safetensors files
// `{file_prefix}-{i:05d}-of-{N:05d}.safetensors` plus
// `{file_prefix}.safetensors.index.json` into `out_dir` (created if needed).
// Keys are split over files like Paddle's divide_positions (the first m % N
// files get one more). One output file's tensors are in memory at a time.
absl::StatusOr<MergeReport> MergeToHuggingFace(const Checkpoint& checkpoint,
                                               const std::string& out_dir,
                                               const MergeOptions& options);

// Creates `dir` and its parents if missing, each new directory made durable
// (Storage::Default()->CreateDirectories).
absl::Status MakeDirs(const std::string& dir);

}  // namespace ckpt

#endif  // CKPTD_CORE_WRITER_H_
