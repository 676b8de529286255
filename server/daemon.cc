// The daemon's facade: builds its components in order (daemon.h), starts and
// stops them, and answers the RPCs that only forward (Inspect, Prefetch,
// Evict) or report (Version, Status). The load path is daemon_load.cc, the
// job registry daemon_jobs.cc, destinations daemon_destinations.cc, saves
// daemon_save.cc and daemon_dcp.cc, multi-node jobs daemon_multinode*.cc.
#include "server/daemon.h"
#include "server/multinode/dist_jobs.h"
#include "server/peer/peer_plane.h"
#include "server/daemon_internal.h"
#include "server/delivery/destination.h"
#include "ckptd_version.h"
#include "proto/fd_socket.h"
#include "server/obs/metrics.h"

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
#include "core/plan/aoa.h"
#include "core/exec/executor.h"
#include "core/io/file.h"
#include "core/format/foreign.h"
#include "core/base/status_macros.h"
#include "core/cache/cache_view.h"
#include "core/format/torch_dcp.h"
#include "core/write/writer.h"

namespace ckptd {

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
      filler_(std::make_unique<CacheFiller>(&cache_)),
      policy_(config_),
      metadata_(config_.limits.metadata_cache_entries, config_.limits.max_metadata_bytes),
      catalog_(Catalog::Parts{&policy_, &metadata_, &cache_, filler_.get(), config_.io_request_size,
                              config_.io_threads, direct_io_, &bytes_read_total_}),
      peers_(std::make_unique<PeerPlane>(config_)),
      jobs_(config_.limits.max_jobs_per_uid),
      dist_jobs_(std::make_unique<DistJobs>(config_, peers_.get(), gpu_.get())),
      save_buffer_(config_.save_buffer),
      async_saves_(AsyncSaves::Options{config_.limits.max_jobs_per_uid, config_.save_buffer,
                                       config_.limits.max_barrier_timeout,
                                       config_.testing_delay_persist},
                   &save_buffer_, [this](const std::string& dir, const std::vector<std::string>& files) {
                     metadata_.Drop(dir);  // new files under a cached directory
                     PublishSaved(dir, files);
                   }) {}

Daemon::~Daemon() { Stop(); }

void Daemon::SetPeerListen(const std::string& bound) {
  config_.peer_listen = bound;
  peers_->SetListen(bound);
}

absl::Status Daemon::Start() {
  spdlog::info("gpu: {}", gpu_->Describe());
  if (gpu_->device_count() > 0 && config_.nccl_device >= gpu_->device_count()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config: nccl_device ", config_.nccl_device, " but this daemon sees ",
        gpu_->device_count(), " CUDA device(s) (check CUDA_VISIBLE_DEVICES)"));
  }
  CKPT_ASSIGN_OR_RETURN(auto tls, peers_->ReadTls());
  peers_->UseTls(std::move(tls));
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
  save_buffer_.Stop();
  async_saves_.Stop();
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
    jobs_.Fail(*job, absl::ResourceExhaustedError(
                      absl::StrCat("job '", job->id, "': the daemon ran out of memory running it")));
  } catch (const std::exception& e) {
    spdlog::error("job {}: unexpected exception (a ckptd bug): {}", job->id, e.what());
    jobs_.Fail(*job, absl::InternalError(
                      absl::StrCat("job '", job->id, "': internal error (a ckptd bug): ", e.what())));
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
  auto bytes = policy_.CheckRequestLimits(who, request.targets(), request.world_size(),
                                  request.node_ranks_size(), request.barrier_timeout_ms());
  if (!bytes.ok()) return fail(bytes.status());
  auto resolved = policy_.ResolvePath(request.path());
  if (!resolved.ok()) return fail(resolved.status());
  if (absl::Status a = policy_.CheckAccess(caller, *resolved, Policy::Access::kRead); !a.ok()) return fail(a);
  auto reservation = policy_.Reserve(caller, who, *bytes, request.has_stream() ? *bytes : 0);
  if (!reservation.ok()) return fail(reservation.status());
  auto prepared = PrepareSlot(caller, request);
  if (!prepared.ok()) return fail(prepared.status());
  std::shared_ptr<RankSlot> slot = *prepared;
  slot->cancelled = cancelled;
  // Nothing more is written into a client that cancelled or went away.
  slot->destination->StopWhen(cancelled);
  slot->registered = absl::Now();
  slot->start = std::chrono::steady_clock::now();

  JobKey key{JobKind::kLoad, request.job_id(), *resolved, std::nullopt, caller.uid,
             request.world_size(), request.rank(),
             std::vector<int>(request.node_ranks().begin(), request.node_ranks().end())};
  if (request.has_unique_id()) key.unique_id = request.unique_id();
  size_t registered = 0, expected = 0;
  auto reg = jobs_.Register(key, slot, &registered, &expected);
  if (!reg.ok()) return fail(reg.status());
  auto [job, runner] = *reg;
  {
    v1::LoadEvent ev;
    ev.set_progress(absl::StrCat("registered rank ", request.rank(), " (", registered, " of ",
                                 expected, " ranks of job '", request.job_id(), "')"));
    send(ev);
  }
  if (runner) RunGuarded(job, &Daemon::RunJob);
  absl::Status status = jobs_.AwaitSlot(job, slot, request.rank(),
                                         BarrierTimeout(request.barrier_timeout_ms()), send, cancelled);
  if (!status.ok()) return fail(status);
  v1::LoadResult result;
  {
    absl::MutexLock lock(&slot->mu);
    result = slot->result;
  }
  if (cancelled()) return fail(absl::CancelledError("client went away"));
  if (ckpt::ViewRecorder* views = slot->destination->views()) {
    if (absl::Status v = DeliverViews(caller, *views, who, send, cancelled); !v.ok()) {
      return fail(v);
    }
    result.set_bytes_from_views(views->bytes_recorded());
  }
  result.mutable_timings()->set_total_s(Seconds(slot->start));
  if (request.has_stream()) {
    uint64_t chunk = request.stream().chunk_bytes() ? request.stream().chunk_bytes() : (4u << 20);
    chunk = std::min<uint64_t>(std::max<uint64_t>(chunk, 4096), 64u << 20);
    // Room for the message around the chunk under limits.max_message_bytes.
    chunk = std::min<uint64_t>(chunk, config_.limits.max_message_bytes - (64u << 10));
    const std::vector<std::vector<uint8_t>>& streamed = slot->destination->streamed();
    for (size_t t = 0; t < streamed.size(); ++t) {
      const auto& buf = streamed[t];
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

absl::StatusOr<v1::InspectResponse> Daemon::Inspect(const Caller& caller,
                                                    const v1::InspectRequest& request) {
  return catalog_.Inspect(caller, request);
}

absl::StatusOr<v1::PrefetchResponse> Daemon::Prefetch(const Caller& caller,
                                                      const v1::PrefetchRequest& request) {
  return catalog_.Prefetch(caller, request);
}

absl::StatusOr<v1::EvictResponse> Daemon::Evict(const Caller& caller,
                                                const v1::EvictRequest& request) {
  return catalog_.Evict(caller, request);
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
  const bool admin = policy_.IsAdmin(caller);
  jobs_.Describe(admin, caller.uid, &resp);
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
  async_saves_.Describe(caller, admin, &resp);
  std::map<std::string, bool> readable;  // checkpoint directory -> caller may read it
  for (const auto& [path, be] : cache_.Files()) {
    if (!admin) {
      // Only files under checkpoints the caller may read (checked once per directory).
      const size_t slash = path.rfind('/');
      if (slash == std::string::npos) continue;
      const std::string dir = path.substr(0, std::max<size_t>(slash, 1));
      auto [it, fresh] = readable.try_emplace(dir, false);
      if (fresh) it->second = policy_.CheckAccess(caller, dir, Policy::Access::kRead).ok();
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
  for (v1::PeerHealth& ph : peers_->Health()) *resp.add_peers() = std::move(ph);
  {
    resp.set_metadata_cache_entries(metadata_.size());
  }
  return resp;
}

}  // namespace ckptd
