// The ckptd daemon's engine room: job registry and barrier, checkpoint
// metadata cache, data cache, destinations. The gRPC service (api/service.cc)
// only translates messages and status codes; everything here is testable
// without a network.
//
// Thread-safe: every RPC runs on its own gRPC thread. Each mutex guards
// fields of its own object (ABSL_GUARDED_BY, checked by clang's
// -Wthread-safety); the components have their own (server/jobs/registry.h:
// the registry, Job::mu, RankSlot::mu; multinode/dist_jobs.h: the
// multi-node jobs, DistJob::mu; save/async_saves.h: the asynchronous
// saves, PendingSave::mu; save/save_buffer.h; the policy, the metadata and
// data caches, the peer plane). The daemon holds no lock of its own: what
// it is made with is set before it serves and read-only after.
//
// Lock order: each component's locks are taken inside that component; no
// thread holds the locks of two of them (the jobs', the multi-node jobs',
// the asynchronous saves') together.
#ifndef CKPTD_SERVER_DAEMON_H_
#define CKPTD_SERVER_DAEMON_H_

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "config/config.h"
#include "core/cache/cache.h"
#include "core/format/checkpoint.h"
#include "core/exec/executor.h"
#include "core/plan/planner.h"
#include "core/write/writer.h"
#include "proto/ckpt.pb.h"
#include <grpcpp/security/server_credentials.h>

#include "server/delivery/arena_pool.h"
#include "server/catalog/cache_filler.h"
#include "server/catalog/catalog.h"
#include "server/api/caller.h"
#include "server/catalog/metadata_cache.h"
#include "server/cuda/gpu.h"
#include "server/delivery/destination.h"
#include "server/delivery/mapped_segment.h"
#include "server/delivery/fd_channel.h"
#include "server/jobs/registry.h"
#include "server/policy/policy.h"
#include "server/save/async_saves.h"
#include "server/save/native_save.h"
#include "server/save/save_buffer.h"
#include "server/delivery/view_leases.h"

namespace ckptd {

// The peer protocol's messages (proto/peer.proto), named here only: the
// files of the multi-node code include it (multinode/dist_jobs.h), the rest of the
// daemon does not see it.
namespace peer::v1 {
class Chunk;
class CompleteRequest;
class CompleteResponse;
class FetchReadRequest;
class JoinRequest;
class PingRequest;
class PingResponse;
class PlanPart;
}  // namespace peer::v1
class PeerPlane;     // server/peer/peer_plane.h
class DistJobs;      // server/multinode/dist_jobs.h
struct DistJob;      // server/multinode/dist_job.h
class RemoteReads;   // server/multinode/dist_job.h

struct JobFigures;     // daemon_internal.h
struct LoadJobRecord;  // metrics.h
struct LocalPart;      // plan_codec.h
struct LocalSave;      // plan_codec.h
struct PlanPartContext;  // plan_codec.h

class Daemon {
 public:
  explicit Daemon(DaemonConfig config);
  ~Daemon();

  // Starts the fd receiver beside the gRPC socket.
  absl::Status Start();
  void Stop();

  // Every call names its caller (caller.h): access to roots, job ids,
  // tokens and limits are decided by it (docs/security.md).
  absl::StatusOr<v1::InspectResponse> Inspect(const Caller& caller,
                                              const v1::InspectRequest& request);
  // Runs one rank's Load. `send` writes an event to the client (false when
  // the stream is gone); `cancelled` tells whether the client went away.
  absl::Status Load(const Caller& caller, const v1::LoadRequest& request,
                    const std::function<bool(const v1::LoadEvent&)>& send,
                    const std::function<bool()>& cancelled);
  // Runs one rank's Save: waits for the job's ranks, then writes the native
  // format once for all of them.
  absl::StatusOr<v1::SaveResponse> Save(const Caller& caller, const v1::SaveRequest& request,
                                        const std::function<bool()>& cancelled);
  // The outcome of asynchronous save job `request.job_id()` for one of its
  // ranks, waiting up to request.timeout_ms() for it to become durable
  // (DEADLINE_EXCEEDED while it is still persisting). Only the job's owner
  // (or an admin) may ask.
  absl::StatusOr<v1::SaveResponse> AwaitSave(const Caller& caller,
                                             const v1::AwaitSaveRequest& request,
                                             const std::function<bool()>& cancelled);
  // SIGTERM (main.cc): waits up to `timeout` for the asynchronous saves still
  // persisting; returns the ids of those that did not finish (Stop then
  // abandons them: their versions never become visible).
  std::vector<std::string> AwaitPersists(absl::Duration timeout);
  absl::StatusOr<v1::PrefetchResponse> Prefetch(const Caller& caller,
                                                const v1::PrefetchRequest& request);
  absl::StatusOr<v1::EvictResponse> Evict(const Caller& caller, const v1::EvictRequest& request);
  // Jobs: only the caller's own unless it is an admin.
  v1::StatusResponse Status(const Caller& caller = Caller());
  // The version and API level of this build (VERSION): any caller may ask.
  static v1::VersionResponse Version();
  // The drain ran out (SIGTERM + drain_timeout, main.cc): every load job
  // still waiting or running fails now, each of its ranks with UNAVAILABLE
  // "job '<id>': <why>"; a running job stops before its next read. Returns
  // the ids of the jobs it failed.
  std::vector<std::string> AbortLoads(const std::string& why) { return jobs_.AbortLoads(why); }

  // The peer plane (server/peer/peer_plane.h): the peer set, who may call
  // the peer service, TLS, channels and health.
  PeerPlane& peer_plane() { return *peers_; }
  // The multi-node jobs of this node and the protocol between their nodes
  // (server/multinode/dist_jobs.h): the peer service's calls go there.
  DistJobs& dist_jobs() { return *dist_jobs_; }

  const DaemonConfig& config() const { return config_; }
  // This node's peer address once the peer server has bound it: main calls
  // it once, right after PeerServer::Start, before anything else reads
  // config().peer_listen (a "host:0" peer_listen becomes "host:N", the
  // node's identity in plans and the peer set). Until then peer calls are
  // refused (UNAVAILABLE).
  void SetPeerListen(const std::string& bound);



 private:
  // Runs a job whose ranks span several daemons (node_ranks a strict subset
  // of the world; RunJob calls it): join the coordinator (or be it), run
  // this node's part of the plan (RunNodePart) with remote reads fetched
  // from peers, agree on the outcome.
  void RunDistributedJob(const std::shared_ptr<Job>& job,
                         const std::vector<std::shared_ptr<RankSlot>>& slots,
                         std::chrono::steady_clock::time_point start);
  // A multi-node load's join for this node's ranks (they must agree on the
  // path and coordinator_rank; the node needs a peer_listen).
  absl::StatusOr<peer::v1::JoinRequest> LoadJoinOf(const Job& job,
                                                   const std::vector<std::shared_ptr<RankSlot>>& slots);
  // What LocalPartOf/LocalSaveOf check a part from `coordinator` against:
  // the job, this node and its ranks' targets.
  PlanPartContext PartContext(const Job& job, const std::vector<std::shared_ptr<RankSlot>>& slots,
                              const std::string& coordinator) const;
  // The planners of a multi-node load and save (DistJobs::PartsPlanner).
  absl::StatusOr<std::map<std::string, peer::v1::PlanPart>> PlanLoadParts(
      const DistJob& dj, const std::vector<std::string>& nodes,
      const std::vector<peer::v1::JoinRequest>& joins, std::chrono::steady_clock::time_point t0);
  absl::StatusOr<std::map<std::string, peer::v1::PlanPart>> PlanSaveParts(
      const DistJob& dj, const std::vector<std::string>& nodes,
      const std::vector<peer::v1::JoinRequest>& joins, std::chrono::steady_clock::time_point t0);
  // A save whose ranks span several daemons (daemon_multinode_save.cc):
  // two-phase, every node writes and fsyncs its ranks' files (prepare), and
  // only when every node did, each writes the version's metadata (commit).
  void RunDistributedSave(const std::shared_ptr<Job>& job,
                          const std::vector<std::shared_ptr<RankSlot>>& slots);
  // A Load's rank slot: its targets checked (NewRankSlot) and its
  // destination opened (daemon_destinations.cc).
  absl::StatusOr<std::shared_ptr<RankSlot>> PrepareSlot(const Caller& caller,
                                                        const v1::LoadRequest& request);
  // What a Load's and a Save's rank share: who it is (job, rank, world,
  // node_ranks) and its targets, checked into a new slot with no destination
  // yet. `verb` ("Load", "Save") names the call in errors.
  static absl::StatusOr<std::shared_ptr<RankSlot>> NewRankSlot(
      absl::string_view verb, const std::string& job_id, int rank, int world_size,
      const google::protobuf::RepeatedField<int32_t>& node_ranks,
      const google::protobuf::RepeatedPtrField<v1::Target>& targets);
  // The destination of `request` (shm, cuda_ipc, process_memory or stream),
  // checked and opened: what the daemon alone knows (the caller, the fd
  // socket, lent arenas, the data cache, the GPU runtime) handed to
  // delivery/destination.h's implementations.
  absl::StatusOr<std::unique_ptr<Destination>> OpenDestination(const Caller& caller,
                                                               const v1::LoadRequest& request,
                                                               const ckpt::RankTargets& targets,
                                                               const std::string& who);
  // The segment `shm` names: an arena this daemon lent, or the caller's
  // sealed memfd taken from the fd socket (not mapped yet).
  absl::StatusOr<SegmentSource> SegmentSourceOf(const Caller& caller,
                                                const v1::ShmDestination& shm,
                                                const std::string& who);
  // process_memory destinations: checks the caller (on the Unix socket, of
  // the daemon's uid) and the cookie's size; ProcessDestination::Open does
  // the rest (core/exec/process_memory.h).
  absl::StatusOr<std::unique_ptr<Destination>> OpenProcessDestination(
      const Caller& caller, const v1::LoadRequest& request,
      const std::vector<TargetPlace>& targets, const std::string& who);
  // cuda_ipc destinations (daemon_gpu.cc): the host segment of the dest_host
  // targets, then the rank's device buffers checked and opened.
  absl::StatusOr<std::unique_ptr<Destination>> OpenDeviceDestination(
      const Caller& caller, const v1::CudaIpcDestination& cuda_ipc,
      std::vector<TargetPlace> targets, const std::string& who);
  // A save's device tensors (SaveRequest.cuda_ipc): copied device -> host
  // into the daemon's own memory, with the dest_host targets' bytes, and the
  // client's IPC handles closed; `request`'s targets then point into the
  // slot's new segment destination as an shm save's do. The caller waits
  // only for this.
  absl::Status StageDeviceSave(const std::string& who, v1::SaveRequest& request, RankSlot& slot);
  // process_memory with views: offers the rank's cache views to its client
  // and waits until it copied them (server/delivery/view_leases.h).
  absl::Status DeliverViews(const Caller& caller, ckpt::ViewRecorder& views,
                            const std::string& who,
                            const std::function<bool(const v1::LoadEvent&)>& send,
                            const std::function<bool()>& cancelled);
  // A request's barrier_timeout_ms, or the configured barrier_timeout when 0.
  absl::Duration BarrierTimeout(uint32_t barrier_timeout_ms) const {
    return barrier_timeout_ms > 0 ? absl::Milliseconds(barrier_timeout_ms)
                                  : config_.barrier_timeout;
  }
  // The one load path (daemon_load.cc): every load job starts here, single-
  // or multi-node.
  void RunJob(const std::shared_ptr<Job>& job);
  // Runs a node's part of a load plan (the whole plan for a single-node job)
  // into `slots` (plan.ranks in the same order): strict ranks missing keys
  // fail alone, the rest are delivered from `stamps`' files through the data
  // cache, and (multi-node) `remote`'s peers. The job's stats, or why it
  // failed on this node.
  absl::StatusOr<ckpt::LoadStats> RunNodePart(const std::shared_ptr<Job>& job,
                                              const std::vector<std::shared_ptr<RankSlot>>& slots,
                                              const ckpt::LoadPlan& plan,
                                              const std::map<std::string, ckpt::FileStamp>& stamps,
                                              absl::string_view phase, RemoteReads* remote);
  // The job succeeded on this node: the job leaves the registry, `rec`
  // (completed from `fig` and `plan`) is logged and counted, and every rank
  // not done yet gets its result (FillLoadResult, then `extra`).
  void FinishLoadJob(const std::shared_ptr<Job>& job,
                     const std::vector<std::shared_ptr<RankSlot>>& slots,
                     const ckpt::LoadPlan& plan, const JobFigures& fig, LoadJobRecord rec,
                     const std::function<void(v1::LoadResult&)>& extra);
  // Runs `run` (RunJob, RunSaveJob) failing the job on any exception.
  void RunGuarded(const std::shared_ptr<Job>& job, void (Daemon::*run)(const std::shared_ptr<Job>&));
  void RunSaveJob(const std::shared_ptr<Job>& job);
  // A save job is done: `answer` fills each rank's SaveResponse (under the
  // slot's mu), the ranks are released and the job leaves the registry.
  void FinishSaveJob(const std::shared_ptr<Job>& job,
                     const std::vector<std::shared_ptr<RankSlot>>& slots,
                     const std::function<void(const RankSlot&, v1::SaveResponse&)>& answer);
  // PyTorch DCP saves (SaveRequest.format "pytorch-dcp"): the data files of
  // a job, and the commit of its `.metadata` (SaveRequest.dcp_metadata).
  void WriteDcpSave(const std::shared_ptr<Job>& job,
                    const std::vector<std::shared_ptr<RankSlot>>& slots, const ckpt::SavePlan& plan,
                    std::shared_ptr<const ckpt::Directory> dir,
                    const std::map<std::pair<int, std::string>, const uint8_t*>& where,
                    std::chrono::steady_clock::time_point t0);
  absl::StatusOr<v1::SaveResponse> CommitDcp(const Caller& caller, const v1::SaveRequest& request,
                                             const std::string& parent, const std::string& dir);
  // A Save's output directory: (its resolved parent, the directory), which
  // need not exist yet; a relative path is under the first root.
  absl::StatusOr<std::pair<std::string, std::string>> ResolveSaveDir(
      const v1::SaveRequest& request) const;
  // An existing output directory: a real directory the caller may save
  // into, without the version (or DCP checkpoint) unless overwrite is set.
  absl::Status CheckSaveDir(const Caller& caller, const v1::SaveRequest& request,
                            const std::string& dir, bool dcp) const;
  // The rank's slot of a save: its targets and segment checked as a load's,
  // (async_save) save_buffer charged and the bytes copied unless handed
  // over, device tensors staged to host.
  absl::StatusOr<std::shared_ptr<RankSlot>> PrepareSaveSlot(const Caller& caller,
                                                            const v1::SaveRequest& request,
                                                            const std::string& who, uint64_t bytes,
                                                            const std::function<bool()>& cancelled);
  // This node's share of a multi-node save's part from `coordinator`,
  // checked (server/plan_codec.h); a refused part fails `dj` here.
  absl::StatusOr<LocalSave> AdoptSavePart(const Job& job,
                                          const std::vector<std::shared_ptr<RankSlot>>& slots,
                                          const std::shared_ptr<DistJob>& dj,
                                          const peer::v1::PlanPart& part,
                                          const std::string& coordinator);
  // A multi-node save's prepare on this node: its ranks' data files written
  // and fsynced under the directory lock (the metadata waits for CommitSave).
  absl::StatusOr<NativeSaved> WriteSavePart(const std::shared_ptr<Job>& job,
                                            const std::vector<std::shared_ptr<RankSlot>>& slots,
                                            const LocalSave& local);
  // Every node prepared: the version's metadata, from every node's shards in
  // `outcome`, written here (or found identical, in a shared directory).
  absl::Status CommitSave(const Job& job, const LocalSave& local,
                          const peer::v1::CompleteResponse& outcome, const std::string& coordinator);
  // An asynchronous save job's ranks are all in and its plan holds: their
  // bytes move into a pending save queued for the persist thread
  // (AsyncSaves::Start), and every rank gets its first answer (persisted
  // false).
  void StartAsyncSave(const std::shared_ptr<Job>& job,
                      const std::vector<std::shared_ptr<RankSlot>>& slots, ckpt::SavePlan plan);
  // Puts the files of a version just made durable into the data cache (read
  // back from the page cache), so loading it right away reads no storage.
  void PublishSaved(const std::string& dir, const std::vector<std::string>& files);

  // Const but for peer_listen, set once by SetPeerListen before it is read.
  DaemonConfig config_;
  // config_.direct_io, parsed once (ValidateConfig checked it).
  const ckpt::DirectIo direct_io_;
  const absl::Time started_;
  // Before cache_: the cache's memory may come from its pinned allocator.
  std::unique_ptr<gpu::GpuRuntime> gpu_;
  ckpt::HostCache cache_;
  std::unique_ptr<ArenaPool> arenas_;  // before fd_receiver_, which lends from it
  // Fills cache_ with what loads delivered without keeping (after cache_).
  std::unique_ptr<CacheFiller> filler_;
  ViewLeases view_leases_;  // before fd_receiver_, which hands them out
  std::unique_ptr<FdReceiver> fd_receiver_;

  Policy policy_;           // roots, access, limits, quotas
  MetadataCache metadata_;  // checkpoints opened
  Catalog catalog_;         // Inspect, Prefetch, Evict (after the parts it uses)
  std::unique_ptr<PeerPlane> peers_;  // the peer set, TLS, channels, health

  JobRegistry jobs_;  // the jobs waiting or running, and their barrier

  // Multi-node jobs this daemon takes part in (coordinating or not).
  std::unique_ptr<DistJobs> dist_jobs_;

  SaveBuffer save_buffer_;  // before the saves that hold its charges
  AsyncSaves async_saves_;  // the asynchronous saves and their persist thread

  std::atomic<uint64_t> loads_started_{0}, loads_succeeded_{0}, loads_failed_{0};
  std::atomic<uint64_t> bytes_read_total_{0}, bytes_delivered_total_{0};
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_DAEMON_H_
