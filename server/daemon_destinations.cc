// Where a rank's bytes go: each Load (and Save) request's destination is
// checked and opened here before its rank joins a job (PrepareSlot,
// OpenDestination), as one of delivery/destination.h's kinds: a
// shared-memory segment (a lent arena or the client's sealed memfd), the
// client's own process memory (process_memory, with cache views), stream
// buffers, or device memory (daemon_gpu.cc).
#include <linux/capability.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <set>

#include <spdlog/spdlog.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/io/file.h"
#include "core/base/status_macros.h"
#include "core/cache/cache_view.h"
#include "server/daemon.h"
#include "server/daemon_internal.h"
#include "server/delivery/destination.h"
#include "proto/fd_socket.h"

namespace ckptd {

using ckpt::Box;
using ckpt::DType;
using ckpt::TargetTensor;

namespace {

ckpt::Shape ToShape(const google::protobuf::RepeatedField<int64_t>& r) {
  return ckpt::Shape(r.begin(), r.end());
}

// Whether this process holds CAP_SYS_PTRACE in its effective set.
bool HasCapSysPtrace() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
  if (::syscall(SYS_capget, &header, data) != 0) return true;  // unknown: assume the worst
  return (data[CAP_SYS_PTRACE / 32].effective & (1u << (CAP_SYS_PTRACE % 32))) != 0;
}

}  // namespace

std::vector<TargetPlace> PlacesOf(const google::protobuf::RepeatedPtrField<v1::Target>& requested,
                                  const ckpt::RankTargets& targets) {
  std::vector<TargetPlace> places;
  places.reserve(static_cast<size_t>(requested.size()));
  for (int i = 0; i < requested.size(); ++i) {
    const v1::Target& t = requested[i];
    places.push_back({t.name(), t.dest_offset(), targets.tensors[i].num_bytes(), t.dest_host(),
                      t.dest_buffer()});
  }
  return places;
}

absl::StatusOr<std::shared_ptr<RankSlot>> Daemon::PrepareSlot(
    const Caller& caller, const v1::LoadRequest& req) {
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<RankSlot> slot,
                        NewRankSlot("Load", req.job_id(), req.rank(), req.world_size(),
                                    req.node_ranks(), req.targets()));
  slot->request = req;
  const std::string who = absl::StrCat("job '", req.job_id(), "' rank ", req.rank());
  CKPT_ASSIGN_OR_RETURN(slot->destination, OpenDestination(caller, req, slot->targets, who));
  return slot;
}

absl::StatusOr<std::shared_ptr<RankSlot>> Daemon::NewRankSlot(
    absl::string_view verb, const std::string& job_id, int rank, int world_size,
    const google::protobuf::RepeatedField<int32_t>& node_ranks,
    const google::protobuf::RepeatedPtrField<v1::Target>& targets) {
  const std::string who = absl::StrCat("job '", job_id, "' rank ", rank);
  if (job_id.empty()) return absl::InvalidArgumentError(absl::StrCat(verb, ": job_id is empty"));
  if (world_size < 1 || world_size > (1 << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": world_size ", world_size,
                                                   " is not in [1, 2^20]"));
  }
  if (rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": rank is outside world_size ", world_size));
  }
  for (int r : node_ranks) {
    if (r < 0 || r >= world_size) {
      return absl::InvalidArgumentError(absl::StrCat(who, ": node_ranks entry ", r,
                                                     " is outside world_size ", world_size));
    }
  }
  auto slot = std::make_shared<RankSlot>();
  slot->targets.rank = rank;
  for (const v1::Target& t : targets) {
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
    CKPT_RETURN_IF_ERROR(ckpt::Annotate(ckpt::ValidateTarget(rank, tt),
                                        absl::StrCat("job '", job_id, "'")));
    slot->targets.tensors.push_back(std::move(tt));
  }
  return slot;
}

absl::StatusOr<std::unique_ptr<Destination>> Daemon::OpenDestination(
    const Caller& caller, const v1::LoadRequest& req, const ckpt::RankTargets& targets,
    const std::string& who) {
  std::vector<TargetPlace> places = PlacesOf(req.targets(), targets);
  if (req.has_shm()) {
    CKPT_ASSIGN_OR_RETURN(SegmentSource source, SegmentSourceOf(caller, req.shm(), who));
    return SegmentDestination::Open(who, std::move(source), std::move(places));
  }
  if (req.has_cuda_ipc()) {
    return OpenDeviceDestination(caller, req.cuda_ipc(), std::move(places), who);
  }
  if (req.has_process_memory()) return OpenProcessDestination(caller, req, places, who);
  if (req.has_stream()) return std::unique_ptr<Destination>(new StreamDestination);
  return absl::InvalidArgumentError(
      absl::StrCat(who, ": no destination (shm, process_memory, stream or cuda_ipc)"));
}

absl::StatusOr<SegmentSource> Daemon::SegmentSourceOf(const Caller& caller,
                                                      const v1::ShmDestination& shm,
                                                      const std::string& who) {
  SegmentSource source;
  source.size = shm.size();
  if (!shm.arena_token().empty()) {
    // An arena this daemon lent: already mapped and faulted in.
    auto arena = arenas_->Find(shm.arena_token(), caller.uid);
    if (!arena.ok()) return ckpt::Annotate(arena.status(), who);
    if (source.size == 0) source.size = (*arena)->size();
    if (source.size > (*arena)->size()) {
      return absl::InvalidArgumentError(absl::StrCat(who, ": shm arena holds ", (*arena)->size(),
                                                     " bytes but the request declares ",
                                                     source.size));
    }
    source.arena = std::move(*arena);
  } else if (!shm.fd_token().empty()) {
    if (!fd_receiver_) return absl::FailedPreconditionError("this daemon has no fd socket");
    CKPT_ASSIGN_OR_RETURN(source.fd, fd_receiver_->Take(shm.fd_token(), caller.uid));
    source.what = absl::StrCat(who, ": shm segment (memfd)");
  } else if (!shm.name().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": shm.name ('", shm.name(), "') is no longer accepted: a named /dev/shm segment "
             "can be truncated under the daemon; send a sealed memfd (fd_token) or borrow an "
             "arena (arena_token)"));
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": shm destination needs arena_token or fd_token"));
  }
  return source;
}

absl::StatusOr<std::unique_ptr<Destination>> Daemon::OpenProcessDestination(
    const Caller& caller, const v1::LoadRequest& req, const std::vector<TargetPlace>& targets,
    const std::string& who) {
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
  // Cached bytes are left to the client to copy (core/cache/cache_view.h).
  const bool views = pm.views() && fd_receiver_ && cache_.CanExport();
  return ProcessDestination::Open(who, caller.pid, targets, pm.cookie_address(), pm.cookie(),
                                  views ? &cache_ : nullptr, caller.uid);
}

absl::Status Daemon::DeliverViews(const Caller& caller, ckpt::ViewRecorder& rec,
                                  const std::string& who,
                                  const std::function<bool(const v1::LoadEvent&)>& send,
                                  const std::function<bool()>& cancelled) {
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

}  // namespace ckptd
