// The multi-node load balancer: decides which node reads each planned byte
// range from storage.
//
// Generalises Paddle's CheckpointLoadBalancer from files to byte ranges and
// from file counts to bytes: every read is done once in the whole job; a read
// that a node needs and can read locally is read by such a node; otherwise by
// a node that can read its file; among candidates the one with the fewest
// bytes so far (ties: lowest node index). Reads with fewer candidates go
// first, larger before smaller, so the greedy choice balances well. The
// result is deterministic for the same inputs.
//
// Reads that several nodes need are sent by their reader to the others: a
// small checkpoint spread over every node of a large job would connect
// every pair of nodes and cost every node a call per peer, more than the
// bytes themselves. With `min_reader_bytes`, such shared reads go to at most
// K readers, K = ceil(W / min_reader_bytes) where W is their bytes read plus
// the bytes their needers copy from them (what the readers read and send):
// the nodes of `first_readers` first (those every node talks to anyway, such
// as a job's coordinator: a connection fewer for each), the rest spread
// evenly over the node indices; a shared read none of those K can read
// keeps its own candidates, and a read one node needs stays local.
#ifndef CKPTD_CORE_BALANCER_H_
#define CKPTD_CORE_BALANCER_H_

#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/plan/planner.h"

namespace ckpt {

struct ReadAssignment {
  std::vector<int> reader;                  // per plan read: node index, -1 if unneeded
  std::vector<std::vector<int>> needed_by;  // per plan read: nodes that copy from it
  std::vector<uint64_t> bytes_per_node;     // storage bytes each node reads
  int shared_readers = 0;                   // K below (the node count when unlimited)
};

struct AssignOptions {
  // 0: shared reads may go to every node that can read them.
  uint64_t min_reader_bytes = 0;
  // Node indices among the K first (in this order, while K allows).
  std::vector<int> first_readers;
};

// `node_of_rank[i]` is the node of plan.ranks[i]; `readable[n]` the data
// files node n can read. Errors name a file no node can read.
absl::StatusOr<ReadAssignment> AssignReads(const LoadPlan& plan,
                                           const std::vector<int>& node_of_rank,
                                           const std::vector<std::set<std::string>>& readable,
                                           const AssignOptions& options = {});


}  // namespace ckpt

#endif  // CKPTD_CORE_BALANCER_H_
