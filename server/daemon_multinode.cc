// Multi-node jobs: the coordinator, the node-aware load balancer's use, and
// daemon-to-daemon transfer over the peer service.
//
// Flow for a job whose ranks span several daemons:
//  1. Each daemon waits for its own ranks (the local barrier in Load).
//  2. The daemon serving `coordinator_rank` gathers every node's ranks and
//     readable data files through Join, plans once, assigns every read to
//     one node (core/plan/balancer.h) and answers each Join with that node's part.
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
#include "core/plan/aoa.h"
#include "core/plan/balancer.h"
#include "core/exec/executor.h"
#include "core/base/status_macros.h"
#include "core/base/xxh3.h"
#include "server/daemon.h"
#include "server/peer/peer_plane.h"
#include "server/daemon_dist.h"
#include "server/daemon_internal.h"
#include "server/obs/metrics.h"
#include "server/multinode/peer_nccl.h"
#include "server/multinode/plan_codec.h"

namespace ckptd {

using ckpt::TargetTensor;

namespace {

// The identity of each file of `dir` that node `me` reads from storage for
// its part (the caching source checks every read against it).
absl::Status StampLocalFiles(const std::string& dir, const std::set<std::string>& files,
                             const std::string& me, std::map<std::string, ckpt::FileStamp>* out) {
  for (const std::string& f : files) {
    auto st = ckpt::StatFile(ckpt::JoinPath(dir, f));
    if (!st.ok()) {
      return absl::NotFoundError(absl::StrCat(me, ": data file ", f, " assigned to this node: ",
                                              st.status().message()));
    }
    (*out)[f] = *st;
  }
  return absl::OkStatus();
}

// Data-file-like names in `dir` (what this node can read).
std::vector<peer::v1::FileInfo> ListReadable(const std::string& dir) {
  std::vector<peer::v1::FileInfo> out;
  auto d = ckpt::Directory::Open(dir, /*confine=*/false);
  if (!d.ok()) return out;
  auto names = (*d)->List();
  if (!names.ok()) return out;
  for (const std::string& n : *names) {
    if (absl::EndsWith(n, ".metadata")) continue;
    auto st = ckpt::StatFile(ckpt::JoinPath(dir, n));
    if (!st.ok()) continue;
    peer::v1::FileInfo fi;
    fi.set_name(n);
    fi.set_size(st->size);
    out.push_back(std::move(fi));
  }
  return out;
}

}  // namespace

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
    bool expired = false;
    {
      DistJob& dj = *it->second;
      absl::MutexLock lock(&dj.mu);
      expired = dj.expires <= now;
    }  // (the map may hold the last reference: erased unlocked)
    it = expired ? dist_jobs_.erase(it) : std::next(it);
  }
}

void Daemon::RetireDistJob(const std::shared_ptr<DistJob>& dj, absl::Duration linger) {
  absl::MutexLock lock(&peer_mu_);
  {
    absl::MutexLock job_lock(&dj->mu);
    dj->expires = absl::Now() + linger;
  }
  PurgeDistJobsLocked();
}

std::shared_ptr<Daemon::DistJob> Daemon::FindDistJob(const std::string& id) {
  absl::MutexLock lock(&peer_mu_);
  auto it = dist_jobs_.find(id);
  return it == dist_jobs_.end() ? nullptr : it->second;
}

absl::Status Daemon::DistJob::ViolationLocked(const PeerCaller& caller, absl::string_view what) {
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

peer::v1::PingResponse Daemon::PeerPing(const PeerCaller& caller, const peer::v1::PingRequest& req) {
  peer::v1::PingResponse r;
  r.set_node(config_.peer_listen);
  // Job ids only to a node of the job, speaking for an address it may.
  if (req.node().empty() || !peers_->SpeaksFor(caller, req.node()).ok()) return r;
  absl::MutexLock lock(&peer_mu_);
  PurgeDistJobsLocked();
  for (const auto& [id, dj] : dist_jobs_) {
    absl::MutexLock job_lock(&dj->mu);
    const bool member = std::find(dj->nodes.begin(), dj->nodes.end(), req.node()) != dj->nodes.end() ||
                        dj->joins.count(req.node()) > 0;
    if (member) r.add_jobs(id);
  }
  return r;
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
  grpc::Status s = peers_->Stub(coordinator)->Complete(&ctx, done, &resp);
  if (s.ok()) return resp;
  return absl::UnavailableError(absl::StrCat("coordinator ", coordinator,
                                             " did not confirm the job: ", s.error_message()));
}

absl::Status Daemon::PeerFetchRead(const PeerCaller& caller,
                                   const peer::v1::FetchReadRequest& req,
                                   const std::function<bool(const peer::v1::Chunk&)>& send,
                                   const std::function<bool()>& cancelled) {
  const absl::Status who_if_member = peers_->SpeaksFor(caller, req.node(), /*job_member=*/true);
  const absl::Status who_otherwise = peers_->SpeaksFor(caller, req.node());
  const std::string& me = config_.peer_listen;
  const uint32_t g = req.read();
  ckpt::RangeView view;
  uint64_t length = 0, xxh3 = 0;
  const absl::Time deadline = absl::Now() + config_.peer_timeout;
  const std::shared_ptr<DistJob> dj = FindDistJob(req.job_id());
  if (dj == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        me, ": job '", req.job_id(),
        "' is not running here (finished, failed, or never started on this node): a late or "
        "unplanned fetch of read ", g));
  }
  {
    absl::MutexLock lock(&dj->mu);
    // A node of the job (checked again below, once the part is known) keeps
    // its standing if it left the peer_dns answer since it joined.
    const bool member =
        std::find(dj->nodes.begin(), dj->nodes.end(), req.node()) != dj->nodes.end();
    const absl::Status& who = member ? who_if_member : who_otherwise;
    if (!who.ok()) {
      return dj->ViolationLocked(caller, absl::StrCat("fetched read ", g, ": ", who.message()));
    }
    auto over = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(dj->mu) {
      return !dj->exec_status.ok() || !dj->violation.ok();
    };
    auto part_known = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(dj->mu) {
      return dj->part_known || over();
    };
    // Why nothing is served any more: this node's part failed, or a violation.
    auto ended = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(dj->mu) -> absl::Status {
      if (!dj->exec_status.ok()) {
        return absl::AbortedError(absl::StrCat(me, " failed its part of job '", req.job_id(),
                                               "': ", dj->exec_status.message()));
      }
      if (!dj->violation.ok()) return absl::AbortedError(std::string(dj->violation.message()));
      return absl::OkStatus();
    };
    if (!AwaitOrCancel(&dj->mu, absl::Condition(&part_known), deadline, cancelled)) {
      return WaitFailed(cancelled, absl::StrCat(me, ": job '", req.job_id(),
                                                "' had no plan part within ",
                                                absl::FormatDuration(config_.peer_timeout)));
    }
    CKPT_RETURN_IF_ERROR(ended());
    if (std::find(dj->nodes.begin(), dj->nodes.end(), req.node()) == dj->nodes.end()) {
      return dj->ViolationLocked(caller, absl::StrCat("fetched read ", g, " as '", req.node(),
                                                      "', which is not a node of the job"));
    }
    auto sv = dj->served.find(g);
    if (sv == dj->served.end() || !sv->second.needers.count(req.node())) {
      return dj->ViolationLocked(caller, absl::StrCat("fetched read ", g, " as '", req.node(),
                                                      "', whose part does not need it from ", me));
    }
    DistJob::Served& served = sv->second;
    if (!served.fetched.insert(req.node()).second) {
      return dj->ViolationLocked(caller,
                                 absl::StrCat("fetched read ", g, " as '", req.node(),
                                              "' a second time (a node fetches a read once)"));
    }
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(dj->mu) { return served.ready || over(); };
    if (!AwaitOrCancel(&dj->mu, absl::Condition(&ready), deadline, cancelled)) {
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
  absl::MutexLock lock(&dj->mu);
  auto sv = dj->served.find(g);  // found above; entries are never erased
  if (sv != dj->served.end() && --sv->second.remaining <= 0) {
    sv->second.view = ckpt::RangeView{};  // unpin
  }
  return absl::OkStatus();
}

absl::StatusOr<peer::v1::JoinRequest> Daemon::LoadJoinOf(
    const Job& job, const std::vector<std::shared_ptr<RankSlot>>& slots) {
  const std::string& me = config_.peer_listen;
  if (me.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.id, "' spans several daemons (this one serves ", job.expected.size(),
        " of ", job.world_size, " ranks) but this daemon has no peer_listen configured"));
  }
  const int coord_rank = slots.front()->request.coordinator_rank();
  for (const auto& s : slots) {
    if (s->request.path() != slots.front()->request.path()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job '", job.id, "': ranks name the checkpoint differently ('",
          slots.front()->request.path(), "' vs '", s->request.path(), "')"));
    }
    if (s->request.coordinator_rank() != coord_rank) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job '", job.id, "': ranks disagree on coordinator_rank (", coord_rank, " vs ",
          s->request.coordinator_rank(), ")"));
    }
  }
  peer::v1::JoinRequest own = BaseJoin(job, slots, me, slots.front()->request.path(), coord_rank);
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
  for (auto& f : ListReadable(job.path)) *own.add_readable() = std::move(f);
  return own;
}

PlanPartContext Daemon::PartContext(const Job& job,
                                    const std::vector<std::shared_ptr<RankSlot>>& slots,
                                    const std::string& coordinator) const {
  PlanPartContext pctx;
  pctx.job_id = job.id;
  pctx.node = config_.peer_listen;
  pctx.sender = coordinator;
  pctx.world_size = job.world_size;
  for (const auto& s : slots) pctx.ranks.push_back(&s->targets);
  return pctx;
}

absl::Status Daemon::AdoptPart(const Job& job, const std::vector<std::shared_ptr<RankSlot>>& slots,
                               const std::shared_ptr<DistJob>& dj, const peer::v1::PlanPart& part,
                               const std::string& coordinator, LocalPart* out) {
  // Every index, range, file, node and rank in it is checked first
  // (server/plan_codec.h): a part that fails is this node's failure,
  // reported to the coordinator like any other.
  PlanPartContext pctx = PartContext(job, slots, coordinator);
  // The coordinator cuts reads at its io_request_size as PlanLoad does.
  pctx.limits.max_read_bytes = config_.io_request_size == 0
                                   ? UINT64_MAX
                                   : std::max<uint64_t>(config_.io_request_size, 8);
  absl::StatusOr<LocalPart> local = LocalPartOf(part, pctx);
  absl::Status exec = local.status();
  if (!exec.ok()) {
    spdlog::warn("multi-node job={}: refused the plan part from {}: {}", job.id, coordinator,
                 exec.ToString());
  }
  LocalPart& mine = *out;
  if (exec.ok()) mine = *std::move(local);
  {
    absl::MutexLock lock(&dj->mu);
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
                 job.id, coordinator, mine.plan.reads.size());
  }
  return exec;
}

void Daemon::RunDistributedJob(const std::shared_ptr<Job>& job,
                               const std::vector<std::shared_ptr<RankSlot>>& slots,
                               std::chrono::steady_clock::time_point t_start) {
  auto fail_all = [&](const absl::Status& s) {
    RecordLoadJob(LoadJobRecord{job->id, job->path, config_.peer_listen, slots.size(), s});
    jobs_.Fail(*job, s);
  };
  const std::string me = config_.peer_listen;
  absl::StatusOr<peer::v1::JoinRequest> joined = LoadJoinOf(*job, slots);
  if (!joined.ok()) return fail_all(joined.status());
  const peer::v1::JoinRequest& own = *joined;
  const int coord_rank = own.coordinator_rank();

  DistJobKind kind;
  kind.aoa = slots.front()->request.aoa_config();
  std::shared_ptr<DistJob> dj = NewDistJob(*job, slots.front()->request.path(),
                                           job->expected.count(coord_rank) > 0, kind);
  job->SetPhase(dj->coordinator ? "gathering the job's ranks from peers"
                                : "joining the coordinator");
  // 1. The plan part of this node.
  auto planned = PlanPartOf(
      dj, own, [&](const auto& nodes, const auto& joins, auto t0) {
        return PlanLoadParts(*dj, nodes, joins, t0);
      });
  if (!planned.ok()) return fail_all(planned.status());
  const peer::v1::PlanPart& part = planned->first;
  const std::string& coordinator = planned->second;

  // 2. This node's share of the part.
  LocalPart mine;
  absl::Status exec = AdoptPart(*job, slots, dj, part, coordinator, &mine);
  ckpt::LoadPlan& lp = mine.plan;
  // 3. Execute.
  if (config_.testing_delay_part > absl::ZeroDuration()) {
    absl::SleepFor(config_.testing_delay_part);  // fault injection for tests only
  }
  std::map<std::string, ckpt::FileStamp> stamps;  // none when the part was refused
  if (exec.ok()) exec = StampLocalFiles(job->path, mine.local_files, me, &stamps);
  ckpt::LoadStats stats;
  uint64_t received = 0, sent = 0;
  if (exec.ok()) {
    std::unique_ptr<RemoteReads> peers =
        PeerReadsFor(dj, part, std::move(mine.global_index), std::move(mine.reader));
    auto st = RunNodePart(job, slots, lp, stamps, "reading (multi-node)", peers.get());
    received = peers->bytes_received();
    sent = peers->bytes_sent();
    if (st.ok()) {
      stats = *st;
    } else {
      exec = st.status();
    }
  }
  exec = dj->EndPart(std::move(exec));
  // 4. Agree on the outcome with every node.
  job->SetPhase("waiting for the other nodes");
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
  fig.start = t_start;
  fig.stats = &stats;
  fig.unexpected_keys.assign(part.unexpected_keys().begin(), part.unexpected_keys().end());
  fig.renamed_keys.insert(part.renamed_keys().begin(), part.renamed_keys().end());
  // Peer bytes are not from storage; the executor counts them with cache hits.
  fig.bytes_from_cache = stats.bytes_from_cache - std::min(stats.bytes_from_cache, received);
  fig.unique_id = part.unique_id();
  fig.format = part.format();
  fig.plan_s = part.plan_s();
  LoadJobRecord rec{job->id, job->path, me, slots.size()};
  rec.bytes_from_peers = received;
  rec.bytes_to_peers = sent;
  rec.job_bytes_read = outcome->job_bytes_read();
  FinishLoadJob(job, slots, lp, fig, std::move(rec), [&](v1::LoadResult& r) {
    r.set_bytes_from_peers(received);
    r.set_bytes_to_peers(sent);
    for (const auto& n : part.nodes()) r.add_nodes(n);
    r.set_job_bytes_read(outcome->job_bytes_read());
  });
}

}  // namespace ckptd
