#include "server/service.h"

#include "server/metrics.h"

namespace ckptd {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

grpc::Status CkptdService::Inspect(grpc::ServerContext*, const v1::InspectRequest* req,
                                   v1::InspectResponse* resp) {
  auto r = daemon_->Inspect(*req);
  if (!r.ok()) return ToGrpc(r.status());
  *resp = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status CkptdService::Load(grpc::ServerContext* ctx, const v1::LoadRequest* req,
                                grpc::ServerWriter<v1::LoadEvent>* writer) {
  return ToGrpc(daemon_->Load(
      *req, [writer](const v1::LoadEvent& ev) { return writer->Write(ev); },
      [ctx] { return ctx->IsCancelled(); }));
}

grpc::Status CkptdService::Save(grpc::ServerContext* ctx, const v1::SaveRequest* req,
                                v1::SaveResponse* resp) {
  auto r = daemon_->Save(*req, [ctx] { return ctx->IsCancelled(); });
  if (!r.ok()) return ToGrpc(r.status());
  *resp = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status CkptdService::Prefetch(grpc::ServerContext*, const v1::PrefetchRequest* req,
                                    v1::PrefetchResponse* resp) {
  auto r = daemon_->Prefetch(*req);
  if (!r.ok()) return ToGrpc(r.status());
  *resp = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status CkptdService::Evict(grpc::ServerContext*, const v1::EvictRequest* req,
                                 v1::EvictResponse* resp) {
  auto r = daemon_->Evict(*req);
  if (!r.ok()) return ToGrpc(r.status());
  *resp = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status CkptdService::Status(grpc::ServerContext*, const v1::StatusRequest*,
                                  v1::StatusResponse* resp) {
  *resp = daemon_->Status();
  resp->set_resident_bytes(ResidentBytes());
  return grpc::Status::OK;
}

}  // namespace ckptd
