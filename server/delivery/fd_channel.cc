#include "server/delivery/fd_channel.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace ckptd {
namespace {

constexpr uint64_t kListenId = 0;
constexpr uint64_t kWakeId = 1;
// How often held fds past their time are closed, and the longest epoll wait.
constexpr absl::Duration kTick = absl::Milliseconds(200);
// How long accepting pauses when the process is out of fds.
constexpr absl::Duration kAcceptBackoff = absl::Milliseconds(100);

absl::Status Errno(absl::string_view what, absl::string_view path) {
  return absl::UnavailableError(absl::StrCat(path, ": ", what, ": ", std::strerror(errno)));
}

// Replies without waiting: a client that does not read its reply loses it.
void Reply(int c, absl::string_view text) { SendMessage(c, text, -1, MSG_DONTWAIT); }

// Refuses a connection whose request was not read, and closes it. What it
// already sent is read and dropped first (fds closed): closing a socket with
// unread messages makes the client's next receive fail with ECONNRESET
// before it sees the reply.
void Refuse(int c, const absl::Status& why) {
  Reply(c, ErrorReply(why));
  char buf[kMaxMessage];
  for (int i = 0; i < 4; ++i) {
    int fd = -1;
    const ssize_t n = ReceiveMessage(c, buf, sizeof(buf), &fd, MSG_DONTWAIT);
    if (fd >= 0) ::close(fd);
    if (n <= 0) break;
  }
  ::close(c);
}

}  // namespace

absl::StatusOr<std::unique_ptr<FdReceiver>> FdReceiver::Start(const std::string& path,
                                                              uint32_t mode,
                                                              absl::Duration token_ttl,
                                                              ArenaHandler* arenas,
                                                              const FdReceiverLimits& limits,
                                                              ViewHandler* views) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": socket path too long"));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  ::unlink(path.c_str());
  int s = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (s < 0) return Errno("socket", path);
  if (::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::chmod(path.c_str(), mode) != 0 || ::listen(s, 1024) != 0) {
    absl::Status st = Errno("bind/listen", path);
    ::close(s);
    return st;
  }
  const int ep = ::epoll_create1(EPOLL_CLOEXEC);
  const int wake = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  epoll_event lev{};
  lev.events = EPOLLIN;
  lev.data.u64 = kListenId;
  epoll_event wev{};
  wev.events = EPOLLIN;
  wev.data.u64 = kWakeId;
  if (ep < 0 || wake < 0 || ::epoll_ctl(ep, EPOLL_CTL_ADD, s, &lev) != 0 ||
      ::epoll_ctl(ep, EPOLL_CTL_ADD, wake, &wev) != 0) {
    absl::Status st = Errno("epoll/eventfd", path);
    if (ep >= 0) ::close(ep);
    if (wake >= 0) ::close(wake);
    ::close(s);
    ::unlink(path.c_str());
    return st;
  }
  std::unique_ptr<FdReceiver> r(
      new FdReceiver(path, s, ep, wake, token_ttl, arenas, limits, views));
  r->thread_ = std::thread([p = r.get()] { p->Run(); });
  return r;
}

FdReceiver::~FdReceiver() {
  Stop();
  absl::MutexLock lock(&mu_);
  for (auto& [t, h] : fds_) ::close(h.fd);
  fds_.clear();
}

void FdReceiver::Wake() {
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
}

void FdReceiver::Stop() {
  if (stop_.exchange(true)) return;
  Wake();
  if (thread_.joinable()) thread_.join();
  // Grants still being made finish first; what they lent goes back.
  std::vector<NewLease> late;
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int* n) { return *n == 0; }, &granting_));
    late.swap(new_leases_);
  }
  for (const NewLease& l : late) EndLease(l.fd, l.token);
  ::close(listen_fd_);
  ::close(epoll_fd_);
  ::close(wake_fd_);
  ::unlink(path_.c_str());
}

size_t FdReceiver::pending() const {
  absl::MutexLock lock(&mu_);
  return fds_.size();
}

size_t FdReceiver::waiting() const { return waiting_.load(); }

void FdReceiver::ExpireLocked() {
  const absl::Time now = absl::Now();
  for (auto it = fds_.begin(); it != fds_.end();) {
    if (it->second.expires < now) {
      ::close(it->second.fd);
      if (--held_per_uid_[it->second.uid] == 0) held_per_uid_.erase(it->second.uid);
      it = fds_.erase(it);
    } else {
      ++it;
    }
  }
}

void FdReceiver::Watch(int fd, uid_t uid, bool lease, std::string token) {
  const uint64_t id = next_id_++;
  epoll_event ev{};
  // A lease ends when the client closes it (or dies); anything it sends
  // after the grant ends it too.
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.u64 = id;
  if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    if (lease) {
      EndLease(fd, token);
    } else {
      Refuse(fd, absl::ResourceExhaustedError(
                     absl::StrCat("the daemon cannot watch this connection: ", std::strerror(errno))));
    }
    return;
  }
  Conn c{fd, uid, lease, absl::InfiniteFuture(), std::move(token)};
  if (!lease) {
    c.deadline = absl::Now() + limits_.request_timeout;
    deadlines_.emplace(c.deadline, id);
    ++waiting_per_uid_[uid];
    ++waiting_;
  }
  conns_.emplace(id, std::move(c));
}

FdReceiver::Conn FdReceiver::Unwatch(uint64_t id) {
  auto it = conns_.find(id);
  Conn c = std::move(it->second);
  conns_.erase(it);
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c.fd, nullptr);
  if (!c.lease) {
    auto [b, e] = deadlines_.equal_range(c.deadline);
    for (auto d = b; d != e; ++d) {
      if (d->second == id) {
        deadlines_.erase(d);
        break;
      }
    }
    if (--waiting_per_uid_[c.uid] == 0) waiting_per_uid_.erase(c.uid);
    --waiting_;
  }
  return c;
}

void FdReceiver::AcceptAll() {
  // A bounded batch per round, so a flood of connections cannot keep the
  // loop from serving requests and deadlines.
  for (int i = 0; i < 256; ++i) {
    const int c = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (c < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        // Out of fds: the listening socket would stay readable and spin the
        // loop. Waiting connections time out and leases end, freeing some.
        accept_paused_until_ = absl::Now() + kAcceptBackoff;
        epoll_event ev{};
        ev.events = 0;
        ev.data.u64 = kListenId;
        ::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, listen_fd_, &ev);
      }
      return;  // EAGAIN: none left (or a transient error)
    }
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (::getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      Refuse(c, absl::UnavailableError("the daemon cannot tell who is connecting"));
      continue;
    }
    const auto per_uid = waiting_per_uid_.find(cred.uid);
    const int uid_waiting = per_uid == waiting_per_uid_.end() ? 0 : per_uid->second;
    if (static_cast<int>(waiting_.load()) >= limits_.max_waiting ||
        uid_waiting >= limits_.max_waiting_per_uid) {
      const bool mine = uid_waiting >= limits_.max_waiting_per_uid;
      Refuse(c, absl::ResourceExhaustedError(absl::StrCat(
                    "too many connections waiting to send their request on the fd socket (",
                    mine ? absl::StrCat(uid_waiting, " of uid ", cred.uid,
                                        ", the limit per uid is ", limits_.max_waiting_per_uid)
                         : absl::StrCat(waiting_.load(), ", the limit is ", limits_.max_waiting),
                    "); retry")));
      continue;
    }
    Watch(c, cred.uid, /*lease=*/false, "");
  }
}

void FdReceiver::Run() {
  constexpr int kEvents = 256;
  epoll_event events[kEvents];
  absl::Time next_expiry = absl::Now() + kTick;
  while (!stop_.load()) {
    {
      std::vector<NewLease> adopt;
      {
        absl::MutexLock lock(&mu_);
        adopt.swap(new_leases_);
      }
      for (NewLease& l : adopt) Watch(l.fd, l.uid, /*lease=*/true, std::move(l.token));
      // Views leases whose load is over (EndViews): closed here, whatever
      // the client does with its end.
      std::vector<std::string> ended;
      {
        absl::MutexLock lock(&mu_);
        ended.swap(ended_views_);
      }
      for (const std::string& t : ended) {
        for (auto it = conns_.begin(); it != conns_.end();) {
          const uint64_t id = it->first;
          const bool match = it->second.lease && it->second.token == t;
          ++it;
          if (match) ::close(Unwatch(id).fd);
        }
      }
    }
    absl::Time now = absl::Now();
    if (accept_paused_until_ != absl::InfinitePast() && now >= accept_paused_until_) {
      accept_paused_until_ = absl::InfinitePast();
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u64 = kListenId;
      ::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, listen_fd_, &ev);
    }
    absl::Time wake_at = next_expiry;
    if (!deadlines_.empty()) wake_at = std::min(wake_at, deadlines_.begin()->first);
    if (accept_paused_until_ != absl::InfinitePast()) {
      wake_at = std::min(wake_at, accept_paused_until_);
    }
    const int64_t wait_ms =
        std::max<int64_t>(0, absl::ToInt64Milliseconds(absl::Ceil(wake_at - now, absl::Milliseconds(1))));
    const int n = ::epoll_wait(epoll_fd_, events, kEvents, static_cast<int>(wait_ms));
    for (int i = 0; i < n; ++i) {
      const uint64_t id = events[i].data.u64;
      if (id == kWakeId) {
        uint64_t v;
        (void)!::read(wake_fd_, &v, sizeof(v));
      } else if (id == kListenId) {
        AcceptAll();
      } else {
        auto it = conns_.find(id);
        if (it == conns_.end()) continue;  // closed earlier in this round
        if (it->second.lease) {
          Conn c = Unwatch(id);
          EndLease(c.fd, c.token);
        } else {
          Serve(id);
        }
      }
    }
    // Connections past their deadline without a request are closed.
    now = absl::Now();
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      Conn c = Unwatch(deadlines_.begin()->second);
      Refuse(c.fd, absl::DeadlineExceededError(absl::StrCat(
                       "no request within ", absl::FormatDuration(limits_.request_timeout),
                       " of connecting")));
    }
    if (now >= next_expiry) {
      absl::MutexLock lock(&mu_);
      ExpireLocked();
      next_expiry = now + kTick;
    }
  }
  for (auto& [id, c] : conns_) {
    if (c.lease) {
      EndLease(c.fd, c.token);
    } else {
      ::close(c.fd);
    }
  }
  conns_.clear();
  deadlines_.clear();
  waiting_per_uid_.clear();
  waiting_ = 0;
}

void FdReceiver::EndViews(const std::string& token) {
  {
    absl::MutexLock lock(&mu_);
    ended_views_.push_back(absl::StrCat("v:", token));
  }
  Wake();
}

void FdReceiver::EndLease(int fd, const std::string& token) {
  if (absl::StartsWith(token, "v:")) {
    if (views_ != nullptr) views_->Done(token.substr(2));
  } else if (arenas_ != nullptr) {
    arenas_->Release(token);
  }
  ::close(fd);
}

void FdReceiver::Serve(uint64_t id) {
  const int c = conns_.at(id).fd;
  char buf[kMaxMessage];
  int fd = -1;
  bool truncated = false;
  const ssize_t n = ReceiveMessage(c, buf, sizeof(buf), &fd, MSG_DONTWAIT, &truncated);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;  // nothing yet
  const Conn conn = Unwatch(id);
  if (n <= 0) {  // the client went away (or the socket failed) before asking
    if (fd >= 0) ::close(fd);
    ::close(c);
    return;
  }
  // The request, parsed strictly (proto/fd_socket.h): a token with one fd,
  // or ALLOC <bytes> with none.
  const std::string expected = absl::StrCat(
      "expected a ", kTokenLen, "-character lowercase hex token and one fd, or ALLOC <bytes>");
  absl::StatusOr<FdRequest> req =
      truncated ? absl::InvalidArgumentError(absl::StrCat(
                      expected, ": the message was longer than ", kMaxMessage - 1,
                      " bytes or carried several fds"))
                : ParseFdRequest(absl::string_view(buf, static_cast<size_t>(n)));
  if (req.ok() && req->kind == FdRequest::Kind::kAlloc && fd >= 0) {
    req = absl::InvalidArgumentError("expected ALLOC <bytes> without an fd");
  } else if (req.ok() && req->kind == FdRequest::Kind::kViews && fd >= 0) {
    req = absl::InvalidArgumentError("expected VIEWS <token> without an fd");
  } else if (req.ok() && req->kind == FdRequest::Kind::kHandOver && fd < 0) {
    req = absl::InvalidArgumentError(absl::StrCat(expected, ": the token came without an fd"));
  }
  if (!req.ok()) {
    if (fd >= 0) ::close(fd);
    Reply(c, ErrorReply(req.status()));
    ::close(c);
    return;
  }
  if (req->kind == FdRequest::Kind::kAlloc) {
    if (arenas_ == nullptr) {
      Reply(c, ErrorReply(absl::UnavailableError("this daemon lends no arenas")));
      ::close(c);
      return;
    }
    // Making an arena faults in its memory (seconds for many GiB): on its
    // own thread, so other clients of this socket are not held up.
    {
      absl::MutexLock lock(&mu_);
      if (granting_ >= limits_.max_granting) {
        Reply(c, ErrorReply(absl::ResourceExhaustedError(absl::StrCat(
                     "too many arena requests at once (", limits_.max_granting, "); retry"))));
        ::close(c);
        return;
      }
      ++granting_;
    }
    std::thread([this, c, size = req->bytes, uid = conn.uid] { Grant(c, size, uid); }).detach();
    return;  // the socket is Grant's now
  }
  if (req->kind == FdRequest::Kind::kViews) {
    ServeViews(c, req->token, conn.uid);
    return;
  }
  Reply(c, Hold(req->token, fd, conn.uid));
  ::close(c);
}

void FdReceiver::ServeViews(int c, const std::string& token, uid_t uid) {
  absl::StatusOr<std::vector<int>> fds =
      views_ != nullptr ? views_->Take(token, uid)
                        : absl::UnavailableError("this daemon has no cache views");
  if (!fds.ok()) {
    Reply(c, ErrorReply(fds.status()));
    ::close(c);
    return;
  }
  FdReply reply;
  reply.kind = FdReply::Kind::kViews;
  reply.bytes = fds->size();
  const bool sent = !fds->empty() && fds->size() <= kMaxViewFds &&
                    SendMessageFds(c, EncodeFdReply(reply), fds->data(), fds->size(), MSG_DONTWAIT);
  for (int f : *fds) ::close(f);
  if (!sent) {
    if (views_ != nullptr) views_->Done(token, /*copied=*/false);
    ::close(c);
    return;
  }
  // The connection is the client's hold on the views: done when it closes.
  Watch(c, uid, /*lease=*/true, absl::StrCat("v:", token));
}

std::string FdReceiver::Hold(const std::string& token, int fd, uid_t uid) {
  absl::Status st = CheckSealedSegment(fd, "the fd");
  if (st.ok()) {
    absl::MutexLock lock(&mu_);
    size_t& mine = held_per_uid_[uid];
    if (fds_.size() >= limits_.max_held) {
      st = absl::ResourceExhaustedError(absl::StrCat(
          "too many fds held and not yet named in a request (", fds_.size(), ")"));
    } else if (mine >= limits_.max_held_per_uid) {
      st = absl::ResourceExhaustedError(absl::StrCat(
          "too many fds of uid ", uid, " held and not yet named in a request (", mine,
          ", the limit per uid is ", limits_.max_held_per_uid, "; unused ones expire after ",
          absl::FormatDuration(ttl_), ")"));
    } else if (!fds_.emplace(token, Held{fd, absl::Now() + ttl_, uid}).second) {
      st = absl::InvalidArgumentError("duplicate token");
    } else {
      ++mine;
      return EncodeFdReply(FdReply());  // "OK"
    }
    if (mine == 0) held_per_uid_.erase(uid);
  }
  ::close(fd);
  return ErrorReply(st);
}

void FdReceiver::Grant(int c, uint64_t size, uid_t uid) {
  absl::StatusOr<ArenaLease> lease = arenas_->Allocate(size, uid);
  bool kept = false;
  if (!lease.ok()) {
    Reply(c, ErrorReply(lease.status()));
  } else {
    FdReply grant;
    grant.kind = FdReply::Kind::kGrant;
    grant.token = lease->token;
    grant.bytes = lease->size;
    const bool sent = SendMessage(c, EncodeFdReply(grant), lease->fd, MSG_DONTWAIT);
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
    new_leases_.push_back(NewLease{c, uid, lease->token});  // Run watches it from its next round
    Wake();  // before granting_ drops: Stop closes wake_fd_ once it is 0
  } else {
    ::close(c);
  }
  --granting_;
}

absl::StatusOr<int> FdReceiver::Take(const std::string& token, uid_t caller_uid) {
  absl::MutexLock lock(&mu_);
  auto it = fds_.find(token);
  if (it != fds_.end() && it->second.expires < absl::Now()) {
    ExpireLocked();
    it = fds_.end();
  }
  if (it == fds_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm fd_token '", token, "' is unknown or expired (send the fd first)"));
  }
  if (it->second.uid != caller_uid) {
    return absl::PermissionDeniedError(absl::StrCat(
        "shm fd_token '", TokenPrefix(token),
        "' belongs to another user: a token may only be used by the uid that sent its fd"));
  }
  const int fd = it->second.fd;
  if (--held_per_uid_[it->second.uid] == 0) held_per_uid_.erase(it->second.uid);
  fds_.erase(it);
  return fd;
}

}  // namespace ckptd
