// Opening a rank's destination from its request: what the daemon alone
// knows (the caller, the fd socket, lent arenas, the data cache, the GPU
// runtime) handed to destination.h's implementations. Every Load's and
// Save's destination is checked and opened here before its rank joins a
// job: a shared-memory segment (a lent arena or the caller's sealed memfd),
// the caller's own process memory (process_memory, with cache views), stream
// buffers, or device memory (cuda_ipc). Also what follows from those: a
// save's device tensors staged to host, the cache views offered to a
// process_memory client.
//
// Owned by the daemon; called by the Load and Save RPC threads.
// Thread-safe: it holds no state of its own beyond what it is made with (the
// parts it uses are thread-safe); SetFdReceiver runs once, before any call.
#ifndef CKPTD_SERVER_DELIVERY_OPENER_H_
#define CKPTD_SERVER_DELIVERY_OPENER_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/cache/cache.h"
#include "core/cache/cache_view.h"
#include "core/plan/planner.h"
#include "proto/ckpt.pb.h"
#include "server/api/caller.h"
#include "server/cuda/gpu.h"
#include "server/delivery/arena_pool.h"
#include "server/delivery/destination.h"
#include "server/delivery/fd_channel.h"
#include "server/delivery/view_leases.h"

namespace ckptd {

// Where each of `requested` (a Load's or Save's targets, in request order)
// lands in the rank's destination; `targets` are the same, parsed.
std::vector<TargetPlace> PlacesOf(const google::protobuf::RepeatedPtrField<v1::Target>& requested,
                                  const ckpt::RankTargets& targets);

class DestinationOpener {
 public:
  // What it uses; every pointer outlives it.
  struct Parts {
    ArenaPool* arenas = nullptr;
    ViewLeases* view_leases = nullptr;
    ckpt::HostCache* cache = nullptr;
    gpu::GpuRuntime* gpu = nullptr;
    absl::Duration load_timeout;  // how long a client may take to copy its views
  };
  explicit DestinationOpener(Parts parts);
  // The fd socket (null when the daemon runs without one): set once by
  // Daemon::Start, before any request.
  void SetFdReceiver(FdReceiver* receiver) { fd_receiver_ = receiver; }

  // The destination of `request` (shm, cuda_ipc, process_memory or stream),
  // checked and opened for `targets` (the request's, parsed); `who` names
  // the rank in errors.
  absl::StatusOr<std::unique_ptr<Destination>> Open(const Caller& caller,
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
  absl::StatusOr<std::unique_ptr<Destination>> OpenProcess(const Caller& caller,
                                                           const v1::LoadRequest& request,
                                                           const std::vector<TargetPlace>& targets,
                                                           const std::string& who);
  // cuda_ipc destinations: the host segment of the dest_host targets, then
  // the rank's device buffers checked and opened.
  absl::StatusOr<std::unique_ptr<Destination>> OpenDevice(const Caller& caller,
                                                          const v1::CudaIpcDestination& cuda_ipc,
                                                          std::vector<TargetPlace> targets,
                                                          const std::string& who);
  // A save's device tensors (SaveRequest.cuda_ipc, in *destination): copied
  // device -> host into the daemon's own memory, with the dest_host targets'
  // bytes, and the client's IPC handles closed; `request`'s targets then
  // point into the new segment *destination as an shm save's do. The caller
  // waits only for this.
  absl::Status StageDeviceSave(const std::string& who, v1::SaveRequest& request,
                               const ckpt::RankTargets& targets,
                               std::unique_ptr<Destination>* destination);
  // process_memory with views: offers the client the rank's cache views
  // recorded since the last call (ViewRecorder::TakeBatch) and waits until
  // it copied them (view_leases.h). `last`: the job is done; then the files
  // the client read are checked unchanged and the views let go.
  absl::Status DeliverViews(const Caller& caller, ckpt::ViewRecorder& views,
                            const std::string& who,
                            const std::function<bool(const v1::LoadEvent&)>& send,
                            const std::function<bool()>& cancelled, bool last = true);

 private:
  // One CacheViews event: sent, taken and copied by the client.
  absl::Status DeliverBatch(const Caller& caller, const ckpt::ViewRecorder::Batch& batch,
                            const std::string& who,
                            const std::function<bool(const v1::LoadEvent&)>& send,
                            const std::function<bool()>& cancelled);

  const Parts parts_;
  FdReceiver* fd_receiver_ = nullptr;
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_DELIVERY_OPENER_H_
