// The client's device export with CUDA (--config=cuda).
#include <cuda.h>  // types only; the driver call goes through cudaGetDriverEntryPoint
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "client/cuda/device_export.h"

namespace ckptd {
namespace {

absl::Status CudaError(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::FailedPreconditionError(
      absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

using GetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
using PointerGetAttributeFn = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);

// A driver function through the runtime's entry-point query (no -lcuda);
// null when the driver lacks it.
template <typename Fn>
Fn DriverEntryPoint(const char* name) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Fn>(f);
}

PointerGetAttributeFn PointerAttribute() {
  static const PointerGetAttributeFn fn =
      DriverEntryPoint<PointerGetAttributeFn>("cuPointerGetAttribute");
  return fn;
}

// Restores the caller's current device when the export is done.
class KeepCurrentDevice {
 public:
  KeepCurrentDevice() {
    if (cudaGetDevice(&device_) != cudaSuccess) {
      cudaGetLastError();
      device_ = -1;
    }
  }
  ~KeepCurrentDevice() {
    if (device_ >= 0) cudaSetDevice(device_);
  }

 private:
  int device_ = -1;
};

GetAddressRangeFn AddressRange() {
  static const GetAddressRangeFn fn = DriverEntryPoint<GetAddressRangeFn>("cuMemGetAddressRange");
  return fn;
}

}  // namespace

bool ClientBuiltWithCuda() { return true; }

absl::Status AddCudaIpcDestination(const std::vector<const void*>& ptrs,
                                   const std::vector<uint64_t>& sizes,
                                   const std::vector<std::string>& names, v1::LoadRequest* req) {
  KeepCurrentDevice keep;
  v1::CudaIpcDestination* dest = req->mutable_cuda_ipc();
  std::map<std::pair<int, CUdeviceptr>, uint32_t> by_base;  // (device, base) -> buffer
  std::set<int> devices;
  for (size_t i = 0; i < ptrs.size(); ++i) {
    const std::string what = absl::StrCat("tensor '", names[i], "'");
    if (ptrs[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(what, " has no device buffer (cuda_ipc)"));
    }
    cudaPointerAttributes attr;
    if (absl::Status s = CudaError(cudaPointerGetAttributes(&attr, ptrs[i]),
                                   absl::StrCat(what, ": cudaPointerGetAttributes"));
        !s.ok()) {
      return s;
    }
    if (attr.type != cudaMemoryTypeDevice) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": cuda_ipc needs device memory (cudaMalloc), not memory of type ",
                       static_cast<int>(attr.type)));
    }
    if (absl::Status s = CudaError(cudaSetDevice(attr.device), "cudaSetDevice"); !s.ok()) return s;
    devices.insert(attr.device);
    GetAddressRangeFn range = AddressRange();
    if (range == nullptr) {
      return absl::FailedPreconditionError("cuMemGetAddressRange is unavailable (CUDA driver)");
    }
    CUdeviceptr base = 0;
    size_t bytes = 0;
    const CUdeviceptr p = reinterpret_cast<CUdeviceptr>(ptrs[i]);
    if (range(&base, &bytes, p) != CUDA_SUCCESS) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": cuMemGetAddressRange failed (memory from cudaMallocAsync pools "
                             "or cuMemMap cannot be exported; use cudaMalloc or a DeviceArena)"));
    }
    if ((p - base) + sizes[i] > bytes) {
      return absl::InvalidArgumentError(absl::StrCat(what, " (", sizes[i],
                                                     " bytes) runs past its allocation"));
    }
    auto key = std::make_pair(attr.device, base);
    auto it = by_base.find(key);
    if (it == by_base.end()) {
      // PyTorch's expandable segments and cudaMallocAsync pools are virtual
      // memory mappings that legacy CUDA IPC cannot export: say so by name.
      if (PointerGetAttributeFn get = PointerAttribute()) {
        int capable = 1;
        if (get(&capable, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, p) == CUDA_SUCCESS &&
            capable == 0) {
          return absl::FailedPreconditionError(absl::StrCat(
              what, ": its memory cannot be exported with CUDA IPC (not legacy-IPC capable: "
                    "cudaMallocAsync pools and PyTorch's expandable_segments are not); allocate "
                    "it with cudaMalloc (PYTORCH_CUDA_ALLOC_CONF without expandable_segments) or "
                    "use a DeviceArena"));
        }
      }
      cudaIpcMemHandle_t h;
      if (absl::Status s = CudaError(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base)),
                                     absl::StrCat(what, ": cudaIpcGetMemHandle"));
          !s.ok()) {
        return s;
      }
      cudaDeviceProp prop;
      if (absl::Status s = CudaError(cudaGetDeviceProperties(&prop, attr.device),
                                     "cudaGetDeviceProperties");
          !s.ok()) {
        return s;
      }
      v1::CudaBuffer* b = dest->add_buffers();
      b->set_ipc_handle(std::string(reinterpret_cast<const char*>(&h), sizeof(h)));
      b->set_device(attr.device);
      b->set_size(bytes);
      b->set_device_uuid(std::string(reinterpret_cast<const char*>(prop.uuid.bytes), 16));
      it = by_base.emplace(key, static_cast<uint32_t>(dest->buffers_size() - 1)).first;
    }
    v1::Target* t = req->mutable_targets(static_cast<int>(i));
    t->set_dest_buffer(it->second);
    t->set_dest_offset(p - base);
  }
  // The daemon writes these buffers from its own context: work the caller
  // queued on them (a cudaMemset, a kernel on any stream) must be finished
  // first, or it could land after (and over) the loaded bytes.
  for (int d : devices) {
    if (absl::Status s = CudaError(cudaSetDevice(d), "cudaSetDevice"); !s.ok()) return s;
    if (absl::Status s = CudaError(cudaDeviceSynchronize(),
                                   absl::StrCat("cudaDeviceSynchronize(device ", d, ")"));
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DeviceArena>> DeviceArena::Create(int device, uint64_t size) {
  if (absl::Status s = CudaError(cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
  void* p = nullptr;
  if (absl::Status s = CudaError(cudaMalloc(&p, std::max<uint64_t>(size, 256)),
                                 absl::StrCat("cudaMalloc of ", size, " bytes"));
      !s.ok()) {
    return s;
  }
  return std::unique_ptr<DeviceArena>(new DeviceArena(device, static_cast<uint8_t*>(p), size));
}

DeviceArena::~DeviceArena() {
  if (data_ != nullptr) {
    cudaSetDevice(device_);
    cudaFree(data_);
  }
}

void* DeviceArena::Allocate(uint64_t n) {
  const uint64_t at = (used_ + 255) / 256 * 256;
  if (at > size_ || n > size_ - at) return nullptr;
  used_ = at + n;
  return data_ + at;
}

}  // namespace ckptd
