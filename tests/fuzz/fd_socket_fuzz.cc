// Fuzz target: the fd socket's text protocol (proto/fd_socket.h), the one
// channel where any local user talks to the daemon without gRPC:
//  - ParseReply (clients read the daemon's "OK ..." / "ERR <CODE>: ..."),
//  - IsToken and TokenPrefix (the daemon checks a request's token and names
//    it in logs),
//  - the receive path both sides use: the input sent as one message over an
//    in-process SOCK_SEQPACKET socketpair, read back with ReceiveMessage into
//    a kMaxMessage buffer, then parsed as the client parses a reply (as a
//    NUL-terminated string).
// The daemon's own request parsing ("ALLOC <bytes>" / a token) is inline in
// FdReceiver::Serve (server/fd_channel.cc) and not reachable without a
// listening socket; see tests/fuzz/README.md.
//
// Properties: ParseReply is OK exactly for "OK..."; an ErrorReply of any code
// and message parses back to that code; IsToken is exactly "32 lowercase
// hex digits"; TokenPrefix never reveals more than 8 characters; a received
// message is NUL-terminated inside the buffer and flagged truncated exactly
// when it did not fit.
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "proto/fd_socket.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

int* Pair() {
  static int* fds = [] {
    static int p[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, p) != 0) std::abort();
    return p;
  }();
  return fds;
}

bool LooksLikeToken(absl::string_view s) {
  if (s.size() != ckptd::kTokenLen) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)Pair();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text = ckptd_fuzz::Str(data, size);

  const absl::Status reply = ckptd::ParseReply(text, "fuzz");
  ckptd_fuzz::Note("ParseReply", reply);
  FUZZ_CHECK(reply.ok() == absl::StartsWith(text, "OK"), reply.ToString());

  FUZZ_CHECK(ckptd::IsToken(text) == LooksLikeToken(text), text);
  const std::string prefix = ckptd::TokenPrefix(text);
  FUZZ_CHECK(prefix.size() <= 11 && absl::EndsWith(prefix, "..."), prefix);

  // Any code and message: the first byte picks the code (1..16).
  if (size >= 1) {
    const auto code = static_cast<absl::StatusCode>(1 + data[0] % 16);
    const std::string err = ckptd::ErrorReply(absl::Status(code, text.substr(1)));
    FUZZ_CHECK(err.size() < ckptd::kMaxMessage, err);
    const absl::Status back = ckptd::ParseReply(err, "fuzz");
    FUZZ_CHECK(back.code() == code, absl::StrCat(err, " -> ", back.ToString()));
  }

  // The receive path. SOCK_SEQPACKET keeps message boundaries; an empty
  // message reads as end-of-file, so it is not sent.
  if (size >= 1 && size <= 4 * ckptd::kMaxMessage) {
    int* p = Pair();
    FUZZ_CHECK(ckptd::SendMessage(p[0], text, -1), "SendMessage");
    char buf[ckptd::kMaxMessage];
    int fd = -2;
    bool truncated = false;
    const ssize_t n = ckptd::ReceiveMessage(p[1], buf, sizeof(buf), &fd, 0, &truncated);
    FUZZ_CHECK(n >= 0 && static_cast<size_t>(n) < sizeof(buf) && buf[n] == '\0',
               absl::StrCat("received ", n));
    FUZZ_CHECK(fd == -1, "an fd from nowhere");
    FUZZ_CHECK(truncated == (size > sizeof(buf) - 1), absl::StrCat("truncated ", truncated));
    FUZZ_CHECK(absl::string_view(buf, n) == absl::string_view(text).substr(0, n), "bytes");
    (void)ckptd::ParseReply(buf, "fuzz");  // as RequestArena / SendFd read it
  }
  return 0;
}
