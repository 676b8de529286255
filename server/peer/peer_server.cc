#include "server/peer/peer_plane.h"
#include "server/peer/peer_server.h"

#include <netdb.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"

namespace ckptd {

absl::StatusOr<std::unique_ptr<grpc::Server>> PeerServer::Build(
    const std::optional<PeerPlane::TlsFiles>& files, std::string* bound) {
  const DaemonConfig& c = config_;
  grpc::ServerBuilder pb;
  int port = 0;
  pb.AddListeningPort(c.peer_listen, PeerPlane::ServerCredentials(files), &port);
  pb.SetMaxReceiveMessageSize(256 << 20);
  pb.SetMaxSendMessageSize(256 << 20);
  pb.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 1);  // the next server, on rotation
  pb.RegisterService(service_);
  // A Unix socket is created owner-only (no window with a wider mode): the
  // plaintext peer plane on one machine is protected by the file's mode.
  const bool unix_socket = IsUnixAddress(c.peer_listen);
  const mode_t old_umask = unix_socket ? ::umask(0177) : 0;
  std::unique_ptr<grpc::Server> s = pb.BuildAndStart();
  if (unix_socket) {
    ::umask(old_umask);
    if (s != nullptr && ::chmod(c.peer_listen.c_str() + 5, 0600) != 0) {
      const int err = errno;
      s->Shutdown(std::chrono::system_clock::now());
      return absl::UnavailableError(absl::StrCat("cannot make ", c.peer_listen, " owner-only: ",
                                                 std::strerror(err)));
    }
  }
  if (s == nullptr || (!unix_socket && port <= 0)) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen for peers on ", c.peer_listen,
        c.peer_tls_cert.empty() ? "" : " (or the peer TLS certificate/key is unusable)"));
  }
  s->GetHealthCheckService()->SetServingStatus(true);
  if (bound != nullptr) {
    *bound = unix_socket
                 ? c.peer_listen
                 : absl::StrCat(c.peer_listen.substr(0, c.peer_listen.rfind(':')), ":", port);
  }
  return s;
}

namespace {

// Whether a TCP `address` ("host:port", "[v6]:port") is free to listen on:
// a plain bind (no SO_REUSEPORT) fails on a port any socket listens on.
// The peer server sets SO_REUSEPORT (its rotation binds a second server on
// its own port), with which a second daemon of the same uid configured for
// the same port would share it, each taking part of the peers' connections:
// this is checked before the first server starts. Port 0, Unix sockets and
// addresses that do not parse or resolve pass (gRPC reports those).
absl::Status PortFree(const std::string& address) {
  const int port = PortOf(address);
  if (port <= 0) return absl::OkStatus();
  const std::string host = HostOf(address);
  const std::string service = std::to_string(port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res) != 0) {
    return absl::OkStatus();
  }
  int err = 0;
  for (addrinfo* a = res; a != nullptr && err == 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);  // TIME_WAIT is no user
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 && errno == EADDRINUSE) err = errno;
    ::close(fd);
  }
  ::freeaddrinfo(res);
  if (err != 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen for peers on ", address, ": ", std::strerror(err),
        " (another process listens on that port; is another ckptd running with this "
        "peer_listen?)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<PeerServer>> PeerServer::Start(const DaemonConfig& config,
                                                              PeerPlane* plane,
                                                              PeerService* service) {
  if (absl::Status free = PortFree(config.peer_listen); !free.ok()) return free;
  std::unique_ptr<PeerServer> p(new PeerServer(config, plane, service));
  auto s = p->Build(plane->tls(), &p->bound_);
  if (!s.ok()) return s.status();
  absl::MutexLock lock(&p->mu_);
  p->current_ = std::move(*s);
  return p;
}

absl::Status PeerServer::Rotate(const std::optional<PeerPlane::TlsFiles>& files) {
  auto next = Build(files);
  if (!next.ok()) return next.status();
  std::vector<std::thread> finished;  // joined outside the lock
  {
    absl::MutexLock lock(&mu_);
    std::shared_ptr<grpc::Server> old(std::move(current_));
    current_ = std::move(*next);
    const auto deadline = std::chrono::system_clock::now() +
                          std::chrono::milliseconds(absl::ToInt64Milliseconds(
                              config_.peer_timeout));
    for (auto it = retiring_.begin(); it != retiring_.end();) {
      if (it->done->load()) {
        finished.push_back(std::move(it->thread));
        it = retiring_.erase(it);
      } else {
        ++it;
      }
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    retiring_.push_back({std::thread([old, deadline, done] {
                           old->Shutdown(deadline);
                           done->store(true);
                         }),
                         done});
    plane_->UseTls(files);  // and this node's channels, now that the server took them
  }
  for (std::thread& t : finished) t.join();
  spdlog::info("peer service on {}: new certificate in use; calls in flight finish on the old one",
               config_.peer_listen);
  return absl::OkStatus();
}

void PeerServer::SetServing(bool serving) {
  absl::MutexLock lock(&mu_);
  if (current_) current_->GetHealthCheckService()->SetServingStatus(serving);
}

void PeerServer::Shutdown(std::chrono::system_clock::time_point deadline) {
  absl::MutexLock lock(&mu_);
  if (current_) current_->Shutdown(deadline);
}

PeerServer::~PeerServer() {
  std::vector<Retiring> threads;
  {
    absl::MutexLock lock(&mu_);
    threads = std::move(retiring_);
    if (current_) current_->Shutdown(std::chrono::system_clock::now());
  }
  for (auto& t : threads) t.thread.join();
}

}  // namespace ckptd
