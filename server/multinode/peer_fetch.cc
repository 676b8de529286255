#include "server/multinode/peer_fetch.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/base/xxh3.h"
#include "server/multinode/dist_job.h"

namespace ckptd {
namespace {

void* const kTag = reinterpret_cast<void*>(1);  // the one operation in flight

}  // namespace

std::vector<size_t> AssignStreams(const std::vector<StreamRead>& reads, uint64_t lane_bytes,
                                  int max_lanes, uint64_t max_reads, uint64_t max_spans) {
  uint64_t bytes = 0;
  for (const StreamRead& r : reads) bytes += r.bytes;
  const uint64_t lanes = std::clamp<uint64_t>((bytes + std::max<uint64_t>(lane_bytes, 1) - 1) /
                                                  std::max<uint64_t>(lane_bytes, 1),
                                              1, static_cast<uint64_t>(std::max(1, max_lanes)));
  std::vector<size_t> out(reads.size());
  uint64_t segment = 0, in_segment = 0, seg_spans = 0;
  for (size_t k = 0; k < reads.size(); ++k) {
    if (in_segment > 0 &&
        (in_segment + 1 > max_reads || seg_spans + reads[k].spans > max_spans)) {
      ++segment;
      in_segment = 0;
      seg_spans = 0;
    }
    out[k] = static_cast<size_t>(segment * lanes + in_segment % lanes);
    ++in_segment;
    seg_spans += reads[k].spans;
  }
  return out;
}

absl::Status CheckReceivedRead(const uint8_t* data, uint64_t n, uint64_t want,
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

std::shared_ptr<uint8_t> ReceiveBuffers::Get(uint64_t n) {
  n = std::max<uint64_t>(n, 1);
  std::unique_ptr<uint8_t[]> p;
  uint64_t size = n;
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < kept_.size(); ++i) {
      if (kept_[i].first >= n && kept_[i].first / 2 <= n) {  // not more than twice the need
        size = kept_[i].first;
        p = std::move(kept_[i].second);
        kept_.erase(kept_.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
    }
  }
  if (p == nullptr) p.reset(new uint8_t[size]);
  std::weak_ptr<ReceiveBuffers> pool = weak_from_this();
  return std::shared_ptr<uint8_t>(p.release(), [pool, size](uint8_t* q) {
    if (std::shared_ptr<ReceiveBuffers> live = pool.lock()) {
      live->Return(size, q);
    } else {
      delete[] q;
    }
  });
}

void ReceiveBuffers::Return(uint64_t size, uint8_t* p) {
  std::unique_ptr<uint8_t[]> owned(p);
  absl::MutexLock lock(&mu_);
  if (max_kept_ == 0) return;
  if (kept_.size() == max_kept_) kept_.erase(kept_.begin());  // the oldest goes
  kept_.emplace_back(size, std::move(owned));
}

PeerFetch::PeerFetch(std::string peer, std::string me, std::string job_id,
                     std::vector<Want> wants, std::shared_ptr<peer::v1::Peer::Stub> stub,
                     absl::Duration timeout, absl::Time call_deadline,
                     std::shared_ptr<ReceiveBuffers> buffers)
    : peer_(std::move(peer)), me_(std::move(me)), job_id_(std::move(job_id)),
      stub_(std::move(stub)), timeout_(timeout), call_deadline_(call_deadline),
      buffers_(std::move(buffers)) {
  slots_.resize(wants.size());
  for (size_t i = 0; i < wants.size(); ++i) {
    Slot& s = slots_[i];
    s.want = std::move(wants[i]);
    s.expect = s.want.spans.empty() ? s.want.length : ckpt::SpanBytes(s.want.spans);
    if (!s.want.spans.empty()) {
      s.spans = std::make_shared<const std::vector<ckpt::ReadSpan>>(std::move(s.want.spans));
      s.want.spans.clear();
    }
    index_[s.want.read] = i;
  }
}

PeerFetch::~PeerFetch() {
  if (live_) {
    ctx_.TryCancel();
    grpc::Status ignored;
    call_->Finish(&ignored, kTag);
    void* tag;
    bool ok;
    cq_.Next(&tag, &ok);  // a cancelled call finishes at once
  }
  cq_.Shutdown();
  void* tag;
  bool ok;
  while (cq_.Next(&tag, &ok)) {
  }
}

std::string PeerFetch::What(const Slot& s) const {
  return absl::StrCat("read ", s.want.read, " (", s.want.file, " bytes [", s.want.offset, ", ",
                      s.want.offset + s.want.length, ")",
                      s.spans == nullptr ? "" : absl::StrCat(", ", s.spans->size(), " spans"),
                      ") from peer ", peer_);
}

absl::StatusOr<ckpt::RangeView> PeerFetch::Take(
    uint32_t read, const std::function<absl::Status(const uint8_t*)>& verify) {
  auto it = index_.find(read);
  if (it == index_.end()) {
    return absl::InternalError(absl::StrCat("read ", read, " is not fetched from ", peer_));
  }
  Slot& s = slots_[it->second];
  {
    absl::MutexLock lock(&mu_);
    while (!s.done) {
      if (!failed_.ok()) return failed_;
      if (!driving_) {
        DriveLocked();
        continue;
      }
      // Another thread is taking a chunk off the stream: at most
      // peer_timeout (its own wait's bound), then this one may.
      auto moved = [this, &s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !driving_ || s.done || !failed_.ok();
      };
      if (!mu_.AwaitWithDeadline(absl::Condition(&moved),
                                 absl::Now() + timeout_ + absl::Seconds(5))) {
        return absl::DeadlineExceededError(absl::StrCat(
            What(s), ": the stream did not move for ", absl::FormatDuration(timeout_)));
      }
    }
    if (s.taken) return absl::InternalError(absl::StrCat(What(s), " taken twice"));
    s.taken = true;
  }
  std::shared_ptr<uint8_t> buf = std::move(s.buf);  // freed once the executor is done with it
  if (s.spans == nullptr) {
    CKPT_RETURN_IF_ERROR(CheckReceivedRead(buf.get(), s.want.length, s.xxh3, What(s), verify));
  }
  return ckpt::RangeView{buf.get(), buf, false, s.spans};
}

void PeerFetch::DriveLocked() {
  driving_ = true;
  mu_.Unlock();
  absl::Status st = Step();
  mu_.Lock();
  driving_ = false;
  if (!st.ok() && failed_.ok()) failed_ = st;
}

bool PeerFetch::Await(absl::Time deadline, bool* ok) {
  void* tag = nullptr;
  if (cq_.AsyncNext(&tag, ok, ToChrono(deadline)) == grpc::CompletionQueue::GOT_EVENT) return true;
  ctx_.TryCancel();
  cq_.Next(&tag, ok);  // the cancelled operation completes at once
  return false;
}

absl::Status PeerFetch::Start() {
  peer::v1::FetchReadsRequest req;
  req.set_job_id(job_id_);
  req.set_node(me_);
  for (Slot& s : slots_) {
    peer::v1::FetchReadRequest* r = req.add_reads();
    r->set_read(s.want.read);
    // Packed: a column slice is one run per read, not a message per row.
    if (s.spans == nullptr) continue;
    for (const ckpt::SpanRun& run : ckpt::PackSpans(*s.spans)) {
      r->add_span_runs(run.begin);
      r->add_span_runs(run.length);
      r->add_span_runs(run.stride);
      r->add_span_runs(run.count);
    }
  }
  started_ = true;
  ctx_.set_deadline(ToChrono(call_deadline_));
  call_ = stub_->PrepareAsyncFetchReads(&ctx_, req, &cq_);
  call_->StartCall(kTag);
  live_ = true;
  bool ok = false;
  if (!Await(absl::Now() + timeout_, &ok)) {
    return Ended(absl::StrCat("no answer within ", absl::FormatDuration(timeout_)));
  }
  if (!ok) return Ended("the call did not start");
  return absl::OkStatus();
}

absl::Status PeerFetch::Ended(const std::string& why) {
  grpc::Status s;
  if (live_) {
    call_->Finish(&s, kTag);
    void* tag;
    bool ok;
    cq_.Next(&tag, &ok);  // the stream is over: its status is there
    live_ = false;
  }
  const Slot& at = slots_[std::min(cur_, slots_.size() - 1)];
  const auto code =
      s.ok() ? absl::StatusCode::kUnavailable : static_cast<absl::StatusCode>(s.error_code());
  return absl::Status(
      code == absl::StatusCode::kPermissionDenied ? code : absl::StatusCode::kUnavailable,
      absl::StrCat("peer ", peer_, " failed to send ", at.want.file, " bytes [", at.want.offset,
                   ", ", at.want.offset + at.want.length, ") (got ", at.got, " of ", at.expect,
                   "): ", s.ok() ? why : s.error_message()));
}

absl::Status PeerFetch::Step() {
  if (!started_) CKPT_RETURN_IF_ERROR(Start());
  if (!live_) return absl::InternalError(absl::StrCat("the stream from ", peer_, " is over"));
  call_->Read(&chunk_, kTag);
  bool ok = false;
  if (!Await(absl::Now() + timeout_, &ok)) {
    return Ended(absl::StrCat("nothing arrived for ", absl::FormatDuration(timeout_)));
  }
  if (!ok) return Ended("stream ended early");
  return Place(chunk_);
}

absl::Status PeerFetch::Place(const peer::v1::Chunk& c) {
  if (cur_ >= slots_.size()) {
    ctx_.TryCancel();
    return absl::DataLossError(absl::StrCat("peer ", peer_, " sent more than the ",
                                            slots_.size(), " reads asked for"));
  }
  Slot& s = slots_[cur_];
  const bool whole = s.spans == nullptr;
  const std::string& d = c.data();
  // (Only an empty read comes in an empty chunk: a stream of empty chunks
  // would never end.)
  if (c.read() != s.want.read || c.offset() != s.got || d.size() > s.expect - s.got ||
      (d.empty() && s.expect > 0) || (whole ? c.has_xxh3() == s.first : !c.has_xxh3())) {
    ctx_.TryCancel();
    return absl::DataLossError(absl::StrCat(
        What(s), ": a chunk of another read, out of order, empty, too long or without its xxh3"));
  }
  if (!s.first) {
    // Written in full before it is read: no need to clear it.
    s.buf = buffers_->Get(s.expect);
  }
  if (whole) {
    if (!s.first) s.xxh3 = c.xxh3();
  } else {
    const uint64_t have = XXH3_64bits(d.data(), d.size());
    if (have != c.xxh3()) {
      ctx_.TryCancel();
      return absl::DataLossError(absl::StrCat(
          What(s), ": the bytes received at ", s.got, " hash to xxh3 ",
          absl::Hex(have, absl::kZeroPad16), ", the peer sent ",
          absl::Hex(c.xxh3(), absl::kZeroPad16),
          " (altered in transit or by the peer); none of it was delivered"));
    }
  }
  // The read, or its spans back to back, as sent (s.got + d.size() <= s.expect).
  std::memcpy(s.buf.get() + s.got, d.data(), d.size());
  s.got += d.size();
  s.first = true;
  received_ += d.size();
  if (s.got == s.expect) {
    ++cur_;
    absl::MutexLock lock(&mu_);
    s.done = true;
  }
  return absl::OkStatus();
}

}  // namespace ckptd
