// The CUDA GPU runtime (built with --config=cuda): pinned data cache, IPC
// handles of clients' device buffers, and CudaDelivery, which copies planned
// slices host -> device asynchronously.
#include <cuda.h>  // CUdeviceptr and CUresult only: driver calls go through cudaGetDriverEntryPoint
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <spdlog/spdlog.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "core/exec/copy.h"
#include "core/base/dtype.h"
#include "server/cuda/copy_runs.h"
#include "server/cuda/cuda_internal.h"
#include "server/cuda/gpu.h"
#include "server/cuda/nccl_api.h"
#include "server/cuda/pinned_arena.h"

namespace ckptd::gpu {
namespace {

using ckpt::StoredLayout;

absl::Status CudaError(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // clear a non-sticky error
  return absl::InternalError(absl::StrCat("CUDA ", what, ": ", cudaGetErrorName(e), " (",
                                          cudaGetErrorString(e), ")"));
}

// Staging for copies that need the host first (dtype casts, permuted
// sources, small gathered rows): page-locked, reused across jobs.
constexpr uint64_t kStagingBytes = 32ull << 20;
// Rows narrower than this whose destination is contiguous are gathered on
// the host into staging and sent with one linear copy: the copy engines move
// 2-D copies row by row, which is slow for tiny rows but at full speed for
// rows of a KiB and more (so those go directly, with no host pass).
constexpr int64_t kGatherBelow = 1 << 10;

using GetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

// The client allocations the daemon has open, shared by every rank and job
// that names them; a handle is closed when its last user goes.
class IpcCache {
 public:
  struct Opened {
    int device = -1;
    void* ptr = nullptr;
    uint64_t bytes = 0;  // of the allocation from `ptr` on (cuMemGetAddressRange)
    int refs = 0;
  };

  // Opens (or shares) the allocation behind `handle` and checks, on every
  // call, that it holds the `size` bytes the client declared: a copy past
  // its end would fault and poison the daemon's context for every job.
  absl::StatusOr<void*> Open(const std::string& handle, int device, uint64_t size,
                             const std::string& what) {
    absl::MutexLock lock(&mu_);
    auto it = open_.find(handle);
    if (it != open_.end()) {
      if (it->second.device != device) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": handle already open on device ",
                                                       it->second.device, ", not ", device));
      }
      if (size > it->second.bytes) return TooLarge(what, size, it->second.bytes);
      ++it->second.refs;
      return it->second.ptr;
    }
    GetAddressRangeFn range = AddressRange();
    if (range == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": the driver lacks cuMemGetAddressRange, so the buffer's size cannot be checked; "
                "cuda_ipc is refused"));
    }
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) return CudaError(e, absl::StrCat("cudaSetDevice(", device, ")"));
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* p = nullptr;
    e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": cudaIpcOpenMemHandle on device ", device, " failed: ", cudaGetErrorName(e), " (",
          cudaGetErrorString(e), "); the handle must come from cudaIpcGetMemHandle of a live "
          "cudaMalloc allocation of another process on this node (PyTorch's expandable segments "
          "and cudaMallocAsync pools cannot be exported this way)"));
    }
    CUdeviceptr base = 0;
    size_t total = 0;
    const auto at = reinterpret_cast<CUdeviceptr>(p);
    if (CUresult r = range(&base, &total, at); r != CUDA_SUCCESS || at < base ||
                                                at - base > total) {
      cudaIpcCloseMemHandle(p);
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": cuMemGetAddressRange of the opened allocation failed (CUresult ", int(r),
          "); its size cannot be checked, so it is refused"));
    }
    const uint64_t bytes = total - (at - base);
    if (size > bytes) {
      cudaIpcCloseMemHandle(p);
      return TooLarge(what, size, bytes);
    }
    open_[handle] = Opened{device, p, bytes, 1};
    return p;
  }

  void Release(const std::string& handle) {
    absl::MutexLock lock(&mu_);
    auto it = open_.find(handle);
    if (it == open_.end() || --it->second.refs > 0) return;
    cudaSetDevice(it->second.device);
    cudaError_t e = cudaIpcCloseMemHandle(it->second.ptr);
    if (e != cudaSuccess) {
      cudaGetLastError();
      spdlog::warn("cudaIpcCloseMemHandle: {}", cudaGetErrorString(e));
    }
    open_.erase(it);
  }

  size_t size() {
    absl::MutexLock lock(&mu_);
    return open_.size();
  }

 private:
  static absl::Status TooLarge(const std::string& what, uint64_t size, uint64_t bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " declares ", size, " bytes but the allocation holds ", bytes));
  }

  static GetAddressRangeFn AddressRange() {
    static GetAddressRangeFn fn = [] {
      void* f = nullptr;
      cudaDriverEntryPointQueryResult q;
      if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault,
                                           &q) != cudaSuccess ||
          q != cudaDriverEntryPointSuccess) {
        cudaGetLastError();
        spdlog::warn("cuMemGetAddressRange unavailable: cuda_ipc destinations are refused");
        return GetAddressRangeFn(nullptr);
      }
      return reinterpret_cast<GetAddressRangeFn>(f);
    }();
    return fn;
  }

  absl::Mutex mu_;
  std::map<std::string, Opened> open_ ABSL_GUARDED_BY(mu_);
};

class IpcBuffers final : public DeviceBuffers {
 public:
  explicit IpcBuffers(std::shared_ptr<IpcCache> cache) : cache_(std::move(cache)) {}
  ~IpcBuffers() override {
    for (const std::string& h : handles_) cache_->Release(h);
  }
  void Add(const std::string& handle, Buffer b) {
    handles_.push_back(handle);
    buffers_.push_back(b);
  }

 private:
  std::shared_ptr<IpcCache> cache_;
  std::vector<std::string> handles_;
};

class StagingPool {
 public:
  ~StagingPool() {
    for (void* p : free_) cudaFreeHost(p);
  }
  absl::StatusOr<uint8_t*> Acquire() {
    {
      absl::MutexLock lock(&mu_);
      if (!free_.empty()) {
        void* p = free_.back();
        free_.pop_back();
        return static_cast<uint8_t*>(p);
      }
    }
    void* p = nullptr;
    cudaError_t e = cudaMallocHost(&p, kStagingBytes);
    if (e != cudaSuccess) return CudaError(e, "cudaMallocHost (staging)");
    return static_cast<uint8_t*>(p);
  }
  void Release(uint8_t* p) {
    absl::MutexLock lock(&mu_);
    free_.push_back(p);
  }

 private:
  absl::Mutex mu_;
  std::vector<void*> free_ ABSL_GUARDED_BY(mu_);
};

struct DeviceInfo {
  std::string name;
  std::string uuid;  // 16 bytes
  int64_t max_pitch = 0;
};

// One I/O thread's streams (one per device it writes to) and staging.
struct Lane {
  std::map<int, cudaStream_t> streams;
  std::set<int> dirty;  // devices with copies not yet waited for
  uint8_t* staging = nullptr;
  uint64_t staging_used = 0;
  std::vector<uint8_t> permuted;  // row-major copy of a permuted source
};

class CudaDelivery final : public ckpt::Delivery {
 public:
  CudaDelivery(std::vector<RankDestination> ranks, const std::vector<DeviceInfo>* devices,
               StagingPool* pool)
      : ranks_(std::move(ranks)), devices_(devices), pool_(pool) {}

  ~CudaDelivery() override {
    absl::MutexLock lock(&mu_);
    for (auto& [id, lane] : lanes_) {
      for (auto& [dev, st] : lane->streams) {
        cudaSetDevice(dev);
        cudaStreamSynchronize(st);
        cudaStreamDestroy(st);
      }
      if (lane->staging != nullptr) pool_->Release(lane->staging);
    }
  }

  absl::StatusOr<int64_t> Copy(size_t rank_index, const ckpt::RankPlan& rank,
                               const ckpt::CopyOp& op, const uint8_t* src) override {
    const RankDestination& d = ranks_[rank_index];
    const ckpt::TargetTensor& t = rank.targets[op.target];
    // Host ranks, and a device rank's host-memory targets (dest_host).
    if (d.device == nullptr || (op.target < d.host.size() && d.host[op.target] != nullptr)) {
      void* dst = op.target < d.host.size() ? d.host[op.target] : nullptr;
      if (dst == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("rank ", rank.rank, " tensor '", t.name, "' has no destination buffer"));
      }
      return ckpt::CopyRegion(op.src, src, t.layout(), dst, op.region);
    }
    const auto [bi, off] = d.device_targets.at(op.target);
    const DeviceBuffers::Buffer& buf = d.device->buffers().at(bi);
    uint8_t* base = buf.ptr + off;
    const StoredLayout dl = t.layout();
    Lane& lane = GetLane();
    cudaError_t e = cudaSetDevice(buf.device);
    if (e != cudaSuccess) return CudaError(e, "cudaSetDevice");
    auto st = Stream(lane, buf.device);
    if (!st.ok()) return st.status();
    lane.dirty.insert(buf.device);
    const int64_t max_pitch = (*devices_)[buf.device].max_pitch;
    const size_t ssz = ckpt::DTypeSize(op.src.dtype), dsz = ckpt::DTypeSize(dl.dtype);
    absl::Status status;
    const std::string what = absl::StrCat("rank ", rank.rank, " tensor '", t.name, "'");

    const bool direct = IsRowMajor(op.src) && op.src.dtype == dl.dtype;
    const uint8_t* s = src;
    StoredLayout sl = op.src;
    if (!IsRowMajor(op.src)) {
      // A permuted (AOA) source: put the region row-major first.
      StoredLayout whole = StoredLayout::Whole(op.region, op.src.dtype);
      if (ckpt::CountRegion(op.src, whole, op.region) != ckpt::NumElements(op.region.shape)) {
        return absl::UnimplementedError(absl::StrCat(
            what, ": a permuted, flattened source shard cannot be delivered to device memory yet"));
      }
      lane.permuted.resize(whole.num_bytes());
      ckpt::CopyRegion(op.src, src, whole, lane.permuted.data(), op.region);
      s = lane.permuted.data();
      sl = whole;
    }
    const int64_t n = ForEachBlock(sl, dl, op.region, [&](const Block2D& k) {
      if (!status.ok()) return;
      const uint8_t* from = s + k.src * ssz;
      uint8_t* to = base + k.dst * dsz;
      const bool gather = k.height > 1 && k.dst_pitch == k.width &&
                          k.width * static_cast<int64_t>(dsz) < kGatherBelow;
      if (direct && !gather) {
        status = Issue(*st, to, k.dst_pitch * dsz, from, k.src_pitch * ssz, k.width * ssz,
                       k.height, max_pitch, what);
      } else {
        status = Staged(lane, *st, k, from, op.src.dtype, ssz, to, dl.dtype, dsz, max_pitch, what);
      }
    });
    if (!status.ok()) return status;
    return n;
  }

  absl::Status Flush() override {
    Lane& lane = GetLane();
    absl::Status first;
    for (int dev : lane.dirty) {
      cudaSetDevice(dev);
      absl::Status s = CudaError(cudaStreamSynchronize(lane.streams.at(dev)),
                                 absl::StrCat("copies to device ", dev));
      if (first.ok()) first = s;
    }
    lane.dirty.clear();
    lane.staging_used = 0;
    return first;
  }

 private:
  Lane& GetLane() {
    absl::MutexLock lock(&mu_);
    auto& l = lanes_[std::this_thread::get_id()];
    if (!l) l = std::make_unique<Lane>();
    return *l;
  }

  absl::StatusOr<cudaStream_t> Stream(Lane& lane, int device) {
    auto it = lane.streams.find(device);
    if (it != lane.streams.end()) return it->second;
    cudaStream_t st;
    cudaError_t e = cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    if (e != cudaSuccess) return CudaError(e, "cudaStreamCreate");
    lane.streams[device] = st;
    return st;
  }

  // One block host -> device: linear, 2-D, or row by row past the pitch limit.
  static absl::Status Issue(cudaStream_t st, uint8_t* dst, size_t dpitch, const uint8_t* src,
                            size_t spitch, size_t width, int64_t height, int64_t max_pitch,
                            const std::string& what) {
    cudaError_t e;
    if (height == 1) {
      e = cudaMemcpyAsync(dst, src, width, cudaMemcpyHostToDevice, st);
    } else if (static_cast<int64_t>(std::max(dpitch, spitch)) <= max_pitch) {
      e = cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyHostToDevice, st);
    } else {
      e = cudaSuccess;
      for (int64_t r = 0; r < height && e == cudaSuccess; ++r) {
        e = cudaMemcpyAsync(dst + r * dpitch, src + r * spitch, width, cudaMemcpyHostToDevice, st);
      }
    }
    return CudaError(e, absl::StrCat("copy to device for ", what));
  }

  // A block through pinned staging: rows converted (or gathered) on the
  // host, packed, then copied; staging is reused after waiting for the
  // stream when it fills up.
  absl::Status Staged(Lane& lane, cudaStream_t st, const Block2D& k, const uint8_t* from,
                      ckpt::DType sdt, size_t ssz, uint8_t* to, ckpt::DType ddt, size_t dsz,
                      int64_t max_pitch, const std::string& what) {
    if (lane.staging == nullptr) {
      auto p = pool_->Acquire();
      if (!p.ok()) return p.status();
      lane.staging = *p;
      lane.staging_used = 0;
    }
    const uint64_t row_bytes = static_cast<uint64_t>(k.width) * dsz;
    auto room = [&](uint64_t need) -> absl::Status {
      if (lane.staging_used + need <= kStagingBytes) return absl::OkStatus();
      // Wait until earlier copies (on any of the lane's devices) have read it.
      lane.staging_used = 0;
      absl::Status s;
      for (int dev : lane.dirty) {
        if (s.ok()) {
          s = CudaError(cudaStreamSynchronize(lane.streams.at(dev)),
                        absl::StrCat("copy to device for ", what));
        }
      }
      return s;
    };
    if (row_bytes > kStagingBytes) {  // very long rows: piece by piece
      const int64_t per = kStagingBytes / dsz;
      for (int64_t r = 0; r < k.height; ++r) {
        for (int64_t c = 0; c < k.width; c += per) {
          const int64_t cnt = std::min(per, k.width - c);
          if (absl::Status s = room(cnt * dsz); !s.ok()) return s;
          uint8_t* stage = lane.staging + lane.staging_used;
          ckpt::ConvertElements(from + (r * k.src_pitch + c) * ssz, sdt, stage, ddt, cnt);
          if (absl::Status s = Issue(st, to + (r * k.dst_pitch + c) * dsz, cnt * dsz, stage,
                                     cnt * dsz, cnt * dsz, 1, max_pitch, what);
              !s.ok()) {
            return s;
          }
          lane.staging_used += cnt * dsz;
        }
      }
      return absl::OkStatus();
    }
    const int64_t rows_per = std::max<int64_t>(1, kStagingBytes / row_bytes);
    for (int64_t r0 = 0; r0 < k.height; r0 += rows_per) {
      const int64_t rows = std::min(rows_per, k.height - r0);
      if (absl::Status s = room(rows * row_bytes); !s.ok()) return s;
      uint8_t* stage = lane.staging + lane.staging_used;
      for (int64_t r = 0; r < rows; ++r) {
        ckpt::ConvertElements(from + (r0 + r) * k.src_pitch * ssz, sdt, stage + r * row_bytes, ddt,
                              k.width);
      }
      absl::Status s;
      if (k.dst_pitch == k.width) {  // contiguous destination: one linear copy
        s = Issue(st, to + r0 * k.dst_pitch * dsz, rows * row_bytes, stage, rows * row_bytes,
                  rows * row_bytes, 1, max_pitch, what);
      } else {
        s = Issue(st, to + r0 * k.dst_pitch * dsz, k.dst_pitch * dsz, stage, row_bytes, row_bytes,
                  rows, max_pitch, what);
      }
      if (!s.ok()) return s;
      lane.staging_used += rows * row_bytes;
    }
    return absl::OkStatus();
  }

  const std::vector<RankDestination> ranks_;
  const std::vector<DeviceInfo>* devices_;
  StagingPool* pool_;
  absl::Mutex mu_;
  std::map<std::thread::id, std::unique_ptr<Lane>> lanes_ ABSL_GUARDED_BY(mu_);
};

std::string Hex(const std::string& b) { return absl::BytesToHexString(b); }

// 13000 -> "13.0"; 0 -> "none".
std::string CudaVersion(int v) {
  if (v <= 0) return "none";
  return absl::StrCat(v / 1000, ".", (v % 1000) / 10);
}

class CudaRuntime final : public GpuRuntime {
 public:
  explicit CudaRuntime(const GpuOptions& options) {
    int driver = 0;
    int runtime = 0;
    if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
    if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) runtime = 0;
    versions_ = absl::StrCat("driver ", CudaVersion(driver), ", runtime ", CudaVersion(runtime));
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      cudaGetLastError();
      init_error_ = absl::StrCat(cudaGetErrorName(e), ": ", cudaGetErrorString(e));
      if (driver == 0) {
        init_error_ += "; no NVIDIA driver (libcuda.so.1) was found";
      } else if (e == cudaErrorInsufficientDriver) {
        init_error_ += absl::StrCat("; the driver (", CudaVersion(driver),
                                    ") is older than this build's CUDA runtime (",
                                    CudaVersion(runtime), ") needs");
      }
      n = 0;
    }
    if (n == 0) {
      spdlog::warn("CUDA is off ({}): {}", versions_,
                   init_error_.empty() ? "no CUDA device" : init_error_);
    } else {
      spdlog::info("CUDA: {} device(s), {}", n, versions_);
    }
    for (int i = 0; i < n; ++i) {
      cudaDeviceProp p;
      DeviceInfo d;
      if (cudaGetDeviceProperties(&p, i) == cudaSuccess) {
        d.name = p.name;
        d.uuid.assign(reinterpret_cast<const char*>(p.uuid.bytes), 16);
      }
      int mp = 0;
      if (cudaDeviceGetAttribute(&mp, cudaDevAttrMaxPitch, i) == cudaSuccess) d.max_pitch = mp;
      if (d.max_pitch <= 0) d.max_pitch = (1ll << 31) - 1;
      if (options.max_pitch > 0) d.max_pitch = std::min(d.max_pitch, options.max_pitch);
      devices_.push_back(std::move(d));
    }
    if (!devices_.empty() && options.pin_cache) {
      ChunkedHostAllocator::Options o;
      o.chunk_bytes = options.pinned_chunk;
      o.limit_bytes = options.pinned_limit;
      allocator_ = std::make_unique<ChunkedHostAllocator>(
          o,
          [](void* p, uint64_t n) {
            cudaError_t e = cudaHostRegister(p, n, cudaHostRegisterPortable);
            if (e != cudaSuccess) {
              cudaGetLastError();
              spdlog::warn("cudaHostRegister of {} bytes failed ({}); that cache chunk stays "
                           "pageable", n, cudaGetErrorString(e));
              return false;
            }
            return true;
          },
          [](void* p, uint64_t) {
            if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
          });
    }
  }

  bool compiled_with_cuda() const override { return true; }
  int device_count() const override { return static_cast<int>(devices_.size()); }

  std::string Describe() const override {
    if (devices_.empty()) {
      return absl::StrCat("built with CUDA (", versions_, "); no CUDA device",
                          init_error_.empty() ? "" : absl::StrCat(" (", init_error_, ")"));
    }
    std::vector<std::string> d;
    for (size_t i = 0; i < devices_.size(); ++i) {
      d.push_back(absl::StrCat(i, ": ", devices_[i].name));
    }
    return absl::StrCat(devices_.size(), " CUDA device(s) [", absl::StrJoin(d, "; "), "] (",
                        versions_, "); data cache ", allocator_ ? "pinned (lazily, in chunks)" : "pageable",
                        "; open IPC handles ", ipc_->size());
  }

  ckpt::HostAllocator* host_allocator() override { return allocator_.get(); }
  uint64_t pinned_bytes() const override { return allocator_ ? allocator_->pinned_bytes() : 0; }

  absl::StatusOr<std::shared_ptr<const DeviceBuffers>> OpenIpc(const std::vector<IpcBuffer>& buffers,
                                                               const std::string& who) override {
    if (devices_.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          who, ": cuda_ipc destination but this daemon sees no CUDA device",
          init_error_.empty() ? "" : absl::StrCat(" (", init_error_, ")")));
    }
    auto out = std::make_shared<IpcBuffers>(ipc_);
    for (size_t i = 0; i < buffers.size(); ++i) {
      const IpcBuffer& b = buffers[i];
      const std::string what = absl::StrCat(who, ": cuda_ipc buffer ", i);
      int dev = -1;
      if (!b.device_uuid.empty()) {
        for (size_t d = 0; d < devices_.size(); ++d) {
          if (devices_[d].uuid == b.device_uuid) dev = static_cast<int>(d);
        }
        if (dev < 0) {
          return absl::FailedPreconditionError(absl::StrCat(
              what, " lives on device GPU-", Hex(b.device_uuid),
              " which this daemon does not see (check CUDA_VISIBLE_DEVICES of ckptd)"));
        }
      } else {
        if (b.device < 0 || b.device >= static_cast<int>(devices_.size())) {
          return absl::InvalidArgumentError(absl::StrCat(what, " names device ", b.device,
                                                         " but this daemon sees ",
                                                         devices_.size(), " device(s)"));
        }
        dev = b.device;
      }
      auto p = ipc_->Open(b.handle, dev, b.size, what);
      if (!p.ok()) return p.status();  // `out` releases what was opened
      out->Add(b.handle, DeviceBuffers::Buffer{dev, static_cast<uint8_t*>(*p), b.size});
    }
    return std::shared_ptr<const DeviceBuffers>(std::move(out));
  }

  absl::StatusOr<std::unique_ptr<ckpt::Delivery>> MakeDelivery(
      std::vector<RankDestination> ranks) override {
    for (const auto& r : ranks) {
      if (r.device == nullptr) continue;
      for (const auto& b : r.device->buffers()) {
        if (b.device < 0 || b.device >= static_cast<int>(devices_.size())) {
          return absl::InvalidArgumentError(absl::StrCat("device ", b.device, " does not exist"));
        }
      }
    }
    return std::unique_ptr<ckpt::Delivery>(new CudaDelivery(std::move(ranks), &devices_, &staging_));
  }

  absl::Status CopyToHost(const DeviceBuffers& src, const std::vector<DeviceToHost>& copies,
                          const std::string& who) override {
    // One non-blocking stream per device, every copy queued, then waited for.
    std::map<int, cudaStream_t> streams;
    absl::Status status;
    for (const DeviceToHost& c : copies) {
      if (c.n == 0) continue;
      if (c.buffer >= src.buffers().size()) {
        status = absl::InvalidArgumentError(absl::StrCat(who, ": device buffer ", c.buffer,
                                                         " does not exist"));
        break;
      }
      const DeviceBuffers::Buffer& b = src.buffers()[c.buffer];
      if (c.offset > b.size || c.n > b.size - c.offset) {
        status = absl::InvalidArgumentError(absl::StrCat(
            who, ": bytes [", c.offset, ", ", c.offset + c.n, ") outside device buffer ",
            c.buffer, " of ", b.size, " bytes"));
        break;
      }
      status = CudaError(cudaSetDevice(b.device), "cudaSetDevice");
      if (!status.ok()) break;
      auto it = streams.find(b.device);
      if (it == streams.end()) {
        cudaStream_t st;
        status = CudaError(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
        if (!status.ok()) break;
        it = streams.emplace(b.device, st).first;
      }
      status = CudaError(cudaMemcpyAsync(c.dst, b.ptr + c.offset, c.n, cudaMemcpyDeviceToHost,
                                         it->second),
                         absl::StrCat("copy from device for ", who));
      if (!status.ok()) break;
    }
    for (auto& [dev, st] : streams) {  // always waited for: no copy outlives the call
      cudaSetDevice(dev);
      absl::Status s = CudaError(cudaStreamSynchronize(st), absl::StrCat("copy from device for ", who));
      if (status.ok()) status = s;
      cudaStreamDestroy(st);
    }
    return status;
  }

  bool nccl_available() const override { return !devices_.empty() && LoadNccl().ok(); }
  absl::StatusOr<std::string> NewNcclId() override { return NcclUniqueId(); }
  absl::StatusOr<std::unique_ptr<PeerLinks>> ConnectPeerLinks(const PeerLinkSpec& spec) override {
    if (devices_.empty()) return absl::FailedPreconditionError("NCCL links need a CUDA device");
    return ConnectNccl(spec);
  }

 private:
  std::vector<DeviceInfo> devices_;
  std::string init_error_;
  std::string versions_;
  std::shared_ptr<IpcCache> ipc_ = std::make_shared<IpcCache>();
  StagingPool staging_;
  std::unique_ptr<ChunkedHostAllocator> allocator_;
};

}  // namespace

std::unique_ptr<GpuRuntime> CreateGpuRuntime(const GpuOptions& options) {
  return std::make_unique<CudaRuntime>(options);
}

}  // namespace ckptd::gpu
