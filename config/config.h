// ckptd's configuration: YAML (yaml-cpp) with a default for every key.
// Unknown keys and bad values are errors that name the key. See
// config/ckptd.yaml for the documented example and docs/configuration.md.
#ifndef CKPTD_CONFIG_CONFIG_H_
#define CKPTD_CONFIG_CONFIG_H_

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace ckptd {

// Who may use a checkpoint root (docs/security.md). A caller may read
// (Inspect, Load, Prefetch) when its uid is in read_uids or save_uids, or
// one of its groups in read_gids or save_gids; it may save (Save, Evict)
// when its uid is in save_uids or a group in save_gids. Roots without an
// entry get the default rule: the daemon's own uid and root read and save,
// members of the socket file's group read.
struct RootAccess {
  std::string root;
  std::vector<uint32_t> read_uids, read_gids, save_uids, save_gids;
};

// Caps on what one request, one uid and all clients together may make the
// daemon hold (docs/security.md, "Limits"). Going over one is
// RESOURCE_EXHAUSTED or INVALID_ARGUMENT naming the limit and the value.
struct Limits {
  uint64_t max_targets_per_request = 262144;
  uint64_t max_request_bytes = 256ull << 30;   // destination bytes of one request
  uint64_t max_uid_bytes = 1ull << 40;         // destination bytes of one uid's requests in flight
  uint64_t max_stream_bytes = 4ull << 30;      // stream buffers held by the daemon, all clients
  uint64_t max_jobs_per_uid = 64;              // jobs waiting or running
  uint64_t max_ranks_per_uid = 256;            // Load/Save calls in flight (waiting or running)
  uint64_t max_ranks_per_job = 1024;           // ranks one job may have on this daemon
  absl::Duration max_barrier_timeout = absl::Hours(1);
  uint64_t max_message_bytes = 128ull << 20;   // gRPC messages, both ways
  uint64_t max_concurrent_streams = 256;       // gRPC calls per connection
  uint64_t max_connections = 4096;             // client connections on the Unix socket
  uint64_t max_threads = 2048;                 // gRPC handler threads (ResourceQuota)
  uint64_t max_metadata_bytes = 1ull << 30;    // one metadata / index / header file
  uint64_t metadata_cache_entries = 256;       // checkpoints whose metadata is kept (LRU)
};

struct S3RootConfig;

// Object storage (docs/object-storage.md): how ckptd reaches the S3 endpoint
// of its s3:// roots. Empty fields fall back to the AWS variables and files
// (AWS_ENDPOINT_URL, AWS_REGION, AWS_PROFILE, ~/.aws/credentials, ...);
// credentials themselves are never in this file.
struct S3Config {
  std::string endpoint;          // "http://rgw.local:7480"; empty: the AWS variables, else AWS
  std::string region;            // empty: AWS_REGION, the profile's, else us-east-1
  std::string profile;           // empty: AWS_PROFILE, else "default"
  std::string addressing = "auto";  // auto, path, virtual
  std::string ca_file;           // PEM CA bundle for https; empty: the system's
  uint64_t part_size = 64ull << 20;  // multipart uploads: part size (5MiB..5GiB)
  std::string spool_dir;         // where saves spool a file before its upload; empty: $TMPDIR
  uint64_t max_attempts = 6;     // per request, retries with backoff and jitter
  absl::Duration connect_timeout = absl::Seconds(5);
  absl::Duration stall_timeout = absl::Seconds(15);  // no byte moved this long: retried
  uint64_t max_bandwidth = 0;  // body bytes per second to and from the store; 0: no cap
  uint64_t max_requests = 0;   // requests in flight to the store at once; 0: no bound
  // Roots with their own endpoint, region, profile (credentials), addressing
  // or CA; what an entry leaves empty comes from the section above.
  std::vector<S3RootConfig> roots;
};

struct S3RootConfig {
  std::string root;  // one of DaemonConfig::roots
  S3Config settings;  // endpoint, region, profile, addressing, ca_file
};

// Whether a root or checkpoint path is an object-storage URL ("s3://...").
bool IsObjectStorageUrl(const std::string& path);

struct DaemonConfig {
  std::string socket = "/run/ckptd/ckptd.sock";  // gRPC Unix socket
  uint32_t socket_mode = 0660;
  std::string tcp_address;  // "host:port"; empty: no TCP listener
  // TLS for tcp_address (client certificates required and verified); without
  // them a TCP listener is refused unless insecure_tcp is set explicitly.
  std::string tcp_tls_cert, tcp_tls_key, tcp_tls_ca;
  bool insecure_tcp = false;
  uint32_t tcp_uid = 65534;  // the identity TCP callers act as (nobody)
  std::vector<uint32_t> admin_uids = {0};  // see every job; the daemon's own uid is admin too
  std::vector<RootAccess> access;
  Limits limits;
  std::vector<std::string> roots;  // checkpoints outside these are refused (paths or s3:// URLs)
  S3Config s3;
  uint64_t cache_budget = 4ull << 30;  // bytes of checkpoint data kept in memory
  // Huge pages for the data cache's shared-memory blocks (the ones clients
  // map as cache views): "auto" (asked for where the kernel's shmem THP
  // setting honours the request: shmem_enabled advise, always or
  // within_size; said at start-up either way), "off".
  std::string cache_huge_pages = "auto";
  // Whether a rank that took its cached bytes in small pieces (a tensor
  // split on another dimension than the checkpoint's) gets them gathered
  // into one contiguous laid-out copy for its next load, in cache budget
  // left free (core/cache/cache_view.h).
  bool cache_laid_out_copies = true;
  // Destination arenas the daemon lends clients (server/arena_pool.h): free
  // ones kept mapped for the next client, and all leased ones together.
  uint64_t arena_pool = 4ull << 30;
  uint64_t arena_limit = 64ull << 30;
  // Asynchronous saves (docs/saving.md): the bytes of saves handed over but
  // not yet durable that the daemon may hold, all jobs together. A save
  // beyond it waits for earlier persists to finish (back-pressure).
  uint64_t save_buffer = 8ull << 30;
  // The memory the daemon may use, which cache_budget + arena_limit +
  // save_buffer + limits.max_stream_bytes + working room must fit (server/memory_budget.h):
  // "auto" (the cgroup's memory limit, or the machine's memory when that is
  // less), "off" (no check), or a size ("8GiB").
  std::string memory_limit = "auto";
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
  // Where the daemon writes the ports it bound, once every listener is up
  // (JSON {"tcp":N,"peer":N,"peer_address":"host:N","metrics":N}, only the
  // listeners configured; written atomically, removed at exit). With port 0
  // in tcp_address, peer_listen or metrics_address the kernel picks the
  // port; this file (or the "... listening on host:port" log lines) says
  // which. Empty: no file.
  std::string port_file;
  // Multi-node: this daemon's peer service address ("host:port"; empty: off),
  // the other daemons (static list; may include this one), or one DNS name
  // "name:port" resolving to all of them (a Kubernetes headless service).
  // peer_listen may be "host:0" (the bound port becomes this node's address;
  // not with peer_dns) or "unix:/abs/path" (daemons on one machine: a
  // socket file of mode 0600, plaintext, no peer_dns / peer TLS); `peers`
  // entries name real ports (no port 0) or "unix:/abs/path".
  std::string peer_listen;
  std::vector<std::string> peers;
  std::string peer_dns;
  absl::Duration peer_timeout = absl::Seconds(60);  // joins, transfers, completion
  // Mutual TLS on the peer plane (docs/security.md): this node's certificate
  // and key (PEM) and the CA that signs every peer's. A peer's identity is the
  // names (DNS/IP SANs) of its certificate. Plaintext only on a loopback
  // peer_listen or with peer_insecure: true.
  std::string peer_tls_cert;
  std::string peer_tls_key;
  std::string peer_tls_ca;
  bool peer_insecure = false;
  // Multi-node jobs whose ranks sent no job_key (LoadRequest/SaveRequest):
  // refused unless this is set. Without a key any node of the peer set
  // that knows a job's id could join it first for a rank and be served the
  // job's bytes (docs/security.md, "Job keys").
  bool peer_unkeyed_jobs = false;
  // A multi-node load's reads that several nodes need go to at most one
  // reader per this many bytes read and sent (ckpt::AssignOptions); 0: to
  // every node that can read them.
  uint64_t peer_reader_min_bytes = 64ull << 20;
  // Connecting a job's NCCL links (GPU nodes) gives up after this; the reads
  // then move over gRPC, and NCCL stays off for that pair of nodes a while.
  absl::Duration nccl_connect_timeout = absl::Seconds(5);
  // The CUDA device (as this daemon sees it) that carries its NCCL links and
  // their staging buffers; ckptd refuses to start when it does not exist.
  int nccl_device = 0;
  // Testing only (flag --testing_delay_part_ms, not in YAML): pause between
  // receiving a multi-node plan part and executing it, so tests can kill a
  // peer mid-load deterministically.
  absl::Duration testing_delay_part = absl::ZeroDuration();
  // Testing only (flag --testing-delay-read-ms, not in YAML): pause before
  // each planned read of a load job on this node (cut short when the job is
  // aborted), so tests can act while a job is provably in flight.
  absl::Duration testing_delay_read = absl::ZeroDuration();
  // Testing only (flag --testing-delay-persist-ms, not in YAML): pause before
  // each file an asynchronous save persists (data files, then the metadata),
  // so tests can kill the daemon at a known point of a persist.
  absl::Duration testing_delay_persist = absl::ZeroDuration();
  // Testing only (flag --testing-fd-token-ttl-ms, not in YAML): fd tokens
  // expire after this instead of barrier_timeout + 1 minute (zero: that).
  absl::Duration testing_fd_token_ttl = absl::ZeroDuration();
  // Testing only (flag --testing-corrupt-served, not in YAML): flip one byte
  // of every read this node serves to peers, after its checksum was taken,
  // as a faulty link or a malicious peer would.
  bool testing_corrupt_served = false;
  // Testing only (flag --testing-peer-lane-bytes, not in YAML): a peer's reads
  // come in one FetchReads stream per this many bytes (up to io_threads)
  // instead of per 64 MiB, so tests move reads over several streams.
  uint64_t testing_peer_lane_bytes = 0;
  // The keys the operator set (in the YAML file or by a flag), "limits.x"
  // for limits: budgets not in it may be fitted to the memory limit.
  std::set<std::string> set_keys;
};

// Parses YAML text; `source` names it in errors.
absl::StatusOr<DaemonConfig> ParseConfig(const std::string& yaml, const std::string& source);
absl::StatusOr<DaemonConfig> LoadConfigFile(const std::string& path);

// Checks cross-key rules (roots present and absolute, threads > 0, ...).
absl::Status ValidateConfig(const DaemonConfig& config);

// The roots that do not exist or are not directories now (an unmounted
// volume, a typo), one line each naming the root and what it is. ckptd warns
// about them at start-up (a volume may be mounted later: requests under it get
// NOT_FOUND until then); `ckptd --check-config` fails on them.
std::vector<std::string> RootProblems(const DaemonConfig& config);

// "64MiB", "4GiB", "1000" (bytes), "1.5GB".
absl::StatusOr<uint64_t> ParseBytes(const std::string& text);
// "120s", "500ms", "2m", "1h", "30" (seconds).
absl::StatusOr<absl::Duration> ParseDuration(const std::string& text);

std::string ConfigToYaml(const DaemonConfig& config);

// The host part of "host:port" ("[v6]:port" gives "v6"; no port: all of it).
std::string HostOf(const std::string& address);
// Whether "host:port" is a loopback address (localhost, an address that
// parses into 127.0.0.0/8, ::1 or ::ffff:127.0.0.0/104; a host name that
// merely starts with "127." is not), or a Unix socket ("unix:/path": local
// to this machine).
bool IsLoopbackAddress(const std::string& address);
// Whether `address` is a gRPC Unix socket address "unix:PATH".
bool IsUnixAddress(const std::string& address);
// The port of "host:port" ("[v6]:port"); -1 when there is none or it is not
// a number in 0..65535 (and for Unix socket addresses).
int PortOf(const std::string& address);

}  // namespace ckptd

#endif  // CKPTD_CONFIG_CONFIG_H_
