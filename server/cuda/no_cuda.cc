// The GPU runtime of a ckptd built without --config=cuda: host memory only.
#include "absl/strings/str_cat.h"
#include "server/cuda/gpu.h"
#include "server/cuda/peer_link.h"

namespace ckptd::gpu {
namespace {

absl::Status NoCuda(const std::string& what) {
  return absl::UnimplementedError(absl::StrCat(
      what, ": this ckptd was built without CUDA (rebuild with `bazel build --config=cuda "
            "//server:ckptd`)"));
}

class NoCudaRuntime final : public GpuRuntime {
 public:
  bool compiled_with_cuda() const override { return false; }
  int device_count() const override { return 0; }
  std::string Describe() const override { return "built without CUDA"; }
  ckpt::HostAllocator* host_allocator() override { return nullptr; }
  uint64_t pinned_bytes() const override { return 0; }
  absl::StatusOr<std::shared_ptr<const DeviceBuffers>> OpenIpc(const std::vector<IpcBuffer>&,
                                                               const std::string& who) override {
    return NoCuda(absl::StrCat(who, ": cuda_ipc destination"));
  }
  absl::StatusOr<std::unique_ptr<ckpt::Delivery>> MakeDelivery(
      std::vector<RankDestination> ranks) override {
    for (const auto& r : ranks) {
      if (r.device != nullptr) return NoCuda("device delivery");
    }
    return std::unique_ptr<ckpt::Delivery>(new HostRanksDelivery(std::move(ranks)));
  }
  absl::Status CopyToHost(const DeviceBuffers&, const std::vector<DeviceToHost>&,
                          const std::string& who) override {
    return NoCuda(absl::StrCat(who, ": copy from device memory"));
  }
  bool nccl_available() const override { return false; }
  absl::StatusOr<std::string> NewNcclId() override { return NoCuda("NCCL peer transport"); }
  absl::StatusOr<std::unique_ptr<PeerLinks>> ConnectPeerLinks(const PeerLinkSpec&) override {
    return NoCuda("NCCL peer transport");
  }
};

}  // namespace

std::unique_ptr<GpuRuntime> CreateGpuRuntime(const GpuOptions&) {
  return std::make_unique<NoCudaRuntime>();
}

}  // namespace ckptd::gpu
