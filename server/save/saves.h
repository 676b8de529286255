// Saves (docs/saving.md). Every Save rank goes through Save: its output
// directory resolved and checked, the request against the limits and the
// caller's access, its bytes (a segment, or device tensors staged to host)
// and, for an asynchronous save, its save_buffer room taken; its rank
// registered in its job. The rank that completes the job's barrier runs the
// job (RunSaveJob): the plan for every rank here (a replicated shard
// written once), then
//  - a synchronous native save: the version's data files and metadata
//    written under the directory's lock (native_save.h), every rank
//    answered once it is durable;
//  - an asynchronous one: the bytes handed to AsyncSaves, every rank
//    answered at once;
//  - a PyTorch DCP save: its data files, then the commit of its .metadata
//    by a later call of the same job (saves_dcp.cc);
//  - ranks on several daemons: the multi-node save, two-phase
//    (server/multinode/multinode_save.h).
//
// Owned by the daemon; Save runs on the RPC threads, the job on the thread
// of the rank that completed its barrier. Thread-safe: no state of its own;
// the parts it uses lock for themselves.
#ifndef CKPTD_SERVER_SAVE_SAVES_H_
#define CKPTD_SERVER_SAVE_SAVES_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "config/config.h"
#include "core/cache/cache.h"
#include "core/io/file.h"
#include "core/plan/save_plan.h"
#include "proto/ckpt.pb.h"
#include "server/api/caller.h"
#include "server/catalog/metadata_cache.h"
#include "server/delivery/opener.h"
#include "server/jobs/registry.h"
#include "server/policy/policy.h"
#include "server/save/async_saves.h"
#include "server/save/save_buffer.h"

namespace ckptd {

// A save job is done: `answer` fills each rank's SaveResponse (under the
// slot's mu), the ranks are released and the job leaves `jobs`.
void FinishSaveJob(JobRegistry& jobs, Job& job, const std::vector<std::shared_ptr<RankSlot>>& slots,
                   const std::function<void(const RankSlot&, v1::SaveResponse&)>& answer);

// Puts the files of a version just made durable in `dir` (the directory the
// save locked, still locked) into `cache` (read back from the page cache),
// so loading it right away reads no storage; a file that changed meanwhile
// is left out.
void PublishSaved(ckpt::HostCache* cache, const ckpt::Directory& dir,
                  const std::vector<std::string>& files);

class Saves {
 public:
  // What it uses; every pointer outlives it.
  struct Parts {
    const DaemonConfig* config = nullptr;
    Policy* policy = nullptr;
    MetadataCache* metadata = nullptr;
    DestinationOpener* opener = nullptr;
    JobRegistry* jobs = nullptr;
    SaveBuffer* save_buffer = nullptr;
    AsyncSaves* async_saves = nullptr;
  };
  // Runs a native save whose ranks span several daemons from its ranks here;
  // `version` is the job's unique_id, or (SaveRequest.next_unique_id) the one
  // this daemon would pick (NextVersion), its proposal to the coordinator.
  using MultiNode = std::function<void(const std::shared_ptr<Job>& job,
                                       const std::vector<std::shared_ptr<RankSlot>>& slots,
                                       int64_t version)>;

  explicit Saves(Parts parts) : p_(parts) {}
  // The multi-node save: set once by the daemon, before any Save.
  void SetMultiNode(MultiNode run) { multi_node_ = std::move(run); }

  // Runs one rank's Save: waits for the job's ranks, then writes the
  // version once for all of them (or, async_save, hands it to the persist
  // thread).
  absl::StatusOr<v1::SaveResponse> Save(const Caller& caller, const v1::SaveRequest& request,
                                        const std::function<bool()>& cancelled);

 private:
  void RunSaveJob(const std::shared_ptr<Job>& job);
  // A Save's output directory: (its resolved parent, the directory), which
  // need not exist yet; a relative path is under the first root.
  absl::StatusOr<std::pair<std::string, std::string>> ResolveSaveDir(
      const v1::SaveRequest& request) const;
  // The version a save with next_unique_id writes into `dir`: one more than
  // the newest there, visible or still persisting; 0 if none.
  absl::StatusOr<int64_t> NextVersion(const std::string& dir) const;
  // An existing output directory: a real directory the caller may save
  // into, without the version (or DCP checkpoint) unless overwrite is set.
  absl::Status CheckSaveDir(const Caller& caller, const v1::SaveRequest& request,
                            const std::string& dir, bool dcp) const;
  // The rank's slot of a save: its targets and segment checked as a load's
  // (`bytes`: what CheckRequestLimits charged), device tensors staged to
  // host, and (async_save) what it will hold of save_buffer, refused when
  // more than all of it.
  absl::StatusOr<std::shared_ptr<RankSlot>> PrepareSaveSlot(const Caller& caller,
                                                            const v1::SaveRequest& request,
                                                            const std::string& who, uint64_t bytes);
  // Ranks copying their bytes at once when an asynchronous save is staged.
  static constexpr size_t kStageThreads = 8;
  // An asynchronous save job's ranks are all in: its save_buffer room
  // charged (waiting for persists to free it, until the barrier timeout or
  // every client left), then the daemon's own copy of each rank's bytes
  // whose segment was not handed over.
  absl::Status StageAsyncSave(Job& job, const std::vector<std::shared_ptr<RankSlot>>& slots);
  // An asynchronous save job's ranks are all in and its plan holds: staged
  // (StageAsyncSave), their bytes move into a pending save queued for the
  // persist thread (AsyncSaves::Start), and every rank gets its first answer
  // (persisted false).
  void StartAsyncSave(const std::shared_ptr<Job>& job,
                      const std::vector<std::shared_ptr<RankSlot>>& slots, ckpt::SavePlan plan);
  // PyTorch DCP saves (SaveRequest.format "pytorch-dcp", saves_dcp.cc): the data
  // files of a job, and the commit of its `.metadata` (dcp_metadata).
  void WriteDcpSave(const std::shared_ptr<Job>& job,
                    const std::vector<std::shared_ptr<RankSlot>>& slots, const ckpt::SavePlan& plan,
                    std::shared_ptr<const ckpt::Directory> dir,
                    const std::map<std::pair<int, std::string>, const uint8_t*>& where,
                    std::chrono::steady_clock::time_point t0);
  absl::StatusOr<v1::SaveResponse> CommitDcp(const Caller& caller, const v1::SaveRequest& request,
                                             const std::string& parent, const std::string& dir);

  const Parts p_;
  MultiNode multi_node_;
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_SAVE_SAVES_H_
