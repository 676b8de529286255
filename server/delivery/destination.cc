#include "server/delivery/destination.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "server/delivery/target_ranges.h"

namespace ckptd {

namespace {

// Where the kernel refuses a process_memory destination (another uid, no
// pidfd): FAILED_PRECONDITION before the job registers, and the client then
// falls back to shm (docs/grpc-api.md, "Transports").
absl::Status ToProcessMemoryError(const absl::Status& s, const std::string& who) {
  if (absl::IsPermissionDenied(s) || absl::IsFailedPrecondition(s)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "process_memory unavailable for ", who, ": ", s.message(), "; use shm"));
  }
  return s;
}

}  // namespace

const std::vector<std::vector<uint8_t>>& Destination::streamed() const {
  static const auto* const kNone = new std::vector<std::vector<uint8_t>>();
  return *kNone;
}

absl::Status Destination::CopyTargetsTo(gpu::GpuRuntime&, const std::vector<uint8_t*>&,
                                        const std::string& who) {
  return absl::FailedPreconditionError(
      absl::StrCat(who, ": only a cuda_ipc destination is staged for a save"));
}

absl::StatusOr<std::unique_ptr<ckpt::Delivery>> JobDelivery(gpu::GpuRuntime& gpu,
                                                            std::vector<RankDelivery> ranks) {
  bool any_remote = false;
  bool any_device = false;
  for (const RankDelivery& r : ranks) {
    any_remote |= r.remote.has_value();
    any_device |= r.local.device != nullptr;
  }
  // Ranks whose tensors are in their own process memory wrap the rest.
  std::vector<ckpt::RemoteRank> remote;
  if (any_remote) {
    remote.resize(ranks.size());
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i].remote) remote[i] = std::move(*ranks[i].remote);
    }
  }
  absl::StatusOr<std::unique_ptr<ckpt::Delivery>> inner;
  if (any_device) {
    std::vector<gpu::RankDestination> local;
    for (RankDelivery& r : ranks) local.push_back(std::move(r.local));
    inner = gpu.MakeDelivery(std::move(local));
  } else {
    std::vector<std::vector<void*>> host;
    for (RankDelivery& r : ranks) host.push_back(std::move(r.local.host));
    inner = std::unique_ptr<ckpt::Delivery>(new ckpt::HostDelivery(std::move(host)));
  }
  if (!any_remote || !inner.ok()) return inner;
  return std::unique_ptr<ckpt::Delivery>(
      new ckpt::ProcessDelivery(*std::move(inner), std::move(remote)));
}

absl::StatusOr<std::unique_ptr<MappedSegment>> OpenSegment(const std::string& who,
                                                           SegmentSource source,
                                                           const std::vector<TargetPlace>& targets) {
  // Every target inside the segment and no two overlapping, checked before
  // anything is mapped; only the bytes up to the end of the last target are,
  // and only the targets' pages are faulted in (Policy::CheckRequestLimits
  // charged those and refused a span far larger).
  std::vector<TargetRange> ranges;
  std::vector<std::pair<uint64_t, uint64_t>> used;
  ranges.reserve(targets.size());
  for (const TargetPlace& t : targets) {
    ranges.push_back({t.name, t.offset, t.bytes});
    used.emplace_back(t.offset, t.bytes);
  }
  auto needed = CheckTargetRanges(who, {"segment", "segment", source.size}, ranges);
  if (!needed.ok()) {
    if (source.fd >= 0) ::close(source.fd);
    return needed.status();
  }
  if (source.arena) return MappedSegment::Borrow(std::move(source.arena));
  return MappedSegment::Map(source.fd, *needed, used, source.what);
}

absl::StatusOr<std::unique_ptr<Destination>> SegmentDestination::Open(
    const std::string& who, SegmentSource source, std::vector<TargetPlace> targets) {
  CKPT_ASSIGN_OR_RETURN(auto segment, OpenSegment(who, std::move(source), targets));
  return std::unique_ptr<Destination>(
      new SegmentDestination(std::move(segment), std::move(targets)));
}

RankDelivery SegmentDestination::Prepare(const ckpt::RankPlan&) {
  RankDelivery d;
  for (const TargetPlace& t : targets_) d.local.host.push_back(segment_->data() + t.offset);
  return d;
}

RankDelivery StreamDestination::Prepare(const ckpt::RankPlan& plan) {
  // Only targets the checkpoint has get a buffer (their bytes were checked
  // against limits.max_stream_bytes when the rank registered).
  RankDelivery d;
  const std::set<std::string> missing(plan.missing_keys.begin(), plan.missing_keys.end());
  buffers_.resize(plan.targets.size());
  for (size_t t = 0; t < plan.targets.size(); ++t) {
    if (!missing.count(plan.targets[t].name)) buffers_[t].resize(plan.targets[t].num_bytes());
    d.local.host.push_back(buffers_[t].data());
  }
  return d;
}

absl::StatusOr<std::unique_ptr<Destination>> ProcessDestination::Open(
    const std::string& who, pid_t pid, const std::vector<TargetPlace>& targets,
    uint64_t cookie_address, const std::string& cookie, ckpt::HostCache* views_of,
    uint32_t tenant, bool file_views) {
  // Targets: no address wraps, no two overlap (a client that overlapped
  // them would only garble its own tensors, but it is a bug worth naming).
  std::vector<TargetRange> checked;
  checked.reserve(targets.size());
  ckpt::RemoteRank remote;
  for (const TargetPlace& t : targets) {
    checked.push_back({t.name, t.offset, t.bytes});
    remote.targets.push_back({t.offset});
  }
  CKPT_RETURN_IF_ERROR(
      CheckTargetRanges(who, {"process's memory", "memory", std::nullopt}, checked).status());
  // The ranges the client's views may cover, in the request's order.
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const TargetRange& t : checked) {
    if (t.bytes > 0) ranges.push_back({t.begin, t.begin + t.bytes});
  }
  auto memory = ckpt::ProcessMemory::Open({pid, absl::StrCat(who, " (pid ", pid, ")")});
  if (!memory.ok()) return ToProcessMemoryError(memory.status(), who);
  std::string seen(cookie.size(), '\0');
  absl::Status read = (*memory)->Read(cookie_address, seen.data(), seen.size());
  if (!read.ok()) return ToProcessMemoryError(read, who);
  if (seen != cookie) {
    return absl::FailedPreconditionError(absl::StrCat(
        who, ": process_memory: the cookie at the given address of pid ", pid,
        " does not match the request (is the caller the process that connected?)"));
  }
  std::unique_ptr<ProcessDestination> d(new ProcessDestination);
  d->memory_ = std::shared_ptr<ckpt::ProcessMemory>(std::move(*memory));
  d->file_views_ = file_views;
  remote.memory = d->memory_;
  if (views_of != nullptr) {
    // Cached bytes are left to the client to copy (core/cache/cache_view.h).
    d->views_ = std::make_shared<ckpt::ViewRecorder>(views_of, tenant, d->memory_,
                                                     std::move(ranges));
    remote.memory = d->views_;
  }
  d->remote_ = std::move(remote);
  return std::unique_ptr<Destination>(std::move(d));
}

RankDelivery ProcessDestination::Prepare(const ckpt::RankPlan& plan) {
  RankDelivery d;
  d.local.host.assign(plan.targets.size(), nullptr);  // written by ckpt::ProcessDelivery
  d.remote = remote_;
  return d;
}

absl::StatusOr<std::unique_ptr<Destination>> DeviceDestination::Open(
    gpu::GpuRuntime& gpu, const std::string& who, const std::vector<gpu::IpcBuffer>& buffers,
    std::vector<TargetPlace> targets, std::unique_ptr<MappedSegment> host) {
  std::vector<std::pair<uint32_t, uint64_t>> device;
  std::vector<uint64_t> sizes;
  std::vector<std::string> names;
  for (const TargetPlace& t : targets) {
    if (t.host) continue;  // in the host segment (OpenSegment)
    device.push_back({t.buffer, t.offset});
    sizes.push_back(t.bytes);
    names.push_back(t.name);
  }
  CKPT_RETURN_IF_ERROR(gpu::ValidateDeviceTargets(buffers, device, sizes, names, who));
  std::unique_ptr<DeviceDestination> d(new DeviceDestination);
  CKPT_ASSIGN_OR_RETURN(d->device_, gpu.OpenIpc(buffers, who));
  d->host_ = std::move(host);
  d->targets_ = std::move(targets);
  return std::unique_ptr<Destination>(std::move(d));
}

RankDelivery DeviceDestination::Prepare(const ckpt::RankPlan&) {
  RankDelivery d;
  if (host_) {  // the dest_host targets only
    for (const TargetPlace& t : targets_) {
      d.local.host.push_back(t.host ? host_->data() + t.offset : nullptr);
    }
  }
  d.local.device = device_;
  for (const TargetPlace& t : targets_) d.local.device_targets.push_back({t.buffer, t.offset});
  return d;
}

absl::Status DeviceDestination::CopyTargetsTo(gpu::GpuRuntime& gpu, const std::vector<uint8_t*>& to,
                                              const std::string& who) {
  std::vector<gpu::GpuRuntime::DeviceToHost> copies;
  for (size_t t = 0; t < targets_.size(); ++t) {
    const TargetPlace& p = targets_[t];
    if (p.host) {  // from the host segment
      if (p.bytes > 0) std::memcpy(to[t], host_->data() + p.offset, p.bytes);
    } else {
      copies.push_back({p.buffer, p.offset, p.bytes, to[t]});
    }
  }
  return gpu.CopyToHost(*device_, copies, who);
}

}  // namespace ckptd
