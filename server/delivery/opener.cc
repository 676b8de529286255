#include "server/delivery/opener.h"

#include <linux/capability.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"

namespace ckptd {

namespace {

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

DestinationOpener::DestinationOpener(Parts parts) : parts_(parts) {}

absl::StatusOr<std::unique_ptr<Destination>> DestinationOpener::Open(
    const Caller& caller, const v1::LoadRequest& req, const ckpt::RankTargets& targets,
    const std::string& who) {
  std::vector<TargetPlace> places = PlacesOf(req.targets(), targets);
  if (req.has_shm()) {
    CKPT_ASSIGN_OR_RETURN(SegmentSource source, SegmentSourceOf(caller, req.shm(), who));
    return SegmentDestination::Open(who, std::move(source), std::move(places));
  }
  if (req.has_cuda_ipc()) {
    return OpenDevice(caller, req.cuda_ipc(), std::move(places), who);
  }
  if (req.has_process_memory()) return OpenProcess(caller, req, places, who);
  if (req.has_stream()) return std::unique_ptr<Destination>(new StreamDestination);
  return absl::InvalidArgumentError(
      absl::StrCat(who, ": no destination (shm, process_memory, stream or cuda_ipc)"));
}

absl::StatusOr<SegmentSource> DestinationOpener::SegmentSourceOf(const Caller& caller,
                                                      const v1::ShmDestination& shm,
                                                      const std::string& who) {
  SegmentSource source;
  source.size = shm.size();
  if (!shm.arena_token().empty()) {
    // An arena this daemon lent: already mapped and faulted in.
    auto arena = parts_.arenas->Find(shm.arena_token(), caller.uid);
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

absl::StatusOr<std::unique_ptr<Destination>> DestinationOpener::OpenProcess(
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
  const bool views = pm.views() && fd_receiver_ && parts_.cache->CanExport();
  return ProcessDestination::Open(who, caller.pid, targets, pm.cookie_address(), pm.cookie(),
                                  views ? parts_.cache : nullptr, caller.uid,
                                  views && pm.file_views());
}

absl::Status DestinationOpener::DeliverViews(const Caller& caller, ckpt::ViewRecorder& rec,
                                             const std::string& who,
                                             const std::function<bool(const v1::LoadEvent&)>& send,
                                             const std::function<bool()>& cancelled, bool last) {
  const ckpt::ViewRecorder::Batch batch = rec.TakeBatch(last);
  absl::Status s = absl::OkStatus();
  if (!batch.copies.empty()) s = DeliverBatch(caller, batch, who, send, cancelled);
  if (!last) return s;
  // Files the client read itself: unchanged while it read them (else its
  // tensors may hold bytes of two versions).
  if (s.ok() && rec.bytes_from_files() > 0) s = rec.CheckFilesUnchanged();
  rec.Release();
  return s;
}

absl::Status DestinationOpener::DeliverBatch(const Caller& caller,
                                             const ckpt::ViewRecorder::Batch& batch,
                                             const std::string& who,
                                             const std::function<bool(const v1::LoadEvent&)>& send,
                                             const std::function<bool()>& cancelled) {
  v1::LoadEvent ev;
  v1::CacheViews* cv = ev.mutable_views();
  std::vector<int> fds;
  for (const ckpt::ViewRecorder::View& v : batch.views) {
    cv->add_view_bytes(v.bytes);
    cv->add_view_keys(v.key);
    cv->add_view_is_file(v.file);
    fds.push_back(v.fd);
  }
  if (!batch.files) cv->clear_view_is_file();  // as before file views: nothing to say
  for (const ckpt::ViewRecorder::Copy& c : batch.copies) {
    v1::ViewCopy* m = cv->add_copies();
    m->set_view(c.view);
    m->set_offset(c.offset);
    m->set_address(c.address);
    m->set_length(c.length);
    m->set_count(c.count);
    m->set_src_stride(c.src_stride);
    m->set_dst_stride(c.dst_stride);
  }
  cv->set_bytes(batch.bytes);
  const std::string token = parts_.view_leases->Offer(caller.uid, std::move(fds), who);
  cv->set_token(token);
  // The client copies while the views are held; they are let go once it is
  // done, gone, or out of time (then the rank fails: its tensors may be
  // half-filled).
  absl::Status s = send(ev) ? parts_.view_leases->AwaitDone(token, absl::Now() + parts_.load_timeout,
                                                     cancelled)
                            : absl::CancelledError(absl::StrCat(who, ": client went away"));
  parts_.view_leases->Withdraw(token);
  if (fd_receiver_) fd_receiver_->EndViews(token);
  return s;
}

absl::StatusOr<std::unique_ptr<Destination>> DestinationOpener::OpenDevice(
    const Caller& caller, const v1::CudaIpcDestination& cuda_ipc,
    std::vector<TargetPlace> targets, const std::string& who) {
  // Targets in host memory (dest_host: a CPU tensor of a GPU state dict)
  // go to the destination's shm segment, the rest to device memory.
  std::vector<TargetPlace> host;
  for (const TargetPlace& t : targets) {
    if (t.host) host.push_back(t);
  }
  std::unique_ptr<MappedSegment> segment;
  if (!host.empty()) {
    if (!cuda_ipc.has_host()) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": tensor '", host[0].name,
          "' is marked dest_host but the cuda_ipc destination has no host segment"));
    }
    CKPT_ASSIGN_OR_RETURN(SegmentSource source, SegmentSourceOf(caller, cuda_ipc.host(), who));
    CKPT_ASSIGN_OR_RETURN(segment, OpenSegment(who, std::move(source), host));
  }
  std::vector<gpu::IpcBuffer> buffers;
  for (const v1::CudaBuffer& b : cuda_ipc.buffers()) {
    buffers.push_back(gpu::IpcBuffer{b.ipc_handle(), b.device(), b.device_uuid(), b.size()});
  }
  return DeviceDestination::Open(*parts_.gpu, who, buffers, std::move(targets), std::move(segment));
}

absl::Status DestinationOpener::StageDeviceSave(const std::string& who, v1::SaveRequest& request,
                                                const ckpt::RankTargets& targets,
                                                std::unique_ptr<Destination>* destination) {
  // The rank's bytes packed into one private buffer (exactly their sum, as
  // charged).
  std::vector<uint64_t> sizes;
  for (int t = 0; t < request.targets_size(); ++t) sizes.push_back(targets.tensors[t].num_bytes());
  uint64_t size = 0;
  const std::vector<uint64_t> at = PackedOffsets(sizes, &size);
  CKPT_ASSIGN_OR_RETURN(auto staged, MappedSegment::Private(parts_.gpu->host_allocator(), size,
                                                            absl::StrCat(who, ": staging")));
  std::vector<uint8_t*> to;
  for (int t = 0; t < request.targets_size(); ++t) to.push_back(staged->data() + at[t]);
  CKPT_RETURN_IF_ERROR((*destination)->CopyTargetsTo(*parts_.gpu, to, who));
  for (int t = 0; t < request.targets_size(); ++t) {
    v1::Target* target = request.mutable_targets(t);
    target->set_dest_offset(at[t]);
    target->clear_dest_host();
    target->clear_dest_buffer();
  }
  request.clear_cuda_ipc();
  // The client's IPC handles are closed here (the device destination goes).
  *destination = std::make_unique<SegmentDestination>(std::move(staged),
                                                      PlacesOf(request.targets(), targets));
  return absl::OkStatus();
}

}  // namespace ckptd
