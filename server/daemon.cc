// The daemon's facade (daemon.h): builds its components in order, starts
// and stops them, forwards the RPCs to them and reports Version and Status.
#include "server/daemon.h"

#include <cstdlib>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "ckptd_version.h"
#include "core/base/status_macros.h"
#include "proto/fd_socket.h"
#include "server/multinode/dist_jobs.h"
#include "server/multinode/multinode_load.h"
#include "server/multinode/multinode_save.h"
#include "server/obs/metrics.h"
#include "server/peer/peer_plane.h"

namespace ckptd {

namespace {

// Laid-out copies are gathered once no load has run for this long
// (docs/daemon.md, "Laid-out copies"): a job loading again at once in the
// same processes does not share memory bandwidth with the gathering.
constexpr std::chrono::milliseconds kQuietBeforeLaidOut{50};

gpu::GpuOptions GpuOptionsOf(const DaemonConfig& c) {
  gpu::GpuOptions o;
  const char* pin = std::getenv("CKPTD_PIN_CACHE");  // "0": keep the data cache pageable
  o.pin_cache = pin == nullptr || std::string(pin) != "0";
  o.pinned_limit = c.cache_budget + 2 * o.pinned_chunk;  // room for fragmentation
  return o;
}
// cache_huge_pages: how the data cache's shared blocks get huge pages,
// said once at start-up with the reason.
ckpt::CacheHugePages CacheHugePages(const DaemonConfig& c) {
  if (c.cache_huge_pages == "off") {
    spdlog::info("cache: 4 KiB pages for shared blocks (cache_huge_pages: off)");
    return ckpt::CacheHugePages::kOff;
  }
  const ckpt::ShmemHugePages probe = ckpt::ProbeShmemHugePages();
  if (probe.honoured) {
    spdlog::info("cache: huge pages for shared blocks (shmem THP: {})", probe.setting);
    return ckpt::CacheHugePages::kAdvise;
  }
  const std::string why_not = ckpt::ProbeShmemCollapse();
  if (why_not.empty()) {
    spdlog::info("cache: shared blocks collapsed into huge pages after they fill, while no load "
                 "runs (MADV_COLLAPSE; shmem THP: {}, so not at allocation)",
                 probe.setting);
    return ckpt::CacheHugePages::kCollapse;
  }
  spdlog::info("cache: 4 KiB pages for shared blocks: this kernel gives shared memory no huge "
               "pages (shmem THP: {}; 'advise' in "
               "/sys/kernel/mm/transparent_hugepage/shmem_enabled allows them) and does not "
               "collapse them on request ({})",
               probe.setting, why_not);
  return ckpt::CacheHugePages::kOff;
}
}  // namespace

Daemon::Daemon(DaemonConfig config)
    : config_(std::move(config)),
      direct_io_(ckpt::ParseDirectIo(config_.direct_io).value_or(ckpt::DirectIo::kNever)),
      started_(absl::Now()),
      gpu_(gpu::CreateGpuRuntime(GpuOptionsOf(config_))),
      cache_(config_.cache_budget, gpu_->host_allocator(),
             gpu_->host_allocator() == nullptr ? CacheHugePages(config_)
                                               : ckpt::CacheHugePages::kOff),
      arenas_(std::make_unique<ArenaPool>(config_.arena_pool, config_.arena_limit)),
      // Laid-out copies are gathered while no load runs.
      filler_(std::make_unique<CacheFiller>(
          &cache_, [this] { return load_counters_.Busy(kQuietBeforeLaidOut); })),
      opener_(DestinationOpener::Parts{arenas_.get(), &view_leases_, &cache_, gpu_.get(),
                                       config_.load_timeout}),
      policy_(config_),
      metadata_(config_.limits.metadata_cache_entries, config_.limits.max_metadata_bytes),
      catalog_(Catalog::Parts{&policy_, &metadata_, &cache_, filler_.get(), config_.io_request_size,
                              config_.io_threads, direct_io_, &load_counters_.bytes_read}),
      peers_(std::make_unique<PeerPlane>(config_)),
      jobs_(config_.limits.max_jobs_per_uid),
      dist_jobs_(std::make_unique<DistJobs>(config_, peers_.get(), gpu_.get())),
      save_buffer_(config_.save_buffer),
      async_saves_(AsyncSaves::Options{config_.limits.max_jobs_per_uid,
                                       config_.limits.max_barrier_timeout,
                                       config_.testing_delay_persist},
                   &save_buffer_,
                   [this](const ckpt::Directory& dir, const std::vector<std::string>& files) {
                     metadata_.Drop(dir.path());  // new files under a cached directory
                     PublishSaved(&cache_, dir, files);
                   }),
      loads_(Loads::Parts{&config_, direct_io_, &policy_, &metadata_, &cache_, filler_.get(),
                          gpu_.get(), &opener_, &jobs_, &async_saves_, &load_counters_}),
      multinode_load_(std::make_unique<MultiNodeLoad>(MultiNodeLoad::Parts{
          &config_, &metadata_, gpu_.get(), &jobs_, dist_jobs_.get(), &loads_})),
      saves_(Saves::Parts{&config_, &policy_, &metadata_, &opener_, &jobs_, &save_buffer_,
                          &async_saves_}),
      multinode_save_(std::make_unique<MultiNodeSave>(
          MultiNodeSave::Parts{&config_, &metadata_, &jobs_, dist_jobs_.get()})) {
  loads_.SetMultiNode([this](const std::shared_ptr<Job>& job,
                             const std::vector<std::shared_ptr<RankSlot>>& slots,
                             std::chrono::steady_clock::time_point start) {
    multinode_load_->Run(job, slots, start);
  });
  saves_.SetMultiNode([this](const std::shared_ptr<Job>& job,
                             const std::vector<std::shared_ptr<RankSlot>>& slots,
                             int64_t version) {
    multinode_save_->Run(job, slots, version);
  });
}

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
  CKPT_ASSIGN_OR_RETURN(object_storage_, StartObjectStorage(config_));
  if (!config_.socket.empty()) {
    // An fd token outlives the longest barrier wait of the load naming it.
    const absl::Duration ttl = config_.testing_fd_token_ttl > absl::ZeroDuration()
                                   ? config_.testing_fd_token_ttl
                                   : config_.barrier_timeout + absl::Minutes(1);
    CKPT_ASSIGN_OR_RETURN(fd_receiver_, FdReceiver::Start(FdSocketPath(config_.socket),
                                                          config_.socket_mode, ttl,
                                                          arenas_.get(), FdReceiverLimits(),
                                                          &view_leases_));
    opener_.SetFdReceiver(fd_receiver_.get());
  }
  return absl::OkStatus();
}

void Daemon::Stop() {
  if (fd_receiver_) fd_receiver_->Stop();
  filler_->Stop();
  save_buffer_.Stop();
  async_saves_.Stop();
}

absl::Status Daemon::Load(const Caller& caller, const v1::LoadRequest& request,
                          const std::function<bool(const v1::LoadEvent&)>& send,
                          const std::function<bool()>& cancelled) {
  return loads_.Load(caller, request, send, cancelled);
}

absl::StatusOr<v1::SaveResponse> Daemon::Save(const Caller& caller, const v1::SaveRequest& request,
                                              const std::function<bool()>& cancelled) {
  return saves_.Save(caller, request, cancelled);
}

absl::StatusOr<v1::SaveResponse> Daemon::AwaitSave(const Caller& caller,
                                                   const v1::AwaitSaveRequest& request,
                                                   const std::function<bool()>& cancelled) {
  return async_saves_.Await(caller, policy_.IsAdmin(caller), request, cancelled);
}

std::vector<std::string> Daemon::AwaitPersists(absl::Duration timeout) {
  return async_saves_.AwaitPersisting(nullptr, absl::Now() + timeout);
}

absl::StatusOr<v1::InspectResponse> Daemon::Inspect(const Caller& caller,
                                                    const v1::InspectRequest& request) {
  return catalog_.Inspect(caller, request);
}

absl::StatusOr<v1::ReadCheckpointFileResponse> Daemon::ReadCheckpointFile(
    const Caller& caller, const v1::ReadCheckpointFileRequest& request) {
  return catalog_.ReadCheckpointFile(caller, request);
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
  resp.set_cache_laid_out_bytes(cs.laid_out_bytes);
  resp.set_cache_laid_out_entries(cs.laid_out_entries);
  resp.set_cache_laid_out_hits(cs.laid_out_hits);
  const CacheFiller::Stats fill = filler_->stats();
  resp.set_cache_fills(fill.fills);
  resp.set_cache_fill_bytes(fill.bytes);
  resp.set_cache_fills_failed(fill.failed);
  switch (cache_.huge_pages()) {
    case ckpt::CacheHugePages::kOff: resp.set_cache_huge_pages("off"); break;
    case ckpt::CacheHugePages::kAdvise: resp.set_cache_huge_pages("advise"); break;
    case ckpt::CacheHugePages::kCollapse: resp.set_cache_huge_pages("collapse"); break;
  }
  resp.set_cache_huge_page_bytes(cs.huge_page_bytes);
  async_saves_.Describe(caller, admin, &resp);
  DescribeObjectStorage(object_storage_, &resp);
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
  resp.set_loads_started(load_counters_.started);
  resp.set_loads_succeeded(load_counters_.succeeded);
  resp.set_loads_failed(load_counters_.failed);
  resp.set_bytes_read_total(load_counters_.bytes_read);
  resp.set_bytes_delivered_total(load_counters_.bytes_delivered);
  for (const auto& r : config_.roots) resp.add_roots(r);
  resp.set_gpu(gpu_->Describe());
  resp.set_cache_pinned_bytes(gpu_->pinned_bytes());
  resp.set_peer_address(config_.peer_listen);
  size_t known = 0;
  for (v1::PeerHealth& ph : peers_->Health(&known)) *resp.add_peers() = std::move(ph);
  resp.set_peers_known(static_cast<uint32_t>(known));
  resp.set_metadata_cache_entries(metadata_.size());
  return resp;
}

}  // namespace ckptd
