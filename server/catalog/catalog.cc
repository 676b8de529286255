#include "server/catalog/catalog.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <set>
#include <string>

#include <spdlog/spdlog.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/io/file.h"
#include "core/plan/planner.h"
#include "core/base/status_macros.h"

namespace ckptd {
namespace {

// A Delivery that never copies (prefetch only warms the cache).
class NoDelivery final : public ckpt::Delivery {
 public:
  absl::StatusOr<int64_t> Copy(size_t, const ckpt::RankPlan&, const ckpt::CopyOp& op,
                               const uint8_t*) override {
    return op.elements;
  }
};

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

template <typename Request>
absl::StatusOr<Catalog::Readable> Catalog::OpenToRead(const Caller& caller,
                                                     const Request& request) const {
  Readable r;
  CKPT_ASSIGN_OR_RETURN(r.dir, p_.policy->ResolvePath(request.path()));
  CKPT_RETURN_IF_ERROR(p_.policy->CheckAccess(caller, r.dir, Policy::Access::kRead));
  std::optional<int64_t> uid;
  if (request.has_unique_id()) uid = request.unique_id();
  CKPT_ASSIGN_OR_RETURN(r.opened, p_.metadata->Open(r.dir, uid));
  return r;
}

absl::StatusOr<v1::InspectResponse> Catalog::Inspect(const Caller& caller,
                                                    const v1::InspectRequest& request) const {
  CKPT_ASSIGN_OR_RETURN(Readable r, OpenToRead(caller, request));
  const ckpt::Checkpoint& c = r.opened->checkpoint;
  v1::InspectResponse resp;
  resp.set_path(c.dir);
  resp.set_format(ckpt::FormatName(c.format));
  if (c.unique_id) resp.set_unique_id(*c.unique_id);
  for (int64_t v : c.versions) resp.add_versions(v);
  uint64_t total = 0;
  for (const auto& [name, t] : c.metadata.tensors) {
    v1::TensorInfo* ti = resp.add_tensors();
    ti->set_name(name);
    ti->set_dtype(std::string(ckpt::DTypeName(t.dtype)));
    for (int64_t d : t.global_shape) ti->add_global_shape(d);
    uint64_t bytes = 0;
    for (const ckpt::ShardMeta& s : t.shards) {
      v1::ShardInfo* si = ti->add_shards();
      si->set_file(s.file);
      for (int64_t d : s.box.offset) si->add_offset(d);
      for (int64_t d : s.box.shape) si->add_shape(d);
      si->set_dtype(std::string(ckpt::DTypeName(s.dtype)));
      if (s.flat_range) {
        si->mutable_flat_range()->set_begin(s.flat_range->begin);
        si->mutable_flat_range()->set_end(s.flat_range->end);
      }
      si->set_replica_id(s.replica_id);
      si->set_data_offset(s.data_offset);
      si->set_nbytes(s.nbytes);
      if (s.replica_id == 0) bytes += s.nbytes;
      (*resp.mutable_files())[s.file] += s.nbytes;
    }
    ti->set_bytes(bytes);
    total += bytes;
  }
  resp.set_total_bytes(total);
  return resp;
}

absl::StatusOr<v1::ReadCheckpointFileResponse> Catalog::ReadCheckpointFile(
    const Caller& caller, const v1::ReadCheckpointFileRequest& request) const {
  CKPT_ASSIGN_OR_RETURN(Readable r, OpenToRead(caller, request));
  const std::string& dir = r.dir;
  const auto& opened = r.opened;
  const ckpt::Checkpoint& c = opened->checkpoint;
  const std::string& name = request.file();
  const std::string path = ckpt::JoinPath(dir, name);
  // Only the checkpoint's own files, by the identity they were read with:
  // the data files its metadata names, else the files OpenCheckpoint read
  // (its metadata or index file).
  const ckpt::FileStamp* stamp = nullptr;
  if (auto it = opened->stamps.find(name); it != opened->stamps.end()) {
    stamp = &it->second;
  } else if (auto it = c.file_stamps.find(name); it != c.file_stamps.end()) {
    stamp = &it->second;
  }
  if (stamp == nullptr) {
    return absl::NotFoundError(absl::StrCat(path, ": not a file of the checkpoint (its metadata "
                                            "file or a data file its metadata names)"));
  }
  const uint64_t offset = request.offset();
  if (request.length() == 0 || request.length() > kMaxFileRead) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", request.length(),
                                                   " bytes asked for; a read is 1 to ",
                                                   kMaxFileRead, " bytes"));
  }
  if (offset > stamp->size) {
    return absl::OutOfRangeError(absl::StrCat(path, ": offset ", offset,
                                              " is past the end of the file's ", stamp->size,
                                              " bytes"));
  }
  const uint64_t n = std::min<uint64_t>(request.length(), stamp->size - offset);
  v1::ReadCheckpointFileResponse resp;
  resp.set_file_size(stamp->size);
  if (n == 0) return resp;
  ckpt::SourceOptions options;
  options.tenant = caller.uid;
  ckpt::CachingSource source(dir, p_.cache, {{name, *stamp}}, options);
  std::vector<uint8_t> scratch;
  // No verify function: the bytes are read into scratch, never kept, and
  // the file is checked unchanged after the read.
  CKPT_ASSIGN_OR_RETURN(ckpt::RangeView view, source.Fetch(name, offset, n, scratch, nullptr));
  CKPT_RETURN_IF_ERROR(source.CheckOpenedFilesUnchanged());
  resp.set_data(view.data, n);
  return resp;
}

absl::StatusOr<v1::PrefetchResponse> Catalog::Prefetch(const Caller& caller,
                                                      const v1::PrefetchRequest& request) {
  const auto t0 = std::chrono::steady_clock::now();
  CKPT_ASSIGN_OR_RETURN(Readable r, OpenToRead(caller, request));
  const std::string& dir = r.dir;
  const auto& opened = r.opened;
  const auto& meta = opened->checkpoint.metadata;
  ckpt::RankTargets rt;
  std::set<std::string> wanted(request.tensors().begin(), request.tensors().end());
  for (const std::string& w : wanted) {
    if (!meta.tensors.count(w)) {
      return absl::NotFoundError(absl::StrCat(dir, " has no tensor '", w, "'"));
    }
  }
  for (const auto& [name, t] : meta.tensors) {
    if (!wanted.empty() && !wanted.count(name)) continue;
    rt.tensors.push_back(ckpt::TargetTensor{name, t.dtype, t.global_shape,
                                      ckpt::Box{ckpt::Shape(t.global_shape.size(), 0), t.global_shape},
                                      std::nullopt});
  }
  ckpt::PlanOptions po;
  po.max_read_bytes = p_.io_request_size;
  CKPT_ASSIGN_OR_RETURN(ckpt::LoadPlan plan, ckpt::PlanLoad(meta, {rt}, po));
  ckpt::SourceOptions options;
  options.tenant = caller.uid;
  ckpt::CachingSource source(dir, p_.cache, opened->stamps, options);
  NoDelivery none;
  ckpt::ExecuteOptions eo;
  eo.threads = p_.io_threads;
  eo.direct_io = p_.direct_io;
  CKPT_ASSIGN_OR_RETURN(ckpt::LoadStats stats, ckpt::ExecutePlan(plan, source, none, eo));
  *p_.bytes_read_total += stats.bytes_read;
  v1::PrefetchResponse resp;
  resp.set_bytes_read(stats.bytes_read);
  uint64_t cached = 0;
  for (const auto& [path, be] : p_.cache->Files()) {
    if (absl::StartsWith(path, dir + "/")) cached += be.first;
  }
  resp.set_bytes_cached(cached);
  resp.set_seconds(Seconds(t0));
  spdlog::info("prefetch path={} read={}B cached={}B in {:.3f}s", dir, stats.bytes_read, cached,
               resp.seconds());
  return resp;
}

absl::StatusOr<v1::EvictResponse> Catalog::Evict(const Caller& caller,
                                                const v1::EvictRequest& request) {
  CKPT_ASSIGN_OR_RETURN(std::string dir, p_.policy->ResolvePath(request.path()));
  // Dropping cached data slows everyone's next load: admins, or who may save there.
  if (!p_.policy->IsAdmin(caller)) CKPT_RETURN_IF_ERROR(p_.policy->CheckAccess(caller, dir, Policy::Access::kSave));
  const std::string prefix = dir == "/" ? dir : dir + "/";
  // A background fill of these checkpoints ends first: nothing is put back
  // behind the eviction (laid-out copies not begun are not made at all).
  p_.filler->DropWork(prefix);
  if (!p_.filler->Wait(prefix, absl::Minutes(1))) {
    return absl::DeadlineExceededError(absl::StrCat(
        "Evict ", dir, ": a background cache fill there did not finish within 1 minute"));
  }
  auto [bytes, entries] = p_.cache->EvictPrefix(prefix);
  p_.metadata->Drop(dir);
  spdlog::info("evict path={} freed={}B entries={}", dir, bytes, entries);
  v1::EvictResponse resp;
  resp.set_bytes_freed(bytes);
  resp.set_entries_freed(entries);
  return resp;
}

}  // namespace ckptd
