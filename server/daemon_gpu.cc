// The daemon's device destinations (cuda_ipc): validation, opening the
// client's exported buffers, and the delivery of a job's ranks. The CUDA
// work itself is behind gpu::GpuRuntime (server/cuda/gpu.h).
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "server/daemon.h"
#include "server/daemon_internal.h"

namespace ckptd {

absl::Status Daemon::PrepareDeviceSlot(const v1::LoadRequest& req, const std::string& who,
                                       RankSlot& slot) {
  std::vector<gpu::IpcBuffer> buffers;
  for (const v1::CudaBuffer& b : req.cuda_ipc().buffers()) {
    buffers.push_back(gpu::IpcBuffer{b.ipc_handle(), b.device(), b.device_uuid(), b.size()});
  }
  std::vector<std::pair<uint32_t, uint64_t>> targets;
  std::vector<uint64_t> sizes;
  std::vector<std::string> names;
  for (int i = 0; i < req.targets_size(); ++i) {
    if (req.targets(i).dest_host()) continue;  // in the host segment (PrepareShmSegment)
    targets.push_back({req.targets(i).dest_buffer(), req.targets(i).dest_offset()});
    sizes.push_back(slot.targets.tensors[i].num_bytes());
    names.push_back(req.targets(i).name());
  }
  CKPT_RETURN_IF_ERROR(gpu::ValidateDeviceTargets(buffers, targets, sizes, names, who));
  CKPT_ASSIGN_OR_RETURN(slot.device, gpu_->OpenIpc(buffers, who));
  return absl::OkStatus();
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
  std::vector<gpu::GpuRuntime::DeviceToHost> copies;
  for (int t = 0; t < request.targets_size(); ++t) {
    const v1::Target& target = request.targets(t);
    const uint64_t n = slot.targets.tensors[t].num_bytes();
    if (target.dest_host()) {  // from the host segment (checked by PrepareShmSegment)
      if (n > 0) std::memcpy(staged->data() + at[t], slot.segment->data() + target.dest_offset(), n);
    } else {
      copies.push_back({target.dest_buffer(), target.dest_offset(), n, staged->data() + at[t]});
    }
  }
  CKPT_RETURN_IF_ERROR(gpu_->CopyToHost(*slot.device, copies, who));
  slot.device.reset();  // the client's IPC handles are closed here
  slot.segment = std::move(staged);
  for (int t = 0; t < request.targets_size(); ++t) {
    v1::Target* target = request.mutable_targets(t);
    target->set_dest_offset(at[t]);
    target->clear_dest_host();
    target->clear_dest_buffer();
  }
  request.clear_cuda_ipc();
  return absl::OkStatus();
}

void ReleaseDeviceBuffers(absl::StatusOr<std::unique_ptr<ckpt::Delivery>>& delivery,
                          const std::vector<std::shared_ptr<Daemon::RankSlot>>& slots) {
  if (delivery.ok()) delivery->reset();
  for (const auto& s : slots) s->device.reset();
}

absl::StatusOr<std::unique_ptr<ckpt::Delivery>> Daemon::JobDelivery(
    const std::vector<std::shared_ptr<RankSlot>>& slots, std::vector<std::vector<void*>> dests) {
  bool any_process = false;
  for (const auto& s : slots) any_process |= s->process.has_value();
  if (any_process) {
    // Ranks whose tensors are in their own process memory wrap the rest.
    std::vector<ckpt::RemoteRank> remote(slots.size());
    for (size_t i = 0; i < slots.size(); ++i) {
      if (slots[i]->process) remote[i] = *slots[i]->process;
    }
    auto inner = JobDeliveryOf(slots, std::move(dests));
    if (!inner.ok()) return inner.status();
    return std::unique_ptr<ckpt::Delivery>(
        new ckpt::ProcessDelivery(*std::move(inner), std::move(remote)));
  }
  return JobDeliveryOf(slots, std::move(dests));
}

absl::StatusOr<std::unique_ptr<ckpt::Delivery>> Daemon::JobDeliveryOf(
    const std::vector<std::shared_ptr<RankSlot>>& slots, std::vector<std::vector<void*>> dests) {
  bool any_device = false;
  for (const auto& s : slots) any_device |= s->device != nullptr;
  if (!any_device) return std::unique_ptr<ckpt::Delivery>(new ckpt::HostDelivery(std::move(dests)));
  std::vector<gpu::RankDestination> ranks(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    const RankSlot& s = *slots[i];
    gpu::RankDestination& d = ranks[i];
    if (s.device == nullptr) {
      d.host = std::move(dests[i]);
      continue;
    }
    d.device = s.device;
    d.host = std::move(dests[i]);  // the dest_host targets' (others null)
    for (const v1::Target& t : s.request.targets()) {
      d.device_targets.push_back({t.dest_buffer(), t.dest_offset()});
    }
  }
  return gpu_->MakeDelivery(std::move(ranks));
}

}  // namespace ckptd
