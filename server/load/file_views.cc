#include "server/load/file_views.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/sorted_append.h"
#include "core/base/status_macros.h"
#include "core/cache/cache_view.h"

namespace ckptd {
namespace {

// A read cut into more runs than this for one rank goes through the daemon
// (whose writes batch them) rather than into that client's copy list.
constexpr size_t kMaxRunsPerRead = 1 << 16;

// `plan` without the reads `left` marks (and the copies from them).
ckpt::LoadPlan WithoutReads(const ckpt::LoadPlan& plan, const std::vector<bool>& left) {
  ckpt::LoadPlan rest;
  rest.files = plan.files;
  rest.missing_keys = plan.missing_keys;
  rest.unexpected_keys = plan.unexpected_keys;
  rest.renamed_keys = plan.renamed_keys;
  std::vector<int64_t> index(plan.reads.size(), -1);
  for (size_t i = 0; i < plan.reads.size(); ++i) {
    if (left[i]) continue;
    index[i] = static_cast<int64_t>(rest.reads.size());
    rest.reads.push_back(plan.reads[i]);
    rest.bytes_to_read += plan.reads[i].length;
  }
  rest.ranks.reserve(plan.ranks.size());
  for (const ckpt::RankPlan& rp : plan.ranks) {
    ckpt::RankPlan& r = rest.ranks.emplace_back();
    r.rank = rp.rank;
    r.targets = rp.targets;
    r.missing_keys = rp.missing_keys;
    r.local_fast_path = rp.local_fast_path;
    for (const ckpt::CopyOp& op : rp.copies) {
      if (index[op.read] < 0) continue;
      r.copies.push_back(op);
      r.copies.back().read = static_cast<uint32_t>(index[op.read]);
    }
  }
  return rest;
}

// Whether two runs (of one read, any ranks) share a byte. Each rank's runs
// come in file order as a rule (a box walked row by row): those are merged,
// not sorted (a column half of a 64 MiB read is thousands of runs per rank;
// ckpt::SortedAppend, which sorts once instead past 8 ranks out of order).
bool RanksOverlap(const std::vector<std::vector<ckpt::ViewRecorder::FileRun>>& runs,
                  std::vector<std::pair<uint64_t, uint64_t>>* spans) {
  spans->clear();
  ckpt::SortedAppend sorted(spans, std::less<std::pair<uint64_t, uint64_t>>());
  for (const auto& rank : runs) {
    for (const auto& r : rank) spans->push_back({r.offset, r.offset + r.length});
    sorted.Appended();
  }
  sorted.Finish();
  for (size_t i = 1; i < spans->size(); ++i) {
    if ((*spans)[i].first < (*spans)[i - 1].second) return true;
  }
  return false;
}

// Closes the descriptors it holds unless released.
struct Fds {
  std::vector<int> fds;
  ~Fds() {
    for (int fd : fds) ::close(fd);
  }
};

}  // namespace

absl::StatusOr<std::optional<ClientFileReads>> LeaveReadsToClients(
    const ckpt::LoadPlan& plan, ckpt::CachingSource& storage,
    const std::vector<Destination*>& ranks, const std::vector<RankDelivery>& parts,
    const std::vector<bool>& skip, bool verify) {
  const size_t n = plan.ranks.size();
  auto reads_files = [&](size_t r) {
    return r < ranks.size() && r < parts.size() && ranks[r]->reads_files() &&
           ranks[r]->views() != nullptr && parts[r].remote.has_value();
  };
  bool any = false;
  for (size_t r = 0; r < n; ++r) any = any || (!skip[r] && reads_files(r));
  if (!any) return std::nullopt;
  // Each read's copies: (plan rank, copy index).
  std::vector<std::vector<std::pair<uint32_t, uint32_t>>> by_read(plan.reads.size());
  for (size_t r = 0; r < n; ++r) {
    if (skip[r]) continue;
    for (size_t c = 0; c < plan.ranks[r].copies.size(); ++c) {
      by_read[plan.ranks[r].copies[c].read].push_back(
          {static_cast<uint32_t>(r), static_cast<uint32_t>(c)});
    }
  }
  ClientFileReads out;
  out.rank_bytes.assign(n, 0);
  std::vector<bool> left(plan.reads.size(), false);
  std::vector<std::vector<ckpt::ViewRecorder::FileRun>> runs(n);
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (size_t i = 0; i < plan.reads.size(); ++i) {
    const ckpt::ReadRange& rr = plan.reads[i];
    if (by_read[i].empty() || (verify && !rr.checks.empty())) continue;
    // Cached: its block's views serve it (a warm load cuts no runs).
    // ShareUncached below decides; this only saves the cutting.
    if (storage.Holds(plan.files[rr.file], rr.offset, rr.length)) continue;
    for (auto& v : runs) v.clear();
    bool ok = true;
    for (const auto& [r, c] : by_read[i]) {
      const ckpt::RankPlan& rp = plan.ranks[r];
      const ckpt::CopyOp& op = rp.copies[c];
      ok = reads_files(r) && op.target < parts[r].remote->targets.size() &&
           ckpt::AppendFileRuns(op, rp.targets[op.target],
                                parts[r].remote->targets[op.target].address,
                                kMaxRunsPerRead, &runs[r]) &&
           runs[r].size() <= kMaxRunsPerRead;
      if (!ok) break;
    }
    for (size_t r = 0; ok && r < n; ++r) {
      ok = runs[r].empty() || ranks[r]->views()->Room(runs[r].size());
    }
    // Bytes two ranks need (a replicated tensor) stay the daemon's: read once
    // for all of them, not once per client.
    if (!ok || RanksOverlap(runs, &spans)) continue;
    CKPT_ASSIGN_OR_RETURN(std::optional<ckpt::CachingSource::SharedFile> shared,
                          storage.ShareUncached(plan.files[rr.file], rr.offset, rr.length));
    if (!shared) continue;  // cached: its block's views serve it
    Fds fds{{shared->fd}};
    // One descriptor per rank (each closed when that rank's views go).
    std::vector<std::pair<size_t, int>> own;
    for (size_t r = 0; r < n; ++r) {
      if (runs[r].empty()) continue;
      const int fd = ::fcntl(shared->fd, F_DUPFD_CLOEXEC, 0);
      if (fd < 0) {
        return absl::ResourceExhaustedError(absl::StrCat(
            plan.files[rr.file], ": no descriptor for a client's read of it: ", strerror(errno)));
      }
      fds.fds.push_back(fd);
      own.push_back({r, fd});
    }
    fds.fds.resize(1);  // the copies are the recorders' from here on
    for (size_t k = 0; k < own.size(); ++k) {
      const auto [r, fd] = own[k];
      if (!ranks[r]->views()->RecordFile(rr.file, fd, shared->size, shared->path, shared->stamp,
                                         runs[r])) {
        for (size_t j = k + 1; j < own.size(); ++j) ::close(own[j].second);
        return absl::InternalError(absl::StrCat(plan.files[rr.file],
                                                ": a client's file view did not fit after all"));
      }
      for (const auto& run : runs[r]) out.rank_bytes[r] += run.length;
    }
    left[i] = true;
    ++out.reads;
    out.read_bytes += rr.length;
  }
  if (out.reads == 0) return std::nullopt;
  for (uint64_t b : out.rank_bytes) out.bytes += b;
  out.rest = WithoutReads(plan, left);
  return out;
}

}  // namespace ckptd
