#include "core/executor.h"

#include <atomic>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/safetensors.h"
#include "core/status_macros.h"

namespace ckpt {

absl::StatusOr<const RandomAccessFile*> DirectorySource::Get(const std::string& file) {
  absl::MutexLock lock(&mu_);
  auto it = files_.find(file);
  if (it != files_.end()) return it->second.get();
  CKPT_ASSIGN_OR_RETURN(auto f, OpenFile(JoinPath(dir_, file)));
  const RandomAccessFile* p = f.get();
  files_.emplace(file, std::move(f));
  return p;
}

absl::Status DirectorySource::Read(const std::string& file, uint64_t offset, uint64_t n,
                                   void* dst) {
  CKPT_ASSIGN_OR_RETURN(const RandomAccessFile* f, Get(file));
  return f->Read(offset, n, dst);
}

absl::StatusOr<LoadStats> ExecutePlan(const LoadPlan& plan, RangeSource& source,
                                      const std::vector<std::vector<void*>>& destinations,
                                      const ExecuteOptions& options) {
  if (destinations.size() != plan.ranks.size()) {
    return absl::InvalidArgumentError("ExecutePlan: one destination list per rank is required");
  }
  // Copies grouped by the read that feeds them.
  std::vector<std::vector<std::pair<uint32_t, uint32_t>>> by_read(plan.reads.size());
  for (uint32_t r = 0; r < plan.ranks.size(); ++r) {
    const RankPlan& rp = plan.ranks[r];
    if (destinations[r].size() != rp.targets.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("ExecutePlan: rank ", rp.rank, " has ", rp.targets.size(),
                       " targets but ", destinations[r].size(), " destinations"));
    }
    for (uint32_t c = 0; c < rp.copies.size(); ++c) {
      const CopyOp& op = rp.copies[c];
      if (destinations[r][op.target] == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("ExecutePlan: rank ", rp.rank, " tensor '",
                                                       rp.targets[op.target].name,
                                                       "' has no destination buffer"));
      }
      by_read[op.read].push_back({r, c});
    }
  }

  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  absl::Mutex mu;
  absl::Status first_error;
  LoadStats total;
  auto worker = [&]() {
    LoadStats local;
    std::vector<uint8_t> buf;
    while (!failed.load(std::memory_order_relaxed)) {
      size_t i = next.fetch_add(1);
      if (i >= plan.reads.size()) break;
      const ReadRange& rr = plan.reads[i];
      const std::string& file = plan.files[rr.file];
      if (buf.size() < rr.length) buf.resize(rr.length);
      auto t0 = std::chrono::steady_clock::now();
      absl::Status s = source.Read(file, rr.offset, rr.length, buf.data());
      auto t1 = std::chrono::steady_clock::now();
      if (s.ok() && options.verify_checksums) {
        for (const auto& c : rr.checks) {
          uint64_t got = Checksum(buf.data() + (c.offset - rr.offset), c.nbytes);
          if (got != c.xxh3) {
            s = absl::DataLossError(absl::StrCat(file, ": tensor '", c.tensor, "' bytes [",
                                                 c.offset, ", ", c.offset + c.nbytes,
                                                 ") fail their checksum (file corrupt or torn)"));
            break;
          }
          ++local.checksums_verified;
        }
      }
      if (s.ok()) {
        local.bytes_read += rr.length;
        for (const auto& [r, c] : by_read[i]) {
          const RankPlan& rp = plan.ranks[r];
          const CopyOp& op = rp.copies[c];
          const TargetTensor& t = rp.targets[op.target];
          int64_t n = CopyRegion(op.src, buf.data() + (op.src_offset - rr.offset), t.layout(),
                                 destinations[r][op.target], op.region);
          if (n != op.elements) {
            s = absl::InternalError(absl::StrCat("rank ", rp.rank, " tensor '", t.name,
                                                 "': copied ", n, " elements, planned ",
                                                 op.elements));
            break;
          }
          local.bytes_delivered += static_cast<uint64_t>(n) * DTypeSize(t.dtype);
        }
      }
      auto t2 = std::chrono::steady_clock::now();
      local.read_seconds += std::chrono::duration<double>(t1 - t0).count();
      local.copy_seconds += std::chrono::duration<double>(t2 - t1).count();
      if (!s.ok()) {
        absl::MutexLock lock(&mu);
        if (first_error.ok()) first_error = s;
        failed = true;
      }
    }
    absl::MutexLock lock(&mu);
    total.bytes_read += local.bytes_read;
    total.bytes_delivered += local.bytes_delivered;
    total.checksums_verified += local.checksums_verified;
    total.read_seconds += local.read_seconds;
    total.copy_seconds += local.copy_seconds;
  };
  int n_threads = std::max(1, std::min<int>(options.threads, static_cast<int>(plan.reads.size())));
  std::vector<std::thread> threads;
  for (int i = 1; i < n_threads; ++i) threads.emplace_back(worker);
  worker();
  for (auto& t : threads) t.join();
  if (!first_error.ok()) return first_error;
  return total;
}

}  // namespace ckpt
