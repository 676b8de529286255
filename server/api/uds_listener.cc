#include "server/api/uds_listener.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>
#include <spdlog/spdlog.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace ckptd {

absl::StatusOr<std::unique_ptr<UdsListener>> UdsListener::Listen(const std::string& path,
                                                                 uint32_t mode,
                                                                 uint64_t max_connections) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": socket path too long"));
  }
  // Bound under a temporary name and renamed into place once listening:
  // a client that sees the socket file can connect (no ECONNREFUSED window
  // between bind and listen).
  const std::string bound = path.size() + 4 < sizeof(addr.sun_path) ? path + ".new" : path;
  std::memcpy(addr.sun_path, bound.c_str(), bound.size() + 1);
  const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (s < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  if (bound != path) ::unlink(bound.c_str());
  // Room to rotate connection fds through: raise the soft fd limit to the
  // hard one (at most 1M) and use its upper part.
  int fd_base = 0, fd_limit = 0;
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    rlim_t want = rl.rlim_max == RLIM_INFINITY ? (1 << 20) : std::min<rlim_t>(rl.rlim_max, 1 << 20);
    if (want > rl.rlim_cur) {
      rl.rlim_cur = want;
      ::setrlimit(RLIMIT_NOFILE, &rl);
    }
    ::getrlimit(RLIMIT_NOFILE, &rl);
    const int limit = static_cast<int>(std::min<rlim_t>(rl.rlim_cur, 1 << 20));
    fd_base = limit / 2;
    fd_limit = limit - 16;
    // The kernel grows a process's fd table the first time a number past it
    // is used, and in a process with threads that waits out an RCU grace
    // period (10-25 ms measured here): grown now to the top of the range,
    // before the socket appears, not in the first client's connection (a
    // restarted job's first load).
    if (fd_limit > fd_base) {
      const int probe = ::fcntl(s, F_DUPFD_CLOEXEC, fd_limit - 1);
      if (probe >= 0) ::close(probe);
    }
  }
  // Created with no access for anyone, then opened up to `mode`: no window
  // in which the umask decides who may connect.
  const mode_t old = ::umask(0777);
  const int b = ::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::umask(old);
  if (b != 0 || ::chmod(bound.c_str(), mode) != 0 || ::listen(s, 256) != 0 ||
      (bound != path && ::rename(bound.c_str(), path.c_str()) != 0)) {
    const int err = errno;
    ::close(s);
    return absl::UnavailableError(absl::StrCat("cannot listen on ", path, ": ", std::strerror(err)));
  }
  std::unique_ptr<UdsListener> l(new UdsListener(path, s, max_connections));
  l->fd_base_ = fd_base;
  l->fd_limit_ = fd_limit;
  l->next_fd_ = fd_base;
  return l;
}

UdsListener::~UdsListener() { Stop(); }

void UdsListener::Serve(grpc::Server* server) {
  thread_ = std::thread([this, server] { Run(server); });
}

void UdsListener::Stop() {
  if (stop_.exchange(true)) return;
  if (thread_.joinable()) thread_.join();
  // Closed, not just no longer accepted from: a client connecting now is
  // refused at once (ECONNREFUSED: "is the daemon running?") instead of
  // waiting in the backlog until its deadline, and connections queued in
  // the backlog are reset.
  ::close(listen_fd_);
}

size_t UdsListener::connections() const {
  absl::MutexLock lock(&mu_);
  return conns_.size();
}

void UdsListener::PruneLocked() {
  for (auto it = conns_.begin(); it != conns_.end();) {
    struct stat st;
    if (::fstat(it->first, &st) != 0 || !S_ISSOCK(st.st_mode) || st.st_ino != it->second.ino) {
      it = conns_.erase(it);
    } else {
      ++it;
    }
  }
}

void UdsListener::Run(grpc::Server* server) {
  while (!stop_.load()) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, 200) <= 0) continue;
    // gRPC drives the connection with non-blocking I/O.
    int c = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (c < 0) continue;
    Caller caller;
    caller.via = Caller::Via::kUnix;
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (::getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      spdlog::warn("{}: SO_PEERCRED: {}; connection closed", path_, std::strerror(errno));
      ::close(c);
      continue;
    }
    caller.uid = cred.uid;
    caller.gid = cred.gid;
    caller.pid = cred.pid;
    gid_t groups[256];
    len = sizeof(groups);
    if (::getsockopt(c, SOL_SOCKET, SO_PEERGROUPS, groups, &len) == 0) {
      caller.groups.assign(groups, groups + len / sizeof(gid_t));
    }
    // A fresh fd number (see the header).
    if (fd_limit_ > fd_base_) {
      int moved = ::fcntl(c, F_DUPFD_CLOEXEC, next_fd_);
      if (moved < 0 && next_fd_ != fd_base_) moved = ::fcntl(c, F_DUPFD_CLOEXEC, fd_base_);
      if (moved >= 0) {
        ::close(c);
        c = moved;
        next_fd_ = c + 1 >= fd_limit_ ? fd_base_ : c + 1;
      }
    }
    struct stat st;
    if (::fstat(c, &st) != 0) {
      ::close(c);
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      PruneLocked();
      size_t mine = 0;
      for (const auto& [fd, conn] : conns_) mine += conn.caller.uid == caller.uid;
      if (conns_.size() >= max_connections_ || mine >= std::max<uint64_t>(1, max_connections_ / 4)) {
        spdlog::warn("{}: refused a connection of {}: {} connections open ({} of them its uid's; "
                     "limits.max_connections {})",
                     path_, caller.Describe(), conns_.size(), mine, max_connections_);
        ::close(c);
        continue;
      }
      conns_[c] = Conn{caller, st.st_ino};
    }
    grpc::AddInsecureChannelFromFd(server, c);  // gRPC owns `c` now
  }
}

std::optional<Caller> UdsListener::Lookup(const std::string& peer) const {
  // "fd:N" (gRPC names an fd channel's endpoint after its fd).
  absl::string_view v = peer;
  int fd = -1;
  if (!absl::ConsumePrefix(&v, "fd:") || !absl::SimpleAtoi(v, &fd)) return std::nullopt;
  absl::MutexLock lock(&mu_);
  auto it = conns_.find(fd);
  if (it == conns_.end()) return std::nullopt;
  return it->second.caller;
}

}  // namespace ckptd
