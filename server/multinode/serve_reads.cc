// This node's reads served to the nodes that need them: the peer service's
// FetchRead and FetchReads bodies (DistJobs::PeerFetchRead/PeerFetchReads).
// A fetcher must be a node of the job whose part needs each read from here,
// fetch each read once, and ask for spans inside it; anything else is a
// violation that fails the job. Each read is waited for (up to
// peer_timeout) until this node's part has read it, then sent whole (the
// first chunk with the xxh3 of the read) or as the spans asked for (each
// chunk with the xxh3 of its own bytes).
#include <algorithm>
#include <atomic>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/base/xxh3.h"
#include "server/await.h"
#include "server/multinode/dist_jobs.h"
#include "server/peer/peer_plane.h"

namespace ckptd {
namespace {

// Streams read bytes `view` (`length` bytes, xxh3 `xxh3` as read) to a
// fetcher: whole (the first chunk with the read's xxh3), or only the spans
// of `runs` (`req`'s, checked), one after another, each chunk with its own
// xxh3. Every chunk names the read. `corrupt`: fault injection for tests (a
// flipped byte per chunk sent). Each chunk's bytes are added to `counted`
// before it goes (DistJob::bytes_sent). Returns the bytes sent, CANCELLED
// when the fetcher went away.
absl::StatusOr<uint64_t> SendRead(const ckpt::RangeView& view, uint64_t length, uint64_t xxh3,
                                  const peer::v1::FetchReadRequest& req,
                                  const std::vector<ckpt::SpanRun>& runs, bool corrupt,
                                  std::atomic<uint64_t>& counted,
                                  const std::function<bool(const peer::v1::Chunk&)>& send) {
  constexpr uint64_t kChunk = 1 << 20;
  if (runs.empty()) {
    for (uint64_t off = 0; off == 0 || off < length; off += kChunk) {
      peer::v1::Chunk c;
      c.set_read(req.read());
      c.set_offset(off);
      if (length > 0) c.set_data(view.data + off, std::min(kChunk, length - off));
      if (off == 0) {
        c.set_xxh3(xxh3);
        if (corrupt && length > 0) {
          (*c.mutable_data())[0] ^= 0x01;  // fault injection for tests only
        }
      }
      counted += c.data().size();
      if (!send(c)) return absl::CancelledError("the fetching node went away");
    }
    return length;
  }
  // Only the spans the fetching node's ranks copy, one after another, in
  // chunks of up to kChunk bytes, each with its own xxh3.
  uint64_t sent = 0;
  peer::v1::Chunk c;
  c.set_read(req.read());
  auto flush = [&]() {
    const std::string& d = c.data();
    c.set_xxh3(XXH3_64bits(d.data(), d.size()));
    if (corrupt && !d.empty()) {
      (*c.mutable_data())[0] ^= 0x01;  // fault injection for tests only
    }
    sent += d.size();
    counted += d.size();
    const bool ok = send(c);
    c.set_offset(sent);
    c.clear_data();
    return ok;
  };
  for (const ckpt::SpanRun& r : runs) {
    for (uint64_t i = 0; i < r.count; ++i) {
      const uint64_t b = r.begin + i * r.stride, e = b + r.length;
      for (uint64_t at = b; at < e;) {
        const uint64_t k = std::min<uint64_t>(e - at, kChunk - c.data().size());
        c.mutable_data()->append(reinterpret_cast<const char*>(view.data + at), k);
        at += k;
        if (c.data().size() == kChunk && !flush()) {
          return absl::CancelledError("the fetching node went away");
        }
      }
    }
  }
  if (!c.data().empty() && !flush()) return absl::CancelledError("the fetching node went away");
  return sent;
}

// "read 7" or "reads 7, 9, ... (12 reads)", for messages.
std::string ReadsNamed(const peer::v1::FetchReadsRequest& req) {
  if (req.reads_size() == 1) return absl::StrCat("read ", req.reads(0).read());
  if (req.reads_size() == 0) return "no read";
  return absl::StrCat("reads ", req.reads(0).read(), ", ... (", req.reads_size(), " reads)");
}

}  // namespace

absl::Status DistJobs::PeerFetchRead(const PeerCaller& caller,
                                     const peer::v1::FetchReadRequest& req,
                                     const std::function<bool(const peer::v1::Chunk&)>& send,
                                     const std::function<bool()>& cancelled) {
  peer::v1::FetchReadsRequest batch;
  batch.set_job_id(req.job_id());
  batch.set_node(req.node());
  peer::v1::FetchReadRequest* one = batch.add_reads();
  one->set_read(req.read());
  *one->mutable_spans() = req.spans();
  *one->mutable_span_runs() = req.span_runs();
  return PeerFetchReads(caller, batch, send, cancelled);
}

absl::Status DistJobs::AdmitFetchLocked(DistJob& dj, const PeerCaller& caller,
                                        const peer::v1::FetchReadsRequest& req,
                                        std::vector<std::vector<ckpt::SpanRun>>* runs) {
  if (req.reads_size() == 0 || static_cast<size_t>(req.reads_size()) > kMaxFetchReads) {
    return dj.ViolationLocked(caller, absl::StrCat("fetched ", req.reads_size(), " reads as '",
                                                   req.node(), "' in one call (1 to ",
                                                   kMaxFetchReads, ")"));
  }
  for (const peer::v1::FetchReadRequest& r : req.reads()) {
    const uint32_t g = r.read();
    auto sv = dj.served.find(g);
    if (sv == dj.served.end() || !sv->second.needers.count(req.node())) {
      return dj.ViolationLocked(caller, absl::StrCat("fetched read ", g, " as '", req.node(),
                                                     "', whose part does not need it from ",
                                                     config_.peer_listen));
    }
    DistJob::Served& served = sv->second;
    absl::StatusOr<std::vector<ckpt::SpanRun>> spans = FetchSpansOf(r, served.length);
    if (!spans.ok()) {
      return dj.ViolationLocked(caller, absl::StrCat("fetched read ", g, " as '", req.node(),
                                                     "' with ", spans.status().message()));
    }
    runs->push_back(*std::move(spans));
    if (!served.fetched.insert(req.node()).second) {
      return dj.ViolationLocked(caller,
                                absl::StrCat("fetched read ", g, " as '", req.node(),
                                             "' a second time (a node fetches a read once)"));
    }
  }
  return absl::OkStatus();
}

absl::Status DistJobs::PeerFetchReads(const PeerCaller& caller,
                                      const peer::v1::FetchReadsRequest& req,
                                      const std::function<bool(const peer::v1::Chunk&)>& send,
                                      const std::function<bool()>& cancelled) {
  const absl::Status who_if_member = peers_->SpeaksFor(caller, req.node(), /*job_member=*/true);
  const absl::Status who_otherwise = peers_->SpeaksFor(caller, req.node());
  const std::string& me = config_.peer_listen;
  const std::string what = ReadsNamed(req);
  const std::shared_ptr<DistJob> dj = Find(req.job_id());
  if (dj == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        me, ": job '", req.job_id(),
        "' is not running here (finished, failed, or never started on this node): a late or "
        "unplanned fetch of ", what));
  }
  std::vector<std::vector<ckpt::SpanRun>> runs;  // each read's spans, once admitted
  auto over = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(dj->mu) {
    return !dj->exec_status.ok() || !dj->violation.ok();
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
  {
    absl::MutexLock lock(&dj->mu);
    // A node of the job (checked again below, once the part is known) keeps
    // its standing if it left the peer_dns answer since it joined.
    const bool member =
        std::find(dj->nodes.begin(), dj->nodes.end(), req.node()) != dj->nodes.end();
    const absl::Status& who = member ? who_if_member : who_otherwise;
    if (!who.ok()) {
      return dj->RefuseLocked(caller, req.node(), absl::StrCat("fetched ", what, ": ", who.message()));
    }
    // The coordinator knows every node that joined: no need to wait for the
    // plan to refuse one that did not.
    if (!member && dj->coordinator && !dj->joins.count(req.node())) {
      return dj->RefuseLocked(caller, req.node(),
                              absl::StrCat("fetched ", what, " as '", req.node(),
                                           "', which is not a node of the job"));
    }
    auto part_known = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(dj->mu) {
      return dj->part_known || over();
    };
    if (!AwaitOrCancel(&dj->mu, absl::Condition(&part_known), absl::Now() + config_.peer_timeout,
                       cancelled)) {
      return WaitFailed(cancelled, absl::StrCat(me, ": job '", req.job_id(),
                                                "' had no plan part within ",
                                                absl::FormatDuration(config_.peer_timeout)));
    }
    CKPT_RETURN_IF_ERROR(ended());
    if (std::find(dj->nodes.begin(), dj->nodes.end(), req.node()) == dj->nodes.end()) {
      return dj->RefuseLocked(caller, req.node(),
                              absl::StrCat("fetched ", what, " as '", req.node(),
                                           "', which is not a node of the job"));
    }
    CKPT_RETURN_IF_ERROR(AdmitFetchLocked(*dj, caller, req, &runs));
  }
  // Each read in the order asked, as soon as this node has it.
  for (int k = 0; k < req.reads_size(); ++k) {
    const peer::v1::FetchReadRequest& r = req.reads(k);
    const uint32_t g = r.read();
    ckpt::RangeView view;
    uint64_t length = 0, xxh3 = 0;
    {
      absl::MutexLock lock(&dj->mu);
      DistJob::Served& served = dj->served[g];  // admitted above; entries are never erased
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(dj->mu) { return served.ready || over(); };
      if (!AwaitOrCancel(&dj->mu, absl::Condition(&ready), absl::Now() + config_.peer_timeout,
                         cancelled)) {
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
        SendRead(view, length, xxh3, r, runs[static_cast<size_t>(k)],
                 config_.testing_corrupt_served, dj->bytes_sent, send);
    if (!sent.ok()) return sent.status();
    absl::MutexLock lock(&dj->mu);
    DistJob::Served& served = dj->served[g];
    if (--served.remaining <= 0) served.view = ckpt::RangeView{};  // unpin
  }
  return absl::OkStatus();
}

}  // namespace ckptd
