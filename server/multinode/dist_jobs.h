// The multi-node jobs this node takes part in, coordinating or not, and the
// protocol between their nodes (docs/multi-node.md):
//  1. every node's ranks are in (the local barrier): the node serving
//     coordinator_rank gathers every node's join, plans once with the
//     planner its caller gives and hands each node its part; the others join
//     it (PlanPartOf; PeerJoin on the coordinator);
//  2. a node checks its part and registers the reads it serves (AdoptPart),
//     runs it with the reads other nodes make fetched from them
//     (PeerReadsFor; PeerFetchRead serves this node's);
//  3. every node reports to the coordinator, which answers all with one
//     outcome (ReportCompletion; PeerComplete), so all succeed or fail
//     together.
// Every wait is bounded by peer_timeout and names who it waited for; every
// peer call is authorized (PeerPlane) before its body runs here.
//
// Owned by the daemon; called by the load and save runners of multi-node
// jobs and by the peer service (server/peer). Thread-safe: `mu_` guards the
// map of jobs and the peers NCCL failed with; each DistJob has its own mutex
// (dist_job.h). Lock order: mu_ before DistJob::mu.
#ifndef CKPTD_SERVER_MULTINODE_DIST_JOBS_H_
#define CKPTD_SERVER_MULTINODE_DIST_JOBS_H_

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "config/config.h"
#include "proto/peer.pb.h"
#include "server/api/caller.h"
#include "server/cuda/gpu.h"
#include "server/jobs/job.h"
#include "server/multinode/dist_job.h"
#include "server/multinode/plan_codec.h"
#include "server/multinode/rendezvous.h"

namespace ckptd {

class PeerPlane;  // server/peer/peer_plane.h

class DistJobs {
 public:
  // `config` (peer_listen, peer_timeout, load_timeout, io_request_size, the
  // NCCL and testing settings), `peers` and `gpu` outlive this object;
  // config.peer_listen is read at each use (set once the peer server bound).
  DistJobs(const DaemonConfig& config, PeerPlane* peers, gpu::GpuRuntime* gpu);

  // Registers this node's record of multi-node job `job` (its ranks on this
  // node); `path` as the ranks named it; `coordinator` when this node serves
  // coordinator_rank.
  std::shared_ptr<DistJob> New(const Job& job, const std::string& path, bool coordinator,
                               const DistJobKind& kind) ABSL_LOCKS_EXCLUDED(mu_);
  // Finished jobs linger `linger` (late joiners get the error, slow fetchers
  // their bytes), then are dropped (no detached timers that could outlive
  // the daemon).
  void Retire(const std::shared_ptr<DistJob>& dj, absl::Duration linger) ABSL_LOCKS_EXCLUDED(mu_);

  // What a coordinator makes of every node's join (`nodes` and their
  // `joins`, in node order; `t0` when the job began gathering): each node's
  // part of the plan, by node.
  using PartsPlanner = std::function<absl::StatusOr<std::map<std::string, peer::v1::PlanPart>>(
      const std::vector<std::string>& nodes, const std::vector<peer::v1::JoinRequest>& joins,
      std::chrono::steady_clock::time_point t0)>;
  // Step 1 of every multi-node job, load or save: this node's plan part and
  // the coordinator it came from. The coordinator gathers every node's join,
  // plans with `plan` and publishes the parts; any other node joins it and
  // checks where its part came from. On failure `dj` is retired (on the
  // coordinator after a short linger, so late joiners still get the error).
  absl::StatusOr<std::pair<peer::v1::PlanPart, std::string>> PlanPartOf(
      const std::shared_ptr<DistJob>& dj, const peer::v1::JoinRequest& own,
      const PartsPlanner& plan);
  // Step 2 of a load: this node's share of `part` from `coordinator`, checked
  // against `pctx` (plan_codec.h) into *out, and the reads it serves to
  // peers registered in `dj`. A refused part is this node's failure
  // (returned, and kept in `dj` for the nodes fetching from it).
  absl::Status AdoptPart(const std::shared_ptr<DistJob>& dj, const peer::v1::PlanPart& part,
                         const std::string& coordinator, PlanPartContext pctx, LocalPart* out);
  // The reads of this node's part `part` of `dj` that peers serve (global
  // read indices, their readers and the spans to fetch of each, taken out of
  // `mine`, AdoptPart's), over gRPC (one FetchReads stream per peer) or
  // NCCL.
  std::unique_ptr<RemoteReads> PeerReadsFor(const std::shared_ptr<DistJob>& dj,
                                            const peer::v1::PlanPart& part, LocalPart& mine);
  // Step 3: this node's part is done (`done`): the coordinator concludes the
  // job (AwaitOutcome here, or Complete sent to `coordinator`), bounded.
  absl::StatusOr<peer::v1::CompleteResponse> ReportCompletion(const std::shared_ptr<DistJob>& dj,
                                                              const std::string& coordinator,
                                                              const peer::v1::CompleteRequest& done);
  // The peers NCCL links recently failed with (their jobs stay on gRPC for
  // a while), and marking them so.
  std::vector<std::string> NcclUnreachable() ABSL_LOCKS_EXCLUDED(mu_);
  void MarkNcclUnreachable(const std::vector<std::string>& nodes) ABSL_LOCKS_EXCLUDED(mu_);

  // The peer service's RPC bodies. `caller` passed PeerPlane::Authorize;
  // `cancelled` polls whether the call went away.
  absl::StatusOr<peer::v1::PlanPart> PeerJoin(const PeerCaller& caller,
                                              const peer::v1::JoinRequest& request,
                                              const std::function<bool()>& cancelled);
  absl::Status PeerFetchRead(const PeerCaller& caller, const peer::v1::FetchReadRequest& request,
                             const std::function<bool(const peer::v1::Chunk&)>& send,
                             const std::function<bool()>& cancelled);
  absl::Status PeerFetchReads(const PeerCaller& caller, const peer::v1::FetchReadsRequest& request,
                              const std::function<bool(const peer::v1::Chunk&)>& send,
                              const std::function<bool()>& cancelled);
  absl::StatusOr<peer::v1::CompleteResponse> PeerComplete(const PeerCaller& caller,
                                                          const peer::v1::CompleteRequest& request,
                                                          const std::function<bool()>& cancelled);
  peer::v1::PingResponse PeerPing(const PeerCaller& caller, const peer::v1::PingRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<peer::v1::LocateResponse> PeerLocate(const PeerCaller& caller,
                                                      const peer::v1::LocateRequest& request,
                                                      const std::function<bool()>& cancelled);

 private:
  friend class PeerReads;  // peer_reads.cc
  // A fetch of `request`'s reads by a node of the job (serve_reads.cc):
  // each needed from here by that node, fetched once, with valid spans; a
  // violation (failing the job) otherwise. Each read's spans as runs into
  // *runs (in the request's order; empty: the whole read).
  absl::Status AdmitFetchLocked(DistJob& dj, const PeerCaller& caller,
                                const peer::v1::FetchReadsRequest& request,
                                std::vector<std::vector<ckpt::SpanRun>>* runs)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(dj.mu);
  // The multi-node job `id` registered here, or null.
  std::shared_ptr<DistJob> Find(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  void PurgeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Coordinator: waits (until dj->deadline) for every rank of the job to
  // join; the nodes and their joins, in node order.
  absl::Status GatherJoins(const std::shared_ptr<DistJob>& dj, const peer::v1::JoinRequest& own,
                           std::vector<std::string>* nodes,
                           std::vector<peer::v1::JoinRequest>* joins);
  // Coordinator: the plan is made (or failed): the joiners get their parts;
  // returns this node's.
  absl::StatusOr<peer::v1::PlanPart> PublishParts(
      const std::shared_ptr<DistJob>& dj, const std::vector<std::string>& nodes,
      const std::string& own_node,
      absl::StatusOr<std::map<std::string, peer::v1::PlanPart>> parts);
  // Coordinator: announces this node (`me`) as the coordinator of `dj` at
  // the job's rendezvous nodes (rendezvous.h); failures are logged (the
  // joiners' wait then names them).
  void Announce(const std::shared_ptr<DistJob>& dj, const std::string& me);
  // Any other node: the coordinator of job `job_id`, as announced at its
  // rendezvous nodes with the MAC only a holder of `job_key` makes; waits
  // until `deadline`.
  absl::StatusOr<std::string> LocateCoordinator(const std::string& job_id, const std::string& me,
                                                const std::string& job_key, absl::Time deadline);
  // Any other node: its part from the coordinator (LocateCoordinator, then
  // one Join), which must carry the MAC only a holder of `job_key` makes.
  absl::StatusOr<std::pair<peer::v1::PlanPart, std::string>> JoinCoordinator(
      const peer::v1::JoinRequest& own, const std::string& job_key, absl::Time deadline);
  // Coordinator: every node's completion gathered (nodes that went away
  // found by Ping), the job's outcome.
  absl::StatusOr<peer::v1::CompleteResponse> AwaitOutcome(const std::shared_ptr<DistJob>& dj,
                                                          const peer::v1::CompleteRequest& own);

  const DaemonConfig& config_;
  PeerPlane* const peers_;
  gpu::GpuRuntime* const gpu_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<DistJob>> jobs_ ABSL_GUARDED_BY(mu_);
  // Peers this node failed to connect NCCL links with, until when it keeps
  // their jobs on gRPC.
  std::map<std::string, absl::Time> nccl_unreachable_ ABSL_GUARDED_BY(mu_);
  // The jobs this node is a rendezvous node of (thread-safe on its own).
  Rendezvous rendezvous_;
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_MULTINODE_DIST_JOBS_H_
