// What the load runs a multi-node part on (DistJobs::PeerReadsFor makes
// it): the reads other nodes serve, beside this node's storage. Its own
// header so the load path sees no peer protocol.
#ifndef CKPTD_SERVER_MULTINODE_REMOTE_READS_H_
#define CKPTD_SERVER_MULTINODE_REMOTE_READS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "core/exec/executor.h"

namespace ckptd {

// The reads of a multi-node load's part that other nodes serve
// (DistJobs::PeerReadsFor): the load runs the part on Wrap(storage),
// then tells how the execution ended.
class RemoteReads {
 public:
  virtual ~RemoteReads() = default;
  // The source the part runs on: `storage` (this node's data cache and
  // files) for its own reads, peers for the others.
  virtual ckpt::RangeSource* Wrap(ckpt::RangeSource* storage) = 0;
  // The part's execution ended with `status` (device mappings closed).
  virtual void Ended(const absl::Status& status) = 0;
  // Bytes received from peers, and of this node's reads sent to them.
  virtual uint64_t bytes_received() const = 0;
  virtual uint64_t bytes_sent() const = 0;
  // The whole length of the reads that came from peers (a read fetched by
  // spans counts whole: the executor counts it so, as not from storage).
  virtual uint64_t peer_read_length() const = 0;
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_MULTINODE_REMOTE_READS_H_
