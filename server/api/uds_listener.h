// The daemon's Unix socket, accepted by ckptd itself so that every call
// knows its caller.
//
// gRPC 1.51 tells a handler nothing about a Unix-socket peer but the socket
// path, so ckptd listens and accepts itself: it reads the peer's uid, gid,
// pid (SO_PEERCRED) and supplementary groups (SO_PEERGROUPS) from the
// kernel, moves the connection to an fd number not used recently, and hands
// it to the gRPC server (AddInsecureChannelFromFd). A handler maps its
// ServerContext::peer() ("fd:N") back to that record. Fd numbers rotate
// through a wide range so a number freed by a closed connection is not
// reused while a call of that connection could still be queued.
#ifndef CKPTD_SERVER_API_UDS_LISTENER_H_
#define CKPTD_SERVER_API_UDS_LISTENER_H_

#include <sys/types.h>

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/api/caller.h"

namespace grpc {
class Server;
}

namespace ckptd {

class UdsListener {
 public:
  // Binds and listens on `path` (mode `mode`). At most `max_connections`
  // connections at once, at most a quarter of them from one uid; more are
  // closed at once (and logged).
  static absl::StatusOr<std::unique_ptr<UdsListener>> Listen(const std::string& path,
                                                             uint32_t mode,
                                                             uint64_t max_connections);
  ~UdsListener();
  // Starts accepting; connections go to `server` (started, outliving this).
  void Serve(grpc::Server* server);
  // Stops accepting and closes the listening socket, so new connections
  // are refused (open connections stay with gRPC).
  void Stop();
  // The caller of a connection named by ServerContext::peer().
  std::optional<Caller> Lookup(const std::string& peer) const;
  size_t connections() const;

 private:
  UdsListener(std::string path, int fd, uint64_t max_connections)
      : path_(std::move(path)), listen_fd_(fd), max_connections_(max_connections) {}
  void Run(grpc::Server* server);
  // Drops records whose fd no longer holds the socket they were made for.
  void PruneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  struct Conn {
    Caller caller;
    ino_t ino;  // the socket's inode: tells a reused fd number apart
  };
  const std::string path_;
  const int listen_fd_;
  const uint64_t max_connections_;
  int next_fd_ = 0;  // Run's thread only
  int fd_base_ = 0, fd_limit_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  mutable absl::Mutex mu_;
  std::map<int, Conn> conns_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_API_UDS_LISTENER_H_
