#include "server/daemon.h"
#include "server/daemon_internal.h"
#include "ckptd_version.h"
#include "proto/fd_socket.h"
#include "server/metrics.h"

#include <fcntl.h>
#include <linux/capability.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <limits>
#include <thread>
#include <tuple>

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/aoa.h"
#include "core/executor.h"
#include "core/file.h"
#include "core/foreign.h"
#include "core/status_macros.h"
#include "core/torch_dcp.h"
#include "core/writer.h"

namespace ckptd {

using ckpt::Box;
using ckpt::DType;
using ckpt::TargetTensor;

namespace {

// SaveRequest.format of a PyTorch DCP checkpoint (ckptd.torch.DaemonStorageWriter).
constexpr char kDcpFormat[] = "pytorch-dcp";
// Names the save job whose DCP data files a directory holds until its commit:
// the commit must come from that job, so two saves racing into one directory
// fail instead of committing one's metadata over the other's files.
constexpr char kDcpPending[] = ".ckptd-dcp-pending";

// ALREADY_EXISTS text for a DCP save into a directory holding a committed one.
std::string DcpCheckpointExists(const std::string& dir) {
  return absl::StrCat(dir, " already holds a PyTorch DCP checkpoint (.metadata); save elsewhere "
                      "or set overwrite");
}

ckpt::Shape ToShape(const google::protobuf::RepeatedField<int64_t>& r) {
  return ckpt::Shape(r.begin(), r.end());
}

// Why a process_memory destination cannot be used. Where the kernel
// refuses (another uid, no pidfd), FAILED_PRECONDITION before the job
// registers: the client then falls back to shm (docs/grpc-api.md, "Transports").
// Whether this process holds CAP_SYS_PTRACE in its effective set.
bool HasCapSysPtrace() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
  if (::syscall(SYS_capget, &header, data) != 0) return true;  // unknown: assume the worst
  return (data[CAP_SYS_PTRACE / 32].effective & (1u << (CAP_SYS_PTRACE % 32))) != 0;
}

absl::Status ToProcessMemoryError(const absl::Status& s, const std::string& who) {
  if (absl::IsPermissionDenied(s) || absl::IsFailedPrecondition(s)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "process_memory unavailable for ", who, ": ", s.message(), "; use shm"));
  }
  return s;
}

// A Delivery that never copies (prefetch only warms the cache).
class NoDelivery final : public ckpt::Delivery {
 public:
  absl::StatusOr<int64_t> Copy(size_t, const ckpt::RankPlan&, const ckpt::CopyOp& op,
                               const uint8_t*) override {
    return op.elements;
  }
};

}  // namespace

// --- MappedSegment -----------------------------------------------------------

absl::StatusOr<std::unique_ptr<MappedSegment>> MappedSegment::Map(int fd, uint64_t size,
                                                                  const std::string& what) {
  // A segment the client could shrink would fault (SIGBUS) under our copies,
  // and a hugetlbfs or on-disk file can fault for lack of memory or space:
  // only sealed memfds on tmpfs (checked before anything else is asked of it).
  if (absl::Status sealed = CheckSealedSegment(fd, what); !sealed.ok()) {
    ::close(fd);
    return sealed;
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(what, ": fstat: ", std::strerror(errno)));
  }
  if (static_cast<uint64_t>(st.st_size) < size) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(what, " holds ", st.st_size,
                                                   " bytes but the request declares ", size));
  }
  if (size == 0) {
    ::close(fd);
    return std::unique_ptr<MappedSegment>(new MappedSegment(nullptr, 0));
  }
  // MAP_POPULATE: the client has touched its pages; building our page tables
  // up front is several times faster than one fault per 4 KiB during copies.
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": mmap: ", std::strerror(errno)));
  }
  return std::unique_ptr<MappedSegment>(new MappedSegment(static_cast<uint8_t*>(p), size));
}

namespace {
// Unmaps client segments on a background thread: tearing down the page
// tables of a job's segments (8 x 64 MiB: ~20 ms) would otherwise delay
// the reply of the handler that drops the job last.
class Unmapper {
 public:
  static Unmapper& Get() {
    static Unmapper* u = new Unmapper;  // never destroyed: its thread outlives main
    return *u;
  }
  void Unmap(void* p, size_t n) {
    absl::MutexLock lock(&mu_);
    if (queue_.size() >= kMaxQueued) {  // behind: do it here
      ::munmap(p, n);
      return;
    }
    queue_.push_back({p, n});
  }

 private:
  static constexpr size_t kMaxQueued = 256;
  Unmapper() {
    std::thread([this] {
      while (true) {
        std::pair<void*, size_t> job;
        {
          absl::MutexLock lock(&mu_);
          mu_.Await(absl::Condition(
              +[](std::deque<std::pair<void*, size_t>>* q) { return !q->empty(); }, &queue_));
          job = queue_.front();
          queue_.pop_front();
        }
        ::munmap(job.first, job.second);
      }
    }).detach();
  }
  absl::Mutex mu_;
  std::deque<std::pair<void*, size_t>> queue_ ABSL_GUARDED_BY(mu_);
};
}  // namespace

std::unique_ptr<MappedSegment> MappedSegment::Borrow(std::shared_ptr<Arena> arena) {
  std::unique_ptr<MappedSegment> m(new MappedSegment(arena->data(), arena->size()));
  m->arena_ = std::move(arena);
  return m;
}

MappedSegment::~MappedSegment() {
  if (data_ != nullptr && arena_ == nullptr && owner_ == nullptr) {
    Unmapper::Get().Unmap(data_, size_);
  }
}

// --- Jobs ------------------------------------------------------------------

namespace {
gpu::GpuOptions GpuOptionsOf(const DaemonConfig& c) {
  gpu::GpuOptions o;
  const char* pin = std::getenv("CKPTD_PIN_CACHE");  // "0": keep the data cache pageable
  o.pin_cache = pin == nullptr || std::string(pin) != "0";
  o.pinned_limit = c.cache_budget + 2 * o.pinned_chunk;  // room for fragmentation
  return o;
}
}  // namespace

Daemon::Daemon(DaemonConfig config)
    : config_(std::move(config)),
      direct_io_(ckpt::ParseDirectIo(config_.direct_io).value_or(ckpt::DirectIo::kNever)),
      started_(absl::Now()),
      gpu_(gpu::CreateGpuRuntime(GpuOptionsOf(config_))),
      cache_(config_.cache_budget, gpu_->host_allocator()),
      arenas_(std::make_unique<ArenaPool>(config_.arena_pool, config_.arena_limit)),
      filler_(std::make_unique<CacheFiller>(&cache_)) {}

Daemon::~Daemon() { Stop(); }

absl::Status Daemon::Start() {
  spdlog::info("gpu: {}", gpu_->Describe());
  if (gpu_->device_count() > 0 && config_.nccl_device >= gpu_->device_count()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config: nccl_device ", config_.nccl_device, " but this daemon sees ",
        gpu_->device_count(), " CUDA device(s) (check CUDA_VISIBLE_DEVICES)"));
  }
  CKPT_ASSIGN_OR_RETURN(auto tls, ReadPeerTls());
  UsePeerTls(std::move(tls));
  if (!config_.socket.empty()) {
    // An fd token outlives the longest barrier wait of the load naming it.
    const absl::Duration ttl = config_.testing_fd_token_ttl > absl::ZeroDuration()
                                   ? config_.testing_fd_token_ttl
                                   : config_.barrier_timeout + absl::Minutes(1);
    CKPT_ASSIGN_OR_RETURN(fd_receiver_, FdReceiver::Start(FdSocketPath(config_.socket),
                                                          config_.socket_mode, ttl,
                                                          arenas_.get(), FdReceiverLimits(),
                                                          &view_leases_));
  }
  return absl::OkStatus();
}

void Daemon::Stop() {
  if (fd_receiver_) fd_receiver_->Stop();
  filler_->Stop();
  {
    absl::MutexLock lock(&save_mu_);
    persist_stop_ = true;
  }
  if (persist_thread_.joinable()) persist_thread_.join();
}

const std::string* Daemon::RootOf(const std::string& real, std::string* real_root) const {
  const std::string* best = nullptr;
  std::string best_real;
  for (const std::string& root : config_.roots) {
    char rb[PATH_MAX];
    std::string r = ::realpath(root.c_str(), rb) != nullptr ? std::string(rb) : root;
    const bool under = real == r || absl::StartsWith(real, r == "/" ? r : r + "/");
    if (under && (best == nullptr || r.size() > best_real.size())) {
      best = &root;
      best_real = std::move(r);
    }
  }
  if (real_root != nullptr) *real_root = std::move(best_real);
  return best;
}

absl::StatusOr<std::string> Daemon::ResolvePath(const std::string& path) const {
  if (path.empty()) return absl::InvalidArgumentError("checkpoint path is empty");
  // A relative path names a checkpoint under the first root, so a multi-node
  // job can name node-local directories that live at different places.
  const std::string full = path[0] == '/' ? path : ckpt::JoinPath(config_.roots.front(), path);
  char buf[PATH_MAX];
  if (::realpath(full.c_str(), buf) == nullptr) {
    std::string msg = absl::StrCat(path, ": ", std::strerror(errno));
    return errno == ENOENT ? absl::NotFoundError(msg) : absl::InvalidArgumentError(msg);
  }
  std::string real = buf;
  if (RootOf(real, nullptr) != nullptr) return real;
  return absl::PermissionDeniedError(absl::StrCat(
      path, " (", real, ") is outside the checkpoint roots this daemon serves (",
      absl::StrJoin(config_.roots, ", "), ")"));
}

// --- Callers: access and limits (docs/security.md) --------------------------

bool Daemon::IsAdmin(const Caller& caller) const {
  if (caller.via == Caller::Via::kSelf) return true;
  if (caller.via != Caller::Via::kUnix) return false;  // TCP callers are never admins
  if (caller.uid == ::geteuid()) return true;
  return std::find(config_.admin_uids.begin(), config_.admin_uids.end(), caller.uid) !=
         config_.admin_uids.end();
}

namespace {
bool Contains(const std::vector<uint32_t>& v, uint32_t x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}
bool AnyGroup(const Caller& c, const std::vector<uint32_t>& gids) {
  for (uint32_t g : gids) {
    if (c.InGroup(g)) return true;
  }
  return false;
}
// The mode bits that apply to `c` for a file with `st` (owner, group, other).
mode_t ModeFor(const Caller& c, const struct stat& st) {
  if (st.st_uid == c.uid) return (st.st_mode >> 6) & 7;
  if (c.InGroup(st.st_gid)) return (st.st_mode >> 3) & 7;
  return st.st_mode & 7;
}
}  // namespace

absl::Status Daemon::CheckAccess(const Caller& caller, const std::string& resolved,
                                 Access access) const {
  if (caller.via == Caller::Via::kSelf) return absl::OkStatus();
  const char* verb = access == Access::kRead ? "read" : "write";
  // The configured root holding `resolved` (ResolvePath checked there is one).
  std::string root;
  const std::string* configured = RootOf(resolved, &root);
  if (configured == nullptr) {
    return absl::PermissionDeniedError(
        absl::StrCat(resolved, " is outside the checkpoint roots this daemon serves"));
  }
  const RootAccess* rule = nullptr;
  for (const RootAccess& a : config_.access) {
    if (a.root == *configured) rule = &a;
  }
  bool allowed = false;
  if (caller.uid == 0 && caller.via == Caller::Via::kUnix) {
    allowed = true;  // root may always
  } else if (rule != nullptr) {
    allowed = Contains(rule->save_uids, caller.uid) || AnyGroup(caller, rule->save_gids);
    if (access == Access::kRead) {
      allowed = allowed || Contains(rule->read_uids, caller.uid) || AnyGroup(caller, rule->read_gids);
    }
  } else {
    // Default rule: the daemon's own uid reads and saves; members of the
    // socket file's group read.
    allowed = caller.via == Caller::Via::kUnix && caller.uid == ::geteuid();
    struct stat sock;
    if (!allowed && access == Access::kRead && caller.via == Caller::Via::kUnix &&
        !config_.socket.empty() && ::stat(config_.socket.c_str(), &sock) == 0) {
      allowed = caller.InGroup(sock.st_gid);
    }
  }
  if (!allowed) {
    return absl::PermissionDeniedError(absl::StrCat(
        caller.Describe(), " may not ", verb, " checkpoints under ", root,
        rule != nullptr ? " (its 'access' entry does not list this uid or its groups)"
                        : " (default rule: only the daemon's uid, root and, for reading, the "
                          "socket's group; add an 'access' entry for this root)"));
  }
  if (caller.uid == 0 && caller.via == Caller::Via::kUnix) return absl::OkStatus();
  // The file system's own answer for this uid: the directory's mode bits
  // (reading needs r-x on the checkpoint directory, saving w-x on the
  // directory that receives the files).
  struct stat st;
  if (::stat(resolved.c_str(), &st) == 0) {
    const mode_t need = access == Access::kRead ? 5 : 3;
    if ((ModeFor(caller, st) & need) != need) {
      return absl::PermissionDeniedError(absl::StrCat(caller.Describe(), " may not ", verb, " ",
                                                      resolved, " (its mode bits do not allow it)"));
    }
  }
  return absl::OkStatus();
}

Daemon::Reservation::~Reservation() {
  absl::MutexLock lock(&d_->mu_);
  auto it = d_->usage_.find(uid_);
  if (it != d_->usage_.end()) {
    it->second.ranks -= 1;
    it->second.bytes -= bytes_;
    if (it->second.ranks == 0) d_->usage_.erase(it);
  }
  d_->stream_bytes_ -= stream_;
}

absl::StatusOr<std::unique_ptr<Daemon::Reservation>> Daemon::Reserve(const Caller& caller,
                                                                      const std::string& who,
                                                                      uint64_t bytes,
                                                                      uint64_t stream_bytes) {
  const Limits& l = config_.limits;
  absl::MutexLock lock(&mu_);
  UidUsage& u = usage_[caller.uid];
  auto refuse = [&](absl::Status s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (u.ranks == 0) usage_.erase(caller.uid);
    return s;
  };
  if (u.ranks + 1 > l.max_ranks_per_uid) {
    return refuse(absl::ResourceExhaustedError(absl::StrCat(
        who, ": ", caller.Describe(), " already has ", u.ranks,
        " Load/Save calls waiting or running (limits.max_ranks_per_uid ", l.max_ranks_per_uid, ")")));
  }
  if (u.bytes + bytes > l.max_uid_bytes) {
    return refuse(absl::ResourceExhaustedError(absl::StrCat(
        who, ": ", bytes, " destination bytes on top of the ", u.bytes, " that ", caller.Describe(),
        " has in flight exceed limits.max_uid_bytes ", l.max_uid_bytes)));
  }
  if (stream_bytes_ + stream_bytes > l.max_stream_bytes) {
    return refuse(absl::ResourceExhaustedError(absl::StrCat(
        who, ": streaming ", stream_bytes, " bytes on top of the ", stream_bytes_,
        " in flight would exceed limits.max_stream_bytes ", l.max_stream_bytes,
        " (use a shared-memory destination for large loads)")));
  }
  u.ranks += 1;
  u.bytes += bytes;
  stream_bytes_ += stream_bytes;
  return std::make_unique<Reservation>(this, caller.uid, bytes, stream_bytes);
}

absl::StatusOr<uint64_t> Daemon::CheckRequestLimits(
    const std::string& who, const google::protobuf::RepeatedPtrField<v1::Target>& targets,
    int world_size, int node_ranks, uint32_t barrier_timeout_ms) const {
  const Limits& l = config_.limits;
  if (static_cast<uint64_t>(targets.size()) > l.max_targets_per_request) {
    return absl::ResourceExhaustedError(absl::StrCat(who, ": ", targets.size(),
                                                     " targets exceed limits.max_targets_per_request ",
                                                     l.max_targets_per_request));
  }
  if (absl::Milliseconds(barrier_timeout_ms) > l.max_barrier_timeout) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": barrier_timeout_ms ", barrier_timeout_ms, " is above limits.max_barrier_timeout ",
        absl::FormatDuration(l.max_barrier_timeout)));
  }
  const uint64_t ranks_here = node_ranks > 0 ? node_ranks : std::max(world_size, 0);
  if (ranks_here > l.max_ranks_per_job) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": ", ranks_here, node_ranks > 0 ? " node_ranks" : " ranks (world_size, no node_ranks)",
        " on this daemon exceed limits.max_ranks_per_job ", l.max_ranks_per_job));
  }
  // Destination bytes from the shapes alone (nothing allocated yet).
  uint64_t total = 0;
  for (const v1::Target& t : targets) {
    uint64_t n = 1;
    bool overflow = false;
    if (t.has_flat_range()) {  // a range of the flattened box
      n = t.flat_range().end() > t.flat_range().begin()
              ? static_cast<uint64_t>(t.flat_range().end()) -
                    static_cast<uint64_t>(t.flat_range().begin())
              : 0;
    } else {
      for (int64_t d : t.shape()) {
        if (d < 0) break;  // ValidateTarget names it
        if (d != 0 && n > (UINT64_MAX >> 4) / static_cast<uint64_t>(d)) overflow = true;
        n = overflow ? 0 : n * static_cast<uint64_t>(d);
      }
    }
    auto dt = ckpt::ParseDType(t.dtype());
    const uint64_t item = dt.ok() ? ckpt::DTypeSize(*dt) : 1;
    if (overflow || (n != 0 && n > (UINT64_MAX >> 4) / item)) {
      return absl::ResourceExhaustedError(
          absl::StrCat(who, " tensor '", t.name(), "': its box has more bytes than fit in 60 bits"));
    }
    total += n * item;
    if (total > l.max_request_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          who, ": the targets need ", total, "+ destination bytes (tensor '", t.name(),
          "' among them), above limits.max_request_bytes ", l.max_request_bytes));
    }
  }
  return total;
}

absl::StatusOr<std::shared_ptr<const Daemon::OpenedCheckpoint>> Daemon::OpenCached(
    const std::string& dir, std::optional<int64_t> unique_id, bool all_files_local) {
  const auto key = std::make_pair(dir + (all_files_local ? "" : "\n(partial)"),
                                  unique_id.value_or(-1));
  std::shared_ptr<const OpenedCheckpoint> cached;
  {
    absl::MutexLock lock(&meta_mu_);
    auto it = meta_cache_.find(key);
    if (it != meta_cache_.end()) {
      cached = it->second.opened;
      it->second.last_used = ++meta_tick_;
    }
  }
  if (cached != nullptr) {
    // Stat outside the lock: one slow mount must not hold up other loads.
    bool fresh = true;
    for (const auto& [path, stamp] : cached->watched) {
      auto now = ckpt::StatFile(path);
      if (!now.ok() || *now != stamp) {
        fresh = false;
        break;
      }
    }
    for (const auto& [file, stamp] : cached->stamps) {
      if (!fresh) break;
      auto now = ckpt::StatFile(ckpt::JoinPath(dir, file));
      if (!now.ok() || *now != stamp) fresh = false;
    }
    if (fresh) return cached;
    absl::MutexLock lock(&meta_mu_);
    auto it = meta_cache_.find(key);
    if (it != meta_cache_.end() && it->second.opened == cached) meta_cache_.erase(it);
    spdlog::info("metadata of {} changed on disk; reopening", dir);
  }
  auto opened = std::make_shared<OpenedCheckpoint>();
  // Stamp the directory first: a change racing with the open invalidates.
  CKPT_ASSIGN_OR_RETURN(opened->watched[dir], ckpt::StatFile(dir));
  ckpt::OpenOptions oo;
  oo.unique_id = unique_id;
  oo.check_data_files = all_files_local;
  oo.max_metadata_bytes = config_.limits.max_metadata_bytes;
  oo.confine = true;  // every file beneath the checkpoint directory, no symlinks
  CKPT_ASSIGN_OR_RETURN(opened->checkpoint, ckpt::OpenCheckpoint(dir, oo));
  // The identity of each file as OpenCheckpoint read it (from its
  // descriptor); a stat only for files it did not read.
  const auto& read = opened->checkpoint.file_stamps;
  auto stamp_of = [&](const std::string& name) -> absl::StatusOr<ckpt::FileStamp> {
    auto it = read.find(name);
    if (it != read.end()) return it->second;
    return ckpt::StatFile(ckpt::JoinPath(dir, name));
  };
  if (!opened->checkpoint.metadata_file.empty()) {
    const std::string mp = ckpt::JoinPath(dir, opened->checkpoint.metadata_file);
    CKPT_ASSIGN_OR_RETURN(opened->watched[mp], stamp_of(opened->checkpoint.metadata_file));
  }
  const std::string index = ckpt::JoinPath(dir, "model.safetensors.index.json");
  if (auto st = stamp_of("model.safetensors.index.json"); st.ok()) opened->watched[index] = *st;
  for (const std::string& f : opened->checkpoint.data_files) {
    auto st = stamp_of(f);
    if (!st.ok() && !all_files_local && absl::IsNotFound(st.status())) continue;
    CKPT_RETURN_IF_ERROR(st.status());
    opened->stamps[f] = *st;
  }
  absl::MutexLock lock(&meta_mu_);
  meta_cache_[key] = MetaEntry{opened, ++meta_tick_};
  // Least recently used entries beyond limits.metadata_cache_entries go.
  while (meta_cache_.size() > std::max<uint64_t>(1, config_.limits.metadata_cache_entries)) {
    auto oldest = meta_cache_.begin();
    for (auto it = meta_cache_.begin(); it != meta_cache_.end(); ++it) {
      if (it->second.last_used < oldest->second.last_used) oldest = it;
    }
    meta_cache_.erase(oldest);
  }
  return std::shared_ptr<const OpenedCheckpoint>(opened);
}

void Daemon::DropCachedMetadata(const std::string& dir) {
  // By path component: ".../run1" keeps ".../run10"; keys of partial opens
  // are the directory + "\n(partial)".
  const std::string prefix = dir == "/" ? dir : dir + "/";
  absl::MutexLock lock(&meta_mu_);
  for (auto it = meta_cache_.begin(); it != meta_cache_.end();) {
    const std::string& p = it->first.first;
    const bool under = p == dir || absl::StartsWith(p, dir + "\n") || absl::StartsWith(p, prefix);
    it = under ? meta_cache_.erase(it) : std::next(it);
  }
}

absl::StatusOr<v1::InspectResponse> Daemon::Inspect(const Caller& caller,
                                                    const v1::InspectRequest& request) {
  CKPT_ASSIGN_OR_RETURN(std::string dir, ResolvePath(request.path()));
  CKPT_RETURN_IF_ERROR(CheckAccess(caller, dir, Access::kRead));
  std::optional<int64_t> uid;
  if (request.has_unique_id()) uid = request.unique_id();
  CKPT_ASSIGN_OR_RETURN(auto opened, OpenCached(dir, uid));
  const ckpt::Checkpoint& c = opened->checkpoint;
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

absl::StatusOr<std::shared_ptr<Daemon::RankSlot>> Daemon::PrepareSlot(
    const Caller& caller, const v1::LoadRequest& req) {
  const std::string who = absl::StrCat("job '", req.job_id(), "' rank ", req.rank());
  if (req.job_id().empty()) return absl::InvalidArgumentError("Load: job_id is empty");
  if (req.world_size() < 1 || req.world_size() > (1 << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": world_size ", req.world_size(),
                                                   " is not in [1, 2^20]"));
  }
  if (req.rank() < 0 || req.rank() >= req.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": rank is outside world_size ", req.world_size()));
  }
  for (int r : req.node_ranks()) {
    if (r < 0 || r >= req.world_size()) {
      return absl::InvalidArgumentError(absl::StrCat(who, ": node_ranks entry ", r,
                                                     " is outside world_size ", req.world_size()));
    }
  }
  auto slot = std::make_shared<RankSlot>();
  slot->request = req;
  slot->targets.rank = req.rank();
  for (const v1::Target& t : req.targets()) {
    TargetTensor tt;
    tt.name = t.name();
    auto dt = ckpt::ParseDType(t.dtype());
    if (!dt.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, " tensor '", t.name(), "': ", dt.status().message()));
    }
    tt.dtype = *dt;
    tt.global_shape = ToShape(t.global_shape());
    tt.box = Box{ToShape(t.offset()), ToShape(t.shape())};
    if (t.has_flat_range()) tt.flat_range = ckpt::FlatRange{t.flat_range().begin(), t.flat_range().end()};
    CKPT_RETURN_IF_ERROR(ckpt::Annotate(ckpt::ValidateTarget(req.rank(), tt),
                                        absl::StrCat("job '", req.job_id(), "'")));
    slot->targets.tensors.push_back(std::move(tt));
  }
  if (req.has_shm()) {
    std::vector<int> all(req.targets_size());
    for (int i = 0; i < req.targets_size(); ++i) all[i] = i;
    CKPT_RETURN_IF_ERROR(PrepareShmSegment(caller, req.shm(), req, all, who, *slot));
  } else if (req.has_cuda_ipc()) {
    // Targets in host memory (dest_host: a CPU tensor of a GPU state dict)
    // go to the destination's shm segment, the rest to device memory.
    std::vector<int> host;
    for (int i = 0; i < req.targets_size(); ++i) {
      if (req.targets(i).dest_host()) host.push_back(i);
    }
    if (!host.empty()) {
      if (!req.cuda_ipc().has_host()) {
        return absl::InvalidArgumentError(absl::StrCat(
            who, ": tensor '", req.targets(host[0]).name(),
            "' is marked dest_host but the cuda_ipc destination has no host segment"));
      }
      CKPT_RETURN_IF_ERROR(PrepareShmSegment(caller, req.cuda_ipc().host(), req, host, who, *slot));
    }
    CKPT_RETURN_IF_ERROR(PrepareDeviceSlot(req, who, *slot));
  } else if (req.has_process_memory()) {
    CKPT_RETURN_IF_ERROR(PrepareProcessSlot(caller, req, who, *slot));
  } else if (!req.has_stream()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": no destination (shm, process_memory, stream or cuda_ipc)"));
  }
  return slot;
}

// Maps the client's segment `shm` for the targets `indices` of `req` (all
// of them for an shm destination; the host-memory ones of a cuda_ipc
// destination): every one inside the segment, no two overlapping.
absl::Status Daemon::PrepareShmSegment(const Caller& caller, const v1::ShmDestination& shm,
                                       const v1::LoadRequest& req, const std::vector<int>& indices,
                                       const std::string& who, RankSlot& slot) {
  int fd = -1;
  std::string what;
  uint64_t size = shm.size();
  if (!shm.arena_token().empty()) {
    // An arena this daemon lent: already mapped and faulted in.
    auto arena = arenas_->Find(shm.arena_token(), caller.uid);
    if (!arena.ok()) return ckpt::Annotate(arena.status(), who);
    if (size == 0) size = (*arena)->size();
    if (size > (*arena)->size()) {
      return absl::InvalidArgumentError(absl::StrCat(who, ": shm arena holds ", (*arena)->size(),
                                                     " bytes but the request declares ", size));
    }
    slot.segment = MappedSegment::Borrow(std::move(*arena));
  } else if (!shm.fd_token().empty()) {
    if (!fd_receiver_) return absl::FailedPreconditionError("this daemon has no fd socket");
    CKPT_ASSIGN_OR_RETURN(fd, fd_receiver_->Take(shm.fd_token(), caller.uid));
    what = absl::StrCat(who, ": shm segment (memfd)");
  } else if (!shm.name().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": shm.name ('", shm.name(), "') is no longer accepted: a named /dev/shm segment "
             "can be truncated under the daemon; send a sealed memfd (fd_token) or borrow an "
             "arena (arena_token)"));
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": shm destination needs arena_token or fd_token"));
  }
  // Every target inside the segment and no two overlapping, checked before
  // anything is mapped; only the bytes up to the end of the last target are.
  absl::Status bad;
  uint64_t needed = 0;
  std::vector<std::tuple<uint64_t, uint64_t, int>> ranges;  // [begin, end), target
  for (size_t k = 0; k < indices.size() && bad.ok(); ++k) {
    const int i = indices[k];
    const uint64_t off = req.targets(i).dest_offset();
    const uint64_t n = slot.targets.tensors[i].num_bytes();
    if (off > size || n > size - off) {
      bad = absl::InvalidArgumentError(absl::StrCat(
          who, " tensor '", req.targets(i).name(), "' needs segment bytes [", off, ", ", off + n,
          ") but the segment is ", size, " bytes (segment too small)"));
    }
    if (n > 0) ranges.push_back({off, off + n, i});
    needed = std::max(needed, off + n);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size() && bad.ok(); ++i) {
    const auto& [begin, end, t] = ranges[i];
    const auto& [prev_begin, prev_end, prev] = ranges[i - 1];
    if (begin < prev_end) {
      bad = absl::InvalidArgumentError(absl::StrCat(
          who, ": two targets overlap in the segment at byte ", begin, ": tensor '",
          req.targets(prev).name(), "' [", prev_begin, ", ", prev_end, ") and tensor '",
          req.targets(t).name(), "' [", begin, ", ", end, ")"));
    }
  }
  if (!bad.ok()) {
    if (fd >= 0) ::close(fd);
    return bad;
  }
  if (!slot.segment) {
    CKPT_ASSIGN_OR_RETURN(slot.segment, MappedSegment::Map(fd, needed, what));
  }
  return absl::OkStatus();
}

absl::Status Daemon::PrepareProcessSlot(const Caller& caller, const v1::LoadRequest& req,
                                        const std::string& who, RankSlot& slot) {
  const v1::ProcessMemoryDestination& pm = req.process_memory();
  if (caller.via != Caller::Via::kUnix || caller.pid <= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        who, ": process_memory needs a caller on this daemon's Unix socket (its process is "
             "known there); use shm or stream"));
  }
  // Only into processes of the daemon's own uid: the kernel's ptrace check,
  // made again on every write, then also stops the writes at a process that
  // exec'd a setuid program or a pid taken over by another user. A daemon
  // with CAP_SYS_PTRACE passes that check for anyone, so as a non-root
  // user it must not hold it (root serves only root callers here).
  const uid_t self = ::geteuid();
  if (caller.uid != self || (self != 0 && HasCapSysPtrace())) {
    return absl::FailedPreconditionError(absl::StrCat(
        who, ": process_memory: ckptd (uid ", self, ") writes only into processes of its own uid",
        self != 0 && caller.uid == self ? " and without CAP_SYS_PTRACE" : "",
        "; this caller is uid ", caller.uid, "; use shm"));
  }
  if (pm.cookie().size() < 16 || pm.cookie().size() > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": process_memory cookie must be 16 to 64 bytes, not ",
                     pm.cookie().size()));
  }
  // Targets: no address wraps, no two overlap (a client that overlapped
  // them would only garble its own tensors, but it is a bug worth naming).
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  ckpt::RemoteRank remote;
  for (int i = 0; i < req.targets_size(); ++i) {
    const uint64_t at = req.targets(i).dest_offset();
    const uint64_t n = slot.targets.tensors[i].num_bytes();
    if (n > 0 && (at == 0 || at > std::numeric_limits<uint64_t>::max() - n)) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, " tensor '", req.targets(i).name(), "': process_memory address ", at,
          " cannot hold ", n, " bytes"));
    }
    if (n > 0) ranges.push_back({at, at + n});
    remote.targets.push_back({at});
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: two targets overlap in the process's memory at address 0x%x", who,
          ranges[i].first));
    }
  }
  auto memory = ckpt::ProcessMemory::Open(
      {caller.pid, absl::StrCat(who, " (pid ", caller.pid, ")")});
  if (!memory.ok()) return ToProcessMemoryError(memory.status(), who);
  std::string seen(pm.cookie().size(), '\0');
  absl::Status read = (*memory)->Read(pm.cookie_address(), seen.data(), seen.size());
  if (!read.ok()) return ToProcessMemoryError(read, who);
  if (seen != pm.cookie()) {
    return absl::FailedPreconditionError(absl::StrCat(
        who, ": process_memory: the cookie at the given address of pid ", caller.pid,
        " does not match the request (is the caller the process that connected?)"));
  }
  slot.process_memory = std::shared_ptr<ckpt::ProcessMemory>(std::move(*memory));
  remote.memory = slot.process_memory;
  if (pm.views() && fd_receiver_ && cache_.CanExport()) {
    // Cached bytes are left to the client to copy (core/cache_view.h).
    slot.views = std::make_shared<ckpt::ViewRecorder>(&cache_, caller.uid, slot.process_memory,
                                                      std::move(ranges));
    remote.memory = slot.views;
  }
  slot.process = std::move(remote);
  return absl::OkStatus();
}

void Daemon::FailJobLocked(Job& job, const absl::Status& status) {
  for (auto& [r, slot] : job.slots) {
    if (!slot->done) {
      slot->status = status;
      slot->done = true;
    }
  }
  job.state = Job::State::kFinished;
  auto it = jobs_.find(job.id);
  if (it != jobs_.end() && it->second.get() == &job) jobs_.erase(it);
}

void Daemon::RunGuarded(const std::shared_ptr<Job>& job,
                        void (Daemon::*run)(const std::shared_ptr<Job>&)) {
  // An exception must not leave the job running with its other ranks
  // waiting for ever: it fails the job for all of them.
  try {
    (this->*run)(job);
    return;
  } catch (const std::bad_alloc&) {
    spdlog::error("job {}: out of memory", job->id);
    FailJob(*job, absl::ResourceExhaustedError(
                      absl::StrCat("job '", job->id, "': the daemon ran out of memory running it")));
  } catch (const std::exception& e) {
    spdlog::error("job {}: unexpected exception (a ckptd bug): {}", job->id, e.what());
    FailJob(*job, absl::InternalError(
                      absl::StrCat("job '", job->id, "': internal error (a ckptd bug): ", e.what())));
  }
}

void Daemon::FailJob(Job& job, const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  FailJobLocked(job, status);
}

std::vector<std::string> Daemon::AbortLoads(const std::string& why) {
  std::vector<std::string> ids;
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Job>> loads;
  for (const auto& [id, job] : jobs_) {
    if (job->kind == JobKind::kLoad) loads.push_back(job);
  }
  for (const auto& job : loads) {
    const absl::Status s = absl::UnavailableError(absl::StrCat("job '", job->id, "': ", why));
    {
      absl::MutexLock abort(&job->abort_mu);
      job->aborted = true;
      job->abort_status = s;
    }
    FailJobLocked(*job, s);  // every rank learns it now; the runner stops at its next read
    ids.push_back(job->id);
  }
  return ids;
}

std::vector<std::shared_ptr<Daemon::RankSlot>> Daemon::SlotsOf(const Job& job) {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<RankSlot>> slots;
  for (const auto& [r, s] : job.slots) slots.push_back(s);
  return slots;
}

std::vector<void*> PrepareDestinations(Daemon::RankSlot& s, const ckpt::RankPlan& plan) {
  std::vector<void*> dests;
  if (s.segment) {  // with device buffers too: the dest_host targets only
    for (int t = 0; t < s.request.targets_size(); ++t) {
      const v1::Target& target = s.request.targets(t);
      dests.push_back(s.device && !target.dest_host() ? nullptr
                                                      : s.segment->data() + target.dest_offset());
    }
    return dests;
  }
  if (s.device) return dests;  // device buffers: Daemon::JobDelivery
  if (s.process) return std::vector<void*>(plan.targets.size(), nullptr);  // JobDelivery
  // Only targets the checkpoint has get a buffer (their bytes were checked
  // against limits.max_stream_bytes when the rank registered).
  const std::set<std::string> missing(plan.missing_keys.begin(), plan.missing_keys.end());
  s.stream_buffers.resize(plan.targets.size());
  for (size_t t = 0; t < plan.targets.size(); ++t) {
    if (!missing.count(plan.targets[t].name)) s.stream_buffers[t].resize(plan.targets[t].num_bytes());
    dests.push_back(s.stream_buffers[t].data());
  }
  return dests;
}

void FillLoadResult(Daemon::RankSlot& s, const ckpt::RankPlan& rp, size_t index,
                    const JobFigures& f, std::chrono::steady_clock::time_point job_start) {
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
  tm->set_wait_s(std::chrono::duration<double>(job_start - s.start).count());
}

absl::StatusOr<std::pair<std::shared_ptr<Daemon::Job>, bool>> Daemon::Register(
    const JobKey& key, const std::shared_ptr<RankSlot>& slot, size_t* registered,
    size_t* expected) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(key.id);
  if (it != jobs_.end() && it->second->owner != key.owner) {
    return absl::PermissionDeniedError(absl::StrCat(
        "job '", key.id, "' belongs to another user (uid ", it->second->owner,
        "); rank ", key.rank, " of uid ", key.owner, " may not join it (use another job_id)"));
  }
  if (it != jobs_.end() && it->second->state == Job::State::kRunning) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", key.id, "' is already running; rank ", key.rank,
                     " came too late (use a new job_id)"));
  }
  std::shared_ptr<Job> job;
  if (it == jobs_.end()) {
    uint64_t owned = 0;
    for (const auto& [id, j] : jobs_) owned += j->owner == key.owner;
    if (owned >= config_.limits.max_jobs_per_uid) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "job '", key.id, "': uid ", key.owner, " already has ", owned,
          " jobs waiting or running (limits.max_jobs_per_uid ", config_.limits.max_jobs_per_uid, ")"));
    }
    job = std::make_shared<Job>();
    job->id = key.id;
    job->owner = key.owner;
    job->kind = key.kind;
    job->path = key.path;
    job->unique_id = key.unique_id;
    job->world_size = key.world_size;
    if (key.node_ranks.empty()) {
      for (int r = 0; r < key.world_size; ++r) job->expected.insert(r);
    } else {
      job->expected.insert(key.node_ranks.begin(), key.node_ranks.end());
    }
    jobs_[job->id] = job;
  } else {
    job = it->second;
    std::string mismatch;
    if (job->kind != key.kind) {
      mismatch = "one side loads, the other saves";
    } else if (job->path != key.path) {
      mismatch = absl::StrCat("checkpoint ", key.path, " vs ", job->path);
    } else if (job->unique_id != key.unique_id) {
      auto version = [](const std::optional<int64_t>& u) {
        return u ? absl::StrCat(*u) : std::string("unset (the newest)");
      };
      mismatch = absl::StrCat("unique_id ", version(key.unique_id), " vs ", version(job->unique_id));
    } else if (job->world_size != key.world_size) {
      mismatch = absl::StrCat("world_size ", key.world_size, " vs ", job->world_size);
    }
    if (!mismatch.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("job '", job->id, "' rank ", key.rank,
                       " disagrees with the ranks already registered: ", mismatch));
    }
  }
  if (!job->expected.count(key.rank)) {
    return absl::InvalidArgumentError(absl::StrCat("job '", job->id, "' rank ", key.rank,
                                                   " is not among the ranks of this node"));
  }
  if (job->slots.count(key.rank)) {
    return absl::AlreadyExistsError(
        absl::StrCat("job '", job->id, "' rank ", key.rank, " is already registered"));
  }
  job->slots[key.rank] = slot;
  *registered = job->slots.size();
  *expected = job->expected.size();
  bool runner = false;
  if (*registered == *expected) {
    job->state = Job::State::kRunning;
    job->phase = key.kind == JobKind::kLoad ? "planning" : "writing";
    runner = true;
  }
  return std::make_pair(job, runner);
}

absl::Status Daemon::AwaitSlot(const std::shared_ptr<Job>& job,
                               const std::shared_ptr<RankSlot>& slot, int rank,
                               uint32_t barrier_timeout_ms,
                               const std::function<bool(const v1::LoadEvent&)>& send,
                               const std::function<bool()>& cancelled) {
  const absl::Duration barrier = BarrierTimeout(barrier_timeout_ms);
  const absl::Time deadline = slot->registered + barrier;
  std::string last_phase;
  uint64_t last_progress = 0;
  while (true) {
    std::string phase;
    uint64_t progress = 0, total = 0;
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&slot->done), absl::Milliseconds(100));
      if (slot->done) return slot->status;
      if (job->state == Job::State::kWaiting) {
        if (cancelled()) {
          job->slots.erase(rank);
          if (job->slots.empty()) {
            auto it = jobs_.find(job->id);
            if (it != jobs_.end() && it->second == job) jobs_.erase(it);
          }
          return absl::CancelledError(absl::StrCat("job '", job->id, "' rank ", rank,
                                                   ": client went away while waiting"));
        }
        if (absl::Now() >= deadline) {
          std::vector<int> missing;
          for (int r : job->expected) {
            if (!job->slots.count(r)) missing.push_back(r);
          }
          FailJobLocked(*job, absl::DeadlineExceededError(absl::StrCat(
                                  "job '", job->id, "': ranks ", absl::StrJoin(missing, ","),
                                  " never registered within ", absl::FormatDuration(barrier), " (",
                                  job->slots.size(), " of ", job->expected.size(),
                                  " ranks came)")));
          return slot->status;
        }
      }
      phase = job->phase;
      progress = job->progress.load();
      total = job->total.load();
    }
    if (send && (phase != last_phase || progress != last_progress)) {
      v1::LoadEvent ev;
      ev.set_progress(phase);
      ev.set_bytes_done(progress);
      ev.set_bytes_total(total);
      send(ev);  // a closed stream is noticed through cancelled()
      last_phase = phase;
      last_progress = progress;
    }
  }
}

absl::Status Daemon::Load(const Caller& caller, const v1::LoadRequest& request,
                          const std::function<bool(const v1::LoadEvent&)>& send,
                          const std::function<bool()>& cancelled) {
  ++loads_started_;
  auto fail = [&](absl::Status s) {
    ++loads_failed_;
    spdlog::warn("load job={} rank={} path={} failed: {}", request.job_id(), request.rank(),
                 request.path(), s.ToString());
    return s;
  };
  const std::string who = absl::StrCat("job '", request.job_id(), "' rank ", request.rank());
  // Checked before anything is allocated for the request: its shape against
  // the limits, the caller's right to the checkpoint, the caller's share.
  auto bytes = CheckRequestLimits(who, request.targets(), request.world_size(),
                                  request.node_ranks_size(), request.barrier_timeout_ms());
  if (!bytes.ok()) return fail(bytes.status());
  auto resolved = ResolvePath(request.path());
  if (!resolved.ok()) return fail(resolved.status());
  if (absl::Status a = CheckAccess(caller, *resolved, Access::kRead); !a.ok()) return fail(a);
  auto reservation = Reserve(caller, who, *bytes, request.has_stream() ? *bytes : 0);
  if (!reservation.ok()) return fail(reservation.status());
  auto prepared = PrepareSlot(caller, request);
  if (!prepared.ok()) return fail(prepared.status());
  std::shared_ptr<RankSlot> slot = *prepared;
  slot->cancelled = cancelled;
  // Nothing more is written into a client that cancelled or went away.
  if (slot->process_memory) slot->process_memory->StopWhen(cancelled);
  slot->registered = absl::Now();
  slot->start = std::chrono::steady_clock::now();

  JobKey key{JobKind::kLoad, request.job_id(), *resolved, std::nullopt, caller.uid,
             request.world_size(), request.rank(),
             std::vector<int>(request.node_ranks().begin(), request.node_ranks().end())};
  if (request.has_unique_id()) key.unique_id = request.unique_id();
  size_t registered = 0, expected = 0;
  auto reg = Register(key, slot, &registered, &expected);
  if (!reg.ok()) return fail(reg.status());
  auto [job, runner] = *reg;
  {
    v1::LoadEvent ev;
    ev.set_progress(absl::StrCat("registered rank ", request.rank(), " (", registered, " of ",
                                 expected, " ranks of job '", request.job_id(), "')"));
    send(ev);
  }
  if (runner) RunGuarded(job, &Daemon::RunJob);
  absl::Status status = AwaitSlot(job, slot, request.rank(), request.barrier_timeout_ms(), send, cancelled);
  if (!status.ok()) return fail(status);
  v1::LoadResult result;
  {
    absl::MutexLock lock(&mu_);
    result = slot->result;
  }
  if (cancelled()) return fail(absl::CancelledError("client went away"));
  if (slot->views) {
    if (absl::Status v = DeliverViews(caller, *slot, who, send, cancelled); !v.ok()) {
      return fail(v);
    }
    result.set_bytes_from_views(slot->views->bytes_recorded());
  }
  result.mutable_timings()->set_total_s(Seconds(slot->start));
  if (request.has_stream()) {
    uint64_t chunk = request.stream().chunk_bytes() ? request.stream().chunk_bytes() : (4u << 20);
    chunk = std::min<uint64_t>(std::max<uint64_t>(chunk, 4096), 64u << 20);
    // Room for the message around the chunk under limits.max_message_bytes.
    chunk = std::min<uint64_t>(chunk, config_.limits.max_message_bytes - (64u << 10));
    for (size_t t = 0; t < slot->stream_buffers.size(); ++t) {
      const auto& buf = slot->stream_buffers[t];
      for (uint64_t off = 0; off < buf.size(); off += chunk) {
        v1::LoadEvent ev;
        v1::StreamChunk* c = ev.mutable_data();
        c->set_target(static_cast<uint32_t>(t));
        c->set_offset(off);
        c->set_data(buf.data() + off, std::min<uint64_t>(chunk, buf.size() - off));
        if (!send(ev)) return fail(absl::CancelledError("client went away during streaming"));
      }
    }
  }
  v1::LoadEvent done;
  *done.mutable_result() = result;
  send(done);
  ++loads_succeeded_;
  bytes_delivered_total_ += result.bytes_delivered();
  return absl::OkStatus();
}

absl::Status Daemon::DeliverViews(const Caller& caller, RankSlot& slot, const std::string& who,
                                  const std::function<bool(const v1::LoadEvent&)>& send,
                                  const std::function<bool()>& cancelled) {
  ckpt::ViewRecorder& rec = *slot.views;
  const std::vector<ckpt::ViewRecorder::Copy> copies = rec.copies();
  if (copies.empty()) {
    rec.Release();
    return absl::OkStatus();
  }
  v1::LoadEvent ev;
  v1::CacheViews* cv = ev.mutable_views();
  std::vector<int> fds;
  for (const ckpt::ViewRecorder::View& v : rec.views()) {
    cv->add_view_bytes(v.bytes);
    cv->add_view_keys(v.key);
    fds.push_back(v.fd);
  }
  for (const ckpt::ViewRecorder::Copy& c : copies) {
    v1::ViewCopy* m = cv->add_copies();
    m->set_view(c.view);
    m->set_offset(c.offset);
    m->set_address(c.address);
    m->set_length(c.length);
    m->set_count(c.count);
    m->set_src_stride(c.src_stride);
    m->set_dst_stride(c.dst_stride);
  }
  cv->set_bytes(rec.bytes_recorded());
  const std::string token = view_leases_.Offer(caller.uid, std::move(fds), who);
  cv->set_token(token);
  // The client copies while the views are held; they are let go once it is
  // done, gone, or out of time (then the rank fails: its tensors may be
  // half-filled).
  absl::Status s = send(ev) ? view_leases_.AwaitDone(token, absl::Now() + config_.load_timeout,
                                                     cancelled)
                            : absl::CancelledError(absl::StrCat(who, ": client went away"));
  view_leases_.Withdraw(token);
  if (fd_receiver_) fd_receiver_->EndViews(token);
  rec.Release();
  return s;
}

absl::StatusOr<v1::SaveResponse> Daemon::Save(const Caller& caller, const v1::SaveRequest& request,
                                              const std::function<bool()>& cancelled) {
  const auto t0 = std::chrono::steady_clock::now();
  auto fail = [&](absl::Status s) {
    spdlog::warn("save job={} rank={} path={} failed: {}", request.job_id(), request.rank(),
                 request.path(), s.ToString());
    return s;
  };
  // The output directory may not exist yet: resolve its parent. A relative
  // path is under the first root (as for loads), so the nodes of a
  // multi-node save can name node-local directories that live at different
  // places.
  std::string out = request.path();
  if (!out.empty() && out[0] != '/') out = ckpt::JoinPath(config_.roots.front(), out);
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  const size_t slash = out.rfind('/');
  if (out.empty() || slash == std::string::npos) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("Save: path '", request.path(), "' names no directory")));
  }
  const std::string leaf = out.substr(slash + 1);
  auto parent = ResolvePath(slash == 0 ? "/" : out.substr(0, slash));
  if (!parent.ok()) return fail(parent.status());
  if (!ckpt::IsPlainFileName(leaf)) {
    return fail(absl::InvalidArgumentError(absl::StrCat("Save: bad directory name '", leaf, "'")));
  }
  const std::string dir = ckpt::JoinPath(*parent, leaf);
  const bool dcp = request.format() == kDcpFormat;
  if (!dcp && !request.format().empty() && request.format() != "ckptd") {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "Save: unknown format '", request.format(), "' (\"ckptd\" or \"", kDcpFormat, "\")")));
  }
  if (!request.dcp_metadata().empty() || !request.raw_targets().empty()) {
    if (!dcp) {
      return fail(absl::InvalidArgumentError(
          "Save: dcp_metadata and raw_targets are for format \"pytorch-dcp\" only"));
    }
  }
  if (!request.dcp_metadata().empty()) {
    auto committed = CommitDcp(caller, request, *parent, dir);
    if (!committed.ok()) return fail(committed.status());
    v1::SaveResponse resp = *committed;
    resp.set_seconds(Seconds(t0));
    return resp;
  }
  const std::string who = absl::StrCat("save job '", request.job_id(), "' rank ", request.rank());
  auto bytes = CheckRequestLimits(who, request.targets(), request.world_size(),
                                  request.node_ranks_size(), request.barrier_timeout_ms());
  if (!bytes.ok()) return fail(bytes.status());
  if (absl::Status a = CheckAccess(caller, *parent, Access::kSave); !a.ok()) return fail(a);
  if (request.async_save() && dcp) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        who, ": async_save is for the native format (PyTorch DCP's own async_save stages on the "
             "client side and calls ckptd.torch.DaemonStorageWriter from a thread)")));
  }
  struct stat lst;
  if (::lstat(dir.c_str(), &lst) == 0) {
    if (!S_ISDIR(lst.st_mode)) {
      return fail(absl::InvalidArgumentError(absl::StrCat(
          "Save: ", dir, S_ISLNK(lst.st_mode) ? " is a symbolic link" : " is not a directory",
          "; save into a real directory inside a root")));
    }
    if (absl::Status a = CheckAccess(caller, dir, Access::kSave); !a.ok()) return fail(a);
    // Early answer for the ranks; RunSaveJob checks again under the directory lock.
    auto exists = dcp ? absl::StatusOr<bool>(::faccessat(AT_FDCWD, (dir + "/.metadata").c_str(),
                                                         F_OK, AT_SYMLINK_NOFOLLOW) == 0)
                      : ckpt::VersionExists(dir, request.unique_id());
    if (!request.overwrite() && exists.ok() && *exists) {
      return fail(absl::AlreadyExistsError(
          dcp ? absl::StrCat("Save: ", DcpCheckpointExists(dir))
              : absl::StrCat("Save: version ", request.unique_id(), " already exists in ", dir,
                             " (", request.unique_id(),
                             ".metadata); choose another unique_id or set overwrite")));
    }
  }
  auto reservation = Reserve(caller, who, *bytes, 0);
  if (!reservation.ok()) return fail(reservation.status());
  // Reuse the Load validation of targets and segment.
  v1::LoadRequest as_load;
  as_load.set_job_id(request.job_id());
  as_load.set_rank(request.rank());
  as_load.set_world_size(request.world_size());
  *as_load.mutable_targets() = request.targets();
  if (request.has_cuda_ipc()) {
    *as_load.mutable_cuda_ipc() = request.cuda_ipc();  // device tensors: staged below
  } else {
    *as_load.mutable_shm() = request.shm();
  }
  *as_load.mutable_node_ranks() = request.node_ranks();
  auto prepared = PrepareSlot(caller, as_load);
  if (!prepared.ok()) return fail(prepared.status());
  std::shared_ptr<RankSlot> slot = *prepared;
  if (request.async_save()) {
    // The rank's bytes must outlive its call: save_buffer room first (the
    // call waits here while earlier persists hold it), then the daemon's own
    // copy unless the client handed its segment over for good.
    auto charge = ChargeSaveBuffer(who, *bytes,
                                   absl::Now() + BarrierTimeout(request.barrier_timeout_ms()),
                                   cancelled, &slot->buffer_wait_s);
    if (!charge.ok()) return fail(charge.status());
    slot->save_charge = std::move(*charge);
    if (!request.handed_over() && !slot->device) {
      std::vector<std::pair<uint64_t, uint64_t>> ranges;
      for (int t = 0; t < request.targets_size(); ++t) {
        ranges.emplace_back(request.targets(t).dest_offset(), slot->targets.tensors[t].num_bytes());
      }
      auto copy = MappedSegment::CopyOf(*slot->segment, ranges, who);
      if (!copy.ok()) return fail(copy.status());
      slot->segment = std::move(*copy);
    }
  }
  slot->save_request = request;
  if (slot->device) {  // its targets then point into the daemon's own copy
    if (absl::Status s = StageDeviceSave(who, slot->save_request, *slot); !s.ok()) return fail(s);
  }
  slot->cancelled = cancelled;
  slot->registered = absl::Now();
  slot->start = t0;
  JobKey key{JobKind::kSave, request.job_id(), dir, request.unique_id(), caller.uid,
             request.world_size(),
             request.rank(), std::vector<int>(request.node_ranks().begin(), request.node_ranks().end())};
  size_t registered = 0, expected = 0;
  auto reg = Register(key, slot, &registered, &expected);
  if (!reg.ok()) return fail(reg.status());
  auto [job, runner] = *reg;
  if (runner) RunGuarded(job, &Daemon::RunSaveJob);
  absl::Status status = AwaitSlot(job, slot, request.rank(), request.barrier_timeout_ms(), nullptr, cancelled);
  if (!status.ok()) return fail(status);
  absl::MutexLock lock(&mu_);
  v1::SaveResponse resp = slot->save_result;
  resp.set_seconds(Seconds(t0));
  if (request.async_save()) save_stall_us_ += static_cast<uint64_t>(resp.seconds() * 1e6);
  return resp;
}

void Daemon::RunSaveJob(const std::shared_ptr<Job>& job) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<std::shared_ptr<RankSlot>> slots = SlotsOf(*job);
  auto fail_all = [&](const absl::Status& s) { FailJob(*job, s); };
  std::vector<ckpt::RankTargets> ranks;
  for (const auto& s : slots) ranks.push_back(s->targets);
  auto plan = ckpt::PlanSave(ranks, job->world_size, job->unique_id.value_or(0));
  if (!plan.ok()) return fail_all(plan.status());
  bool overwrite = slots.front()->save_request.overwrite();
  const bool async = slots.front()->save_request.async_save();
  const std::string format = slots.front()->save_request.format();
  for (const auto& s : slots) {
    if (s->save_request.overwrite() != overwrite) {
      return fail_all(absl::InvalidArgumentError(absl::StrCat(
          "save job '", job->id, "': ranks disagree on overwrite (all must set it or none)")));
    }
    if (s->save_request.async_save() != async) {
      return fail_all(absl::InvalidArgumentError(absl::StrCat(
          "save job '", job->id, "': ranks disagree on async_save (all must set it or none)")));
    }
    if (s->save_request.format() != format) {
      return fail_all(absl::InvalidArgumentError(absl::StrCat(
          "save job '", job->id, "': ranks ", slots.front()->targets.rank, " and ",
          s->targets.rank, " send different formats ('", format, "', '",
          s->save_request.format(), "')")));
    }
  }
  const bool dcp = format == kDcpFormat;
  // Ranks on several daemons: a two-phase save with the others (a PyTorch
  // DCP save's data files are per rank; its coordinator commits .metadata).
  if (!dcp && static_cast<int>(job->expected.size()) < job->world_size) {
    return RunDistributedSave(job, slots);
  }
  if (async) return StartAsyncSave(job, slots, *std::move(plan));
  if (absl::Status s = ckpt::MakeDirs(job->path); !s.ok()) return fail_all(s);
  // One writer per directory; the files go into the directory that is locked
  // (opened without following a symlink), the version checked under the lock.
  auto lock = ckpt::LockDirectory(job->path, 0);
  if (!lock.ok()) {
    return fail_all(ckpt::Annotate(lock.status(), absl::StrCat("save job '", job->id, "'")));
  }
  // The old checkpoint stops existing first: a save that dies midway leaves
  // no commit file over new data files.
  if (absl::Status s =
          dcp ? ckpt::PrepareCommitFile(*lock->directory(), ".metadata",
                                        DcpCheckpointExists(lock->directory()->path()), overwrite)
              : ckpt::PrepareSave(*lock->directory(), plan->unique_id, overwrite);
      !s.ok()) {
    return fail_all(s);
  }
  const NativeSave save = NativeSaveOf(*job, slots, *std::move(plan));
  if (dcp) return WriteDcpSave(job, slots, save.plan, lock->directory(), save.where, t0);
  auto saved = WriteNativeSave(save, lock->directory(), nullptr, nullptr);
  if (!saved.ok()) return fail_all(saved.status());
  DropCachedMetadata(job->path);  // new files under a cached directory
  FinishSaveJob(job, slots, [&](RankSlot& s) {
    v1::SaveResponse& r = s.save_result;
    for (const auto& f : saved->files_of_rank[s.targets.rank]) r.add_files(f);
    r.set_bytes_written(saved->bytes);
    r.set_metadata_file(absl::StrCat(save.plan.unique_id, ".metadata"));
    r.set_persisted(true);
  });
  spdlog::info("save job={} path={} ranks={} written={}B in {:.3f}s", job->id, job->path,
               slots.size(), saved->bytes, Seconds(t0));
}

void Daemon::FinishSaveJob(const std::shared_ptr<Job>& job,
                           const std::vector<std::shared_ptr<RankSlot>>& slots,
                           const std::function<void(RankSlot&)>& answer) {
  absl::MutexLock jobs_lock(&mu_);
  for (const auto& s : slots) {
    answer(*s);
    s->done = true;
  }
  job->state = Job::State::kFinished;
  auto it = jobs_.find(job->id);
  if (it != jobs_.end() && it->second == job) jobs_.erase(it);
}

void Daemon::WriteDcpSave(const std::shared_ptr<Job>& job,
                          const std::vector<std::shared_ptr<RankSlot>>& slots,
                          const ckpt::SavePlan& plan,
                          std::shared_ptr<const ckpt::Directory> dir,
                          const std::map<std::pair<int, std::string>, const uint8_t*>& where,
                          std::chrono::steady_clock::time_point t0) {
  std::set<std::string> raw;
  for (const auto& s : slots) {
    for (const auto& name : s->save_request.raw_targets()) raw.insert(name);
  }
  std::map<int, std::vector<v1::SavedItem>> items_of_rank;
  uint64_t bytes = 0;
  if (absl::Status s = ckpt::WriteFileAtomicIn(dir, kDcpPending, job->id); !s.ok()) {
    return FailJob(*job, s);
  }
  for (int r = 0; r < job->world_size; ++r) {
    if (!job->expected.count(r) || plan.writes[r].empty()) continue;
    std::vector<ckpt::DcpItemToWrite> items;
    for (const TargetTensor& t : plan.writes[r]) {
      const std::string what = absl::StrCat("save job '", job->id, "' rank ", r, " tensor '",
                                            t.name, "'");
      if (t.flat_range) {
        return FailJob(*job, absl::InvalidArgumentError(absl::StrCat(
                                 what, ": a flat range cannot be saved as PyTorch DCP (its "
                                 "chunks are boxes)")));
      }
      ckpt::DcpItemToWrite w;
      w.name = t.name;
      w.dtype = t.dtype;
      w.shape = t.box.shape;
      w.data = where.at({r, t.name});
      w.nbytes = t.num_bytes();
      w.raw = raw.count(t.name) > 0;
      if (w.raw && (t.dtype != ckpt::DType::kU8 || t.global_shape.size() != 1 ||
                    t.box.shape != t.global_shape)) {
        return FailJob(*job, absl::InvalidArgumentError(absl::StrCat(
                                 what, ": a raw target must be a whole 1-D U8 tensor")));
      }
      items.push_back(std::move(w));
    }
    const std::string file = absl::StrCat("__", r, "_", plan.unique_id, ".distcp");
    auto written = ckpt::WriteDcpDataFile(dir, file, items);
    if (!written.ok()) return FailJob(*job, written.status());
    for (size_t i = 0; i < items.size(); ++i) {
      v1::SavedItem it;
      it.set_name(items[i].name);
      it.set_file(file);
      it.set_offset((*written)[i].offset);
      it.set_length((*written)[i].length);
      items_of_rank[r].push_back(std::move(it));
      bytes += items[i].nbytes;
    }
  }
  FinishSaveJob(job, slots, [&](RankSlot& s) {
    v1::SaveResponse& resp = s.save_result;
    for (const auto& it : items_of_rank[s.targets.rank]) {
      if (resp.files_size() == 0) resp.add_files(it.file());
      *resp.add_items() = it;
    }
    resp.set_bytes_written(bytes);
  });
  spdlog::info("save job={} path={} format={} ranks={} written={}B in {:.3f}s (not committed "
               "until its .metadata)", job->id, job->path, kDcpFormat, slots.size(), bytes,
               Seconds(t0));
}

absl::StatusOr<v1::SaveResponse> Daemon::CommitDcp(const Caller& caller,
                                                   const v1::SaveRequest& request,
                                                   const std::string& parent,
                                                   const std::string& dir) {
  const std::string what = absl::StrCat("commit of ", dir);
  if (request.targets_size() > 0 || request.world_size() > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": a dcp_metadata request carries no targets (world_size 1)"));
  }
  if (request.dcp_metadata().size() > config_.limits.max_metadata_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": dcp_metadata of ", request.dcp_metadata().size(), " bytes is over "
        "limits.max_metadata_bytes (", config_.limits.max_metadata_bytes, ")"));
  }
  struct stat lst;
  if (::lstat(dir.c_str(), &lst) != 0 || !S_ISDIR(lst.st_mode)) {
    return absl::NotFoundError(absl::StrCat(what, ": no such directory (save the data first)"));
  }
  CKPT_RETURN_IF_ERROR(CheckAccess(caller, parent, Access::kSave));
  CKPT_RETURN_IF_ERROR(CheckAccess(caller, dir, Access::kSave));
  // A commit reads the whole checkpoint's metadata back: it counts as one of
  // the caller's calls in flight, its metadata bytes against its share.
  CKPT_ASSIGN_OR_RETURN(auto reservation,
                        Reserve(caller, what, request.dcp_metadata().size(), 0));
  auto lock = ckpt::LockDirectory(dir, 0);
  if (!lock.ok()) return ckpt::Annotate(lock.status(), what);
  const ckpt::Directory& d = *lock->directory();
  CKPT_ASSIGN_OR_RETURN(bool exists, d.Exists(".metadata"));
  if (exists && !request.overwrite()) {
    return absl::AlreadyExistsError(absl::StrCat(
        what, ": .metadata already exists; set overwrite to replace the checkpoint"));
  }
  // Only the save job that wrote the data files there last may commit them.
  std::string pending;
  {
    auto f = d.OpenFile(kDcpPending);
    if (!f.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": no pytorch-dcp save wrote data files there since the last commit"));
    }
    const uint64_t n = std::min<uint64_t>((*f)->size(), 4096);
    pending.resize(n);
    CKPT_RETURN_IF_ERROR((*f)->Read(0, n, pending.data()));
  }
  if (pending != request.job_id()) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": its data files were last written by save job '", pending, "', not by '",
        request.job_id(), "' (another save into the same directory replaced them); save again"));
  }
  // Read the checkpoint back through the new metadata before it exists for
  // anyone: every item located and parsed, every tensor covered.
  ckpt::Checkpoint c;
  c.dir = dir;
  c.confine = true;
  if (absl::Status s = ckpt::OpenPickledCheckpoint(&c, d, ".metadata", request.dcp_metadata());
      !s.ok()) {
    return ckpt::Annotate(s, absl::StrCat(what, ": the DCP metadata does not describe the files "
                                          "there"));
  }
  if (c.format != ckpt::CheckpointFormat::kTorchDcp) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": dcp_metadata is not a PyTorch DCP Metadata"));
  }
  CKPT_RETURN_IF_ERROR(
      ckpt::WriteFileAtomicIn(lock->directory(), ".metadata", request.dcp_metadata()));
  if (::unlinkat(d.fd(), kDcpPending, 0) != 0 && errno != ENOENT) {
    spdlog::warn("{}: cannot remove {}: {}", dir, kDcpPending, std::strerror(errno));
  }
  CKPT_RETURN_IF_ERROR(d.Sync());
  DropCachedMetadata(dir);
  spdlog::info("save commit path={} format={} tensors={} bytes={}", dir, kDcpFormat,
               c.metadata.tensors.size(), request.dcp_metadata().size());
  v1::SaveResponse resp;
  resp.set_metadata_file(".metadata");
  return resp;
}

void Daemon::RunJob(const std::shared_ptr<Job>& job) {
  // AOA statements (LoadRequest.aoa_config): the same text from every rank
  // (multi-node: the coordinator checks every node sends the same).
  std::string aoa;
  {
    const std::vector<std::shared_ptr<RankSlot>> aoa_slots = SlotsOf(*job);
    absl::Status bad;
    for (const auto& s : aoa_slots) {
      if (s->request.aoa_config() != aoa_slots.front()->request.aoa_config()) {
        bad = absl::InvalidArgumentError(absl::StrCat(
            "job '", job->id, "': ranks ", aoa_slots.front()->request.rank(), " and ",
            s->request.rank(), " send different aoa_config"));
      }
    }
    aoa = aoa_slots.front()->request.aoa_config();
    if (!bad.ok()) {
      RecordLoadJob(LoadJobRecord{job->id, job->path, "", aoa_slots.size(), bad});
      return FailJob(*job, bad);
    }
  }
  if (static_cast<int>(job->expected.size()) < job->world_size) return RunDistributedJob(job);
  const auto t_start = std::chrono::steady_clock::now();
  const std::vector<std::shared_ptr<RankSlot>> slots = SlotsOf(*job);
  auto fail_all = [&](const absl::Status& s) {
    RecordLoadJob(LoadJobRecord{job->id, job->path, "", slots.size(), s});
    FailJob(*job, s);
  };
  auto t0 = std::chrono::steady_clock::now();
  // A version still being persisted (asynchronous save) is not visible yet:
  // wait for it, so a load right after a save finds it (in memory).
  AwaitPersistsInto(job->path, absl::Now() + config_.load_timeout);
  // The previous load's background fill of this checkpoint first: what the
  // cache serves does not depend on timing (server/cache_filler.h).
  if (!filler_->Wait(job->path + "/", config_.load_timeout)) {
    spdlog::warn("job {}: the cache fill of {} did not finish in time; loading anyway", job->id,
                 job->path);
  }
  auto opened = OpenCached(job->path, job->unique_id);
  if (!opened.ok()) return fail_all(opened.status());
  const double list_s = Seconds(t0);
  const ckpt::Checkpoint& ckpt = (*opened)->checkpoint;

  t0 = std::chrono::steady_clock::now();
  std::vector<ckpt::RankTargets> ranks;
  for (const auto& s : slots) ranks.push_back(s->targets);
  ckpt::PlanOptions po;
  po.max_read_bytes = config_.io_request_size;
  auto plan = ckpt::PlanLoadWithAoa(ckpt.metadata, aoa, ranks, po, "aoa_config");
  if (!plan.ok()) return fail_all(plan.status());
  const double plan_s = Seconds(t0);

  // Strict ranks with missing keys fail alone.
  std::vector<bool> skip(slots.size(), false);
  for (size_t i = 0; i < slots.size(); ++i) {
    const auto& missing = plan->ranks[i].missing_keys;
    if (slots[i]->request.strict() && !missing.empty()) {
      skip[i] = true;
      absl::MutexLock lock(&mu_);
      slots[i]->status = absl::NotFoundError(
          absl::StrCat("job '", job->id, "' rank ", slots[i]->request.rank(), ": ", job->path,
                       " has no tensor(s) ", absl::StrJoin(missing, ", ")));
      slots[i]->done = true;
    }
  }
  std::vector<std::vector<void*>> dests;
  for (size_t i = 0; i < slots.size(); ++i) {
    dests.push_back(PrepareDestinations(*slots[i], plan->ranks[i]));
  }
  {
    absl::MutexLock lock(&mu_);
    job->phase = "reading";
    job->total = plan->bytes_to_read;
  }
  ckpt::SourceOptions storage_options;
  storage_options.defer_fresh_memory = true;  // filled afterwards by filler_
  storage_options.tenant = job->owner;        // the uid whose loads may view these entries
  ckpt::CachingSource storage(job->path, &cache_, (*opened)->stamps, storage_options);
  GatedSource source(&storage, job.get(), config_.testing_delay_read);
  auto delivery = JobDelivery(slots, std::move(dests));
  if (!delivery.ok()) return fail_all(delivery.status());
  ckpt::ExecuteOptions eo;
  eo.threads = config_.io_threads;
  eo.direct_io = direct_io_;
  // skip_verify is one rank's wish for its own delivery; the bytes are shared
  // with every rank of the job (and the cache), so they are verified unless
  // every rank asks not to (and then nothing read is cached: core publishes
  // only verified fills).
  eo.verify_checksums = !AllRanksSkipVerify(slots);
  eo.progress_bytes = &job->progress;
  eo.skip_rank = [&](size_t i) { return skip[i] || slots[i]->cancelled(); };
  eo.deadline = std::chrono::steady_clock::now() +
                std::chrono::milliseconds(absl::ToInt64Milliseconds(config_.load_timeout));
  auto stats = ckpt::ExecutePlan(*plan, source, **delivery, eo);
  // A file changed after its last read, before the load ends, fails it too
  // (docs/daemon.md: a file that changes or vanishes during a load fails that load).
  if (stats.ok()) {
    if (absl::Status c = storage.CheckOpenedFilesUnchanged(); !c.ok()) stats = c;
  }
  ReleaseDeviceBuffers(delivery, slots);
  if (stats.ok()) {
    if (absl::Status a = job->AbortStatus(); !a.ok()) stats = a;  // aborted as it finished
  }
  if (!stats.ok()) {
    absl::Status s = stats.status();
    if (absl::IsDeadlineExceeded(s)) {  // the executor's deadline: load_timeout
      s = absl::DeadlineExceededError(absl::StrCat("job '", job->id, "': load_timeout ",
                                                   absl::FormatDuration(config_.load_timeout),
                                                   " ran out: ", s.message()));
    }
    return fail_all(s);
  }
  bytes_read_total_ += stats->bytes_read;
  // Reads delivered without being kept (no warm memory for them): filled
  // into the cache in the background, before this checkpoint's next load.
  if (auto deferred = storage.Deferred(); !deferred.empty()) {
    const std::set<std::pair<std::string, uint64_t>> d(deferred.begin(), deferred.end());
    ckpt::LoadPlan fill;
    fill.files = plan->files;
    uint64_t bytes = 0;  // no more than the cache can hold (it would evict its own fill)
    for (const ckpt::ReadRange& rr : plan->reads) {
      if (!d.count({plan->files[rr.file], rr.offset})) continue;
      if (bytes + rr.length > config_.cache_budget) break;
      bytes += rr.length;
      fill.reads.push_back(rr);
    }
    filler_->Submit(job->path, (*opened)->stamps, std::move(fill), job->owner);
  }

  JobFigures fig;
  fig.stats = &*stats;
  fig.unexpected_keys = plan->unexpected_keys;
  fig.renamed_keys = plan->renamed_keys;
  fig.bytes_from_cache = stats->bytes_from_cache;
  fig.unique_id = ckpt.unique_id.value_or(0);
  fig.format = ckpt::FormatName(ckpt.format);
  fig.list_s = list_s;
  fig.plan_s = plan_s;
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i]->done) continue;
    FillLoadResult(*slots[i], plan->ranks[i], i, fig, t_start);
    slots[i]->done = true;
  }
  job->state = Job::State::kFinished;
  job->phase = "done";
  auto it = jobs_.find(job->id);
  if (it != jobs_.end() && it->second == job) jobs_.erase(it);
  LoadJobRecord rec{job->id, job->path, "", slots.size()};  // metrics + the job's log line
  rec.bytes_read = stats->bytes_read;
  rec.bytes_read_direct = stats->bytes_read_direct;
  rec.bytes_from_cache = stats->bytes_from_cache;
  rec.bytes_delivered = stats->bytes_delivered;
  rec.reads = plan->reads.size();
  rec.checksums_verified = stats->checksums_verified;
  rec.list_s = list_s;
  rec.plan_s = plan_s;
  rec.read_s = stats->read_seconds;
  rec.copy_s = stats->copy_seconds;
  rec.wall_s = Seconds(t_start);
  RecordLoadJob(rec);
}

absl::StatusOr<v1::PrefetchResponse> Daemon::Prefetch(const Caller& caller,
                                                      const v1::PrefetchRequest& request) {
  const auto t0 = std::chrono::steady_clock::now();
  CKPT_ASSIGN_OR_RETURN(std::string dir, ResolvePath(request.path()));
  CKPT_RETURN_IF_ERROR(CheckAccess(caller, dir, Access::kRead));
  std::optional<int64_t> uid;
  if (request.has_unique_id()) uid = request.unique_id();
  CKPT_ASSIGN_OR_RETURN(auto opened, OpenCached(dir, uid));
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
    rt.tensors.push_back(TargetTensor{name, t.dtype, t.global_shape,
                                      Box{ckpt::Shape(t.global_shape.size(), 0), t.global_shape},
                                      std::nullopt});
  }
  ckpt::PlanOptions po;
  po.max_read_bytes = config_.io_request_size;
  CKPT_ASSIGN_OR_RETURN(ckpt::LoadPlan plan, ckpt::PlanLoad(meta, {rt}, po));
  ckpt::SourceOptions options;
  options.tenant = caller.uid;
  ckpt::CachingSource source(dir, &cache_, opened->stamps, options);
  NoDelivery none;
  ckpt::ExecuteOptions eo;
  eo.threads = config_.io_threads;
  eo.direct_io = direct_io_;
  CKPT_ASSIGN_OR_RETURN(ckpt::LoadStats stats, ckpt::ExecutePlan(plan, source, none, eo));
  bytes_read_total_ += stats.bytes_read;
  v1::PrefetchResponse resp;
  resp.set_bytes_read(stats.bytes_read);
  uint64_t cached = 0;
  for (const auto& [path, be] : cache_.Files()) {
    if (absl::StartsWith(path, dir + "/")) cached += be.first;
  }
  resp.set_bytes_cached(cached);
  resp.set_seconds(Seconds(t0));
  spdlog::info("prefetch path={} read={}B cached={}B in {:.3f}s", dir, stats.bytes_read, cached,
               resp.seconds());
  return resp;
}

absl::StatusOr<v1::EvictResponse> Daemon::Evict(const Caller& caller,
                                                const v1::EvictRequest& request) {
  CKPT_ASSIGN_OR_RETURN(std::string dir, ResolvePath(request.path()));
  // Dropping cached data slows everyone's next load: admins, or who may save there.
  if (!IsAdmin(caller)) CKPT_RETURN_IF_ERROR(CheckAccess(caller, dir, Access::kSave));
  const std::string prefix = dir == "/" ? dir : dir + "/";
  // A background fill of these checkpoints ends first: nothing is put back
  // behind the eviction.
  if (!filler_->Wait(prefix, absl::Minutes(1))) {
    return absl::DeadlineExceededError(absl::StrCat(
        "Evict ", dir, ": a background cache fill there did not finish within 1 minute"));
  }
  auto [bytes, entries] = cache_.EvictPrefix(prefix);
  DropCachedMetadata(dir);
  spdlog::info("evict path={} freed={}B entries={}", dir, bytes, entries);
  v1::EvictResponse resp;
  resp.set_bytes_freed(bytes);
  resp.set_entries_freed(entries);
  return resp;
}

v1::VersionResponse Daemon::Version() {
  v1::VersionResponse resp;
  resp.set_version(absl::StrCat("ckptd ", kVersion, " (api ckptd.v1)"));
  resp.set_api_level(kApiLevel);
  resp.set_release(kVersion);
  return resp;
}

v1::StatusResponse Daemon::Status(const Caller& caller) {
  v1::StatusResponse resp;
  {
    v1::VersionResponse v = Version();
    resp.set_version(v.version());
    resp.set_api_level(v.api_level());
  }
  resp.set_uptime_s(absl::ToDoubleSeconds(absl::Now() - started_));
  const bool admin = IsAdmin(caller);
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, job] : jobs_) {
      if (!admin && job->owner != caller.uid) continue;  // others' jobs are not its business
      v1::JobStatus* js = resp.add_jobs();
      js->set_job_id(id);
      js->set_path(job->path);
      js->set_world_size(job->world_size);
      for (const auto& [r, s] : job->slots) js->add_registered_ranks(r);
      for (int r : job->expected) {
        if (!job->slots.count(r)) js->add_waiting_for(r);
      }
      js->set_state(job->phase);
    }
  }
  ckpt::CacheStats cs = cache_.stats();
  resp.set_cache_budget_bytes(cs.budget_bytes);
  resp.set_cache_bytes(cs.bytes);
  resp.set_arena_leased_bytes(arenas_->leased_bytes());
  resp.set_arena_free_bytes(arenas_->free_bytes());
  resp.set_arena_reused(arenas_->reused());
  resp.set_views_held(view_leases_.offered());
  resp.set_cache_entries(cs.entries);
  resp.set_cache_hits(cs.hits);
  resp.set_cache_misses(cs.misses);
  resp.set_cache_evictions(cs.evictions);
  const CacheFiller::Stats fill = filler_->stats();
  resp.set_cache_fills(fill.fills);
  resp.set_cache_fill_bytes(fill.bytes);
  resp.set_cache_fills_failed(fill.failed);
  FillSaveStatus(caller, &resp);
  std::map<std::string, bool> readable;  // checkpoint directory -> caller may read it
  for (const auto& [path, be] : cache_.Files()) {
    if (!admin) {
      // Only files under checkpoints the caller may read (checked once per directory).
      const size_t slash = path.rfind('/');
      if (slash == std::string::npos) continue;
      const std::string dir = path.substr(0, std::max<size_t>(slash, 1));
      auto [it, fresh] = readable.try_emplace(dir, false);
      if (fresh) it->second = CheckAccess(caller, dir, Access::kRead).ok();
      if (!it->second) continue;
    }
    v1::CachedFile* f = resp.add_cached_files();
    f->set_path(path);
    f->set_bytes(be.first);
    f->set_entries(be.second);
  }
  resp.set_loads_started(loads_started_);
  resp.set_loads_succeeded(loads_succeeded_);
  resp.set_loads_failed(loads_failed_);
  resp.set_bytes_read_total(bytes_read_total_);
  resp.set_bytes_delivered_total(bytes_delivered_total_);
  for (const auto& r : config_.roots) resp.add_roots(r);
  resp.set_gpu(gpu_->Describe());
  resp.set_cache_pinned_bytes(gpu_->pinned_bytes());
  resp.set_peer_address(config_.peer_listen);
  for (v1::PeerHealth& ph : PeerHealth()) *resp.add_peers() = std::move(ph);
  {
    absl::MutexLock lock(&meta_mu_);
    resp.set_metadata_cache_entries(meta_cache_.size());
  }
  return resp;
}

}  // namespace ckptd
