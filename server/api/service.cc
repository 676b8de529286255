#include "server/api/service.h"

#include <new>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "server/jobs/restart.h"
#include "server/obs/metrics.h"

namespace ckptd {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

grpc::Status RunCatching(const char* rpc, const std::string& who,
                         const std::function<grpc::Status()>& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    spdlog::error("{}: out of memory handling a request from {}", rpc, who);
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat(rpc, ": the daemon ran out of memory for this request"));
  } catch (const std::exception& e) {
    spdlog::error("{}: unexpected exception (a ckptd bug): {}", rpc, e.what());
    return grpc::Status(grpc::StatusCode::INTERNAL,
                        absl::StrCat(rpc, ": internal error (a ckptd bug): ", e.what()));
  } catch (...) {
    spdlog::error("{}: unexpected non-standard exception (a ckptd bug)", rpc);
    return grpc::Status(grpc::StatusCode::INTERNAL, absl::StrCat(rpc, ": internal error"));
  }
}

grpc::Status CkptdService::Guard(const char* rpc, grpc::ServerContext* ctx,
                                 const std::function<absl::Status(const Caller&)>& body) {
  return RunCatching(rpc, ctx->peer(), [&] {
    std::optional<Caller> caller = resolve_(ctx->peer());
    if (!caller) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          absl::StrCat(rpc, ": cannot tell who is calling (peer '", ctx->peer(),
                                       "'); connect through the daemon's Unix socket"));
    }
    const absl::Status status = body(*caller);
    if (!status.ok()) {
      // The daemon's own answer (a client tells it from the transport's
      // UNAVAILABLE), and whether a restart ended it (jobs/restart.h).
      ctx->AddTrailingMetadata("ckptd-status", "daemon");
      if (IsRetryAfterRestart(status)) ctx->AddTrailingMetadata("ckptd-retry", "restart");
    }
    return ToGrpc(status);
  });
}

grpc::Status CkptdService::Inspect(grpc::ServerContext* ctx, const v1::InspectRequest* req,
                                   v1::InspectResponse* resp) {
  return Guard("Inspect", ctx, [&](const Caller& c) -> absl::Status {
    auto r = daemon_->Inspect(c, *req);
    if (!r.ok()) return r.status();
    *resp = std::move(*r);
    return absl::OkStatus();
  });
}

grpc::Status CkptdService::ReadCheckpointFile(grpc::ServerContext* ctx,
                                              const v1::ReadCheckpointFileRequest* req,
                                              v1::ReadCheckpointFileResponse* resp) {
  return Guard("ReadCheckpointFile", ctx, [&](const Caller& c) -> absl::Status {
    auto r = daemon_->ReadCheckpointFile(c, *req);
    if (!r.ok()) return r.status();
    *resp = std::move(*r);
    return absl::OkStatus();
  });
}

grpc::Status CkptdService::Load(grpc::ServerContext* ctx, const v1::LoadRequest* req,
                                grpc::ServerWriter<v1::LoadEvent>* writer) {
  return Guard("Load", ctx, [&](const Caller& c) {
    return daemon_->Load(
        c, *req, [writer](const v1::LoadEvent& ev) { return writer->Write(ev); },
        [ctx] { return ctx->IsCancelled(); });
  });
}

grpc::Status CkptdService::Save(grpc::ServerContext* ctx, const v1::SaveRequest* req,
                                v1::SaveResponse* resp) {
  return Guard("Save", ctx, [&](const Caller& c) -> absl::Status {
    auto r = daemon_->Save(c, *req, [ctx] { return ctx->IsCancelled(); });
    if (!r.ok()) return r.status();
    *resp = std::move(*r);
    return absl::OkStatus();
  });
}

grpc::Status CkptdService::AwaitSave(grpc::ServerContext* ctx, const v1::AwaitSaveRequest* req,
                                     v1::SaveResponse* resp) {
  return Guard("AwaitSave", ctx, [&](const Caller& c) -> absl::Status {
    auto r = daemon_->AwaitSave(c, *req, [ctx] { return ctx->IsCancelled(); });
    if (!r.ok()) return r.status();
    *resp = std::move(*r);
    return absl::OkStatus();
  });
}

grpc::Status CkptdService::Prefetch(grpc::ServerContext* ctx, const v1::PrefetchRequest* req,
                                    v1::PrefetchResponse* resp) {
  return Guard("Prefetch", ctx, [&](const Caller& c) -> absl::Status {
    auto r = daemon_->Prefetch(c, *req);
    if (!r.ok()) return r.status();
    *resp = std::move(*r);
    return absl::OkStatus();
  });
}

grpc::Status CkptdService::Evict(grpc::ServerContext* ctx, const v1::EvictRequest* req,
                                 v1::EvictResponse* resp) {
  return Guard("Evict", ctx, [&](const Caller& c) -> absl::Status {
    auto r = daemon_->Evict(c, *req);
    if (!r.ok()) return r.status();
    *resp = std::move(*r);
    return absl::OkStatus();
  });
}

grpc::Status CkptdService::Status(grpc::ServerContext* ctx, const v1::StatusRequest*,
                                  v1::StatusResponse* resp) {
  return Guard("Status", ctx, [&](const Caller& c) {
    *resp = daemon_->Status(c);
    resp->set_resident_bytes(ResidentBytes());
    return absl::OkStatus();
  });
}

grpc::Status CkptdService::Version(grpc::ServerContext* ctx, const v1::VersionRequest*,
                                   v1::VersionResponse* resp) {
  return Guard("Version", ctx, [&](const Caller&) {
    *resp = Daemon::Version();
    return absl::OkStatus();
  });
}

}  // namespace ckptd
