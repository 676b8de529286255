#include "server/peer_service.h"

#include "server/service.h"

namespace ckptd {

grpc::Status PeerService::Join(grpc::ServerContext*, const peer::v1::JoinRequest* req,
                               peer::v1::PlanPart* resp) {
  auto r = daemon_->PeerJoin(*req);
  if (!r.ok()) return ToGrpc(r.status());
  *resp = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status PeerService::FetchRead(grpc::ServerContext*, const peer::v1::FetchReadRequest* req,
                                    grpc::ServerWriter<peer::v1::Chunk>* writer) {
  return ToGrpc(daemon_->PeerFetchRead(
      *req, [writer](const peer::v1::Chunk& c) { return writer->Write(c); }));
}

grpc::Status PeerService::Complete(grpc::ServerContext*, const peer::v1::CompleteRequest* req,
                                   peer::v1::CompleteResponse* resp) {
  auto r = daemon_->PeerComplete(*req);
  if (!r.ok()) return ToGrpc(r.status());
  *resp = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status PeerService::Ping(grpc::ServerContext*, const peer::v1::PingRequest*,
                               peer::v1::PingResponse* resp) {
  *resp = daemon_->PeerPing();
  return grpc::Status::OK;
}

}  // namespace ckptd
