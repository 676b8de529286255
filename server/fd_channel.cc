#include "server/fd_channel.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"

namespace ckptd {
namespace {

constexpr size_t kTokenLen = 32;

absl::Status Errno(absl::string_view what, absl::string_view path) {
  return absl::UnavailableError(absl::StrCat(path, ": ", what, ": ", std::strerror(errno)));
}

absl::StatusOr<sockaddr_un> Address(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": socket path too long"));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  return addr;
}

void SetTimeouts(int sock, absl::Duration timeout) {
  timeval tv{};
  tv.tv_sec = absl::ToInt64Seconds(timeout);
  tv.tv_usec = absl::ToInt64Microseconds(timeout) % 1000000;
  ::setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

// A connected SOCK_SEQPACKET socket to `path` with send/receive timeouts.
absl::StatusOr<int> Dial(const std::string& path, absl::Duration timeout) {
  auto addr = Address(path);
  if (!addr.ok()) return addr.status();
  int s = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (s < 0) return Errno("socket", path);
  SetTimeouts(s, timeout);
  if (::connect(s, reinterpret_cast<sockaddr*>(&*addr), sizeof(*addr)) != 0) {
    absl::Status st = Errno("connect to the daemon's fd socket (is ckptd running?)", path);
    ::close(s);
    return st;
  }
  return s;
}

// Sends one message, with `fd` as SCM_RIGHTS when it is >= 0.
bool SendMessage(int sock, const std::string& text, int fd) {
  iovec iov{const_cast<char*>(text.data()), text.size()};
  alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (fd >= 0) {
    msg.msg_control = ctrl;
    msg.msg_controllen = sizeof(ctrl);
    cmsghdr* cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(cm), &fd, sizeof(int));
  }
  return ::sendmsg(sock, &msg, MSG_NOSIGNAL) == static_cast<ssize_t>(text.size());
}

// Receives one message into buf (NUL-terminated, at most cap - 1 bytes) and
// the fd it carries, if any (*fd = -1 otherwise). Returns recvmsg's result.
ssize_t ReceiveMessage(int sock, char* buf, size_t cap, int* fd) {
  iovec iov{buf, cap - 1};
  alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = ctrl;
  msg.msg_controllen = sizeof(ctrl);
  const ssize_t n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  *fd = -1;
  for (cmsghdr* cm = CMSG_FIRSTHDR(&msg); n > 0 && cm != nullptr; cm = CMSG_NXTHDR(&msg, cm)) {
    if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
      std::memcpy(fd, CMSG_DATA(cm), sizeof(int));
    }
  }
  buf[n > 0 ? n : 0] = '\0';
  return n;
}

}  // namespace

std::string RandomToken() {
  static thread_local std::mt19937_64 rng(std::random_device{}() ^
                                          static_cast<uint64_t>(::getpid()) << 32);
  static const char kHex[] = "0123456789abcdef";
  std::string t(kTokenLen, '0');
  for (char& c : t) c = kHex[rng() & 15];
  return t;
}

std::string FdSocketPath(const std::string& grpc_socket) { return grpc_socket + ".fd"; }

absl::StatusOr<std::string> SendFd(const std::string& fd_socket, int fd, absl::Duration timeout) {
  absl::StatusOr<int> s = Dial(fd_socket, timeout);
  if (!s.ok()) return s.status();
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{*s};
  std::string token = RandomToken();
  if (!SendMessage(*s, token, fd)) return Errno("sendmsg", fd_socket);
  char reply[256];
  int unused = -1;
  if (ReceiveMessage(*s, reply, sizeof(reply), &unused) <= 0) {
    return Errno("no reply from the daemon", fd_socket);
  }
  if (unused >= 0) ::close(unused);
  if (std::strncmp(reply, "OK", 2) != 0) {
    return absl::UnavailableError(absl::StrCat(fd_socket, ": daemon refused the fd: ", reply));
  }
  return token;
}

absl::StatusOr<ArenaGrant> RequestArena(const std::string& fd_socket, uint64_t size,
                                        absl::Duration timeout) {
  absl::StatusOr<int> s = Dial(fd_socket, timeout);
  if (!s.ok()) return s.status();
  ArenaGrant g;
  g.lease = *s;
  auto fail = [&](absl::Status st) {
    ::close(g.lease);
    if (g.fd >= 0) ::close(g.fd);
    return st;
  };
  if (!SendMessage(g.lease, absl::StrCat("ALLOC ", size), -1)) return fail(Errno("send", fd_socket));
  char reply[256];
  if (ReceiveMessage(g.lease, reply, sizeof(reply), &g.fd) <= 0) {
    return fail(Errno("no reply from the daemon", fd_socket));
  }
  char token[kTokenLen + 1] = {};
  unsigned long long got = 0;
  if (std::strncmp(reply, "OK ", 3) != 0 || g.fd < 0 ||
      std::sscanf(reply + 3, "%32s %llu", token, &got) != 2 || std::strlen(token) != kTokenLen ||
      got < size) {
    return fail(absl::UnavailableError(
        absl::StrCat(fd_socket, ": the daemon did not lend an arena of ", size, " bytes: ", reply)));
  }
  g.token = token;
  g.size = got;
  return g;
}

absl::StatusOr<std::unique_ptr<FdReceiver>> FdReceiver::Start(const std::string& path,
                                                              uint32_t mode,
                                                              absl::Duration token_ttl,
                                                              ArenaHandler* arenas) {
  auto addr = Address(path);
  if (!addr.ok()) return addr.status();
  ::unlink(path.c_str());
  int s = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (s < 0) return Errno("socket", path);
  if (::bind(s, reinterpret_cast<sockaddr*>(&*addr), sizeof(*addr)) != 0 ||
      ::chmod(path.c_str(), mode) != 0 || ::listen(s, 64) != 0) {
    absl::Status st = Errno("bind/listen", path);
    ::close(s);
    return st;
  }
  std::unique_ptr<FdReceiver> r(new FdReceiver(path, s, token_ttl, arenas));
  r->thread_ = std::thread([p = r.get()] { p->Run(); });
  return r;
}

FdReceiver::~FdReceiver() {
  Stop();
  absl::MutexLock lock(&mu_);
  for (auto& [t, h] : fds_) ::close(h.fd);
}

void FdReceiver::Stop() {
  if (stop_.exchange(true)) return;
  if (thread_.joinable()) thread_.join();
  // Grants still being made finish first; what they lent goes back.
  std::vector<std::pair<int, std::string>> late;
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int* n) { return *n == 0; }, &granting_));
    late.swap(new_leases_);
  }
  for (const auto& [fd, token] : late) EndLease(fd, token);
  ::close(listen_fd_);
  ::unlink(path_.c_str());
}

size_t FdReceiver::pending() const {
  absl::MutexLock lock(&mu_);
  return fds_.size();
}

void FdReceiver::ExpireLocked() {
  const absl::Time now = absl::Now();
  for (auto it = fds_.begin(); it != fds_.end();) {
    if (it->second.expires < now) {
      ::close(it->second.fd);
      it = fds_.erase(it);
    } else {
      ++it;
    }
  }
}

void FdReceiver::Run() {
  std::vector<pollfd> polls;
  while (!stop_.load()) {
    {
      absl::MutexLock lock(&mu_);
      for (auto& [fd, token] : new_leases_) leases_[fd] = std::move(token);
      new_leases_.clear();
    }
    polls.assign(1, pollfd{listen_fd_, POLLIN, 0});
    for (const auto& [fd, token] : leases_) polls.push_back(pollfd{fd, POLLIN, 0});
    int r = ::poll(polls.data(), polls.size(), 200);
    {
      absl::MutexLock lock(&mu_);
      ExpireLocked();
    }
    if (r <= 0) continue;
    // A lease ends when the client closes it (or dies); anything it sends
    // after the grant ends it too.
    for (size_t i = 1; i < polls.size(); ++i) {
      if (polls[i].revents == 0) continue;
      auto it = leases_.find(polls[i].fd);
      EndLease(it->first, it->second);
      leases_.erase(it);
    }
    if ((polls[0].revents & POLLIN) == 0) continue;
    int c = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) continue;
    if (!Serve(c)) ::close(c);
  }
  for (const auto& [fd, token] : leases_) EndLease(fd, token);
  leases_.clear();
}

void FdReceiver::EndLease(int fd, const std::string& token) {
  if (arenas_ != nullptr) arenas_->Release(token);
  ::close(fd);
}

bool FdReceiver::Serve(int c) {
  SetTimeouts(c, absl::Seconds(2));
  char buf[64];
  int fd = -1;
  const ssize_t n = ReceiveMessage(c, buf, sizeof(buf), &fd);
  if (n > 6 && fd < 0 && std::strncmp(buf, "ALLOC ", 6) == 0) {
    if (arenas_ == nullptr) {
      SendMessage(c, "ERR this daemon lends no arenas", -1);
      return false;
    }
    char* end = nullptr;
    errno = 0;
    const unsigned long long size = std::strtoull(buf + 6, &end, 10);
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (errno != 0 || end == buf + 6 || *end != '\0' ||
        ::getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      SendMessage(c, "ERR expected ALLOC <bytes>", -1);
      return false;
    }
    // Making an arena faults in its memory (seconds for many GiB): on its
    // own thread, so other clients of this socket are not held up.
    {
      absl::MutexLock lock(&mu_);
      if (granting_ >= kMaxGranting) {
        SendMessage(c, "ERR too many arena requests at once; retry", -1);
        return false;
      }
      ++granting_;
    }
    std::thread([this, c, size, uid = cred.uid] { Grant(c, size, uid); }).detach();
    return true;  // the socket is Grant's now
  }
  const char* text = "OK";
  if (n != static_cast<ssize_t>(kTokenLen) || fd < 0) {
    text = "ERR expected a 32-byte token and one fd, or ALLOC <bytes>";
    if (fd >= 0) ::close(fd);
  } else {
    absl::MutexLock lock(&mu_);
    if (fds_.size() >= 4096) {
      text = "ERR too many pending fds";
      ::close(fd);
    } else {
      auto [it, inserted] = fds_.emplace(std::string(buf, kTokenLen), Held{fd, absl::Now() + ttl_});
      if (!inserted) {
        text = "ERR duplicate token";
        ::close(fd);
      }
    }
  }
  SendMessage(c, text, -1);
  return false;
}

void FdReceiver::Grant(int c, uint64_t size, uid_t uid) {
  absl::StatusOr<ArenaLease> lease = arenas_->Allocate(size, uid);
  bool kept = false;
  if (!lease.ok()) {
    SendMessage(c, absl::StrCat("ERR ", lease.status().message()), -1);
  } else {
    const bool sent =
        SendMessage(c, absl::StrCat("OK ", lease->token, " ", lease->size), lease->fd);
    ::close(lease->fd);
    if (sent) {
      kept = true;
      arenas_->Prefault(lease->token);
    } else {
      arenas_->Release(lease->token);
    }
  }
  absl::MutexLock lock(&mu_);
  if (kept) {
    new_leases_.emplace_back(c, lease->token);  // Run polls it from its next round
  } else {
    ::close(c);
  }
  --granting_;
}

absl::StatusOr<int> FdReceiver::Take(const std::string& token) {
  absl::MutexLock lock(&mu_);
  auto it = fds_.find(token);
  if (it == fds_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm fd_token '", token, "' is unknown or expired (send the fd first)"));
  }
  int fd = it->second.fd;
  fds_.erase(it);
  return fd;
}

}  // namespace ckptd
