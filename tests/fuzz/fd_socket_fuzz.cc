// Fuzz target: the fd socket's text protocol (proto/fd_socket.h), the one
// channel where any local user talks to the daemon without gRPC. The input
// is one message, read both ways:
//  - as a request (ParseFdRequest: what FdReceiver::Serve parses, a token,
//    "ALLOC <bytes>" or "VIEWS <token>") and as a reply (ParseFdReply: what
//    SendFd, RequestArena and RequestViews parse, "OK", "OK <token> <bytes>",
//    "OK VIEWS <count>" (1..kMaxViewFds) or "ERR ..."), each
//    against an independent model of the grammar, and re-encoded
//    (EncodeFdRequest, EncodeFdReply);
//  - ParseReply (the status a reply stands for), ErrorReply of any code and
//    message, an arena grant made from the input's bytes;
//  - IsToken and TokenPrefix (the daemon names tokens in logs);
//  - the receive path both sides use: the input sent as one message over an
//    in-process SOCK_SEQPACKET socketpair, read back with ReceiveMessage
//    into a kMaxMessage buffer, and parsed from there.
//
// Properties: a message parses exactly when the model says it is one of the
// protocol's forms (canonical decimal sizes in 1..kMaxArenaBytes, tokens of
// 32 lowercase hex digits, no NUL, under kMaxMessage); what parses
// re-encodes to the same bytes (an older daemon's "ERR <message>" to the
// current form) and parses back to the same value; a refusal is
// INVALID_ARGUMENT; ParseReply is OK exactly for a parsed OK, grant or views;
// ErrorReply fits kMaxMessage and parses back to its code; TokenPrefix
// never shows more than 8 characters; a received message is NUL-terminated
// inside the buffer, flagged truncated exactly when it did not fit, and
// parses as the bytes sent.
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "proto/fd_socket.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using ckptd::FdReply;
using ckptd::FdRequest;

int* Pair() {
  static int* fds = [] {
    static int p[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, p) != 0) std::abort();
    return p;
  }();
  return fds;
}

// --- A model of the grammar, written apart from the parsers --------------

bool LooksLikeToken(absl::string_view s) {
  if (s.size() != ckptd::kTokenLen) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// A size: 1-20 digits, no leading zero, 1..kMaxArenaBytes.
std::optional<uint64_t> ModelSize(absl::string_view s) {
  if (s.empty() || s.size() > 20 || (s.size() > 1 && s[0] == '0')) return std::nullopt;
  unsigned __int128 v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<unsigned>(c - '0');
  }
  if (v < 1 || v > ckptd::kMaxArenaBytes) return std::nullopt;
  return static_cast<uint64_t>(v);
}

bool Sendable(absl::string_view s) {
  return s.size() < ckptd::kMaxMessage && s.find('\0') == absl::string_view::npos;
}

bool ModelRequest(absl::string_view s) {
  if (!Sendable(s)) return false;
  if (LooksLikeToken(s)) return true;
  if (absl::ConsumePrefix(&s, "VIEWS ")) return LooksLikeToken(s);
  return absl::ConsumePrefix(&s, "ALLOC ") && ModelSize(s).has_value();
}

bool ModelReply(absl::string_view s) {
  if (!Sendable(s)) return false;
  if (s == "OK" || absl::StartsWith(s, "ERR ")) return true;
  if (absl::ConsumePrefix(&s, "OK VIEWS ")) {  // a count of fds: 1..kMaxViewFds
    const std::optional<uint64_t> n = ModelSize(s);
    return n.has_value() && *n <= ckptd::kMaxViewFds;
  }
  if (!absl::ConsumePrefix(&s, "OK ")) return false;
  const size_t sp = s.find(' ');
  return sp != absl::string_view::npos && LooksLikeToken(s.substr(0, sp)) &&
         ModelSize(s.substr(sp + 1)).has_value();
}

void CheckRequest(absl::string_view text) {
  const absl::StatusOr<FdRequest> r = ckptd::ParseFdRequest(text);
  ckptd_fuzz::Note("ParseFdRequest", r.status());
  FUZZ_CHECK(r.ok() == ModelRequest(text), r.status().ToString());
  if (!r.ok()) {
    FUZZ_CHECK(r.status().code() == absl::StatusCode::kInvalidArgument, r.status().ToString());
    FUZZ_CHECK(absl::StartsWith(r.status().message(), "expected "), r.status().ToString());
    return;
  }
  if (r->kind == FdRequest::Kind::kAlloc) {
    FUZZ_CHECK(r->bytes >= 1 && r->bytes <= ckptd::kMaxArenaBytes, absl::StrCat(r->bytes));
  } else {
    FUZZ_CHECK(ckptd::IsToken(r->token), r->token);
  }
  const std::string again = ckptd::EncodeFdRequest(*r);
  FUZZ_CHECK(again == text, absl::StrCat("re-encoded as '", again, "'"));
  const absl::StatusOr<FdRequest> back = ckptd::ParseFdRequest(again);
  FUZZ_CHECK(back.ok() && *back == *r, "request round trip");
}

void CheckReply(absl::string_view text) {
  const absl::StatusOr<FdReply> r = ckptd::ParseFdReply(text);
  ckptd_fuzz::Note("ParseFdReply", r.status());
  FUZZ_CHECK(r.ok() == ModelReply(text), r.status().ToString());
  const absl::Status st = ckptd::ParseReply(text, "fuzz");
  FUZZ_CHECK(st.ok() == (r.ok() && r->kind != FdReply::Kind::kError), st.ToString());
  if (!r.ok()) {
    FUZZ_CHECK(r.status().code() == absl::StatusCode::kInvalidArgument, r.status().ToString());
    FUZZ_CHECK(absl::StartsWith(r.status().message(), "malformed reply: "), r.status().ToString());
    return;
  }
  switch (r->kind) {
    case FdReply::Kind::kOk:
      FUZZ_CHECK(text == "OK", "OK");
      break;
    case FdReply::Kind::kGrant:
      FUZZ_CHECK(ckptd::IsToken(r->token) && r->bytes >= 1 && r->bytes <= ckptd::kMaxArenaBytes,
                 "grant");
      break;
    case FdReply::Kind::kViews:
      FUZZ_CHECK(r->bytes >= 1 && r->bytes <= ckptd::kMaxViewFds, "views");
      break;
    case FdReply::Kind::kError:
      FUZZ_CHECK(!r->error.ok(), "an error reply with an OK status");
      FUZZ_CHECK(st.code() == r->error.code(), st.ToString());
      break;
  }
  const std::string again = ckptd::EncodeFdReply(*r);
  FUZZ_CHECK(again.size() < ckptd::kMaxMessage, absl::StrCat(again.size()));
  const bool current = r->kind != FdReply::Kind::kError ||
                       absl::StartsWith(text, absl::StrCat("ERR ", absl::StatusCodeToString(
                                                                       r->error.code()), ": "));
  if (current) FUZZ_CHECK(again == text, absl::StrCat("re-encoded as '", again, "'"));
  // An older daemon's "ERR <message>" grows by its code's name: it parses
  // back the same unless that cut it.
  const size_t full = 4 + absl::StatusCodeToString(absl::StatusCode::kUnavailable).size() + 2 +
                      r->error.message().size();
  if (current || full < ckptd::kMaxMessage) {
    const absl::StatusOr<FdReply> back = ckptd::ParseFdReply(again);
    FUZZ_CHECK(back.ok() && *back == *r, absl::StrCat("reply round trip: '", again, "'"));
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)Pair();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text = ckptd_fuzz::Str(data, size);
  CheckRequest(text);
  CheckReply(text);

  FUZZ_CHECK(ckptd::IsToken(text) == LooksLikeToken(text), text);
  const std::string prefix = ckptd::TokenPrefix(text);
  FUZZ_CHECK(prefix.size() <= 11 && absl::EndsWith(prefix, "..."), prefix);

  if (size >= 1) {
    // Any code and message: the first byte picks the code (1..16).
    const auto code = static_cast<absl::StatusCode>(1 + data[0] % 16);
    const std::string err = ckptd::ErrorReply(absl::Status(code, text.substr(1)));
    FUZZ_CHECK(err.size() < ckptd::kMaxMessage, err);
    const absl::StatusOr<FdReply> back = ckptd::ParseFdReply(err);
    FUZZ_CHECK(back.ok() && back->kind == FdReply::Kind::kError && back->error.code() == code,
               absl::StrCat(err, " -> ", back.status().ToString()));
    FUZZ_CHECK(ckptd::ParseReply(err, "fuzz").code() == code, err);
  }
  if (size >= 24) {
    // A grant: the token from 16 bytes, the size from 8 more.
    FdReply g;
    g.kind = FdReply::Kind::kGrant;
    static const char kHex[] = "0123456789abcdef";
    for (size_t i = 0; i < 16; ++i) {
      g.token += kHex[data[i] >> 4];
      g.token += kHex[data[i] & 15];
    }
    uint64_t v = 0;
    for (size_t i = 16; i < 24; ++i) v = v << 8 | data[i];
    g.bytes = 1 + v % ckptd::kMaxArenaBytes;
    const std::string m = ckptd::EncodeFdReply(g);
    const absl::StatusOr<FdReply> back = ckptd::ParseFdReply(m);
    FUZZ_CHECK(back.ok() && *back == g, m);
    FdRequest a;
    a.kind = FdRequest::Kind::kAlloc;
    a.bytes = g.bytes;
    const absl::StatusOr<FdRequest> req = ckptd::ParseFdRequest(ckptd::EncodeFdRequest(a));
    FUZZ_CHECK(req.ok() && *req == a, ckptd::EncodeFdRequest(a));
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
    const absl::string_view got(buf, static_cast<size_t>(n));
    FUZZ_CHECK(got == absl::string_view(text).substr(0, n), "bytes");
    if (!truncated) {  // as FdReceiver::Serve, SendFd and RequestArena parse it
      FUZZ_CHECK(ckptd::ParseFdRequest(got) == ckptd::ParseFdRequest(text), "request");
      FUZZ_CHECK(ckptd::ParseFdReply(got) == ckptd::ParseFdReply(text), "reply");
    }
  }
  return 0;
}
