#include "server/multinode/dist_job.h"

#include <algorithm>

#include <spdlog/spdlog.h>

#include "server/multinode/job_mac.h"
#include "server/multinode/plan_codec.h"

namespace ckptd {

absl::Status DistJob::RefuseLocked(const PeerCaller& caller, const std::string& node,
                                   absl::string_view what) {
  absl::Status s =
      absl::PermissionDeniedError(absl::StrCat("job '", id, "': ", caller.Describe(), " ", what));
  spdlog::warn("peer plane: {} (refused; the job goes on)", std::string(s.message()));
  // At most a few kept (`node` may be any name the caller made up).
  constexpr size_t kMaxRefusedKept = 16;
  if (refused.size() < kMaxRefusedKept || refused.count(node)) {
    refused[node] = absl::StrCat(caller.Describe(), " ", what);
  }
  return s;
}

absl::Status DistJob::ViolationLocked(const PeerCaller& caller, absl::string_view what) {
  absl::Status s =
      absl::PermissionDeniedError(absl::StrCat("job '", id, "': ", caller.Describe(), " ", what));
  spdlog::warn("peer plane: {}", std::string(s.message()));
  if (violation.ok()) violation = s;
  if (coordinator) {
    if (!planned) {
      plan_status = s;
      planned = true;
    } else if (!finished) {
      peer::v1::CompleteRequest c;
      c.set_ok(false);
      c.set_error(std::string(s.message()));
      c.set_error_code(static_cast<int>(s.code()));
      completes.emplace("(authorization)", std::move(c));
    }
  }
  return s;
}

absl::Status CheckJobKeyed(const Job& job, bool unkeyed_allowed) {
  if (!job.job_key.empty() || unkeyed_allowed) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "job '", job.id, "' spans several daemons (this one serves ", job.expected.size(), " of ",
      job.world_size, " ranks) but its ranks sent no job_key: give every rank the same secret "
      "of ", kMinJobKeyBytes, " to ", kMaxJobKeyBytes, " bytes (CKPTD_JOB_KEY; the Python "
      "client agrees on one over torch.distributed when it is initialised), or set "
      "peer_unkeyed_jobs: true on every daemon (any node of the peer set that knows the job id "
      "could then join it and be served its bytes)"));
}

peer::v1::JoinRequest BaseJoin(const Job& job,
                               const std::vector<std::shared_ptr<RankSlot>>& slots,
                               const std::string& node, const std::string& path, int coordinator_rank) {
  peer::v1::JoinRequest own;
  own.set_job_id(job.id);
  own.set_node(node);
  own.set_path(path);
  if (job.unique_id) own.set_unique_id(*job.unique_id);
  own.set_world_size(job.world_size);
  own.set_coordinator_rank(coordinator_rank);
  own.set_job_mac(JoinMac(job.job_key, job.id, node));
  for (const auto& s : slots) {
    peer::v1::RankTargetsMsg* rm = own.add_ranks();
    rm->set_rank(s->targets.rank);
    for (const auto& t : s->targets.tensors) ToMsg(t, rm->add_targets());
  }
  return own;
}

absl::Status CheckPartOrigin(const peer::v1::PlanPart& part, const std::string& job_id,
                             const std::string& me, const std::string& coordinator) {
  const auto& n = part.nodes();
  if (part.job_id() != job_id || std::find(n.begin(), n.end(), me) == n.end() ||
      std::find(n.begin(), n.end(), coordinator) == n.end()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "job '", job_id, "': the plan part from ", coordinator,
        " is not one the job's coordinator could have made (job id or nodes do not match)"));
  }
  return absl::OkStatus();
}

absl::Status JobOutcome(const std::string& job_id, const absl::Status& exec,
                        const absl::StatusOr<peer::v1::CompleteResponse>& outcome) {
  absl::Status final_status = outcome.ok() ? absl::OkStatus() : outcome.status();
  if (outcome.ok() && !outcome->ok()) {
    final_status = absl::Status(static_cast<absl::StatusCode>(outcome->error_code()),
                                absl::StrCat("job '", job_id, "' failed on another node: ",
                                             outcome->error()));
    if (final_status.ok()) final_status = absl::AbortedError(outcome->error());
  }
  // This node's own failure, unless it only echoes another node's (its
  // fetches refused or cut because that node failed) and the outcome names
  // the cause.
  const bool outcome_names_cause =
      !final_status.ok() && !EchoOfAnotherFailure(static_cast<int>(final_status.code()));
  if (!exec.ok() && !(EchoOfAnotherFailure(static_cast<int>(exec.code())) && outcome_names_cause)) {
    final_status = exec;
  }
  return final_status;
}

PlanPartContext PartContextOf(const Job& job, const std::vector<std::shared_ptr<RankSlot>>& slots,
                              const std::string& me, const std::string& coordinator) {
  PlanPartContext pctx;
  pctx.job_id = job.id;
  pctx.node = me;
  pctx.sender = coordinator;
  pctx.world_size = job.world_size;
  for (const auto& s : slots) pctx.ranks.push_back(&s->targets);
  return pctx;
}

}  // namespace ckptd
