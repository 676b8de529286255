// Moving a multi-node job's reads between daemons over NCCL links
// (server/cuda/peer_link.h) instead of the gRPC FetchRead stream.
//
// Chosen automatically: every node's JoinRequest says whether it can use
// NCCL (built with CUDA, a device present, CKPTD_PEER_TRANSPORT not "grpc");
// when all can, the coordinator makes one NCCL id for the job and sends it
// in every PlanPart. Each node then runs one thread that connects and walks
// the job's transfers (read g from its reader to each node that needs it)
// in one global order, (read, receiving node) ascending, the same on every
// node, so each matching send/receive pair meets: the earliest unfinished
// transfer always has both ends at it. Senders wait until the read is in
// memory; receivers keep received reads (within a byte budget) until the
// executor takes them. If anything fails, the links are aborted and every
// read not yet received comes over gRPC as before (FetchRead still serves
// every read until the job ends), so NCCL can only make a job faster.
#ifndef CKPTD_SERVER_MULTINODE_PEER_NCCL_H_
#define CKPTD_SERVER_MULTINODE_PEER_NCCL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/exec/executor.h"
#include "server/cuda/gpu.h"
#include "proto/peer.pb.h"
#include "server/cuda/peer_link.h"

namespace ckptd {

class NcclTransfers {
 public:
  struct Transfer {
    uint32_t read = 0;  // global read index
    int peer = 0;       // the other node's index
    bool send = false;  // this node sends (it is the reader)
    uint64_t length = 0;
  };
  // The transfers this node takes part in, in the global order, from every
  // read's reader and needers (node indices).
  static std::vector<Transfer> Schedule(int me, const std::vector<int>& reader,
                                        const std::vector<std::vector<int>>& needed_by,
                                        const std::vector<uint64_t>& length);

  // A read's bytes with the xxh3 the serving node took of them; after the
  // bytes of each transfer its 8-byte xxh3 follows on the link, and the
  // receiver checks it before delivering (as FetchRead's first chunk).
  struct Bytes {
    ckpt::RangeView view;
    uint64_t xxh3 = 0;
  };
  // `served(g, deadline)`: the bytes of read g this node reads, once they are
  // in memory (kept alive by the view's pin).
  using ServedFn = std::function<absl::StatusOr<Bytes>(uint32_t, absl::Time)>;
  NcclTransfers(gpu::GpuRuntime* gpu, gpu::PeerLinkSpec spec, std::vector<Transfer> transfers,
                ServedFn served, uint64_t receive_budget);
  ~NcclTransfers();  // aborts what is still running

  void Start();
  // Whether read g arrives over the links (while they work).
  bool Receives(uint32_t g) const { return receives_.count(g) > 0; }
  // The received bytes of read g, or nullopt when the links failed (or the
  // deadline passed) before it arrived: fetch it over gRPC then.
  std::optional<Bytes> Take(uint32_t g, absl::Time deadline);
  // Waits (until `deadline`) for this node's sends to finish, then closes.
  absl::Status Finish(absl::Time deadline);
  void Abort();

  // Whether the communicator could not be created (a node never connected
  // within the connect timeout, or NCCL failed there).
  bool connect_failed() const { return connect_failed_.load(); }
  uint64_t bytes_sent() const { return sent_.load(); }
  uint64_t bytes_received() const { return received_.load(); }

 private:
  void Run();
  static gpu::PeerLinkSpec WithCancel(gpu::PeerLinkSpec spec,
                                      std::shared_ptr<std::atomic<bool>> cancel);

  const std::shared_ptr<std::atomic<bool>> cancel_ = std::make_shared<std::atomic<bool>>(false);
  gpu::GpuRuntime* const gpu_;
  const gpu::PeerLinkSpec spec_;
  const std::vector<Transfer> transfers_;
  const ServedFn served_;
  const uint64_t budget_;
  std::map<uint32_t, uint64_t> receives_;  // read -> length
  std::thread thread_;
  std::atomic<uint64_t> sent_{0}, received_{0};
  std::atomic<bool> connect_failed_{false};

  absl::Mutex mu_;
  std::unique_ptr<gpu::PeerLinks> links_ ABSL_GUARDED_BY(mu_);
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  uint64_t buffered_ ABSL_GUARDED_BY(mu_) = 0;
  struct Arrived {
    std::shared_ptr<uint8_t> bytes;  // RecvBuffer: pinned when it can be, never zero-filled
    uint64_t length = 0;
    uint64_t xxh3 = 0;
  };
  // `n` bytes to receive into: page-locked from the GPU runtime's allocator
  // (faster device -> host copies) when it has room, else plain memory;
  // not initialised (every byte is received before anyone reads it).
  std::shared_ptr<uint8_t> RecvBuffer(uint64_t n);
  std::map<uint32_t, Arrived> ready_ ABSL_GUARDED_BY(mu_);
};

// Whether this node offers NCCL to a job's coordinator: a device is present
// and $CKPTD_PEER_TRANSPORT is not "grpc".
bool NcclWanted(gpu::GpuRuntime& gpu);

// The NCCL transfers of `part` for node `me`, started (every node of the
// job connects, with or without transfers); null when the part carries no
// NCCL id. The links run on CUDA device `device` (config nccl_device).
std::unique_ptr<NcclTransfers> StartNcclTransfers(gpu::GpuRuntime* gpu,
                                                  const peer::v1::PlanPart& part,
                                                  const std::string& me, int device,
                                                  absl::Duration timeout,
                                                  absl::Duration connect_timeout,
                                                  NcclTransfers::ServedFn served);

}  // namespace ckptd

#endif  // CKPTD_SERVER_MULTINODE_PEER_NCCL_H_
