// Point-to-point links between the daemons of a multi-node job, for moving
// planned reads between GPU nodes over NCCL (NVLink/InfiniBand/RoCE with
// GPUDirect where the fabric has it) instead of the gRPC peer stream.
//
// One communicator per job spans every node of the job (rank = the node's
// index in PlanPart.nodes). The coordinator makes the NCCL unique id
// (GpuRuntime::NewNcclId) and sends it to every node in its plan part over
// the peer gRPC service; each node connects (GpuRuntime::ConnectPeerLinks)
// and one thread per node walks the job's transfers in one global order
// (server/nccl_schedule.h), so matching sends and receives never deadlock.
// Any failure aborts the communicator and the remaining reads fall back to
// gRPC. No CUDA types here.
#ifndef CKPTD_SERVER_CUDA_PEER_LINK_H_
#define CKPTD_SERVER_CUDA_PEER_LINK_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace ckptd::gpu {

struct PeerLinkSpec {
  std::string nccl_id;  // the bytes of an ncclUniqueId
  int nranks = 0;       // nodes of the job
  int rank = 0;         // this node's index
  int device = 0;       // the daemon's CUDA device used for the links
  absl::Duration timeout = absl::Seconds(60);  // each transfer step
  // Creating the communicator: every node of the job must take part, so a
  // node that never connects is noticed after this, not after `timeout`.
  absl::Duration connect_timeout = absl::Seconds(5);
  uint64_t chunk_bytes = 64ull << 20;          // device staging per transfer step
  // Polled while waiting: true aborts the links (from any thread).
  std::function<bool()> cancelled;
};

// The links of one node for one job. Not thread-safe: one thread uses it.
class PeerLinks {
 public:
  virtual ~PeerLinks() = default;  // aborts transfers still in flight
  // Sends `n` host bytes to node `peer`, which receives them with Recv.
  virtual absl::Status Send(int peer, const uint8_t* data, uint64_t n) = 0;
  virtual absl::Status Recv(int peer, uint8_t* data, uint64_t n) = 0;
};

}  // namespace ckptd::gpu

#endif  // CKPTD_SERVER_CUDA_PEER_LINK_H_
