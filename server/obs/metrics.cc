#include "server/obs/metrics.h"

#include <dirent.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <exception>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>
#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/spdlog.h>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace ckptd {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

// --- Instruments fed by RecordLoadJob -----------------------------------------

struct Instruments {
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  prometheus::Counter* jobs_ok;
  prometheus::Counter* jobs_failed;
  prometheus::Family<prometheus::Counter>* job_errors;  // by status code
  prometheus::Counter* peer_received;
  prometheus::Counter* peer_sent;
  prometheus::Family<prometheus::Counter>* peer_rpcs;  // by rpc
  prometheus::Histogram* phase[5];  // list plan read copy total

  Instruments() {
    auto& jobs = prometheus::BuildCounter()
                     .Name("ckptd_load_jobs_total")
                     .Help("Load jobs this daemon ran (all ranks of a job on this node together), "
                           "by result")
                     .Register(*registry);
    jobs_ok = &jobs.Add({{"result", "ok"}});
    jobs_failed = &jobs.Add({{"result", "error"}});
    job_errors = &prometheus::BuildCounter()
                      .Name("ckptd_load_job_errors_total")
                      .Help("Failed load jobs by the status code of their error: DATA_LOSS, "
                            "INTERNAL (the node's storage or ckptd), UNAVAILABLE, "
                            "RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, ABORTED (capacity, peers, "
                            "restarts, files changing), NOT_FOUND, INVALID_ARGUMENT, "
                            "PERMISSION_DENIED, ... (the request: a typo, a missing key)")
                      .Register(*registry);
    peer_received = &prometheus::BuildCounter()
                         .Name("ckptd_peer_received_bytes_total")
                         .Help("Checkpoint bytes received from other daemons (multi-node jobs)")
                         .Register(*registry)
                         .Add({});
    peer_sent = &prometheus::BuildCounter()
                     .Name("ckptd_peer_sent_bytes_total")
                     .Help("Checkpoint bytes sent to other daemons (multi-node jobs)")
                     .Register(*registry)
                     .Add({});
    peer_rpcs = &prometheus::BuildCounter()
                     .Name("ckptd_peer_rpcs_total")
                     .Help("Calls of the peer service this daemon served (multi-node jobs), by "
                           "rpc: Join, Locate, FetchRead, FetchReads, Complete, Ping")
                     .Register(*registry);
    for (const char* rpc : {"Join", "Locate", "FetchRead", "FetchReads", "Complete", "Ping"}) {
      peer_rpcs->Add({{"rpc", rpc}});  // served as 0 until the first call
    }
    auto& h = prometheus::BuildHistogram()
                  .Name("ckptd_load_phase_duration_seconds")
                  .Help("Duration of each phase of a successful load job: list (open the "
                        "checkpoint), plan, read (storage, cache and peers), copy (into the "
                        "ranks' memory), total (barrier complete to done)")
                  .Register(*registry);
    const prometheus::Histogram::BucketBoundaries b = {0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5,
                                                       1,     2.5,   5,    10,   30,  60,   120,
                                                       300,   600,   1800};
    const char* names[5] = {"list", "plan", "read", "copy", "total"};
    for (int i = 0; i < 5; ++i) phase[i] = &h.Add({{"phase", names[i]}}, b);
  }
};

Instruments& Inst() {
  static Instruments* i = new Instruments();
  return *i;
}

std::atomic<bool> g_json_logs{false};

// --- Logging -------------------------------------------------------------------

std::string Utc(std::chrono::system_clock::time_point t) {
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
  const time_t secs = static_cast<time_t>(ms / 1000);
  struct tm tm;
  gmtime_r(&secs, &tm);
  char buf[96];
  std::snprintf(buf, sizeof(buf), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
                tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                static_cast<int>(ms % 1000));
  return buf;
}

std::string Dump(const nlohmann::ordered_json& j) {
  // Paths may hold bytes that are not UTF-8: replace them rather than throw.
  return j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

// The level's name as the configuration spells it ("warn", not spdlog's
// "warning").
absl::string_view LevelName(spdlog::level::level_enum level) {
  switch (level) {
    case spdlog::level::trace: return "trace";
    case spdlog::level::debug: return "debug";
    case spdlog::level::info: return "info";
    case spdlog::level::warn: return "warn";
    case spdlog::level::err: return "error";
    case spdlog::level::critical: return "critical";
    default: return "off";
  }
}

// %L in the text pattern: LevelName.
class LevelFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    const absl::string_view name = LevelName(msg.level);
    dest.append(name.data(), name.data() + name.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<LevelFlag>();
  }
};

// A "key=value" token's value as JSON: an integer (a trailing "B", bytes,
// dropped), a number of seconds ("0.0012s"), else the text.
nlohmann::ordered_json FieldValue(absl::string_view v) {
  absl::string_view num = v;
  const bool bytes = absl::ConsumeSuffix(&num, "B");
  const bool seconds = !bytes && absl::ConsumeSuffix(&num, "s");
  int64_t i = 0;
  uint64_t u = 0;
  double d = 0;
  if (!seconds && absl::SimpleAtoi(num, &i)) return i;
  if (!seconds && absl::SimpleAtoi(num, &u)) return u;
  if (!bytes && !num.empty() && absl::ascii_isdigit(num.front()) && absl::SimpleAtod(num, &d)) {
    return d;
  }
  return std::string(v);
}

// Fields of a text line: every "key=value" token (key of [a-z0-9_]; a
// trailing ',', ';', ':' or ')' is not part of the value) becomes a field, and the
// words before the first one become "event" ("cache fill path=... reads=2" ->
// event "cache fill", path, reads). The text stays whole in "msg".
void AddFields(absl::string_view text, nlohmann::ordered_json& j) {
  std::string event;
  bool seen = false;
  for (absl::string_view tok : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    const size_t eq = tok.find('=');
    absl::string_view key = eq == absl::string_view::npos ? absl::string_view() : tok.substr(0, eq);
    const bool is_key = !key.empty() && std::all_of(key.begin(), key.end(), [](char c) {
      return absl::ascii_islower(c) || absl::ascii_isdigit(c) || c == '_';
    });
    if (!is_key) {
      if (!seen) absl::StrAppend(&event, event.empty() ? "" : " ", tok);
      continue;
    }
    seen = true;
    if (key == "ts" || key == "level" || key == "msg" || key == "event" || j.contains(key)) continue;
    absl::string_view value = tok.substr(eq + 1);
    while (!value.empty() && (value.back() == ',' || value.back() == ';' || value.back() == ')' ||
                              value.back() == ':')) {
      value.remove_suffix(1);
    }
    j[std::string(key)] = FieldValue(value);
  }
  if (seen) {
    while (!event.empty() && event.back() == ':') event.pop_back();
    if (!event.empty()) j["event"] = event;
  }
}

// One JSON object per line: {"ts", "level", "msg", fields of its key=value
// tokens}; a message that is itself a JSON object starting with "event"
// (RecordLoadJob) is merged in instead.
class JsonFormatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const std::string payload(msg.payload.data(), msg.payload.size());
    nlohmann::ordered_json head;
    head["ts"] = Utc(msg.time);
    head["level"] = std::string(LevelName(msg.level));
    std::string line;
    if (payload.rfind("{\"event\":", 0) == 0 && payload.back() == '}') {
      line = Dump(head);
      line.pop_back();  // '}'
      line += "," + payload.substr(1);
    } else {
      head["msg"] = payload;
      AddFields(payload, head);
      line = Dump(head);
    }
    line += "\n";
    dest.append(line.data(), line.data() + line.size());
  }
  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonFormatter>();
  }
};

// --- Scrape-time collection from Daemon::Status() ------------------------------

MetricFamily Fam(const std::string& name, const std::string& help, MetricType type) {
  MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  return f;
}

void Sample(MetricFamily& f, double v, std::vector<ClientMetric::Label> labels = {}) {
  ClientMetric m;
  m.label = std::move(labels);
  if (f.type == MetricType::Counter) {
    m.counter.value = v;
  } else {
    m.gauge.value = v;
  }
  f.metric.push_back(std::move(m));
}

MetricFamily One(const std::string& name, const std::string& help, MetricType type, double v) {
  MetricFamily f = Fam(name, help, type);
  Sample(f, v);
  return f;
}

// Process figures in the standard process_* names.
void ProcessFamilies(std::vector<MetricFamily>& out) {
  out.push_back(One("process_resident_memory_bytes", "Resident memory size in bytes",
                    MetricType::Gauge, static_cast<double>(ResidentBytes())));
  int fds = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (struct dirent* e = ::readdir(d)) fds += e->d_name[0] != '.';
    ::closedir(d);
    --fds;  // the directory stream's own descriptor
  }
  out.push_back(One("process_open_fds", "Number of open file descriptors", MetricType::Gauge, fds));
  std::ifstream stat("/proc/self/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  if (paren == std::string::npos) return;
  std::istringstream fields(text.substr(paren + 2));
  std::vector<std::string> f;
  for (std::string s; fields >> s;) f.push_back(s);
  // After the command: state(0) ... utime(11) stime(12) ... starttime(19).
  if (f.size() < 20) return;
  const double tick = static_cast<double>(::sysconf(_SC_CLK_TCK));
  out.push_back(One("process_cpu_seconds_total", "Total user and system CPU time in seconds",
                    MetricType::Counter, (std::stod(f[11]) + std::stod(f[12])) / tick));
  std::ifstream up("/proc/uptime");
  double uptime = 0;
  if (up >> uptime) {
    const double boot = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()) - uptime;
    out.push_back(One("process_start_time_seconds",
                      "Start time of the process since the Unix epoch in seconds",
                      MetricType::Gauge, boot + std::stod(f[19]) / tick));
  }
}

// Requests to the S3 endpoint of s3:// roots (zeros when there is none).
void ObjectStorageFamilies(const v1::ObjectStorageStatus& o, std::vector<MetricFamily>& out) {
  MetricFamily req = Fam("ckptd_s3_requests_total",
                         "Requests made to the S3 endpoint, by op: HEAD, GET (ranged reads), LIST "
                         "(listing pages), PUT (objects, multipart creations, parts and "
                         "completions), DELETE; retries included",
                         MetricType::Counter);
  Sample(req, o.heads(), {{"op", "HEAD"}});
  Sample(req, o.gets(), {{"op", "GET"}});
  Sample(req, o.lists(), {{"op", "LIST"}});
  Sample(req, o.puts(), {{"op", "PUT"}});
  Sample(req, o.deletes(), {{"op", "DELETE"}});
  out.push_back(std::move(req));
  out.push_back(One("ckptd_s3_retries_total",
                    "S3 requests retried (5xx, SlowDown, resets, stalls, short bodies)",
                    MetricType::Counter, o.retries()));
  MetricFamily bytes = Fam("ckptd_s3_bytes_total",
                           "Body bytes moved to and from the S3 endpoint, by direction (in: "
                           "GETs and listings, out: uploads)",
                           MetricType::Counter);
  Sample(bytes, o.bytes_in(), {{"direction", "in"}});
  Sample(bytes, o.bytes_out(), {{"direction", "out"}});
  out.push_back(std::move(bytes));
  out.push_back(One("ckptd_s3_request_wait_seconds_total",
                    "Seconds S3 requests waited for one of s3.max_requests slots",
                    MetricType::Counter, o.request_wait_seconds()));
}

class StatusCollector final : public prometheus::Collectable {
 public:
  explicit StatusCollector(std::function<v1::StatusResponse()> status)
      : status_(std::move(status)) {}

  std::vector<MetricFamily> Collect() const override {
    const v1::StatusResponse s = status_();
    std::vector<MetricFamily> out;
    const auto C = MetricType::Counter;
    const auto G = MetricType::Gauge;
    {
      MetricFamily f = Fam("ckptd_build_info", "Version of the running ckptd (always 1)", G);
      Sample(f, 1, {{"version", s.version()}});
      out.push_back(std::move(f));
    }
    out.push_back(One("ckptd_uptime_seconds", "Seconds since the daemon started", G, s.uptime_s()));
    out.push_back(One("ckptd_loads_started_total",
                      "Load requests received (one per rank of a job)", C, s.loads_started()));
    out.push_back(One("ckptd_loads_succeeded_total",
                      "Load requests that delivered every tensor to their rank", C,
                      s.loads_succeeded()));
    out.push_back(One("ckptd_loads_failed_total",
                      "Load requests that ended with an error (bad request, barrier timeout, "
                      "failed job, client gone)",
                      C, s.loads_failed()));
    out.push_back(One("ckptd_storage_read_bytes_total",
                      "Checkpoint bytes read from storage (cache misses, loads and prefetches)",
                      C, s.bytes_read_total()));
    out.push_back(One("ckptd_delivered_bytes_total",
                      "Bytes delivered into the ranks' shared memory or streams", C,
                      s.bytes_delivered_total()));
    out.push_back(One("ckptd_cache_bytes", "Checkpoint bytes held in the data cache", G,
                      s.cache_bytes()));
    out.push_back(One("ckptd_arena_leased_bytes", "Bytes of shared-memory arenas lent to clients",
                      G, s.arena_leased_bytes()));
    out.push_back(One("ckptd_arena_free_bytes",
                      "Bytes of arenas kept mapped for the next clients (arena_pool)", G,
                      s.arena_free_bytes()));
    out.push_back(One("ckptd_arena_reused_total", "Arena leases served from the free arenas", C,
                      s.arena_reused()));
    out.push_back(One("ckptd_cache_budget_bytes", "Data cache budget (cache_budget)", G,
                      s.cache_budget_bytes()));
    out.push_back(One("ckptd_cache_fills_total",
                      "Background cache fills done (reads a load delivered without keeping)", C,
                      s.cache_fills()));
    out.push_back(One("ckptd_cache_fill_bytes_total",
                      "Bytes the background cache fill read again and published", C,
                      s.cache_fill_bytes()));
    out.push_back(One("ckptd_cache_fills_failed_total",
                      "Background cache fills that failed (a file changed, a read error)", C,
                      s.cache_fills_failed()));
    out.push_back(One("ckptd_cache_huge_page_bytes_total",
                      "Bytes of the cache's shared blocks collapsed into huge pages while idle "
                      "(cache_huge_pages where the kernel collapses on request)",
                      C, s.cache_huge_page_bytes()));
    out.push_back(One("ckptd_save_staged_bytes",
                      "Bytes of asynchronous saves held until they are durable (save_buffer)", G,
                      s.save_staged_bytes()));
    out.push_back(One("ckptd_save_buffer_bytes", "The save_buffer budget", G,
                      s.save_buffer_bytes()));
    out.push_back(One("ckptd_saves_durable_total", "Asynchronous saves made durable", C,
                      s.saves_durable()));
    out.push_back(One("ckptd_saves_failed_total",
                      "Asynchronous saves whose background persist failed (not visible)", C,
                      s.saves_failed()));
    out.push_back(One("ckptd_save_persisted_bytes_total",
                      "Bytes asynchronous saves wrote in the background", C,
                      s.save_bytes_persisted_total()));
    out.push_back(One("ckptd_save_persist_seconds_total",
                      "Seconds the background persists took (throughput: bytes / seconds)", C,
                      s.save_persist_seconds_total()));
    out.push_back(One("ckptd_save_stall_seconds_total",
                      "Seconds asynchronous Save calls held their ranks, until answered", C,
                      s.save_stall_seconds_total()));
    out.push_back(One("ckptd_cache_entries", "Byte ranges held in the data cache", G,
                      s.cache_entries()));
    out.push_back(One("ckptd_cache_hits_total", "Data cache lookups served from memory", C,
                      s.cache_hits()));
    out.push_back(One("ckptd_cache_misses_total", "Data cache lookups that read storage", C,
                      s.cache_misses()));
    out.push_back(One("ckptd_cache_evictions_total",
                      "Byte ranges evicted from the data cache (budget or invalidation)", C,
                      s.cache_evictions()));
    out.push_back(One("ckptd_cache_laid_out_bytes",
                      "Bytes of laid-out copies in the data cache (ranks' bytes gathered after "
                      "a load that took them in pieces; part of the cache's bytes)", G,
                      s.cache_laid_out_bytes()));
    out.push_back(One("ckptd_cache_laid_out_hits_total",
                      "Ranks' loads served from a laid-out copy", C, s.cache_laid_out_hits()));
    out.push_back(One("ckptd_metadata_cache_entries", "Checkpoints whose metadata is cached", G,
                      s.metadata_cache_entries()));
    {
      int waiting = 0, running = 0;
      for (const auto& j : s.jobs()) (j.state() == "waiting for ranks" ? waiting : running)++;
      MetricFamily f = Fam("ckptd_active_jobs",
                           "Jobs in the registry: waiting for their ranks, or running", G);
      Sample(f, waiting, {{"state", "waiting"}});
      Sample(f, running, {{"state", "running"}});
      out.push_back(std::move(f));
    }
    {
      MetricFamily up = Fam("ckptd_peer_up", "1 if the peer daemon answered a ping", G);
      MetricFamily rtt = Fam("ckptd_peer_rtt_seconds", "Round trip of the last ping to the peer", G);
      for (const auto& p : s.peers()) {
        Sample(up, p.reachable() ? 1 : 0, {{"peer", p.address()}});
        if (p.reachable()) Sample(rtt, p.rtt_ms() / 1000.0, {{"peer", p.address()}});
      }
      out.push_back(One("ckptd_peers", "Other daemons known (static list and DNS)", G,
                        std::max<double>(s.peers_known(), s.peers_size())));
      if (!up.metric.empty()) out.push_back(std::move(up));
      if (!rtt.metric.empty()) out.push_back(std::move(rtt));
    }
    ObjectStorageFamilies(s.object_storage(), out);
    ProcessFamilies(out);
    return out;
  }

 private:
  std::function<v1::StatusResponse()> status_;
};

}  // namespace

uint64_t ResidentBytes() {
  std::ifstream f("/proc/self/statm");
  uint64_t pages = 0, resident = 0;
  if (!(f >> pages >> resident)) return 0;
  return resident * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

void SetUpLogging(const std::string& level, const std::string& format) {
  spdlog::set_level(spdlog::level::from_str(level));
  if (format == "json") {
    g_json_logs = true;
    spdlog::set_formatter(std::make_unique<JsonFormatter>());
  } else {
    g_json_logs = false;
    auto text = std::make_unique<spdlog::pattern_formatter>();
    text->add_flag<LevelFlag>('L').set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%L%$ ckptd: %v");
    spdlog::set_formatter(std::move(text));
  }
}

void RecordPeerRpc(const char* rpc) { Inst().peer_rpcs->Add({{"rpc", rpc}}).Increment(); }

void RecordLoadJob(const LoadJobRecord& r) {
  Instruments& in = Inst();
  const bool ok = r.status.ok();
  (ok ? in.jobs_ok : in.jobs_failed)->Increment();
  if (!ok) in.job_errors->Add({{"code", absl::StatusCodeToString(r.status.code())}}).Increment();
  if (r.bytes_from_peers) in.peer_received->Increment(static_cast<double>(r.bytes_from_peers));
  if (r.bytes_to_peers) in.peer_sent->Increment(static_cast<double>(r.bytes_to_peers));
  const double phases[5] = {r.list_s, r.plan_s, r.read_s, r.copy_s, r.wall_s};
  if (ok) {
    for (int i = 0; i < 5; ++i) {
      if (phases[i] >= 0) in.phase[i]->Observe(phases[i]);
    }
  }

  if (g_json_logs) {
    nlohmann::ordered_json j;
    j["event"] = "load";
    j["job"] = r.job;
    j["path"] = r.path;
    if (!r.node.empty()) j["node"] = r.node;
    j["ranks"] = r.ranks;
    j["result"] = ok ? "ok" : "error";
    if (r.ranks_failed) j["ranks_failed"] = r.ranks_failed;
    if (!ok) {
      j["code"] = absl::StatusCodeToString(r.status.code());
      j["error"] = std::string(r.status.message());
    } else {
      j["bytes_read"] = r.bytes_read;
      j["bytes_read_direct"] = r.bytes_read_direct;
      j["bytes_from_cache"] = r.bytes_from_cache;
      if (r.node.empty()) j["bytes_from_files"] = r.bytes_from_files;
      if (!r.node.empty()) {
        j["bytes_from_peers"] = r.bytes_from_peers;
        j["bytes_to_peers"] = r.bytes_to_peers;
        j["job_bytes_read"] = r.job_bytes_read;
      }
      j["bytes_delivered"] = r.bytes_delivered;
      if (r.node.empty()) {
        j["reads"] = r.reads;
        j["checksums_verified"] = r.checksums_verified;
      }
    }
    const char* names[5] = {"list_s", "plan_s", "read_s", "copy_s", "wall_s"};
    for (int i = 0; i < 5; ++i) {
      if (phases[i] >= 0) j[names[i]] = std::round(phases[i] * 1e6) / 1e6;
    }
    const std::string line = Dump(j);
    if (ok) {
      spdlog::info("{}", line);
    } else {
      spdlog::warn("{}", line);
    }
    return;
  }
  if (!ok) {
    spdlog::warn("load job={} path={}{} ranks={}{} failed: {}", r.job, r.path,
                 r.node.empty() ? "" : " node=" + r.node, r.ranks,
                 r.ranks_failed ? absl::StrCat(" ranks_failed=", r.ranks_failed) : "",
                 r.status.ToString());
  } else if (r.node.empty()) {
    spdlog::info(
        "load job={} path={} ranks={} read={}B direct={}B cache={}B files={}B delivered={}B "
        "reads={} verified={} list={:.4f}s plan={:.4f}s read={:.4f}s copy={:.4f}s wall={:.4f}s",
        r.job, r.path, r.ranks, r.bytes_read, r.bytes_read_direct, r.bytes_from_cache,
        r.bytes_from_files, r.bytes_delivered, r.reads, r.checksums_verified, r.list_s, r.plan_s, r.read_s, r.copy_s,
        r.wall_s);
  } else {
    spdlog::info(
        "load job={} node={} ranks={} read={}B cache={}B from_peers={}B to_peers={}B "
        "delivered={}B job_read={}B wall={:.4f}s",
        r.job, r.node, r.ranks, r.bytes_read, r.bytes_from_cache, r.bytes_from_peers,
        r.bytes_to_peers, r.bytes_delivered, r.job_bytes_read, r.wall_s);
  }
}

// --- The endpoint ----------------------------------------------------------------

struct MetricsServer::Impl {
  std::shared_ptr<StatusCollector> collector;
  std::unique_ptr<prometheus::Exposer> exposer;
};

MetricsServer::MetricsServer(std::unique_ptr<Impl> impl, int port)
    : impl_(std::move(impl)), port_(port) {}

MetricsServer::~MetricsServer() = default;

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& address, std::function<v1::StatusResponse()> status) {
  auto impl = std::make_unique<Impl>();
  impl->collector = std::make_shared<StatusCollector>(std::move(status));
  try {
    impl->exposer = std::make_unique<prometheus::Exposer>(address, /*num_threads=*/2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", e.what()));
  }
  impl->exposer->RegisterCollectable(Inst().registry);
  impl->exposer->RegisterCollectable(impl->collector);
  const std::vector<int> ports = impl->exposer->GetListeningPorts();
  const int port = ports.empty() ? 0 : ports.front();
  return std::unique_ptr<MetricsServer>(new MetricsServer(std::move(impl), port));
}

}  // namespace ckptd
