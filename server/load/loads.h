// The one load path (docs/architecture.md). Every Load rank, single- or
// multi-node, goes through Load: its request checked against the limits
// and the caller's access, its destination opened, its rank registered in
// its job; the rank that completes the job's barrier runs the job (RunJob):
//
//   RunJob          one aoa_config per job; waits for persists into the
//                   directory and for the previous load's cache fill; then
//                   plans the whole job here, or hands it to the multi-node
//                   load (server/multinode/multinode_load.h), which joins the
//                   job's coordinator for this node's part of a plan made
//                   across nodes;
//   RunNodePart     strict ranks missing keys fail alone; destinations; the
//                   storage source (data cache + files, fresh memory deferred
//                   to the cache filler), wrapped by peers' reads for a
//                   multi-node part; execution under load_timeout and the
//                   drain's abort; the file-change check; device mappings
//                   closed; the background cache fill queued;
//   FinishLoadJob   every rank's result, the job out of the registry, its
//                   log line and metrics.
//
// The multi-node load adds only joining, planning across nodes, peer
// fetches and agreeing on the outcome, and calls RunNodePart and
// FinishLoadJob for the rest.
//
// Owned by the daemon; Load runs on the RPC threads, the job on the thread
// of the rank that completed its barrier. Thread-safe: no state of its own
// but atomic counters; the parts it uses lock for themselves.
#ifndef CKPTD_SERVER_LOAD_LOADS_H_
#define CKPTD_SERVER_LOAD_LOADS_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "config/config.h"
#include "core/cache/cache.h"
#include "core/cache/cache_view.h"
#include "core/exec/executor.h"
#include "core/io/file.h"
#include "core/plan/planner.h"
#include "proto/ckpt.pb.h"
#include "server/api/caller.h"
#include "server/catalog/cache_filler.h"
#include "server/catalog/metadata_cache.h"
#include "server/cuda/gpu.h"
#include "server/delivery/opener.h"
#include "server/jobs/registry.h"
#include "server/multinode/remote_reads.h"
#include "server/obs/metrics.h"
#include "server/policy/policy.h"
#include "server/save/async_saves.h"

namespace ckptd {

// The daemon's load counters (Status, metrics).
struct LoadCounters {
  std::atomic<uint64_t> started{0}, succeeded{0}, failed{0};
  std::atomic<int64_t> running{0};  // Load calls in progress
  std::atomic<int64_t> last_end_ns{0};  // when the latest one ended (NowNs)
  static int64_t NowNs() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  // Whether a load runs or ended within `quiet` (loads back to back leave
  // gaps of a few milliseconds between them).
  bool Busy(std::chrono::nanoseconds quiet) const {
    return running.load() > 0 || NowNs() - last_end_ns.load() < quiet.count();
  }
  std::atomic<uint64_t> bytes_read{0}, bytes_delivered{0};
};

// Figures of a whole job (on this node) that every rank's result carries.
struct JobFigures {
  std::chrono::steady_clock::time_point start;  // the job began running (its ranks' wait ends)
  const ckpt::LoadStats* stats = nullptr;
  std::vector<std::string> unexpected_keys;
  std::map<std::string, std::string> renamed_keys;
  uint64_t bytes_from_cache = 0;
  int64_t unique_id = 0;
  std::string format;
  double list_s = 0;
  double plan_s = 0;
};

class Loads {
 public:
  // What it uses; every pointer outlives it.
  struct Parts {
    const DaemonConfig* config = nullptr;
    ckpt::DirectIo direct_io = ckpt::DirectIo::kNever;
    Policy* policy = nullptr;
    MetadataCache* metadata = nullptr;
    ckpt::HostCache* cache = nullptr;
    CacheFiller* filler = nullptr;
    gpu::GpuRuntime* gpu = nullptr;
    DestinationOpener* opener = nullptr;
    JobRegistry* jobs = nullptr;
    AsyncSaves* async_saves = nullptr;  // a load waits for persists into its directory
    LoadCounters* counters = nullptr;
  };
  // Runs a job whose ranks span several daemons (node_ranks a strict subset
  // of the world) from its ranks here, `start` when it began running.
  using MultiNode = std::function<void(const std::shared_ptr<Job>& job,
                                       const std::vector<std::shared_ptr<RankSlot>>& slots,
                                       std::chrono::steady_clock::time_point start)>;

  explicit Loads(Parts parts) : p_(parts) {}
  // The multi-node load: set once by the daemon, before any Load.
  void SetMultiNode(MultiNode run) { multi_node_ = std::move(run); }

  // Runs one rank's Load. `send` writes an event to the client (false when
  // the stream is gone); `cancelled` tells whether the client went away.
  absl::Status Load(const Caller& caller, const v1::LoadRequest& request,
                    const std::function<bool(const v1::LoadEvent&)>& send,
                    const std::function<bool()>& cancelled);

  // Runs a node's part of a load plan (the whole plan for a single-node job)
  // into `slots` (plan.ranks in the same order): strict ranks missing keys
  // fail alone, the rest are delivered from `stamps`' files through the data
  // cache, and (multi-node) `remote`'s peers. The job's stats, or why it
  // failed on this node.
  absl::StatusOr<ckpt::LoadStats> RunNodePart(const std::shared_ptr<Job>& job,
                                              const std::vector<std::shared_ptr<RankSlot>>& slots,
                                              const ckpt::LoadPlan& plan,
                                              const std::map<std::string, ckpt::FileStamp>& stamps,
                                              absl::string_view phase, RemoteReads* remote);
  // The job failed on this node (`node`: its peer address in a multi-node
  // job, else empty): logged and counted, then every rank not done yet
  // fails with `status` and the job leaves the registry.
  void FailLoadJob(Job& job, size_t ranks, const std::string& node, const absl::Status& status);
  // The job succeeded on this node: the job leaves the registry, `rec`
  // (completed from `fig` and `plan`) is logged and counted, and every rank
  // not done yet gets its result (its part of `fig`, then `extra`).
  void FinishLoadJob(const std::shared_ptr<Job>& job,
                     const std::vector<std::shared_ptr<RankSlot>>& slots,
                     const ckpt::LoadPlan& plan, const JobFigures& fig, LoadJobRecord rec,
                     const std::function<void(v1::LoadResult&)>& extra);

 private:
  // A thread joined when this goes (a job run beside its runner's call).
  struct JoinedThread {
    std::thread t;
    ~JoinedThread() {
      if (t.joinable()) t.join();
    }
  };
  // Bytes of views a client copying while the job runs gets at least at a
  // time (but the last batch): fewer round trips for small reads.
  static constexpr uint64_t kViewBatchBytes = 16 << 20;
  // ... and only from a job still running this long after they are due.
  static constexpr absl::Duration kEarlyViewsAfter = absl::Milliseconds(50);

  // The slot's views mark it pending (RankSlot::views_pending) as they fill.
  static void WatchViews(const std::shared_ptr<RankSlot>& slot, ckpt::ViewRecorder& views);
  // A batch of the rank's views for its client while the job runs, if the
  // job is still running kEarlyViewsAfter from now (*copied: the client's
  // copies so far; nothing is handed out once one failed).
  void HandOutEarly(const Caller& caller, RankSlot& slot, ckpt::ViewRecorder& views,
                    const std::string& who, const std::function<bool(const v1::LoadEvent&)>& send,
                    const std::function<bool()>& cancelled, absl::Status* copied);
  // The rank's last views (the client copies them) and what they
  // delivered into *result.
  absl::Status DeliverViews(const Caller& caller, ckpt::ViewRecorder& views,
                            const std::string& who,
                            const std::function<bool(const v1::LoadEvent&)>& send,
                            const std::function<bool()>& cancelled, v1::LoadResult* result);
  // The laid-out copy to gather from the rank's views for its next load
  // (ViewRecorder::TakeLaidOutWork), if a target qualifies, queued on the
  // cache filler, which expands its pieces too (`views` held till then):
  // the rank's call does not wait for that (6-12 ms for the pieces of a
  // cold load's column halves, 512 MiB).
  void QueueLaidOut(std::shared_ptr<ckpt::ViewRecorder> views, const std::string& path);
  // Runs the job (RunJob, guarded): on `thread` when `own_thread` (this
  // rank's call hands out views meanwhile), else here, till it is done.
  void Start(const std::shared_ptr<Job>& job, bool own_thread, JoinedThread* thread);
  // A Load's rank slot: its targets checked (NewRankSlot) and its
  // destination opened (DestinationOpener); `who` names the rank in errors.
  absl::StatusOr<std::shared_ptr<RankSlot>> PrepareSlot(const Caller& caller,
                                                        const v1::LoadRequest& request,
                                                        const std::string& who);
  // Every load job starts here, single- or multi-node.
  void RunJob(const std::shared_ptr<Job>& job);

  const Parts p_;
  MultiNode multi_node_;
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_LOAD_LOADS_H_
