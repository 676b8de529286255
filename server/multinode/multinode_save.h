// A native save whose ranks span several daemons, on one node (Saves hands
// it the job once this node's ranks are in). Two phases, so that a version
// is visible only when every byte of it is durable: plan (the coordinator,
// the node serving rank 0, plans once for the whole job: PlanParts),
// prepare (every node writes and fsyncs its ranks' data files: WritePart)
// and commit (once every node prepared, each writes the version's metadata
// from every node's shards: Commit). multinode_save.cc tells the rules; the
// protocol is DistJobs' (dist_jobs.h).
//
// Owned by the daemon; runs on the thread of the job's runner.
// Thread-safe: no state of its own.
#ifndef CKPTD_SERVER_MULTINODE_MULTINODE_SAVE_H_
#define CKPTD_SERVER_MULTINODE_MULTINODE_SAVE_H_

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "config/config.h"
#include "proto/peer.pb.h"
#include "server/catalog/metadata_cache.h"
#include "server/jobs/registry.h"
#include "server/multinode/dist_jobs.h"
#include "server/multinode/plan_codec.h"
#include "server/save/native_save.h"

namespace ckptd {

class MultiNodeSave {
 public:
  // What it uses; every pointer outlives it.
  struct Parts {
    const DaemonConfig* config = nullptr;
    MetadataCache* metadata = nullptr;
    JobRegistry* jobs = nullptr;
    DistJobs* dist_jobs = nullptr;
  };
  explicit MultiNodeSave(Parts parts) : p_(parts) {}

  // Runs this node's ranks (`slots`) of multi-node save `job`
  // (Saves::MultiNode; `version`: the job's, or this node's proposal when
  // the daemons pick it).
  void Run(const std::shared_ptr<Job>& job, const std::vector<std::shared_ptr<RankSlot>>& slots,
           int64_t version);

 private:
  // The coordinator's planner (DistJobs::PartsPlanner).
  absl::StatusOr<std::map<std::string, peer::v1::PlanPart>> PlanParts(
      const DistJob& dj, const std::vector<std::string>& nodes,
      const std::vector<peer::v1::JoinRequest>& joins, std::chrono::steady_clock::time_point t0);
  // This node's share of the part from `coordinator`, checked
  // (plan_codec.h); a refused part fails `dj` here.
  absl::StatusOr<LocalSave> AdoptPart(const Job& job,
                                      const std::vector<std::shared_ptr<RankSlot>>& slots,
                                      const std::shared_ptr<DistJob>& dj,
                                      const peer::v1::PlanPart& part,
                                      const std::string& coordinator, int64_t version);
  // The prepare on this node: its ranks' data files written and fsynced
  // under the directory lock (the metadata waits for Commit).
  absl::StatusOr<NativeSaved> WritePart(const std::shared_ptr<Job>& job,
                                        const std::vector<std::shared_ptr<RankSlot>>& slots,
                                        const LocalSave& local);
  // Every node prepared: the version's metadata, from every node's shards in
  // `outcome`, written here (or found identical, in a shared directory).
  absl::Status Commit(const Job& job, const LocalSave& local,
                      const peer::v1::CompleteResponse& outcome, const std::string& coordinator);

  const Parts p_;
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_MULTINODE_MULTINODE_SAVE_H_
