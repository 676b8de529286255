// Multi-node jobs: the coordinator, the node-aware load balancer's use, and
// daemon-to-daemon transfer over the peer service.
//
// Flow for a job whose ranks span several daemons:
//  1. Each daemon waits for its own ranks (the local barrier in Load).
//  2. The daemon serving `coordinator_rank` gathers every node's ranks and
//     readable data files through Join, plans once, assigns every read to
//     one node (core/balancer.h) and answers each Join with that node's part.
//  3. Every node executes its part: reads assigned to it come from storage
//     (through its data cache) and are served to the nodes that need them
//     (FetchRead, chunked gRPC stream: flow-controlled, one read in memory
//     per transfer); reads other nodes do are fetched from them.
//  4. Every node reports to the coordinator (Complete); the coordinator
//     answers all of them with one outcome, so all nodes succeed or fail
//     together. Every wait is bounded by peer_timeout and names who it
//     waited for.
#include <dirent.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/aoa.h"
#include "core/balancer.h"
#include "core/executor.h"
#include "core/status_macros.h"
#include "core/xxh3.h"
#include "server/daemon.h"
#include "server/daemon_dist.h"
#include "server/daemon_internal.h"
#include "server/metrics.h"
#include "server/peer_nccl.h"
#include "server/plan_codec.h"

namespace ckptd {

using ckpt::TargetTensor;

namespace {

// Data-file-like names in `dir` (what this node can read).
std::vector<peer::v1::FileInfo> ListReadable(const std::string& dir) {
  std::vector<peer::v1::FileInfo> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  while (struct dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n == "." || n == ".." || absl::EndsWith(n, ".metadata")) continue;
    auto st = ckpt::StatFile(ckpt::JoinPath(dir, n));
    if (!st.ok()) continue;
    peer::v1::FileInfo fi;
    fi.set_name(n);
    fi.set_size(st->size);
    out.push_back(std::move(fi));
  }
  ::closedir(d);
  return out;
}

}  // namespace

peer::v1::JoinRequest BaseJoin(const Daemon::Job& job,
                               const std::vector<std::shared_ptr<Daemon::RankSlot>>& slots,
                               const std::string& node, const std::string& path, int coordinator_rank) {
  peer::v1::JoinRequest own;
  own.set_job_id(job.id);
  own.set_node(node);
  own.set_path(path);
  if (job.unique_id) own.set_unique_id(*job.unique_id);
  own.set_world_size(job.world_size);
  own.set_coordinator_rank(coordinator_rank);
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

std::shared_ptr<Daemon::DistJob> Daemon::NewDistJob(const Job& job, const std::string& path,
                                                    bool coordinator, const DistJobKind& kind) {
  auto dj = std::make_shared<DistJob>();
  dj->id = job.id;
  dj->coordinator = coordinator;
  dj->save = kind.save;
  dj->overwrite = kind.overwrite;
  dj->deadline = absl::Now() + config_.peer_timeout;
  dj->outcome_deadline = absl::Now() + std::max(config_.load_timeout, config_.peer_timeout);
  dj->path = path;
  dj->local_dir = job.path;
  dj->unique_id = job.unique_id;
  dj->world_size = job.world_size;
  dj->aoa = kind.aoa;
  absl::MutexLock lock(&peer_mu_);
  PurgeDistJobsLocked();
  dist_jobs_[job.id] = dj;
  return dj;
}

void Daemon::PurgeDistJobsLocked() {
  const absl::Time now = absl::Now();
  for (auto it = dist_jobs_.begin(); it != dist_jobs_.end();) {
    it = it->second->expires < now ? dist_jobs_.erase(it) : std::next(it);
  }
}

void Daemon::RetireDistJob(const std::shared_ptr<DistJob>& dj, absl::Duration linger) {
  absl::MutexLock lock(&peer_mu_);
  dj->expires = absl::Now() + linger;
  PurgeDistJobsLocked();
}

absl::Status Daemon::ViolationLocked(DistJob& dj, const PeerCaller& caller,
                                     absl::string_view what) {
  absl::Status s = absl::PermissionDeniedError(
      absl::StrCat("job '", dj.id, "': ", caller.Describe(), " ", what));
  spdlog::warn("peer plane: {}", std::string(s.message()));
  if (dj.violation.ok()) dj.violation = s;
  if (dj.coordinator) {
    if (!dj.planned) {
      dj.plan_status = s;
      dj.planned = true;
    } else if (!dj.finished) {
      peer::v1::CompleteRequest c;
      c.set_ok(false);
      c.set_error(std::string(s.message()));
      c.set_error_code(static_cast<int>(s.code()));
      dj.completes.emplace("(authorization)", std::move(c));
    }
  }
  return s;
}

peer::v1::PingResponse Daemon::PeerPing(const PeerCaller& caller, const peer::v1::PingRequest& req) {
  peer::v1::PingResponse r;
  r.set_node(config_.peer_listen);
  // Job ids only to a node of the job, speaking for an address it may.
  if (req.node().empty() || !SpeaksFor(caller, req.node()).ok()) return r;
  absl::MutexLock lock(&peer_mu_);
  PurgeDistJobsLocked();
  for (const auto& [id, dj] : dist_jobs_) {
    const bool member = std::find(dj->nodes.begin(), dj->nodes.end(), req.node()) != dj->nodes.end() ||
                        dj->joins.count(req.node()) > 0;
    if (member) r.add_jobs(id);
  }
  return r;
}

absl::StatusOr<peer::v1::PlanPart> Daemon::PeerJoin(const PeerCaller& caller,
                                                    const peer::v1::JoinRequest& req,
                                                    const std::function<bool()>& cancelled) {
  const absl::Status who = SpeaksFor(caller, req.node());
  absl::MutexLock lock(&peer_mu_);
  auto it = dist_jobs_.find(req.job_id());
  if (!who.ok()) {
    if (it != dist_jobs_.end() && it->second->coordinator) {
      return ViolationLocked(*it->second, caller, absl::StrCat("tried to join: ", who.message()));
    }
    return who;
  }
  if (it == dist_jobs_.end()) {
    return absl::UnavailableError(absl::StrCat("job '", req.job_id(), "' is not known on ",
                                               config_.peer_listen, " yet"));
  }
  std::shared_ptr<DistJob> dj = it->second;
  if (!dj->coordinator) {
    return absl::FailedPreconditionError(
        absl::StrCat(config_.peer_listen, " is not the coordinator of job '", req.job_id(), "'"));
  }
  if (req.ranks_size() == 0) {
    return ViolationLocked(*dj, caller,
                           absl::StrCat("joined as '", req.node(),
                                        "' with no ranks (a node joins only for ranks it serves)"));
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
    if (r.rank() < 0 || r.rank() >= dj->world_size || dj->ranks_joined.count(r.rank())) {
      mismatch = absl::StrCat("rank ", r.rank(), " is outside the world or already joined");
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
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(peer_mu_) { return dj->planned; };
  if (!AwaitOrCancel(&peer_mu_, absl::Condition(&ready), dj->deadline, cancelled)) {
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

absl::Status Daemon::GatherJoins(const std::shared_ptr<DistJob>& dj,
                                 const peer::v1::JoinRequest& own,
                                 std::vector<std::string>* nodes,
                                 std::vector<peer::v1::JoinRequest>* joins) {
  absl::MutexLock lock(&peer_mu_);
  dj->joins[own.node()] = own;
  for (const auto& r : own.ranks()) dj->ranks_joined.insert(r.rank());
  auto covered = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(peer_mu_) {
    return dj->planned || static_cast<int>(dj->ranks_joined.size()) == dj->world_size;
  };
  peer_mu_.AwaitWithDeadline(absl::Condition(&covered), dj->deadline);
  if (dj->planned) return dj->plan_status;  // a joiner disagreed
  if (static_cast<int>(dj->ranks_joined.size()) != dj->world_size) {
    std::vector<int> missing;
    for (int r = 0; r < dj->world_size; ++r) {
      if (!dj->ranks_joined.count(r)) missing.push_back(r);
    }
    std::vector<std::string> joined;
    for (const auto& [n, j] : dj->joins) joined.push_back(n);
    dj->plan_status = absl::DeadlineExceededError(absl::StrCat(
        "job '", dj->id, "': ranks ", absl::StrJoin(missing, ","),
        " never joined from other nodes within ", absl::FormatDuration(config_.peer_timeout),
        " (nodes joined: ", absl::StrJoin(joined, ", "), ")"));
    dj->planned = true;
    return dj->plan_status;
  }
  for (const auto& [n, j] : dj->joins) {
    nodes->push_back(n);
    joins->push_back(j);
  }
  return absl::OkStatus();
}

absl::StatusOr<peer::v1::PlanPart> Daemon::PublishParts(
    const std::shared_ptr<DistJob>& dj, const std::vector<std::string>& nodes,
    const std::string& own_node,
    absl::StatusOr<std::map<std::string, peer::v1::PlanPart>> parts) {
  absl::MutexLock lock(&peer_mu_);
  dj->nodes = nodes;
  if (!parts.ok()) {
    dj->plan_status = parts.status();
  } else {
    dj->parts = std::move(*parts);
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

absl::StatusOr<peer::v1::PlanPart> Daemon::CoordinatePlan(const std::shared_ptr<DistJob>& dj,
                                                          const peer::v1::JoinRequest& own) {
  const auto t0 = std::chrono::steady_clock::now();
  // Every rank is in: plan once for the whole job.
  std::vector<std::string> nodes;
  std::vector<peer::v1::JoinRequest> joins;
  CKPT_RETURN_IF_ERROR(GatherJoins(dj, own, &nodes, &joins));
  auto plan_all = [&]() -> absl::StatusOr<std::map<std::string, peer::v1::PlanPart>> {
    CKPT_ASSIGN_OR_RETURN(auto opened,
                          OpenCached(dj->local_dir, dj->unique_id, /*all_files_local=*/false));
    std::vector<std::pair<int, int>> rank_node;  // rank -> node index
    std::map<int, const peer::v1::RankTargetsMsg*> by_rank;
    for (size_t n = 0; n < joins.size(); ++n) {
      for (const auto& r : joins[n].ranks()) {
        by_rank[r.rank()] = &r;
        rank_node.push_back({r.rank(), static_cast<int>(n)});
      }
    }
    std::sort(rank_node.begin(), rank_node.end());
    std::vector<ckpt::RankTargets> ranks;
    std::vector<int> node_of_rank;
    for (const auto& [rank, node] : rank_node) {
      ckpt::RankTargets rt;
      rt.rank = rank;
      for (const auto& t : by_rank[rank]->targets()) {
        CKPT_ASSIGN_OR_RETURN(TargetTensor tt, FromMsg(t));
        rt.tensors.push_back(std::move(tt));
      }
      ranks.push_back(std::move(rt));
      node_of_rank.push_back(node);
    }
    ckpt::PlanOptions po;
    po.max_read_bytes = config_.io_request_size;
    CKPT_ASSIGN_OR_RETURN(ckpt::LoadPlan plan,
                          ckpt::PlanLoadWithAoa(opened->checkpoint.metadata, dj->aoa, ranks, po,
                                                "aoa_config"));
    std::vector<std::set<std::string>> readable(joins.size());
    for (size_t n = 0; n < joins.size(); ++n) {
      for (const auto& f : joins[n].readable()) readable[n].insert(f.name());
    }
    CKPT_ASSIGN_OR_RETURN(ckpt::ReadAssignment assign, ckpt::AssignReads(plan, node_of_rank, readable));
    const double plan_s = Seconds(t0);
    std::map<std::string, peer::v1::PlanPart> parts;
    for (size_t n = 0; n < nodes.size(); ++n) {
      peer::v1::PlanPart& part = parts[nodes[n]];
      part.set_job_id(dj->id);
      for (const auto& f : plan.files) part.add_files(f);
      for (size_t i = 0; i < plan.reads.size(); ++i) {
        peer::v1::ReadMsg* rm = part.add_reads();
        ToMsg(plan.reads[i], rm);
        if (assign.reader[i] >= 0) rm->set_reader(nodes[assign.reader[i]]);
        for (int m : assign.needed_by[i]) rm->add_needed_by(nodes[m]);
      }
      for (size_t r = 0; r < plan.ranks.size(); ++r) {
        if (node_of_rank[r] == static_cast<int>(n)) ToMsg(plan.ranks[r], part.add_ranks());
      }
      for (const auto& k : plan.unexpected_keys) part.add_unexpected_keys(k);
      for (const auto& [a, b] : plan.renamed_keys) (*part.mutable_renamed_keys())[a] = b;
      for (const auto& nn : nodes) part.add_nodes(nn);
      part.set_job_bytes_to_read(plan.bytes_to_read);
      part.set_format(ckpt::FormatName(opened->checkpoint.format));
      part.set_unique_id(opened->checkpoint.unique_id.value_or(0));
      part.set_plan_s(plan_s);
    }
    std::string balance;
    for (size_t n = 0; n < nodes.size(); ++n) {
      balance += absl::StrCat(n ? " " : "", nodes[n], "=", assign.bytes_per_node[n], "B");
    }
    spdlog::info("coordinator job={} nodes={} ranks={} reads={} plan={:.4f}s storage reads: {}",
                 dj->id, nodes.size(), ranks.size(), plan.reads.size(), plan_s, balance);
    // NCCL between the nodes when every one of them can (peer_nccl.h).
    bool nccl = nodes.size() > 1;
    for (const auto& j : joins) nccl = nccl && j.nccl();
    for (const auto& j : joins) {
      for (const auto& u : j.nccl_unreachable()) {
        if (nccl && std::find(nodes.begin(), nodes.end(), u) != nodes.end()) {
          spdlog::info("coordinator job={}: {} recently failed to connect NCCL links with {}; "
                       "peers use gRPC", dj->id, j.node(), u);
          nccl = false;
        }
      }
    }
    if (nccl) {
      auto id = gpu_->NewNcclId();
      if (id.ok()) {
        for (auto& [n, p] : parts) p.set_nccl_id(*id);
      } else {
        spdlog::warn("coordinator job={}: no NCCL id ({}); peers use gRPC", dj->id,
                     id.status().ToString());
      }
    }
    return parts;
  };
  return PublishParts(dj, nodes, own.node(), plan_all());
}

absl::StatusOr<std::pair<peer::v1::PlanPart, std::string>> Daemon::JoinCoordinator(
    const peer::v1::JoinRequest& own, absl::Time deadline) {
  std::map<std::string, std::string> last_error;
  while (absl::Now() < deadline) {
    for (const std::string& peer : PeerAddresses()) {
      grpc::ClientContext ctx;
      ctx.set_deadline(ToChrono(deadline));
      peer::v1::PlanPart part;
      grpc::Status s = PeerStub(peer)->Join(&ctx, own, &part);
      if (s.ok()) return std::make_pair(std::move(part), peer);
      const auto code = s.error_code();
      if (code == grpc::StatusCode::FAILED_PRECONDITION) {
        last_error[peer] = "not the coordinator";
        continue;
      }
      if (code == grpc::StatusCode::UNAVAILABLE) {
        last_error[peer] = s.error_message();
        continue;
      }
      return FromGrpc(s, absl::StrCat("coordinator ", peer));  // the coordinator said no
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::vector<std::string> tried;
  for (const auto& [p, e] : last_error) tried.push_back(absl::StrCat(p, " (", e, ")"));
  return absl::DeadlineExceededError(absl::StrCat(
      "job '", own.job_id(), "': no peer accepted this node's ranks as the coordinator within ",
      absl::FormatDuration(config_.peer_timeout), "; peers: ",
      tried.empty() ? std::string("none configured") : absl::StrJoin(tried, "; ")));
}

absl::StatusOr<peer::v1::CompleteResponse> Daemon::PeerComplete(
    const PeerCaller& caller, const peer::v1::CompleteRequest& req,
    const std::function<bool()>& cancelled) {
  const absl::Status who_if_member = SpeaksFor(caller, req.node(), /*job_member=*/true);
  const absl::Status who_otherwise = SpeaksFor(caller, req.node());
  absl::MutexLock lock(&peer_mu_);
  auto it = dist_jobs_.find(req.job_id());
  if (it == dist_jobs_.end() || !it->second->coordinator) {
    return absl::NotFoundError(absl::StrCat("job '", req.job_id(), "' is not coordinated by ",
                                            config_.peer_listen));
  }
  std::shared_ptr<DistJob> dj = it->second;
  const bool member =
      std::find(dj->nodes.begin(), dj->nodes.end(), req.node()) != dj->nodes.end();
  const absl::Status& who = member ? who_if_member : who_otherwise;
  if (!who.ok()) {
    return ViolationLocked(*dj, caller, absl::StrCat("reported completion: ", who.message()));
  }
  if (!dj->planned ||
      std::find(dj->nodes.begin(), dj->nodes.end(), req.node()) == dj->nodes.end()) {
    return ViolationLocked(*dj, caller,
                           absl::StrCat("reported completion as '", req.node(),
                                        "', which is not a node of the job"));
  }
  if (!dj->reported.insert(req.node()).second) {
    return absl::FailedPreconditionError(absl::StrCat(
        "node ", req.node(), " already reported completion of job '", req.job_id(), "'"));
  }
  // A node the coordinator already found down keeps that entry.
  dj->completes.emplace(req.node(), req);
  auto finished = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(peer_mu_) { return dj->finished; };
  const absl::Time until =
      dj->save ? std::max(dj->outcome_deadline, absl::Now() + config_.peer_timeout)
               : absl::Now() + config_.peer_timeout;
  if (!AwaitOrCancel(&peer_mu_, absl::Condition(&finished), until, cancelled)) {
    return WaitFailed(cancelled, absl::StrCat("job '", req.job_id(),
                                              "': the coordinator did not conclude in time"));
  }
  return dj->outcome;
}

absl::StatusOr<peer::v1::CompleteResponse> Daemon::AwaitOutcome(
    const std::shared_ptr<DistJob>& dj, const peer::v1::CompleteRequest& own) {
  absl::Time deadline = absl::Now() + config_.peer_timeout;
  {
    absl::MutexLock lock(&peer_mu_);
    dj->completes[own.node()] = own;
    dj->reported.insert(own.node());
  }
  while (true) {
    std::vector<std::string> missing;
    {
      absl::MutexLock lock(&peer_mu_);
      // Concluded once every node reported, or one failed for a reason of
      // its own (not only because another node failed first: then the
      // cause is on its way and every rank should get it, not an echo).
      auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(peer_mu_) {
        if (dj->completes.size() == dj->nodes.size()) return true;
        for (const auto& [n, c] : dj->completes) {
          if (!c.ok() && !EchoOfAnotherFailure(c.error_code())) return true;
        }
        return false;
      };
      peer_mu_.AwaitWithTimeout(absl::Condition(&done), absl::Milliseconds(300));
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
    // Nodes that are gone will never report: find out now, not at the deadline.
    for (const std::string& n : missing) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
      peer::v1::PingRequest pr;
      pr.set_node(config_.peer_listen);
      peer::v1::PingResponse resp;
      grpc::Status s = PeerStub(n)->Ping(&ctx, pr, &resp);
      if (s.ok() && dj->save &&
          std::find(resp.jobs().begin(), resp.jobs().end(), dj->id) != resp.jobs().end()) {
        // Alive and still writing its part of the save: wait on, within
        // the job's bound.
        deadline = std::max(deadline, std::min(absl::Now() + config_.peer_timeout,
                                               dj->outcome_deadline));
      }
      if (!s.ok()) {
        absl::MutexLock lock(&peer_mu_);
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

absl::StatusOr<peer::v1::CompleteResponse> Daemon::ReportCompletion(
    const std::shared_ptr<DistJob>& dj, const std::string& coordinator,
    const peer::v1::CompleteRequest& done) {
  if (dj->coordinator) return AwaitOutcome(dj, done);
  // The coordinator answers once every node reported: a save's nodes may
  // write long (AwaitOutcome waits while they are alive), a load's not.
  const absl::Time until = dj->save ? std::max(dj->outcome_deadline, absl::Now() + config_.peer_timeout)
                                    : absl::Now() + config_.peer_timeout;
  grpc::ClientContext ctx;
  ctx.set_deadline(ToChrono(until + absl::Seconds(5)));
  peer::v1::CompleteResponse resp;
  grpc::Status s = PeerStub(coordinator)->Complete(&ctx, done, &resp);
  if (s.ok()) return resp;
  return absl::UnavailableError(absl::StrCat("coordinator ", coordinator,
                                             " did not confirm the job: ", s.error_message()));
}

absl::Status Daemon::PeerFetchRead(const PeerCaller& caller,
                                   const peer::v1::FetchReadRequest& req,
                                   const std::function<bool(const peer::v1::Chunk&)>& send,
                                   const std::function<bool()>& cancelled) {
  const absl::Status who_if_member = SpeaksFor(caller, req.node(), /*job_member=*/true);
  const absl::Status who_otherwise = SpeaksFor(caller, req.node());
  const std::string& me = config_.peer_listen;
  const uint32_t g = req.read();
  std::shared_ptr<DistJob> dj;
  ckpt::RangeView view;
  uint64_t length = 0, xxh3 = 0;
  const absl::Time deadline = absl::Now() + config_.peer_timeout;
  {
    absl::MutexLock lock(&peer_mu_);
    auto it = dist_jobs_.find(req.job_id());
    if (it == dist_jobs_.end()) {
      return absl::NotFoundError(absl::StrCat(
          me, ": job '", req.job_id(),
          "' is not running here (finished, failed, or never started on this node): a late or "
          "unplanned fetch of read ", g));
    }
    dj = it->second;
    // A node of the job (checked again below, once the part is known) keeps
    // its standing if it left the peer_dns answer since it joined.
    const bool member =
        std::find(dj->nodes.begin(), dj->nodes.end(), req.node()) != dj->nodes.end();
    const absl::Status& who = member ? who_if_member : who_otherwise;
    if (!who.ok()) {
      return ViolationLocked(*dj, caller, absl::StrCat("fetched read ", g, ": ", who.message()));
    }
    auto over = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(peer_mu_) {
      return !dj->exec_status.ok() || !dj->violation.ok();
    };
    auto part_known = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(peer_mu_) {
      return dj->part_known || over();
    };
    // Why nothing is served any more: this node's part failed, or a violation.
    auto ended = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(peer_mu_) -> absl::Status {
      if (!dj->exec_status.ok()) {
        return absl::AbortedError(absl::StrCat(me, " failed its part of job '", req.job_id(),
                                               "': ", dj->exec_status.message()));
      }
      if (!dj->violation.ok()) return absl::AbortedError(std::string(dj->violation.message()));
      return absl::OkStatus();
    };
    if (!AwaitOrCancel(&peer_mu_, absl::Condition(&part_known), deadline, cancelled)) {
      return WaitFailed(cancelled, absl::StrCat(me, ": job '", req.job_id(),
                                                "' had no plan part within ",
                                                absl::FormatDuration(config_.peer_timeout)));
    }
    CKPT_RETURN_IF_ERROR(ended());
    if (std::find(dj->nodes.begin(), dj->nodes.end(), req.node()) == dj->nodes.end()) {
      return ViolationLocked(*dj, caller, absl::StrCat("fetched read ", g, " as '", req.node(),
                                                       "', which is not a node of the job"));
    }
    auto sv = dj->served.find(g);
    if (sv == dj->served.end() || !sv->second.needers.count(req.node())) {
      return ViolationLocked(*dj, caller,
                             absl::StrCat("fetched read ", g, " as '", req.node(),
                                          "', whose part does not need it from ", me));
    }
    DistJob::Served& served = sv->second;
    if (!served.fetched.insert(req.node()).second) {
      return ViolationLocked(*dj, caller,
                             absl::StrCat("fetched read ", g, " as '", req.node(),
                                          "' a second time (a node fetches a read once)"));
    }
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(peer_mu_) { return served.ready || over(); };
    if (!AwaitOrCancel(&peer_mu_, absl::Condition(&ready), deadline, cancelled)) {
      return WaitFailed(cancelled, absl::StrCat(me, ": read ", g, " of job '", req.job_id(),
                                                "' was not available within ",
                                                absl::FormatDuration(config_.peer_timeout)));
    }
    CKPT_RETURN_IF_ERROR(ended());
    if (served.view.data == nullptr && served.length > 0) {
      return absl::FailedPreconditionError(absl::StrCat(me, ": read ", g, " of job '",
                                                        req.job_id(), "' is no longer held"));
    }
    view = served.view;  // pinned while we send
    length = served.length;
    xxh3 = served.xxh3;
  }
  constexpr uint64_t kChunk = 1 << 20;
  for (uint64_t off = 0; off == 0 || off < length; off += kChunk) {
    peer::v1::Chunk c;
    c.set_offset(off);
    if (length > 0) c.set_data(view.data + off, std::min(kChunk, length - off));
    if (off == 0) {
      c.set_xxh3(xxh3);
      if (config_.testing_corrupt_served && length > 0) {
        (*c.mutable_data())[0] ^= 0x01;  // fault injection for tests only
      }
    }
    if (!send(c)) return absl::CancelledError("the fetching node went away");
  }
  absl::MutexLock lock(&peer_mu_);
  auto sv = dj->served.find(g);  // found above; entries are never erased
  if (sv != dj->served.end() && --sv->second.remaining <= 0) {
    sv->second.view = ckpt::RangeView{};  // unpin
  }
  return absl::OkStatus();
}

// Reads of one node's part: storage for reads assigned here (published for
// the nodes that need them, with their xxh3), peers for the rest. Bytes from
// a peer reach the executor only after their xxh3 matched the one the
// serving node took as it read them, and after the plan's own checksums
// (where the format stores them) verified them.
class DistSource final : public ckpt::RangeSource {
 public:
  using PublishFn = std::function<void(uint32_t, const ckpt::RangeView&, uint64_t xxh3)>;
  using StubFn = std::function<std::shared_ptr<peer::v1::Peer::Stub>(const std::string&)>;
  DistSource(std::string me, std::string job_id, ckpt::RangeSource* storage,
             std::map<std::pair<std::string, uint64_t>, uint32_t> global_index,
             std::vector<std::string> reader, PublishFn publish, StubFn stub,
             std::function<absl::Status()> aborted, absl::Duration timeout)
      : me_(std::move(me)), job_id_(std::move(job_id)), storage_(storage),
        global_index_(std::move(global_index)), reader_(std::move(reader)),
        publish_(std::move(publish)), stub_(std::move(stub)), aborted_(std::move(aborted)),
        timeout_(timeout) {}

  absl::StatusOr<ckpt::RangeView> Fetch(
      const std::string& file, uint64_t offset, uint64_t n, std::vector<uint8_t>& scratch,
      const std::function<absl::Status(const uint8_t*)>& verify) override {
    CKPT_RETURN_IF_ERROR(aborted_());  // an authorization violation ends the job here
    auto it = global_index_.find({file, offset});
    if (it == global_index_.end()) {
      return absl::InternalError(absl::StrCat("no planned read of ", file, " at ", offset));
    }
    const uint32_t g = it->second;
    const std::string& reader = reader_[g];
    if (reader == me_) {
      CKPT_ASSIGN_OR_RETURN(ckpt::RangeView v, storage_->Fetch(file, offset, n, scratch, verify));
      if (v.pin == nullptr) {
        // Not cached (budget): keep a private copy for the peers.
        auto copy = std::make_shared<std::vector<uint8_t>>(v.data, v.data + n);
        v = ckpt::RangeView{copy->data(), copy, true};
      }
      publish_(g, v, XXH3_64bits(v.data, n));
      return v;
    }
    const std::string what =
        absl::StrCat("read ", g, " (", file, " bytes [", offset, ", ", offset + n, ")) from peer ", reader);
    if (links_ != nullptr && links_->Receives(g)) {
      if (auto b = links_->Take(g, absl::Now() + timeout_)) {
        CKPT_RETURN_IF_ERROR(Check(b->view.data, n, b->xxh3, what + " over NCCL", verify));
        received_ += n;
        return b->view;
      }  // links failed: gRPC below
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout_)));
    peer::v1::FetchReadRequest req;
    req.set_job_id(job_id_);
    req.set_read(g);
    req.set_node(me_);
    auto stub = stub_(reader);
    auto stream = stub->FetchRead(&ctx, req);
    if (scratch.size() < n) scratch.resize(n);
    uint64_t got = 0;
    std::optional<uint64_t> xxh3;
    peer::v1::Chunk c;
    while (stream->Read(&c)) {
      if (c.offset() != got || c.data().size() > n - got || (c.has_xxh3() && got != 0)) {
        ctx.TryCancel();
        return absl::DataLossError(absl::StrCat(what, ": a chunk out of order or too long"));
      }
      if (c.has_xxh3()) xxh3 = c.xxh3();
      std::memcpy(scratch.data() + got, c.data().data(), c.data().size());
      got += c.data().size();
    }
    grpc::Status s = stream->Finish();
    if (!s.ok() || got != n) {
      const auto code = s.ok() ? absl::StatusCode::kUnavailable
                               : static_cast<absl::StatusCode>(s.error_code());
      return absl::Status(
          code == absl::StatusCode::kPermissionDenied ? code : absl::StatusCode::kUnavailable,
          absl::StrCat("peer ", reader, " failed to send ", file, " bytes [", offset, ", ",
                       offset + n, ") (got ", got, "): ",
                       s.ok() ? "stream ended early" : s.error_message()));
    }
    if (!xxh3) return absl::DataLossError(absl::StrCat(what, ": sent without its checksum"));
    CKPT_RETURN_IF_ERROR(Check(scratch.data(), n, *xxh3, what, verify));
    received_ += n;
    return ckpt::RangeView{scratch.data(), nullptr, false};
  }

  uint64_t received() const { return received_.load(); }
  void set_links(NcclTransfers* links) { links_ = links; }

 private:
  // The received bytes against the sender's xxh3, then the plan's checksums.
  static absl::Status Check(const uint8_t* data, uint64_t n, uint64_t want,
                            const std::string& what,
                            const std::function<absl::Status(const uint8_t*)>& verify) {
    const uint64_t have = XXH3_64bits(data, n);
    if (have != want) {
      return absl::DataLossError(absl::StrCat(
          what, ": the bytes received hash to xxh3 ", absl::Hex(have, absl::kZeroPad16),
          ", the peer read ", absl::Hex(want, absl::kZeroPad16),
          " (altered in transit or by the peer); none of it was delivered"));
    }
    if (verify) {
      absl::Status v = verify(data);
      if (!v.ok()) return absl::Status(v.code(), absl::StrCat(what, ": ", v.message()));
    }
    return absl::OkStatus();
  }

  NcclTransfers* links_ = nullptr;
  const std::string me_, job_id_;
  ckpt::RangeSource* storage_;
  const std::map<std::pair<std::string, uint64_t>, uint32_t> global_index_;
  const std::vector<std::string> reader_;
  const PublishFn publish_;
  const StubFn stub_;
  const std::function<absl::Status()> aborted_;
  const absl::Duration timeout_;
  std::atomic<uint64_t> received_{0};
};

void Daemon::RunDistributedJob(const std::shared_ptr<Job>& job) {
  const auto t_start = std::chrono::steady_clock::now();
  const std::vector<std::shared_ptr<RankSlot>> slots = SlotsOf(*job);  // ascending rank
  auto fail_all = [&](const absl::Status& s) {
    RecordLoadJob(LoadJobRecord{job->id, job->path, config_.peer_listen, slots.size(), s});
    FailJob(*job, s);
  };
  const std::string me = config_.peer_listen;
  if (me.empty()) {
    return fail_all(absl::FailedPreconditionError(absl::StrCat(
        "job '", job->id, "' spans several daemons (this one serves ", job->expected.size(),
        " of ", job->world_size, " ranks) but this daemon has no peer_listen configured")));
  }
  const int coord_rank = slots.front()->request.coordinator_rank();
  for (const auto& s : slots) {
    if (s->request.path() != slots.front()->request.path()) {
      return fail_all(absl::InvalidArgumentError(absl::StrCat(
          "job '", job->id, "': ranks name the checkpoint differently ('",
          slots.front()->request.path(), "' vs '", s->request.path(), "')")));
    }
    if (s->request.coordinator_rank() != coord_rank) {
      return fail_all(absl::InvalidArgumentError(absl::StrCat(
          "job '", job->id, "': ranks disagree on coordinator_rank (", coord_rank, " vs ",
          s->request.coordinator_rank(), ")")));
    }
  }
  peer::v1::JoinRequest own = BaseJoin(*job, slots, me, slots.front()->request.path(), coord_rank);
  own.set_nccl(NcclWanted(*gpu_));
  {
    absl::MutexLock lock(&peer_mu_);
    const absl::Time now = absl::Now();
    for (auto it = nccl_unreachable_.begin(); it != nccl_unreachable_.end();) {
      if (it->second < now) {
        it = nccl_unreachable_.erase(it);
      } else {
        own.add_nccl_unreachable(it->first);
        ++it;
      }
    }
  }
  own.set_aoa_config(slots.front()->request.aoa_config());
  for (auto& f : ListReadable(job->path)) *own.add_readable() = std::move(f);

  DistJobKind kind;
  kind.aoa = slots.front()->request.aoa_config();
  std::shared_ptr<DistJob> dj = NewDistJob(*job, slots.front()->request.path(),
                                           job->expected.count(coord_rank) > 0, kind);
  auto cleanup = [&] {
    absl::MutexLock lock(&peer_mu_);
    auto it = dist_jobs_.find(job->id);
    if (it != dist_jobs_.end() && it->second == dj) dist_jobs_.erase(it);
  };
  {
    absl::MutexLock lock(&mu_);
    job->phase = dj->coordinator ? "gathering the job's ranks from peers" : "joining the coordinator";
  }
  // 1. The plan part of this node.
  peer::v1::PlanPart part;
  std::string coordinator = me;
  if (dj->coordinator) {
    auto p = CoordinatePlan(dj, own);
    if (!p.ok()) {
      fail_all(p.status());
      RetireDistJob(dj, absl::Seconds(2));  // late joiners still get the error
      return;
    }
    part = std::move(*p);
  } else {
    auto p = JoinCoordinator(own, dj->deadline);
    if (!p.ok()) {
      cleanup();
      return fail_all(p.status());
    }
    part = std::move(p->first);
    coordinator = p->second;
    if (absl::Status s = CheckPartOrigin(part, job->id, me, coordinator); !s.ok()) {
      cleanup();
      return fail_all(s);
    }
  }

  // 2. This node's share of the part. Every index, range, file, node and
  // rank in it is checked first (server/plan_codec.h): a part that fails is
  // this node's failure, reported to the coordinator like any other.
  PlanPartContext pctx;
  pctx.job_id = job->id;
  pctx.node = me;
  pctx.sender = coordinator;
  pctx.world_size = job->world_size;
  for (const auto& s : slots) pctx.ranks.push_back(&s->targets);
  // The coordinator cuts reads at its io_request_size as PlanLoad does.
  pctx.limits.max_read_bytes = config_.io_request_size == 0
                                   ? UINT64_MAX
                                   : std::max<uint64_t>(config_.io_request_size, 8);
  absl::StatusOr<LocalPart> local = LocalPartOf(part, pctx);
  absl::Status exec = local.status();
  if (!exec.ok()) {
    spdlog::warn("multi-node job={}: refused the plan part from {}: {}", job->id, coordinator,
                 exec.ToString());
  }
  LocalPart mine = exec.ok() ? *std::move(local) : LocalPart();
  ckpt::LoadPlan& lp = mine.plan;
  {
    absl::MutexLock lock(&peer_mu_);
    if (exec.ok()) {
      for (ServedRead& s : mine.served) {
        DistJob::Served& sv = dj->served[s.read];
        sv.length = s.length;
        sv.remaining = static_cast<int>(s.needers.size());
        sv.needers = std::move(s.needers);
      }
      dj->nodes.assign(part.nodes().begin(), part.nodes().end());
    } else {
      dj->exec_status = exec;  // nodes fetching from this one learn why
    }
    dj->part_known = true;
  }
  if (!dj->coordinator && exec.ok()) {
    // Observable for operators and tests: this node holds its part now.
    spdlog::info("multi-node job={}: plan part received from coordinator {} ({} reads here)",
                 job->id, coordinator, lp.reads.size());
  }
  // 3. Execute.
  if (config_.testing_delay_part > absl::ZeroDuration()) {
    absl::SleepFor(config_.testing_delay_part);  // fault injection for tests only
  }
  std::map<std::string, ckpt::FileStamp> stamps;
  for (const std::string& f : mine.local_files) {  // none when the part was refused
    auto st = ckpt::StatFile(ckpt::JoinPath(job->path, f));
    if (!st.ok()) {
      exec = absl::NotFoundError(absl::StrCat(me, ": data file ", f, " assigned to this node: ",
                                              st.status().message()));
      break;
    }
    stamps[f] = *st;
  }
  ckpt::LoadStats stats;
  uint64_t received = 0, sent = 0;
  if (exec.ok()) {
    std::vector<std::vector<void*>> dests;
    for (size_t i = 0; i < slots.size(); ++i) {
      dests.push_back(PrepareDestinations(*slots[i], lp.ranks[i]));
    }
    {
      absl::MutexLock lock(&mu_);
      job->phase = "reading (multi-node)";
      uint64_t total = 0;
      for (const auto& r : lp.reads) total += r.length;
      job->total = total;
    }
    ckpt::SourceOptions storage_options;
    storage_options.tenant = job->owner;
    ckpt::CachingSource storage(job->path, &cache_, stamps, storage_options);
    DistSource source(
        me, job->id, &storage, std::move(mine.global_index), std::move(mine.reader),
        [&](uint32_t g, const ckpt::RangeView& v, uint64_t xxh3) {
          absl::MutexLock lock(&peer_mu_);
          auto it = dj->served.find(g);
          if (it == dj->served.end()) return;
          it->second.view = v;
          it->second.xxh3 = xxh3;
          it->second.ready = true;
          sent += it->second.length * it->second.remaining;
        },
        [this](const std::string& a) { return PeerStub(a); },
        [this, dj]() -> absl::Status {
          absl::MutexLock lock(&peer_mu_);
          return dj->violation;
        },
        config_.peer_timeout);
    std::unique_ptr<NcclTransfers> nccl = StartNcclTransfers(
        gpu_.get(), part, me, config_.nccl_device, config_.peer_timeout,
        std::min(config_.nccl_connect_timeout, config_.peer_timeout),
        [this, dj](uint32_t g, absl::Time deadline) -> absl::StatusOr<NcclTransfers::Bytes> {
          absl::MutexLock lock(&peer_mu_);
          auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(peer_mu_) {
            auto it = dj->served.find(g);
            return it == dj->served.end() || it->second.ready || !dj->exec_status.ok() ||
                   !dj->violation.ok();
          };
          peer_mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
          auto it = dj->served.find(g);
          if (it == dj->served.end() || !it->second.ready || it->second.view.data == nullptr) {
            return absl::UnavailableError(absl::StrCat("read ", g, " is not available to send"));
          }
          NcclTransfers::Bytes b{it->second.view, it->second.xxh3};
          if (config_.testing_corrupt_served && it->second.length > 0) {
            // Fault injection for tests only: a flipped byte on the link.
            auto copy = std::make_shared<std::vector<uint8_t>>(b.view.data,
                                                               b.view.data + it->second.length);
            (*copy)[0] ^= 0x01;
            b.view = ckpt::RangeView{copy->data(), copy, false};
          }
          return b;
        });
    source.set_links(nccl.get());
    auto delivery = JobDelivery(slots, std::move(dests));
    ckpt::ExecuteOptions eo;
    eo.threads = config_.io_threads;
    eo.verify_checksums = !AllRanksSkipVerify(slots);
    eo.progress_bytes = &job->progress;
    eo.skip_rank = [&](size_t i) { return slots[i]->cancelled(); };
    eo.deadline = std::chrono::steady_clock::now() +
                  std::chrono::milliseconds(absl::ToInt64Milliseconds(config_.load_timeout));
    GatedSource gated(&source, job.get(), config_.testing_delay_read);
    auto st = delivery.ok() ? ckpt::ExecutePlan(lp, gated, **delivery, eo)
                            : absl::StatusOr<ckpt::LoadStats>(delivery.status());
    if (st.ok()) {
      // A local file changed after its last read fails this node's part too.
      if (absl::Status c = storage.CheckOpenedFilesUnchanged(); !c.ok()) st = c;
    }
    ReleaseDeviceBuffers(delivery, slots);
    received = source.received();
    if (nccl != nullptr && nccl->connect_failed()) {
      // Remembered: this node's next jobs with these peers stay on gRPC.
      absl::MutexLock lock(&peer_mu_);
      for (const auto& n : part.nodes()) {
        if (n != me) nccl_unreachable_[n] = absl::Now() + absl::Minutes(5);
      }
    }
    if (nccl != nullptr) {
      // Our own part is done; peers may still be receiving our reads.
      if (st.ok()) {
        nccl->Finish(absl::Now() + config_.peer_timeout).IgnoreError();  // logged; gRPC serves
      } else {
        nccl->Abort();
      }
    }
    if (st.ok()) {
      stats = *st;
    } else {
      exec = st.status();
    }
  }
  {
    absl::MutexLock lock(&peer_mu_);
    // A violation seen here fails this node's part (and so the job), even
    // when every read went through before it.
    if (exec.ok() && !dj->violation.ok()) exec = dj->violation;
    if (!exec.ok()) dj->exec_status = exec;
  }
  bytes_read_total_ += stats.bytes_read;
  // 4. Agree on the outcome with every node.
  {
    absl::MutexLock lock(&mu_);
    job->phase = "waiting for the other nodes";
  }
  peer::v1::CompleteRequest done = CompletionOf(job->id, me, exec);
  done.set_bytes_read(stats.bytes_read);
  done.set_bytes_received(received);
  done.set_bytes_sent(sent);
  absl::StatusOr<peer::v1::CompleteResponse> outcome = ReportCompletion(dj, coordinator, done);
  // Every node has completed (the outcome says so): its fetches are done.
  RetireDistJob(dj, absl::Seconds(1));
  absl::Status final_status = JobOutcome(job->id, exec, outcome);
  if (!final_status.ok()) {
    spdlog::warn("multi-node job={} failed on {}: {}", job->id, me, final_status.ToString());
    return fail_all(final_status);
  }
  JobFigures fig;
  fig.stats = &stats;
  fig.unexpected_keys.assign(part.unexpected_keys().begin(), part.unexpected_keys().end());
  fig.renamed_keys.insert(part.renamed_keys().begin(), part.renamed_keys().end());
  // Peer bytes are not from storage; the executor counts them with cache hits.
  fig.bytes_from_cache = stats.bytes_from_cache - std::min(stats.bytes_from_cache, received);
  fig.unique_id = part.unique_id();
  fig.format = part.format();
  fig.plan_s = part.plan_s();
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < slots.size(); ++i) {
    RankSlot& s = *slots[i];
    if (s.done) continue;
    FillLoadResult(s, lp.ranks[i], i, fig, t_start);
    s.result.set_bytes_from_peers(received);
    s.result.set_bytes_to_peers(sent);
    for (const auto& n : part.nodes()) s.result.add_nodes(n);
    s.result.set_job_bytes_read(outcome->job_bytes_read());
    s.done = true;
  }
  job->state = Job::State::kFinished;
  job->phase = "done";
  auto it = jobs_.find(job->id);
  if (it != jobs_.end() && it->second == job) jobs_.erase(it);
  LoadJobRecord rec{job->id, job->path, me, slots.size()};  // metrics + the job's log line
  rec.bytes_read = stats.bytes_read;
  rec.bytes_from_cache = fig.bytes_from_cache;
  rec.bytes_from_peers = received;
  rec.bytes_to_peers = sent;
  rec.bytes_delivered = stats.bytes_delivered;
  rec.job_bytes_read = outcome->job_bytes_read();
  rec.reads = lp.reads.size();
  rec.checksums_verified = stats.checksums_verified;
  rec.plan_s = part.plan_s();
  rec.read_s = stats.read_seconds;
  rec.copy_s = stats.copy_seconds;
  rec.wall_s = Seconds(t_start);
  RecordLoadJob(rec);
}

}  // namespace ckptd
