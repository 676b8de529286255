// The coordinator's side of a multi-node job (the node serving
// coordinator_rank) and a joiner's way to it: the coordinator gathers every
// node's join (PeerJoin, GatherJoins), plans the job once across the nodes
// with the planner its caller gives (PlanPartOf) and hands each node its
// part (PublishParts); then it collects every node's completion and decides
// the job's outcome (PeerComplete, AwaitOutcome). docs/multi-node.md tells
// the protocol.
#include <algorithm>
#include <chrono>

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/base/status_macros.h"
#include "server/await.h"
#include "server/multinode/dist_jobs.h"
#include "server/multinode/job_mac.h"
#include "server/peer/peer_plane.h"

namespace ckptd {
namespace {

// Why rank `rank`, already joined, may not join again from `node`: names
// the node it joined from first.
std::string RankJoinedTwice(const DistJob& dj, int rank, const std::string& node)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(dj.mu) {
  std::string first = "another node";
  for (const auto& [n, j] : dj.joins) {
    for (const auto& r : j.ranks()) {
      if (r.rank() == rank) first = n;
    }
  }
  return absl::StrCat("rank ", rank, " joined from both ", first, " and ", node,
                      " (a rank belongs to one node)");
}

// This node has no part of `dj` (`why`): peers already fetching from it
// learn that now (their waits end on exec_status), not after peer_timeout.
void FailPart(const std::shared_ptr<DistJob>& dj, const absl::Status& why) {
  absl::MutexLock lock(&dj->mu);
  if (dj->exec_status.ok()) dj->exec_status = why;
}

}  // namespace

absl::StatusOr<peer::v1::PlanPart> DistJobs::PeerJoin(const PeerCaller& caller,
                                                    const peer::v1::JoinRequest& req,
                                                    const std::function<bool()>& cancelled) {
  const absl::Status who = peers_->SpeaksFor(caller, req.node());
  const std::shared_ptr<DistJob> dj = Find(req.job_id());
  if (!who.ok()) {
    if (dj != nullptr && dj->coordinator) {
      absl::MutexLock lock(&dj->mu);
      return dj->RefuseLocked(caller, req.node(), absl::StrCat("tried to join: ", who.message()));
    }
    return who;
  }
  if (dj == nullptr) {
    return absl::UnavailableError(absl::StrCat("job '", req.job_id(), "' is not known on ",
                                               config_.peer_listen, " yet"));
  }
  if (!dj->coordinator) {
    return absl::FailedPreconditionError(
        absl::StrCat(config_.peer_listen, " is not the coordinator of job '", req.job_id(), "'"));
  }
  absl::MutexLock lock(&dj->mu);
  // Proof first: a node without the ranks' key neither joins nor, by
  // disagreeing with the job, fails it.
  if (!MacMatches(req.job_mac(), JoinMac(dj->job_key, req.job_id(), req.node()))) {
    const std::string why = dj->job_key.empty() ? "its ranks sent a job_key, the coordinator's none"
                            : req.job_mac().empty()
                                ? "its ranks sent no job_key"
                                : "its ranks' job_key is not the coordinator's ranks' key";
    return dj->RefuseLocked(
        caller, req.node(),
        absl::StrCat("joined as '", req.node(), "', refused by the coordinator ",
                     config_.peer_listen, ": ", why,
                     " (every rank of a multi-node job sends the same job_key)"));
  }
  if (req.ranks_size() == 0) {
    return dj->ViolationLocked(caller, absl::StrCat("joined as '", req.node(),
                                                    "' with no ranks (a node joins only for "
                                                    "ranks it serves)"));
  }
  std::string mismatch;
  if (req.path() != dj->path) mismatch = absl::StrCat("checkpoint ", req.path(), " vs ", dj->path);
  if (req.has_unique_id() != dj->unique_id.has_value() ||
      (req.has_unique_id() && req.unique_id() != *dj->unique_id)) {
    mismatch = "unique_id";
  }
  if (req.world_size() != dj->world_size) {
    mismatch = absl::StrCat("world_size ", req.world_size(), " vs ", dj->world_size);
  }
  if (req.aoa_config() != dj->aoa) mismatch = "aoa_config (the AOA statements differ)";
  if (req.has_save() != dj->save) {
    mismatch = absl::StrCat("the kind of job (a ", req.has_save() ? "save" : "load", " vs a ",
                            dj->save ? "save" : "load", ")");
  } else if (dj->save && req.save().overwrite() != dj->overwrite) {
    mismatch = "overwrite (all ranks must set it or none)";
  }
  for (const auto& r : req.ranks()) {
    if (r.rank() < 0 || r.rank() >= dj->world_size) {
      mismatch = absl::StrCat("rank ", r.rank(), " is outside the world of ", dj->world_size);
    } else if (dj->ranks_joined.count(r.rank())) {
      mismatch = RankJoinedTwice(*dj, r.rank(), req.node());
    }
  }
  if (!mismatch.empty()) {
    absl::Status s = absl::InvalidArgumentError(absl::StrCat(
        "job '", req.job_id(), "': node ", req.node(),
        " disagrees with the coordinator ", config_.peer_listen, ": ", mismatch));
    if (!dj->planned) {
      dj->plan_status = s;
      dj->planned = true;
    }
    return s;
  }
  if (dj->joins.count(req.node())) {
    return absl::AlreadyExistsError(absl::StrCat("node ", req.node(), " already joined job '",
                                                 req.job_id(), "'"));
  }
  dj->joins[req.node()] = req;
  for (const auto& r : req.ranks()) dj->ranks_joined.insert(r.rank());
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(dj->mu) { return dj->planned; };
  if (!AwaitOrCancel(&dj->mu, absl::Condition(&ready), dj->deadline, cancelled)) {
    return WaitFailed(cancelled, absl::StrCat("job '", req.job_id(),
                                              "': the coordinator did not plan before the deadline"));
  }
  if (!dj->plan_status.ok()) return dj->plan_status;
  auto part = dj->parts.find(req.node());
  if (part == dj->parts.end()) {
    return absl::InternalError(absl::StrCat("job '", req.job_id(), "': the plan has no part for ",
                                            req.node()));
  }
  return part->second;
}

absl::Status DistJobs::GatherJoins(const std::shared_ptr<DistJob>& dj,
                                 const peer::v1::JoinRequest& own,
                                 std::vector<std::string>* nodes,
                                 std::vector<peer::v1::JoinRequest>* joins) {
  absl::MutexLock lock(&dj->mu);
  // A peer that joined first for one of this node's own ranks fails the job
  // (never merged): a rank belongs to one node.
  for (const auto& r : own.ranks()) {
    if (!dj->planned && dj->ranks_joined.count(r.rank())) {
      dj->plan_status = absl::InvalidArgumentError(
          absl::StrCat("job '", dj->id, "': ", RankJoinedTwice(*dj, r.rank(), own.node())));
      dj->planned = true;
    }
  }
  if (dj->planned) return dj->plan_status;
  dj->joins[own.node()] = own;
  for (const auto& r : own.ranks()) dj->ranks_joined.insert(r.rank());
  auto covered = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(dj->mu) {
    return dj->planned || static_cast<int>(dj->ranks_joined.size()) == dj->world_size;
  };
  dj->mu.AwaitWithDeadline(absl::Condition(&covered), dj->deadline);
  if (dj->planned) return dj->plan_status;  // a joiner disagreed
  if (static_cast<int>(dj->ranks_joined.size()) != dj->world_size) {
    std::vector<int> missing;
    for (int r = 0; r < dj->world_size; ++r) {
      if (!dj->ranks_joined.count(r)) missing.push_back(r);
    }
    std::vector<std::string> joined, refused;
    for (const auto& [n, j] : dj->joins) joined.push_back(n);
    for (const auto& [n, why] : dj->refused) refused.push_back(why);
    dj->plan_status = absl::DeadlineExceededError(absl::StrCat(
        "job '", dj->id, "': ranks ", absl::StrJoin(missing, ","),
        " never joined from other nodes within ", absl::FormatDuration(config_.peer_timeout),
        " (nodes joined: ", absl::StrJoin(joined, ", "),
        refused.empty() ? "" : absl::StrCat("; joins refused: ", absl::StrJoin(refused, "; ")),
        ")"));
    dj->planned = true;
    return dj->plan_status;
  }
  for (const auto& [n, j] : dj->joins) {
    nodes->push_back(n);
    joins->push_back(j);
  }
  return absl::OkStatus();
}

absl::StatusOr<peer::v1::PlanPart> DistJobs::PublishParts(
    const std::shared_ptr<DistJob>& dj, const std::vector<std::string>& nodes,
    const std::string& own_node,
    absl::StatusOr<std::map<std::string, peer::v1::PlanPart>> parts) {
  absl::MutexLock lock(&dj->mu);
  dj->nodes = nodes;
  if (!parts.ok()) {
    dj->plan_status = parts.status();
  } else {
    dj->parts = std::move(*parts);
    for (auto& [node, part] : dj->parts) {
      part.set_coordinator_mac(PlanMac(dj->job_key, dj->id, own_node, node));
    }
  }
  dj->planned = true;
  if (!dj->plan_status.ok()) return dj->plan_status;
  auto part = dj->parts.find(own_node);
  if (part == dj->parts.end()) {
    return absl::InternalError(absl::StrCat("job '", dj->id, "': the plan has no part for ",
                                            own_node));
  }
  return part->second;
}

absl::StatusOr<std::pair<peer::v1::PlanPart, std::string>> DistJobs::PlanPartOf(
    const std::shared_ptr<DistJob>& dj, const peer::v1::JoinRequest& own,
    const PartsPlanner& plan) {
  if (dj->coordinator) {
    Announce(dj, own.node());
    // Every rank is in: plan once for the whole job.
    std::vector<std::string> nodes;
    std::vector<peer::v1::JoinRequest> joins;
    const absl::Status gathered = GatherJoins(dj, own, &nodes, &joins);
    // plan_s: the planning itself, from the last join on.
    absl::StatusOr<peer::v1::PlanPart> part =
        gathered.ok()
            ? PublishParts(dj, nodes, own.node(),
                           plan(nodes, joins, std::chrono::steady_clock::now()))
            : absl::StatusOr<peer::v1::PlanPart>(gathered);
    if (!part.ok()) {
      FailPart(dj, part.status());
      Retire(dj, absl::Seconds(2));  // late joiners still get the error
      return part.status();
    }
    return std::make_pair(*std::move(part), own.node());
  }
  auto p = JoinCoordinator(own, dj->job_key, dj->deadline);
  absl::Status origin = p.ok() ? CheckPartOrigin(p->first, dj->id, own.node(), p->second)
                               : p.status();
  if (!origin.ok()) {
    FailPart(dj, origin);
    Retire(dj, absl::ZeroDuration());
    return origin;
  }
  return p;
}

void DistJobs::Announce(const std::shared_ptr<DistJob>& dj, const std::string& me) {
  const std::string mac = CoordinatorMac(dj->job_key, dj->id, me);
  int announced = 0;
  std::vector<std::string> failed;
  for (const std::string& r : RendezvousRing(dj->id, peers_->Members())) {
    if (announced == kRendezvousCopies) break;
    if (r == me) {
      absl::Status s = rendezvous_.Announce(dj->id, me, mac);
      if (s.ok()) {
        ++announced;
        dj->announced_at.push_back(r);
      } else {
        failed.push_back(absl::StrCat(r, ": ", s.message()));
      }
      continue;
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(ToChrono(absl::Now() + std::min(config_.peer_timeout, absl::Seconds(2))));
    peer::v1::LocateRequest req;
    req.set_job_id(dj->id);
    req.set_node(me);
    req.set_announce(true);
    req.set_mac(mac);
    peer::v1::LocateResponse resp;
    grpc::Status s = peers_->Stub(r)->Locate(&ctx, req, &resp);
    if (s.ok()) {
      ++announced;
      dj->announced_at.push_back(r);
    } else {
      failed.push_back(absl::StrCat(r, ": ", s.error_message()));
    }
  }
  if (!failed.empty()) {
    spdlog::warn("job={}: announced the coordinator at {} rendezvous node(s); could not at {}",
                 dj->id, announced, absl::StrJoin(failed, "; "));
  }
}

absl::StatusOr<std::string> DistJobs::LocateCoordinator(const std::string& job_id,
                                                        const std::string& me,
                                                        const std::string& job_key,
                                                        absl::Time deadline) {
  const std::vector<std::string> ring = RendezvousRing(job_id, peers_->Members());
  if (ring.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job_id, "' spans several daemons but this daemon has no peers configured"));
  }
  // Round after round until the deadline: the ring in order, past the nodes
  // that cannot be reached, waiting up to a second at each of the first two
  // that can (where the coordinator announced itself; a node that restarted
  // may have been passed over by one side): a handful of calls a second,
  // whatever the peer set's size.
  const absl::Duration window = ring.size() > 1 ? absl::Seconds(1) : absl::InfiniteDuration();
  std::map<std::string, std::string> last_error;
  while (absl::Now() < deadline) {
    int waited = 0;
    for (const std::string& r : ring) {
      if (waited == kRendezvousCopies || absl::Now() >= deadline) break;
      const absl::Time until = std::min(deadline, absl::Now() + window);
      std::vector<Rendezvous::Coordinator> found;
      if (r == me) {
        auto local = rendezvous_.Await(job_id, until, nullptr);
        if (!local.ok()) {
          last_error[r] = "nothing announced (this node)";
          ++waited;
          continue;
        }
        found = *std::move(local);
      } else {
        grpc::ClientContext ctx;
        ctx.set_deadline(ToChrono(until));
        peer::v1::LocateRequest req;
        req.set_job_id(job_id);
        req.set_node(me);
        peer::v1::LocateResponse resp;
        grpc::Status s = peers_->Stub(r)->Locate(&ctx, req, &resp);
        if (!s.ok()) {
          const bool timed_out = s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
          last_error[r] = timed_out ? "nothing announced" : s.error_message();
          if (timed_out) {
            ++waited;
          } else if (s.error_code() != grpc::StatusCode::UNAVAILABLE) {
            return FromGrpc(s, absl::StrCat("rendezvous node ", r));
          }
          continue;
        }
        for (const auto& c : resp.coordinators()) found.push_back({c.node(), c.mac()});
      }
      for (const Rendezvous::Coordinator& c : found) {
        // Only a coordinator whose ranks hold the job's key can make the MAC.
        if (MacMatches(c.mac, CoordinatorMac(job_key, job_id, c.node))) return c.node;
      }
      return absl::PermissionDeniedError(absl::StrCat(
          "job '", job_id, "': rendezvous node ", r, " names ", found.size(),
          " coordinator(s), none with proof of the ranks' job key (every rank of a multi-node "
          "job sends the same job_key)"));
    }
    // Nothing reachable waited: do not spin.
    if (waited == 0 && absl::Now() < deadline) {
      absl::SleepFor(std::min(absl::Milliseconds(200), deadline - absl::Now()));
    }
  }
  std::vector<std::string> tried;
  for (const auto& [r, e] : last_error) tried.push_back(absl::StrCat(r, ": ", e));
  return absl::DeadlineExceededError(absl::StrCat(
      "job '", job_id, "': its coordinator (the daemon serving coordinator_rank) was not "
      "announced within ", absl::FormatDuration(config_.peer_timeout),
      " at the job's rendezvous nodes (", absl::StrJoin(tried, "; "),
      "): are that rank and its daemon running the job, with the same peer set?"));
}

absl::StatusOr<std::pair<peer::v1::PlanPart, std::string>> DistJobs::JoinCoordinator(
    const peer::v1::JoinRequest& own, const std::string& job_key, absl::Time deadline) {
  absl::StatusOr<std::string> coordinator =
      LocateCoordinator(own.job_id(), own.node(), job_key, deadline);
  if (!coordinator.ok()) return coordinator.status();
  grpc::ClientContext ctx;
  ctx.set_deadline(ToChrono(deadline));
  peer::v1::PlanPart part;
  grpc::Status s = peers_->Stub(*coordinator)->Join(&ctx, own, &part);
  if (!s.ok()) return FromGrpc(s, absl::StrCat("coordinator ", *coordinator));
  if (!MacMatches(part.coordinator_mac(),
                  PlanMac(job_key, own.job_id(), *coordinator, own.node()))) {
    return absl::PermissionDeniedError(absl::StrCat(
        "job '", own.job_id(), "': ", *coordinator,
        " answered as its coordinator without proof of the job key"));
  }
  return std::make_pair(std::move(part), *coordinator);
}

absl::StatusOr<peer::v1::LocateResponse> DistJobs::PeerLocate(
    const PeerCaller& caller, const peer::v1::LocateRequest& req,
    const std::function<bool()>& cancelled) {
  CKPT_RETURN_IF_ERROR(peers_->SpeaksFor(caller, req.node()));
  peer::v1::LocateResponse out;
  if (req.announce()) {
    CKPT_RETURN_IF_ERROR(rendezvous_.Announce(req.job_id(), req.node(), req.mac()));
    return out;
  }
  CKPT_ASSIGN_OR_RETURN(auto found,
                        rendezvous_.Await(req.job_id(), absl::Now() + config_.peer_timeout,
                                          cancelled));
  for (const auto& c : found) {
    peer::v1::AnnouncedCoordinator* m = out.add_coordinators();
    m->set_node(c.node);
    m->set_mac(c.mac);
  }
  return out;
}

absl::StatusOr<peer::v1::CompleteResponse> DistJobs::PeerComplete(
    const PeerCaller& caller, const peer::v1::CompleteRequest& req,
    const std::function<bool()>& cancelled) {
  const absl::Status who_if_member = peers_->SpeaksFor(caller, req.node(), /*job_member=*/true);
  const absl::Status who_otherwise = peers_->SpeaksFor(caller, req.node());
  const std::shared_ptr<DistJob> dj = Find(req.job_id());
  if (dj == nullptr || !dj->coordinator) {
    return absl::NotFoundError(absl::StrCat("job '", req.job_id(), "' is not coordinated by ",
                                            config_.peer_listen));
  }
  absl::MutexLock lock(&dj->mu);
  const bool member =
      std::find(dj->nodes.begin(), dj->nodes.end(), req.node()) != dj->nodes.end();
  const absl::Status& who = member ? who_if_member : who_otherwise;
  if (!who.ok()) {
    return dj->RefuseLocked(caller, req.node(),
                            absl::StrCat("reported completion: ", who.message()));
  }
  if (!dj->planned ||
      std::find(dj->nodes.begin(), dj->nodes.end(), req.node()) == dj->nodes.end()) {
    return dj->RefuseLocked(caller, req.node(),
                            absl::StrCat("reported completion as '", req.node(),
                                         "', which is not a node of the job"));
  }
  if (!dj->reported.insert(req.node()).second) {
    return absl::FailedPreconditionError(absl::StrCat(
        "node ", req.node(), " already reported completion of job '", req.job_id(), "'"));
  }
  // A node the coordinator already found down keeps that entry.
  dj->completes.emplace(req.node(), req);
  auto finished = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(dj->mu) { return dj->finished; };
  const absl::Time until =
      dj->save ? std::max(dj->outcome_deadline, absl::Now() + config_.peer_timeout)
               : absl::Now() + config_.peer_timeout;
  if (!AwaitOrCancel(&dj->mu, absl::Condition(&finished), until, cancelled)) {
    return WaitFailed(cancelled, absl::StrCat("job '", req.job_id(),
                                              "': the coordinator did not conclude in time"));
  }
  return dj->outcome;
}

absl::StatusOr<peer::v1::CompleteResponse> DistJobs::AwaitOutcome(
    const std::shared_ptr<DistJob>& dj, const peer::v1::CompleteRequest& own) {
  absl::Time deadline = absl::Now() + config_.peer_timeout;
  {
    absl::MutexLock lock(&dj->mu);
    dj->completes[own.node()] = own;
    dj->reported.insert(own.node());
  }
  while (true) {
    std::vector<std::string> missing;
    {
      absl::MutexLock lock(&dj->mu);
      // Concluded once every node reported, or one failed for a reason of
      // its own (not only because another node failed first: then the
      // cause is on its way and every rank should get it, not an echo).
      auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(dj->mu) {
        if (dj->completes.size() == dj->nodes.size()) return true;
        for (const auto& [n, c] : dj->completes) {
          if (!c.ok() && !EchoOfAnotherFailure(c.error_code())) return true;
        }
        return false;
      };
      dj->mu.AwaitWithTimeout(absl::Condition(&done), absl::Milliseconds(300));
      peer::v1::CompleteResponse out;
      out.set_ok(true);
      uint64_t read = 0, written = 0;
      for (const auto& [n, c] : dj->completes) {
        read += c.bytes_read();
        written += c.bytes_written();
        if (!c.ok() && (out.ok() || (EchoOfAnotherFailure(out.error_code()) &&
                                     !EchoOfAnotherFailure(c.error_code())))) {
          out.set_ok(false);
          out.set_error(absl::StrCat("node ", n, ": ", c.error()));
          out.set_error_code(c.error_code());
        }
      }
      out.set_job_bytes_read(read);
      out.set_job_bytes_written(written);
      for (const auto& n : dj->nodes) {
        if (!dj->completes.count(n)) missing.push_back(n);
      }
      if (out.ok() && missing.empty() && dj->save) {
        // Every node prepared: the commit needs every node's shards.
        for (const auto& [n, c] : dj->completes) {
          for (const auto& sh : c.shards()) *out.add_shards() = sh;
        }
      }
      if (!out.ok() || missing.empty() || absl::Now() >= deadline) {
        if (out.ok() && !missing.empty()) {
          out.set_ok(false);
          out.set_error(absl::StrCat("node(s) ", absl::StrJoin(missing, ", "),
                                     " never reported completion within ",
                                     absl::FormatDuration(config_.peer_timeout)));
          out.set_error_code(static_cast<int>(absl::StatusCode::kDeadlineExceeded));
        }
        dj->outcome = out;
        dj->finished = true;
        return out;
      }
    }
    // Nodes that are gone will never report: find out now, not at the
    // deadline (all at once: a job of many nodes does not wait on each).
    const std::vector<PeerPlane::Pinged> pinged = peers_->PingAll(missing, absl::Milliseconds(500));
    for (size_t i = 0; i < missing.size(); ++i) {
      const std::string& n = missing[i];
      const grpc::Status& s = pinged[i].status;
      const auto& jobs = pinged[i].response.jobs();
      if (s.ok() && dj->save && std::find(jobs.begin(), jobs.end(), dj->id) != jobs.end()) {
        // Alive and still writing its part of the save: wait on, within
        // the job's bound.
        deadline = std::max(deadline, std::min(absl::Now() + config_.peer_timeout,
                                               dj->outcome_deadline));
      }
      if (!s.ok()) {
        absl::MutexLock lock(&dj->mu);
        peer::v1::CompleteRequest down;
        down.set_node(n);
        down.set_ok(false);
        down.set_error(absl::StrCat("peer is down or unreachable: ", s.error_message()));
        down.set_error_code(static_cast<int>(absl::StatusCode::kUnavailable));
        dj->completes.emplace(n, down);
      }
    }
  }
}

}  // namespace ckptd
