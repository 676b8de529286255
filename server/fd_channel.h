// Handing a shared-memory file descriptor (a memfd) from a client process to
// the daemon over a Unix socket (SCM_RIGHTS), so destinations need no name
// in /dev/shm and cannot leak: the memory is freed when both sides close it.
//
// Protocol (SOCK_SEQPACKET, one message each way):
//   client -> daemon: 32-byte ASCII token + the fd as SCM_RIGHTS
//   daemon -> client: "OK" or "ERR <reason>"
// The client then names the token in LoadRequest.shm.fd_token. Tokens are
// single-use and expire.
//
// Arenas from the daemon (server/arena_pool.h), on the same socket:
//   client -> daemon: "ALLOC <bytes>"
//   daemon -> client: "OK <32-byte token> <bytes>" + the arena's memfd as
//                     SCM_RIGHTS, or "ERR <reason>"
// The connection then stays open as the lease: the client names the token in
// LoadRequest.shm.arena_token for as many loads as it likes; closing the
// connection (or exiting) gives the arena back.
#ifndef CKPTD_SERVER_FD_CHANNEL_H_
#define CKPTD_SERVER_FD_CHANNEL_H_

#include <sys/types.h>

#include <atomic>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

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

// A random 32-character hex token.
std::string RandomToken();

// An arena the daemon lent: `fd` is the receiver's to send and close.
struct ArenaLease {
  std::string token;
  int fd = -1;
  uint64_t size = 0;
};

// What the daemon does with "ALLOC" requests and closed leases.
class ArenaHandler {
 public:
  virtual ~ArenaHandler() = default;
  virtual absl::StatusOr<ArenaLease> Allocate(uint64_t size, uid_t uid) = 0;
  // After the client has the arena: fault it in on this side (may take a
  // while; the client need not wait for it).
  virtual void Prefault(const std::string& token) {}
  virtual void Release(const std::string& token) = 0;
};

// Client side of "ALLOC": the arena's memfd, its token and size (rounded
// up), and the lease socket to keep open while the arena is in use.
struct ArenaGrant {
  int fd = -1;
  int lease = -1;
  std::string token;
  uint64_t size = 0;
};
absl::StatusOr<ArenaGrant> RequestArena(const std::string& fd_socket, uint64_t size,
                                        absl::Duration timeout = absl::Seconds(10));

// Daemon side: accepts fds on `path` on a background thread, and arena
// requests when `arenas` is set (it must outlive the receiver).
class FdReceiver {
 public:
  ~FdReceiver();
  static absl::StatusOr<std::unique_ptr<FdReceiver>> Start(const std::string& path, uint32_t mode,
                                                           absl::Duration token_ttl,
                                                           ArenaHandler* arenas = nullptr);
  // Takes ownership of the fd named by `token` (the caller closes it).
  absl::StatusOr<int> Take(const std::string& token);
  void Stop();
  size_t pending() const;

 private:
  FdReceiver(std::string path, int listen_fd, absl::Duration ttl, ArenaHandler* arenas)
      : path_(std::move(path)), listen_fd_(listen_fd), ttl_(ttl), arenas_(arenas) {}
  void Run();
  // Handles one new connection; true if something else owns it now.
  bool Serve(int c);
  // The client's lease socket `fd` closed (or we stop): the arena goes back.
  void EndLease(int fd, const std::string& token);
  // Lends an arena to the client on `c` (its own thread; see Serve).
  void Grant(int c, uint64_t size, uid_t uid);
  static constexpr int kMaxGranting = 64;
  void ExpireLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  int listen_fd_;
  const absl::Duration ttl_;
  ArenaHandler* const arenas_;
  std::map<int, std::string> leases_;  // lease socket -> arena token (Run's thread only)
  std::atomic<bool> stop_{false};
  std::thread thread_;
  mutable absl::Mutex mu_;
  struct Held {
    int fd;
    absl::Time expires;
  };
  std::map<std::string, Held> fds_ ABSL_GUARDED_BY(mu_);
  int granting_ ABSL_GUARDED_BY(mu_) = 0;  // Grant threads running
  // Leases granted since Run last looked (socket, token).
  std::vector<std::pair<int, std::string>> new_leases_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_FD_CHANNEL_H_
