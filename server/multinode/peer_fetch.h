// The reads one node of a multi-node load fetches from one peer, over one
// FetchReads stream (proto/peer.proto): one call per pair of nodes per job
// instead of one per read, which is what a job over many nodes pays for
// (docs/multi-node.md "At scale").
//
// The request names every read in the order the executor claims them
// (ascending ids); the peer sends each as soon as it has read it. The
// stream has no thread of its own: a thread that needs a read not yet here
// takes the next chunk off the stream (the others wait for it), so a read
// arrives no earlier than the reads before it are being fetched and at most
// the reads the executor's threads are working on are held here. Every wait
// is bounded by peer_timeout: a peer that sends nothing for that long
// cancels the stream and fails its reads, naming the peer.
//
// A read's bytes reach its fetcher only once checked: whole, against the
// xxh3 the peer took as it read them and then the plan's checksums; by
// spans, each chunk against its own xxh3.
//
//   PeerFetch f(peer, me, job, wants, stub, peer_timeout, job_deadline, buffers);
//   absl::StatusOr<ckpt::RangeView> v = f.Take(read, verify);  // any thread
//
// Thread-safe.
#ifndef CKPTD_SERVER_MULTINODE_PEER_FETCH_H_
#define CKPTD_SERVER_MULTINODE_PEER_FETCH_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/exec/executor.h"
#include "core/plan/planner.h"
#include "proto/peer.grpc.pb.h"
#include "server/multinode/plan_codec.h"

namespace ckptd {

// Spans one FetchReads stream asks for at most (its request stays a few
// MiB; the peer service takes messages of up to 256 MiB).
inline constexpr uint64_t kMaxStreamSpans = 1 << 20;

// Which stream each read a node fetches from one peer comes in. `reads`: in
// the order the executor takes them, each with its bytes and span count.
// Consecutive reads form segments of at most `max_reads` reads and
// `max_spans` spans (a stream's limits; one segment unless the peer sends
// very many reads), and each segment's reads are dealt round-robin over
// `lanes` streams, one per `lane_bytes` of the peer's bytes, at most
// `max_lanes` (the I/O threads: a large transfer between two nodes is then
// not held to one stream's pace). Stream i is segment i / lanes.
struct StreamRead {
  uint64_t bytes = 0;
  uint64_t spans = 0;
};
std::vector<size_t> AssignStreams(const std::vector<StreamRead>& reads, uint64_t lane_bytes,
                                  int max_lanes, uint64_t max_reads = kMaxFetchReads,
                                  uint64_t max_spans = kMaxStreamSpans);

// A whole read received from a peer (`n` bytes at `data`), checked against
// the xxh3 the peer took as it read it (`want`), then against the plan's
// checksums (`verify`, may be empty): DATA_LOSS, or verify's error, naming
// `what`.
absl::Status CheckReceivedRead(const uint8_t* data, uint64_t n, uint64_t want,
                               const std::string& what,
                               const std::function<absl::Status(const uint8_t*)>& verify);

// Receive buffers kept for the next reads of one node's fetch streams in a
// job (a fresh buffer faults in every page it is given). A buffer goes back
// when the executor lets its read go; the latest
// `max_kept` are kept (what the I/O threads cycle through); the others, and
// all once the last holder lets go, are freed. Thread-safe.
class ReceiveBuffers : public std::enable_shared_from_this<ReceiveBuffers> {
 public:
  explicit ReceiveBuffers(size_t max_kept) : max_kept_(max_kept) {}
  // At least `n` bytes (their contents: whatever a read before left).
  std::shared_ptr<uint8_t> Get(uint64_t n) ABSL_LOCKS_EXCLUDED(mu_);
  // Buffers waiting for a read.
  size_t kept() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return kept_.size();
  }

 private:
  void Return(uint64_t size, uint8_t* p) ABSL_LOCKS_EXCLUDED(mu_);

  const size_t max_kept_;
  absl::Mutex mu_;
  std::vector<std::pair<uint64_t, std::unique_ptr<uint8_t[]>>> kept_ ABSL_GUARDED_BY(mu_);
};

class PeerFetch {
 public:
  struct Want {
    uint32_t read = 0;  // the read's id in the job
    std::string file;   // where it is (for messages)
    uint64_t offset = 0;
    uint64_t length = 0;
    std::vector<ckpt::ReadSpan> spans;  // the bytes wanted; empty: the whole read
  };

  // `timeout`: the longest wait for a chunk (peer_timeout); `call_deadline`:
  // when the call ends at the latest (the job's own bound, so a fetching node
  // that stopped never holds the serving node's call open).
  // `buffers` supplies the receive buffers.
  PeerFetch(std::string peer, std::string me, std::string job_id, std::vector<Want> wants,
            std::shared_ptr<peer::v1::Peer::Stub> stub, absl::Duration timeout,
            absl::Time call_deadline, std::shared_ptr<ReceiveBuffers> buffers);
  ~PeerFetch();  // cancels a stream still open
  PeerFetch(const PeerFetch&) = delete;
  PeerFetch& operator=(const PeerFetch&) = delete;

  // Read `read`'s bytes (one of the wants, once): the whole read, or its
  // wanted spans back to back as they came (RangeView::spans: the executor
  // copies from them as they are, with no buffer of the read's length whose
  // every page a column slice would touch). `verify` (may be empty) checks a
  // whole read's bytes against the plan's checksums.
  absl::StatusOr<ckpt::RangeView> Take(uint32_t read,
                                       const std::function<absl::Status(const uint8_t*)>& verify)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Bytes received so far (the spans', or the whole reads').
  uint64_t received() const { return received_.load(); }

 private:
  struct Slot {
    Want want;  // its spans moved to `spans`
    std::shared_ptr<const std::vector<ckpt::ReadSpan>> spans;  // null: the whole read
    uint64_t expect = 0;  // bytes the stream carries for it
    std::shared_ptr<uint8_t> buf;
    uint64_t got = 0;
    bool first = false;    // a chunk arrived
    uint64_t xxh3 = 0;     // whole: the read's, from its first chunk
    bool done = false;     // ABSL_GUARDED_BY(mu_) once the stream started
    bool taken = false;    // ABSL_GUARDED_BY(mu_)
  };
  // The taking thread moves the stream on by one chunk, unlocked.
  void DriveLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One chunk off the stream into its slot (the driving thread only).
  absl::Status Step() ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Start();
  absl::Status Place(const peer::v1::Chunk& c) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits for the one operation in flight; false when `deadline` passed
  // first (the call is then cancelled and the operation drained).
  bool Await(absl::Time deadline, bool* ok);
  // The stream ended (or was cancelled): its status, as an error naming the
  // read it was on.
  absl::Status Ended(const std::string& why);
  std::string What(const Slot& s) const;

  const std::string peer_, me_, job_id_;
  const std::shared_ptr<peer::v1::Peer::Stub> stub_;
  const absl::Duration timeout_;
  const absl::Time call_deadline_;
  const std::shared_ptr<ReceiveBuffers> buffers_;
  std::vector<Slot> slots_;            // in stream order; never resized
  std::map<uint32_t, size_t> index_;   // read id -> slot
  std::atomic<uint64_t> received_{0};

  // The driving thread's own (one at a time, under driving_).
  grpc::ClientContext ctx_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::ClientAsyncReader<peer::v1::Chunk>> call_;
  peer::v1::Chunk chunk_;
  bool started_ = false;
  bool live_ = false;  // started and not finished
  size_t cur_ = 0;     // the slot the next chunk is for

  absl::Mutex mu_;
  bool driving_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_MULTINODE_PEER_FETCH_H_
