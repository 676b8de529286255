// The fd socket's wire protocol, shared by the daemon (server/fd_channel.h)
// and its clients (client/ckptd_client.h; the Python client speaks the same
// text in client/python/ckptd/_shm.py).
//
// The fd socket is a Unix SOCK_SEQPACKET socket beside the daemon's gRPC
// socket (FdSocketPath). A connection carries one request and one reply:
//
// Handing over a shared-memory segment (a memfd) so destinations need no name
// in /dev/shm and cannot leak (the memory is freed when both sides close it):
//   client -> daemon: a 32-character token (lowercase hex, RandomToken) with
//                     the memfd as SCM_RIGHTS
//   daemon -> client: "OK" or "ERR <reason>"
// The client then names the token in LoadRequest.shm.fd_token (or
// SaveRequest.shm.fd_token). Tokens are single-use, expire, and may only be
// used by the uid that sent the fd.
// The memfd must be sealed with at least F_SEAL_SHRINK (SealSegment), so it
// cannot shrink under the daemon's mapping (a copy into a truncated page
// would kill the daemon with SIGBUS), and must live on tmpfs (a plain memfd;
// hugetlbfs pages can fault when huge pages run out). Anything else is
// refused with "ERR INVALID_ARGUMENT: <why>".
//
// Borrowing an arena the daemon keeps mapped (server/arena_pool.h):
//   client -> daemon: "ALLOC <bytes>"
//   daemon -> client: "OK <32-character token> <bytes>" + the arena's memfd
//                     (sealed against shrinking and growing) as SCM_RIGHTS,
//                     or "ERR <reason>"
// The connection then stays open as the lease: the client names the token in
// LoadRequest.shm.arena_token for as many loads as it likes (only from its
// own uid); closing the connection (or exiting) gives the arena back.
//
// Taking the views of a load (LoadEvent.views, process_memory with views):
//   client -> daemon: "VIEWS <32-character token>"
//   daemon -> client: "OK VIEWS <count>" + count read-only memfds as
//                     SCM_RIGHTS (1..kMaxViewFds), or "ERR <reason>"
// The connection then stays open while the client copies; closing it tells
// the daemon the client is done with the views (they may change after).
// Only the uid whose load it is may take them, once.
//
// "<reason>" is "<CODE>: <message>", CODE an absl/gRPC status code name
// (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE, ...); older daemons
// sent a bare message, read as UNAVAILABLE.
//
// Both sides parse every message strictly, with the pure functions below
// (ParseFdRequest, ParseFdReply): exactly these forms, nothing before or
// after; <bytes> in canonical decimal (digits only: no sign, space or
// leading zero; at most 20 digits, no overflow) from 1 to kMaxArenaBytes;
// tokens exactly kTokenLen lowercase hex digits; no NUL byte; at most
// kMaxMessage - 1 bytes. Anything else is INVALID_ARGUMENT saying what was
// wrong (the daemon answers a request it cannot parse with that error).
//
// The daemon gives every connection a short deadline to send its request
// (kRequestTimeout) and then closes it.
#ifndef CKPTD_PROTO_FD_SOCKET_H_
#define CKPTD_PROTO_FD_SOCKET_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace ckptd {

// Tokens: 128 random bits as 32 lowercase hex characters.
inline constexpr size_t kTokenLen = 32;
// How long the daemon waits for a connection's request.
inline constexpr absl::Duration kRequestTimeout = absl::Seconds(2);
// The longest message either side sends, plus one (a message is at most
// kMaxMessage - 1 bytes: it fits a kMaxMessage buffer NUL-terminated).
inline constexpr size_t kMaxMessage = 512;
// The largest arena a client may ask for and the daemon may lend (64 TiB):
// far above any machine's memory, and page-rounded sizes stay far from
// overflowing off_t.
inline constexpr uint64_t kMaxArenaBytes = uint64_t{1} << 46;
// The most fds one "OK VIEWS" reply carries (below the kernel's 253 per
// SCM_RIGHTS message).
inline constexpr size_t kMaxViewFds = 200;

// The fd socket that goes with a daemon's gRPC socket path.
std::string FdSocketPath(const std::string& grpc_socket);

// A fresh token from getrandom(2): 128 bits, 32 lowercase hex characters.
std::string RandomToken();
// Whether `s` has a token's form (32 lowercase hex characters).
bool IsToken(absl::string_view s);
// The first characters of a token, for messages (never the whole token).
std::string TokenPrefix(absl::string_view token);

// Seals a sized memfd (made with MFD_ALLOW_SEALING) as the daemon requires:
// F_SEAL_SHRINK | F_SEAL_GROW.
absl::Status SealSegment(int fd);
// The daemon's requirement for a client's segment: a regular file on tmpfs
// (a memfd, not hugetlbfs or a file on disk) sealed with at least
// F_SEAL_SHRINK. INVALID_ARGUMENT "<what>: <why and how to fix it>" else.
// Checks the seals first, so an fd of any other kind (a FUSE file, a socket)
// is refused without asking its file system anything.
absl::Status CheckSealedSegment(int fd, const std::string& what);

// --- Client side ---------------------------------------------------------

// Sends `fd` (a sealed memfd) to the daemon listening at `fd_socket`; returns
// the token that names it. A refusal carries the daemon's code and reason.
absl::StatusOr<std::string> SendFd(const std::string& fd_socket, int fd,
                                   absl::Duration timeout = absl::Seconds(10));

// "ALLOC": the arena's memfd, its token and size (rounded up), and the lease
// socket to keep open while the arena is in use. The caller closes both fds.
struct ArenaGrant {
  int fd = -1;
  int lease = -1;
  std::string token;
  uint64_t size = 0;
};
absl::StatusOr<ArenaGrant> RequestArena(const std::string& fd_socket, uint64_t size,
                                        absl::Duration timeout = absl::Seconds(10));

// "VIEWS <token>": a load's cache views (LoadEvent.views), `count` read-only
// memfds in the order of CacheViews.view_bytes, and the connection to close
// once the copies are made (the daemon waits for that). The caller closes
// every fd.
struct ViewGrant {
  int lease = -1;
  std::vector<int> fds;
};
absl::StatusOr<ViewGrant> RequestViews(const std::string& fd_socket, const std::string& token,
                                       size_t count, absl::Duration timeout = absl::Seconds(10));

// --- Messages as values (pure; both directions) --------------------------

// A request, client -> daemon.
struct FdRequest {
  enum class Kind {
    kHandOver,  // "<token>", with the fd it names as SCM_RIGHTS
    kAlloc,     // "ALLOC <bytes>", no fd
    kViews,     // "VIEWS <token>", no fd
  };
  Kind kind = Kind::kHandOver;
  std::string token;   // kHandOver, kViews
  uint64_t bytes = 0;  // kAlloc: 1..kMaxArenaBytes

  bool operator==(const FdRequest& o) const {
    return kind == o.kind && token == o.token && bytes == o.bytes;
  }
};
// The request `message` (the bytes of one message, no terminator) stands
// for. INVALID_ARGUMENT "expected a 32-character lowercase hex token and one
// fd, or ALLOC <bytes>: <what is wrong>" (or "expected ALLOC <bytes>: ..."
// for a malformed ALLOC) otherwise. Whether an fd came with it is the
// caller's to check.
absl::StatusOr<FdRequest> ParseFdRequest(absl::string_view message);
// The message for a request ParseFdRequest accepts.
std::string EncodeFdRequest(const FdRequest& request);

// A reply, daemon -> client.
struct FdReply {
  enum class Kind {
    kOk,     // "OK": the fd was taken
    kGrant,  // "OK <token> <bytes>", with the arena's memfd as SCM_RIGHTS
    kViews,  // "OK VIEWS <count>", with count memfds as SCM_RIGHTS
    kError,  // "ERR <CODE>: <message>" (or an older daemon's "ERR <message>")
  };
  Kind kind = Kind::kOk;
  std::string token;   // kGrant
  uint64_t bytes = 0;  // kGrant: 1..kMaxArenaBytes; kViews: the count, 1..kMaxViewFds
  // kError: never OK; UNAVAILABLE for an older daemon's bare message.
  absl::Status error;

  bool operator==(const FdReply& o) const {
    return kind == o.kind && token == o.token && bytes == o.bytes && error == o.error;
  }
};
// The reply `message` stands for; INVALID_ARGUMENT "malformed reply: <what
// is wrong>" otherwise.
absl::StatusOr<FdReply> ParseFdReply(absl::string_view message);
// The message for `reply`; an error's message is cut to fit kMaxMessage
// and its NUL bytes replaced, so the daemon can send any status.
std::string EncodeFdReply(const FdReply& reply);

// --- Messages (both sides) -----------------------------------------------

// A connected SOCK_SEQPACKET socket to `path` with send/receive timeouts.
absl::StatusOr<int> Dial(const std::string& path, absl::Duration timeout);
// Sends one message, with `fd` as SCM_RIGHTS when it is >= 0. `flags` are
// sendmsg's (MSG_NOSIGNAL is always added). True if all of it was sent.
bool SendMessage(int sock, absl::string_view text, int fd, int flags = 0);
// The same with any number of fds (at most kMaxViewFds) as one SCM_RIGHTS.
bool SendMessageFds(int sock, absl::string_view text, const int* fds, size_t n, int flags = 0);
// Receives one message into buf (NUL-terminated, at most cap - 1 bytes) and
// the fd it carries, if any (*fd = -1 otherwise; any further fds are closed).
// *truncated is set when the message or its control data did not fit.
// Returns recvmsg's result.
ssize_t ReceiveMessage(int sock, char* buf, size_t cap, int* fd, int flags = 0,
                       bool* truncated = nullptr);
// The same keeping up to kMaxViewFds fds (in *fds, in order).
ssize_t ReceiveMessageFds(int sock, char* buf, size_t cap, std::vector<int>* fds, int flags = 0,
                          bool* truncated = nullptr);

// "ERR <CODE>: <message>" for a refusal (EncodeFdReply of an error; an OK
// status reads as UNKNOWN).
std::string ErrorReply(const absl::Status& status);
// The status a reply stands for (ParseFdReply), prefixed with `context`: OK
// for "OK" and "OK <token> <bytes>"; the code and message of an "ERR ..."; a
// malformed or empty reply is UNAVAILABLE saying so.
absl::Status ParseReply(absl::string_view reply, absl::string_view context);

}  // namespace ckptd

#endif  // CKPTD_PROTO_FD_SOCKET_H_
