// The reads of a multi-node load's part that other nodes make (peer fetches
// over gRPC, or NCCL links between GPU nodes), and this node's own reads
// kept for the peers that need them: DistJobs::PeerReadsFor, the
// RemoteReads the load runs a multi-node part on.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <optional>
#include <set>

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/base/xxh3.h"
#include "core/exec/executor.h"
#include "server/multinode/dist_jobs.h"
#include "server/multinode/peer_fetch.h"
#include "server/multinode/peer_nccl.h"
#include "server/peer/peer_plane.h"

namespace ckptd {
namespace {

// A peer's reads come in one stream per this many bytes (up to the I/O
// threads; config testing_peer_lane_bytes in tests).
constexpr uint64_t kLaneBytes = 64ull << 20;

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
             std::map<uint32_t, PeerFetch::Want> wants, PublishFn publish,
             StubFn stub, std::function<absl::Status()> aborted, absl::Duration timeout,
             absl::Time call_deadline, int max_lanes, uint64_t lane_bytes)
      : me_(std::move(me)), job_id_(std::move(job_id)), storage_(storage),
        global_index_(std::move(global_index)), reader_(std::move(reader)),
        wants_(std::move(wants)), publish_(std::move(publish)),
        stub_(std::move(stub)), aborted_(std::move(aborted)), timeout_(timeout),
        call_deadline_(call_deadline),
        buffers_(std::make_shared<ReceiveBuffers>(2 * static_cast<size_t>(std::max(1, max_lanes)) + 2)) {
    // Per peer, the stream each read comes in (AssignStreams).
    std::map<std::string, std::pair<std::vector<uint32_t>, std::vector<StreamRead>>> by_peer;
    for (const auto& [g, w] : wants_) {
      auto who = reader_.find(g);
      if (who == reader_.end()) continue;
      auto& [ids, reads] = by_peer[who->second];
      ids.push_back(g);
      reads.push_back({w.spans.empty() ? w.length : ckpt::SpanBytes(w.spans),
                       std::max<uint64_t>(w.spans.size(), 1)});
    }
    for (const auto& [peer, p] : by_peer) {
      const std::vector<size_t> lanes = AssignStreams(p.second, lane_bytes, max_lanes);
      std::set<size_t> used;
      for (size_t k = 0; k < lanes.size(); ++k) {
        lane_[p.first[k]] = lanes[k];
        lane_reads_[{peer, lanes[k]}].push_back(p.first[k]);
        used.insert(lanes[k]);
      }
      streams_ += used.size();
    }
    peers_ = by_peer.size();
  }

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
    if (links_ != nullptr && links_->Receives(g)) {
      if (auto b = links_->Take(g, absl::Now() + timeout_)) {
        const std::string what = absl::StrCat("read ", g, " (", file, " bytes [", offset, ", ",
                                              offset + n, ")) from peer ", reader, " over NCCL");
        CKPT_RETURN_IF_ERROR(CheckReceivedRead(b->view.data, n, b->xxh3, what, verify));
        received_ += n;
        peer_read_length_ += n;
        return b->view;
      }  // links failed: gRPC below
    }
    absl::StatusOr<ckpt::RangeView> v = FetchFrom(reader, g)->Take(g, verify);
    if (v.ok()) peer_read_length_ += n;
    return v;
  }

  // Bytes received from peers (streams and NCCL links).
  uint64_t received() const ABSL_LOCKS_EXCLUDED(fetches_mu_) {
    uint64_t n = received_.load();
    absl::MutexLock lock(&fetches_mu_);
    for (const auto& [key, f] : fetches_) n += f->received();
    return n;
  }
  // The whole length of the reads that came from peers (whole or by spans:
  // what the executor counts as not from storage for them).
  uint64_t peer_read_length() const { return peer_read_length_.load(); }
  void set_links(NcclTransfers* links) { links_ = links; }
  // The reads peers make, the peers, and the FetchReads streams for them.
  size_t fetched_reads() const { return wants_.size(); }
  size_t peers() const { return peers_; }
  size_t streams() const { return streams_; }
  void set_storage(ckpt::RangeSource* storage) { storage_ = storage; }

 private:
  size_t LaneOf(uint32_t g) const {
    auto it = lane_.find(g);
    return it == lane_.end() ? 0 : it->second;
  }

  // The stream `g` comes over from `reader`: one per lane of the peer with
  // the lane's reads; in NCCL jobs (where gRPC carries a read only when its
  // link failed) one per read.
  PeerFetch* FetchFrom(const std::string& reader, uint32_t g) ABSL_LOCKS_EXCLUDED(fetches_mu_) {
    const size_t lane = LaneOf(g);
    const std::string key =
        links_ != nullptr ? absl::StrCat(reader, " read ", g) : absl::StrCat(reader, " lane ", lane);
    absl::MutexLock lock(&fetches_mu_);
    std::unique_ptr<PeerFetch>& f = fetches_[key];
    if (f == nullptr) {
      std::vector<PeerFetch::Want> wants;
      if (links_ != nullptr) {
        if (auto w = wants_.find(g); w != wants_.end()) wants.push_back(w->second);
      } else if (auto ids = lane_reads_.find({reader, lane}); ids != lane_reads_.end()) {
        for (uint32_t id : ids->second) wants.push_back(wants_.at(id));
      }
      f = std::make_unique<PeerFetch>(reader, me_, job_id_, std::move(wants), stub_(reader),
                                      timeout_, call_deadline_, buffers_);
    }
    return f.get();
  }


  NcclTransfers* links_ = nullptr;
  const std::string me_, job_id_;
  ckpt::RangeSource* storage_;
  const std::map<std::pair<std::string, uint64_t>, uint32_t> global_index_;
  const std::map<uint32_t, std::string> reader_;
  const std::map<uint32_t, PeerFetch::Want> wants_;  // the reads peers make
  std::map<uint32_t, size_t> lane_;                  // each one's lane (constructor)
  // (reader, lane) -> the reads that stream brings, in order (constructor).
  std::map<std::pair<std::string, size_t>, std::vector<uint32_t>> lane_reads_;
  size_t peers_ = 0, streams_ = 0;
  const PublishFn publish_;
  const StubFn stub_;
  const std::function<absl::Status()> aborted_;
  const absl::Duration timeout_;
  const absl::Time call_deadline_;  // the job's (DistJob::outcome_deadline)
  // Receive buffers, recycled over the job's streams (the I/O threads' worth).
  const std::shared_ptr<ReceiveBuffers> buffers_;
  std::atomic<uint64_t> received_{0};  // over NCCL links
  std::atomic<uint64_t> peer_read_length_{0};
  mutable absl::Mutex fetches_mu_;
  std::map<std::string, std::unique_ptr<PeerFetch>> fetches_ ABSL_GUARDED_BY(fetches_mu_);
};

}  // namespace

// A multi-node part's reads that other nodes make: fetched over gRPC or
// received on NCCL links, and this node's own reads published for the peers
// that need them (DistJob::served).
class PeerReads final : public RemoteReads {
 public:
  PeerReads(DistJobs* d, std::shared_ptr<DistJob> dj, const peer::v1::PlanPart& part,
            const std::string& me, std::map<std::pair<std::string, uint64_t>, uint32_t> global_index,
            std::map<uint32_t, std::string> reader, std::map<uint32_t, PeerFetch::Want> wants)
      : d_(d), dj_(std::move(dj)), part_(part), me_(me),
        source_(me, dj_->id, nullptr, std::move(global_index), std::move(reader),
                std::move(wants),
                [this](uint32_t g, const ckpt::RangeView& v, uint64_t xxh3) { Publish(g, v, xxh3); },
                [d](const std::string& a) { return d->peers_->Stub(a); },
                [dj = dj_]() -> absl::Status {
                  absl::MutexLock lock(&dj->mu);
                  return dj->violation;
                },
                d->config_.peer_timeout, dj_->outcome_deadline, d->config_.io_threads,
                d->config_.testing_peer_lane_bytes > 0 ? d->config_.testing_peer_lane_bytes
                                                       : kLaneBytes) {}

  ckpt::RangeSource* Wrap(ckpt::RangeSource* storage) override {
    source_.set_storage(storage);
    const DaemonConfig& c = d_->config_;
    nccl_ = StartNcclTransfers(
        d_->gpu_, part_, me_, c.nccl_device, c.peer_timeout,
        std::min(c.nccl_connect_timeout, c.peer_timeout),
        [this](uint32_t g, absl::Time deadline) { return Served(g, deadline); });
    source_.set_links(nccl_.get());
    spdlog::info("multi-node job={}: {} reads from {} peers {}", dj_->id, source_.fetched_reads(),
                 source_.peers(),
                 nccl_ != nullptr ? std::string("over NCCL links (gRPC where one fails)")
                                  : absl::StrCat("in ", source_.streams(), " FetchReads streams"));
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
  uint64_t bytes_sent() const override { return dj_->bytes_sent.load(); }

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

std::unique_ptr<RemoteReads> DistJobs::PeerReadsFor(const std::shared_ptr<DistJob>& dj,
                                                    const peer::v1::PlanPart& part,
                                                    LocalPart& mine) {
  const std::string& me = config_.peer_listen;
  std::map<uint32_t, PeerFetch::Want> wants;  // the reads peers make, what of each
  for (size_t l = 0; l < mine.plan.reads.size(); ++l) {
    const uint32_t g = mine.global_read[l];
    if (mine.reader[g] == me) continue;
    const ckpt::ReadRange& rr = mine.plan.reads[l];
    PeerFetch::Want& w = wants[g];
    w.read = g;
    w.file = mine.plan.files[rr.file];
    w.offset = rr.offset;
    w.length = rr.length;
    auto spans = mine.fetch_spans.find(g);
    if (spans != mine.fetch_spans.end()) w.spans = std::move(spans->second);
  }
  return std::make_unique<PeerReads>(this, dj, part, me, std::move(mine.global_index),
                                     std::move(mine.reader), std::move(wants));
}

}  // namespace ckptd
