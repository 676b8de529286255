#include "proto/fd_socket.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ckptd {
namespace {

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

// Fills `out` from the kernel's CSPRNG; never falls back to a weaker source.
void RandomBytes(uint8_t* out, size_t n) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::getrandom(out + got, n - got, 0);
    if (r > 0) {
      got += static_cast<size_t>(r);
    } else if (r < 0 && errno != EINTR) {
      std::fprintf(stderr, "ckptd: getrandom: %s\n", std::strerror(errno));
      std::abort();
    }
  }
}

// Receives the daemon's reply. A daemon that refuses a connection before
// reading its request closes it with the request unread, and the kernel then
// reports ECONNRESET to the first receive even though the reply is queued:
// the second one gets it.
ssize_t ReceiveReply(int sock, char* buf, size_t cap, int* fd) {
  ssize_t n = ReceiveMessage(sock, buf, cap, fd);
  if (n < 0 && errno == ECONNRESET) n = ReceiveMessage(sock, buf, cap, fd, MSG_DONTWAIT);
  return n;
}

}  // namespace

std::string FdSocketPath(const std::string& grpc_socket) { return grpc_socket + ".fd"; }

std::string RandomToken() {
  static const char kHex[] = "0123456789abcdef";
  uint8_t bytes[kTokenLen / 2];
  RandomBytes(bytes, sizeof(bytes));
  std::string t(kTokenLen, '0');
  for (size_t i = 0; i < sizeof(bytes); ++i) {
    t[2 * i] = kHex[bytes[i] >> 4];
    t[2 * i + 1] = kHex[bytes[i] & 15];
  }
  return t;
}

bool IsToken(absl::string_view s) {
  if (s.size() != kTokenLen) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

std::string TokenPrefix(absl::string_view token) {
  std::string p(token.substr(0, 8));
  for (char& c : p) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c))) c = '?';
  }
  return absl::StrCat(p, "...");
}

absl::Status SealSegment(int fd) {
  if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    return absl::InternalError(absl::StrCat(
        "sealing the shared-memory segment (F_SEAL_SHRINK|F_SEAL_GROW): ", std::strerror(errno),
        errno == EPERM ? " (create the memfd with MFD_ALLOW_SEALING)" : ""));
  }
  return absl::OkStatus();
}

absl::Status CheckSealedSegment(int fd, const std::string& what) {
  constexpr absl::string_view kHow =
      "create it with memfd_create(..., MFD_ALLOW_SEALING), size it with ftruncate, then add "
      "F_SEAL_SHRINK|F_SEAL_GROW (fcntl F_ADD_SEALS)";
  // Seals first: only shmem and hugetlbfs files have them, and asking costs
  // no file system anything (an fstat of a FUSE file could block).
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    if (errno == EINVAL) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " is not a memfd (it cannot carry seals): the daemon maps only sealed memfds; ",
          kHow));
    }
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": F_GET_SEALS: ", std::strerror(errno), "; send a sealed memfd"));
  }
  struct statfs fs {};
  if (::fstatfs(fd, &fs) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": fstatfs: ", std::strerror(errno)));
  }
  if (static_cast<uint64_t>(fs.f_type) == HUGETLBFS_MAGIC) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " is a hugetlbfs memfd (MFD_HUGETLB), whose pages can fault (SIGBUS) when huge "
              "pages run out: send a plain memfd (tmpfs)"));
  }
  if (static_cast<uint64_t>(fs.f_type) != TMPFS_MAGIC) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s is not a tmpfs memfd (file system type 0x%x): send a plain memfd", what,
        static_cast<uint64_t>(fs.f_type)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": fstat: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is not a regular file: send a memfd"));
  }
  if ((seals & F_SEAL_SHRINK) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": the memfd is not sealed with F_SEAL_SHRINK (it could be truncated while the "
              "daemon copies into it): ",
        kHow));
  }
#ifdef F_SEAL_FUTURE_WRITE
  constexpr int kWriteSeals = F_SEAL_WRITE | F_SEAL_FUTURE_WRITE;
#else
  constexpr int kWriteSeals = F_SEAL_WRITE;
#endif
  if ((seals & kWriteSeals) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": the memfd is sealed against writes (F_SEAL_WRITE/F_SEAL_FUTURE_WRITE) but the "
              "daemon writes into it: seal it with F_SEAL_SHRINK|F_SEAL_GROW only"));
  }
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl < 0 || (fl & O_ACCMODE) != O_RDWR) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the memfd is not open read-write: send the fd memfd_create returned"));
  }
  return absl::OkStatus();
}

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

bool SendMessage(int sock, absl::string_view text, int fd, int flags) {
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
  ssize_t n;
  do {
    n = ::sendmsg(sock, &msg, flags | MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(text.size());
}

ssize_t ReceiveMessage(int sock, char* buf, size_t cap, int* fd, int flags, bool* truncated) {
  iovec iov{buf, cap - 1};
  // Room for a few fds, so a sender of several has them all closed here
  // rather than leaked into this process.
  alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int) * 8)] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = ctrl;
  msg.msg_controllen = sizeof(ctrl);
  ssize_t n;
  do {
    n = ::recvmsg(sock, &msg, flags | MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  *fd = -1;
  if (n >= 0) {
    for (cmsghdr* cm = CMSG_FIRSTHDR(&msg); cm != nullptr; cm = CMSG_NXTHDR(&msg, cm)) {
      if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int f;
        std::memcpy(&f, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
        if (*fd < 0) {
          *fd = f;
        } else {
          ::close(f);
          if (truncated != nullptr) *truncated = true;  // more than one fd
        }
      }
    }
  }
  if (truncated != nullptr && n >= 0 && (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
    *truncated = true;
  }
  buf[n > 0 ? n : 0] = '\0';
  return n;
}

std::string ErrorReply(const absl::Status& status) {
  std::string r = absl::StrCat("ERR ", absl::StatusCodeToString(status.code()), ": ",
                               status.message());
  if (r.size() > kMaxMessage - 1) r.resize(kMaxMessage - 1);
  return r;
}

absl::Status ParseReply(absl::string_view reply, absl::string_view context) {
  if (absl::StartsWith(reply, "OK")) return absl::OkStatus();
  if (reply.empty()) return absl::UnavailableError(absl::StrCat(context, ": no reply"));
  absl::string_view rest = reply;
  if (absl::StartsWith(rest, "ERR ")) rest.remove_prefix(4);
  absl::StatusCode code = absl::StatusCode::kUnavailable;
  const size_t colon = rest.find(": ");
  if (colon != absl::string_view::npos) {
    const absl::string_view name = rest.substr(0, colon);
    for (int c = 1; c <= 16; ++c) {
      if (name == absl::StatusCodeToString(static_cast<absl::StatusCode>(c))) {
        code = static_cast<absl::StatusCode>(c);
        rest.remove_prefix(colon + 2);
        break;
      }
    }
  }
  return absl::Status(code, absl::StrCat(context, ": ", rest));
}

// After a failed send: the daemon may have refused the connection before
// reading it ("ERR RESOURCE_EXHAUSTED: too many connections ..."); its reply
// is still queued here. That reply's status, else the send's error.
static absl::Status SendFailed(int sock, absl::string_view fd_socket, absl::string_view context) {
  const absl::Status sent = Errno("sendmsg", fd_socket);
  char reply[kMaxMessage];
  int fd = -1;
  ssize_t n = ReceiveMessage(sock, reply, sizeof(reply), &fd, MSG_DONTWAIT);
  if (n < 0 && errno == ECONNRESET) n = ReceiveMessage(sock, reply, sizeof(reply), &fd, MSG_DONTWAIT);
  if (n > 0) {
    if (fd >= 0) ::close(fd);
    absl::Status st = ParseReply(reply, absl::StrCat(fd_socket, ": ", context));
    if (!st.ok()) return st;
  }
  return sent;
}

absl::StatusOr<std::string> SendFd(const std::string& fd_socket, int fd, absl::Duration timeout) {
  absl::StatusOr<int> s = Dial(fd_socket, timeout);
  if (!s.ok()) return s.status();
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{*s};
  std::string token = RandomToken();
  if (!SendMessage(*s, token, fd)) return SendFailed(*s, fd_socket, "daemon refused the fd");
  char reply[kMaxMessage];
  int unused = -1;
  if (ReceiveReply(*s, reply, sizeof(reply), &unused) <= 0) {
    return Errno("no reply from the daemon", fd_socket);
  }
  if (unused >= 0) ::close(unused);
  absl::Status st = ParseReply(reply, absl::StrCat(fd_socket, ": daemon refused the fd"));
  if (!st.ok()) return st;
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
  if (!SendMessage(g.lease, absl::StrCat("ALLOC ", size), -1)) {
    return fail(SendFailed(g.lease, fd_socket, "the daemon lent no arena"));
  }
  char reply[kMaxMessage];
  if (ReceiveReply(g.lease, reply, sizeof(reply), &g.fd) <= 0) {
    return fail(Errno("no reply from the daemon", fd_socket));
  }
  char token[kTokenLen + 1] = {};
  unsigned long long got = 0;
  if (std::strncmp(reply, "OK ", 3) != 0 || g.fd < 0 ||
      std::sscanf(reply + 3, "%32s %llu", token, &got) != 2 || !IsToken(token) || got < size) {
    return fail(absl::UnavailableError(
        absl::StrCat(fd_socket, ": the daemon did not lend an arena of ", size, " bytes: ", reply)));
  }
  g.token = token;
  g.size = got;
  return g;
}

}  // namespace ckptd
