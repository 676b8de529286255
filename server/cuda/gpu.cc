// The parts of the GPU runtime that need no CUDA: validation, wrapped
// pointers and the host-rank delivery.
#include "server/cuda/gpu.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/exec/copy.h"
#include "server/delivery/target_ranges.h"

namespace ckptd::gpu {
namespace {

class Wrapped final : public DeviceBuffers {
 public:
  explicit Wrapped(std::vector<Buffer> b) { buffers_ = std::move(b); }
};

}  // namespace

std::shared_ptr<const DeviceBuffers> WrapDevicePointers(std::vector<DeviceBuffers::Buffer> buffers) {
  return std::make_shared<Wrapped>(std::move(buffers));
}

absl::Status ValidateDeviceTargets(const std::vector<IpcBuffer>& buffers,
                                   const std::vector<std::pair<uint32_t, uint64_t>>& targets,
                                   const std::vector<uint64_t>& sizes,
                                   const std::vector<std::string>& names, const std::string& who) {
  if (buffers.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": cuda_ipc destination has no buffers"));
  }
  for (size_t b = 0; b < buffers.size(); ++b) {
    if (buffers[b].handle.size() != 64) {
      return absl::InvalidArgumentError(absl::StrCat(who, ": cuda_ipc buffer ", b, " has a ",
                                                     buffers[b].handle.size(),
                                                     "-byte handle (a cudaIpcMemHandle_t is 64)"));
    }
    if (!buffers[b].device_uuid.empty() && buffers[b].device_uuid.size() != 16) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": cuda_ipc buffer ", b, " device_uuid must be 16 bytes"));
    }
  }
  std::map<uint32_t, std::vector<TargetRange>> ranges;  // by buffer
  for (size_t i = 0; i < targets.size(); ++i) {
    const auto [buf, off] = targets[i];
    if (buf >= buffers.size()) {
      return absl::InvalidArgumentError(absl::StrCat(who, " tensor '", names[i], "': dest_buffer ",
                                                     buf, " but the request has ", buffers.size(),
                                                     " cuda_ipc buffers"));
    }
    ranges[buf].push_back({names[i], off, sizes[i]});
  }
  for (const auto& [buf, r] : ranges) {
    CKPT_RETURN_IF_ERROR(
        CheckTargetRanges(who, {absl::StrCat("cuda_ipc buffer ", buf), "buffer", buffers[buf].size},
                          r)
            .status());
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> HostRanksDelivery::Copy(size_t rank_index, const ckpt::RankPlan& rank,
                                                const ckpt::CopyOp& op, const uint8_t* src) {
  const RankDestination& d = ranks_[rank_index];
  if (d.device != nullptr) {
    return absl::InternalError(absl::StrCat("rank ", rank.rank,
                                            " has device buffers but this delivery copies to host "
                                            "memory only"));
  }
  void* dst = op.target < d.host.size() ? d.host[op.target] : nullptr;
  if (dst == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank.rank, " tensor '",
                                                   rank.targets[op.target].name,
                                                   "' has no destination buffer"));
  }
  return ckpt::CopyRegion(op.src, src, rank.targets[op.target].layout(), dst, op.region);
}

}  // namespace ckptd::gpu
