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

absl::StatusOr<LoadStats> ExecutePlan(const LoadPlan& plan, RangeSource& source,
                                      Delivery& delivery, const ExecuteOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  // Copies grouped by the read that feeds them.
  std::vector<std::vector<std::pair<uint32_t, uint32_t>>> by_read(plan.reads.size());
  for (uint32_t r = 0; r < plan.ranks.size(); ++r) {
    const RankPlan& rp = plan.ranks[r];
    for (uint32_t c = 0; c < rp.copies.size(); ++c) by_read[rp.copies[c].read].push_back({r, c});
  }

  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  absl::Mutex mu;
  absl::Status first_error;
  LoadStats total;
  total.rank_bytes_delivered.assign(plan.ranks.size(), 0);
  auto worker = [&]() {
    LoadStats local;
    local.rank_bytes_delivered.assign(plan.ranks.size(), 0);
    std::vector<uint8_t> scratch;
    std::vector<uint8_t> skip_memo(plan.ranks.size(), 0);  // 0 unknown, 1 run, 2 skip
    std::vector<uint32_t> memo_touched;
    while (!failed.load(std::memory_order_relaxed)) {
      for (uint32_t r : memo_touched) skip_memo[r] = 0;
      memo_touched.clear();
      size_t i = next.fetch_add(1);
      if (i >= plan.reads.size()) break;
      if (options.deadline && std::chrono::steady_clock::now() > *options.deadline) {
        absl::MutexLock lock(&mu);
        if (first_error.ok()) {
          first_error = absl::DeadlineExceededError(absl::StrCat(
              "load did not finish in time: ", i, " of ", plan.reads.size(), " reads done"));
        }
        failed = true;
        break;
      }
      const ReadRange& rr = plan.reads[i];
      const std::string& file = plan.files[rr.file];
      int64_t verified = 0;
      auto verify = [&](const uint8_t* data) -> absl::Status {
        if (!options.verify_checksums) return absl::OkStatus();
        for (const auto& c : rr.checks) {
          if (Checksum(data + (c.offset - rr.offset), c.nbytes) != c.xxh3) {
            return absl::DataLossError(absl::StrCat(file, ": tensor '", c.tensor, "' bytes [",
                                                    c.offset, ", ", c.offset + c.nbytes,
                                                    ") fail their checksum (file corrupt or torn)"));
          }
          ++verified;
        }
        return absl::OkStatus();
      };
      auto t0 = std::chrono::steady_clock::now();
      absl::StatusOr<RangeView> view = source.Fetch(file, rr.offset, rr.length, scratch, verify);
      auto t1 = std::chrono::steady_clock::now();
      absl::Status s = view.status();
      if (s.ok()) {
        local.checksums_verified += verified;
        (view->from_storage ? local.bytes_read : local.bytes_from_cache) += rr.length;
        for (const auto& [r, c] : by_read[i]) {
          // skip_rank may be costly (a gRPC cancellation check): ask once per
          // rank per read.
          if (options.skip_rank) {
            if (skip_memo[r] == 0) {
              skip_memo[r] = options.skip_rank(r) ? 2 : 1;
              memo_touched.push_back(r);
            }
            if (skip_memo[r] == 2) continue;
          }
          const RankPlan& rp = plan.ranks[r];
          const CopyOp& op = rp.copies[c];
          absl::StatusOr<int64_t> n =
              delivery.Copy(r, rp, op, view->data + (op.src_offset - rr.offset));
          if (!n.ok()) {
            s = n.status();
            break;
          }
          if (*n != op.elements) {
            s = absl::InternalError(absl::StrCat("rank ", rp.rank, " tensor '",
                                                 rp.targets[op.target].name, "': copied ", *n,
                                                 " elements, planned ", op.elements));
            break;
          }
          uint64_t bytes = static_cast<uint64_t>(*n) * DTypeSize(rp.targets[op.target].dtype);
          local.bytes_delivered += bytes;
          local.rank_bytes_delivered[r] += bytes;
        }
        absl::Status flushed = delivery.Flush();
        if (s.ok()) s = flushed;
      }
      auto t2 = std::chrono::steady_clock::now();
      local.read_seconds += std::chrono::duration<double>(t1 - t0).count();
      local.copy_seconds += std::chrono::duration<double>(t2 - t1).count();
      if (options.progress_bytes) options.progress_bytes->fetch_add(rr.length);
      if (!s.ok()) {
        absl::MutexLock lock(&mu);
        if (first_error.ok()) first_error = s;
        failed = true;
      }
    }
    absl::MutexLock lock(&mu);
    total.bytes_read += local.bytes_read;
    total.bytes_from_cache += local.bytes_from_cache;
    total.bytes_delivered += local.bytes_delivered;
    for (size_t r = 0; r < plan.ranks.size(); ++r) {
      total.rank_bytes_delivered[r] += local.rank_bytes_delivered[r];
    }
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
  total.wall_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return total;
}

}  // namespace ckpt
