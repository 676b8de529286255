// Job keys across nodes (docs/security.md, "Job keys"): the ranks of a
// multi-node job share a secret key (LoadRequest.job_key) that each sends to
// its own daemon only. A node joins the job with a MAC of the job id and its
// own address under that key (JoinRequest.job_mac), and the coordinator
// answers each node with a MAC of the job, itself and that node
// (PlanPart.coordinator_mac): a member of the peer set that knows a job's id
// but none of its ranks' key can neither join it nor pose as its
// coordinator.
//
// The key's size is checked where the request arrives (CheckJobKey,
// server/jobs/job.h). HMAC-SHA256 (OpenSSL's libcrypto); MACs compared in
// constant time.
// Stateless; thread-safe.
#ifndef CKPTD_SERVER_MULTINODE_JOB_MAC_H_
#define CKPTD_SERVER_MULTINODE_JOB_MAC_H_

#include <string>

#include "absl/strings/string_view.h"

namespace ckptd {

// What node `node` sends with its join of job `job_id` (empty without a key).
std::string JoinMac(absl::string_view key, absl::string_view job_id, absl::string_view node);
// What coordinator `coordinator` sends with node `node`'s part of the plan
// (empty without a key).
std::string PlanMac(absl::string_view key, absl::string_view job_id,
                    absl::string_view coordinator, absl::string_view node);
// What coordinator `node` announces itself with at the job's rendezvous
// nodes (server/multinode/rendezvous.h; empty without a key).
std::string CoordinatorMac(absl::string_view key, absl::string_view job_id,
                           absl::string_view node);
// Whether `got` is `want` (constant time in their contents; both empty
// counts as equal: a job without a key).
bool MacMatches(absl::string_view got, absl::string_view want);

}  // namespace ckptd

#endif  // CKPTD_SERVER_MULTINODE_JOB_MAC_H_
