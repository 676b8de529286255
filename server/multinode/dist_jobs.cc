#include "server/multinode/dist_jobs.h"

#include <algorithm>
#include <cstdint>

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "server/await.h"
#include "server/peer/peer_plane.h"

namespace ckptd {

DistJobs::DistJobs(const DaemonConfig& config, PeerPlane* peers, gpu::GpuRuntime* gpu)
    : config_(config), peers_(peers), gpu_(gpu), rendezvous_(2 * config.peer_timeout) {}

std::shared_ptr<DistJob> DistJobs::New(const Job& job, const std::string& path,
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
  dj->job_key = job.job_key;
  absl::MutexLock lock(&mu_);
  PurgeLocked();
  jobs_[job.id] = dj;
  return dj;
}

void DistJobs::PurgeLocked() {
  const absl::Time now = absl::Now();
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    bool expired = false;
    {
      DistJob& dj = *it->second;
      absl::MutexLock lock(&dj.mu);
      expired = dj.expires <= now;
    }  // (the map may hold the last reference: erased unlocked)
    it = expired ? jobs_.erase(it) : std::next(it);
  }
}

void DistJobs::Retire(const std::shared_ptr<DistJob>& dj, absl::Duration linger) {
  absl::MutexLock lock(&mu_);
  {
    absl::MutexLock job_lock(&dj->mu);
    dj->expires = absl::Now() + linger;
  }
  PurgeLocked();
}

std::shared_ptr<DistJob> DistJobs::Find(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(id);
  return it == jobs_.end() ? nullptr : it->second;
}

peer::v1::PingResponse DistJobs::PeerPing(const PeerCaller& caller, const peer::v1::PingRequest& req) {
  peer::v1::PingResponse r;
  r.set_node(config_.peer_listen);
  // Job ids only to a node of the job, speaking for an address it may.
  if (req.node().empty() || !peers_->SpeaksFor(caller, req.node()).ok()) return r;
  absl::MutexLock lock(&mu_);
  PurgeLocked();
  for (const auto& [id, dj] : jobs_) {
    absl::MutexLock job_lock(&dj->mu);
    const bool member = std::find(dj->nodes.begin(), dj->nodes.end(), req.node()) != dj->nodes.end() ||
                        dj->joins.count(req.node()) > 0;
    if (member) r.add_jobs(id);
  }
  return r;
}

absl::StatusOr<peer::v1::CompleteResponse> DistJobs::ReportCompletion(
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

std::vector<std::string> DistJobs::NcclUnreachable() {
  std::vector<std::string> out;
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  for (auto it = nccl_unreachable_.begin(); it != nccl_unreachable_.end();) {
    if (it->second < now) {
      it = nccl_unreachable_.erase(it);
    } else {
      out.push_back(it->first);
      ++it;
    }
  }
  return out;
}

void DistJobs::MarkNcclUnreachable(const std::vector<std::string>& nodes) {
  absl::MutexLock lock(&mu_);
  for (const auto& n : nodes) {
    if (n != config_.peer_listen) nccl_unreachable_[n] = absl::Now() + absl::Minutes(5);
  }
}

absl::Status DistJobs::AdoptPart(const std::shared_ptr<DistJob>& dj, const peer::v1::PlanPart& part,
                                 const std::string& coordinator, PlanPartContext pctx,
                                 LocalPart* out) {
  // Every index, range, file, node and rank in it is checked first
  // (plan_codec.h): a part that fails is this node's failure, reported to
  // the coordinator like any other.
  // The coordinator cuts reads at its io_request_size as PlanLoad does.
  pctx.limits.max_read_bytes = config_.io_request_size == 0
                                   ? UINT64_MAX
                                   : std::max<uint64_t>(config_.io_request_size, 8);
  absl::StatusOr<LocalPart> local = LocalPartOf(part, pctx);
  absl::Status exec = local.status();
  if (!exec.ok()) {
    spdlog::warn("multi-node job={}: refused the plan part from {}: {}", dj->id, coordinator,
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
      // The coordinator keeps every node of the job (PublishParts); a part
      // names only the nodes its node exchanges reads with.
      if (!dj->coordinator) dj->nodes.assign(part.nodes().begin(), part.nodes().end());
    } else {
      dj->exec_status = exec;  // nodes fetching from this one learn why
    }
    dj->part_known = true;
  }
  if (!dj->coordinator && exec.ok()) {
    // Observable for operators and tests: this node holds its part now.
    spdlog::info("multi-node job={}: plan part received from coordinator {} ({} reads here)",
                 dj->id, coordinator, mine.plan.reads.size());
  }
  return exec;
}

}  // namespace ckptd
