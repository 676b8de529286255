// NCCL links between the daemons of a multi-node job (peer_link.h). Host
// bytes go through a device staging buffer on the daemon's link device:
// sender H2D + ncclSend, receiver ncclRecv + D2H, `chunk_bytes` at a time.
// The communicator is non-blocking so every wait has a deadline and a dead
// peer turns into an error (and ncclCommAbort), never a hang.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <thread>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/cuda/cuda_internal.h"
#include "server/cuda/nccl_api.h"

namespace ckptd::gpu {
namespace {

absl::Status NcclError(const NcclApi& nccl, ncclResult_t r, const std::string& what) {
  if (r == ncclSuccess) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("NCCL ", what, ": ", nccl.GetErrorString(r)));
}

absl::Status CudaErr(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat("CUDA ", what, ": ", cudaGetErrorString(e)));
}

class NcclLinks final : public PeerLinks {
 public:
  static absl::StatusOr<std::unique_ptr<PeerLinks>> Connect(const PeerLinkSpec& spec) {
    if (spec.nccl_id.size() != sizeof(ncclUniqueId)) {
      return absl::InvalidArgumentError(absl::StrCat("NCCL id of ", spec.nccl_id.size(),
                                                     " bytes, expected ", sizeof(ncclUniqueId)));
    }
    absl::StatusOr<const NcclApi*> nccl = LoadNccl();
    if (!nccl.ok()) return nccl.status();
    auto links = std::unique_ptr<NcclLinks>(new NcclLinks(spec, **nccl));
    if (absl::Status s = links->Init(); !s.ok()) return s;
    return std::unique_ptr<PeerLinks>(std::move(links));
  }

  ~NcclLinks() override {
    if (comm_ != nullptr && !aborted_) {
      cudaSetDevice(spec_.device);
      ncclResult_t r = ok_ && !Cancelled() ? nccl_.CommFinalize(comm_) : ncclInternalError;
      if ((r == ncclSuccess || r == ncclInProgress) && Wait("finalize", spec_.timeout).ok()) {
        nccl_.CommDestroy(comm_);
      } else {
        nccl_.CommAbort(comm_);
      }
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (staging_ != nullptr) cudaFree(staging_);
  }

  absl::Status Send(int peer, const uint8_t* data, uint64_t n) override {
    return Transfer(peer, const_cast<uint8_t*>(data), n, /*send=*/true);
  }
  absl::Status Recv(int peer, uint8_t* data, uint64_t n) override {
    return Transfer(peer, data, n, /*send=*/false);
  }

 private:
  // On the owning thread only: ncclCommAbort frees the communicator.
  void Abort() {
    if (comm_ != nullptr && !aborted_) {
      cudaSetDevice(spec_.device);
      nccl_.CommAbort(comm_);
      aborted_ = true;
      ok_ = false;
    }
  }
  bool Cancelled() const { return spec_.cancelled && spec_.cancelled(); }

  NcclLinks(const PeerLinkSpec& spec, const NcclApi& nccl) : spec_(spec), nccl_(nccl) {}

  absl::Status Init() {
    if (auto s = CudaErr(cudaSetDevice(spec_.device), "cudaSetDevice"); !s.ok()) return s;
    if (auto s = CudaErr(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
        !s.ok()) {
      return s;
    }
    if (auto s = CudaErr(cudaMalloc(&staging_, spec_.chunk_bytes), "cudaMalloc (NCCL staging)");
        !s.ok()) {
      return s;
    }
    ncclUniqueId id;
    std::memcpy(&id, spec_.nccl_id.data(), sizeof(id));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = nccl_.CommInitRankConfig(&comm_, spec_.nranks, id, spec_.rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      comm_ = nullptr;
      return NcclError(nccl_, r, "ncclCommInitRankConfig");
    }
    if (absl::Status s = Wait("connect", spec_.connect_timeout); !s.ok()) {
      Abort();
      return s;
    }
    ok_ = true;
    return absl::OkStatus();
  }

  // Polls the communicator until its pending operation is issued.
  absl::Status Wait(const std::string& what, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      ncclResult_t state = ncclSuccess;
      ncclResult_t r = nccl_.CommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) return NcclError(nccl_, r, what);
      if (state == ncclSuccess) return absl::OkStatus();
      if (state != ncclInProgress) return NcclError(nccl_, state, what);
      if (Cancelled()) return absl::CancelledError(absl::StrCat("NCCL ", what, ": cancelled"));
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat("NCCL ", what, " did not finish within ",
                                                        absl::FormatDuration(timeout)));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  // Waits for the stream, watching the communicator for peer failures.
  absl::Status Drain(const std::string& what) {
    const absl::Time deadline = absl::Now() + spec_.timeout;
    while (true) {
      cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) return CudaErr(e, what);
      ncclResult_t state = ncclSuccess;
      nccl_.CommGetAsyncError(comm_, &state);
      if (state != ncclSuccess && state != ncclInProgress) return NcclError(nccl_, state, what);
      if (Cancelled()) return absl::CancelledError(absl::StrCat("NCCL ", what, ": cancelled"));
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat("NCCL ", what, " did not finish within ",
                                                        absl::FormatDuration(spec_.timeout)));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  absl::Status Transfer(int peer, uint8_t* host, uint64_t n, bool send) {
    if (!ok_) return absl::UnavailableError("NCCL links are down");
    cudaSetDevice(spec_.device);
    const std::string what =
        absl::StrCat(send ? "send to" : "receive from", " node ", peer, " (", n, " bytes)");
    absl::Status s;
    for (uint64_t off = 0; off < n && s.ok(); off += spec_.chunk_bytes) {
      const uint64_t len = std::min<uint64_t>(spec_.chunk_bytes, n - off);
      if (send) {
        s = CudaErr(cudaMemcpyAsync(staging_, host + off, len, cudaMemcpyHostToDevice, stream_),
                    what);
        if (s.ok()) {
          ncclResult_t r = nccl_.Send(staging_, len, ncclUint8, peer, comm_, stream_);
          s = (r == ncclSuccess || r == ncclInProgress) ? Wait(what, spec_.timeout) : NcclError(nccl_, r, what);
        }
      } else {
        ncclResult_t r = nccl_.Recv(staging_, len, ncclUint8, peer, comm_, stream_);
        s = (r == ncclSuccess || r == ncclInProgress) ? Wait(what, spec_.timeout) : NcclError(nccl_, r, what);
        if (s.ok()) {
          s = CudaErr(cudaMemcpyAsync(host + off, staging_, len, cudaMemcpyDeviceToHost, stream_),
                      what);
        }
      }
      if (s.ok()) s = Drain(what);
    }
    if (!s.ok()) {
      spdlog::warn("NCCL link failed ({}); aborting the communicator", s.ToString());
      Abort();
    }
    return s;
  }

  const PeerLinkSpec spec_;
  const NcclApi& nccl_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* staging_ = nullptr;
  bool ok_ = false;
  bool aborted_ = false;
};

}  // namespace

absl::StatusOr<std::string> NcclUniqueId() {
  absl::StatusOr<const NcclApi*> nccl = LoadNccl();
  if (!nccl.ok()) return nccl.status();
  ncclUniqueId id;
  ncclResult_t r = (*nccl)->GetUniqueId(&id);
  if (r != ncclSuccess) return NcclError(**nccl, r, "ncclGetUniqueId");
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

absl::StatusOr<std::unique_ptr<PeerLinks>> ConnectNccl(const PeerLinkSpec& spec) {
  return NcclLinks::Connect(spec);
}

}  // namespace ckptd::gpu
