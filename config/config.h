// ckptd's configuration: YAML (yaml-cpp) with a default for every key.
// Unknown keys and bad values are errors that name the key. See
// config/ckptd.yaml for the documented example and README "Configuration".
#ifndef CKPTD_CONFIG_CONFIG_H_
#define CKPTD_CONFIG_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace ckptd {

struct DaemonConfig {
  std::string socket = "/run/ckptd/ckptd.sock";  // gRPC Unix socket
  uint32_t socket_mode = 0660;
  std::string tcp_address;  // "host:port"; empty: no TCP listener
  std::vector<std::string> roots;  // checkpoints outside these are refused
  uint64_t cache_budget = 4ull << 30;  // bytes of checkpoint data kept in memory
  // Destination arenas the daemon lends clients (server/arena_pool.h): free
  // ones kept mapped for the next client, and all leased ones together.
  uint64_t arena_pool = 4ull << 30;
  uint64_t arena_limit = 64ull << 30;
  int io_threads = 2;
  // Reads around the page cache (O_DIRECT): never, auto (reads whose bytes
  // are not in the page cache: the data cache keeps them), always.
  std::string direct_io = "auto";
  uint64_t io_request_size = 64ull << 20;  // largest single read
  absl::Duration barrier_timeout = absl::Seconds(120);
  absl::Duration load_timeout = absl::Minutes(30);  // one job's plan + read + copy
  absl::Duration drain_timeout = absl::Seconds(30);  // SIGTERM: wait for loads
  std::string log_level = "info";  // trace debug info warn error
  std::string log_format = "text";  // text, or json (one JSON object per line)
  // Prometheus metrics over HTTP ("host:port", GET /metrics); empty: off.
  std::string metrics_address;
  // Multi-node: this daemon's peer service address ("host:port"; empty: off),
  // the other daemons (static list; may include this one), or one DNS name
  // "name:port" resolving to all of them (a Kubernetes headless service).
  std::string peer_listen;
  std::vector<std::string> peers;
  std::string peer_dns;
  absl::Duration peer_timeout = absl::Seconds(60);  // joins, transfers, completion
  // Testing only (flag --testing_delay_part_ms, not in YAML): pause between
  // receiving a multi-node plan part and executing it, so tests can kill a
  // peer mid-load deterministically.
  absl::Duration testing_delay_part = absl::ZeroDuration();
};

// Parses YAML text; `source` names it in errors.
absl::StatusOr<DaemonConfig> ParseConfig(const std::string& yaml, const std::string& source);
absl::StatusOr<DaemonConfig> LoadConfigFile(const std::string& path);

// Checks cross-key rules (roots present and absolute, threads > 0, ...).
absl::Status ValidateConfig(const DaemonConfig& config);

// "64MiB", "4GiB", "1000" (bytes), "1.5GB".
absl::StatusOr<uint64_t> ParseBytes(const std::string& text);
// "120s", "500ms", "2m", "1h", "30" (seconds).
absl::StatusOr<absl::Duration> ParseDuration(const std::string& text);

std::string ConfigToYaml(const DaemonConfig& config);

}  // namespace ckptd

#endif  // CKPTD_CONFIG_CONFIG_H_
