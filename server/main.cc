// ckptd — the per-node checkpoint daemon.
//
//   ckptd --socket /run/ckptd/ckptd.sock --root /data/checkpoints
//   ckptd --config /etc/ckptd/ckptd.yaml
//   ckptd --check-config /etc/ckptd/ckptd.yaml
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <iostream>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/security/server_credentials.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <systemd/sd-daemon.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "ckptd_version.h"
#include "core/file.h"
#include "config/config.h"
#include "server/daemon.h"
#include "server/memory_budget.h"
#include "server/metrics.h"
#include "server/peer_server.h"
#include "server/peer_service.h"
#include "server/pem.h"
#include "server/service.h"
#include "server/uds_listener.h"

ABSL_FLAG(std::string, config, "", "YAML config file (see config/ckptd.yaml)");
ABSL_FLAG(std::string, check_config, "", "validate a config file and exit");
ABSL_FLAG(std::string, socket, "", "Unix socket for the gRPC API (overrides the config)");
ABSL_FLAG(std::vector<std::string>, root, {},
          "checkpoint root(s) served, comma-separated (overrides the config)");
ABSL_FLAG(std::string, tcp, "",
          "also listen on host:port (overrides the config; needs mutual TLS or --insecure_tcp; "
          "port 0: the kernel picks one, see --port-file)");
ABSL_FLAG(std::string, tcp_tls_cert, "", "PEM certificate of this daemon for --tcp");
ABSL_FLAG(std::string, tcp_tls_key, "", "PEM private key for --tcp");
ABSL_FLAG(std::string, tcp_tls_ca, "", "PEM CA that signs the client certificates --tcp requires");
ABSL_FLAG(bool, insecure_tcp, false, "serve --tcp without TLS (anyone who can reach it acts as tcp_uid)");
ABSL_FLAG(std::string, cache_budget, "", "data cache budget, e.g. 8GiB (overrides the config)");
ABSL_FLAG(std::string, save_buffer, "",
          "bytes of asynchronous saves not yet durable the daemon may hold, e.g. 8GiB (overrides "
          "the config)");
ABSL_FLAG(std::string, memory_limit, "",
          "the memory the budgets must fit: auto (the cgroup's limit or the machine's memory), off, "
          "or a size (overrides the config)");
ABSL_FLAG(int, io_threads, 0, "I/O threads (overrides the config)");
ABSL_FLAG(std::string, direct_io, "", "never|auto|always: O_DIRECT reads (overrides the config)");
ABSL_FLAG(std::string, barrier_timeout, "", "e.g. 120s (overrides the config)");
ABSL_FLAG(std::string, log_level, "", "trace|debug|info|warn|error (overrides the config)");
ABSL_FLAG(std::string, log_format, "", "text|json (overrides the config)");
ABSL_FLAG(std::string, metrics_address, "",
          "serve Prometheus metrics on host:port /metrics (overrides the config)");
ABSL_FLAG(std::string, port_file, "",
          "write the ports bound (JSON {\"tcp\":N,\"peer\":N,\"peer_address\":\"host:N\","
          "\"metrics\":N}) to this file once every listener is up (overrides the config)");
ABSL_FLAG(bool, print_config, false, "print the effective config and exit");
ABSL_FLAG(std::string, peer_listen, "",
          "multi-node: this daemon's peer address host:port (port 0: the kernel picks one), or "
          "unix:/abs/path (daemons on one machine)");
ABSL_FLAG(std::vector<std::string>, peers, {},
          "multi-node: the other daemons, host:port or unix:/abs/path,...");
ABSL_FLAG(std::string, peer_dns, "", "multi-node: DNS name:port resolving to all daemons");
ABSL_FLAG(std::string, peer_timeout, "", "multi-node: e.g. 60s (overrides the config)");
ABSL_FLAG(std::string, peer_tls_cert, "", "multi-node: PEM certificate of this node (its names are its identity)");
ABSL_FLAG(std::string, peer_tls_key, "", "multi-node: PEM private key of --peer-tls-cert");
ABSL_FLAG(std::string, peer_tls_ca, "", "multi-node: PEM CA that signs every peer's certificate");
ABSL_FLAG(bool, peer_insecure, false,
          "multi-node: plaintext peer service on a non-loopback --peer-listen (anyone who reaches it "
          "can join jobs and read or alter their bytes)");
ABSL_FLAG(std::string, nccl_connect_timeout, "", "multi-node GPU: e.g. 5s (overrides the config)");
ABSL_FLAG(bool, testing_corrupt_served, false,
          "testing only: flip a byte of every read served to peers (fault injection)");
ABSL_FLAG(std::string, io_request_size, "", "largest single read, e.g. 64MiB (overrides the config)");
ABSL_FLAG(int, testing_delay_part_ms, 0,
          "testing only: pause before executing a multi-node plan part (fault injection)");
ABSL_FLAG(int, testing_delay_read_ms, 0,
          "testing only: pause before each planned read of a load job (keeps a job in flight)");
ABSL_FLAG(int, testing_delay_persist_ms, 0,
          "testing only: pause before each file an asynchronous save persists");
ABSL_FLAG(int, testing_fd_token_ttl_ms, 0,
          "testing only: fd tokens expire after this instead of barrier_timeout + 1 minute");

namespace {

constexpr char kUsage[] = R"(ckptd — per-node checkpoint loading and resharding daemon

Usage:
  ckptd --socket PATH --root DIR[,DIR...]      start with defaults
  ckptd --config FILE [overriding flags]       start from a YAML config
  ckptd --check-config FILE                    validate a config and exit
  ckptd ... --print-config                     print the effective config and exit

Training ranks connect with the C++/Python clients or `ckptctl load --daemon PATH`.
Callers are identified by the kernel (uid/groups of the Unix-socket peer) and
checked against each root's access rule (docs/security.md). --tcp needs
mutual TLS (--tcp-tls-cert/--tcp-tls-key/--tcp-tls-ca) or --insecure-tcp.
The peer service (--peer-listen) needs mutual TLS (--peer-tls-cert/--peer-tls-key/
--peer-tls-ca) unless it listens on loopback (or a unix:/path socket, mode 0600)
or --peer-insecure is given.
Port 0 in --tcp, --peer-listen or --metrics-address: the kernel picks a free port;
each listener logs "<tcp|peer> service listening on HOST:PORT" (metrics:
"metrics on http://HOST:PORT/metrics") and --port-file PATH gets them all as
JSON, written atomically once every listener is up (docs/configuration.md).
SIGTERM/SIGINT: stop accepting, drain running loads and asynchronous saves
(drain_timeout), exit.
SIGHUP: reload the peer TLS files without dropping running jobs.)";

int Fail(const std::string& msg) {
  std::cerr << "ckptd: error: " << msg << "\n";
  return 1;
}

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

// Loads that ended so far, either way (for the drain's linger).
int64_t LoadsEnded(ckptd::Daemon& daemon) {
  const auto st = daemon.Status(ckptd::Caller{});
  return static_cast<int64_t>(st.loads_succeeded() + st.loads_failed());
}

}  // namespace

// Fits the budgets to the memory limit (config.memory_limit); `notes` says
// what was changed.
absl::Status FitBudgets(ckptd::DaemonConfig* config, std::vector<std::string>* notes) {
  std::optional<ckptd::MemoryLimit> limit;
  if (config->memory_limit == "auto") {
    limit = ckptd::ProcessMemoryLimit();
  } else if (config->memory_limit != "off") {
    auto b = ckptd::ParseBytes(config->memory_limit);
    if (!b.ok()) return absl::InvalidArgumentError(absl::StrCat("memory_limit: ", b.status().message()));
    limit = ckptd::MemoryLimit{*b, "memory_limit"};
  }
  if (!limit) return absl::OkStatus();
  return ckptd::FitMemoryBudgets(config, *limit, notes);
}

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  {
    absl::FlagsUsageConfig usage;  // --version: VERSION's version and API level
    usage.version_string = [] {
      return absl::StrCat("ckptd ", ckptd::kVersion, " (api ckptd.v1, level ", ckptd::kApiLevel,
                          ")\n");
    };
    absl::SetFlagsUsageConfig(usage);
  }
  // Accept dashed flag names (--check-config) as well as underscores.
  std::vector<std::string> args;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (i > 0 && a.rfind("--", 0) == 0) {
      size_t eq = a.find('=');
      for (size_t k = 2; k < (eq == std::string::npos ? a.size() : eq); ++k) {
        if (a[k] == '-') a[k] = '_';
      }
    }
    args.push_back(a);
  }
  std::vector<char*> cargs;
  for (auto& a : args) cargs.push_back(a.data());
  std::vector<char*> rest = absl::ParseCommandLine(static_cast<int>(cargs.size()), cargs.data());
  if (rest.size() > 1) return Fail(absl::StrCat("unexpected argument '", rest[1], "'"));

  if (!absl::GetFlag(FLAGS_check_config).empty()) {
    auto c = ckptd::LoadConfigFile(absl::GetFlag(FLAGS_check_config));
    absl::Status s = c.ok() ? ckptd::ValidateConfig(*c) : c.status();
    if (!s.ok()) return Fail(std::string(s.message()));
    std::vector<std::string> notes;
    if (absl::Status f = FitBudgets(&*c, &notes); !f.ok()) return Fail(std::string(f.message()));
    for (const std::string& n : notes) std::cout << n << "\n";
    // The TLS files must be readable PEM now, not only at start.
    const std::pair<const std::string*, const char*> pems[] = {
        {&c->tcp_tls_cert, "tcp_tls_cert"},   {&c->tcp_tls_key, "tcp_tls_key"},
        {&c->tcp_tls_ca, "tcp_tls_ca"},       {&c->peer_tls_cert, "peer_tls_cert"},
        {&c->peer_tls_key, "peer_tls_key"},   {&c->peer_tls_ca, "peer_tls_ca"}};
    for (const auto& [path, key] : pems) {
      if (path->empty()) continue;
      auto pem = ckptd::ReadPem(*path, key);
      if (!pem.ok()) return Fail(std::string(pem.status().message()));
    }
    std::cout << absl::GetFlag(FLAGS_check_config) << ": OK\n";
    return 0;
  }

  ckptd::DaemonConfig config;
  if (!absl::GetFlag(FLAGS_config).empty()) {
    auto c = ckptd::LoadConfigFile(absl::GetFlag(FLAGS_config));
    if (!c.ok()) return Fail(std::string(c.status().message()));
    config = *c;
  }
  if (!absl::GetFlag(FLAGS_socket).empty()) config.socket = absl::GetFlag(FLAGS_socket);
  if (!absl::GetFlag(FLAGS_root).empty()) config.roots = absl::GetFlag(FLAGS_root);
  if (!absl::GetFlag(FLAGS_tcp).empty()) config.tcp_address = absl::GetFlag(FLAGS_tcp);
  if (!absl::GetFlag(FLAGS_tcp_tls_cert).empty()) config.tcp_tls_cert = absl::GetFlag(FLAGS_tcp_tls_cert);
  if (!absl::GetFlag(FLAGS_tcp_tls_key).empty()) config.tcp_tls_key = absl::GetFlag(FLAGS_tcp_tls_key);
  if (!absl::GetFlag(FLAGS_tcp_tls_ca).empty()) config.tcp_tls_ca = absl::GetFlag(FLAGS_tcp_tls_ca);
  if (absl::GetFlag(FLAGS_insecure_tcp)) config.insecure_tcp = true;
  if (!absl::GetFlag(FLAGS_cache_budget).empty()) {
    auto b = ckptd::ParseBytes(absl::GetFlag(FLAGS_cache_budget));
    if (!b.ok()) return Fail(absl::StrCat("--cache_budget: ", b.status().message()));
    config.cache_budget = *b;
    config.set_keys.insert("cache_budget");
  }
  if (!absl::GetFlag(FLAGS_save_buffer).empty()) {
    auto b = ckptd::ParseBytes(absl::GetFlag(FLAGS_save_buffer));
    if (!b.ok()) return Fail(absl::StrCat("--save_buffer: ", b.status().message()));
    config.save_buffer = *b;
    config.set_keys.insert("save_buffer");
  }
  if (!absl::GetFlag(FLAGS_memory_limit).empty()) {
    config.memory_limit = absl::GetFlag(FLAGS_memory_limit);
    config.set_keys.insert("memory_limit");
  }
  if (absl::GetFlag(FLAGS_io_threads) > 0) config.io_threads = absl::GetFlag(FLAGS_io_threads);
  if (!absl::GetFlag(FLAGS_direct_io).empty()) config.direct_io = absl::GetFlag(FLAGS_direct_io);
  if (!absl::GetFlag(FLAGS_barrier_timeout).empty()) {
    auto d = ckptd::ParseDuration(absl::GetFlag(FLAGS_barrier_timeout));
    if (!d.ok()) return Fail(absl::StrCat("--barrier_timeout: ", d.status().message()));
    config.barrier_timeout = *d;
  }
  if (!absl::GetFlag(FLAGS_log_level).empty()) config.log_level = absl::GetFlag(FLAGS_log_level);
  if (!absl::GetFlag(FLAGS_log_format).empty()) config.log_format = absl::GetFlag(FLAGS_log_format);
  if (!absl::GetFlag(FLAGS_metrics_address).empty()) {
    config.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  }
  if (!absl::GetFlag(FLAGS_port_file).empty()) config.port_file = absl::GetFlag(FLAGS_port_file);
  if (!absl::GetFlag(FLAGS_peer_listen).empty()) config.peer_listen = absl::GetFlag(FLAGS_peer_listen);
  if (!absl::GetFlag(FLAGS_peers).empty()) config.peers = absl::GetFlag(FLAGS_peers);
  if (!absl::GetFlag(FLAGS_peer_dns).empty()) config.peer_dns = absl::GetFlag(FLAGS_peer_dns);
  if (!absl::GetFlag(FLAGS_io_request_size).empty()) {
    auto b = ckptd::ParseBytes(absl::GetFlag(FLAGS_io_request_size));
    if (!b.ok()) return Fail(absl::StrCat("--io_request_size: ", b.status().message()));
    config.io_request_size = *b;
  }
  config.testing_delay_part = absl::Milliseconds(absl::GetFlag(FLAGS_testing_delay_part_ms));
  config.testing_delay_read = absl::Milliseconds(absl::GetFlag(FLAGS_testing_delay_read_ms));
  config.testing_delay_persist =
      absl::Milliseconds(absl::GetFlag(FLAGS_testing_delay_persist_ms));
  config.testing_fd_token_ttl = absl::Milliseconds(absl::GetFlag(FLAGS_testing_fd_token_ttl_ms));
  config.testing_corrupt_served = absl::GetFlag(FLAGS_testing_corrupt_served);
  if (!absl::GetFlag(FLAGS_peer_tls_cert).empty()) config.peer_tls_cert = absl::GetFlag(FLAGS_peer_tls_cert);
  if (!absl::GetFlag(FLAGS_peer_tls_key).empty()) config.peer_tls_key = absl::GetFlag(FLAGS_peer_tls_key);
  if (!absl::GetFlag(FLAGS_peer_tls_ca).empty()) config.peer_tls_ca = absl::GetFlag(FLAGS_peer_tls_ca);
  if (absl::GetFlag(FLAGS_peer_insecure)) config.peer_insecure = true;
  if (!absl::GetFlag(FLAGS_nccl_connect_timeout).empty()) {
    auto d = ckptd::ParseDuration(absl::GetFlag(FLAGS_nccl_connect_timeout));
    if (!d.ok()) return Fail(absl::StrCat("--nccl_connect_timeout: ", d.status().message()));
    config.nccl_connect_timeout = *d;
  }
  if (!absl::GetFlag(FLAGS_peer_timeout).empty()) {
    auto d = ckptd::ParseDuration(absl::GetFlag(FLAGS_peer_timeout));
    if (!d.ok()) return Fail(absl::StrCat("--peer_timeout: ", d.status().message()));
    config.peer_timeout = *d;
  }
  if (absl::Status s = ckptd::ValidateConfig(config); !s.ok()) return Fail(std::string(s.message()));
  std::vector<std::string> budget_notes;
  if (absl::Status s = FitBudgets(&config, &budget_notes); !s.ok()) {
    return Fail(std::string(s.message()));
  }
  if (absl::GetFlag(FLAGS_print_config)) {
    std::cout << ckptd::ConfigToYaml(config);
    return 0;
  }
  ckptd::SetUpLogging(config.log_level, config.log_format);
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
  ckptd::Daemon daemon(config);
  if (!config.socket.empty()) {
    if (absl::Status s = ClaimSocket(config.socket); !s.ok()) return Fail(std::string(s.message()));
  }
  if (ckptd::IsUnixAddress(config.peer_listen)) {
    // gRPC would remove whatever is at the path: refuse a live daemon's socket.
    if (absl::Status s = ClaimSocket(config.peer_listen.substr(5)); !s.ok()) {
      return Fail(absl::StrCat("peer_listen: ", s.message()));
    }
  }
  if (absl::Status s = daemon.Start(); !s.ok()) return Fail(std::string(s.message()));
  grpc::EnableDefaultHealthCheckService(true);  // every server below has grpc.health.v1
  // The peer service: TCP, separate from the client API; up before the
  // client socket appears, so a node whose socket exists can be joined.
  ckptd::PeerService peer_service(&daemon);
  std::unique_ptr<ckptd::PeerServer> peer_server;
  if (!config.peer_listen.empty()) {
    auto ps = ckptd::PeerServer::Start(&daemon, &peer_service);
    if (!ps.ok()) return Fail(std::string(ps.status().message()));
    peer_server = std::move(*ps);
    // "host:0" is now "host:N": this node's address everywhere from here on.
    config.peer_listen = peer_server->bound_address();
    daemon.SetPeerListen(config.peer_listen);
    if (config.peer_tls_cert.empty() && !ckptd::IsLoopbackAddress(config.peer_listen)) {
      spdlog::warn("peer service on {} WITHOUT TLS (peer_insecure: true): whoever reaches it can "
                   "join jobs and read or alter their bytes", config.peer_listen);
    }
    spdlog::info("peer service listening on {} (peers: {}{}; {})", config.peer_listen,
                 absl::StrJoin(config.peers, ","),
                 config.peer_dns.empty() ? "" : " dns " + config.peer_dns,
                 config.peer_tls_cert.empty() ? "plaintext" : "mutual TLS");
  }
  std::unique_ptr<ckptd::UdsListener> uds;
  if (!config.socket.empty()) {
    auto l = ckptd::UdsListener::Listen(config.socket, config.socket_mode,
                                        config.limits.max_connections);
    if (!l.ok()) return Fail(std::string(l.status().message()));
    uds = std::move(*l);
  }
  // The socket file this daemon made: removed at exit only if it is still
  // this one (the listener closes at SIGTERM, so a successor may have
  // claimed the path while this daemon drained).
  struct stat own_socket {};
  const bool have_socket = uds != nullptr && ::stat(config.socket.c_str(), &own_socket) == 0;
  const uid_t tcp_uid = config.tcp_uid;
  ckptd::CkptdService service(
      &daemon, [&uds, tcp_uid](const std::string& peer) -> std::optional<ckptd::Caller> {
        if (absl::StartsWith(peer, "fd:")) {
          return uds ? uds->Lookup(peer) : std::nullopt;
        }
        if (absl::StartsWith(peer, "ipv4:") || absl::StartsWith(peer, "ipv6:")) {
          ckptd::Caller c;
          c.via = ckptd::Caller::Via::kTcp;
          c.uid = tcp_uid;
          c.gid = tcp_uid;
          return c;
        }
        return std::nullopt;
      });
  grpc::ServerBuilder builder;
  int tcp_port = 0;
  if (!config.tcp_address.empty()) {
    std::shared_ptr<grpc::ServerCredentials> creds;
    if (!config.tcp_tls_cert.empty()) {
      auto cert = ckptd::ReadPem(config.tcp_tls_cert, "tcp_tls_cert");
      auto key = ckptd::ReadPem(config.tcp_tls_key, "tcp_tls_key");
      auto ca = ckptd::ReadPem(config.tcp_tls_ca, "tcp_tls_ca");
      for (const auto* r : {&cert, &key, &ca}) {
        if (!r->ok()) return Fail(std::string(r->status().message()));
      }
      grpc::SslServerCredentialsOptions o(
          GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
      o.pem_root_certs = *ca;
      o.pem_key_cert_pairs.push_back({*key, *cert});
      creds = grpc::SslServerCredentials(o);
    } else {
      spdlog::warn("tcp_address {} is served WITHOUT TLS (insecure_tcp: true): anyone who can "
                   "reach it acts as uid {}", config.tcp_address, config.tcp_uid);
      creds = grpc::InsecureServerCredentials();
    }
    builder.AddListeningPort(config.tcp_address, creds, &tcp_port);
  }
  const int max_msg = static_cast<int>(std::min<uint64_t>(config.limits.max_message_bytes, INT32_MAX));
  builder.SetMaxReceiveMessageSize(max_msg);
  builder.SetMaxSendMessageSize(max_msg);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                             static_cast<int>(std::min<uint64_t>(config.limits.max_concurrent_streams, INT32_MAX)));
  grpc::ResourceQuota quota("ckptd");
  quota.SetMaxThreads(static_cast<int>(std::min<uint64_t>(config.limits.max_threads, INT32_MAX)));
  builder.SetResourceQuota(quota);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || (!config.tcp_address.empty() && tcp_port <= 0)) {
    if (server) server->Shutdown(std::chrono::system_clock::now());
    return Fail(absl::StrCat("cannot start the gRPC server",
                             config.tcp_address.empty() ? "" : " on " + config.tcp_address));
  }
  if (!config.tcp_address.empty()) {
    // "host:0" is now "host:N".
    config.tcp_address = absl::StrCat(
        config.tcp_address.substr(0, config.tcp_address.rfind(':')), ":", tcp_port);
    spdlog::info("tcp service listening on {}", config.tcp_address);
  }
  if (uds) uds->Serve(server.get());
  std::unique_ptr<ckptd::MetricsServer> metrics;
  if (!config.metrics_address.empty()) {
    auto m = ckptd::MetricsServer::Start(config.metrics_address, [&daemon] { return daemon.Status(); });
    if (!m.ok()) {
      server->Shutdown();
      if (peer_server) peer_server->Shutdown(std::chrono::system_clock::now());
      return Fail(std::string(m.status().message()));
    }
    metrics = std::move(*m);
    const std::string host = config.metrics_address.substr(0, config.metrics_address.rfind(':'));
    spdlog::info("metrics on http://{}:{}/metrics", host, metrics->port());
  }
  server->GetHealthCheckService()->SetServingStatus(true);
  if (!config.port_file.empty()) {
    nlohmann::ordered_json ports = nlohmann::ordered_json::object();
    if (!config.tcp_address.empty()) ports["tcp"] = tcp_port;
    if (peer_server) {
      const int peer_port = ckptd::PortOf(config.peer_listen);
      if (peer_port > 0) ports["peer"] = peer_port;
      ports["peer_address"] = config.peer_listen;
    }
    if (metrics) ports["metrics"] = metrics->port();
    const std::string json =
        ports.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
    if (absl::Status s = ckpt::WriteFileAtomic(config.port_file, json); !s.ok()) {
      server->Shutdown(std::chrono::system_clock::now());
      if (peer_server) peer_server->Shutdown(std::chrono::system_clock::now());
      return Fail(absl::StrCat("port_file: ", s.message()));
    }
  }
  spdlog::info("serving on {}{} roots={} cache_budget={}B io_threads={}", config.socket,
               config.tcp_address.empty() ? "" : " and tcp " + config.tcp_address,
               absl::StrJoin(config.roots, ","), config.cache_budget, config.io_threads);
  // systemd Type=notify (a no-op without NOTIFY_SOCKET): ready once every listener is up.
  sd_notifyf(0, "READY=1\nSTATUS=serving on %s\nMAINPID=%lu", config.socket.c_str(),
             static_cast<unsigned long>(::getpid()));

  std::atomic<int64_t> loads_at_drain{-1};
  absl::Time drain_until = absl::Now();  // set by the signal thread, read after it ends
  auto draining_loads_done = [&] {
    return loads_at_drain >= 0 && LoadsEnded(daemon) != loads_at_drain;
  };
  std::thread signals([&] {
    int sig = 0;
    while (sigwait(&sigs, &sig) == 0 && sig == SIGHUP) {
      auto files = daemon.ReadPeerTls();
      absl::Status s = files.status();
      if (s.ok() && peer_server && !config.peer_tls_cert.empty()) s = peer_server->Rotate(*files);
      if (s.ok()) {
        spdlog::info("SIGHUP: peer TLS files reloaded");
      } else {
        spdlog::error("SIGHUP: peer TLS not reloaded, the old certificate stays: {}", std::string(s.message()));
      }
    }
    spdlog::info("signal {}: draining running loads (up to {})", sig,
                 absl::FormatDuration(config.drain_timeout));
    loads_at_drain = LoadsEnded(daemon);
    drain_until = absl::Now() + config.drain_timeout;
    sd_notify(0, "STOPPING=1\nSTATUS=draining running loads");
    server->GetHealthCheckService()->SetServingStatus(false);
    if (uds) uds->Stop();  // no new connections; open ones drain
    // grpc.health.v1 on the peer port says NOT_SERVING while draining.
    if (peer_server) peer_server->SetServing(false);
    const auto drain = std::chrono::system_clock::now() +
                       std::chrono::milliseconds(absl::ToInt64Milliseconds(config.drain_timeout));
    // When the drain runs out, the loads still waiting or running fail with
    // a clear UNAVAILABLE (their handlers return it within kDrainGrace) before
    // gRPC cancels whatever call is left; without this a running job would
    // read on to its end while its ranks got a bare CANCELLED.
    constexpr auto kDrainGrace = std::chrono::seconds(2);
    absl::Mutex drain_mu;
    bool drained = false;
    std::thread expiry([&] {
      absl::MutexLock lock(&drain_mu);
      drain_mu.AwaitWithDeadline(absl::Condition(&drained), absl::FromChrono(drain));
      if (drained) return;
      const std::vector<std::string> cut = daemon.AbortLoads(absl::StrCat(
          "ckptd is shutting down: drain_timeout ", absl::FormatDuration(config.drain_timeout),
          " ran out before the load finished (retry with a new job_id once ckptd is back)"));
      if (!cut.empty()) {
        spdlog::warn("drain_timeout {} ran out: failed {} load job(s) still waiting or running: {}",
                     absl::FormatDuration(config.drain_timeout), cut.size(),
                     absl::StrJoin(cut, ","));
      }
    });
    server->Shutdown(drain + kDrainGrace);
    {
      absl::MutexLock lock(&drain_mu);
      drained = true;
    }
    expiry.join();
    if (peer_server) peer_server->Shutdown(drain);
  });
  server->Wait();
  signals.join();
  // Loads that finished during the drain: their clients may still be
  // reading the final result and status. The connections stay open a
  // moment (gRPC has told the clients to go away), so no client writes into
  // a closed socket and loses what it had not read yet.
  if (draining_loads_done()) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  if (uds) uds->Stop();
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
  metrics.reset();
  daemon.Stop();
  struct stat now_socket {};
  if (have_socket && ::stat(config.socket.c_str(), &now_socket) == 0 &&
      now_socket.st_ino == own_socket.st_ino && now_socket.st_dev == own_socket.st_dev) {
    ::unlink(config.socket.c_str());
  }
  if (!config.port_file.empty()) ::unlink(config.port_file.c_str());
  spdlog::info("stopped");
  return 0;
}
