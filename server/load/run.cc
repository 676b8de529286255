// The load runner: RunJob, RunNodePart and FinishLoadJob (loads.h tells
// the steps), and what they share on a job's way.
#include <algorithm>
#include <chrono>
#include <set>

#include <spdlog/spdlog.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "core/plan/aoa.h"
#include "core/exec/executor.h"
#include "server/load/file_views.h"
#include "server/load/loads.h"

namespace ckptd {
namespace {

// The source a load job's plan runs on: `inner`, behind a gate that ends
// the job once it is aborted (JobRegistry::AbortLoads) and, for tests only
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

// Fills `s.result` for plan rank `index` (not `done`: the caller marks it).
void FillLoadResult(RankSlot& s, const ckpt::RankPlan& rp, size_t index, const JobFigures& f)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
  v1::LoadResult& r = s.result;
  for (const auto& k : rp.missing_keys) r.add_missing_keys(k);
  for (const auto& k : f.unexpected_keys) r.add_unexpected_keys(k);
  for (const auto& [from, to] : f.renamed_keys) (*r.mutable_renamed_keys())[from] = to;
  r.set_bytes_read(f.stats->bytes_read);
  r.set_bytes_read_direct(f.stats->bytes_read_direct);
  r.set_bytes_from_cache(f.bytes_from_cache);
  r.set_bytes_delivered(f.stats->rank_bytes_delivered[index]);
  r.set_job_bytes_delivered(f.stats->bytes_delivered);
  r.set_checksums_verified(f.stats->checksums_verified);
  r.set_unique_id(f.unique_id);
  r.set_format(f.format);
  r.set_local_fast_path(rp.local_fast_path);
  v1::PhaseTimings* tm = r.mutable_timings();
  tm->set_list_s(f.list_s);
  tm->set_plan_s(f.plan_s);
  tm->set_read_s(f.stats->read_seconds);
  tm->set_copy_s(f.stats->copy_seconds);
  tm->set_wait_s(std::chrono::duration<double>(f.start - s.start).count());
}


// Closes a job's device mappings once its copies are done: `delivery` (its
// streams waited for) and every slot's destination are released, before any
// rank is told it is done (a client may free that memory right after).
void ReleaseDestinations(absl::StatusOr<std::unique_ptr<ckpt::Delivery>>& delivery,
                         const std::vector<std::shared_ptr<RankSlot>>& slots) {
  if (delivery.ok()) delivery->reset();
  for (const auto& s : slots) s->destination->Release();
}

// Whether every rank of a job asked skip_verify (only then are the job's
// reads left unverified, and nothing they read is cached).
inline bool AllRanksSkipVerify(const std::vector<std::shared_ptr<RankSlot>>& slots) {
  for (const auto& s : slots) {
    if (!s->request.skip_verify()) return false;
  }
  return !slots.empty();
}

}  // namespace

void Loads::RunJob(const std::shared_ptr<Job>& job) {
  const auto t_start = std::chrono::steady_clock::now();
  const std::vector<std::shared_ptr<RankSlot>> slots = SlotsOf(*job);
  const bool distributed = job->SpansNodes();
  auto fail_all = [&](const absl::Status& s) {
    FailLoadJob(*job, slots.size(), distributed ? p_.config->peer_listen : "", s);
  };
  // AOA statements (LoadRequest.aoa_config): the same text from every rank
  // (multi-node: the coordinator checks every node sends the same).
  for (const auto& s : slots) {
    if (s->request.aoa_config() != slots.front()->request.aoa_config()) {
      return fail_all(absl::InvalidArgumentError(absl::StrCat(
          "job '", job->id, "': ranks ", slots.front()->request.rank(), " and ", s->request.rank(),
          " send different aoa_config")));
    }
  }
  // A version still being persisted (asynchronous save) is not visible yet:
  // wait for it, so a load right after a save finds it (in memory). A node
  // of a multi-node job waits at most peer_timeout: its peers wait for its
  // join (or its plan) no longer than that.
  const absl::Duration wait =
      distributed ? std::min(p_.config->load_timeout, p_.config->peer_timeout) : p_.config->load_timeout;
  p_.async_saves->AwaitPersisting(&job->path, absl::Now() + wait);
  // The previous load's background fill of this checkpoint first: what the
  // cache serves does not depend on timing (server/catalog/cache_filler.h).
  if (!p_.filler->Wait(job->path + "/", wait, /*work=*/false)) {
    spdlog::warn("job {}: the cache fill of {} did not finish in time; loading anyway", job->id,
                 job->path);
  }
  if (distributed) return multi_node_(job, slots, t_start);

  auto t0 = std::chrono::steady_clock::now();
  auto opened = p_.metadata->Open(job->path, job->unique_id);
  if (!opened.ok()) return fail_all(opened.status());
  const double list_s = Seconds(t0);
  const ckpt::Checkpoint& ckpt = (*opened)->checkpoint;

  t0 = std::chrono::steady_clock::now();
  std::vector<ckpt::RankTargets> ranks;
  for (const auto& s : slots) ranks.push_back(s->targets);
  ckpt::PlanOptions po;
  po.max_read_bytes = p_.config->io_request_size;
  auto plan = ckpt::PlanLoadWithAoa(ckpt.metadata, slots.front()->request.aoa_config(), ranks, po,
                                    "aoa_config");
  if (!plan.ok()) return fail_all(plan.status());
  const double plan_s = Seconds(t0);

  auto stats = RunNodePart(job, slots, *plan, (*opened)->stamps, "reading", nullptr);
  if (!stats.ok()) return fail_all(stats.status());

  JobFigures fig;
  fig.start = t_start;
  fig.stats = &*stats;
  fig.unexpected_keys = plan->unexpected_keys;
  fig.renamed_keys = plan->renamed_keys;
  fig.bytes_from_cache = stats->bytes_from_cache;
  fig.unique_id = ckpt.unique_id.value_or(0);
  fig.format = ckpt::FormatName(ckpt.format);
  fig.list_s = list_s;
  fig.plan_s = plan_s;
  LoadJobRecord rec{job->id, job->path, "", slots.size()};
  rec.list_s = list_s;
  FinishLoadJob(job, slots, *plan, fig, std::move(rec), nullptr);
}

absl::StatusOr<ckpt::LoadStats> Loads::RunNodePart(
    const std::shared_ptr<Job>& job, const std::vector<std::shared_ptr<RankSlot>>& slots,
    const ckpt::LoadPlan& plan, const std::map<std::string, ckpt::FileStamp>& stamps,
    absl::string_view phase, RemoteReads* remote) {
  // Strict ranks with missing keys fail alone; the others still load (and a
  // multi-node part still reads what its peers need from this node).
  std::vector<bool> skip(slots.size(), false);
  for (size_t i = 0; i < slots.size(); ++i) {
    const auto& missing = plan.ranks[i].missing_keys;
    if (slots[i]->request.strict() && !missing.empty()) {
      skip[i] = true;
      absl::MutexLock lock(&slots[i]->mu);
      slots[i]->status = absl::NotFoundError(absl::StrCat(
          "job '", job->id, "' rank ", slots[i]->request.rank(), ": ", job->path,
          " has no tensor(s) ", ckpt::MissingKeysText(missing),
          " (a strict load; strict=False loads the rest and reports them as missing_keys)"));
      slots[i]->done = true;
    }
  }
  std::vector<RankDelivery> parts;
  for (size_t i = 0; i < slots.size(); ++i) {
    parts.push_back(slots[i]->destination->Prepare(plan.ranks[i]));
  }
  uint64_t total = 0;
  for (const ckpt::ReadRange& r : plan.reads) total += r.length;
  {
    absl::MutexLock lock(&job->mu);
    job->phase = std::string(phase);
    job->total = total;
  }
  ckpt::SourceOptions storage_options;
  storage_options.defer_fresh_memory = true;  // filled afterwards by filler_
  storage_options.tenant = job->owner;        // the uid whose loads may view these entries
  ckpt::CachingSource storage(job->path, p_.cache, stamps, storage_options);
  GatedSource source(remote != nullptr ? remote->Wrap(&storage) : &storage, job.get(),
                     p_.config->testing_delay_read);
  ckpt::ExecuteOptions eo;
  eo.threads = p_.config->io_threads;
  eo.direct_io = p_.direct_io;
  // skip_verify is one rank's wish for its own delivery; the bytes are shared
  // with every rank of the job (and the cache, and peers), so they are
  // verified unless every rank asks not to (and then nothing read is cached:
  // core publishes only verified fills).
  eo.verify_checksums = !AllRanksSkipVerify(slots);
  // Reads the ranks' clients make themselves (file_views.h); not across nodes.
  absl::StatusOr<std::optional<ClientFileReads>> by_clients = std::nullopt;
  if (remote == nullptr) {
    std::vector<Destination*> dests;
    for (const auto& s : slots) dests.push_back(s->destination.get());
    by_clients = LeaveReadsToClients(plan, storage, dests, parts, skip, eo.verify_checksums);
  }
  const bool left = by_clients.ok() && by_clients->has_value();
  if (left) {
    absl::MutexLock lock(&job->mu);
    job->total -= (*by_clients)->read_bytes;
  }
  const ckpt::LoadPlan& daemon_reads = left ? (*by_clients)->rest : plan;
  auto delivery = JobDelivery(*p_.gpu, std::move(parts));
  eo.progress_bytes = &job->progress;
  eo.skip_rank = [&](size_t i) { return skip[i] || slots[i]->cancelled(); };
  eo.deadline = std::chrono::steady_clock::now() +
                std::chrono::milliseconds(absl::ToInt64Milliseconds(p_.config->load_timeout));
  auto stats = !by_clients.ok() ? absl::StatusOr<ckpt::LoadStats>(by_clients.status())
               : delivery.ok()  ? ckpt::ExecutePlan(daemon_reads, source, **delivery, eo)
                                : absl::StatusOr<ckpt::LoadStats>(delivery.status());
  if (stats.ok() && left) {  // delivered by the clients, once they copy
    for (size_t i = 0; i < slots.size(); ++i) {
      stats->rank_bytes_delivered[i] += (*by_clients)->rank_bytes[i];
    }
    stats->bytes_delivered += (*by_clients)->bytes;
    stats->bytes_from_files = (*by_clients)->bytes;
  }
  // A file changed after its last read, before the load ends, fails it too
  // (docs/daemon.md: a file that changes or vanishes during a load fails that load).
  if (stats.ok()) {
    if (absl::Status c = storage.CheckOpenedFilesUnchanged(); !c.ok()) stats = c;
  }
  ReleaseDestinations(delivery, slots);
  if (remote != nullptr) remote->Ended(stats.status());
  if (stats.ok()) {
    if (absl::Status a = job->AbortStatus(); !a.ok()) stats = a;  // aborted as it finished
  }
  if (!stats.ok()) {
    absl::Status s = stats.status();
    if (absl::IsDeadlineExceeded(s)) {  // the executor's deadline: load_timeout
      s = absl::DeadlineExceededError(absl::StrCat("job '", job->id, "': load_timeout ",
                                                   absl::FormatDuration(p_.config->load_timeout),
                                                   " ran out: ", s.message()));
    }
    return s;
  }
  p_.counters->bytes_read += stats->bytes_read;
  // Reads delivered without being kept (no warm memory for them): filled
  // into the cache in the background, before this checkpoint's next load.
  if (auto deferred = storage.Deferred(); !deferred.empty()) {
    const std::set<std::pair<std::string, uint64_t>> d(deferred.begin(), deferred.end());
    ckpt::LoadPlan fill;
    fill.files = plan.files;
    uint64_t bytes = 0;  // no more than the cache can hold (it would evict its own fill)
    for (const ckpt::ReadRange& rr : plan.reads) {
      if (!d.count({plan.files[rr.file], rr.offset})) continue;
      if (bytes + rr.length > p_.config->cache_budget) break;
      bytes += rr.length;
      fill.reads.push_back(rr);
    }
    // After the ranks' clients are done reading (file views): the fill
    // would compete with them (a first load after start: fresh memory). A
    // rank whose thread is gone already holds it until the job is let go.
    auto hold = std::make_shared<int>(0);
    for (size_t i = 0; i < slots.size(); ++i) {
      if (skip[i] || !slots[i]->destination->reads_files()) continue;
      absl::MutexLock lock(&slots[i]->mu);
      slots[i]->fill_after = hold;
    }
    p_.filler->Submit(job->path, stamps, std::move(fill), job->owner, hold,
                      p_.config->load_timeout);
  }
  return stats;
}

void Loads::FailLoadJob(Job& job, size_t ranks, const std::string& node,
                        const absl::Status& status) {
  RecordLoadJob(LoadJobRecord{job.id, job.path, node, ranks, status});
  p_.jobs->Fail(job, status);
}

void Loads::FinishLoadJob(const std::shared_ptr<Job>& job,
                           const std::vector<std::shared_ptr<RankSlot>>& slots,
                           const ckpt::LoadPlan& plan, const JobFigures& fig, LoadJobRecord rec,
                           const std::function<void(v1::LoadResult&)>& extra) {
  const ckpt::LoadStats& stats = *fig.stats;
  rec.bytes_read = stats.bytes_read;
  rec.bytes_read_direct = stats.bytes_read_direct;
  rec.bytes_from_files = stats.bytes_from_files;
  rec.bytes_from_cache = fig.bytes_from_cache;
  rec.bytes_delivered = stats.bytes_delivered;
  rec.reads = plan.reads.size();
  rec.checksums_verified = stats.checksums_verified;
  rec.plan_s = fig.plan_s;
  rec.read_s = stats.read_seconds;
  rec.copy_s = stats.copy_seconds;
  for (const auto& s : slots) {  // ranks that failed alone (strict, missing keys)
    absl::MutexLock slot_lock(&s->mu);
    if (!s->done || s->status.ok()) continue;
    if (rec.ranks_failed++ == 0) rec.status = s->status;
  }
  p_.jobs->Finish(*job, [&] {
    // Metrics and the job's log line, written before any rank can see its
    // result: a client that finished finds its job logged.
    rec.wall_s = Seconds(fig.start);
    RecordLoadJob(rec);
    for (size_t i = 0; i < slots.size(); ++i) {
      RankSlot& s = *slots[i];
      absl::MutexLock slot_lock(&s.mu);
      if (s.done) continue;
      FillLoadResult(s, plan.ranks[i], i, fig);
      s.result.set_reads(plan.reads.size());
      if (extra) extra(s.result);
      s.done = true;
    }
  });
}

}  // namespace ckptd
