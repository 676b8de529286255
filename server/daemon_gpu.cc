// The daemon's device destinations (cuda_ipc): opening the client's exported
// buffers (and the host segment of its dest_host targets), staging a save's
// device tensors, and closing a job's device mappings. The destination is
// delivery/destination.h's DeviceDestination; the CUDA work itself is behind
// gpu::GpuRuntime (server/cuda/gpu.h).
#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "server/daemon.h"
#include "server/daemon_internal.h"
#include "server/delivery/destination.h"

namespace ckptd {

absl::StatusOr<std::unique_ptr<Destination>> Daemon::OpenDeviceDestination(
    const Caller& caller, const v1::CudaIpcDestination& cuda_ipc,
    std::vector<TargetPlace> targets, const std::string& who) {
  // Targets in host memory (dest_host: a CPU tensor of a GPU state dict)
  // go to the destination's shm segment, the rest to device memory.
  std::vector<TargetPlace> host;
  for (const TargetPlace& t : targets) {
    if (t.host) host.push_back(t);
  }
  std::unique_ptr<MappedSegment> segment;
  if (!host.empty()) {
    if (!cuda_ipc.has_host()) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": tensor '", host[0].name,
          "' is marked dest_host but the cuda_ipc destination has no host segment"));
    }
    CKPT_ASSIGN_OR_RETURN(SegmentSource source, SegmentSourceOf(caller, cuda_ipc.host(), who));
    CKPT_ASSIGN_OR_RETURN(segment, OpenSegment(who, std::move(source), host));
  }
  std::vector<gpu::IpcBuffer> buffers;
  for (const v1::CudaBuffer& b : cuda_ipc.buffers()) {
    buffers.push_back(gpu::IpcBuffer{b.ipc_handle(), b.device(), b.device_uuid(), b.size()});
  }
  return DeviceDestination::Open(*gpu_, who, buffers, std::move(targets), std::move(segment));
}

absl::Status Daemon::StageDeviceSave(const std::string& who, v1::SaveRequest& request,
                                     RankSlot& slot) {
  // The rank's bytes packed (64-byte aligned) into one private buffer.
  std::vector<uint64_t> at(request.targets_size());
  uint64_t size = 0;
  for (int t = 0; t < request.targets_size(); ++t) {
    at[t] = size;
    size = (size + slot.targets.tensors[t].num_bytes() + 63) / 64 * 64;
  }
  CKPT_ASSIGN_OR_RETURN(auto staged, MappedSegment::Private(gpu_->host_allocator(), size,
                                                            absl::StrCat(who, ": staging")));
  std::vector<uint8_t*> to;
  for (int t = 0; t < request.targets_size(); ++t) to.push_back(staged->data() + at[t]);
  CKPT_RETURN_IF_ERROR(slot.destination->CopyTargetsTo(*gpu_, to, who));
  for (int t = 0; t < request.targets_size(); ++t) {
    v1::Target* target = request.mutable_targets(t);
    target->set_dest_offset(at[t]);
    target->clear_dest_host();
    target->clear_dest_buffer();
  }
  request.clear_cuda_ipc();
  // The client's IPC handles are closed here (the device destination goes).
  slot.destination = std::make_unique<SegmentDestination>(
      std::move(staged), PlacesOf(request.targets(), slot.targets));
  return absl::OkStatus();
}

void ReleaseDestinations(absl::StatusOr<std::unique_ptr<ckpt::Delivery>>& delivery,
                         const std::vector<std::shared_ptr<RankSlot>>& slots) {
  if (delivery.ok()) delivery->reset();
  for (const auto& s : slots) s->destination->Release();
}

}  // namespace ckptd
