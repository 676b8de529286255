// The coordinator's plan of a multi-node load, as one part per node: the job
// planned once from every node's join (ckpt::PlanLoadWithAoa), every read
// assigned to one node (ckpt::AssignReads: local storage first, balanced by
// bytes), and each node's part cut to what that node reads, fetches, serves
// and copies (proto/peer.proto PlanPart). Pure: no daemon, no I/O, no
// clock; MultiNodeLoad::PlanParts runs it on the coordinator and
// bench/scale_plan at 1,024-4,096 simulated nodes.
//
//   JobPlanInput in{...};
//   absl::StatusOr<JobParts> p = PlanJobParts(in);
//   p->parts["10.0.0.2:7071"]  // that node's part, without its MAC
//
// Thread-compatible.
#ifndef CKPTD_SERVER_MULTINODE_JOB_PLAN_H_
#define CKPTD_SERVER_MULTINODE_JOB_PLAN_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/format/metadata.h"
#include "proto/peer.pb.h"

namespace ckptd {

struct JobPlanInput {
  std::string job_id;
  const ckpt::CheckpointMetadata* metadata = nullptr;
  std::string aoa;  // the job's AOA statements ("" none)
  // The nodes that joined and their joins, in the same order.
  std::vector<std::string> nodes;
  std::vector<const peer::v1::JoinRequest*> joins;
  std::string coordinator;  // a node of `nodes`: named in every part
  uint64_t max_read_bytes = 0;  // the coordinator's io_request_size (0: no cut)
  // The coordinator's peer_reader_min_bytes (ckpt::AssignOptions; not with
  // whole_tables: NCCL jobs spread over every node).
  uint64_t min_reader_bytes = 0;
  // Nodes that every node calls anyway (the coordinator, the rendezvous
  // node): the first readers of the shared reads (ckpt::AssignOptions),
  // so fetching from them costs no connection of its own.
  std::vector<std::string> first_readers;
  // Every read and node in every part (jobs moving reads over NCCL).
  bool whole_tables = false;
  // Stamped on every part.
  std::string format;
  int64_t unique_id = 0;
};

struct JobParts {
  std::map<std::string, peer::v1::PlanPart> parts;  // node -> its part
  // For the coordinator's log: reads planned, ranks, bytes each node reads.
  size_t reads = 0;
  size_t ranks = 0;
  std::vector<uint64_t> bytes_per_node;  // as `nodes`
  int shared_readers = 0;                // nodes the shared reads went to at most
  uint64_t bytes_to_read = 0;
};

// INVALID_ARGUMENT (naming the rank or tensor) for targets the planner
// refuses; NOT_FOUND/FAILED_PRECONDITION from the balancer when a needed
// read has no node that can read its file.
absl::StatusOr<JobParts> PlanJobParts(const JobPlanInput& in);

}  // namespace ckptd

#endif  // CKPTD_SERVER_MULTINODE_JOB_PLAN_H_
