// Client side of `cuda_ipc` destinations: exporting device memory to the
// daemon (cudaIpcGetMemHandle) and an arena that keeps a rank's tensors in
// one allocation per device, so the daemon opens one handle per device.
//
// Compiled with CUDA only under `--config=cuda` (device_export_cuda.cc);
// otherwise every call fails with UNIMPLEMENTED (device_export_stub.cc).
#ifndef CKPTD_CLIENT_CUDA_DEVICE_EXPORT_H_
#define CKPTD_CLIENT_CUDA_DEVICE_EXPORT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/ckpt.pb.h"

namespace ckptd {

// Whether this client library was built with CUDA.
bool ClientBuiltWithCuda();

// Fills `req`'s cuda_ipc destination for device pointers `ptrs` (one per
// target, in order; `sizes` their byte sizes): one CudaBuffer per distinct
// allocation (found with cuMemGetAddressRange), each target's dest_buffer
// and dest_offset inside it. The allocations must stay alive until the load
// returns.
absl::Status AddCudaIpcDestination(const std::vector<const void*>& ptrs,
                                   const std::vector<uint64_t>& sizes,
                                   const std::vector<std::string>& names, v1::LoadRequest* req);

// One cudaMalloc'd block on one device that tensors are carved from
// (256-byte aligned, bump allocation): a rank's tensors on a device then
// share one IPC handle.
class DeviceArena {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceArena>> Create(int device, uint64_t size);
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  // `n` bytes of the arena, or nullptr when it is full.
  void* Allocate(uint64_t n);
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  uint64_t used() const { return used_; }
  int device() const { return device_; }

 private:
  DeviceArena(int device, uint8_t* data, uint64_t size) : device_(device), data_(data), size_(size) {}
  int device_;
  uint8_t* data_;
  uint64_t size_;
  uint64_t used_ = 0;
};

}  // namespace ckptd

#endif  // CKPTD_CLIENT_CUDA_DEVICE_EXPORT_H_
