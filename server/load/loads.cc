#include "server/load/loads.h"

#include <algorithm>
#include <chrono>
#include <system_error>
#include <thread>

#include <spdlog/spdlog.h>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "server/await.h"

namespace ckptd {
namespace {

// How often a load asks gRPC whether its client cancelled (ThrottledCancel).
constexpr absl::Duration kCancelCheckEvery = absl::Milliseconds(50);

}  // namespace

absl::StatusOr<std::shared_ptr<RankSlot>> Loads::PrepareSlot(
    const Caller& caller, const v1::LoadRequest& req, const std::string& who) {
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<RankSlot> slot,
                        NewRankSlot("Load", req.job_id(), req.rank(), req.world_size(),
                                    req.node_ranks(), req.targets()));
  slot->request = req;
  CKPT_ASSIGN_OR_RETURN(slot->destination, p_.opener->Open(caller, req, slot->targets, who));
  return slot;
}

void Loads::WatchViews(const std::shared_ptr<RankSlot>& slot, ckpt::ViewRecorder& views) {
  views.NotifyWhenPending(kViewBatchBytes, [weak = std::weak_ptr<RankSlot>(slot)] {
    if (std::shared_ptr<RankSlot> s = weak.lock()) {
      absl::MutexLock lock(&s->mu);
      s->views_pending = true;
    }
  });
}

void Loads::Start(const std::shared_ptr<Job>& job, bool own_thread, JoinedThread* thread) {
  auto run = [this, job] { p_.jobs->RunGuarded(*job, [&] { RunJob(job); }); };
  if (own_thread) {
    try {
      thread->t = std::thread(run);
      return;
    } catch (const std::system_error& e) {  // no thread to be had: run it here
      spdlog::warn("job '{}': no thread for the job ({}); its ranks get their views at the end",
                   job->id, e.what());
    }
  }
  run();
}

void Loads::HandOutEarly(const Caller& caller, RankSlot& slot, ckpt::ViewRecorder& views,
                         const std::string& who,
                         const std::function<bool(const v1::LoadEvent&)>& send,
                         const std::function<bool()>& cancelled, absl::Status* copied) {
  if (!copied->ok()) return;
  // Views go out early only from a job still running kEarlyViewsAfter after
  // they became pending: a warm job records all of its views within
  // milliseconds, and its client does best with them at once (one round
  // trip; measured: 20% slower in batches for 128 MiB per rank).
  {
    absl::MutexLock lock(&slot.mu);
    if (slot.mu.AwaitWithTimeout(absl::Condition(&slot.done), kEarlyViewsAfter)) return;
  }
  *copied = p_.opener->DeliverViews(caller, views, who, send, cancelled, false);
}

absl::Status Loads::DeliverViews(const Caller& caller, ckpt::ViewRecorder& views,
                                 const std::string& who,
                                 const std::function<bool(const v1::LoadEvent&)>& send,
                                 const std::function<bool()>& cancelled, v1::LoadResult* result) {
  CKPT_RETURN_IF_ERROR(p_.opener->DeliverViews(caller, views, who, send, cancelled));
  result->set_bytes_from_views(views.bytes_recorded());
  result->set_bytes_from_files(views.bytes_from_files());
  result->set_bytes_from_laid_out(views.bytes_laid_out());
  return absl::OkStatus();
}

void Loads::QueueLaidOut(std::shared_ptr<ckpt::ViewRecorder> views, const std::string& path) {
  if (views == nullptr || !views->WantsLaidOut()) return;
  // Queued after the job's cache fill (bytes its client read from files are
  // gathered from there); the pieces are expanded there too, off this call.
  p_.filler->SubmitWork(path, [views = std::move(views)](const std::function<void()>& pause) {
    if (ckpt::ViewRecorder::Work work = views->TakeLaidOutWork()) work(pause);
  });
}

absl::Status Loads::Load(const Caller& caller, const v1::LoadRequest& request,
                          const std::function<bool(const v1::LoadEvent&)>& send,
                          const std::function<bool()>& cancelled_every_time) {
  // Asked by the executor's workers before each read and each batch of
  // writes into the client's memory: at most once per kCancelCheckEvery.
  const std::function<bool()> cancelled = ThrottledCancel(cancelled_every_time, kCancelCheckEvery);
  ++p_.counters->started;
  ++p_.counters->running;
  absl::Cleanup not_running = [this] {
    p_.counters->last_end_ns = LoadCounters::NowNs();
    --p_.counters->running;
  };
  auto fail = [&](absl::Status s) {
    ++p_.counters->failed;
    spdlog::warn("load request failed: job={} rank={} path={} code={}: {}", request.job_id(), request.rank(),
                 request.path(), absl::StatusCodeToString(s.code()), std::string(s.message()));
    return s;
  };
  const std::string who = absl::StrCat("job '", request.job_id(), "' rank ", request.rank());
  // Checked before anything is allocated for the request: its shape against
  // the limits, the caller's right to the checkpoint, the caller's share.
  auto bytes = p_.policy->CheckRequestLimits(
      who, request.targets(), request.world_size(), request.node_ranks_size(),
      request.barrier_timeout_ms(),
      request.has_shm()        ? Policy::Mapped::kAll
      : request.has_cuda_ipc() ? Policy::Mapped::kHostOnly
                               : Policy::Mapped::kNone);
  if (!bytes.ok()) return fail(bytes.status());
  auto resolved = p_.policy->ResolvePath(request.path());
  if (!resolved.ok()) return fail(resolved.status());
  if (absl::Status a = p_.policy->CheckAccess(caller, *resolved, Policy::Access::kRead); !a.ok()) return fail(a);
  auto reservation = p_.policy->Reserve(caller, who, *bytes, request.has_stream() ? *bytes : 0);
  if (!reservation.ok()) return fail(reservation.status());
  if (absl::Status k = CheckJobKey(who, request.job_key()); !k.ok()) return fail(k);
  auto prepared = PrepareSlot(caller, request, who);
  if (!prepared.ok()) return fail(prepared.status());
  std::shared_ptr<RankSlot> slot = *prepared;
  slot->cancelled = cancelled;
  // Nothing more is written into a client that cancelled or went away.
  slot->destination->StopWhen(cancelled);
  slot->registered = absl::Now();
  slot->start = std::chrono::steady_clock::now();
  // A client that takes views in batches copies while the job runs.
  ckpt::ViewRecorder* views = slot->destination->views();
  if (views != nullptr && p_.config->cache_laid_out_copies) views->EnableLaidOut(*resolved);
  const bool batches = views != nullptr && request.process_memory().view_batches();
  if (batches) WatchViews(slot, *views);

  JobKey key{JobKind::kLoad, request.job_id(), *resolved, std::nullopt, caller.uid,
             request.world_size(), request.rank(),
             std::vector<int>(request.node_ranks().begin(), request.node_ranks().end()),
             request.job_key()};
  if (request.has_unique_id()) key.unique_id = request.unique_id();
  size_t registered = 0, expected = 0;
  auto reg = p_.jobs->Register(key, slot, &registered, &expected);
  if (!reg.ok()) return fail(reg.status());
  const std::shared_ptr<Job> job = reg->first;
  const bool runner = reg->second;
  {
    v1::LoadEvent ev;
    ev.set_progress(absl::StrCat("registered rank ", request.rank(), " (", registered, " of ",
                                 expected, " ranks of job '", request.job_id(), "')"));
    send(ev);
  }
  JoinedThread job_thread;  // the job's, when it runs beside this call
  if (runner) Start(job, batches, &job_thread);
  absl::Status copied;  // the client's copies of the batches handed out so far
  auto hand_out = [&] { HandOutEarly(caller, *slot, *views, who, send, cancelled, &copied); };
  absl::Status status = p_.jobs->AwaitSlot(
      job, slot, request.rank(),
      BarrierTimeout(request.barrier_timeout_ms(), p_.config->barrier_timeout), send, cancelled,
      batches ? std::function<void()>(hand_out) : nullptr);
  // A batch the client did not copy fails the rank, once the job is done
  // with it (the job may still use the call's cancellation check till then).
  if (status.ok()) status = copied;
  // Let go (whatever happens next) when this call ends: the views delivered.
  std::shared_ptr<const void> fill_after;
  {
    absl::MutexLock lock(&slot->mu);
    fill_after = std::move(slot->fill_after);
  }
  if (!status.ok()) return fail(status);
  v1::LoadResult result;
  {
    absl::MutexLock lock(&slot->mu);
    result = slot->result;
  }
  if (cancelled()) return fail(absl::CancelledError("client went away"));
  if (views != nullptr) {
    absl::Status v = DeliverViews(caller, *views, who, send, cancelled, &result);
    if (!v.ok()) return fail(v);
  }
  result.mutable_timings()->set_total_s(Seconds(slot->start));
  if (request.has_stream()) {
    uint64_t chunk = request.stream().chunk_bytes() ? request.stream().chunk_bytes() : (4u << 20);
    chunk = std::min<uint64_t>(std::max<uint64_t>(chunk, 4096), 64u << 20);
    // Room for the message around the chunk under limits.max_message_bytes.
    chunk = std::min<uint64_t>(chunk, p_.config->limits.max_message_bytes - (64u << 10));
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
  // Before the result: an Evict the client sends once it has it drops the work.
  QueueLaidOut(slot->destination->shared_views(), *resolved);
  send(done);
  ++p_.counters->succeeded;
  p_.counters->bytes_delivered += result.bytes_delivered();
  return absl::OkStatus();
}

}  // namespace ckptd
