// The daemon's command line: every flag, and the config they make (flags.h).
#include "server/flags.h"

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <tuple>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "ckptd_version.h"
#include "core/base/status_macros.h"
#include "core/tools/cli_help.h"
#include "server/policy/memory_budget.h"
#include "server/pem.h"

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
ABSL_FLAG(std::string, cache_huge_pages, "",
          "auto|off: huge pages for the data cache's shared blocks (overrides the config)");
ABSL_FLAG(std::string, cache_laid_out_copies, "",
          "true|false: gather a rank's cached bytes taken in pieces into one laid-out copy for "
          "its next load (overrides the config)");
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
ABSL_FLAG(bool, peer_unkeyed_jobs, false,
          "multi-node: accept jobs whose ranks sent no job_key (any node of the peer set that "
          "knows a job's id could then join it and be served its bytes)");
ABSL_FLAG(std::string, nccl_connect_timeout, "", "multi-node GPU: e.g. 5s (overrides the config)");
ABSL_FLAG(bool, testing_corrupt_served, false,
          "testing only: flip a byte of every read served to peers (fault injection)");
ABSL_FLAG(std::string, io_request_size, "", "largest single read, e.g. 64MiB (overrides the config)");
ABSL_FLAG(std::string, peer_reader_min_bytes, "",
          "multi-node: bytes read and sent per reader of reads several nodes need, e.g. 64MiB; 0: "
          "every node reads (overrides the config)");
ABSL_FLAG(int, testing_delay_part_ms, 0,
          "testing only: pause before executing a multi-node plan part (fault injection)");
ABSL_FLAG(int, testing_delay_read_ms, 0,
          "testing only: pause before each planned read of a load job (keeps a job in flight)");
ABSL_FLAG(int, testing_delay_persist_ms, 0,
          "testing only: pause before each file an asynchronous save persists");
ABSL_FLAG(int64_t, testing_peer_lane_bytes, 0,
          "testing only: a peer's reads come in one stream per this many bytes (0: 64 MiB)");
ABSL_FLAG(int, testing_fd_token_ttl_ms, 0,
          "testing only: fd tokens expire after this instead of barrier_timeout + 1 minute");

namespace ckptd {
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

// Lowers the budgets to fit config->memory_limit ("auto": the cgroup's);
// `notes` says what was changed.
absl::Status FitBudgets(DaemonConfig* config, std::vector<std::string>* notes) {
  std::optional<MemoryLimit> limit;
  if (config->memory_limit == "auto") {
    limit = ProcessMemoryLimit();
  } else if (config->memory_limit != "off") {
    auto b = ParseBytes(config->memory_limit);
    if (!b.ok()) return absl::InvalidArgumentError(absl::StrCat("memory_limit: ", b.status().message()));
    limit = MemoryLimit{*b, "memory_limit"};
  }
  if (!limit) return absl::OkStatus();
  return FitMemoryBudgets(config, *limit, notes);
}

}  // namespace


absl::Status ParseDaemonFlags(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  {
    absl::FlagsUsageConfig usage;  // --version: VERSION's version and API level
    usage.version_string = [] {
      return absl::StrCat("ckptd ", kVersion, " (api ckptd.v1, level ", kApiLevel,
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
  bool full = false;
  if (ckpt::AsksForHelp(std::vector<std::string>(args.begin() + 1, args.end()), &full)) {
    ckpt::PrintHelp(std::cout, kUsage, {"server/flags.cc"}, full);
    std::exit(0);
  }
  std::vector<char*> cargs;
  for (auto& a : args) cargs.push_back(a.data());
  std::vector<char*> rest = absl::ParseCommandLine(static_cast<int>(cargs.size()), cargs.data());
  if (rest.size() > 1) {
    return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", rest[1], "'"));
  }
  return absl::OkStatus();
}

std::optional<std::string> CheckConfigFile() {
  const std::string file = absl::GetFlag(FLAGS_check_config);
  if (file.empty()) return std::nullopt;
  return file;
}

absl::Status CheckConfig(const std::string& file) {
  auto c = LoadConfigFile(file);
  absl::Status s = c.ok() ? ValidateConfig(*c) : c.status();
  if (!s.ok()) return s;
  if (std::vector<std::string> roots = RootProblems(*c); !roots.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(file, ": ", absl::StrJoin(roots, "; ")));
  }
  std::vector<std::string> notes;
  if (absl::Status f = FitBudgets(&*c, &notes); !f.ok()) return f;
  for (const std::string& n : notes) std::cout << n << "\n";
  // The TLS files must be readable PEM now, not only at start.
  const std::pair<const std::string*, const char*> pems[] = {
      {&c->tcp_tls_cert, "tcp_tls_cert"},   {&c->tcp_tls_key, "tcp_tls_key"},
      {&c->tcp_tls_ca, "tcp_tls_ca"},       {&c->peer_tls_cert, "peer_tls_cert"},
      {&c->peer_tls_key, "peer_tls_key"},   {&c->peer_tls_ca, "peer_tls_ca"}};
  for (const auto& [path, key] : pems) {
    if (path->empty()) continue;
    auto pem = ReadPem(*path, key);
    if (!pem.ok()) return pem.status();
  }
  std::cout << file << ": OK\n";
  return absl::OkStatus();
}

bool PrintConfigRequested() { return absl::GetFlag(FLAGS_print_config); }

absl::StatusOr<StartupConfig> ConfigFromFlags() {
  StartupConfig out;
  DaemonConfig& config = out.config;
  if (!absl::GetFlag(FLAGS_config).empty()) {
    auto c = LoadConfigFile(absl::GetFlag(FLAGS_config));
    if (!c.ok()) return c.status();
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
    auto b = ParseBytes(absl::GetFlag(FLAGS_cache_budget));
    if (!b.ok()) return absl::InvalidArgumentError(absl::StrCat("--cache_budget: ", b.status().message()));
    config.cache_budget = *b;
    config.set_keys.insert("cache_budget");
  }
  if (!absl::GetFlag(FLAGS_save_buffer).empty()) {
    auto b = ParseBytes(absl::GetFlag(FLAGS_save_buffer));
    if (!b.ok()) return absl::InvalidArgumentError(absl::StrCat("--save_buffer: ", b.status().message()));
    config.save_buffer = *b;
    config.set_keys.insert("save_buffer");
  }
  if (!absl::GetFlag(FLAGS_memory_limit).empty()) {
    config.memory_limit = absl::GetFlag(FLAGS_memory_limit);
    config.set_keys.insert("memory_limit");
  }
  if (absl::GetFlag(FLAGS_io_threads) > 0) config.io_threads = absl::GetFlag(FLAGS_io_threads);
  if (!absl::GetFlag(FLAGS_direct_io).empty()) config.direct_io = absl::GetFlag(FLAGS_direct_io);
  if (!absl::GetFlag(FLAGS_cache_huge_pages).empty()) {
    config.cache_huge_pages = absl::GetFlag(FLAGS_cache_huge_pages);
  }
  if (const std::string v = absl::GetFlag(FLAGS_cache_laid_out_copies); !v.empty()) {
    if (v != "true" && v != "false") {
      return absl::InvalidArgumentError(
          absl::StrCat("--cache_laid_out_copies: must be true or false, not '", v, "'"));
    }
    config.cache_laid_out_copies = v == "true";
  }
  if (!absl::GetFlag(FLAGS_barrier_timeout).empty()) {
    auto d = ParseDuration(absl::GetFlag(FLAGS_barrier_timeout));
    if (!d.ok()) return absl::InvalidArgumentError(absl::StrCat("--barrier_timeout: ", d.status().message()));
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
  for (const auto& [flag, name, field] :
       {std::make_tuple(&FLAGS_io_request_size, "io_request_size", &config.io_request_size),
        std::make_tuple(&FLAGS_peer_reader_min_bytes, "peer_reader_min_bytes",
                        &config.peer_reader_min_bytes)}) {
    if (absl::GetFlag(*flag).empty()) continue;
    auto b = ParseBytes(absl::GetFlag(*flag));
    if (!b.ok()) return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", b.status().message()));
    *field = *b;
  }
  config.testing_delay_part = absl::Milliseconds(absl::GetFlag(FLAGS_testing_delay_part_ms));
  config.testing_delay_read = absl::Milliseconds(absl::GetFlag(FLAGS_testing_delay_read_ms));
  config.testing_delay_persist =
      absl::Milliseconds(absl::GetFlag(FLAGS_testing_delay_persist_ms));
  config.testing_fd_token_ttl = absl::Milliseconds(absl::GetFlag(FLAGS_testing_fd_token_ttl_ms));
  config.testing_corrupt_served = absl::GetFlag(FLAGS_testing_corrupt_served);
  config.testing_peer_lane_bytes =
      static_cast<uint64_t>(std::max<int64_t>(0, absl::GetFlag(FLAGS_testing_peer_lane_bytes)));
  if (!absl::GetFlag(FLAGS_peer_tls_cert).empty()) config.peer_tls_cert = absl::GetFlag(FLAGS_peer_tls_cert);
  if (!absl::GetFlag(FLAGS_peer_tls_key).empty()) config.peer_tls_key = absl::GetFlag(FLAGS_peer_tls_key);
  if (!absl::GetFlag(FLAGS_peer_tls_ca).empty()) config.peer_tls_ca = absl::GetFlag(FLAGS_peer_tls_ca);
  if (absl::GetFlag(FLAGS_peer_insecure)) config.peer_insecure = true;
  if (absl::GetFlag(FLAGS_peer_unkeyed_jobs)) config.peer_unkeyed_jobs = true;
  if (!absl::GetFlag(FLAGS_nccl_connect_timeout).empty()) {
    auto d = ParseDuration(absl::GetFlag(FLAGS_nccl_connect_timeout));
    if (!d.ok()) return absl::InvalidArgumentError(absl::StrCat("--nccl_connect_timeout: ", d.status().message()));
    config.nccl_connect_timeout = *d;
  }
  if (!absl::GetFlag(FLAGS_peer_timeout).empty()) {
    auto d = ParseDuration(absl::GetFlag(FLAGS_peer_timeout));
    if (!d.ok()) return absl::InvalidArgumentError(absl::StrCat("--peer_timeout: ", d.status().message()));
    config.peer_timeout = *d;
  }
  if (absl::Status s = ValidateConfig(config); !s.ok()) return s;
  CKPT_RETURN_IF_ERROR(FitBudgets(&config, &out.budget_notes));
  return out;
}

}  // namespace ckptd
