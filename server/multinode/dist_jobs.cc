#include "server/multinode/dist_jobs.h"

#include <algorithm>
#include <cstdint>

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/base/xxh3.h"
#include "server/await.h"
#include "server/peer/peer_plane.h"

namespace ckptd {
namespace {

// The spans of a fetch (FetchReadRequest.spans) against its read of
// `length` bytes: at most kMaxFetchSpans, each non-empty, inside the read,
// ascending and disjoint. Says what is wrong with the first that is not.
absl::Status CheckFetchSpans(const peer::v1::FetchReadRequest& req, uint64_t length) {
  if (static_cast<size_t>(req.spans_size()) > kMaxFetchSpans) {
    return absl::InvalidArgumentError(
        absl::StrCat(req.spans_size(), " spans (at most ", kMaxFetchSpans, ")"));
  }
  int64_t prev_end = 0;
  for (int i = 0; i < req.spans_size(); ++i) {
    const peer::v1::Range& r = req.spans(i);
    if (r.begin() < prev_end || r.end() <= r.begin() ||
        static_cast<uint64_t>(r.end()) > length) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spans[", i, "] [", r.begin(), ", ", r.end(), ") (spans are non-empty, ascending, "
          "disjoint and inside the read of ", length, " bytes)"));
    }
    prev_end = r.end();
  }
  return absl::OkStatus();
}

// Streams read bytes `view` (`length` bytes, xxh3 `xxh3` as read) to a
// fetcher: whole (the first chunk with the read's xxh3), or only the spans
// `req` asks for, one after another, each chunk with its own xxh3.
// `corrupt`: fault injection for tests (a flipped byte per chunk sent).
// Returns the bytes sent, CANCELLED when the fetcher went away.
absl::StatusOr<uint64_t> SendRead(const ckpt::RangeView& view, uint64_t length, uint64_t xxh3,
                                  const peer::v1::FetchReadRequest& req, bool corrupt,
                                  const std::function<bool(const peer::v1::Chunk&)>& send) {
  constexpr uint64_t kChunk = 1 << 20;
  if (req.spans_size() == 0) {
    for (uint64_t off = 0; off == 0 || off < length; off += kChunk) {
      peer::v1::Chunk c;
      c.set_offset(off);
      if (length > 0) c.set_data(view.data + off, std::min(kChunk, length - off));
      if (off == 0) {
        c.set_xxh3(xxh3);
        if (corrupt && length > 0) {
          (*c.mutable_data())[0] ^= 0x01;  // fault injection for tests only
        }
      }
      if (!send(c)) return absl::CancelledError("the fetching node went away");
    }
    return length;
  }
  // Only the spans the fetching node's ranks copy, one after another, in
  // chunks of up to kChunk bytes, each with its own xxh3.
  uint64_t sent = 0;
  peer::v1::Chunk c;
  auto flush = [&]() {
    const std::string& d = c.data();
    c.set_xxh3(XXH3_64bits(d.data(), d.size()));
    if (corrupt && !d.empty()) {
      (*c.mutable_data())[0] ^= 0x01;  // fault injection for tests only
    }
    sent += d.size();
    const bool ok = send(c);
    c.set_offset(sent);
    c.clear_data();
    return ok;
  };
  for (const peer::v1::Range& r : req.spans()) {
    for (uint64_t at = static_cast<uint64_t>(r.begin()); at < static_cast<uint64_t>(r.end());) {
      const uint64_t k = std::min<uint64_t>(static_cast<uint64_t>(r.end()) - at,
                                            kChunk - c.data().size());
      c.mutable_data()->append(reinterpret_cast<const char*>(view.data + at), k);
      at += k;
      if (c.data().size() == kChunk && !flush()) {
        return absl::CancelledError("the fetching node went away");
      }
    }
  }
  if (!c.data().empty() && !flush()) return absl::CancelledError("the fetching node went away");
  return sent;
}

}  // namespace

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

absl::Status DistJobs::PeerFetchRead(const PeerCaller& caller,
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
  const std::shared_ptr<DistJob> dj = Find(req.job_id());
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
      return dj->RefuseLocked(caller, req.node(),
                              absl::StrCat("fetched read ", g, ": ", who.message()));
    }
    // The coordinator knows every node that joined: no need to wait for the
    // plan to refuse one that did not.
    if (!member && dj->coordinator && !dj->joins.count(req.node())) {
      return dj->RefuseLocked(caller, req.node(),
                              absl::StrCat("fetched read ", g, " as '", req.node(),
                                           "', which is not a node of the job"));
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
      return dj->RefuseLocked(caller, req.node(),
                              absl::StrCat("fetched read ", g, " as '", req.node(),
                                           "', which is not a node of the job"));
    }
    auto sv = dj->served.find(g);
    if (sv == dj->served.end() || !sv->second.needers.count(req.node())) {
      return dj->ViolationLocked(caller, absl::StrCat("fetched read ", g, " as '", req.node(),
                                                      "', whose part does not need it from ", me));
    }
    DistJob::Served& served = sv->second;
    if (absl::Status spans = CheckFetchSpans(req, served.length); !spans.ok()) {
      return dj->ViolationLocked(caller, absl::StrCat("fetched read ", g, " as '", req.node(),
                                                      "' with ", spans.message()));
    }
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
  absl::StatusOr<uint64_t> sent =
      SendRead(view, length, xxh3, req, config_.testing_corrupt_served, send);
  if (!sent.ok()) return sent.status();
  absl::MutexLock lock(&dj->mu);
  dj->bytes_sent += *sent;
  auto sv = dj->served.find(g);  // found above; entries are never erased
  if (sv != dj->served.end() && --sv->second.remaining <= 0) {
    sv->second.view = ckpt::RangeView{};  // unpin
  }
  return absl::OkStatus();
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
