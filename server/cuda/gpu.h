// The daemon's GPU side, behind an interface with no CUDA types so the
// daemon compiles and runs without CUDA.
//
// CreateGpuRuntime() returns the CUDA implementation when ckptd is built
// with `--config=cuda` (cuda_runtime.cc) and a stub otherwise (no_cuda.cc),
// whose device operations fail with UNIMPLEMENTED "this ckptd was built
// without CUDA". The CUDA runtime provides:
//  - page-locked host memory for the data cache (a ckpt::HostAllocator that
//    pins large chunks lazily, pinned_arena.h);
//  - `cuda_ipc` destinations: a client's exported device allocations opened
//    once per job (shared across ranks and jobs while open, closed when the
//    last job using them ends or its client goes away);
//  - a Delivery that copies planned slices host -> device with
//    cudaMemcpyAsync / cudaMemcpy2DAsync on a few streams per device
//    (one lane per I/O thread) and waits for them before a read's bytes are
//    released (Delivery::Flush);
//  - the NCCL peer transport of multi-node jobs (peer_link.h).
#ifndef CKPTD_SERVER_CUDA_GPU_H_
#define CKPTD_SERVER_CUDA_GPU_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/cache/cache.h"
#include "core/exec/executor.h"

namespace ckptd::gpu {

class PeerLinks;
struct PeerLinkSpec;

// One exported device allocation of a client (v1.CudaBuffer).
struct IpcBuffer {
  std::string handle;       // the 64 bytes of a cudaIpcMemHandle_t
  int device = -1;          // the client's device ordinal
  std::string device_uuid;  // 16 bytes, or empty
  uint64_t size = 0;        // bytes from the allocation's base the targets may use
};

// Device memory the daemon writes into: opened IPC handles (closed when the
// last reference goes) or, in tests and benchmarks, plain device pointers.
class DeviceBuffers {
 public:
  struct Buffer {
    int device = -1;  // the daemon's ordinal
    uint8_t* ptr = nullptr;
    uint64_t size = 0;
  };
  virtual ~DeviceBuffers() = default;
  const std::vector<Buffer>& buffers() const { return buffers_; }

 protected:
  std::vector<Buffer> buffers_;
};

// Where one rank's targets go: host memory (shm segment, stream buffers)
// or device buffers.
struct RankDestination {
  // Per target: every target's host buffer when `device` is null; with
  // `device`, the buffers of the targets in host memory (the others null).
  std::vector<void*> host;
  std::shared_ptr<const DeviceBuffers> device;
  std::vector<std::pair<uint32_t, uint64_t>> device_targets;  // per target: (buffer, offset)
};

struct GpuOptions {
  bool pin_cache = true;               // page-lock the data cache's memory
  uint64_t pinned_limit = 0;           // bytes of pinned chunks at most (0: no limit)
  uint64_t pinned_chunk = 256ull << 20;
  // Largest pitch of a 2-D copy; 0: the device's (cudaDevAttrMaxPitch). A
  // smaller value (tests) sends rows past it down the row-by-row path.
  int64_t max_pitch = 0;
};

class GpuRuntime {
 public:
  virtual ~GpuRuntime() = default;
  virtual bool compiled_with_cuda() const = 0;
  // CUDA devices this process sees (0 without a driver or device).
  virtual int device_count() const = 0;
  // One line for logs and Status: "built without CUDA", "no CUDA device",
  // or the devices and the pinned cache.
  virtual std::string Describe() const = 0;
  // The data cache's allocator (page-locked chunks), or nullptr.
  virtual ckpt::HostAllocator* host_allocator() = 0;
  virtual uint64_t pinned_bytes() const = 0;

  // Opens a client's exported allocations; `who` names the rank in errors.
  virtual absl::StatusOr<std::shared_ptr<const DeviceBuffers>> OpenIpc(
      const std::vector<IpcBuffer>& buffers, const std::string& who) = 0;

  // The Delivery of one job. Host ranks are copied with ckpt::CopyRegion,
  // device ranks host -> device. `lanes` is the number of I/O threads.
  virtual absl::StatusOr<std::unique_ptr<ckpt::Delivery>> MakeDelivery(
      std::vector<RankDestination> ranks) = 0;

  // Copies device bytes to host memory and waits for them: each copy reads
  // bytes [offset, offset + n) of buffer `buffer` of `src` (checked against
  // its size) into `dst`. The daemon stages a save's device tensors so.
  struct DeviceToHost {
    uint32_t buffer = 0;
    uint64_t offset = 0;
    uint64_t n = 0;
    uint8_t* dst = nullptr;
  };
  virtual absl::Status CopyToHost(const DeviceBuffers& src, const std::vector<DeviceToHost>& copies,
                                  const std::string& who) = 0;

  // NCCL links of a multi-node job (see peer_link.h); UNIMPLEMENTED
  // without CUDA/NCCL or a device.
  virtual bool nccl_available() const = 0;
  virtual absl::StatusOr<std::string> NewNcclId() = 0;
  virtual absl::StatusOr<std::unique_ptr<PeerLinks>> ConnectPeerLinks(const PeerLinkSpec& spec) = 0;
};

std::unique_ptr<GpuRuntime> CreateGpuRuntime(const GpuOptions& options);

// Device pointers the caller owns, as DeviceBuffers (tests, benchmarks).
std::shared_ptr<const DeviceBuffers> WrapDevicePointers(std::vector<DeviceBuffers::Buffer> buffers);

// Checks a rank's device targets against its buffers: every target inside
// its buffer and no two overlapping. `sizes[i]` is target i's byte size.
absl::Status ValidateDeviceTargets(const std::vector<IpcBuffer>& buffers,
                                   const std::vector<std::pair<uint32_t, uint64_t>>& targets,
                                   const std::vector<uint64_t>& sizes,
                                   const std::vector<std::string>& names, const std::string& who);

// A Delivery of host ranks only (the stub's, and the CUDA one's host part).
class HostRanksDelivery final : public ckpt::Delivery {
 public:
  explicit HostRanksDelivery(std::vector<RankDestination> ranks) : ranks_(std::move(ranks)) {}
  absl::StatusOr<int64_t> Copy(size_t rank_index, const ckpt::RankPlan& rank,
                               const ckpt::CopyOp& op, const uint8_t* src) override;

 private:
  std::vector<RankDestination> ranks_;
};

}  // namespace ckptd::gpu

#endif  // CKPTD_SERVER_CUDA_GPU_H_
