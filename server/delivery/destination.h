// Destination: where one rank's tensors go, whatever the kind of the
// request's destination: a shared-memory segment (shm; also the memory a
// save's bytes live in), stream buffers sent back in the answer, the
// client's own process memory (process_memory, with or without cache views),
// or device memory (cuda_ipc, with an optional host segment for its dest_host
// targets). The daemon asks the destination, never its kind: the host
// pointers and the rank's part of its job's ckpt::Delivery (Prepare, put
// together by JobDelivery), what to let go once the copies are done
// (Release), what the client copies itself (views), what is streamed back,
// the bytes of a save (segment) and their staging (CopyTargetsTo).
//
// Owns what the rank's bytes go to: the mapped segment, the stream buffers,
// the opened process (and its view recorder), the opened device buffers.
// Each implementation checks where its targets land before anything is
// mapped, opened or written (CheckTargetRanges, target_ranges.h; for device
// buffers through gpu::ValidateDeviceTargets). What the daemon alone knows
// (the caller, the fd socket, lent arenas, the data cache, the GPU runtime)
// is handed in by the daemon (server/delivery/opener.h), which opens
// the destination of each Load and Save request.
//
// Thread-safety: a destination belongs to one rank slot. It is set before
// the slot registers in its job; the job's runner thread then uses it
// (Prepare, Release), and the rank's own thread after the rank is done
// (streamed, views, a save's segment). Never two threads at once; the
// delivery may write its targets from several threads (disjoint bytes).
#ifndef CKPTD_SERVER_DELIVERY_DESTINATION_H_
#define CKPTD_SERVER_DELIVERY_DESTINATION_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/cache/cache.h"
#include "core/cache/cache_view.h"
#include "core/exec/executor.h"
#include "core/exec/process_memory.h"
#include "core/plan/planner.h"
#include "server/cuda/gpu.h"
#include "server/delivery/arena_pool.h"
#include "server/delivery/mapped_segment.h"

namespace ckptd {

// Where one of the rank's targets lands, as its request (v1.Target) places
// it, in request order.
struct TargetPlace {
  std::string name;     // the tensor, for messages
  uint64_t offset = 0;  // dest_offset: in the segment, the device buffer, the process
  uint64_t bytes = 0;   // the target's size
  bool host = false;    // cuda_ipc: in the host segment (dest_host)
  uint32_t buffer = 0;  // cuda_ipc: dest_buffer
};

// The rank's part of its job's ckpt::Delivery.
struct RankDelivery {
  // Per target: its host buffer, or null (device memory, another process);
  // with `local.device`, only the dest_host targets' (empty without a host
  // segment). Device buffers and (buffer, offset) per target, for cuda_ipc.
  gpu::RankDestination local;
  // process_memory: the rank's targets in its client's process.
  std::optional<ckpt::RemoteRank> remote;
};

class Destination {
 public:
  virtual ~Destination() = default;

  // The rank's part of the delivery of `plan` (this rank's part of its job's
  // plan), once per job, by the job's runner before any copy: host pointers
  // of the planned targets (stream buffers are allocated here), device
  // buffers, the client's process.
  virtual RankDelivery Prepare(const ckpt::RankPlan& plan) = 0;
  // After the job's copies (its delivery already gone): lets go of what must
  // not outlive them (device mappings, before the rank is told it is done).
  virtual void Release() {}
  // Nothing more is written into the client once `stop` returns true (it
  // cancelled or left); before the job runs.
  virtual void StopWhen(std::function<bool()> stop) {}

  // Stream: per planned target, the bytes the answer carries; empty else.
  virtual const std::vector<std::vector<uint8_t>>& streamed() const;
  // process_memory with views: what the client copies itself (after the job,
  // by the rank's thread); null else.
  virtual ckpt::ViewRecorder* views() { return nullptr; }
  // The same recorder, shared: the laid-out work that outlives the rank's
  // call holds it (the recorder locks itself), not the destination.
  virtual std::shared_ptr<ckpt::ViewRecorder> shared_views() { return nullptr; }
  // With views: whether the client also reads bytes the cache does not hold
  // from the checkpoint's files itself (ProcessMemoryDestination.file_views).
  virtual bool reads_files() const { return false; }
  // The memory a save's bytes are in, each target at its offset (shm, the
  // daemon's copy of it, a device save staged to host); null else.
  virtual MappedSegment* segment() { return nullptr; }
  // A device save's staging: copies target t's bytes to `to[t]` (device
  // ones device -> host through `gpu`, waited for); cuda_ipc only.
  virtual absl::Status CopyTargetsTo(gpu::GpuRuntime& gpu, const std::vector<uint8_t*>& to,
                                     const std::string& who);
};

// The delivery of a job whose plan ranks go to `ranks` (in plan order):
// into host memory, device memory through `gpu` when any rank has device
// buffers, and into their process for process_memory ranks.
absl::StatusOr<std::unique_ptr<ckpt::Delivery>> JobDelivery(gpu::GpuRuntime& gpu,
                                                            std::vector<RankDelivery> ranks);

// A shm segment before it is mapped: an arena this daemon lent (already
// mapped), or else a client's sealed memfd (owned: closed on failure).
struct SegmentSource {
  std::shared_ptr<Arena> arena;
  int fd = -1;
  std::string what;   // names the memfd in errors
  uint64_t size = 0;  // the bytes the request declares
};

// Checks `targets` against the segment (CheckTargetRanges: "segment too
// small", overlaps), then maps it up to the end of the last target.
absl::StatusOr<std::unique_ptr<MappedSegment>> OpenSegment(const std::string& who,
                                                           SegmentSource source,
                                                           const std::vector<TargetPlace>& targets);

// shm: the targets at their offsets in a segment.
class SegmentDestination final : public Destination {
 public:
  static absl::StatusOr<std::unique_ptr<Destination>> Open(const std::string& who,
                                                           SegmentSource source,
                                                           std::vector<TargetPlace> targets);
  // Over memory already checked and mapped (a save's copy, staged bytes).
  SegmentDestination(std::unique_ptr<MappedSegment> segment, std::vector<TargetPlace> targets)
      : segment_(std::move(segment)), targets_(std::move(targets)) {}
  RankDelivery Prepare(const ckpt::RankPlan& plan) override;
  MappedSegment* segment() override { return segment_.get(); }

 private:
  std::unique_ptr<MappedSegment> segment_;
  std::vector<TargetPlace> targets_;
};

// stream: buffers of the daemon's, for the planned targets the checkpoint
// has (allocated by Prepare), sent back in the answer.
class StreamDestination final : public Destination {
 public:
  RankDelivery Prepare(const ckpt::RankPlan& plan) override;
  const std::vector<std::vector<uint8_t>>& streamed() const override { return buffers_; }

 private:
  std::vector<std::vector<uint8_t>> buffers_;
};

// process_memory: the targets at their addresses in the client's process.
class ProcessDestination final : public Destination {
 public:
  // Checks `targets` (CheckTargetRanges: no address 0, no wrap, no overlap),
  // opens process `pid` and checks that it holds `cookie` at
  // `cookie_address`. With `views_of` (the data cache; null: no views),
  // cached bytes are left to the client to copy (core/cache/cache_view.h),
  // from the blocks `tenant` may view, and with `file_views` bytes it does
  // not hold may be left to the client to read from the files (reads_files).
  // FAILED_PRECONDITION "process_memory unavailable for <who>: ...; use shm"
  // where the kernel refuses.
  static absl::StatusOr<std::unique_ptr<Destination>> Open(
      const std::string& who, pid_t pid, const std::vector<TargetPlace>& targets,
      uint64_t cookie_address, const std::string& cookie, ckpt::HostCache* views_of,
      uint32_t tenant, bool file_views);
  RankDelivery Prepare(const ckpt::RankPlan& plan) override;
  void StopWhen(std::function<bool()> stop) override { memory_->StopWhen(std::move(stop)); }
  ckpt::ViewRecorder* views() override { return views_.get(); }
  std::shared_ptr<ckpt::ViewRecorder> shared_views() override { return views_; }
  bool reads_files() const override { return views_ != nullptr && file_views_; }

 private:
  ProcessDestination() = default;
  bool file_views_ = false;
  std::shared_ptr<ckpt::ProcessMemory> memory_;
  // With views: the rank's RemoteRank memory (it writes the rest to memory_).
  std::shared_ptr<ckpt::ViewRecorder> views_;
  ckpt::RemoteRank remote_;
};

// cuda_ipc: the targets in the client's device buffers, the dest_host ones
// in its host segment.
class DeviceDestination final : public Destination {
 public:
  // Checks the device targets against `buffers` (gpu::ValidateDeviceTargets)
  // and opens them through `gpu`; `host` (null when no target is dest_host)
  // is the host segment, already checked and mapped (OpenSegment).
  static absl::StatusOr<std::unique_ptr<Destination>> Open(gpu::GpuRuntime& gpu,
                                                           const std::string& who,
                                                           const std::vector<gpu::IpcBuffer>& buffers,
                                                           std::vector<TargetPlace> targets,
                                                           std::unique_ptr<MappedSegment> host);
  RankDelivery Prepare(const ckpt::RankPlan& plan) override;
  // Closes the device mappings (the client's IPC handles, once no other job
  // uses them).
  void Release() override { device_.reset(); }
  absl::Status CopyTargetsTo(gpu::GpuRuntime& gpu, const std::vector<uint8_t*>& to,
                             const std::string& who) override;

 private:
  DeviceDestination() = default;
  std::shared_ptr<const gpu::DeviceBuffers> device_;
  std::unique_ptr<MappedSegment> host_;
  std::vector<TargetPlace> targets_;
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_DELIVERY_DESTINATION_H_
