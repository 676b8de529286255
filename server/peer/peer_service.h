// gRPC glue for the daemon-to-daemon Peer service (proto/peer.proto): every
// call is mapped to its PeerCaller (the verified certificate's names, or the
// source IP in plaintext), checked against the peer set
// (PeerPlane::Authorize: PERMISSION_DENIED for a name outside it), and run
// by the multi-node jobs (DistJobs, server/multinode/dist_jobs.h) with no
// exception escaping.
#ifndef CKPTD_SERVER_PEER_PEER_SERVICE_H_
#define CKPTD_SERVER_PEER_PEER_SERVICE_H_

#include <functional>

#include "proto/peer.grpc.pb.h"
#include "server/api/caller.h"
#include "server/multinode/dist_jobs.h"
#include "server/peer/peer_plane.h"

namespace ckptd {

PeerCaller PeerCallerOf(const grpc::ServerContext& ctx);

class PeerService final : public peer::v1::Peer::Service {
 public:
  // `plane` authorizes each call, `jobs` runs it; both outlive the service.
  PeerService(PeerPlane* plane, DistJobs* jobs) : plane_(plane), jobs_(jobs) {}
  grpc::Status Join(grpc::ServerContext* ctx, const peer::v1::JoinRequest* req,
                    peer::v1::PlanPart* resp) override;
  grpc::Status FetchRead(grpc::ServerContext* ctx, const peer::v1::FetchReadRequest* req,
                         grpc::ServerWriter<peer::v1::Chunk>* writer) override;
  grpc::Status FetchReads(grpc::ServerContext* ctx, const peer::v1::FetchReadsRequest* req,
                          grpc::ServerWriter<peer::v1::Chunk>* writer) override;
  grpc::Status Complete(grpc::ServerContext* ctx, const peer::v1::CompleteRequest* req,
                        peer::v1::CompleteResponse* resp) override;
  grpc::Status Ping(grpc::ServerContext* ctx, const peer::v1::PingRequest* req,
                    peer::v1::PingResponse* resp) override;
  grpc::Status Locate(grpc::ServerContext* ctx, const peer::v1::LocateRequest* req,
                      peer::v1::LocateResponse* resp) override;

 private:
  grpc::Status Run(const char* rpc, grpc::ServerContext* ctx,
                   const std::function<absl::Status(const PeerCaller&)>& body);
  PeerPlane* const plane_;
  DistJobs* const jobs_;
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_PEER_PEER_SERVICE_H_
