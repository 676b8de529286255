// The client's device export with CUDA (--config=cuda).
#include <cuda.h>  // types only; the driver call goes through cudaGetDriverEntryPoint
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <map>

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

GetAddressRangeFn AddressRange() {
  static GetAddressRangeFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return GetAddressRangeFn(nullptr);
    }
    return reinterpret_cast<GetAddressRangeFn>(f);
  }();
  return fn;
}

}  // namespace

bool ClientBuiltWithCuda() { return true; }

absl::Status AddCudaIpcDestination(const std::vector<const void*>& ptrs,
                                   const std::vector<uint64_t>& sizes,
                                   const std::vector<std::string>& names, v1::LoadRequest* req) {
  v1::CudaIpcDestination* dest = req->mutable_cuda_ipc();
  std::map<std::pair<int, CUdeviceptr>, uint32_t> by_base;  // (device, base) -> buffer
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
