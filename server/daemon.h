// The daemon as a facade: it builds the components in order (the members
// below, in declaration order: each after the parts it uses), starts and
// stops them, and forwards each RPC to the component that owns it:
//   Load                 load/loads.h (the one load path; multi-node parts
//                        through multinode/multinode_load.h)
//   Save                 save/saves.h (multi-node saves through
//                        multinode/multinode_save.h)
//   AwaitSave, drain     save/async_saves.h
//   Inspect, Prefetch,   catalog/catalog.h
//   Evict, ReadCheckpointFile
//   Status               every component's figures
//   peer RPCs            multinode/dist_jobs.h, through dist_jobs()
//   AbortLoads           jobs/registry.h
// docs/architecture.md tells how they fit together. The gRPC services
// (api/service.cc, peer/peer_service.cc) only translate messages and status
// codes; everything here is testable without a network.
//
// Thread-safe: every RPC runs on its own gRPC thread. The daemon holds no
// lock of its own (what it is made with is set before it serves and
// read-only after); each component has its own, every shared field
// ABSL_GUARDED_BY a mutex of the same object (checked by clang's
// -Wthread-safety): jobs/registry.h (the registry, Job::mu, RankSlot::mu),
// multinode/dist_jobs.h (the multi-node jobs, DistJob::mu),
// save/async_saves.h (the asynchronous saves, PendingSave::mu),
// save/save_buffer.h, the policy, the metadata and data caches and the peer
// plane. Lock order: each component's locks are taken inside that
// component; no thread holds the locks of two of them together.
#ifndef CKPTD_SERVER_DAEMON_H_
#define CKPTD_SERVER_DAEMON_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "config/config.h"
#include "core/cache/cache.h"
#include "core/io/file.h"
#include "proto/ckpt.pb.h"
#include "server/api/caller.h"
#include "server/catalog/cache_filler.h"
#include "server/catalog/catalog.h"
#include "server/catalog/metadata_cache.h"
#include "server/cuda/gpu.h"
#include "server/delivery/arena_pool.h"
#include "server/delivery/fd_channel.h"
#include "server/delivery/opener.h"
#include "server/delivery/view_leases.h"
#include "server/jobs/registry.h"
#include "server/load/loads.h"
#include "server/policy/policy.h"
#include "server/save/async_saves.h"
#include "server/save/save_buffer.h"
#include "server/save/saves.h"
#include "server/storage/object_storage.h"

namespace ckptd {

class PeerPlane;      // server/peer/peer_plane.h
class DistJobs;       // server/multinode/dist_jobs.h
class MultiNodeLoad;  // server/multinode/multinode_load.h
class MultiNodeSave;  // server/multinode/multinode_save.h

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
  absl::StatusOr<v1::ReadCheckpointFileResponse> ReadCheckpointFile(
      const Caller& caller, const v1::ReadCheckpointFileRequest& request);
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
  // SIGTERM: AwaitSave calls end by `until` (the drain's end), so a client
  // waiting on a save does not hold the drain open (AsyncSaves::Drain).
  void DrainSaves(absl::Time until) { async_saves_.Drain(until); }
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
  std::vector<std::string> AbortWaiting(const std::string& why) { return jobs_.AbortWaiting(why); }

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
  // Const but for peer_listen, set once by SetPeerListen before it is read.
  DaemonConfig config_;
  // config_.direct_io, parsed once (ValidateConfig checked it).
  const ckpt::DirectIo direct_io_;
  const absl::Time started_;
  // Before cache_: the cache's memory may come from its pinned allocator.
  std::unique_ptr<gpu::GpuRuntime> gpu_;
  ckpt::HostCache cache_;
  std::unique_ptr<ArenaPool> arenas_;  // before fd_receiver_, which lends from it
  LoadCounters load_counters_;  // before the parts that count (filler_ too)
  // Fills cache_ with what loads delivered without keeping (after cache_).
  std::unique_ptr<CacheFiller> filler_;
  ViewLeases view_leases_;  // before fd_receiver_, which hands them out
  std::unique_ptr<FdReceiver> fd_receiver_;
  DestinationOpener opener_;  // after the parts it uses

  Policy policy_;           // roots, access, limits, quotas
  MetadataCache metadata_;  // checkpoints opened
  Catalog catalog_;         // Inspect, Prefetch, Evict (after the parts it uses)
  std::unique_ptr<PeerPlane> peers_;  // the peer set, TLS, channels, health

  JobRegistry jobs_;  // the jobs waiting or running, and their barrier

  // Multi-node jobs this daemon takes part in (coordinating or not).
  std::unique_ptr<DistJobs> dist_jobs_;

  SaveBuffer save_buffer_;  // before the saves that hold its charges
  AsyncSaves async_saves_;  // the asynchronous saves and their persist thread

  Loads loads_;  // the one load path

  // The S3 storage of s3:// roots (registered for s3:// paths by Start);
  // nullptr when no root is one. Lives as long as the process.
  ckpt::s3::S3Storage* object_storage_ = nullptr;
  std::unique_ptr<MultiNodeLoad> multinode_load_;  // a load's part on this node
  Saves saves_;  // sync, async and DCP saves
  std::unique_ptr<MultiNodeSave> multinode_save_;  // a save's part on this node
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_DAEMON_H_
