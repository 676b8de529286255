// Writing one native version (core/write/writer.h) from a save job's ranks:
// what it needs (NativeSave, taken from the ranks' slots), the data files of
// some or all of its ranks, then the metadata. Used by synchronous saves,
// the persist thread of asynchronous ones and each node of a multi-node save.
// Stateless; the caller holds the directory's lock (PrepareSave done).
#ifndef CKPTD_SERVER_SAVE_NATIVE_SAVE_H_
#define CKPTD_SERVER_SAVE_NATIVE_SAVE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/io/file.h"
#include "core/plan/planner.h"
#include "core/plan/save_plan.h"
#include "core/write/writer.h"
#include "server/jobs/job.h"

namespace ckptd {

// What writing one version needs, taken from the job's ranks, and what it
// wrote.
struct NativeSave {
  std::string id, path;
  int world_size = 0;
  std::set<int> expected;
  ckpt::SavePlan plan;
  bool overwrite = false;
  // Where each rank's copy of a shard lives: (rank, name) -> bytes.
  std::map<std::pair<int, std::string>, const uint8_t*> where;
  std::map<std::string, std::vector<std::string>> flat_mapping;
  std::vector<ckpt::RankTargets> ranks;
};
struct NativeSaved {
  std::map<int, std::set<std::string>> files_of_rank;
  std::vector<std::string> files;
  uint64_t bytes = 0;
  std::vector<std::pair<std::string, ckpt::ShardMeta>> shards;  // (tensor, shard) written
};

// The version `plan` of `job`'s ranks (`slots`, whose destinations hold
// their bytes).
NativeSave NativeSaveOf(const Job& job, const std::vector<std::shared_ptr<RankSlot>>& slots,
                        ckpt::SavePlan plan);
// Writes the data files of `save`'s ranks (`expected`) into `dir`, each
// fsynced and renamed, the directory fsynced; WriteNativeSave then writes
// the metadata (a multi-node save writes it once every node wrote).
// `persisted` (optional) counts the data bytes written; `between` (optional)
// runs before each file and may stop the write.
absl::StatusOr<NativeSaved> WriteNativeFiles(const NativeSave& save,
                                             std::shared_ptr<const ckpt::Directory> dir,
                                             std::atomic<uint64_t>* persisted,
                                             const std::function<absl::Status()>& between);
// Writes the data files and then the metadata of `save` into `dir`.
absl::StatusOr<NativeSaved> WriteNativeSave(const NativeSave& save,
                                            std::shared_ptr<const ckpt::Directory> dir,
                                            std::atomic<uint64_t>* persisted,
                                            const std::function<absl::Status()>& between);

}  // namespace ckptd

#endif  // CKPTD_SERVER_SAVE_NATIVE_SAVE_H_
