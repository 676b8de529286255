// The daemon side of the fd socket (protocol: proto/fd_socket.h): clients
// hand it sealed memfds (SCM_RIGHTS) and borrow arenas ("ALLOC <bytes>").
//
// One thread serves every connection with epoll, never blocking on a
// client: each connection has kRequestTimeout to send its one request (then
// it is closed), connections waiting for their request are capped (in all
// and per uid; past the cap a connection gets "ERR RESOURCE_EXHAUSTED: ..."
// at once), replies are sent without waiting, arenas are made and handed out
// on their own threads (a bounded number at once), and lease sockets are
// watched on the same epoll set: a lease ends when its client closes it.
//
// Received fds are checked (CheckSealedSegment: a tmpfs memfd sealed against
// shrinking), held for a while under their token and the uid that sent them
// (SO_PEERCRED), and taken by that uid only.
#ifndef CKPTD_SERVER_DELIVERY_FD_CHANNEL_H_
#define CKPTD_SERVER_DELIVERY_FD_CHANNEL_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/fd_socket.h"

namespace ckptd {

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

// What the daemon does with "VIEWS <token>" requests (a load's cache views,
// core/cache/cache_view.h) and with their connections closing.
class ViewHandler {
 public:
  virtual ~ViewHandler() = default;
  // The views' fds (the receiver sends and closes them) for the uid whose
  // load `token` names, once; an error otherwise.
  virtual absl::StatusOr<std::vector<int>> Take(const std::string& token, uid_t uid) = 0;
  // The client that took them closed the connection (done copying), or
  // (copied false) they could not be sent.
  virtual void Done(const std::string& token, bool copied = true) = 0;
};

struct FdReceiverLimits {
  // How long a connection may take to send its request.
  absl::Duration request_timeout = kRequestTimeout;
  // Connections that have not sent their request yet, in all and per uid.
  int max_waiting = 1024;
  int max_waiting_per_uid = 256;
  // Fds received and not yet taken, in all and per uid.
  size_t max_held = 4096;
  size_t max_held_per_uid = 1024;
  // Arena grants being made at once (each on its own thread).
  int max_granting = 64;
};

// Daemon side: serves the fd socket at `path` on a background thread, and
// arena requests when `arenas` is set (it must outlive the receiver).
class FdReceiver {
 public:
  ~FdReceiver();
  static absl::StatusOr<std::unique_ptr<FdReceiver>> Start(
      const std::string& path, uint32_t mode, absl::Duration token_ttl,
      ArenaHandler* arenas = nullptr, const FdReceiverLimits& limits = FdReceiverLimits(),
      ViewHandler* views = nullptr);
  // Takes ownership of the fd named by `token` (the caller closes it), if
  // `caller_uid` sent it: INVALID_ARGUMENT when unknown or expired,
  // PERMISSION_DENIED when another uid sent it (it stays held for its owner).
  absl::StatusOr<int> Take(const std::string& token, uid_t caller_uid);
  // The load whose views `token` named is over: its views connection, if
  // the client still holds it open, is closed (no descriptor outlives a load).
  void EndViews(const std::string& token);
  void Stop();
  size_t pending() const;  // fds held, not yet taken
  size_t waiting() const;  // connections that have not sent their request

 private:
  FdReceiver(std::string path, int listen_fd, int epoll_fd, int wake_fd, absl::Duration ttl,
             ArenaHandler* arenas, const FdReceiverLimits& limits, ViewHandler* views)
      : path_(std::move(path)),
        listen_fd_(listen_fd),
        epoll_fd_(epoll_fd),
        wake_fd_(wake_fd),
        ttl_(ttl),
        arenas_(arenas),
        views_(views),
        limits_(limits) {}

  // A connection on the epoll set (Run's thread only).
  struct Conn {
    int fd;
    uid_t uid;
    bool lease;           // a lent arena's lease socket (else: waiting for its request)
    absl::Time deadline;  // for its request
    std::string token;    // lease: the arena's token, or "v:" + a views token
  };

  void Run();
  void Wake();
  void AcceptAll();
  void Watch(int fd, uid_t uid, bool lease, std::string token);
  // Takes the connection off the epoll set and out of conns_; returns it.
  Conn Unwatch(uint64_t id);
  // Reads the request of connection `id` and answers it (or hands it to a
  // Grant thread).
  void Serve(uint64_t id);
  // Answers "VIEWS <token>" on connection `c` (then watched as the views'
  // lease, or closed).
  void ServeViews(int c, const std::string& token, uid_t uid);
  // Answers a token + fd request (the fd is Hold's): the reply text.
  std::string Hold(const std::string& token, int fd, uid_t uid);
  // The client's lease socket `fd` closed (or we stop): the arena goes back.
  void EndLease(int fd, const std::string& token);
  // Lends an arena to the client on `c` (its own thread; see Serve).
  void Grant(int c, uint64_t size, uid_t uid);
  void ExpireLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  const int listen_fd_;
  const int epoll_fd_;
  const int wake_fd_;  // eventfd: Stop and Grant threads wake Run
  const absl::Duration ttl_;
  ArenaHandler* const arenas_;
  ViewHandler* const views_;
  const FdReceiverLimits limits_;
  std::atomic<bool> stop_{false};
  std::atomic<size_t> waiting_{0};
  std::thread thread_;

  // Run's thread only.
  uint64_t next_id_ = 2;  // 0: the listening socket, 1: wake_fd_
  std::unordered_map<uint64_t, Conn> conns_;
  std::multimap<absl::Time, uint64_t> deadlines_;  // connections waiting for their request
  std::unordered_map<uid_t, int> waiting_per_uid_;
  absl::Time accept_paused_until_ = absl::InfinitePast();  // out of fds: accept later

  mutable absl::Mutex mu_;
  struct Held {
    int fd;
    absl::Time expires;
    uid_t uid;
  };
  std::map<std::string, Held> fds_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<uid_t, size_t> held_per_uid_ ABSL_GUARDED_BY(mu_);
  int granting_ ABSL_GUARDED_BY(mu_) = 0;  // Grant threads running
  // Leases granted since Run last looked (socket, uid, token).
  struct NewLease {
    int fd;
    uid_t uid;
    std::string token;
  };
  std::vector<NewLease> new_leases_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> ended_views_ ABSL_GUARDED_BY(mu_);  // "v:" + token
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_DELIVERY_FD_CHANNEL_H_
