// gRPC glue for the daemon-to-daemon Peer service (proto/peer.proto).
#ifndef CKPTD_SERVER_PEER_SERVICE_H_
#define CKPTD_SERVER_PEER_SERVICE_H_

#include "proto/peer.grpc.pb.h"
#include "server/daemon.h"

namespace ckptd {

class PeerService final : public peer::v1::Peer::Service {
 public:
  explicit PeerService(Daemon* daemon) : daemon_(daemon) {}
  grpc::Status Join(grpc::ServerContext* ctx, const peer::v1::JoinRequest* req,
                    peer::v1::PlanPart* resp) override;
  grpc::Status FetchRead(grpc::ServerContext* ctx, const peer::v1::FetchReadRequest* req,
                         grpc::ServerWriter<peer::v1::Chunk>* writer) override;
  grpc::Status Complete(grpc::ServerContext* ctx, const peer::v1::CompleteRequest* req,
                        peer::v1::CompleteResponse* resp) override;
  grpc::Status Ping(grpc::ServerContext* ctx, const peer::v1::PingRequest* req,
                    peer::v1::PingResponse* resp) override;

 private:
  Daemon* const daemon_;
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_PEER_SERVICE_H_
