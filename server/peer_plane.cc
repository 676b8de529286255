// The peer plane's identity and transport: who may call the peer service,
// who may speak for which node address, the TLS credentials of both ends
// (reloaded on SIGHUP), and the parallel, cached peer health of Status.
//
// Identity is the certificate: with mutual TLS every peer presents a
// certificate signed by peer_tls_ca, and its DNS/IP names (SANs) are what it
// is. A name must belong to the peer set to call at all; inside a job a node
// may only use an address its certificate names (daemon_multinode.cc).
// Two ways to name nodes:
//  - static `peers` (host:port): each node's certificate names its host;
//    channels verify the server's certificate against that host.
//  - `peer_dns` (a Kubernetes headless service): the nodes' addresses are
//    the service's pod IPs, and channels to them verify the service name,
//    so every node's certificate names it (one Secret shared by the
//    DaemonSet) and may speak for any address behind it: the nodes share one
//    identity, the key is the trust boundary.
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <chrono>

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/blocking_counter.h"
#include "core/base/status_macros.h"
#include "server/daemon.h"
#include "server/pem.h"

namespace ckptd {

namespace {

constexpr absl::Duration kPeerSetTtl = absl::Seconds(5);
constexpr absl::Duration kHealthTtl = absl::Seconds(3);
constexpr auto kPingDeadline = std::chrono::milliseconds(300);

// The addresses `dns` ("name:port") resolves to, as "ip:port" ("[v6]:port").
std::set<std::string> Resolve(const std::string& dns) {
  std::set<std::string> out;
  const size_t colon = dns.rfind(':');
  const std::string host = HostOf(dns);
  const std::string port = colon == std::string::npos ? "" : dns.substr(colon + 1);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0) {
    spdlog::warn("peer_dns {} does not resolve", dns);
    return out;
  }
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char ip[INET6_ADDRSTRLEN] = {};
    const void* addr =
        a->ai_family == AF_INET
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr)
            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr);
    ::inet_ntop(a->ai_family, addr, ip, sizeof(ip));
    out.insert(a->ai_family == AF_INET6 ? absl::StrCat("[", ip, "]:", port)
                                        : absl::StrCat(ip, ":", port));
  }
  ::freeaddrinfo(res);
  return out;
}

}  // namespace

std::shared_ptr<const Daemon::PeerSet> Daemon::CurrentPeerSet(bool refresh) const {
  {
    absl::MutexLock lock(&peer_set_mu_);
    if (peer_set_ != nullptr && absl::Now() - peer_set_->resolved < kPeerSetTtl &&
        (!refresh || config_.peer_dns.empty())) {
      return peer_set_;
    }
  }
  auto set = std::make_shared<PeerSet>();
  set->resolved = absl::Now();
  if (!config_.peer_listen.empty()) {
    set->members.insert(config_.peer_listen);
    set->names.insert(HostOf(config_.peer_listen));
  }
  for (const std::string& p : config_.peers) {
    set->members.insert(p);
    set->names.insert(HostOf(p));
  }
  if (!config_.peer_dns.empty()) {
    set->dns_name = HostOf(config_.peer_dns);
    set->names.insert(set->dns_name);
    set->dns_addresses = Resolve(config_.peer_dns);
    for (const std::string& a : set->dns_addresses) {
      set->members.insert(a);
      set->names.insert(HostOf(a));
    }
  }
  for (const std::string& m : set->members) {
    if (m != config_.peer_listen) set->others.push_back(m);
  }
  absl::MutexLock lock(&peer_set_mu_);
  peer_set_ = std::move(set);
  return peer_set_;
}

std::vector<std::string> Daemon::PeerAddresses() const { return CurrentPeerSet()->others; }

void Daemon::SetPeerListen(const std::string& bound) {
  config_.peer_listen = bound;
  {
    absl::MutexLock lock(&peer_set_mu_);
    peer_set_ = nullptr;  // none yet; were there one, it named the unbound address
  }
  peer_listen_bound_.store(true, std::memory_order_release);
}

absl::StatusOr<PeerCaller> Daemon::AuthorizePeer(PeerCaller caller) const {
  if (!peer_listen_bound_.load(std::memory_order_acquire)) {
    return absl::UnavailableError("peer service: starting (its address is not set yet)");
  }
  const bool tls = !config_.peer_tls_ca.empty();
  if (!caller.verified) {
    if (tls) {
      return absl::UnauthenticatedError(
          absl::StrCat("peer service: ", caller.Describe(), " presented no verified certificate"));
    }
    return caller;  // plaintext: a loopback peer_listen, or peer_insecure
  }
  auto set = CurrentPeerSet();
  for (const std::string& n : caller.names) {
    if (set->names.count(n)) return caller;
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "peer service: ", caller.Describe(), " names none of this daemon's peer set (",
      absl::StrJoin(set->names, ", "), ")"));
}

absl::Status Daemon::SpeaksFor(const PeerCaller& caller, const std::string& node,
                               bool job_member) const {
  auto set = CurrentPeerSet();
  if (!job_member && !set->members.count(node)) set = CurrentPeerSet(/*refresh=*/true);
  if (!job_member && !set->members.count(node)) {
    return absl::PermissionDeniedError(absl::StrCat(
        caller.Describe(), " speaks for node '", node, "', which is not in the peer set"));
  }
  if (!caller.verified) return absl::OkStatus();
  const std::string host = HostOf(node);
  for (const std::string& n : caller.names) {
    if (n == host) return absl::OkStatus();
    if (!set->dns_name.empty() && n == set->dns_name &&
        (job_member || set->dns_addresses.count(node))) {
      return absl::OkStatus();
    }
  }
  return absl::PermissionDeniedError(absl::StrCat(
      caller.Describe(), " speaks for node '", node, "', which its certificate does not name"));
}

absl::StatusOr<std::optional<Daemon::PeerTlsFiles>> Daemon::ReadPeerTls() const {
  if (config_.peer_tls_cert.empty()) return std::optional<PeerTlsFiles>();
  PeerTlsFiles t;
  CKPT_ASSIGN_OR_RETURN(t.cert, ReadPem(config_.peer_tls_cert, "peer_tls_cert"));
  CKPT_ASSIGN_OR_RETURN(t.key, ReadPem(config_.peer_tls_key, "peer_tls_key"));
  CKPT_ASSIGN_OR_RETURN(t.ca, ReadPem(config_.peer_tls_ca, "peer_tls_ca"));
  return std::optional<PeerTlsFiles>(std::move(t));
}

void Daemon::UsePeerTls(std::optional<PeerTlsFiles> files) {
  absl::MutexLock lock(&stubs_mu_);
  peer_tls_ = std::move(files);
  stubs_.clear();  // new channels present the new certificate; calls in flight keep theirs
}

std::optional<Daemon::PeerTlsFiles> Daemon::peer_tls() {
  absl::MutexLock lock(&stubs_mu_);
  return peer_tls_;
}

std::shared_ptr<grpc::ServerCredentials> Daemon::PeerServerCredentials(
    const std::optional<PeerTlsFiles>& files) {
  if (!files) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions o(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  o.pem_root_certs = files->ca;
  o.pem_key_cert_pairs.push_back({files->key, files->cert});
  return grpc::SslServerCredentials(o);
}

std::shared_ptr<peer::v1::Peer::Stub> Daemon::PeerStub(const std::string& address) {
  auto set = CurrentPeerSet();
  absl::MutexLock lock(&stubs_mu_);
  auto& s = stubs_[address];
  if (!s) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(256 << 20);
    args.SetMaxSendMessageSize(256 << 20);
    std::shared_ptr<grpc::ChannelCredentials> creds;
    if (peer_tls_) {
      grpc::SslCredentialsOptions o;
      o.pem_root_certs = peer_tls_->ca;
      o.pem_private_key = peer_tls_->key;
      o.pem_cert_chain = peer_tls_->cert;
      creds = grpc::SslCredentials(o);
      // Found only through peer_dns: its certificate names the service.
      bool listed = false;
      for (const std::string& p : config_.peers) listed = listed || p == address;
      if (!listed && set->dns_addresses.count(address)) args.SetSslTargetNameOverride(set->dns_name);
    } else {
      creds = grpc::InsecureChannelCredentials();
    }
    s = peer::v1::Peer::NewStub(grpc::CreateCustomChannel(address, creds, args));
  }
  return s;
}

std::vector<v1::PeerHealth> Daemon::PeerHealth() {
  absl::MutexLock refresh(&health_refresh_mu_);
  {
    absl::MutexLock lock(&health_mu_);
    if (absl::Now() - health_at_ < kHealthTtl) return health_;
  }
  const std::vector<std::string> peers = PeerAddresses();
  struct Call {
    grpc::ClientContext ctx;
    peer::v1::PingRequest req;
    peer::v1::PingResponse resp;
    grpc::Status status;
    std::chrono::steady_clock::time_point t0, t1;
    std::shared_ptr<peer::v1::Peer::Stub> stub;
  };
  std::vector<std::unique_ptr<Call>> calls;
  absl::BlockingCounter pending(static_cast<int>(peers.size()));
  for (const std::string& p : peers) {
    auto c = std::make_unique<Call>();
    c->ctx.set_deadline(std::chrono::system_clock::now() + kPingDeadline);
    c->req.set_node(config_.peer_listen);
    c->stub = PeerStub(p);
    c->t0 = std::chrono::steady_clock::now();
    Call* raw = c.get();
    calls.push_back(std::move(c));
    raw->stub->async()->Ping(&raw->ctx, &raw->req, &raw->resp, [raw, &pending](grpc::Status s) {
      raw->status = std::move(s);
      raw->t1 = std::chrono::steady_clock::now();
      pending.DecrementCount();
    });
  }
  pending.Wait();  // every call ends by its deadline
  std::vector<v1::PeerHealth> out;
  for (size_t i = 0; i < peers.size(); ++i) {
    v1::PeerHealth ph;
    ph.set_address(peers[i]);
    ph.set_reachable(calls[i]->status.ok());
    if (!calls[i]->status.ok()) ph.set_error(calls[i]->status.error_message());
    ph.set_rtt_ms(std::chrono::duration<double, std::milli>(calls[i]->t1 - calls[i]->t0).count());
    out.push_back(std::move(ph));
  }
  absl::MutexLock lock(&health_mu_);
  health_ = out;
  health_at_ = absl::Now();
  return out;
}

}  // namespace ckptd
