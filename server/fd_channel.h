// Handing a shared-memory file descriptor (a memfd) from a client process to
// the daemon over a Unix socket (SCM_RIGHTS), so destinations need no name
// in /dev/shm and cannot leak: the memory is freed when both sides close it.
//
// Protocol (SOCK_SEQPACKET, one message each way):
//   client -> daemon: 32-byte ASCII token + the fd as SCM_RIGHTS
//   daemon -> client: "OK" or "ERR <reason>"
// The client then names the token in LoadRequest.shm.fd_token. Tokens are
// single-use and expire.
#ifndef CKPTD_SERVER_FD_CHANNEL_H_
#define CKPTD_SERVER_FD_CHANNEL_H_

#include <atomic>
#include <map>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace ckptd {

// The fd socket that goes with a daemon's gRPC socket path.
std::string FdSocketPath(const std::string& grpc_socket);

// Client side: sends `fd` to the daemon listening at `fd_socket`; returns
// the token that names it.
absl::StatusOr<std::string> SendFd(const std::string& fd_socket, int fd,
                                   absl::Duration timeout = absl::Seconds(10));

// Daemon side: accepts fds on `path` on a background thread.
class FdReceiver {
 public:
  ~FdReceiver();
  static absl::StatusOr<std::unique_ptr<FdReceiver>> Start(const std::string& path, uint32_t mode,
                                                           absl::Duration token_ttl);
  // Takes ownership of the fd named by `token` (the caller closes it).
  absl::StatusOr<int> Take(const std::string& token);
  void Stop();
  size_t pending() const;

 private:
  FdReceiver(std::string path, int listen_fd, absl::Duration ttl)
      : path_(std::move(path)), listen_fd_(listen_fd), ttl_(ttl) {}
  void Run();
  void ExpireLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  int listen_fd_;
  const absl::Duration ttl_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  mutable absl::Mutex mu_;
  struct Held {
    int fd;
    absl::Time expires;
  };
  std::map<std::string, Held> fds_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_FD_CHANNEL_H_
