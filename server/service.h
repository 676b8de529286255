// gRPC glue: translates ckptd.v1 RPCs into Daemon calls and absl::Status
// into grpc::Status with the same code and message.
#ifndef CKPTD_SERVER_SERVICE_H_
#define CKPTD_SERVER_SERVICE_H_

#include "proto/ckpt.grpc.pb.h"
#include "server/daemon.h"

namespace ckptd {

grpc::Status ToGrpc(const absl::Status& s);

class CkptdService final : public v1::Ckptd::Service {
 public:
  explicit CkptdService(Daemon* daemon) : daemon_(daemon) {}

  grpc::Status Inspect(grpc::ServerContext* ctx, const v1::InspectRequest* req,
                       v1::InspectResponse* resp) override;
  grpc::Status Load(grpc::ServerContext* ctx, const v1::LoadRequest* req,
                    grpc::ServerWriter<v1::LoadEvent>* writer) override;
  grpc::Status Save(grpc::ServerContext* ctx, const v1::SaveRequest* req,
                    v1::SaveResponse* resp) override;
  grpc::Status Prefetch(grpc::ServerContext* ctx, const v1::PrefetchRequest* req,
                        v1::PrefetchResponse* resp) override;
  grpc::Status Evict(grpc::ServerContext* ctx, const v1::EvictRequest* req,
                     v1::EvictResponse* resp) override;
  grpc::Status Status(grpc::ServerContext* ctx, const v1::StatusRequest* req,
                      v1::StatusResponse* resp) override;

 private:
  Daemon* const daemon_;
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_SERVICE_H_
