// The fd socket against a real FdReceiver + ArenaPool on a temporary socket:
// the seal requirement, uid-bound tokens, tokens themselves, sealed arenas,
// and serving many connections without one client holding up the others.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/synchronization/notification.h"
#include "absl/strings/str_cat.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/fd_socket.h"
#include "server/delivery/arena_pool.h"
#include "server/delivery/fd_channel.h"
#include "server/delivery/view_leases.h"
#include "tests/testing/temp_dir.h"

namespace ckptd {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// A memfd of `size` bytes; sealed as the clients do unless told otherwise.
int MakeMemfd(uint64_t size, bool allow_sealing = true, int seals = F_SEAL_SHRINK | F_SEAL_GROW) {
  const int fd = ::memfd_create("fd-socket-test", MFD_CLOEXEC | (allow_sealing ? MFD_ALLOW_SEALING : 0));
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(size)), 0);
  if (allow_sealing && seals != 0) {
    EXPECT_EQ(::fcntl(fd, F_ADD_SEALS, seals), 0);
  }
  return fd;
}

// A connection that has sent nothing.
int Idle(const std::string& path) {
  auto s = Dial(path, absl::Seconds(5));
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : -1;
}

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

class FdSocketTest : public ::testing::Test {
 protected:
  void StartReceiver(const FdReceiverLimits& limits = FdReceiverLimits()) {
    // Unix socket paths must stay under 108 bytes: not under TEST_TMPDIR.
    if (sock_dir_.empty()) {
      char tmpl[] = "/tmp/ckptd-fd-XXXXXX";
      ASSERT_NE(::mkdtemp(tmpl), nullptr);
      sock_dir_ = tmpl;
    }
    path_ = sock_dir_ + "/ckptd.sock.fd";
    auto r = FdReceiver::Start(path_, 0600, absl::Minutes(1), &pool_, limits, &views_);
    ASSERT_TRUE(r.ok()) << r.status();
    receiver_ = std::move(*r);
  }
  void SetUp() override { StartReceiver(); }
  void TearDown() override {
    receiver_.reset();  // removes the socket
    ::rmdir(sock_dir_.c_str());
  }

  ckpt::testing::TempDir tmp_;
  ArenaPool pool_{64ull << 20, 256ull << 20};
  ViewLeases views_;
  std::string sock_dir_;
  std::string path_;
  std::unique_ptr<FdReceiver> receiver_;
};

TEST(Tokens, Are128RandomBitsAsLowercaseHex) {
  std::set<std::string> seen;
  for (int i = 0; i < 2000; ++i) {
    const std::string t = RandomToken();
    ASSERT_EQ(t.size(), 32u);
    for (char c : t) ASSERT_TRUE((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')) << t;
    EXPECT_TRUE(IsToken(t));
    seen.insert(t);
  }
  EXPECT_EQ(seen.size(), 2000u);
  // Every hex digit shows up in every position across 2000 tokens (a fixed
  // or narrow generator would not).
  for (size_t pos = 0; pos < 32; ++pos) {
    std::set<char> digits;
    for (const std::string& t : seen) digits.insert(t[pos]);
    EXPECT_EQ(digits.size(), 16u) << "position " << pos;
  }
  EXPECT_FALSE(IsToken(std::string(31, 'a')));
  EXPECT_FALSE(IsToken(std::string(32, 'A')));
  EXPECT_FALSE(IsToken(std::string(31, 'a') + "g"));
  EXPECT_EQ(TokenPrefix("0123456789abcdef0123456789abcdef"), "01234567...");
}

TEST(CheckSealedSegment, AcceptsOnlySealedWritableTmpfsMemfds) {
  const int good = MakeMemfd(4096);
  EXPECT_TRUE(CheckSealedSegment(good, "seg").ok());

  const int unsealed = MakeMemfd(4096, true, 0);
  absl::Status st = CheckSealedSegment(unsealed, "seg");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("not sealed with F_SEAL_SHRINK"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("MFD_ALLOW_SEALING"));

  const int no_sealing = MakeMemfd(4096, false);  // its seals: F_SEAL_SEAL only
  st = CheckSealedSegment(no_sealing, "seg");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("not sealed with F_SEAL_SHRINK"));

  const int write_sealed = MakeMemfd(4096, true, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE);
  st = CheckSealedSegment(write_sealed, "seg");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("sealed against writes"));

  const int read_only =
      ::open(("/proc/self/fd/" + std::to_string(good)).c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(read_only, 0);
  st = CheckSealedSegment(read_only, "seg");
  EXPECT_THAT(std::string(st.message()), HasSubstr("not open read-write"));

  ckpt::testing::TempDir tmp;
  const std::string file = tmp.Sub("plain");
  std::ofstream(file) << std::string(4096, 'x');
  const int disk = ::open(file.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(disk, 0);
  st = CheckSealedSegment(disk, "seg");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("seg is not a memfd"));

  int pipe_fds[2];
  ASSERT_EQ(::pipe2(pipe_fds, O_CLOEXEC), 0);
  st = CheckSealedSegment(pipe_fds[1], "seg");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);

  // A hugetlbfs memfd, where the kernel offers them.
  const int huge = ::memfd_create("fd-socket-test-huge", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB);
  if (huge >= 0) {
    ::fcntl(huge, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW);
    st = CheckSealedSegment(huge, "seg");
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(st.message()), HasSubstr("hugetlbfs"));
    ::close(huge);
  }
  for (int fd : {good, unsealed, no_sealing, write_sealed, read_only, disk, pipe_fds[0], pipe_fds[1]}) {
    ::close(fd);
  }
}

TEST(Replies, CarryTheirCode) {
  EXPECT_TRUE(ParseReply("OK", "x").ok());
  absl::Status st = ParseReply(ErrorReply(absl::PermissionDeniedError("no")), "ctx");
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(st.message(), "ctx: no");
  st = ParseReply("ERR too many pending fds", "ctx");  // an older daemon's reply
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(st.message(), "ctx: too many pending fds");
  EXPECT_LT(ErrorReply(absl::InternalError(std::string(5000, 'x'))).size(), kMaxMessage);
}

constexpr char kTok[] = "0123456789abcdef0123456789abcdef";

// Every message is parsed strictly: the protocol's forms and nothing else.
TEST(FdMessages, RequestsAreParsedStrictly) {
  auto req = ParseFdRequest(kTok);
  ASSERT_TRUE(req.ok()) << req.status();
  EXPECT_EQ(req->kind, FdRequest::Kind::kHandOver);
  EXPECT_EQ(req->token, kTok);
  EXPECT_EQ(EncodeFdRequest(*req), kTok);
  for (const auto& [text, bytes] : std::vector<std::pair<std::string, uint64_t>>{
           {"ALLOC 1", 1}, {"ALLOC 4096", 4096}, {"ALLOC 70368744177664", kMaxArenaBytes}}) {
    req = ParseFdRequest(text);
    ASSERT_TRUE(req.ok()) << text << ": " << req.status();
    EXPECT_EQ(req->kind, FdRequest::Kind::kAlloc);
    EXPECT_EQ(req->bytes, bytes);
    EXPECT_EQ(EncodeFdRequest(*req), text);
  }
  struct Bad {
    std::string text;
    const char* why;
  };
  for (const Bad& b : std::vector<Bad>{
           {"ALLOC -5", "'-5' is not a decimal number of bytes (digits only: no sign"},
           {"ALLOC +5", "'+5' is not a decimal number"},
           {"ALLOC  5", "' 5' is not a decimal number"},
           {"ALLOC 5x", "'5x' is not a decimal number"},
           {"ALLOC 5 ", "'5 ' is not a decimal number"},
           {"ALLOC 0x10", "is not a decimal number"},
           {"ALLOC 18446744073709551616", "'18446744073709551616' does not fit in 64 bits"},
           {"ALLOC 18446744073709551615", "over the limit of 70368744177664"},
           {"ALLOC 70368744177665", "over the limit of 70368744177664"},
           {"ALLOC 123456789012345678901", "(21 characters) is longer than any number of bytes"},
           {"ALLOC 007", "'007' has a leading zero"},
           {"ALLOC 0", "0 bytes (at least 1)"},
           {"ALLOC ", "no number of bytes"},
           {"ALLOC", "expected ALLOC <bytes> (one space"},
           {"ALLOC\t5", "expected ALLOC <bytes> (one space"},
           {"alloc 5", "expected a 32-character lowercase hex token and one fd, or ALLOC <bytes>"},
           {"", "expected a 32-character"},
           {" " + std::string(kTok), "got ' 0123456789abcdef0123456'..."},
           {std::string(kTok) + "\n", "expected a 32-character"},
           {std::string(kTok).substr(0, 31), "expected a 32-character"},
           {"0123456789ABCDEF0123456789ABCDEF", "expected a 32-character"},
           {std::string(kTok, 16) + std::string(1, '\0') + std::string(kTok, 15), "has a NUL byte"},
           {std::string(600, 'a'), "600 bytes, over the limit of 511"},
       }) {
    req = ParseFdRequest(b.text);
    EXPECT_EQ(req.status().code(), absl::StatusCode::kInvalidArgument) << absl::CHexEscape(b.text);
    EXPECT_THAT(std::string(req.status().message()), HasSubstr(b.why)) << absl::CHexEscape(b.text);
  }
  // Client input quoted in a refusal is escaped and short.
  req = ParseFdRequest("ALLOC \x01" + std::string(100, '9'));
  EXPECT_THAT(std::string(req.status().message()), HasSubstr("'\\001999"));
  EXPECT_LT(req.status().message().size(), 120u);
}

TEST(FdMessages, ViewsMessagesAreParsedStrictly) {
  const std::string views = absl::StrCat("VIEWS ", kTok);
  auto req = ParseFdRequest(views);
  ASSERT_TRUE(req.ok()) << req.status();
  EXPECT_EQ(req->kind, FdRequest::Kind::kViews);
  EXPECT_EQ(req->token, kTok);
  EXPECT_EQ(EncodeFdRequest(*req), views);
  for (const std::string& bad : {std::string("VIEWS "), std::string("VIEWS x"), views + " ",
                                 absl::StrCat("VIEWS  ", kTok), absl::StrCat("VIEWS\t", kTok),
                                 absl::StrCat("VIEWS ", std::string(kTok).substr(0, 31))}) {
    req = ParseFdRequest(bad);
    EXPECT_EQ(req.status().code(), absl::StatusCode::kInvalidArgument) << absl::CHexEscape(bad);
  }
  auto reply = ParseFdReply("OK VIEWS 3");
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->kind, FdReply::Kind::kViews);
  EXPECT_EQ(reply->bytes, 3u);
  EXPECT_EQ(EncodeFdReply(*reply), "OK VIEWS 3");
  EXPECT_TRUE(ParseFdReply("OK VIEWS 200").ok());
  for (const char* bad : {"OK VIEWS 0", "OK VIEWS 201", "OK VIEWS 03", "OK VIEWS", "OK VIEWS ",
                          "OK VIEWS -1", "OK VIEWS 3 "}) {
    EXPECT_FALSE(ParseFdReply(bad).ok()) << bad;
  }
}

TEST(FdMessages, RepliesAreParsedStrictly) {
  auto reply = ParseFdReply("OK");
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->kind, FdReply::Kind::kOk);
  EXPECT_EQ(EncodeFdReply(*reply), "OK");
  const std::string grant = absl::StrCat("OK ", kTok, " 2097152");
  reply = ParseFdReply(grant);
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->kind, FdReply::Kind::kGrant);
  EXPECT_EQ(reply->token, kTok);
  EXPECT_EQ(reply->bytes, 2097152u);
  EXPECT_EQ(EncodeFdReply(*reply), grant);
  reply = ParseFdReply("ERR RESOURCE_EXHAUSTED: too many: really");
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->kind, FdReply::Kind::kError);
  EXPECT_EQ(reply->error, absl::ResourceExhaustedError("too many: really"));
  reply = ParseFdReply("ERR too many pending fds");  // an older daemon's
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->error, absl::UnavailableError("too many pending fds"));
  EXPECT_EQ(EncodeFdReply(*reply), "ERR UNAVAILABLE: too many pending fds");

  const std::string ok_tok = absl::StrCat("OK ", kTok, " ");
  for (const auto& [text, why] : std::vector<std::pair<std::string, std::string>>{
           {ok_tok + "-5", "'-5' is not a decimal number"},
           {ok_tok + "+5", "'+5' is not a decimal number"},
           {ok_tok + " 5", "' 5' is not a decimal number"},
           {ok_tok + "5x", "'5x' is not a decimal number"},
           {ok_tok + "18446744073709551616", "does not fit in 64 bits"},
           {ok_tok + "99999999999999999999999", "longer than any number of bytes"},
           {ok_tok, "arena size: no number of bytes"},
           {ok_tok + "0", "0 bytes"},
           {absl::StrCat("OK ", kTok), "expected OK <32-character lowercase hex token> <bytes>"},
           {absl::StrCat("OK  ", kTok, " 5"), "expected OK <32-character"},
           {"OK 0123456789ABCDEF0123456789ABCDEF 5", "expected OK <32-character"},
           {"", "expected OK, OK <token> <bytes> or ERR <reason>"},
           {"OKAY", "expected OK, OK <token> <bytes> or ERR <reason>, got 'OKAY'"},
           {"OK\n", "expected OK, OK"},
           {" OK", "expected OK, OK"},
           {"ERR", "expected OK, OK"},
           {std::string("OK\0", 3), "has a NUL byte"},
           {"ERR " + std::string(600, 'x'), "604 bytes, over the limit of 511"},
       }) {
    reply = ParseFdReply(text);
    EXPECT_EQ(reply.status().code(), absl::StatusCode::kInvalidArgument) << absl::CHexEscape(text);
    EXPECT_THAT(std::string(reply.status().message()), HasSubstr("malformed reply: "));
    EXPECT_THAT(std::string(reply.status().message()), HasSubstr(why)) << absl::CHexEscape(text);
  }
  // Any status fits one message and keeps its code; NUL bytes are replaced.
  const std::string err = ErrorReply(absl::DataLossError(std::string("a\0b", 3) + std::string(900, 'z')));
  EXPECT_EQ(err.size(), kMaxMessage - 1);
  reply = ParseFdReply(err);
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->error.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(reply->error.message()), ::testing::StartsWith("a?bzzz"));
}

// A daemon (here a fake one) whose grant is malformed: RequestArena refuses
// it instead of reading "-5" as 2^64 - 5 bytes.
TEST(FdMessages, TheClientRefusesMalformedGrants) {
  char tmpl[] = "/tmp/ckptd-fd-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string path = std::string(tmpl) + "/fake.sock.fd";
  const int listener = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  ASSERT_GE(listener, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(listener, 4), 0);
  // Answers one connection with `reply` (and a memfd), then waits for it to close.
  auto answer = [&](const std::string& reply) {
    return std::thread([listener, reply] {
      const int c = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) return;
      char buf[kMaxMessage];
      int fd = -1;
      (void)ReceiveMessage(c, buf, sizeof(buf), &fd);
      const int memfd = MakeMemfd(1 << 20);
      SendMessage(c, reply, memfd);
      ::close(memfd);
      (void)ReceiveMessage(c, buf, sizeof(buf), &fd);  // until the client closes
      ::close(c);
    });
  };
  const std::string ok_tok = absl::StrCat("OK ", kTok, " ");
  for (const auto& [reply, code, why] : std::vector<std::tuple<std::string, absl::StatusCode, std::string>>{
           {ok_tok + "-5", absl::StatusCode::kUnavailable, "malformed reply: arena size: '-5'"},
           {ok_tok + "18446744073709551615", absl::StatusCode::kUnavailable, "over the limit"},
           {ok_tok + "1048576x", absl::StatusCode::kUnavailable, "is not a decimal number"},
           {"OK", absl::StatusCode::kUnavailable, "the reply is not a grant"},
           {ok_tok + "2048", absl::StatusCode::kUnavailable, "the reply grants only 2048 bytes"},
           {"ERR RESOURCE_EXHAUSTED: full", absl::StatusCode::kResourceExhausted, "bytes: full"},
       }) {
    std::thread daemon = answer(reply);
    auto g = RequestArena(path, 4096, absl::Seconds(5));
    daemon.join();
    ASSERT_FALSE(g.ok()) << reply;
    EXPECT_EQ(g.status().code(), code) << g.status();
    EXPECT_THAT(std::string(g.status().message()),
                HasSubstr("the daemon did not lend an arena of 4096 bytes"));
    EXPECT_THAT(std::string(g.status().message()), HasSubstr(why)) << g.status();
  }
  std::thread daemon = answer(ok_tok + "1048576");
  auto g = RequestArena(path, 4096, absl::Seconds(5));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->size, 1048576u);
  EXPECT_EQ(g->token, kTok);
  ::close(g->fd);
  ::close(g->lease);
  daemon.join();
  // Sizes the protocol cannot carry are refused before anything is sent.
  EXPECT_EQ(RequestArena(path, kMaxArenaBytes + 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RequestArena(path, 0).status().code(), absl::StatusCode::kInvalidArgument);
  ::close(listener);
  ::unlink(path.c_str());
  ::rmdir(tmpl);
}

TEST_F(FdSocketTest, UnsealedMemfdIsRefusedWithTheReason) {
  const int fd = MakeMemfd(1 << 20, true, 0);
  auto token = SendFd(path_, fd);
  ASSERT_FALSE(token.ok());
  EXPECT_EQ(token.status().code(), absl::StatusCode::kInvalidArgument) << token.status();
  EXPECT_THAT(std::string(token.status().message()), HasSubstr("not sealed with F_SEAL_SHRINK"));
  EXPECT_THAT(std::string(token.status().message()),
              HasSubstr("add F_SEAL_SHRINK|F_SEAL_GROW"));
  EXPECT_EQ(receiver_->pending(), 0u);

  // A file on disk is no memfd at all.
  const std::string file = tmp_.Sub("on-disk");
  std::ofstream(file) << std::string(4096, 'x');
  const int disk = ::open(file.c_str(), O_RDWR | O_CLOEXEC);
  token = SendFd(path_, disk);
  EXPECT_EQ(token.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(token.status().message()), HasSubstr("not a memfd"));
  EXPECT_EQ(receiver_->pending(), 0u);
  ::close(fd);
  ::close(disk);
}

TEST_F(FdSocketTest, SealedMemfdIsAcceptedAndTakenOnceByItsOwner) {
  const int fd = MakeMemfd(1 << 20);
  auto token = SendFd(path_, fd);
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_TRUE(IsToken(*token));
  EXPECT_EQ(receiver_->pending(), 1u);
  auto taken = receiver_->Take(*token, ::geteuid());
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(CheckSealedSegment(*taken, "taken"), absl::OkStatus());
  ::close(*taken);
  auto again = receiver_->Take(*token, ::geteuid());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(again.status().message()), HasSubstr("unknown or expired"));
  ::close(fd);
}

TEST_F(FdSocketTest, AnotherUidCannotTakeAToken) {
  const int fd = MakeMemfd(4096);
  auto token = SendFd(path_, fd);
  ASSERT_TRUE(token.ok()) << token.status();
  auto stolen = receiver_->Take(*token, ::geteuid() + 1);
  ASSERT_EQ(stolen.status().code(), absl::StatusCode::kPermissionDenied) << stolen.status();
  const std::string msg(stolen.status().message());
  EXPECT_THAT(msg, HasSubstr("belongs to another user"));
  EXPECT_THAT(msg, HasSubstr(token->substr(0, 8)));
  EXPECT_THAT(msg, Not(HasSubstr(*token)));  // never the whole token
  // Still held for its owner.
  EXPECT_EQ(receiver_->pending(), 1u);
  auto taken = receiver_->Take(*token, ::geteuid());
  ASSERT_TRUE(taken.ok()) << taken.status();
  ::close(*taken);
  ::close(fd);
}

TEST_F(FdSocketTest, BadRequestsAreRefused) {
  auto send_raw = [&](const std::string& text, int fd) {
    const int s = Idle(path_);
    EXPECT_TRUE(SendMessage(s, text, fd));
    char reply[kMaxMessage];
    int got = -1;
    EXPECT_GT(ReceiveMessage(s, reply, sizeof(reply), &got), 0);
    ::close(s);
    return std::string(reply);
  };
  const int fd = MakeMemfd(4096);
  EXPECT_THAT(send_raw(std::string(32, 'Z'), fd), HasSubstr("ERR INVALID_ARGUMENT: expected a 32-character"));
  EXPECT_THAT(send_raw(RandomToken(), -1), HasSubstr("ERR INVALID_ARGUMENT"));
  EXPECT_THAT(send_raw("ALLOC abc", -1), HasSubstr("ERR INVALID_ARGUMENT: expected ALLOC <bytes>"));
  EXPECT_THAT(send_raw("ALLOC 0", -1), HasSubstr("ERR INVALID_ARGUMENT"));
  for (const char* bad : {"ALLOC -5", "ALLOC +5", "ALLOC  5", "ALLOC 5x", "ALLOC 18446744073709551616"}) {
    EXPECT_THAT(send_raw(bad, -1),
                HasSubstr("ERR INVALID_ARGUMENT: expected ALLOC <bytes>: '"))
        << bad;
  }
  EXPECT_THAT(send_raw("ALLOC 4096", fd), HasSubstr("ERR INVALID_ARGUMENT: expected ALLOC <bytes> without an fd"));
  EXPECT_THAT(send_raw(std::string(kMaxMessage + 10, 'a'), -1),
              HasSubstr("ERR INVALID_ARGUMENT: expected a 32-character lowercase hex token and one "
                        "fd, or ALLOC <bytes>: the message was longer than 511 bytes"));
  const std::string token = RandomToken();
  EXPECT_EQ(send_raw(token, fd), "OK");
  EXPECT_THAT(send_raw(token, fd), HasSubstr("duplicate token"));
  EXPECT_EQ(receiver_->pending(), 1u);
  ::close(fd);
}

TEST_F(FdSocketTest, LentArenaIsSealedAndUidBound) {
  auto g = RequestArena(path_, 5000);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->size, ArenaPool::kGranule);
  EXPECT_TRUE(IsToken(g->token));
  const int seals = ::fcntl(g->fd, F_GET_SEALS);
  EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
            F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  EXPECT_EQ(seals & F_SEAL_WRITE, 0);  // the client writes into it
  EXPECT_NE(::ftruncate(g->fd, 0), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(::ftruncate(g->fd, static_cast<off_t>(g->size * 2)), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(::fcntl(g->fd, F_ADD_SEALS, F_SEAL_WRITE), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(CheckSealedSegment(g->fd, "arena"), absl::OkStatus());

  auto mine = pool_.Find(g->token, ::geteuid());
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_EQ((*mine)->size(), g->size);
  mine->reset();
  auto theirs = pool_.Find(g->token, ::geteuid() + 1);
  EXPECT_EQ(theirs.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(theirs.status().message()), HasSubstr("belongs to another user"));
  EXPECT_THAT(std::string(theirs.status().message()), Not(HasSubstr(g->token)));
  EXPECT_EQ(pool_.Find(RandomToken(), ::geteuid()).status().code(), absl::StatusCode::kNotFound);

  // An arena another uid borrowed is not this uid's either.
  auto other = pool_.Allocate(4096, ::geteuid() + 1);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(pool_.Find(other->token, ::geteuid()).status().code(),
            absl::StatusCode::kPermissionDenied);
  ::close(other->fd);
  pool_.Release(other->token);

  // Closing the lease gives the arena back.
  EXPECT_EQ(pool_.leased_bytes(), g->size);
  ::close(g->fd);
  ::close(g->lease);
  for (int i = 0; i < 300 && pool_.leased_bytes() != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(pool_.leased_bytes(), 0u);
  EXPECT_EQ(pool_.free_bytes(), 2 * ArenaPool::kGranule);  // with the other uid's
}

TEST_F(FdSocketTest, IdleConnectionsDoNotHoldUpOtherClients) {
  std::vector<int> idle;
  for (int i = 0; i < 200; ++i) idle.push_back(Idle(path_));
  for (int i = 0; i < 100 && receiver_->waiting() < 200; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(receiver_->waiting(), 200u);

  // The old receiver served one connection at a time with a 2 s receive:
  // behind 200 idle connections these took minutes, far past their deadlines
  // (a bound a loaded machine still meets, not a speed assert).
  const int fd = MakeMemfd(1 << 20);
  auto token = SendFd(path_, fd, absl::Seconds(20));
  ASSERT_TRUE(token.ok()) << token.status();
  auto g = RequestArena(path_, 1 << 20, absl::Seconds(20));
  ASSERT_TRUE(g.ok()) << g.status();
  auto taken = receiver_->Take(*token, ::geteuid());
  ASSERT_TRUE(taken.ok()) << taken.status();
  ::close(*taken);
  ::close(g->fd);
  ::close(g->lease);
  ::close(fd);
  for (int s : idle) ::close(s);
}

// An arena handler whose grants take as long as the test wants (as faulting
// in many GiB takes its time): each waits until `release` is notified.
class SlowArenas final : public ArenaHandler {
 public:
  absl::StatusOr<ArenaLease> Allocate(uint64_t size, uid_t uid) override {
    entered.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(60));
    return pool_.Allocate(size, uid);
  }
  void Release(const std::string& token) override { pool_.Release(token); }
  absl::Notification entered, release;

 private:
  ArenaPool pool_{16ull << 20, 64ull << 20};
};

// While one client's arena grant is held up, another client's fd is taken:
// the grant does not hold the receiver. No timing: the held grant is let go
// only after the other client was served, so a receiver that served one
// client at a time would make SendFd miss its deadline.
TEST_F(FdSocketTest, ASlowArenaGrantDoesNotHoldUpOtherClients) {
  receiver_.reset();
  SlowArenas slow;
  auto r = FdReceiver::Start(path_, 0600, absl::Minutes(1), &slow);
  ASSERT_TRUE(r.ok()) << r.status();
  std::thread alloc([&] {
    auto g = RequestArena(path_, 4096, absl::Seconds(90));
    EXPECT_TRUE(g.ok()) << g.status();
    if (!g.ok()) return;
    ::close(g->fd);
    ::close(g->lease);
  });
  const bool granting = slow.entered.WaitForNotificationWithTimeout(absl::Seconds(30));
  EXPECT_TRUE(granting) << "the arena grant never started";
  const int fd = MakeMemfd(4096);
  auto token = SendFd(path_, fd, absl::Seconds(20));
  EXPECT_TRUE(token.ok()) << token.status();
  EXPECT_FALSE(slow.release.HasBeenNotified());  // the grant was still held up
  slow.release.Notify();
  alloc.join();
  ::close(fd);
  (*r)->Stop();
}

TEST_F(FdSocketTest, ConnectionsWithoutARequestAreClosedAtTheirDeadline) {
  receiver_.reset();
  FdReceiverLimits limits;
  limits.request_timeout = absl::Milliseconds(300);
  StartReceiver(limits);
  const int s = Idle(path_);
  const auto t0 = std::chrono::steady_clock::now();
  char reply[kMaxMessage];
  int fd = -1;
  timeval tv{5, 0};
  ::setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ASSERT_GT(ReceiveMessage(s, reply, sizeof(reply), &fd), 0);
  const double waited = SecondsSince(t0);
  EXPECT_THAT(std::string(reply), HasSubstr("ERR DEADLINE_EXCEEDED: no request within"));
  EXPECT_GT(waited, 0.2);
  EXPECT_LT(waited, 2.0);
  EXPECT_EQ(ReceiveMessage(s, reply, sizeof(reply), &fd), 0);  // closed
  EXPECT_EQ(receiver_->waiting(), 0u);
  ::close(s);
}

TEST_F(FdSocketTest, WaitingConnectionsAreCappedPerUidWithAClearRefusal) {
  receiver_.reset();
  FdReceiverLimits limits;
  limits.max_waiting_per_uid = 10;
  StartReceiver(limits);
  std::vector<int> idle;
  for (int i = 0; i < 10; ++i) idle.push_back(Idle(path_));
  for (int i = 0; i < 100 && receiver_->waiting() < 10; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(receiver_->waiting(), 10u);
  const int fd = MakeMemfd(4096);
  auto token = SendFd(path_, fd);
  ASSERT_FALSE(token.ok());
  EXPECT_EQ(token.status().code(), absl::StatusCode::kResourceExhausted) << token.status();
  EXPECT_THAT(std::string(token.status().message()), HasSubstr("too many connections waiting"));
  auto g = RequestArena(path_, 4096);
  ASSERT_FALSE(g.ok());
  EXPECT_THAT(std::string(g.status().message()), HasSubstr("too many connections waiting"));
  // Once they are gone, clients are served again.
  for (int s : idle) ::close(s);
  for (int i = 0; i < 100 && receiver_->waiting() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  token = SendFd(path_, fd);
  EXPECT_TRUE(token.ok()) << token.status();
  ::close(fd);
}

TEST_F(FdSocketTest, HeldFdsAreCappedPerUid) {
  receiver_.reset();
  FdReceiverLimits limits;
  limits.max_held_per_uid = 3;
  StartReceiver(limits);
  const int fd = MakeMemfd(4096);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(SendFd(path_, fd).ok());
  auto fourth = SendFd(path_, fd);
  EXPECT_EQ(fourth.status().code(), absl::StatusCode::kResourceExhausted) << fourth.status();
  EXPECT_THAT(std::string(fourth.status().message()), HasSubstr("limit per uid is 3"));
  EXPECT_EQ(receiver_->pending(), 3u);
  ::close(fd);
}

TEST_F(FdSocketTest, ManyClientsAtOnce) {
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < 16; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 20; ++i) {
        const int fd = MakeMemfd(4096);
        auto token = SendFd(path_, fd);
        if (token.ok()) {
          auto taken = receiver_->Take(*token, ::geteuid());
          if (taken.ok()) {
            ::close(*taken);
            ++ok;
          }
        }
        ::close(fd);
        auto g = RequestArena(path_, 4096);
        if (g.ok()) {
          ::close(g->fd);
          ::close(g->lease);
          ++ok;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 16 * 20 * 2);
  EXPECT_EQ(receiver_->pending(), 0u);
}

}  // namespace
}  // namespace ckptd

namespace ckptd {
namespace {

// A read-only descriptor of a sealed memfd holding `fill`, as the cache's.
int ReadOnlyView(uint64_t size, uint8_t fill) {
  const int rw = MakeMemfd(size);
  std::vector<uint8_t> bytes(size, fill);
  EXPECT_EQ(::pwrite(rw, bytes.data(), size, 0), static_cast<ssize_t>(size));
  const int ro = ::open(absl::StrCat("/proc/self/fd/", rw).c_str(), O_RDONLY | O_CLOEXEC);
  EXPECT_GE(ro, 0);
  ::close(rw);
  return ro;
}

TEST_F(FdSocketTest, CacheViewsGoToTheirUidOnceAndTheConnectionIsTheHold) {
  const int a = ReadOnlyView(4096, 1), b = ReadOnlyView(8192, 2);
  // Another uid's load: refused, and the offer stands for its owner.
  const std::string theirs = views_.Offer(::geteuid() + 1, {a}, "job 'x' rank 0");
  auto stolen = RequestViews(path_, theirs, 1);
  EXPECT_EQ(stolen.status().code(), absl::StatusCode::kPermissionDenied) << stolen.status();
  EXPECT_THAT(std::string(stolen.status().message()), HasSubstr("belong to another uid"));
  EXPECT_THAT(std::string(stolen.status().message()), Not(HasSubstr(theirs)));
  views_.Withdraw(theirs);

  const std::string mine = views_.Offer(::geteuid(), {a, b}, "job 'y' rank 1");
  // Not taken yet: the load's wait names that.
  absl::Status s = views_.AwaitDone(mine, absl::Now() + absl::Milliseconds(50), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(s.message()), HasSubstr("job 'y' rank 1: the client did not take"));
  auto got = RequestViews(path_, mine, 2);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->fds.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(::fcntl(got->fds[i], F_GETFL) & O_ACCMODE, O_RDONLY);
    struct stat mine_st, sent_st;
    ASSERT_EQ(::fstat(got->fds[i], &mine_st), 0);
    ASSERT_EQ(::fstat(i == 0 ? a : b, &sent_st), 0);
    EXPECT_EQ(mine_st.st_ino, sent_st.st_ino);  // in the order offered
  }
  uint8_t byte = 0;
  ASSERT_EQ(::pread(got->fds[1], &byte, 1, 100), 1);
  EXPECT_EQ(byte, 2);
  // Once only.
  auto again = RequestViews(path_, mine, 2);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(again.status().message()), HasSubstr("already taken"));
  // Taken, connection open: still copying.
  s = views_.AwaitDone(mine, absl::Now() + absl::Milliseconds(50), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(s.message()), HasSubstr("did not finish copying"));
  // A client that leaves its load is noticed at once.
  s = views_.AwaitDone(mine, absl::InfiniteFuture(), [] { return true; });
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled);
  ::close(got->lease);  // done
  for (int f : got->fds) ::close(f);
  EXPECT_TRUE(views_.AwaitDone(mine, absl::Now() + absl::Seconds(10), nullptr).ok());
  views_.Withdraw(mine);
  // A load that ends (here: out of time) closes a views connection its
  // client still holds open.
  const std::string held = views_.Offer(::geteuid(), {a}, "job 'z' rank 0");
  auto open_lease = RequestViews(path_, held, 1);
  ASSERT_TRUE(open_lease.ok()) << open_lease.status();
  views_.Withdraw(held);
  receiver_->EndViews(held);
  char eof[8];
  ::timeval tv{5, 0};
  ::setsockopt(open_lease->lease, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  EXPECT_EQ(::recv(open_lease->lease, eof, sizeof(eof), 0), 0);  // closed by the daemon
  ::close(open_lease->lease);
  for (int f : open_lease->fds) ::close(f);
  EXPECT_EQ(views_.offered(), 0u);
  // Withdrawn: unknown.
  auto late = RequestViews(path_, mine, 2);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(late.status().message()), HasSubstr("expired or unknown"));
  // An fd with the request is refused.
  const int fd = MakeMemfd(4096);
  const int c = Idle(path_);
  ASSERT_TRUE(SendMessage(c, absl::StrCat("VIEWS ", mine), fd));
  char buf[kMaxMessage];
  int none = -1;
  ASSERT_GT(ReceiveMessage(c, buf, sizeof(buf), &none), 0);
  EXPECT_THAT(std::string(buf), HasSubstr("without an fd"));
  ::close(c);
  ::close(fd);
  ::close(a);
  ::close(b);
}

}  // namespace
}  // namespace ckptd
