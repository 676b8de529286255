#include "core/exec/executor.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>
#include <thread>
#include <tuple>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "core/base/checksum.h"
#include "core/base/sorted_append.h"
#include "core/base/status_macros.h"
#include "core/base/xxh3.h"
#include "core/exec/executor_runs.h"

namespace ckpt {
namespace {

using exec_internal::ChecksumError;
using exec_internal::CopyCountError;
using exec_internal::RunWriter;

}  // namespace

absl::StatusOr<DirectIo> ParseDirectIo(const std::string& text) {
  if (text == "never") return DirectIo::kNever;
  if (text == "auto") return DirectIo::kAuto;
  if (text == "always") return DirectIo::kAlways;
  return absl::InvalidArgumentError(
      absl::StrCat("direct I/O mode '", text, "' is not one of never, auto, always"));
}

absl::StatusOr<const RandomAccessFile*> DirectorySource::Get(const std::string& file) {
  absl::MutexLock lock(&mu_);
  auto it = files_.find(file);
  if (it != files_.end()) return it->second.get();
  if (directory_ == nullptr) {
    CKPT_ASSIGN_OR_RETURN(directory_, Directory::Open(dir_, options_.confine));
  }
  CKPT_ASSIGN_OR_RETURN(auto f, directory_->OpenFile(file));
  const RandomAccessFile* p = f.get();
  files_.emplace(file, std::move(f));
  return p;
}

absl::StatusOr<std::unique_ptr<RangeSource::Fill>> DirectorySource::BeginFill(
    const std::string& file, uint64_t offset, uint64_t n, bool verify,
    std::optional<RangeView>* served) {
  auto fill = std::make_unique<Fill>();
  CKPT_ASSIGN_OR_RETURN(fill->file, Get(file));
  return fill;
}

absl::StatusOr<RangeView> DirectorySource::Fetch(
    const std::string& file, uint64_t offset, uint64_t n, std::vector<uint8_t>& scratch,
    const std::function<absl::Status(const uint8_t*)>& verify) {
  CKPT_ASSIGN_OR_RETURN(const RandomAccessFile* f, Get(file));
  if (scratch.size() < n) scratch.resize(n);
  CKPT_RETURN_IF_ERROR(f->Read(offset, n, scratch.data()));
  if (verify) CKPT_RETURN_IF_ERROR(verify(scratch.data()));
  return RangeView{scratch.data(), nullptr, true};
}

absl::StatusOr<int64_t> HostDelivery::Copy(size_t rank_index, const RankPlan& rank,
                                           const CopyOp& op, const uint8_t* src) {
  void* dst = dests_[rank_index][op.target];
  if (dst == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank.rank, " tensor '",
                                                   rank.targets[op.target].name,
                                                   "' has no destination buffer"));
  }
  return CopyRegion(op.src, src, rank.targets[op.target].layout(), dst, op.region);
}

absl::StatusOr<LoadStats> ExecutePlan(const LoadPlan& plan, RangeSource& source,
                                      const std::vector<std::vector<void*>>& destinations,
                                      const ExecuteOptions& options) {
  if (destinations.size() != plan.ranks.size()) {
    return absl::InvalidArgumentError("ExecutePlan: one destination list per rank is required");
  }
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    if (destinations[r].size() != plan.ranks[r].targets.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("ExecutePlan: rank ", plan.ranks[r].rank, " has ",
                       plan.ranks[r].targets.size(), " targets but ", destinations[r].size(),
                       " destinations"));
    }
  }
  HostDelivery delivery(destinations);
  return ExecutePlan(plan, source, delivery, options);
}

namespace {

// One execution of a plan: the reads are claimed in order by every worker
// thread; each read's bytes are filled piece by piece (a Fill), served from
// memory, or fetched whole, then copied into the ranks' destinations.
class PlanRun {
 public:
  PlanRun(const LoadPlan& plan, RangeSource& source, Delivery& delivery,
          const ExecuteOptions& options)
      : plan_(plan), source_(source), delivery_(delivery), options_(options),
        by_read_(plan.reads.size()),
        // Loads far larger than the caches write their destinations with
        // streaming stores (as CopyRegion does for one large region).
        stream_(plan.bytes_to_deliver() >= kStreamingBytes) {
    for (uint32_t r = 0; r < plan.ranks.size(); ++r) {
      const RankPlan& rp = plan.ranks[r];
      for (uint32_t c = 0; c < rp.copies.size(); ++c) by_read_[rp.copies[c].read].push_back({r, c});
    }
    total_.rank_bytes_delivered.assign(plan.ranks.size(), 0);
  }

  // Claims and runs reads until none is left or one failed.
  void Worker();
  absl::StatusOr<LoadStats> Result() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (!first_error_.ok()) return first_error_;
    return total_;
  }

 private:
  // What one worker thread keeps across its reads.
  struct WorkerState {
    explicit WorkerState(const LoadPlan& plan, uint64_t piece_bytes)
        : writer(piece_bytes), skip_memo(plan.ranks.size(), 0) {
      local.rank_bytes_delivered.assign(plan.ranks.size(), 0);
    }
    LoadStats local;
    std::vector<uint8_t> scratch;
    RunWriter writer;
    std::vector<uint8_t> skip_memo;  // per rank: 0 unknown, 1 run, 2 skip
    std::vector<uint32_t> memo_touched;
  };
  absl::Status RunRead(size_t i, WorkerState& w);
  // The read's bytes fetched whole (or served from memory), then copied.
  absl::Status FetchAndCopy(size_t i, bool by_runs, std::optional<RangeView> served,
                            WorkerState& w);
  absl::Status CopyEach(size_t i, const RangeView& view, WorkerState& w);
  void Fail(const absl::Status& s) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (first_error_.ok()) first_error_ = s;
    failed_ = true;
  }
  void Merge(const LoadStats& local) ABSL_LOCKS_EXCLUDED(mu_);

  const LoadPlan& plan_;
  RangeSource& source_;
  Delivery& delivery_;
  const ExecuteOptions& options_;
  // Copies grouped by the read that feeds them: (rank, copy).
  std::vector<std::vector<std::pair<uint32_t, uint32_t>>> by_read_;
  const bool stream_;
  std::atomic<size_t> next_{0};
  std::atomic<bool> failed_{false};
  absl::Mutex mu_;
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
  LoadStats total_ ABSL_GUARDED_BY(mu_);
};

void PlanRun::Worker() {
  WorkerState w(plan_, options_.piece_bytes);
  while (!failed_.load(std::memory_order_relaxed)) {
    for (uint32_t r : w.memo_touched) w.skip_memo[r] = 0;
    w.memo_touched.clear();
    size_t i = next_.fetch_add(1);
    if (i >= plan_.reads.size()) break;
    if (options_.deadline && std::chrono::steady_clock::now() > *options_.deadline) {
      Fail(absl::DeadlineExceededError(absl::StrCat(
          "load did not finish in time: ", i, " of ", plan_.reads.size(), " reads done")));
      break;
    }
    // skip_rank may be costly (a gRPC cancellation check): ask once per
    // rank per read.
    for (const auto& rc : by_read_[i]) {
      const uint32_t r = rc.first;
      if (w.skip_memo[r] == 0) {
        w.skip_memo[r] = options_.skip_rank && options_.skip_rank(r) ? 2 : 1;
        w.memo_touched.push_back(r);
      }
    }
    if (absl::Status s = RunRead(i, w); !s.ok()) {
      Fail(s);
      break;
    }
  }
  Merge(w.local);
}

absl::Status PlanRun::RunRead(size_t i, WorkerState& w) {
  const ReadRange& rr = plan_.reads[i];
  absl::Status prepared;
  const bool by_runs = w.writer.Prepare(plan_, i, by_read_[i], w.skip_memo, delivery_, &prepared);
  CKPT_RETURN_IF_ERROR(prepared);
  // The read's bytes: read piece by piece here (a Fill), served from
  // memory (a cache hit), or fetched whole by the source.
  std::optional<RangeView> served;
  if (by_runs) {
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<RangeSource::Fill> fill,
                          source_.BeginFill(plan_.files[rr.file], rr.offset, rr.length,
                                            options_.verify_checksums, &served));
    if (fill != nullptr) {
      const RandomAccessFile& f = *fill->file;
      const bool direct = options_.direct_io == DirectIo::kAlways ||
                          (options_.direct_io == DirectIo::kAuto && !f.Cached(rr.offset, rr.length));
      absl::Status s = w.writer.ReadPieces(f, options_.verify_checksums, stream_, direct, w.local,
                                           fill->keep);
      if (s.ok()) s = fill->Finish();
      if (s.ok()) w.writer.Account(w.local);
      absl::Status flushed = delivery_.Flush();
      if (s.ok()) s = flushed;
      if (options_.progress_bytes) options_.progress_bytes->fetch_add(rr.length);
      return s;
    }
  }
  return FetchAndCopy(i, by_runs, std::move(served), w);
}

absl::Status PlanRun::FetchAndCopy(size_t i, bool by_runs, std::optional<RangeView> served,
                                   WorkerState& w) {
  const ReadRange& rr = plan_.reads[i];
  const std::string& file = plan_.files[rr.file];
  int64_t verified = 0;
  auto verify = [&](const uint8_t* data) -> absl::Status {
    if (!options_.verify_checksums) return absl::OkStatus();
    for (const auto& c : rr.checks) {
      if (Checksum(data + (c.offset - rr.offset), c.nbytes) != c.xxh3) {
        return ChecksumError(file, c);
      }
      ++verified;
    }
    return absl::OkStatus();
  };
  // Without verification the source gets no verify function, so it knows
  // these bytes are unverified (and a cache does not keep them).
  static const std::function<absl::Status(const uint8_t*)> kNoVerify;
  auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<RangeView> view =
      served ? *std::move(served)
             : source_.Fetch(file, rr.offset, rr.length, w.scratch,
                             options_.verify_checksums
                                 ? std::function<absl::Status(const uint8_t*)>(verify)
                                 : kNoVerify);
  auto t1 = std::chrono::steady_clock::now();
  absl::Status s = view.status();
  if (s.ok()) {
    w.local.checksums_verified += verified;
    (view->from_storage ? w.local.bytes_read : w.local.bytes_from_cache) += rr.length;
    if (by_runs) {
      s = view->spans ? w.writer.WriteSpans(view->data, *view->spans, stream_)
                      : w.writer.WriteAll(view->data, stream_);
      if (s.ok()) w.writer.Account(w.local);
    } else if (view->spans) {
      // Copy by copy needs the read laid out: its spans put in place first.
      w.scratch.resize(rr.length);
      uint64_t at = 0;
      for (const ReadSpan& sp : *view->spans) {
        if (sp.end > rr.length || sp.begin >= sp.end) {
          return absl::DataLossError(absl::StrCat("read of ", file, " bytes [", rr.offset, ", ",
                                                  rr.offset + rr.length, "): a span [", sp.begin,
                                                  ", ", sp.end, ") outside it"));
        }
        std::memcpy(w.scratch.data() + sp.begin, view->data + at, sp.end - sp.begin);
        at += sp.end - sp.begin;
      }
      s = CopyEach(i, RangeView{w.scratch.data(), nullptr, view->from_storage}, w);
    } else {
      s = CopyEach(i, *view, w);
    }
    absl::Status flushed = delivery_.Flush();
    if (s.ok()) s = flushed;
  }
  auto t2 = std::chrono::steady_clock::now();
  w.local.read_seconds += std::chrono::duration<double>(t1 - t0).count();
  w.local.copy_seconds += std::chrono::duration<double>(t2 - t1).count();
  if (options_.progress_bytes) options_.progress_bytes->fetch_add(rr.length);
  return s;
}

// Read `i`'s copies one by one through the delivery (no run writer).
absl::Status PlanRun::CopyEach(size_t i, const RangeView& view, WorkerState& w) {
  const ReadRange& rr = plan_.reads[i];
  for (const auto& [r, c] : by_read_[i]) {
    if (w.skip_memo[r] == 2) continue;
    const RankPlan& rp = plan_.ranks[r];
    const CopyOp& op = rp.copies[c];
    CKPT_ASSIGN_OR_RETURN(int64_t n,
                          delivery_.Copy(r, rp, op, view.data + (op.src_offset - rr.offset)));
    if (n != op.elements) return CopyCountError(rp, op, n);
    uint64_t bytes = static_cast<uint64_t>(n) * DTypeSize(rp.targets[op.target].dtype);
    w.local.bytes_delivered += bytes;
    w.local.rank_bytes_delivered[r] += bytes;
  }
  return absl::OkStatus();
}

void PlanRun::Merge(const LoadStats& local) {
  absl::MutexLock lock(&mu_);
  total_.bytes_read += local.bytes_read;
  total_.bytes_read_direct += local.bytes_read_direct;
  total_.bytes_from_cache += local.bytes_from_cache;
  total_.bytes_delivered += local.bytes_delivered;
  for (size_t r = 0; r < plan_.ranks.size(); ++r) {
    total_.rank_bytes_delivered[r] += local.rank_bytes_delivered[r];
  }
  total_.checksums_verified += local.checksums_verified;
  total_.read_seconds += local.read_seconds;
  total_.copy_seconds += local.copy_seconds;
}

}  // namespace

absl::StatusOr<LoadStats> ExecutePlan(const LoadPlan& plan, RangeSource& source,
                                      Delivery& delivery, const ExecuteOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  PlanRun run(plan, source, delivery, options);
  int n_threads = std::max(1, std::min<int>(options.threads, static_cast<int>(plan.reads.size())));
  std::vector<std::thread> threads;
  for (int i = 1; i < n_threads; ++i) threads.emplace_back([&run] { run.Worker(); });
  run.Worker();
  for (auto& t : threads) t.join();
  absl::StatusOr<LoadStats> total = run.Result();
  if (total.ok()) {
    total->wall_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return total;
}

}  // namespace ckpt
