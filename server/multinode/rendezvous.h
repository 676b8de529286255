// Where the nodes of a multi-node job find its coordinator, in O(1)
// (docs/multi-node.md, issue 34): every node computes the same rendezvous
// ring for a job from its id and the peer set (RendezvousRing); the
// coordinator (the node serving coordinator_rank) announces itself at the
// first two nodes of the ring it reaches, with a MAC of the job and its
// address under the ranks' job key; every other node asks the same nodes
// (past those it cannot reach), waiting until the coordinator is announced
// or the deadline passes, checks the MAC and joins the coordinator once. No
// node sweeps the peer set: a node down costs one failed connection.
//
// Rendezvous is the table one daemon keeps for the jobs it is a rendezvous
// node of: announcements kept a while (late joiners), bounded in jobs and in
// coordinators per job (a peer may announce itself falsely; a joiner takes
// only one whose MAC proves the job's key).
//
// Thread-safe.
#ifndef CKPTD_SERVER_MULTINODE_RENDEZVOUS_H_
#define CKPTD_SERVER_MULTINODE_RENDEZVOUS_H_

#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace ckptd {

// The rendezvous ring of job `job_id` among `members` (every daemon of the
// peer set, this one included; any order): all of them, sorted, rotated to
// start at one picked by a hash of the job id. The same on every node with
// the same peer set. The coordinator announces itself at the first two it
// reaches; a joiner asks the ring in the same order, past the nodes it
// cannot reach, until one of the first two it reaches names the coordinator.
std::vector<std::string> RendezvousRing(const std::string& job_id,
                                        std::vector<std::string> members);

// How many reachable rendezvous nodes a coordinator announces itself at.
inline constexpr int kRendezvousCopies = 2;

class Rendezvous {
 public:
  struct Limits {
    size_t max_jobs = 1 << 16;
    size_t max_coordinators_per_job = 4;
    size_t max_job_id_bytes = 1024;
    size_t max_node_bytes = 1024;
  };
  // Announcements are kept for `keep` after they were made.
  explicit Rendezvous(absl::Duration keep) : Rendezvous(keep, Limits()) {}
  Rendezvous(absl::Duration keep, Limits limits) : keep_(keep), limits_(limits) {}

  // `node` announces itself as the coordinator of `job_id` with `mac`.
  // INVALID_ARGUMENT for an id or node over the limits; RESOURCE_EXHAUSTED
  // when the table or the job's entry is full.
  absl::Status Announce(const std::string& job_id, const std::string& node,
                        const std::string& mac);

  struct Coordinator {
    std::string node;
    std::string mac;
  };
  // The coordinators announced for `job_id`, once there is one: waits until
  // `deadline` (DEADLINE_EXCEEDED) or `cancelled()` (CANCELLED).
  absl::StatusOr<std::vector<Coordinator>> Await(const std::string& job_id, absl::Time deadline,
                                                 const std::function<bool()>& cancelled);

  size_t size() const;

 private:
  void PurgeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  struct Entry {
    std::vector<Coordinator> coordinators;
    absl::Time expires;
  };
  const absl::Duration keep_;
  const Limits limits_;
  mutable absl::Mutex mu_;
  std::map<std::string, Entry> jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_MULTINODE_RENDEZVOUS_H_
