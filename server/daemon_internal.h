// Private to the daemon's implementation files (daemon.cc, daemon_load.cc,
// daemon_multinode.cc, ...): the job registry's records and what the load
// path shares.
#ifndef CKPTD_SERVER_DAEMON_INTERNAL_H_
#define CKPTD_SERVER_DAEMON_INTERNAL_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/exec/executor.h"
#include "server/await.h"
#include "server/daemon.h"
#include "server/delivery/destination.h"
#include "server/jobs/job.h"

namespace ckptd {

// SaveRequest.format of a PyTorch DCP checkpoint (ckptd.torch.DaemonStorageWriter).
inline constexpr char kDcpFormat[] = "pytorch-dcp";
// Names the save job whose DCP data files a directory holds until its commit:
// the commit must come from that job, so two saves racing into one directory
// fail instead of committing one's metadata over the other's files.
inline constexpr char kDcpPending[] = ".ckptd-dcp-pending";

// ALREADY_EXISTS text for a DCP save into a directory holding a committed one.
inline std::string DcpCheckpointExists(const std::string& dir) {
  return absl::StrCat(dir, " already holds a PyTorch DCP checkpoint (.metadata); save elsewhere "
                      "or set overwrite");
}

inline double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The source a load job's plan runs on: `inner`, behind a gate that ends
// the job once it is aborted (Daemon::AbortLoads) and, for tests only
// (--testing-delay-read-ms), pauses before each read; the pause ends early
// when the job is aborted.
class GatedSource final : public ckpt::RangeSource {
 public:
  GatedSource(ckpt::RangeSource* inner, Job* job, absl::Duration delay)
      : inner_(inner), job_(job), delay_(delay) {}
  absl::StatusOr<ckpt::RangeView> Fetch(
      const std::string& file, uint64_t offset, uint64_t n, std::vector<uint8_t>& scratch,
      const std::function<absl::Status(const uint8_t*)>& verify) override {
    if (absl::Status s = Gate(); !s.ok()) return s;
    return inner_->Fetch(file, offset, n, scratch, verify);
  }
  absl::StatusOr<std::unique_ptr<Fill>> BeginFill(const std::string& file, uint64_t offset,
                                                  uint64_t n, bool verify,
                                                  std::optional<ckpt::RangeView>* served) override {
    if (absl::Status s = Gate(); !s.ok()) return s;
    return inner_->BeginFill(file, offset, n, verify, served);
  }

 private:
  absl::Status Gate() {
    absl::MutexLock lock(&job_->abort_mu);
    if (delay_ > absl::ZeroDuration()) {
      job_->abort_mu.AwaitWithTimeout(absl::Condition(&job_->aborted), delay_);
    }
    return job_->aborted ? job_->abort_status : absl::OkStatus();
  }
  ckpt::RangeSource* const inner_;
  Job* const job_;
  const absl::Duration delay_;
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

// Where each of `requested` (a Load's or Save's targets, in request order)
// lands in the rank's destination; `targets` are the same, parsed.
std::vector<TargetPlace> PlacesOf(const google::protobuf::RepeatedPtrField<v1::Target>& requested,
                                  const ckpt::RankTargets& targets);

// Closes a job's device mappings once its copies are done: `delivery` (its
// streams waited for) and every slot's destination are released, before any
// rank is told it is done (a client may free that memory right after).
void ReleaseDestinations(absl::StatusOr<std::unique_ptr<ckpt::Delivery>>& delivery,
                         const std::vector<std::shared_ptr<RankSlot>>& slots);

// Whether every rank of a job asked skip_verify (only then are the job's
// reads left unverified, and nothing they read is cached).
inline bool AllRanksSkipVerify(const std::vector<std::shared_ptr<RankSlot>>& slots) {
  for (const auto& s : slots) {
    if (!s->request.skip_verify()) return false;
  }
  return !slots.empty();
}

// Fills `slot.result` for plan rank `index` (not `done`: the caller marks it).
void FillLoadResult(RankSlot& slot, const ckpt::RankPlan& plan, size_t index,
                    const JobFigures& figures) ABSL_EXCLUSIVE_LOCKS_REQUIRED(slot.mu);

}  // namespace ckptd

#endif  // CKPTD_SERVER_DAEMON_INTERNAL_H_
