// gRPC glue: translates ckptd.v1 RPCs into Daemon calls and absl::Status
// into grpc::Status with the same code and message. Every call is first
// mapped to its Caller (uds_listener.h); a call whose caller cannot be
// identified is UNAUTHENTICATED. No exception leaves a handler: one that
// escapes the daemon's code becomes RESOURCE_EXHAUSTED (out of memory) or
// INTERNAL naming the RPC, and is logged.
#ifndef CKPTD_SERVER_API_SERVICE_H_
#define CKPTD_SERVER_API_SERVICE_H_

#include <functional>
#include <optional>
#include <string>

#include "proto/ckpt.grpc.pb.h"
#include "server/api/caller.h"
#include "server/daemon.h"

namespace ckptd {

grpc::Status ToGrpc(const absl::Status& s);
// Runs a handler's `body`; an exception becomes RESOURCE_EXHAUSTED (out of
// memory) or INTERNAL naming `rpc`, logged with `who` called.
grpc::Status RunCatching(const char* rpc, const std::string& who,
                         const std::function<grpc::Status()>& body);

// Maps ServerContext::peer() to the caller; nullopt: unknown.
using CallerResolver = std::function<std::optional<Caller>(const std::string& peer)>;

class CkptdService final : public v1::Ckptd::Service {
 public:
  CkptdService(Daemon* daemon, CallerResolver resolve)
      : daemon_(daemon), resolve_(std::move(resolve)) {}

  grpc::Status Inspect(grpc::ServerContext* ctx, const v1::InspectRequest* req,
                       v1::InspectResponse* resp) override;
  grpc::Status ReadCheckpointFile(grpc::ServerContext* ctx,
                                  const v1::ReadCheckpointFileRequest* req,
                                  v1::ReadCheckpointFileResponse* resp) override;
  grpc::Status Load(grpc::ServerContext* ctx, const v1::LoadRequest* req,
                    grpc::ServerWriter<v1::LoadEvent>* writer) override;
  grpc::Status Save(grpc::ServerContext* ctx, const v1::SaveRequest* req,
                    v1::SaveResponse* resp) override;
  grpc::Status AwaitSave(grpc::ServerContext* ctx, const v1::AwaitSaveRequest* req,
                         v1::SaveResponse* resp) override;
  grpc::Status Prefetch(grpc::ServerContext* ctx, const v1::PrefetchRequest* req,
                        v1::PrefetchResponse* resp) override;
  grpc::Status Evict(grpc::ServerContext* ctx, const v1::EvictRequest* req,
                     v1::EvictResponse* resp) override;
  grpc::Status Status(grpc::ServerContext* ctx, const v1::StatusRequest* req,
                      v1::StatusResponse* resp) override;
  grpc::Status Version(grpc::ServerContext* ctx, const v1::VersionRequest* req,
                       v1::VersionResponse* resp) override;

 private:
  // Runs `body` with the caller of `ctx`, catching every exception.
  grpc::Status Guard(const char* rpc, grpc::ServerContext* ctx,
                     const std::function<absl::Status(const Caller&)>& body);

  Daemon* const daemon_;
  const CallerResolver resolve_;
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_API_SERVICE_H_
