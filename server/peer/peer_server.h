// The peer service's gRPC server, with certificate rotation.
//
// Rotate() (SIGHUP, with the files PeerPlane::ReadTls just read) starts a
// second server on the same port (gRPC sets SO_REUSEPORT) with the new
// credentials and shuts the old one down in the background: the calls in
// flight on it (joins, FetchRead streams, completions) finish there within
// peer_timeout, so running jobs are not dropped, and new connections meet
// the new certificate. Only then do this node's own channels switch
// (PeerPlane::UseTls). If the new server cannot start (e.g. a key that
// does not match its certificate), nothing changes.
#ifndef CKPTD_SERVER_PEER_PEER_SERVER_H_
#define CKPTD_SERVER_PEER_PEER_SERVER_H_

#include <chrono>
#include <memory>
#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/peer/peer_plane.h"
#include "config/config.h"
#include "server/peer/peer_service.h"

namespace ckptd {

class PeerServer {
 public:
  // Serves `service` on config.peer_listen with `plane`'s TLS files; both
  // outlive it (config.peer_listen and peer_timeout are read at each use).
  static absl::StatusOr<std::unique_ptr<PeerServer>> Start(const DaemonConfig& config,
                                                           PeerPlane* plane, PeerService* service);
  ~PeerServer();

  // The address it listens on: peer_listen with the port the kernel picked
  // for "host:0" (main hands it to Daemon::SetPeerListen). A "unix:/path"
  // peer_listen is a socket file of mode 0600.
  const std::string& bound_address() const { return bound_; }

  absl::Status Rotate(const std::optional<PeerPlane::TlsFiles>& files);
  // The standard health service's answer (Kubernetes probes the peer port).
  void SetServing(bool serving);
  // Stops accepting; calls in flight get until `deadline`.
  void Shutdown(std::chrono::system_clock::time_point deadline);

 private:
  PeerServer(const DaemonConfig& config, PeerPlane* plane, PeerService* service)
      : config_(config), plane_(plane), service_(service) {}
  // `bound`, if given, gets the address it listens on.
  absl::StatusOr<std::unique_ptr<grpc::Server>> Build(const std::optional<PeerPlane::TlsFiles>& files,
                                                      std::string* bound = nullptr);

  const DaemonConfig& config_;
  PeerPlane* const plane_;
  PeerService* const service_;
  std::string bound_;
  absl::Mutex mu_;
  std::unique_ptr<grpc::Server> current_ ABSL_GUARDED_BY(mu_);
  // Servers a rotation replaced, each shut down (calls in flight given up
  // to peer_timeout) by a thread of its own; joined at the next rotation
  // once done, or at destruction.
  struct Retiring {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::vector<Retiring> retiring_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_PEER_PEER_SERVER_H_
