// The reads of a multi-node load's part that other nodes make (peer fetches
// over gRPC, or NCCL links between GPU nodes), and this node's own reads
// kept for the peers that need them: DistJobs::PeerReadsFor, the
// RemoteReads the load runs a multi-node part on.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <optional>

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/base/xxh3.h"
#include "core/exec/executor.h"
#include "server/multinode/dist_jobs.h"
#include "server/multinode/peer_nccl.h"
#include "server/peer/peer_plane.h"

namespace ckptd {
namespace {

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
             std::map<uint32_t, std::string> reader,
             std::map<uint32_t, std::vector<ckpt::ReadSpan>> fetch_spans, PublishFn publish,
             StubFn stub, std::function<absl::Status()> aborted, absl::Duration timeout)
      : me_(std::move(me)), job_id_(std::move(job_id)), storage_(storage),
        global_index_(std::move(global_index)), reader_(std::move(reader)),
        fetch_spans_(std::move(fetch_spans)), publish_(std::move(publish)),
        stub_(std::move(stub)), aborted_(std::move(aborted)), timeout_(timeout) {}

  absl::StatusOr<ckpt::RangeView> Fetch(
      const std::string& file, uint64_t offset, uint64_t n, std::vector<uint8_t>& scratch,
      const std::function<absl::Status(const uint8_t*)>& verify) override {
    CKPT_RETURN_IF_ERROR(aborted_());  // an authorization violation ends the job here
    auto it = global_index_.find({file, offset});
    if (it == global_index_.end()) {
      return absl::InternalError(absl::StrCat("no planned read of ", file, " at ", offset));
    }
    const uint32_t g = it->second;
    auto who = reader_.find(g);
    if (who == reader_.end()) return absl::InternalError(absl::StrCat("read ", g, " has no reader"));
    const std::string& reader = who->second;
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
        Arrived(n, n);
        return b->view;
      }  // links failed: gRPC below
    }
    auto spans = fetch_spans_.find(g);
    if (spans != fetch_spans_.end()) {
      return FetchSpans(g, reader, file, offset, n, spans->second, scratch);
    }
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    auto stream = stub_(reader)->FetchRead(&ctx, Request(g));
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
    if (!s.ok() || got != n) return SendFailed(s, reader, file, offset, n, got, n);
    if (!xxh3) return absl::DataLossError(absl::StrCat(what, ": sent without its checksum"));
    CKPT_RETURN_IF_ERROR(Check(scratch.data(), n, *xxh3, what, verify));
    Arrived(n, n);
    return ckpt::RangeView{scratch.data(), nullptr, false};
  }

  uint64_t received() const { return received_.load(); }
  // The whole length of the reads that came from peers (whole or by spans:
  // what the executor counts as not from storage for them).
  uint64_t peer_read_length() const { return peer_read_length_.load(); }
  void set_links(NcclTransfers* links) { links_ = links; }
  void set_storage(ckpt::RangeSource* storage) { storage_ = storage; }

 private:
  // A call to a peer: bounded by peer_timeout.
  void SetDeadline(grpc::ClientContext* ctx) const {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout_)));
  }

  // A read of `length` bytes came from a peer, `moved` of them over the wire
  // (fewer when fetched by spans).
  void Arrived(uint64_t moved, uint64_t length) {
    received_ += moved;
    peer_read_length_ += length;
  }

  // This node's fetch of read `g` of the job.
  peer::v1::FetchReadRequest Request(uint32_t g) const {
    peer::v1::FetchReadRequest req;
    req.set_job_id(job_id_);
    req.set_read(g);
    req.set_node(me_);
    return req;
  }

  // Only the bytes of read `g` (`n` at `offset` of `file`, made by
  // `reader`) the ranks here copy: `spans`, cut and sent one after another by the peer, each chunk
  // with the xxh3 of its own bytes, placed at their offsets in `scratch`.
  // The rest of `scratch` is never read (the copies touch only the spans),
  // and the plan's checksums, over whole blocks, are not checked here: the
  // peer checked them as it read (and checks its xxh3 against them).
  absl::StatusOr<ckpt::RangeView> FetchSpans(uint32_t g, const std::string& reader,
                                             const std::string& file, uint64_t offset, uint64_t n,
                                             const std::vector<ckpt::ReadSpan>& spans,
                                             std::vector<uint8_t>& scratch) {
    const std::string what = absl::StrCat("read ", g, " (", file, " bytes [", offset, ", ",
                                          offset + n, "), ", spans.size(),
                                          " spans) from peer ", reader);
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    peer::v1::FetchReadRequest req = Request(g);
    uint64_t want = 0;
    for (const ckpt::ReadSpan& sp : spans) {
      peer::v1::Range* r = req.add_spans();
      r->set_begin(static_cast<int64_t>(sp.begin));
      r->set_end(static_cast<int64_t>(sp.end));
      want += sp.end - sp.begin;
    }
    if (scratch.size() < n) scratch.resize(n);
    auto stream = stub_(reader)->FetchRead(&ctx, req);
    uint64_t got = 0;  // position in the spans' bytes
    size_t span = 0;
    uint64_t in_span = 0;  // bytes of spans[span] placed so far
    peer::v1::Chunk c;
    while (stream->Read(&c)) {
      if (c.offset() != got || c.data().size() > want - got || !c.has_xxh3()) {
        ctx.TryCancel();
        return absl::DataLossError(
            absl::StrCat(what, ": a chunk out of order, too long or without its xxh3"));
      }
      const uint64_t have = XXH3_64bits(c.data().data(), c.data().size());
      if (have != c.xxh3()) {
        ctx.TryCancel();
        return absl::DataLossError(absl::StrCat(
            what, ": the bytes received at ", got, " hash to xxh3 ",
            absl::Hex(have, absl::kZeroPad16), ", the peer sent ",
            absl::Hex(c.xxh3(), absl::kZeroPad16),
            " (altered in transit or by the peer); none of it was delivered"));
      }
      const char* p = c.data().data();
      uint64_t left = c.data().size();
      while (left > 0) {  // got + left <= want: spans remain
        const ckpt::ReadSpan& sp = spans[span];
        const uint64_t k = std::min(left, sp.end - sp.begin - in_span);
        std::memcpy(scratch.data() + sp.begin + in_span, p, k);
        p += k;
        left -= k;
        in_span += k;
        if (in_span == sp.end - sp.begin) {
          ++span;
          in_span = 0;
        }
      }
      got += c.data().size();
    }
    grpc::Status s = stream->Finish();
    if (!s.ok() || got != want) return SendFailed(s, reader, file, offset, n, got, want);
    Arrived(want, n);
    return ckpt::RangeView{scratch.data(), nullptr, false};
  }

  // A fetch from `reader` that ended with `s` after `got` of `want` bytes.
  static absl::Status SendFailed(const grpc::Status& s, const std::string& reader,
                                 const std::string& file, uint64_t offset, uint64_t n,
                                 uint64_t got, uint64_t want) {
    const auto code =
        s.ok() ? absl::StatusCode::kUnavailable : static_cast<absl::StatusCode>(s.error_code());
    return absl::Status(
        code == absl::StatusCode::kPermissionDenied ? code : absl::StatusCode::kUnavailable,
        absl::StrCat("peer ", reader, " failed to send ", file, " bytes [", offset, ", ",
                     offset + n, ") (got ", got, " of ", want, "): ",
                     s.ok() ? "stream ended early" : s.error_message()));
  }

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
  const std::map<uint32_t, std::string> reader_;
  const std::map<uint32_t, std::vector<ckpt::ReadSpan>> fetch_spans_;
  const PublishFn publish_;
  const StubFn stub_;
  const std::function<absl::Status()> aborted_;
  const absl::Duration timeout_;
  std::atomic<uint64_t> received_{0};
  std::atomic<uint64_t> peer_read_length_{0};
};

}  // namespace

// A multi-node part's reads that other nodes make: fetched over gRPC or
// received on NCCL links, and this node's own reads published for the peers
// that need them (DistJob::served).
class PeerReads final : public RemoteReads {
 public:
  PeerReads(DistJobs* d, std::shared_ptr<DistJob> dj, const peer::v1::PlanPart& part,
            const std::string& me, std::map<std::pair<std::string, uint64_t>, uint32_t> global_index,
            std::map<uint32_t, std::string> reader,
            std::map<uint32_t, std::vector<ckpt::ReadSpan>> fetch_spans)
      : d_(d), dj_(std::move(dj)), part_(part), me_(me),
        source_(me, dj_->id, nullptr, std::move(global_index), std::move(reader),
                std::move(fetch_spans),
                [this](uint32_t g, const ckpt::RangeView& v, uint64_t xxh3) { Publish(g, v, xxh3); },
                [d](const std::string& a) { return d->peers_->Stub(a); },
                [dj = dj_]() -> absl::Status {
                  absl::MutexLock lock(&dj->mu);
                  return dj->violation;
                },
                d->config_.peer_timeout) {}

  ckpt::RangeSource* Wrap(ckpt::RangeSource* storage) override {
    source_.set_storage(storage);
    const DaemonConfig& c = d_->config_;
    nccl_ = StartNcclTransfers(
        d_->gpu_, part_, me_, c.nccl_device, c.peer_timeout,
        std::min(c.nccl_connect_timeout, c.peer_timeout),
        [this](uint32_t g, absl::Time deadline) { return Served(g, deadline); });
    source_.set_links(nccl_.get());
    return &source_;
  }

  void Ended(const absl::Status& status) override {
    if (nccl_ == nullptr) return;
    if (nccl_->connect_failed()) {
      // Remembered: this node's next jobs with these peers stay on gRPC.
      d_->MarkNcclUnreachable({part_.nodes().begin(), part_.nodes().end()});
    }
    // Our own part is done; peers may still be receiving our reads.
    if (status.ok()) {
      nccl_->Finish(absl::Now() + d_->config_.peer_timeout).IgnoreError();  // logged; gRPC serves
    } else {
      nccl_->Abort();
    }
  }

  uint64_t bytes_received() const override { return source_.received(); }
  uint64_t peer_read_length() const override { return source_.peer_read_length(); }
  uint64_t bytes_sent() const override {
    absl::MutexLock lock(&dj_->mu);
    return dj_->bytes_sent;
  }

 private:
  // One of this node's reads, verified: kept for the peers that need it.
  void Publish(uint32_t g, const ckpt::RangeView& v, uint64_t xxh3) {
    absl::MutexLock lock(&dj_->mu);
    auto it = dj_->served.find(g);
    if (it == dj_->served.end()) return;
    it->second.view = v;
    it->second.xxh3 = xxh3;
    it->second.ready = true;
  }

  // What the NCCL links send for read `g`, once this node has it.
  absl::StatusOr<NcclTransfers::Bytes> Served(uint32_t g, absl::Time deadline) {
    absl::MutexLock lock(&dj_->mu);
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(dj_->mu) {
      auto it = dj_->served.find(g);
      return it == dj_->served.end() || it->second.ready || !dj_->exec_status.ok() ||
             !dj_->violation.ok();
    };
    dj_->mu.AwaitWithDeadline(absl::Condition(&ready), deadline);
    auto it = dj_->served.find(g);
    if (it == dj_->served.end() || !it->second.ready || it->second.view.data == nullptr) {
      return absl::UnavailableError(absl::StrCat("read ", g, " is not available to send"));
    }
    NcclTransfers::Bytes b{it->second.view, it->second.xxh3};
    dj_->bytes_sent += it->second.length;
    if (d_->config_.testing_corrupt_served && it->second.length > 0) {
      // Fault injection for tests only: a flipped byte on the link.
      auto copy = std::make_shared<std::vector<uint8_t>>(b.view.data,
                                                         b.view.data + it->second.length);
      (*copy)[0] ^= 0x01;
      b.view = ckpt::RangeView{copy->data(), copy, false};
    }
    return b;
  }

  DistJobs* const d_;
  const std::shared_ptr<DistJob> dj_;
  const peer::v1::PlanPart& part_;
  const std::string me_;
  DistSource source_;
  std::unique_ptr<NcclTransfers> nccl_;
};

std::unique_ptr<RemoteReads> DistJobs::PeerReadsFor(
    const std::shared_ptr<DistJob>& dj, const peer::v1::PlanPart& part,
    std::map<std::pair<std::string, uint64_t>, uint32_t> global_index,
    std::map<uint32_t, std::string> reader, std::map<uint32_t, std::vector<ckpt::ReadSpan>> fetch_spans) {
  return std::make_unique<PeerReads>(this, dj, part, config_.peer_listen, std::move(global_index),
                                     std::move(reader), std::move(fetch_spans));
}

}  // namespace ckptd
