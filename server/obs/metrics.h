// Observability of the daemon: the Prometheus endpoint (prometheus-cpp,
// off unless `metrics_address` is set), the log set-up (text or JSON lines)
// and the one record per load job that feeds both.
//
// The daemon's counters and gauges (loads, bytes, cache, jobs, peers) are
// read from Daemon::Status() at every scrape, so the daemon keeps a single
// set of figures; what Status() does not carry (per-phase durations, peer
// transfer bytes, job outcomes) comes from RecordLoadJob, called once per
// load job by the daemon.
#ifndef CKPTD_SERVER_OBS_METRICS_H_
#define CKPTD_SERVER_OBS_METRICS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/ckpt.pb.h"

namespace ckptd {

// What one load job did on this daemon (all its ranks here together).
struct LoadJobRecord {
  std::string job;
  std::string path;
  std::string node;  // this daemon's peer address for a multi-node job, else empty
  size_t ranks = 0;  // ranks of the job served by this daemon
  // Not OK when the job failed, or when some of its ranks did while the
  // others loaded (a strict rank missing keys): the job counts as failed.
  absl::Status status;
  size_t ranks_failed = 0;  // of `ranks`, those that got an error (the rest loaded)
  uint64_t bytes_read = 0;        // from storage
  uint64_t bytes_read_direct = 0;  // of which around the page cache (O_DIRECT)
  uint64_t bytes_from_cache = 0;  // from the data cache
  uint64_t bytes_from_files = 0;  // read by the clients from the files (file views)
  uint64_t bytes_from_peers = 0;  // multi-node: received from other daemons
  uint64_t bytes_to_peers = 0;    // multi-node: sent to other daemons
  uint64_t bytes_delivered = 0;   // into the ranks' destinations
  uint64_t job_bytes_read = 0;    // multi-node: storage reads of all nodes
  uint64_t reads = 0;             // planned read requests
  uint64_t checksums_verified = 0;
  // Phase timings in seconds; negative: not measured for this job.
  double list_s = -1, plan_s = -1, read_s = -1, copy_s = -1, wall_s = -1;
};

// Counts the job in the metrics (always, even with the endpoint off: a few
// atomic adds) and writes its log line: info when it succeeded, warn when
// it failed; text or one JSON object, as set up by SetUpLogging.
void RecordLoadJob(const LoadJobRecord& record);

// Counts one call of the peer service (`rpc`: Join, Locate, FetchRead, FetchReads,
// Complete, Ping) served by this daemon: ckptd_peer_rpcs_total{rpc}.
void RecordPeerRpc(const char* rpc);

// Sets spdlog's level and format: "text" (timestamp level ckptd: message)
// or "json" (one object per line: ts, level, msg and the line's key=value
// tokens as fields; load jobs write their own fields). Level names as
// configured (trace debug info warn error). Call before anything logs.
void SetUpLogging(const std::string& level, const std::string& format);

// This process's resident memory (bytes), from /proc/self/statm; 0 if unknown.
uint64_t ResidentBytes();

// The HTTP endpoint. `status` is called at every scrape (Daemon::Status).
class MetricsServer {
 public:
  // Listens on `address` ("host:port"; port 0 picks a free one).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& address, std::function<v1::StatusResponse()> status);
  ~MetricsServer();
  int port() const { return port_; }

 private:
  struct Impl;
  explicit MetricsServer(std::unique_ptr<Impl> impl, int port);
  std::unique_ptr<Impl> impl_;
  int port_;
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_OBS_METRICS_H_
