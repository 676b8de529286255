// NCCL links between the daemons of a multi-node job (peer_link.h). Host
// bytes go through two device staging buffers on the daemon's link device
// (`chunk_bytes` each, double-buffered): the sender copies chunk k+1 host ->
// device on a copy stream while ncclSend moves chunk k; the receiver's
// ncclRecv of chunk k+1 overlaps the device -> host copy of chunk k. Events
// order the two streams, so a buffer is refilled only once it was sent (or
// copied out).
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
    for (int b = 0; b < 2; ++b) {
      if (staging_[b] != nullptr) cudaFree(staging_[b]);
      if (filled_[b] != nullptr) cudaEventDestroy(filled_[b]);
      if (drained_[b] != nullptr) cudaEventDestroy(drained_[b]);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
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
    for (cudaStream_t* st : {&stream_, &copy_stream_}) {
      if (auto s = CudaErr(cudaStreamCreateWithFlags(st, cudaStreamNonBlocking), "stream");
          !s.ok()) {
        return s;
      }
    }
    for (int b = 0; b < 2; ++b) {
      if (auto s = CudaErr(cudaMalloc(&staging_[b], spec_.chunk_bytes), "cudaMalloc (NCCL staging)");
          !s.ok()) {
        return s;
      }
      for (cudaEvent_t* ev : {&filled_[b], &drained_[b]}) {
        if (auto s = CudaErr(cudaEventCreateWithFlags(ev, cudaEventDisableTiming), "event");
            !s.ok()) {
          return s;
        }
      }
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

  // Waits for `stream`, watching the communicator for peer failures.
  absl::Status Drain(cudaStream_t stream, const std::string& what) {
    const absl::Time deadline = absl::Now() + spec_.timeout;
    while (true) {
      cudaError_t e = cudaStreamQuery(stream);
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

  // Chunk k uses staging buffer k % 2. Sending: the copy stream fills a
  // buffer (after the send of chunk k-2 from it: `drained_`), the NCCL
  // stream sends it once filled (`filled_`). Receiving: the NCCL stream
  // receives into a buffer (after the copy-out of chunk k-2: `drained_`),
  // the copy stream copies it out once received (`filled_`).
  absl::Status Transfer(int peer, uint8_t* host, uint64_t n, bool send) {
    if (!ok_) return absl::UnavailableError("NCCL links are down");
    cudaSetDevice(spec_.device);
    const std::string what =
        absl::StrCat(send ? "send to" : "receive from", " node ", peer, " (", n, " bytes)");
    absl::Status s;
    uint64_t k = 0;
    for (uint64_t off = 0; off < n && s.ok(); off += spec_.chunk_bytes, ++k) {
      const uint64_t len = std::min<uint64_t>(spec_.chunk_bytes, n - off);
      const int b = static_cast<int>(k % 2);
      void* buf = staging_[b];
      if (send) {
        if (k >= 2) s = CudaErr(cudaStreamWaitEvent(copy_stream_, drained_[b], 0), what);
        if (s.ok()) {
          s = CudaErr(cudaMemcpyAsync(buf, host + off, len, cudaMemcpyHostToDevice, copy_stream_),
                      what);
        }
        if (s.ok()) s = CudaErr(cudaEventRecord(filled_[b], copy_stream_), what);
        if (s.ok()) s = CudaErr(cudaStreamWaitEvent(stream_, filled_[b], 0), what);
        if (s.ok()) {
          ncclResult_t r = nccl_.Send(buf, len, ncclUint8, peer, comm_, stream_);
          s = (r == ncclSuccess || r == ncclInProgress) ? Wait(what, spec_.timeout)
                                                        : NcclError(nccl_, r, what);
        }
        if (s.ok()) s = CudaErr(cudaEventRecord(drained_[b], stream_), what);
      } else {
        if (k >= 2) s = CudaErr(cudaStreamWaitEvent(stream_, drained_[b], 0), what);
        if (s.ok()) {
          ncclResult_t r = nccl_.Recv(buf, len, ncclUint8, peer, comm_, stream_);
          s = (r == ncclSuccess || r == ncclInProgress) ? Wait(what, spec_.timeout)
                                                        : NcclError(nccl_, r, what);
        }
        if (s.ok()) s = CudaErr(cudaEventRecord(filled_[b], stream_), what);
        if (s.ok()) s = CudaErr(cudaStreamWaitEvent(copy_stream_, filled_[b], 0), what);
        if (s.ok()) {
          s = CudaErr(cudaMemcpyAsync(host + off, buf, len, cudaMemcpyDeviceToHost, copy_stream_),
                      what);
        }
        if (s.ok()) s = CudaErr(cudaEventRecord(drained_[b], copy_stream_), what);
      }
    }
    // Every chunk sent (or copied out) before the host bytes are given back.
    if (s.ok()) s = Drain(stream_, what);
    if (s.ok()) s = Drain(copy_stream_, what);
    if (!s.ok()) {
      spdlog::warn("NCCL link failed ({}); aborting the communicator", s.ToString());
      Abort();
      cudaStreamSynchronize(copy_stream_);  // no copy may still touch `host`
    }
    return s;
  }

  const PeerLinkSpec spec_;
  const NcclApi& nccl_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;       // NCCL operations
  cudaStream_t copy_stream_ = nullptr;  // host <-> staging copies
  void* staging_[2] = {nullptr, nullptr};
  cudaEvent_t filled_[2] = {nullptr, nullptr};
  cudaEvent_t drained_[2] = {nullptr, nullptr};
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
