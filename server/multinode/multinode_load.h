// A load whose ranks span several daemons, on one node (Loads hands it the
// job once this node's ranks are in):
//  1. join the coordinator (or be it) with this node's ranks, targets and
//     readable files; the coordinator plans the whole job (PlanParts) and
//     assigns every read to one node (core/plan/balancer.h);
//  2. check this node's part and run it through the one load path
//     (Loads::RunNodePart) with the reads other nodes make fetched from
//     them, serving this node's reads to those that need them;
//  3. agree on the outcome with every node, then finish the job
//     (Loads::FinishLoadJob) or fail every rank here with the cause.
// The protocol itself is DistJobs' (dist_jobs.h).
//
// Owned by the daemon; runs on the thread of the job's runner.
// Thread-safe: no state of its own.
#ifndef CKPTD_SERVER_MULTINODE_MULTINODE_LOAD_H_
#define CKPTD_SERVER_MULTINODE_MULTINODE_LOAD_H_

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "config/config.h"
#include "proto/peer.pb.h"
#include "server/catalog/metadata_cache.h"
#include "server/cuda/gpu.h"
#include "server/jobs/registry.h"
#include "server/load/loads.h"
#include "server/multinode/dist_jobs.h"

namespace ckptd {

class MultiNodeLoad {
 public:
  // What it uses; every pointer outlives it.
  struct Parts {
    const DaemonConfig* config = nullptr;
    MetadataCache* metadata = nullptr;
    gpu::GpuRuntime* gpu = nullptr;
    JobRegistry* jobs = nullptr;
    DistJobs* dist_jobs = nullptr;
    Loads* loads = nullptr;
  };
  explicit MultiNodeLoad(Parts parts) : p_(parts) {}

  // Runs this node's ranks (`slots`) of multi-node load `job`, which began
  // running at `start` (Loads::MultiNode).
  void Run(const std::shared_ptr<Job>& job, const std::vector<std::shared_ptr<RankSlot>>& slots,
           std::chrono::steady_clock::time_point start);

 private:
  // This node's join (its ranks must agree on the path and
  // coordinator_rank; the node needs a peer_listen).
  absl::StatusOr<peer::v1::JoinRequest> JoinOf(const Job& job,
                                               const std::vector<std::shared_ptr<RankSlot>>& slots);
  // The coordinator's planner (DistJobs::PartsPlanner): the job planned
  // once from every node's join, each read assigned to one node.
  absl::StatusOr<std::map<std::string, peer::v1::PlanPart>> PlanParts(
      const DistJob& dj, const std::vector<std::string>& nodes,
      const std::vector<peer::v1::JoinRequest>& joins, std::chrono::steady_clock::time_point t0);

  const Parts p_;
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_MULTINODE_MULTINODE_LOAD_H_
