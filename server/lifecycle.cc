#include "server/peer/peer_plane.h"
#include "server/lifecycle.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <iostream>
#include <memory>
#include <optional>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/security/server_credentials.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <systemd/sd-daemon.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/io/file.h"
#include "server/daemon.h"
#include "server/obs/metrics.h"
#include "server/peer/peer_server.h"
#include "server/peer/peer_service.h"
#include "server/pem.h"
#include "server/api/service.h"
#include "server/api/uds_listener.h"

namespace ckptd {
namespace {

// Removes a socket file left by a dead daemon; refuses to steal a live one.
absl::Status ClaimSocket(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return absl::OkStatus();
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " exists and is not a socket"));
  }
  int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  int r = ::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::close(s);
  if (r == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is in use by a running daemon"));
  }
  ::unlink(path.c_str());
  return absl::OkStatus();
}

// Load calls that ended so far, either way, and those still running.
int64_t LoadsEnded(Daemon& daemon) {
  const auto st = daemon.Status(Caller{});
  return static_cast<int64_t>(st.loads_succeeded() + st.loads_failed());
}
int64_t LoadsRunning(Daemon& daemon) {
  const auto st = daemon.Status(Caller{});
  return static_cast<int64_t>(st.loads_started() - st.loads_succeeded() - st.loads_failed());
}

// What a running daemon answers on (RunDaemon owns them).
struct Listeners {
  std::unique_ptr<PeerServer> peer;
  std::unique_ptr<UdsListener> uds;
  std::unique_ptr<grpc::Server> grpc;
  std::unique_ptr<MetricsServer> metrics;
  int tcp_port = 0;
  // The socket file this daemon made: removed at exit only if it is still
  // this one (the listener closes at SIGTERM, so a successor may have
  // claimed the path while this daemon drained).
  struct stat own_socket {};
  bool have_socket = false;
};

// The peer service: TCP (or a unix: socket), separate from the client API.
// "host:0" becomes "host:N" in config->peer_listen: the node's identity.
absl::Status StartPeerService(DaemonConfig* config, Daemon* daemon, PeerService* service,
                              Listeners* l) {
  auto ps = PeerServer::Start(daemon->config(), &daemon->peer_plane(), service);
  if (!ps.ok()) return ps.status();
  l->peer = std::move(*ps);
  config->peer_listen = l->peer->bound_address();
  daemon->SetPeerListen(config->peer_listen);
  if (config->peer_tls_cert.empty() && !IsLoopbackAddress(config->peer_listen)) {
    spdlog::warn("peer service on {} WITHOUT TLS (peer_insecure: true): whoever reaches it can "
                 "join jobs and read or alter their bytes", config->peer_listen);
  }
  spdlog::info("peer service listening on {} (peers: {}{}; {})", config->peer_listen,
               absl::StrJoin(config->peers, ","),
               config->peer_dns.empty() ? "" : " dns " + config->peer_dns,
               config->peer_tls_cert.empty() ? "plaintext" : "mutual TLS");
  return absl::OkStatus();
}

// Credentials for tcp_address: mutual TLS, or plaintext (insecure_tcp).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TcpCredentials(
    const DaemonConfig& config) {
  if (config.tcp_tls_cert.empty()) {
    spdlog::warn("tcp_address {} is served WITHOUT TLS (insecure_tcp: true): anyone who can "
                 "reach it acts as uid {}", config.tcp_address, config.tcp_uid);
    return grpc::InsecureServerCredentials();
  }
  auto cert = ReadPem(config.tcp_tls_cert, "tcp_tls_cert");
  auto key = ReadPem(config.tcp_tls_key, "tcp_tls_key");
  auto ca = ReadPem(config.tcp_tls_ca, "tcp_tls_ca");
  for (const auto* r : {&cert, &key, &ca}) {
    if (!r->ok()) return r->status();
  }
  grpc::SslServerCredentialsOptions o(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  o.pem_root_certs = *ca;
  o.pem_key_cert_pairs.push_back({*key, *cert});
  return grpc::SslServerCredentials(o);
}

// The gRPC server of the client API, with the limits on messages, streams
// and threads; its TCP port when tcp_address is set ("host:0" becomes
// "host:N" in config->tcp_address).
absl::Status StartGrpc(DaemonConfig* config, CkptdService* service, Listeners* l) {
  grpc::ServerBuilder builder;
  if (!config->tcp_address.empty()) {
    auto creds = TcpCredentials(*config);
    if (!creds.ok()) return creds.status();
    builder.AddListeningPort(config->tcp_address, *creds, &l->tcp_port);
    // gRPC would share a port another process of this uid listens on
    // (SO_REUSEPORT), each taking part of the connections: refuse it.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  }
  const Limits& limits = config->limits;
  const int max_msg = static_cast<int>(std::min<uint64_t>(limits.max_message_bytes, INT32_MAX));
  builder.SetMaxReceiveMessageSize(max_msg);
  builder.SetMaxSendMessageSize(max_msg);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                             static_cast<int>(std::min<uint64_t>(limits.max_concurrent_streams, INT32_MAX)));
  grpc::ResourceQuota quota("ckptd");
  quota.SetMaxThreads(static_cast<int>(std::min<uint64_t>(limits.max_threads, INT32_MAX)));
  builder.SetResourceQuota(quota);
  builder.RegisterService(service);
  l->grpc = builder.BuildAndStart();
  if (!l->grpc || (!config->tcp_address.empty() && l->tcp_port <= 0)) {
    if (l->grpc) l->grpc->Shutdown(std::chrono::system_clock::now());
    l->grpc.reset();
    return absl::UnavailableError(absl::StrCat(
        "cannot start the gRPC server", config->tcp_address.empty() ? "" : " on " + config->tcp_address));
  }
  if (!config->tcp_address.empty()) {
    config->tcp_address = absl::StrCat(
        config->tcp_address.substr(0, config->tcp_address.rfind(':')), ":", l->tcp_port);
    spdlog::info("tcp service listening on {}", config->tcp_address);
  }
  return absl::OkStatus();
}

// --port-file: every listener's port as JSON, written atomically.
absl::Status WritePortFile(const DaemonConfig& config, const Listeners& l) {
  nlohmann::ordered_json ports = nlohmann::ordered_json::object();
  if (!config.tcp_address.empty()) ports["tcp"] = l.tcp_port;
  if (l.peer) {
    const int peer_port = PortOf(config.peer_listen);
    if (peer_port > 0) ports["peer"] = peer_port;
    ports["peer_address"] = config.peer_listen;
  }
  if (l.metrics) ports["metrics"] = l.metrics->port();
  const std::string json =
      ports.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
  if (absl::Status s = ckpt::WriteFileAtomic(config.port_file, json); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("port_file: ", s.message()));
  }
  return absl::OkStatus();
}

// After SIGTERM/SIGINT: no new connections; running loads get drain_timeout,
// then fail with a clear UNAVAILABLE (AbortLoads) a moment before gRPC
// cancels whatever call is left.
void Drain(const DaemonConfig& config, Daemon& daemon, Listeners& l) {
  sd_notify(0, "STOPPING=1\nSTATUS=draining running loads");
  l.grpc->GetHealthCheckService()->SetServingStatus(false);
  if (l.uds) l.uds->Stop();  // no new connections; open ones drain
  // grpc.health.v1 on the peer port says NOT_SERVING while draining.
  if (l.peer) l.peer->SetServing(false);
  const auto drain = std::chrono::system_clock::now() +
                     std::chrono::milliseconds(absl::ToInt64Milliseconds(config.drain_timeout));
  daemon.DrainSaves(absl::FromChrono(drain));  // a client awaiting a save does not hold it open
  // Jobs still waiting for ranks cannot finish (no new calls are taken):
  // their ranks retry on the restarted daemon now, not after drain_timeout.
  if (const std::vector<std::string> waiting = daemon.AbortWaiting(
          "ckptd is restarting before the job's ranks all came (the clients retry once it is "
          "back)");
      !waiting.empty()) {
    spdlog::info("drain: failed {} job(s) still waiting for ranks (their clients retry): {}",
                 waiting.size(), absl::StrJoin(waiting, ","));
  }
  // Without the abort, a running job would read on to its end while its
  // ranks got a bare CANCELLED.
  constexpr auto kDrainGrace = std::chrono::seconds(2);
  absl::Mutex drain_mu;
  bool drained = false;
  std::thread expiry([&] {
    absl::MutexLock lock(&drain_mu);
    drain_mu.AwaitWithDeadline(absl::Condition(&drained), absl::FromChrono(drain));
    if (drained) return;
    const std::vector<std::string> cut = daemon.AbortLoads(absl::StrCat(
        "ckptd is shutting down: drain_timeout ", absl::FormatDuration(config.drain_timeout),
        " ran out before the load finished (the clients retry once ckptd is back)"));
    if (!cut.empty()) {
      spdlog::warn("drain_timeout {} ran out: failed {} load job(s) still waiting or running: {}",
                   absl::FormatDuration(config.drain_timeout), cut.size(), absl::StrJoin(cut, ","));
    }
  });
  // The running loads end before gRPC shuts down: gRPC closes every
  // connection as soon as Shutdown has no call left, and a client that had
  // not read its last answer by then (it answers a ping into the closed
  // socket) loses it. So the loads end first, with the connections open
  // (new loads are refused meanwhile: AbortWaiting), their clients get
  // kLinger to read their results, and then gRPC shuts down.
  const int64_t ended = LoadsEnded(daemon);
  while (LoadsRunning(daemon) > 0 && std::chrono::system_clock::now() < drain + kDrainGrace) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (LoadsEnded(daemon) != ended) {
    constexpr auto kLinger = std::chrono::milliseconds(500);
    std::this_thread::sleep_until(
        std::min(std::chrono::system_clock::now() + kLinger, drain + kDrainGrace));
  }
  l.grpc->Shutdown(drain + kDrainGrace);
  {
    absl::MutexLock lock(&drain_mu);
    drained = true;
  }
  expiry.join();
  // This node's loads are over, so every multi-node job it was a node of is
  // concluded (a node's load ends when the job's outcome is known): what
  // peer calls are left wait for jobs that failed (or for nothing). They
  // get a second, not the rest of drain_timeout (128 daemons stopped at
  // once took 30 s).
  if (l.peer) {
    l.peer->Shutdown(std::min(drain, std::chrono::system_clock::now() + std::chrono::seconds(1)));
  }
}

// The signal thread: SIGHUP reloads the peer TLS files; the first stop
// signal drains. *drain_until says when the drain ends.
void HandleSignals(const sigset_t& sigs, const DaemonConfig& config, Daemon& daemon, Listeners& l,
                   absl::Time* drain_until) {
  int sig = 0;
  while (sigwait(&sigs, &sig) == 0 && sig == SIGHUP) {
    if (!l.peer || config.peer_tls_cert.empty()) {
      spdlog::info("SIGHUP: no peer TLS is configured; nothing to reload (what SIGHUP reloads: "
                   "the peer TLS files)");
      continue;
    }
    auto files = daemon.peer_plane().ReadTls();
    absl::Status s = files.status();
    if (s.ok()) s = l.peer->Rotate(*files);
    if (s.ok()) {
      spdlog::info("SIGHUP: peer TLS files reloaded");
    } else {
      spdlog::error("SIGHUP: peer TLS not reloaded, the old certificate stays: {}",
                    std::string(s.message()));
    }
  }
  spdlog::info("signal {}: draining running loads (up to {})", sig,
               absl::FormatDuration(config.drain_timeout));
  *drain_until = absl::Now() + config.drain_timeout;
  Drain(config, daemon, l);
}

// After the drain: the last answers read, asynchronous saves given the rest
// of drain_timeout, the daemon stopped, the socket and port files removed.
void Finish(const DaemonConfig& config, Daemon& daemon, Listeners& l, absl::Time drain_until) {
  if (l.uds) l.uds->Stop();
  // Asynchronous saves still persisting get the rest of the drain; those
  // that do not finish are abandoned (their versions never appear).
  const std::vector<std::string> abandoned =
      daemon.AwaitPersists(std::max(absl::ZeroDuration(), drain_until - absl::Now()));
  if (!abandoned.empty()) {
    spdlog::warn("drain_timeout {} ran out: abandoned {} save job(s) still persisting (their "
                 "versions are not visible): {}",
                 absl::FormatDuration(config.drain_timeout), abandoned.size(),
                 absl::StrJoin(abandoned, ", "));
  }
  l.metrics.reset();
  daemon.Stop();
  struct stat now_socket {};
  if (l.have_socket && ::stat(config.socket.c_str(), &now_socket) == 0 &&
      now_socket.st_ino == l.own_socket.st_ino && now_socket.st_dev == l.own_socket.st_dev) {
    ::unlink(config.socket.c_str());
  }
  if (!config.port_file.empty()) ::unlink(config.port_file.c_str());
  spdlog::info("stopped");
}

// Who a gRPC peer string names: a Unix-socket connection's kernel identity
// (the listener's), or a TCP client acting as tcp_uid.
std::function<std::optional<Caller>(const std::string&)> CallerLookup(
    const std::unique_ptr<UdsListener>& uds, uid_t tcp_uid) {
  return [&uds, tcp_uid](const std::string& peer) -> std::optional<Caller> {
    if (absl::StartsWith(peer, "fd:")) return uds ? uds->Lookup(peer) : std::nullopt;
    if (absl::StartsWith(peer, "ipv4:") || absl::StartsWith(peer, "ipv6:")) {
      Caller c;
      c.via = Caller::Via::kTcp;
      c.uid = tcp_uid;
      c.gid = tcp_uid;
      return c;
    }
    return std::nullopt;
  };
}

// The sockets this daemon will listen on: a live daemon's are refused,
// stale ones removed (gRPC would remove whatever is at a path).
absl::Status ClaimSockets(const DaemonConfig& config) {
  if (!config.socket.empty()) {
    if (absl::Status s = ClaimSocket(config.socket); !s.ok()) return s;
  }
  if (IsUnixAddress(config.peer_listen)) {
    if (absl::Status s = ClaimSocket(config.peer_listen.substr(5)); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("peer_listen: ", s.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

int Fail(const std::string& msg) {
  std::cerr << "ckptd: error: " << msg << "\n";
  return 1;
}

int RunDaemon(DaemonConfig config, const std::vector<std::string>& budget_notes) {
  SetUpLogging(config.log_level, config.log_format);
  for (const std::string& n : budget_notes) spdlog::info("{}", n);
  // Signals are handled by one thread with sigwait; block them everywhere.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  signal(SIGPIPE, SIG_IGN);

  // A port file from an earlier run must not be read as this one's.
  if (!config.port_file.empty()) ::unlink(config.port_file.c_str());
  Daemon daemon(config);
  if (absl::Status s = ClaimSockets(config); !s.ok()) return Fail(std::string(s.message()));
  if (absl::Status s = daemon.Start(); !s.ok()) return Fail(std::string(s.message()));
  grpc::EnableDefaultHealthCheckService(true);  // every server below has grpc.health.v1
  // The services outlive the servers that call them (declared first,
  // destroyed last), also those a SIGHUP rotation is still retiring.
  PeerService peer_service(&daemon.peer_plane(), &daemon.dist_jobs());
  std::optional<CkptdService> service;
  Listeners l;
  // The peer service is up before the client socket appears, so a node whose
  // socket exists can be joined.
  if (!config.peer_listen.empty()) {
    if (absl::Status s = StartPeerService(&config, &daemon, &peer_service, &l); !s.ok()) {
      return Fail(std::string(s.message()));
    }
  }
  if (!config.socket.empty()) {
    auto u = UdsListener::Listen(config.socket, config.socket_mode, config.limits.max_connections);
    if (!u.ok()) return Fail(std::string(u.status().message()));
    l.uds = std::move(*u);
    l.have_socket = ::stat(config.socket.c_str(), &l.own_socket) == 0;
  }
  service.emplace(&daemon, CallerLookup(l.uds, config.tcp_uid));
  auto stop_listeners = [&l] {
    if (l.grpc) l.grpc->Shutdown(std::chrono::system_clock::now());
    if (l.peer) l.peer->Shutdown(std::chrono::system_clock::now());
  };
  if (absl::Status s = StartGrpc(&config, &*service, &l); !s.ok()) {
    stop_listeners();
    return Fail(std::string(s.message()));
  }
  if (l.uds) l.uds->Serve(l.grpc.get());
  if (!config.metrics_address.empty()) {
    auto m = MetricsServer::Start(config.metrics_address, [&daemon] { return daemon.Status(); });
    if (!m.ok()) {
      stop_listeners();
      return Fail(std::string(m.status().message()));
    }
    l.metrics = std::move(*m);
    const std::string host = config.metrics_address.substr(0, config.metrics_address.rfind(':'));
    spdlog::info("metrics on http://{}:{}/metrics", host, l.metrics->port());
  }
  l.grpc->GetHealthCheckService()->SetServingStatus(true);
  if (!config.port_file.empty()) {
    if (absl::Status s = WritePortFile(config, l); !s.ok()) {
      stop_listeners();
      return Fail(std::string(s.message()));
    }
  }
  for (const std::string& problem : RootProblems(config)) {
    spdlog::warn("{}; requests under it get NOT_FOUND until it exists", problem);
  }
  spdlog::info("serving on {}{} roots={} cache_budget={}B io_threads={}", config.socket,
               config.tcp_address.empty() ? "" : " and tcp " + config.tcp_address,
               absl::StrJoin(config.roots, ","), config.cache_budget, config.io_threads);
  // systemd Type=notify (a no-op without NOTIFY_SOCKET): ready once every listener is up.
  sd_notifyf(0, "READY=1\nSTATUS=serving on %s\nMAINPID=%lu", config.socket.c_str(),
             static_cast<unsigned long>(::getpid()));

  absl::Time drain_until = absl::Now();  // set by the signal thread, read after it ends
  std::thread signals(
      [&] { HandleSignals(sigs, config, daemon, l, &drain_until); });
  l.grpc->Wait();
  signals.join();
  Finish(config, daemon, l, drain_until);
  return 0;
}

}  // namespace ckptd
