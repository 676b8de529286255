// A job of this node and its ranks: what the registry (registry.h) holds,
// the load and save runners fill and each rank's RPC thread waits on.
//
// A job's identity (kind ... expected) and a slot's request, targets and
// timing are set before they are registered and read-only after; each
// object's mutex guards the rest (ABSL_GUARDED_BY). Lock order: Job::mu
// before RankSlot::mu; Job::abort_mu is never held with Job::mu.
#ifndef CKPTD_SERVER_JOBS_JOB_H_
#define CKPTD_SERVER_JOBS_JOB_H_

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/plan/planner.h"
#include "proto/ckpt.pb.h"
#include "server/delivery/destination.h"
#include "server/save/save_buffer.h"

namespace ckptd {

enum class JobKind { kLoad, kSave };

// One rank's call in a job. Everything but the outcome is set before the
// slot is registered and read-only after, except the rank's destination,
// save_request and save_charge: the job's runner uses them (an asynchronous
// save's staging rewrites the first two) once the job runs, the rank's
// thread again once it is done.
struct RankSlot {
  v1::LoadRequest request;
  v1::SaveRequest save_request;  // Save jobs
  ckpt::RankTargets targets;
  // Where the rank's tensors go (shm, stream, process_memory, cuda_ipc);
  // an asynchronous save hands it to its pending save.
  std::unique_ptr<Destination> destination;
  std::function<bool()> cancelled;
  absl::Time registered;
  std::chrono::steady_clock::time_point start;
  // Asynchronous saves: the save_buffer bytes this rank holds once staged
  // (its handed-over segment's mapped pages, or its copy), the room charged
  // for the job after its barrier (on one of its slots), and how long the
  // job waited for it.
  uint64_t save_buffer_bytes = 0;
  std::unique_ptr<SaveBuffer::Charge> save_charge;
  double buffer_wait_s = 0;

  // The outcome, written by whoever ends the rank (the job's runner, a
  // failure, the barrier's deadline); the rank's thread waits on `mu` for
  // `done` (JobRegistry::AwaitSlot), then reads its status and result.
  mutable absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
  v1::LoadResult result ABSL_GUARDED_BY(mu);
  v1::SaveResponse save_result ABSL_GUARDED_BY(mu);
  // Loads whose client copies cache views while the job runs: the job has
  // views for the rank's thread to hand out (ViewRecorder::NotifyWhenPending).
  bool views_pending ABSL_GUARDED_BY(mu) = false;
  // Loads whose client reads files itself (file views): held until the
  // rank's views are delivered; the cache fill of those reads waits for it.
  std::shared_ptr<const void> fill_after ABSL_GUARDED_BY(mu);
};

// A job of this node: its ranks (those of the job's world on this node),
// state and phase.
struct Job {
  enum class State { kWaiting, kRunning, kFinished };
  JobKind kind = JobKind::kLoad;
  std::string id;
  std::string path;
  std::optional<int64_t> unique_id;
  uid_t owner = 0;  // the uid that created it: only it may join
  int world_size = 0;
  std::set<int> expected;
  // The ranks' job_key (the same on every rank; empty: none): a multi-node
  // job's proof of membership to other nodes (server/multinode/job_mac.h).
  std::string job_key;
  // Whether the job's ranks span several daemons (this node serves fewer
  // than the world): its loads and saves go through the multi-node code.
  bool SpansNodes() const { return static_cast<int>(expected.size()) < world_size; }

  mutable absl::Mutex mu;
  std::map<int, std::shared_ptr<RankSlot>> slots ABSL_GUARDED_BY(mu);
  State state ABSL_GUARDED_BY(mu) = State::kWaiting;
  std::string phase ABSL_GUARDED_BY(mu) = "waiting for ranks";
  std::atomic<uint64_t> progress{0};
  std::atomic<uint64_t> total{0};
  // Every rank not done yet fails with `status` (each slot's mu taken in
  // turn); the job is finished (the registry drops it).
  void FailLocked(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void SetPhase(absl::string_view now) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    phase = std::string(now);
  }

  // Set once, by JobRegistry::AbortLoads (the drain ran out): the job's
  // reads stop at the next one and its ranks get `abort_status`.
  absl::Mutex abort_mu;
  bool aborted ABSL_GUARDED_BY(abort_mu) = false;
  absl::Status abort_status ABSL_GUARDED_BY(abort_mu);
  absl::Status AbortStatus() ABSL_LOCKS_EXCLUDED(abort_mu) {
    absl::MutexLock lock(&abort_mu);
    return abort_status;
  }
};

// A request's job_key: empty (none) or 16 to 64 bytes; INVALID_ARGUMENT
// naming `who` and the size else.
inline constexpr size_t kMinJobKeyBytes = 16;
inline constexpr size_t kMaxJobKeyBytes = 64;
absl::Status CheckJobKey(const std::string& who, const std::string& key);

// What a Load's and a Save's rank share: who it is (job, rank, world,
// node_ranks) and its targets, checked into a new slot with no destination
// yet. `verb` ("Load", "Save") names the call in errors.
absl::StatusOr<std::shared_ptr<RankSlot>> NewRankSlot(
    absl::string_view verb, const std::string& job_id, int rank, int world_size,
    const google::protobuf::RepeatedField<int32_t>& node_ranks,
    const google::protobuf::RepeatedPtrField<v1::Target>& targets);

// Seconds since `t0` (job and rank timings).
inline double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The job's registered slots, ascending rank.
std::vector<std::shared_ptr<RankSlot>> SlotsOf(const Job& job);

}  // namespace ckptd

#endif  // CKPTD_SERVER_JOBS_JOB_H_
