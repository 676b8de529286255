// The client library without CUDA: device destinations are unavailable.
#include "client/cuda/device_export.h"

namespace ckptd {
namespace {
absl::Status NoCuda() {
  return absl::UnimplementedError(
      "cuda_ipc: this ckptd client library was built without CUDA (bazel build --config=cuda)");
}
}  // namespace

bool ClientBuiltWithCuda() { return false; }

absl::Status AddCudaIpcDestination(const std::vector<const void*>&, const std::vector<uint64_t>&,
                                   const std::vector<std::string>&, v1::LoadRequest*) {
  return NoCuda();
}

absl::StatusOr<std::unique_ptr<DeviceArena>> DeviceArena::Create(int, uint64_t) { return NoCuda(); }
DeviceArena::~DeviceArena() = default;
void* DeviceArena::Allocate(uint64_t) { return nullptr; }

}  // namespace ckptd
