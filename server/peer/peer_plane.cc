// The peer plane (peer_plane.h).
//
// Identity is the certificate: with mutual TLS every peer presents a
// certificate signed by peer_tls_ca, and its DNS/IP names (SANs) are what it
// is. A name must belong to the peer set to call at all; inside a job a node
// may only use an address its certificate names (multinode/dist_jobs.cc).
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
#include "server/peer/peer_plane.h"
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

std::shared_ptr<const PeerPlane::PeerSet> PeerPlane::Current(bool refresh) const {
  std::string listen;
  {
    absl::MutexLock lock(&set_mu_);
    if (set_ != nullptr && absl::Now() - set_->resolved < kPeerSetTtl &&
        (!refresh || peer_dns_.empty())) {
      return set_;
    }
    listen = listen_;
  }
  auto set = std::make_shared<PeerSet>();
  set->resolved = absl::Now();
  if (!listen.empty()) {
    set->members.insert(listen);
    set->names.insert(HostOf(listen));
  }
  for (const std::string& p : peers_) {
    set->members.insert(p);
    set->names.insert(HostOf(p));
  }
  if (!peer_dns_.empty()) {
    set->dns_name = HostOf(peer_dns_);
    set->names.insert(set->dns_name);
    set->dns_addresses = Resolve(peer_dns_);
    for (const std::string& a : set->dns_addresses) {
      set->members.insert(a);
      set->names.insert(HostOf(a));
    }
  }
  for (const std::string& m : set->members) {
    if (m != listen) set->others.push_back(m);
  }
  absl::MutexLock lock(&set_mu_);
  set_ = std::move(set);
  return set_;
}

PeerPlane::PeerPlane(const DaemonConfig& config)
    : peers_(config.peers),
      peer_dns_(config.peer_dns),
      tls_cert_(config.peer_tls_cert),
      tls_key_(config.peer_tls_key),
      tls_ca_(config.peer_tls_ca),
      listen_(config.peer_listen) {}

std::vector<std::string> PeerPlane::Others() const { return Current()->others; }

std::vector<std::string> PeerPlane::Members() const {
  const auto set = Current();
  return std::vector<std::string>(set->members.begin(), set->members.end());
}

std::string PeerPlane::listen() const {
  absl::MutexLock lock(&set_mu_);
  return listen_;
}

void PeerPlane::SetListen(const std::string& bound) {
  {
    absl::MutexLock lock(&set_mu_);
    listen_ = bound;
    set_ = nullptr;  // none yet; were there one, it named the unbound address
  }
  bound_.store(true, std::memory_order_release);
}

absl::StatusOr<PeerCaller> PeerPlane::Authorize(PeerCaller caller) const {
  if (!bound_.load(std::memory_order_acquire)) {
    return absl::UnavailableError("peer service: starting (its address is not set yet)");
  }
  const bool tls = !tls_ca_.empty();
  if (!caller.verified) {
    if (tls) {
      return absl::UnauthenticatedError(
          absl::StrCat("peer service: ", caller.Describe(), " presented no verified certificate"));
    }
    return caller;  // plaintext: a loopback peer_listen, or peer_insecure
  }
  auto set = Current();
  for (const std::string& n : caller.names) {
    if (set->names.count(n)) return caller;
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "peer service: ", caller.Describe(), " names none of this daemon's peer set (",
      absl::StrJoin(set->names, ", "), ")"));
}

absl::Status PeerPlane::SpeaksFor(const PeerCaller& caller, const std::string& node,
                                  bool job_member) const {
  auto set = Current();
  if (!job_member && !set->members.count(node)) set = Current(/*refresh=*/true);
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

absl::StatusOr<std::optional<PeerPlane::TlsFiles>> PeerPlane::ReadTls() const {
  if (tls_cert_.empty()) return std::optional<TlsFiles>();
  TlsFiles t;
  CKPT_ASSIGN_OR_RETURN(t.cert, ReadPem(tls_cert_, "peer_tls_cert"));
  CKPT_ASSIGN_OR_RETURN(t.key, ReadPem(tls_key_, "peer_tls_key"));
  CKPT_ASSIGN_OR_RETURN(t.ca, ReadPem(tls_ca_, "peer_tls_ca"));
  return std::optional<TlsFiles>(std::move(t));
}

void PeerPlane::UseTls(std::optional<TlsFiles> files) {
  absl::MutexLock lock(&stubs_mu_);
  tls_ = std::move(files);
  stubs_.clear();  // new channels present the new certificate; calls in flight keep theirs
}

std::optional<PeerPlane::TlsFiles> PeerPlane::tls() const {
  absl::MutexLock lock(&stubs_mu_);
  return tls_;
}

std::shared_ptr<grpc::ServerCredentials> PeerPlane::ServerCredentials(
    const std::optional<TlsFiles>& files) {
  if (!files) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions o(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  o.pem_root_certs = files->ca;
  o.pem_key_cert_pairs.push_back({files->key, files->cert});
  return grpc::SslServerCredentials(o);
}

std::shared_ptr<peer::v1::Peer::Stub> PeerPlane::Stub(const std::string& address) {
  auto set = Current();
  absl::MutexLock lock(&stubs_mu_);
  last_called_[address] = absl::Now();
  auto& s = stubs_[address];
  if (!s) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(256 << 20);
    args.SetMaxSendMessageSize(256 << 20);
    // A peer that restarts is back within a second, not after gRPC's
    // default backoff (up to 2 minutes); an idle connection is closed.
    // (GRPC_ARG_MIN_RECONNECT_BACKOFF_MS stays: it is also how long a
    // connection attempt may take, 20 s, which many nodes connecting to
    // each other at once on a busy host need.)
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    args.SetInt(GRPC_ARG_CLIENT_IDLE_TIMEOUT_MS, 10000);
    std::shared_ptr<grpc::ChannelCredentials> creds;
    if (tls_) {
      grpc::SslCredentialsOptions o;
      o.pem_root_certs = tls_->ca;
      o.pem_private_key = tls_->key;
      o.pem_cert_chain = tls_->cert;
      creds = grpc::SslCredentials(o);
      // Found only through peer_dns: its certificate names the service.
      bool listed = false;
      for (const std::string& p : peers_) listed = listed || p == address;
      if (!listed && set->dns_addresses.count(address)) args.SetSslTargetNameOverride(set->dns_name);
    } else {
      creds = grpc::InsecureChannelCredentials();
    }
    s = peer::v1::Peer::NewStub(grpc::CreateCustomChannel(address, creds, args));
  }
  return s;
}

std::vector<PeerPlane::Pinged> PeerPlane::PingAll(const std::vector<std::string>& nodes,
                                                   absl::Duration deadline) {
  const std::string me = listen();
  struct Call {
    grpc::ClientContext ctx;
    peer::v1::PingRequest req;
    peer::v1::PingResponse resp;
    grpc::Status status;
    std::chrono::steady_clock::time_point t0, t1;
    std::shared_ptr<peer::v1::Peer::Stub> stub;
  };
  std::vector<std::unique_ptr<Call>> calls;
  absl::BlockingCounter pending(static_cast<int>(nodes.size()));
  for (const std::string& p : nodes) {
    auto c = std::make_unique<Call>();
    c->ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(deadline));
    c->req.set_node(me);
    c->stub = Stub(p);
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
  std::vector<Pinged> out;
  for (auto& c : calls) {
    out.push_back(Pinged{std::move(c->status), std::move(c->resp), absl::FromChrono(c->t1 - c->t0)});
  }
  return out;
}

std::vector<v1::PeerHealth> PeerPlane::Health(size_t* known) {
  absl::MutexLock refresh(&health_refresh_mu_);
  std::vector<std::string> peers = Others();
  if (known != nullptr) *known = peers.size();
  {
    absl::MutexLock lock(&health_mu_);
    if (absl::Now() - health_at_ < kHealthTtl) return health_;
  }
  if (peers.size() > kMaxHealthPings) {
    // The peers called most recently (never-called ones last, in order).
    std::map<std::string, absl::Time> last;
    {
      absl::MutexLock lock(&stubs_mu_);
      last = last_called_;
    }
    auto when = [&last](const std::string& p) {
      auto it = last.find(p);
      return it == last.end() ? absl::InfinitePast() : it->second;
    };
    std::stable_sort(peers.begin(), peers.end(),
                     [&](const std::string& a, const std::string& b) { return when(a) > when(b); });
    peers.resize(kMaxHealthPings);
  }
  const std::vector<Pinged> pinged = PingAll(peers, absl::FromChrono(kPingDeadline));
  std::vector<v1::PeerHealth> out;
  for (size_t i = 0; i < peers.size(); ++i) {
    v1::PeerHealth ph;
    ph.set_address(peers[i]);
    ph.set_reachable(pinged[i].status.ok());
    if (!pinged[i].status.ok()) ph.set_error(pinged[i].status.error_message());
    ph.set_rtt_ms(absl::ToDoubleMilliseconds(pinged[i].rtt));
    out.push_back(std::move(ph));
  }
  absl::MutexLock lock(&health_mu_);
  health_ = out;
  health_at_ = absl::Now();
  return out;
}

}  // namespace ckptd
