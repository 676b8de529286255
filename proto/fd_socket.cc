#include "proto/fd_socket.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"
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

// At most 24 bytes of untrusted text for a message, escaped and quoted.
std::string Quoted(absl::string_view s) {
  constexpr size_t kShown = 24;
  return absl::StrCat("'", absl::CEscape(s.substr(0, kShown)), s.size() > kShown ? "'..." : "'");
}

// `text` as a number of bytes: canonical decimal, 1..kMaxArenaBytes.
absl::StatusOr<uint64_t> ParseByteCount(absl::string_view text) {
  constexpr size_t kMaxDigits = 20;  // UINT64_MAX has 20
  if (text.empty()) return absl::InvalidArgumentError("no number of bytes");
  if (text.size() > kMaxDigits) {
    return absl::InvalidArgumentError(absl::StrCat(Quoted(text), " (", text.size(),
                                                   " characters) is longer than any number of bytes"));
  }
  uint64_t v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') {
      return absl::InvalidArgumentError(absl::StrCat(
          Quoted(text), " is not a decimal number of bytes (digits only: no sign, space or other "
                        "character)"));
    }
    const uint64_t d = static_cast<uint64_t>(c - '0');
    if (v > (UINT64_MAX - d) / 10) {
      return absl::InvalidArgumentError(absl::StrCat(Quoted(text), " does not fit in 64 bits"));
    }
    v = v * 10 + d;
  }
  if (text.size() > 1 && text[0] == '0') {
    return absl::InvalidArgumentError(absl::StrCat(Quoted(text), " has a leading zero"));
  }
  if (v == 0) return absl::InvalidArgumentError("0 bytes (at least 1)");
  if (v > kMaxArenaBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(v, " bytes is over the limit of ", kMaxArenaBytes, " (64 TiB)"));
  }
  return v;
}

// What no message may be: over-long, or carrying a NUL byte.
absl::Status CheckMessage(absl::string_view message) {
  if (message.size() > kMaxMessage - 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(message.size(), " bytes, over the limit of ", kMaxMessage - 1));
  }
  if (message.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(Quoted(message), " has a NUL byte"));
  }
  return absl::OkStatus();
}

// The status code named `name` (1..16), if it is one.
std::optional<absl::StatusCode> CodeNamed(absl::string_view name) {
  for (int c = 1; c <= 16; ++c) {
    if (name == absl::StatusCodeToString(static_cast<absl::StatusCode>(c))) {
      return static_cast<absl::StatusCode>(c);
    }
  }
  return std::nullopt;
}

// Receives and parses the daemon's reply; *fd gets the fd it carried (-1
// if none). UNAVAILABLE "<fd_socket>: <what>: ..." when there is no reply or
// it is malformed; an "ERR ..." reply is returned as a value. A daemon that
// refuses a connection before reading its request closes it with the
// request unread, and the kernel then reports ECONNRESET to the first
// receive even though the reply is queued: the second one gets it.
// The fds that came with the reply go to *fds (at most `max_fds`; more
// make the reply malformed); on an error none is left open.
absl::StatusOr<FdReply> AwaitReply(int sock, std::vector<int>* fds, size_t max_fds,
                                   absl::string_view fd_socket, absl::string_view what) {
  char buf[kMaxMessage];
  bool truncated = false;
  ssize_t n = ReceiveMessageFds(sock, buf, sizeof(buf), fds, 0, &truncated);
  if (n < 0 && errno == ECONNRESET) {
    n = ReceiveMessageFds(sock, buf, sizeof(buf), fds, MSG_DONTWAIT, &truncated);
  }
  auto fail = [&](absl::Status st) {
    for (int f : *fds) ::close(f);
    fds->clear();
    return st;
  };
  if (n <= 0) return fail(Errno("no reply from the daemon", fd_socket));
  absl::StatusOr<FdReply> reply =
      truncated || fds->size() > max_fds
          ? absl::InvalidArgumentError(absl::StrCat("malformed reply: longer than ",
                                                    kMaxMessage - 1, " bytes or with more than ",
                                                    max_fds, " fd(s)"))
          : ParseFdReply(absl::string_view(buf, static_cast<size_t>(n)));
  if (!reply.ok()) {
    return fail(absl::UnavailableError(
        absl::StrCat(fd_socket, ": ", what, ": ", reply.status().message())));
  }
  return reply;
}

}  // namespace

absl::StatusOr<FdRequest> ParseFdRequest(absl::string_view message) {
  const std::string expected =
      absl::StrCat("expected a ", kTokenLen, "-character lowercase hex token and one fd, or ALLOC <bytes>");
  if (absl::Status s = CheckMessage(message); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(expected, ": ", s.message()));
  }
  FdRequest r;
  absl::string_view rest = message;
  if (absl::ConsumePrefix(&rest, "ALLOC ")) {
    absl::StatusOr<uint64_t> bytes = ParseByteCount(rest);
    if (!bytes.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("expected ALLOC <bytes>: ", bytes.status().message()));
    }
    r.kind = FdRequest::Kind::kAlloc;
    r.bytes = *bytes;
    return r;
  }
  if (absl::StartsWith(message, "ALLOC")) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected ALLOC <bytes> (one space, then the number): got ", Quoted(message)));
  }
  if (absl::ConsumePrefix(&rest, "VIEWS ")) {
    if (!IsToken(rest)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "expected VIEWS <", kTokenLen, "-character lowercase hex token>: got ", Quoted(message)));
    }
    r.kind = FdRequest::Kind::kViews;
    r.token = std::string(rest);
    return r;
  }
  if (!IsToken(message)) {
    return absl::InvalidArgumentError(absl::StrCat(expected, ": got ", Quoted(message)));
  }
  r.kind = FdRequest::Kind::kHandOver;
  r.token = std::string(message);
  return r;
}

std::string EncodeFdRequest(const FdRequest& request) {
  if (request.kind == FdRequest::Kind::kAlloc) return absl::StrCat("ALLOC ", request.bytes);
  if (request.kind == FdRequest::Kind::kViews) return absl::StrCat("VIEWS ", request.token);
  return request.token;
}

absl::StatusOr<FdReply> ParseFdReply(absl::string_view message) {
  auto bad = [](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("malformed reply: ", why));
  };
  if (absl::Status s = CheckMessage(message); !s.ok()) return bad(s.message());
  FdReply r;
  if (message == "OK") return r;
  absl::string_view rest = message;
  if (absl::ConsumePrefix(&rest, "OK VIEWS ")) {
    absl::StatusOr<uint64_t> count = ParseByteCount(rest);
    if (!count.ok() || *count > kMaxViewFds) {
      return bad(absl::StrCat("expected OK VIEWS <count> (1 to ", kMaxViewFds, "), got ",
                              Quoted(message)));
    }
    r.kind = FdReply::Kind::kViews;
    r.bytes = *count;
    return r;
  }
  if (absl::ConsumePrefix(&rest, "OK ")) {
    const size_t space = rest.find(' ');
    const absl::string_view token = rest.substr(0, space);
    if (space == absl::string_view::npos || !IsToken(token)) {
      return bad(absl::StrCat("expected OK <", kTokenLen, "-character lowercase hex token> <bytes>, got ",
                              Quoted(message)));
    }
    absl::StatusOr<uint64_t> bytes = ParseByteCount(rest.substr(space + 1));
    if (!bytes.ok()) return bad(absl::StrCat("arena size: ", bytes.status().message()));
    r.kind = FdReply::Kind::kGrant;
    r.token = std::string(token);
    r.bytes = *bytes;
    return r;
  }
  if (absl::ConsumePrefix(&rest, "ERR ")) {
    r.kind = FdReply::Kind::kError;
    absl::StatusCode code = absl::StatusCode::kUnavailable;  // an older daemon's bare message
    const size_t colon = rest.find(": ");
    if (colon != absl::string_view::npos) {
      if (std::optional<absl::StatusCode> c = CodeNamed(rest.substr(0, colon))) {
        code = *c;
        rest.remove_prefix(colon + 2);
      }
    }
    r.error = absl::Status(code, rest);
    return r;
  }
  return bad(absl::StrCat("expected OK, OK <token> <bytes> or ERR <reason>, got ", Quoted(message)));
}

std::string EncodeFdReply(const FdReply& reply) {
  switch (reply.kind) {
    case FdReply::Kind::kOk:
      return "OK";
    case FdReply::Kind::kGrant:
      return absl::StrCat("OK ", reply.token, " ", reply.bytes);
    case FdReply::Kind::kViews:
      return absl::StrCat("OK VIEWS ", reply.bytes);
    case FdReply::Kind::kError:
      break;
  }
  absl::StatusCode code = reply.error.code();
  if (!CodeNamed(absl::StatusCodeToString(code))) code = absl::StatusCode::kUnknown;
  std::string r = absl::StrCat("ERR ", absl::StatusCodeToString(code), ": ", reply.error.message());
  if (r.size() > kMaxMessage - 1) r.resize(kMaxMessage - 1);
  std::replace(r.begin(), r.end(), '\0', '?');
  return r;
}

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
  return SendMessageFds(sock, text, &fd, fd >= 0 ? 1 : 0, flags);
}

bool SendMessageFds(int sock, absl::string_view text, const int* fds, size_t count, int flags) {
  if (count > kMaxViewFds) return false;
  iovec iov{const_cast<char*>(text.data()), text.size()};
  alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int) * kMaxViewFds)] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (count > 0) {
    msg.msg_control = ctrl;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * count);
    cmsghdr* cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int) * count);
    std::memcpy(CMSG_DATA(cm), fds, sizeof(int) * count);
  }
  ssize_t n;
  do {
    n = ::sendmsg(sock, &msg, flags | MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(text.size());
}

ssize_t ReceiveMessage(int sock, char* buf, size_t cap, int* fd, int flags, bool* truncated) {
  std::vector<int> fds;
  const ssize_t n = ReceiveMessageFds(sock, buf, cap, &fds, flags, truncated);
  *fd = fds.empty() ? -1 : fds[0];
  for (size_t i = 1; i < fds.size(); ++i) {  // one fd at most here
    ::close(fds[i]);
    if (truncated != nullptr) *truncated = true;
  }
  return n;
}

ssize_t ReceiveMessageFds(int sock, char* buf, size_t cap, std::vector<int>* fds, int flags,
                          bool* truncated) {
  iovec iov{buf, cap - 1};
  // Room for every fd a sender may send, so none is leaked into this
  // process (beyond it the kernel closes them and sets MSG_CTRUNC).
  alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int) * kMaxViewFds)] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = ctrl;
  msg.msg_controllen = sizeof(ctrl);
  ssize_t n;
  do {
    n = ::recvmsg(sock, &msg, flags | MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  fds->clear();
  if (n >= 0) {
    for (cmsghdr* cm = CMSG_FIRSTHDR(&msg); cm != nullptr; cm = CMSG_NXTHDR(&msg, cm)) {
      if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int f;
        std::memcpy(&f, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
        fds->push_back(f);
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
  FdReply r;
  r.kind = FdReply::Kind::kError;
  r.error = status;
  return EncodeFdReply(r);
}

absl::Status ParseReply(absl::string_view reply, absl::string_view context) {
  if (reply.empty()) return absl::UnavailableError(absl::StrCat(context, ": no reply"));
  absl::StatusOr<FdReply> r = ParseFdReply(reply);
  if (!r.ok()) return absl::UnavailableError(absl::StrCat(context, ": ", r.status().message()));
  if (r->kind != FdReply::Kind::kError) return absl::OkStatus();
  return absl::Status(r->error.code(), absl::StrCat(context, ": ", r->error.message()));
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
    absl::StatusOr<FdReply> r = ParseFdReply(absl::string_view(reply, static_cast<size_t>(n)));
    if (r.ok() && r->kind == FdReply::Kind::kError) {
      return absl::Status(r->error.code(),
                          absl::StrCat(fd_socket, ": ", context, ": ", r->error.message()));
    }
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
  FdRequest request;
  request.token = RandomToken();
  if (!SendMessage(*s, EncodeFdRequest(request), fd)) {
    return SendFailed(*s, fd_socket, "daemon refused the fd");
  }
  std::vector<int> unused;
  absl::StatusOr<FdReply> reply = AwaitReply(*s, &unused, 1, fd_socket, "handing over the fd");
  for (int f : unused) ::close(f);
  if (!reply.ok()) return reply.status();
  if (reply->kind == FdReply::Kind::kError) {
    return absl::Status(reply->error.code(), absl::StrCat(fd_socket, ": daemon refused the fd: ",
                                                          reply->error.message()));
  }
  if (reply->kind != FdReply::Kind::kOk) {
    return absl::UnavailableError(absl::StrCat(
        fd_socket, ": handing over the fd: the daemon answered with an arena grant, not OK"));
  }
  return request.token;
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
  const std::string what = absl::StrCat("the daemon did not lend an arena of ", size, " bytes");
  FdRequest request;
  request.kind = FdRequest::Kind::kAlloc;
  request.bytes = size;
  const std::string message = EncodeFdRequest(request);
  if (absl::StatusOr<FdRequest> valid = ParseFdRequest(message); !valid.ok()) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat(fd_socket, ": ", what, ": ", valid.status().message())));
  }
  if (!SendMessage(g.lease, message, -1)) {
    return fail(SendFailed(g.lease, fd_socket, "the daemon lent no arena"));
  }
  std::vector<int> fds;
  absl::StatusOr<FdReply> reply = AwaitReply(g.lease, &fds, 1, fd_socket, what);
  if (!fds.empty()) g.fd = fds[0];
  if (!reply.ok()) return fail(reply.status());
  if (reply->kind == FdReply::Kind::kError) {
    return fail(absl::Status(reply->error.code(),
                             absl::StrCat(fd_socket, ": ", what, ": ", reply->error.message())));
  }
  if (reply->kind != FdReply::Kind::kGrant || g.fd < 0 || reply->bytes < size) {
    return fail(absl::UnavailableError(absl::StrCat(
        fd_socket, ": ", what, ": the reply ",
        reply->kind != FdReply::Kind::kGrant
            ? std::string("is not a grant")
            : g.fd < 0 ? std::string("carries no fd")
                       : absl::StrCat("grants only ", reply->bytes, " bytes"))));
  }
  g.token = reply->token;
  g.size = reply->bytes;
  return g;
}

absl::StatusOr<ViewGrant> RequestViews(const std::string& fd_socket, const std::string& token,
                                       size_t count, absl::Duration timeout) {
  absl::StatusOr<int> s = Dial(fd_socket, timeout);
  if (!s.ok()) return s.status();
  ViewGrant g;
  g.lease = *s;
  auto fail = [&](absl::Status st) {
    ::close(g.lease);
    for (int f : g.fds) ::close(f);
    return st;
  };
  const std::string what = "taking the load's cache views";
  FdRequest request;
  request.kind = FdRequest::Kind::kViews;
  request.token = token;
  const std::string message = EncodeFdRequest(request);
  if (absl::StatusOr<FdRequest> valid = ParseFdRequest(message); !valid.ok()) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat(fd_socket, ": ", what, ": ", valid.status().message())));
  }
  if (!SendMessage(g.lease, message, -1)) return fail(SendFailed(g.lease, fd_socket, what));
  absl::StatusOr<FdReply> reply = AwaitReply(g.lease, &g.fds, kMaxViewFds, fd_socket, what);
  if (!reply.ok()) return fail(reply.status());
  if (reply->kind == FdReply::Kind::kError) {
    return fail(absl::Status(reply->error.code(),
                             absl::StrCat(fd_socket, ": ", what, ": ", reply->error.message())));
  }
  if (reply->kind != FdReply::Kind::kViews || reply->bytes != count || g.fds.size() != count) {
    return fail(absl::DataLossError(absl::StrCat(fd_socket, ": ", what, ": expected ", count,
                                                 " views, got '", EncodeFdReply(*reply), "' with ",
                                                 g.fds.size(), " fd(s)")));
  }
  return g;
}

}  // namespace ckptd
