#include "server/peer/peer_plane.h"
#include "server/peer/peer_service.h"

#include <grpc/grpc_security_constants.h>

#include "absl/strings/strip.h"
#include "config/config.h"
#include "server/api/service.h"
#include "server/obs/metrics.h"

namespace ckptd {

PeerCaller PeerCallerOf(const grpc::ServerContext& ctx) {
  PeerCaller c;
  std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    // The TLS handshake verified the certificate against peer_tls_ca.
    for (const grpc::string_ref& v : auth->FindPropertyValues(GRPC_X509_SAN_PROPERTY_NAME)) {
      c.names.emplace_back(v.data(), v.size());
    }
    c.verified = true;
    return c;
  }
  // Plaintext: "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000".
  const std::string peer = ctx.peer();
  absl::string_view p = peer;
  if (absl::ConsumePrefix(&p, "ipv4:") || absl::ConsumePrefix(&p, "ipv6:")) {
    c.names.push_back(HostOf(std::string(p)));
  }
  return c;
}

namespace {

// A call's answer into `resp`, or its error.
template <typename Resp>
absl::Status Answer(absl::StatusOr<Resp> r, Resp* resp) {
  if (!r.ok()) return r.status();
  *resp = std::move(*r);
  return absl::OkStatus();
}

}  // namespace

grpc::Status PeerService::Run(const char* rpc, grpc::ServerContext* ctx,
                              const std::function<absl::Status(const PeerCaller&)>& body) {
  RecordPeerRpc(rpc);
  return RunCatching(rpc, ctx->peer(), [&] {
    auto caller = plane_->Authorize(PeerCallerOf(*ctx));
    if (!caller.ok()) return ToGrpc(caller.status());
    return ToGrpc(body(*caller));
  });
}

grpc::Status PeerService::Join(grpc::ServerContext* ctx, const peer::v1::JoinRequest* req,
                               peer::v1::PlanPart* resp) {
  return Run("Join", ctx, [&](const PeerCaller& c) {
    return Answer(jobs_->PeerJoin(c, *req, [ctx] { return ctx->IsCancelled(); }), resp);
  });
}

grpc::Status PeerService::FetchRead(grpc::ServerContext* ctx, const peer::v1::FetchReadRequest* req,
                                    grpc::ServerWriter<peer::v1::Chunk>* writer) {
  return Run("FetchRead", ctx, [&](const PeerCaller& c) {
    return jobs_->PeerFetchRead(
        c, *req, [writer](const peer::v1::Chunk& chunk) { return writer->Write(chunk); },
        [ctx] { return ctx->IsCancelled(); });
  });
}

grpc::Status PeerService::FetchReads(grpc::ServerContext* ctx,
                                     const peer::v1::FetchReadsRequest* req,
                                     grpc::ServerWriter<peer::v1::Chunk>* writer) {
  return Run("FetchReads", ctx, [&](const PeerCaller& c) {
    return jobs_->PeerFetchReads(
        c, *req, [writer](const peer::v1::Chunk& chunk) { return writer->Write(chunk); },
        [ctx] { return ctx->IsCancelled(); });
  });
}

grpc::Status PeerService::Complete(grpc::ServerContext* ctx, const peer::v1::CompleteRequest* req,
                                   peer::v1::CompleteResponse* resp) {
  return Run("Complete", ctx, [&](const PeerCaller& c) {
    return Answer(jobs_->PeerComplete(c, *req, [ctx] { return ctx->IsCancelled(); }), resp);
  });
}

grpc::Status PeerService::Ping(grpc::ServerContext* ctx, const peer::v1::PingRequest* req,
                               peer::v1::PingResponse* resp) {
  return Run("Ping", ctx, [&](const PeerCaller& c) {
    *resp = jobs_->PeerPing(c, *req);
    return absl::OkStatus();
  });
}

grpc::Status PeerService::Locate(grpc::ServerContext* ctx, const peer::v1::LocateRequest* req,
                                 peer::v1::LocateResponse* resp) {
  return Run("Locate", ctx, [&](const PeerCaller& c) {
    return Answer(jobs_->PeerLocate(c, *req, [ctx] { return ctx->IsCancelled(); }), resp);
  });
}

}  // namespace ckptd
