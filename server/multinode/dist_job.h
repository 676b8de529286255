// A multi-node job's record on one node (DistJob) and what the nodes of
// such a job say to each other beside it: the join every node sends, the
// checks a part from the coordinator passes, how a node's own outcome and
// the job's combine.
//
// Thread-safety: a DistJob's identity is set before DistJobs registers it and
// read-only after; its `mu` guards the rest (ABSL_GUARDED_BY).
#ifndef CKPTD_SERVER_MULTINODE_DIST_JOB_H_
#define CKPTD_SERVER_MULTINODE_DIST_JOB_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/exec/executor.h"
#include "proto/peer.pb.h"
#include "server/api/caller.h"
#include "server/jobs/job.h"
#include "server/multinode/plan_codec.h"
#include "server/multinode/remote_reads.h"

namespace ckptd {

// What a multi-node job is, as the nodes compare it (DistJobs::New).
struct DistJobKind {
  std::string aoa;  // a load's AOA statements
  bool save = false;
  bool overwrite = false;
};

// Everything down to `aoa` is set before the job is registered in
// DistJobs (dist_jobs.h) and read-only after; `mu` guards the rest.
struct DistJob {
  std::string id;
  bool coordinator = false;
  bool save = false;   // a multi-node save (multinode_save.cc), else a load
  bool overwrite = false;  // a save's (compared across nodes)
  absl::Time deadline;  // for joining and planning
  // How long the outcome may take once this node reported (Complete): a
  // load's nodes finish close together (peer_timeout); a save's may write
  // for long, so its nodes wait while the missing ones are alive and working
  // on it, up to load_timeout from the job's start.
  absl::Time outcome_deadline;
  std::string path;       // as the ranks named it (compared across nodes)
  std::string local_dir;  // where it resolves on this node
  std::optional<int64_t> unique_id;
  int world_size = 0;
  std::string aoa;  // the job's AOA statements (compared across nodes)
  std::string job_key;  // the ranks' key (Job::job_key): MACs (job_mac.h)
  // Coordinator: the rendezvous nodes it announced itself at, in ring order
  // (the joiners ask the first). Set and read on the coordinator's own
  // thread (DistJobs::PlanPartOf: Announce, then the planning).
  std::vector<std::string> announced_at;

  absl::Mutex mu;
  // A finished job stays a little (late joiners get its error, slow fetchers
  // their bytes) and is dropped by DistJobs after this time.
  absl::Time expires ABSL_GUARDED_BY(mu) = absl::InfiniteFuture();
  // Coordinator: gathering and planning.
  std::map<std::string, peer::v1::JoinRequest> joins ABSL_GUARDED_BY(mu);  // node -> its join
  std::set<int> ranks_joined ABSL_GUARDED_BY(mu);
  // Joins refused for want of the job key's proof: node -> why (named when
  // the job then times out waiting for that node's ranks).
  std::map<std::string, std::string> refused ABSL_GUARDED_BY(mu);
  bool planned ABSL_GUARDED_BY(mu) = false;
  absl::Status plan_status ABSL_GUARDED_BY(mu);
  std::map<std::string, peer::v1::PlanPart> parts ABSL_GUARDED_BY(mu);
  // Serving: reads this node does that other nodes need (global index).
  struct Served {
    bool ready = false;
    ckpt::RangeView view;  // pinned bytes of the read once ready
    uint64_t length = 0;
    uint64_t xxh3 = 0;     // of the bytes as read (and verified) here
    std::set<std::string> needers;  // the other nodes whose parts copy from it
    std::set<std::string> fetched;  // who fetched it (once each)
    int remaining = 0;     // fetches still expected
  };
  std::map<uint32_t, Served> served ABSL_GUARDED_BY(mu);
  // Bytes of this node's reads sent to peers (gRPC streams, NCCL links),
  // counted as they are handed over (before a fetching node can have them:
  // once the outcome is in, every byte its nodes received is counted here).
  std::atomic<uint64_t> bytes_sent{0};
  bool part_known ABSL_GUARDED_BY(mu) = false;
  absl::Status exec_status ABSL_GUARDED_BY(mu);
  // The first authorization violation seen here (PERMISSION_DENIED naming
  // the caller): the job fails with it on this node.
  absl::Status violation ABSL_GUARDED_BY(mu);
  // Every node of the job (known once planned / the part arrived).
  std::vector<std::string> nodes ABSL_GUARDED_BY(mu);
  // Coordinator: completion.
  std::map<std::string, peer::v1::CompleteRequest> completes ABSL_GUARDED_BY(mu);
  std::set<std::string> reported ABSL_GUARDED_BY(mu);  // nodes that sent Complete themselves
  bool finished ABSL_GUARDED_BY(mu) = false;
  peer::v1::CompleteResponse outcome ABSL_GUARDED_BY(mu);

  // An authorization violation by `caller`, a node of this job (one whose
  // join proved the job key): logged, kept as the job's failure on this
  // node, and (coordinator) the job's outcome for every node. Returns the
  // PERMISSION_DENIED status naming the caller.
  absl::Status ViolationLocked(const PeerCaller& caller, absl::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // What `caller`, not a proven node of this job, tried to do as `node`:
  // refused (PERMISSION_DENIED naming it) and logged, and kept in `refused`
  // for the job's error should it then time out; the job goes on (a peer
  // that knows only a job's id can neither join it nor fail it).
  absl::Status RefuseLocked(const PeerCaller& caller, const std::string& node,
                            absl::string_view what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // This node's part ended with `exec`: a violation seen here fails it even
  // when all of its work went through; a failure is kept as the job's on
  // this node. Returns the part's status.
  absl::Status EndPart(absl::Status exec) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    if (exec.ok() && !violation.ok()) exec = violation;
    if (!exec.ok()) exec_status = exec;
    return exec;
  }
};

// A job spanning several daemons needs its ranks' job_key (the proof of
// membership its join carries) unless this daemon allows unkeyed jobs
// (`unkeyed_allowed`: config peer_unkeyed_jobs): FAILED_PRECONDITION saying
// how to set one.
absl::Status CheckJobKeyed(const Job& job, bool unkeyed_allowed);

// What every node of a multi-node job sends its coordinator: the job, this
// node's ranks and their targets (loads add their files, saves SaveJoin),
// and the MAC of the job and this node under the ranks' key.
peer::v1::JoinRequest BaseJoin(const Job& job,
                               const std::vector<std::shared_ptr<RankSlot>>& slots,
                               const std::string& node, const std::string& path, int coordinator_rank);

// What LocalPartOf/LocalSaveOf check a part from `coordinator` against:
// job `job`, this node (`me`) and its ranks' targets (`slots`).
PlanPartContext PartContextOf(const Job& job, const std::vector<std::shared_ptr<RankSlot>>& slots,
                              const std::string& me, const std::string& coordinator);

// A part from `coordinator` must name this job, and both this node and the
// coordinator among its nodes (PERMISSION_DENIED otherwise).
absl::Status CheckPartOrigin(const peer::v1::PlanPart& part, const std::string& job_id,
                             const std::string& me, const std::string& coordinator);

// A multi-node job's status on this node from its own part's (`exec`) and
// the job's outcome: another node's failure names that node; this node's own
// failure wins unless it only echoes another's (its fetches refused or cut).
absl::Status JobOutcome(const std::string& job_id, const absl::Status& exec,
                        const absl::StatusOr<peer::v1::CompleteResponse>& outcome);

// Codes a node's part fails with when another node failed first: its
// fetches refused (ABORTED "... failed its part"), cut or never answered.
// This node's report of its part of job `job_id` to the coordinator: the
// common fields (the kind-specific byte counts are set by the caller).
inline peer::v1::CompleteRequest CompletionOf(const std::string& job_id, const std::string& me,
                                              const absl::Status& exec) {
  peer::v1::CompleteRequest done;
  done.set_job_id(job_id);
  done.set_node(me);
  done.set_ok(exec.ok());
  done.set_error(std::string(exec.message()));
  done.set_error_code(static_cast<int>(exec.code()));
  return done;
}

inline bool EchoOfAnotherFailure(int code) {
  const auto c = static_cast<absl::StatusCode>(code);
  return c == absl::StatusCode::kAborted || c == absl::StatusCode::kUnavailable ||
         c == absl::StatusCode::kCancelled;
}

inline absl::Status FromGrpc(const grpc::Status& s, absl::string_view who) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(who, ": ", s.error_message()));
}

inline std::chrono::system_clock::time_point ToChrono(absl::Time t) {
  return std::chrono::system_clock::from_time_t(0) +
         std::chrono::microseconds(absl::ToUnixMicros(t));
}

// Why a wait ended without its condition.
inline absl::Status WaitFailed(const std::function<bool()>& cancelled, const std::string& what) {
  if (cancelled && cancelled()) return absl::CancelledError(absl::StrCat(what, ": the caller went away"));
  return absl::DeadlineExceededError(what);
}

}  // namespace ckptd

#endif  // CKPTD_SERVER_MULTINODE_DIST_JOB_H_
