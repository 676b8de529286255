#include "core/tools/offline.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/plan/aoa.h"
#include "core/exec/process_memory.h"
#include "core/format/safetensors.h"
#include "core/base/status_macros.h"
#include "core/write/writer.h"

namespace ckpt {
namespace {

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

absl::StatusOr<OfflineLoadResult> LoadOffline(const std::string& dir, const Layout& layout,
                                              const OfflineLoadOptions& options) {
  OfflineLoadResult res;
  auto t0 = std::chrono::steady_clock::now();
  OpenOptions oo;
  oo.unique_id = options.unique_id;
  oo.confine = options.confine;
  CKPT_ASSIGN_OR_RETURN(res.checkpoint, OpenCheckpoint(dir, oo));
  res.times.open_seconds = Since(t0);
  t0 = std::chrono::steady_clock::now();
  CKPT_ASSIGN_OR_RETURN(res.plan, PlanLoadWithAoa(res.checkpoint.metadata, options.aoa,
                                                  layout.ranks, options.plan, options.aoa_where));
  res.times.plan_seconds = Since(t0);
  t0 = std::chrono::steady_clock::now();
  res.buffers.resize(res.plan.ranks.size());
  std::vector<std::vector<void*>> dests(res.plan.ranks.size());
  // The buffers are zero-filled (std::vector) and so faulted in: spread
  // over the I/O threads, largest first, instead of one thread doing all.
  std::vector<std::pair<uint64_t, std::vector<uint8_t>*>> allocs;
  for (size_t r = 0; r < res.plan.ranks.size(); ++r) {
    const RankPlan& rp = res.plan.ranks[r];
    std::vector<bool> has_copy(rp.targets.size(), false);
    for (const CopyOp& c : rp.copies) has_copy[c.target] = true;
    res.buffers[r].tensors.resize(rp.targets.size());
    for (size_t t = 0; t < rp.targets.size(); ++t) {
      if (has_copy[t]) allocs.push_back({rp.targets[t].num_bytes(), &res.buffers[r].tensors[t]});
    }
  }
  std::sort(allocs.begin(), allocs.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  {
    std::atomic<size_t> next{0};
    auto work = [&] {
      for (size_t i; (i = next.fetch_add(1)) < allocs.size();) {
        allocs[i].second->resize(allocs[i].first, options.fill_byte.value_or(0));
      }
    };
    std::vector<std::thread> helpers;
    for (int i = 1; i < options.threads && static_cast<size_t>(i) < allocs.size(); ++i) {
      helpers.emplace_back(work);
    }
    work();
    for (auto& h : helpers) h.join();
  }
  for (size_t r = 0; r < res.plan.ranks.size(); ++r) {
    for (auto& buf : res.buffers[r].tensors) {
      dests[r].push_back(buf.empty() ? nullptr : buf.data());
    }
  }
  DirectorySource source(res.checkpoint.dir, SourceOptions{res.checkpoint.confine});
  ExecuteOptions eo;
  eo.threads = options.threads;
  eo.verify_checksums = options.verify_checksums;
  eo.piece_bytes = options.piece_bytes;
  eo.direct_io = options.direct_io;
  if (options.via_process_memory) {
    // The daemon's process_memory path, into this process's own buffers.
    CKPT_ASSIGN_OR_RETURN(auto self, ProcessMemory::Open({::getpid(), "this process"}));
    std::vector<RemoteRank> remote(dests.size());
    std::shared_ptr<RemoteMemory> memory(std::move(self));
    for (size_t r = 0; r < dests.size(); ++r) {
      remote[r].memory = memory;
      for (void* d : dests[r]) remote[r].targets.push_back({reinterpret_cast<uintptr_t>(d)});
    }
    ProcessDelivery delivery(std::make_unique<HostDelivery>(dests), std::move(remote));
    CKPT_ASSIGN_OR_RETURN(res.stats, ExecutePlan(res.plan, source, delivery, eo));
  } else {
    CKPT_ASSIGN_OR_RETURN(res.stats, ExecutePlan(res.plan, source, dests, eo));
  }
  res.times.load_seconds = Since(t0);
  return res;
}

absl::Status WriteRankOutputs(const OfflineLoadResult& result, const std::string& out_dir) {
  CKPT_RETURN_IF_ERROR(MakeDirs(out_dir));
  for (size_t r = 0; r < result.plan.ranks.size(); ++r) {
    const RankPlan& rp = result.plan.ranks[r];
    std::vector<TensorToWrite> tensors;
    for (size_t t = 0; t < rp.targets.size(); ++t) {
      const TargetTensor& tt = rp.targets[t];
      if (result.buffers[r].tensors[t].empty() && tt.num_bytes() != 0) continue;  // missing
      if (std::find(rp.missing_keys.begin(), rp.missing_keys.end(), tt.name) !=
          rp.missing_keys.end()) {
        continue;
      }
      tensors.push_back({tt.name, tt.dtype, tt.flat_range ? Shape{tt.num_elements()} : tt.box.shape,
                         result.buffers[r].tensors[t].data()});
    }
    CKPT_RETURN_IF_ERROR(
        WriteSafetensors(JoinPath(out_dir, absl::StrCat("rank", rp.rank, ".safetensors")), tensors,
                         {})
            .status());
  }
  return absl::OkStatus();
}

std::string LoadReportJson(const OfflineLoadResult& res) {
  nlohmann::json ranks = nlohmann::json::array();
  for (const RankPlan& rp : res.plan.ranks) {
    uint64_t bytes = 0;
    for (const CopyOp& c : rp.copies) {
      bytes += static_cast<uint64_t>(c.elements) * DTypeSize(rp.targets[c.target].dtype);
    }
    ranks.push_back({{"rank", rp.rank},
                     {"tensors", rp.targets.size() - rp.missing_keys.size()},
                     {"bytes", bytes},
                     {"missing_keys", rp.missing_keys},
                     {"local_fast_path", rp.local_fast_path}});
  }
  nlohmann::json j = {
      {"checkpoint", res.checkpoint.dir},
      {"format", FormatName(res.checkpoint.format)},
      {"bytes_read", res.stats.bytes_read},
      {"bytes_read_direct", res.stats.bytes_read_direct},
      {"bytes_delivered", res.stats.bytes_delivered},
      {"reads", res.plan.reads.size()},
      {"checksums_verified", res.stats.checksums_verified},
      {"missing_keys", res.plan.missing_keys},
      {"unexpected_keys", res.plan.unexpected_keys},
      {"renamed_keys", res.plan.renamed_keys},
      {"timings",
       {{"open_s", res.times.open_seconds},
        {"plan_s", res.times.plan_seconds},
        {"load_s", res.times.load_seconds},
        {"write_s", res.times.write_seconds}}},
      {"ranks", ranks}};
  if (res.checkpoint.unique_id) j["unique_id"] = *res.checkpoint.unique_id;
  return j.dump();
}

absl::Status ShardCheckpoint(const std::string& src_dir, const Layout& layout,
                             const std::string& out_dir, const ShardOptions& options) {
  OpenOptions oo;
  oo.unique_id = options.source_unique_id;
  oo.confine = options.confine;
  CKPT_ASSIGN_OR_RETURN(Checkpoint src, OpenCheckpoint(src_dir, oo));
  CKPT_ASSIGN_OR_RETURN(SavePlan save, PlanSave(layout.ranks, layout.world_size, options.unique_id,
                                                      options.checksum_block));
  CKPT_RETURN_IF_ERROR(MakeDirs(out_dir));
  // The user's own output path may hold symlinks: resolve it, then lock the
  // real directory and write through the locked descriptor.
  auto real = Storage::Default()->Canonical(out_dir);
  if (!real.ok()) {
    return absl::Status(real.status().code(),
                        absl::StrCat("cannot resolve the output directory: ",
                                     real.status().message()));
  }
  CKPT_ASSIGN_OR_RETURN(DirLock lock, LockDirectory(*real));
  if (absl::Status p = PrepareSave(*lock.directory(), save.unique_id, options.overwrite); !p.ok()) {
    return absl::Status(p.code(), absl::StrCat(p.message(), absl::IsAlreadyExists(p)
                                                                ? " (--overwrite replaces it)"
                                                                : ""));
  }
  DirectorySource source(src.dir, SourceOptions{src.confine});
  std::vector<std::pair<std::string, ShardMeta>> written;
  for (int r = 0; r < layout.world_size; ++r) {
    RankTargets rt;
    rt.rank = r;
    rt.tensors = save.writes[r];
    CKPT_ASSIGN_OR_RETURN(LoadPlan lp, PlanLoad(src.metadata, {rt}));
    if (!lp.missing_keys.empty()) {
      return absl::NotFoundError(absl::StrCat("shard: ", src_dir, " has no tensor(s) ",
                                              absl::StrJoin(lp.missing_keys, ", "),
                                              " named by the layout (rank ", r, ")"));
    }
    std::vector<std::vector<uint8_t>> bufs(rt.tensors.size());
    std::vector<std::vector<void*>> dests(1);
    std::vector<const void*> data;
    for (size_t i = 0; i < rt.tensors.size(); ++i) {
      bufs[i].resize(rt.tensors[i].num_bytes());
      dests[0].push_back(bufs[i].data());
      data.push_back(bufs[i].data());
    }
    ExecuteOptions eo;
    eo.threads = options.threads;
    CKPT_RETURN_IF_ERROR(ExecutePlan(lp, source, dests, eo).status());
    CKPT_ASSIGN_OR_RETURN(auto shards, WriteRankFile(lock.directory(), save, r, data));
    written.insert(written.end(), shards.begin(), shards.end());
  }
  return FinishSave(lock.directory(), save, written, src.metadata.flat_mapping);
}

}  // namespace ckpt
