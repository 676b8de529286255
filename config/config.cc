#include "config/config.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <cmath>
#include <set>

#include <yaml-cpp/yaml.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace ckptd {
namespace {

const std::set<std::string>& KnownKeys() {
  static const auto* keys = new std::set<std::string>{
      "socket",        "socket_mode",     "tcp_address",   "roots",
      "cache_budget",  "io_threads",      "io_request_size", "barrier_timeout",
      "load_timeout",  "drain_timeout",   "log_level",       "peer_listen",
      "peers",         "peer_dns",        "peer_timeout",    "log_format",
      "metrics_address", "arena_pool",      "arena_limit",     "direct_io",
      "tcp_tls_cert",  "tcp_tls_key",     "tcp_tls_ca",      "insecure_tcp",
      "tcp_uid",       "admin_uids",      "access",          "limits",
      "peer_tls_cert", "peer_tls_key",    "peer_tls_ca",     "peer_insecure",
      "peer_unkeyed_jobs", "peer_reader_min_bytes", "nccl_connect_timeout", "nccl_device", "port_file", "memory_limit", "save_buffer", "s3",
      "cache_huge_pages", "cache_laid_out_copies"};
  return *keys;
}

// The modes of `direct_io` (core's ckpt::DirectIo; config/ does not link core).
bool IsDirectIoMode(const std::string& s) { return s == "never" || s == "auto" || s == "always"; }

absl::Status Bad(const std::string& source, const std::string& key, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": key '", key, "': ", what));
}

// A uid/gid list: a sequence of numbers (or one number).
absl::StatusOr<std::vector<uint32_t>> IdList(const YAML::Node& v, const std::string& source,
                                             const std::string& key) {
  std::vector<uint32_t> out;
  auto one = [&](const YAML::Node& n) -> absl::Status {
    uint32_t id;
    if (!n.IsScalar() || !absl::SimpleAtoi(n.as<std::string>(), &id)) {
      return Bad(source, key, "must be a list of numeric uids/gids");
    }
    out.push_back(id);
    return absl::OkStatus();
  };
  if (v.IsSequence()) {
    for (const auto& n : v) {
      if (absl::Status s = one(n); !s.ok()) return s;
    }
  } else if (!v.IsNull()) {
    if (absl::Status s = one(v); !s.ok()) return s;
  }
  return out;
}

// The count and size limits: one table for parsing, the key list in errors
// and printing (max_barrier_timeout, a duration, is handled beside it).
struct CountLimit {
  const char* key;
  uint64_t Limits::*field;
};
constexpr CountLimit kCountLimits[] = {
    {"max_targets_per_request", &Limits::max_targets_per_request},
    {"max_request_bytes", &Limits::max_request_bytes},
    {"max_uid_bytes", &Limits::max_uid_bytes},
    {"max_stream_bytes", &Limits::max_stream_bytes},
    {"max_jobs_per_uid", &Limits::max_jobs_per_uid},
    {"max_ranks_per_uid", &Limits::max_ranks_per_uid},
    {"max_ranks_per_job", &Limits::max_ranks_per_job},
    {"max_message_bytes", &Limits::max_message_bytes},
    {"max_concurrent_streams", &Limits::max_concurrent_streams},
    {"max_connections", &Limits::max_connections},
    {"max_threads", &Limits::max_threads},
    {"max_metadata_bytes", &Limits::max_metadata_bytes},
    {"metadata_cache_entries", &Limits::metadata_cache_entries},
};
constexpr char kBarrierLimit[] = "max_barrier_timeout";

std::string LimitKeyList() {
  std::set<std::string> keys = {kBarrierLimit};
  for (const CountLimit& c : kCountLimits) keys.insert(c.key);
  return absl::StrJoin(keys, ", ");
}

absl::Status ParseLimits(const YAML::Node& v, const std::string& source, Limits* l) {
  if (!v.IsMap()) return Bad(source, "limits", "must be a mapping of limit: value");
  for (const auto& kv : v) {
    const std::string key = kv.first.as<std::string>();
    const std::string full = "limits." + key;
    const CountLimit* count = nullptr;
    for (const CountLimit& c : kCountLimits) {
      if (key == c.key) count = &c;
    }
    if (count == nullptr && key != kBarrierLimit) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": unknown key '", full,
                                                     "' (known: ", LimitKeyList(), ")"));
    }
    if (!kv.second.IsScalar()) return Bad(source, full, "must be a single value");
    const std::string s = kv.second.as<std::string>();
    if (count == nullptr) {
      auto d = ParseDuration(s);
      if (!d.ok()) return Bad(source, full, d.status().message());
      if (*d <= absl::ZeroDuration()) return Bad(source, full, "must be positive");
      l->max_barrier_timeout = *d;
      continue;
    }
    auto b = ParseBytes(s);  // plain counts parse as bytes too
    if (!b.ok() || *b == 0) return Bad(source, full, "must be a positive number or byte size");
    l->*count->field = *b;
  }
  return absl::OkStatus();
}

absl::Status ParseAccess(const YAML::Node& v, const std::string& source,
                         std::vector<RootAccess>* out) {
  if (!v.IsSequence()) {
    return Bad(source, "access", "must be a list of {root, read_uids, read_gids, save_uids, save_gids}");
  }
  static const std::set<std::string> kKeys = {"root", "read_uids", "read_gids", "save_uids",
                                              "save_gids"};
  out->clear();
  for (const auto& e : v) {
    if (!e.IsMap()) return Bad(source, "access", "each entry must be a mapping");
    RootAccess ra;
    for (const auto& kv : e) {
      const std::string key = kv.first.as<std::string>();
      const std::string full = "access." + key;
      if (!kKeys.count(key)) {
        return absl::InvalidArgumentError(absl::StrCat(
            source, ": unknown key '", full, "' (known: ", absl::StrJoin(kKeys, ", "), ")"));
      }
      if (key == "root") {
        if (!kv.second.IsScalar()) return Bad(source, full, "must be a path");
        ra.root = kv.second.as<std::string>();
        continue;
      }
      auto ids = IdList(kv.second, source, full);
      if (!ids.ok()) return ids.status();
      (key == "read_uids"   ? ra.read_uids
       : key == "read_gids" ? ra.read_gids
       : key == "save_uids" ? ra.save_uids
                            : ra.save_gids) = *ids;
    }
    if (ra.root.empty()) return Bad(source, "access", "every entry needs 'root'");
    out->push_back(std::move(ra));
  }
  return absl::OkStatus();
}

absl::Status ParseS3Root(const YAML::Node& v, const std::string& source, S3RootConfig* out);

// The `s3` section (`within` "s3"), or one entry of its `roots` ("s3.roots"):
// the same keys but `roots` (and, in an entry, `root`).
absl::Status ParseS3(const YAML::Node& v, const std::string& source, S3Config* out,
                     const std::string& within = "s3") {
  if (!v.IsMap()) return Bad(source, within, "must be a mapping (endpoint, region, ...)");
  static const std::set<std::string> kKeys = {
      "endpoint", "region",       "profile",         "addressing",   "ca_file",
      "part_size", "spool_dir", "max_attempts", "connect_timeout", "stall_timeout",
      "max_bandwidth", "max_requests", "roots"};
  for (const auto& kv : v) {
    const std::string key = kv.first.as<std::string>();
    const std::string full = within + "." + key;
    if (within != "s3" && key == "root") continue;  // the entry's own, read by ParseS3Root
    static const std::set<std::string> kRootKeys = {"endpoint", "region", "profile",
                                                     "addressing", "ca_file"};
    if (!kKeys.count(key) || (within != "s3" && !kRootKeys.count(key))) {
      return absl::InvalidArgumentError(absl::StrCat(
          source, ": unknown key '", full, "' (known: ",
          absl::StrJoin(within == "s3" ? kKeys : kRootKeys, ", "),
          within == "s3" ? "" : ", and root", ")"));
    }
    if (key == "roots") {
      if (!kv.second.IsSequence()) {
        return Bad(source, full, "must be a list of {root, endpoint, region, profile, ...}");
      }
      out->roots.clear();
      for (const auto& e : kv.second) {
        S3RootConfig r;
        if (absl::Status st = ParseS3Root(e, source, &r); !st.ok()) return st;
        out->roots.push_back(std::move(r));
      }
      continue;
    }
    if (!kv.second.IsScalar()) return Bad(source, full, "must be a single value");
    const std::string s = kv.second.as<std::string>();
    if (key == "part_size") {
      auto b = ParseBytes(s);
      if (!b.ok() || *b < (5ull << 20) || *b > (5ull << 30)) {
        return Bad(source, full, "must be a size from 5MiB to 5GiB (S3's part sizes)");
      }
      out->part_size = *b;
    } else if (key == "max_bandwidth") {
      auto b = s == "0" ? absl::StatusOr<uint64_t>(0) : ParseBytes(s);
      if (!b.ok()) return Bad(source, full, "must be bytes per second (500MiB) or 0 (no cap)");
      out->max_bandwidth = *b;
    } else if (key == "max_requests") {
      uint64_t n;
      if (!absl::SimpleAtoi(s, &n) || n > 1024) {
        return Bad(source, full, "must be a number from 1 to 1024, or 0 (no bound)");
      }
      out->max_requests = n;
    } else if (key == "max_attempts") {
      uint64_t n;
      if (!absl::SimpleAtoi(s, &n) || n < 1 || n > 100) {
        return Bad(source, full, "must be a number from 1 to 100");
      }
      out->max_attempts = n;
    } else if (key == "connect_timeout" || key == "stall_timeout") {
      auto d = ParseDuration(s);
      if (!d.ok() || *d < absl::Seconds(1) || *d > absl::Hours(1)) {
        return Bad(source, full, "must be a duration from 1s to 1h");
      }
      (key == "connect_timeout" ? out->connect_timeout : out->stall_timeout) = *d;
    } else if (key == "addressing") {
      if (s != "auto" && s != "path" && s != "virtual") {
        return Bad(source, full, "must be auto, path or virtual");
      }
      out->addressing = s;
    } else if (key == "endpoint") {
      if (!s.empty() && !absl::StartsWith(s, "http://") && !absl::StartsWith(s, "https://")) {
        return Bad(source, full, "must be an http:// or https:// URL");
      }
      out->endpoint = s;  // (empty: unset, as ConfigToYaml prints it)
    } else {
      (key == "region"    ? out->region
       : key == "profile" ? out->profile
       : key == "ca_file" ? out->ca_file
                          : out->spool_dir) = s;
    }
  }
  return absl::OkStatus();
}

absl::Status ParseS3Root(const YAML::Node& v, const std::string& source, S3RootConfig* out) {
  if (!v.IsMap() || !v["root"] || !v["root"].IsScalar()) {
    return Bad(source, "s3.roots", "each entry must be a mapping with 'root' (an s3:// root)");
  }
  out->root = v["root"].as<std::string>();
  if (!IsObjectStorageUrl(out->root)) {
    return Bad(source, "s3.roots.root", absl::StrCat("'", out->root, "' is not an s3:// URL"));
  }
  return ParseS3(v, source, &out->settings, "s3.roots");
}

}  // namespace

bool IsObjectStorageUrl(const std::string& path) { return absl::StartsWith(path, "s3://"); }

bool IsUnixAddress(const std::string& address) { return absl::StartsWith(address, "unix:"); }

int PortOf(const std::string& address) {
  if (IsUnixAddress(address)) return -1;
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return -1;
  if (address[0] != '[' && address.find(':') != colon) return -1;  // bare v6
  if (address[0] == '[' && address.find(']') != colon - 1) return -1;
  int port = -1;
  if (!absl::SimpleAtoi(absl::string_view(address).substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return -1;
  }
  return port;
}

std::string HostOf(const std::string& address) {
  if (IsUnixAddress(address)) return address;  // a path has no host:port
  if (!address.empty() && address[0] == '[') {
    const size_t close = address.find(']');
    return close == std::string::npos ? address : address.substr(1, close - 1);
  }
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || address.find(':') != colon) return address;  // bare v6
  return address.substr(0, colon);
}

bool IsLoopbackAddress(const std::string& address) {
  if (IsUnixAddress(address)) return true;
  const std::string host = HostOf(address);
  if (host == "localhost") return true;
  // Parsed, never matched by prefix: "127.evil.example" is a name anyone's
  // DNS may point anywhere, not a loopback address.
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    return IN6_IS_ADDR_LOOPBACK(&v6) || (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127);
  }
  return false;
}

absl::StatusOr<uint64_t> ParseBytes(const std::string& text) {
  std::string t = std::string(absl::StripAsciiWhitespace(text));
  static const std::pair<const char*, double> kUnits[] = {
      {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0},
      {"KB", 1e3},     {"MB", 1e6},        {"GB", 1e9},           {"TB", 1e12},
      {"B", 1.0}};
  double mult = 1;
  absl::string_view num = t;
  for (const auto& [suffix, m] : kUnits) {
    if (absl::ConsumeSuffix(&num, suffix)) {
      mult = m;
      break;
    }
  }
  num = absl::StripAsciiWhitespace(num);
  double v;
  if (num.empty() || !absl::SimpleAtod(num, &v) || v < 0 || !std::isfinite(v) ||
      v * mult > 1.8e19) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "' is not a byte size (e.g. 4096, 64MiB, 8GiB)"));
  }
  return static_cast<uint64_t>(v * mult);
}

absl::StatusOr<absl::Duration> ParseDuration(const std::string& text) {
  std::string t = std::string(absl::StripAsciiWhitespace(text));
  double v;
  if (absl::SimpleAtod(t, &v) && v >= 0) return absl::Seconds(v);
  absl::Duration d;
  if (absl::ParseDuration(t, &d) && d >= absl::ZeroDuration()) return d;
  return absl::InvalidArgumentError(
      absl::StrCat("'", text, "' is not a duration (e.g. 30, 500ms, 120s, 2m)"));
}

absl::StatusOr<DaemonConfig> ParseConfig(const std::string& yaml, const std::string& source) {
  DaemonConfig c;
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not valid YAML: ", e.what()));
  }
  if (root.IsNull()) return c;
  if (!root.IsMap()) return absl::InvalidArgumentError(absl::StrCat(source, ": not a YAML mapping"));
  try {
    for (const auto& kv : root) {
      const std::string key = kv.first.as<std::string>();
      const YAML::Node& v = kv.second;
      if (!KnownKeys().count(key)) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ": unknown key '", key, "' (known: ",
                         absl::StrJoin(KnownKeys(), ", "), ")"));
      }
      c.set_keys.insert(key);
      if (key == "peers") {
        c.peers.clear();
        if (v.IsSequence()) {
          for (const auto& r : v) c.peers.push_back(r.as<std::string>());
        } else if (v.IsScalar()) {
          c.peers.push_back(v.as<std::string>());
        } else {
          return Bad(source, key, "must be a list of host:port");
        }
        continue;
      }
      if (key == "roots") {
        if (v.IsScalar()) {
          c.roots = {v.as<std::string>()};
        } else if (v.IsSequence()) {
          c.roots.clear();
          for (const auto& r : v) c.roots.push_back(r.as<std::string>());
        } else {
          return Bad(source, key, "must be a path or a list of paths");
        }
        continue;
      }
      if (key == "limits") {
        if (absl::Status st = ParseLimits(v, source, &c.limits); !st.ok()) return st;
        if (v.IsMap()) {
          for (const auto& l : v) c.set_keys.insert("limits." + l.first.as<std::string>());
        }
        continue;
      }
      if (key == "access") {
        if (absl::Status st = ParseAccess(v, source, &c.access); !st.ok()) return st;
        continue;
      }
      if (key == "s3") {
        if (absl::Status st = ParseS3(v, source, &c.s3); !st.ok()) return st;
        continue;
      }
      if (key == "admin_uids") {
        auto ids = IdList(v, source, key);
        if (!ids.ok()) return ids.status();
        c.admin_uids = *ids;
        continue;
      }
      if (!v.IsScalar()) return Bad(source, key, "must be a single value");
      const std::string s = v.as<std::string>();
      if (key == "socket") {
        c.socket = s;
      } else if (key == "socket_mode") {
        char* end = nullptr;
        unsigned long m = std::strtoul(s.c_str(), &end, 8);
        if (s.empty() || *end != '\0' || m > 0777) return Bad(source, key, "must be octal like 0660");
        c.socket_mode = static_cast<uint32_t>(m);
      } else if (key == "tcp_address") {
        c.tcp_address = s;
      } else if (key == "tcp_tls_cert") {
        c.tcp_tls_cert = s;
      } else if (key == "tcp_tls_key") {
        c.tcp_tls_key = s;
      } else if (key == "tcp_tls_ca") {
        c.tcp_tls_ca = s;
      } else if (key == "insecure_tcp" || key == "peer_insecure" || key == "peer_unkeyed_jobs" ||
                 key == "cache_laid_out_copies") {
        if (s != "true" && s != "false") return Bad(source, key, "must be true or false");
        (key == "insecure_tcp"      ? c.insecure_tcp
         : key == "peer_insecure"   ? c.peer_insecure
         : key == "peer_unkeyed_jobs" ? c.peer_unkeyed_jobs
                                    : c.cache_laid_out_copies) = s == "true";
      } else if (key == "peer_tls_cert") {
        c.peer_tls_cert = s;
      } else if (key == "peer_tls_key") {
        c.peer_tls_key = s;
      } else if (key == "peer_tls_ca") {
        c.peer_tls_ca = s;
      } else if (key == "tcp_uid") {
        if (!absl::SimpleAtoi(s, &c.tcp_uid)) return Bad(source, key, "must be a numeric uid");
      } else if (key == "cache_budget" || key == "io_request_size" || key == "arena_pool" ||
                 key == "arena_limit" || key == "save_buffer" || key == "peer_reader_min_bytes") {
        auto b = ParseBytes(s);
        if (!b.ok()) return Bad(source, key, b.status().message());
        (key == "cache_budget"      ? c.cache_budget
         : key == "io_request_size" ? c.io_request_size
         : key == "arena_pool"      ? c.arena_pool
         : key == "save_buffer"     ? c.save_buffer
         : key == "peer_reader_min_bytes" ? c.peer_reader_min_bytes
                                    : c.arena_limit) = *b;
      } else if (key == "cache_huge_pages") {
        if (s != "auto" && s != "off") return Bad(source, key, "must be auto or off");
        c.cache_huge_pages = s;
      } else if (key == "direct_io") {
        if (!IsDirectIoMode(s)) return Bad(source, key, "must be never, auto or always");
        c.direct_io = s;
      } else if (key == "memory_limit") {
        if (s != "auto" && s != "off") {
          auto b = ParseBytes(s);
          if (!b.ok() || *b == 0) return Bad(source, key, "must be auto, off or a size such as 8GiB");
        }
        c.memory_limit = s;
      } else if (key == "nccl_device") {
        int n;
        if (!absl::SimpleAtoi(s, &n) || n < 0 || n > 1023) {
          return Bad(source, key, "must be a CUDA device ordinal in [0, 1023]");
        }
        c.nccl_device = n;
      } else if (key == "io_threads") {
        int n;
        if (!absl::SimpleAtoi(s, &n) || n < 1 || n > 256) {
          return Bad(source, key, "must be an integer in [1, 256]");
        }
        c.io_threads = n;
      } else if (key == "barrier_timeout" || key == "load_timeout" || key == "drain_timeout" ||
                 key == "peer_timeout" || key == "nccl_connect_timeout") {
        auto d = ParseDuration(s);
        if (!d.ok()) return Bad(source, key, d.status().message());
        (key == "barrier_timeout"  ? c.barrier_timeout
         : key == "load_timeout"   ? c.load_timeout
         : key == "peer_timeout"   ? c.peer_timeout
         : key == "nccl_connect_timeout" ? c.nccl_connect_timeout
                                   : c.drain_timeout) = *d;
      } else if (key == "port_file") {
        c.port_file = s;
      } else if (key == "peer_listen") {
        c.peer_listen = s;
      } else if (key == "peer_dns") {
        c.peer_dns = s;
      } else if (key == "metrics_address") {
        c.metrics_address = s;
      } else if (key == "log_format") {
        if (s != "text" && s != "json") return Bad(source, key, "must be text or json");
        c.log_format = s;
      } else if (key == "log_level") {
        static const std::set<std::string> kLevels = {"trace", "debug", "info", "warn", "error"};
        if (!kLevels.count(s)) return Bad(source, key, "must be one of trace debug info warn error");
        c.log_level = s;
      }
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", e.what()));
  }
  return c;
}

absl::StatusOr<DaemonConfig> LoadConfigFile(const std::string& path) {
  YAML::Node n;
  std::string text;
  {
    FILE* f = std::fopen(path.c_str(), "rb");
    if (f == nullptr) {
      return absl::NotFoundError(absl::StrCat(path, ": cannot open config file: ",
                                              std::strerror(errno)));
    }
    char buf[65536];
    size_t r;
    while ((r = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, r);
    std::fclose(f);
  }
  return ParseConfig(text, path);
}

absl::Status ValidateConfig(const DaemonConfig& c) {
  if (c.socket.empty() && c.tcp_address.empty()) {
    return absl::InvalidArgumentError("config: neither 'socket' nor 'tcp_address' is set");
  }
  if (c.roots.empty()) {
    return absl::InvalidArgumentError(
        "config: 'roots' is empty: name at least one checkpoint directory ckptd may serve "
        "(--root DIR)");
  }
  for (const std::string& r : c.roots) {
    if (IsObjectStorageUrl(r)) {
      // s3://bucket[/prefix]: the rest is checked when the storage parses it.
      if (r.size() <= 5 || r[5] == '/') {
        return absl::InvalidArgumentError(
            absl::StrCat("config: root '", r, "' names no bucket (s3://bucket/prefix)"));
      }
      continue;
    }
    if (r.empty() || r[0] != '/') {
      return absl::InvalidArgumentError(absl::StrCat(
          "config: root '", r, "' must be an absolute path or an s3://bucket/prefix URL"));
    }
  }
  if (c.io_request_size < 4096) {
    return absl::InvalidArgumentError("config: 'io_request_size' must be at least 4KiB");
  }
  if (c.cache_huge_pages != "auto" && c.cache_huge_pages != "off") {
    return absl::InvalidArgumentError(absl::StrCat(
        "config: 'cache_huge_pages' is '", c.cache_huge_pages, "', not one of auto, off"));
  }
  if (!IsDirectIoMode(c.direct_io)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config: 'direct_io' is '", c.direct_io, "', not one of never, auto, always"));
  }
  auto bad_unix = [](const std::string& a) {
    return IsUnixAddress(a) && (a.size() < 6 || a[5] != '/');
  };
  for (const std::string& p : c.peers) {
    if (bad_unix(p)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config: peer '", p, "' must be unix:/absolute/path (or host:port)"));
    }
    if (IsUnixAddress(p)) continue;
    if (p.rfind(':') == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("config: peer '", p, "' must be host:port"));
    }
    if (PortOf(p) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config: peer '", p, "' has port 0: a peer must be named by the port it listens on "
          "(port 0 is only for this daemon's own 'peer_listen'; read the port it bound from "
          "'port_file' or its log and give that to the other daemons)"));
    }
  }
  if (!c.peer_dns.empty() && PortOf(c.peer_dns) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config: 'peer_dns' ", c.peer_dns, " has port 0: it must name the port every node listens on"));
  }
  if ((!c.peers.empty() || !c.peer_dns.empty()) && c.peer_listen.empty()) {
    return absl::InvalidArgumentError(
        "config: 'peers'/'peer_dns' need 'peer_listen' (this daemon's own peer address)");
  }
  if (!c.peer_listen.empty() && bad_unix(c.peer_listen)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config: 'peer_listen' ", c.peer_listen, " must be unix:/absolute/path (or host:port)"));
  }
  if (!c.peer_listen.empty() && !c.peer_dns.empty() &&
      (IsUnixAddress(c.peer_listen) || PortOf(c.peer_listen) == 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config: 'peer_listen' ", c.peer_listen, " cannot be combined with 'peer_dns' ",
        c.peer_dns, ": the DNS name gives every node's address as ip:port with its port, so this "
        "node must listen on a fixed TCP port (not port 0, not a Unix socket)"));
  }
  if (!c.peer_listen.empty() && IsUnixAddress(c.peer_listen) &&
      (!c.peer_tls_cert.empty() || !c.peer_tls_key.empty() || !c.peer_tls_ca.empty())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config: 'peer_listen' ", c.peer_listen, " is a Unix socket: peer TLS identifies nodes by "
        "the host names of their certificates, which a socket path has not; a Unix socket peer "
        "plane is plaintext, guarded by the socket file's mode (0600): drop 'peer_tls_*'"));
  }
  if (!c.peer_listen.empty()) {
    const bool tls = !c.peer_tls_cert.empty() || !c.peer_tls_key.empty() || !c.peer_tls_ca.empty();
    if (tls && (c.peer_tls_cert.empty() || c.peer_tls_key.empty() || c.peer_tls_ca.empty())) {
      return absl::InvalidArgumentError(
          "config: mutual TLS on the peer plane needs all of 'peer_tls_cert', 'peer_tls_key' and "
          "'peer_tls_ca' (the CA that signs every peer's certificate)");
    }
    if (!tls && !c.peer_insecure && !IsLoopbackAddress(c.peer_listen)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config: 'peer_listen' ", c.peer_listen,
          " is not a loopback address, and without mutual TLS anyone who can reach it could join "
          "jobs, read and alter checkpoint bytes: set 'peer_tls_cert', 'peer_tls_key' and "
          "'peer_tls_ca', or 'peer_insecure: true' to accept that explicitly"));
    }
  }
  if (c.nccl_connect_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("config: 'nccl_connect_timeout' must be positive");
  }
  if (!c.metrics_address.empty()) {
    const size_t colon = c.metrics_address.rfind(':');
    int port = -1;
    if (colon == std::string::npos ||
        !absl::SimpleAtoi(absl::string_view(c.metrics_address).substr(colon + 1), &port) ||
        port < 0 || port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config: 'metrics_address' '", c.metrics_address, "' must be host:port (e.g. 0.0.0.0:9464)"));
    }
  }
  if (c.log_format != "text" && c.log_format != "json") {
    return absl::InvalidArgumentError("config: 'log_format' must be text or json");
  }
  if (c.barrier_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("config: 'barrier_timeout' must be positive");
  }
  if (c.barrier_timeout > c.limits.max_barrier_timeout) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config: 'barrier_timeout' ", absl::FormatDuration(c.barrier_timeout),
        " is above limits.max_barrier_timeout ", absl::FormatDuration(c.limits.max_barrier_timeout)));
  }
  if (!c.tcp_address.empty()) {
    const bool tls = !c.tcp_tls_cert.empty() || !c.tcp_tls_key.empty() || !c.tcp_tls_ca.empty();
    if (tls && (c.tcp_tls_cert.empty() || c.tcp_tls_key.empty() || c.tcp_tls_ca.empty())) {
      return absl::InvalidArgumentError(
          "config: TLS on 'tcp_address' needs all of 'tcp_tls_cert', 'tcp_tls_key' and "
          "'tcp_tls_ca' (the CA that signs client certificates)");
    }
    if (!tls && !c.insecure_tcp) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config: 'tcp_address' ", c.tcp_address,
          " would accept anyone who can reach it: set 'tcp_tls_cert', 'tcp_tls_key' and "
          "'tcp_tls_ca' (mutual TLS), or 'insecure_tcp: true' to accept that explicitly"));
    }
  }
  auto configured = [&c](const std::string& root) {
    return std::find(c.roots.begin(), c.roots.end(), root) != c.roots.end();
  };
  for (const S3RootConfig& r : c.s3.roots) {
    if (!configured(r.root)) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: s3.roots entry for '", r.root, "' names no configured root"));
    }
  }
  for (const RootAccess& a : c.access) {
    if (!configured(a.root)) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: access entry for '", a.root, "' names no configured root"));
    }
  }
  if (c.limits.max_message_bytes < (4u << 20)) {
    return absl::InvalidArgumentError("config: 'limits.max_message_bytes' must be at least 4MiB");
  }
  return absl::OkStatus();
}

std::string ConfigToYaml(const DaemonConfig& c) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  out << YAML::Key << "socket" << YAML::Value << c.socket;
  out << YAML::Key << "socket_mode" << YAML::Value << absl::StrFormat("0%o", c.socket_mode);
  out << YAML::Key << "tcp_address" << YAML::Value << c.tcp_address;
  out << YAML::Key << "roots" << YAML::Value << c.roots;
  out << YAML::Key << "cache_budget" << YAML::Value << c.cache_budget;
  out << YAML::Key << "cache_huge_pages" << YAML::Value << c.cache_huge_pages;
  out << YAML::Key << "cache_laid_out_copies" << YAML::Value
      << (c.cache_laid_out_copies ? "true" : "false");
  out << YAML::Key << "arena_pool" << YAML::Value << c.arena_pool;
  out << YAML::Key << "arena_limit" << YAML::Value << c.arena_limit;
  out << YAML::Key << "save_buffer" << YAML::Value << c.save_buffer;
  out << YAML::Key << "io_threads" << YAML::Value << c.io_threads;
  out << YAML::Key << "direct_io" << YAML::Value << c.direct_io;
  out << YAML::Key << "memory_limit" << YAML::Value << c.memory_limit;
  out << YAML::Key << "io_request_size" << YAML::Value << c.io_request_size;
  out << YAML::Key << "barrier_timeout" << YAML::Value << absl::FormatDuration(c.barrier_timeout);
  out << YAML::Key << "load_timeout" << YAML::Value << absl::FormatDuration(c.load_timeout);
  out << YAML::Key << "drain_timeout" << YAML::Value << absl::FormatDuration(c.drain_timeout);
  out << YAML::Key << "log_level" << YAML::Value << c.log_level;
  out << YAML::Key << "log_format" << YAML::Value << c.log_format;
  out << YAML::Key << "metrics_address" << YAML::Value << c.metrics_address;
  out << YAML::Key << "port_file" << YAML::Value << c.port_file;
  out << YAML::Key << "peer_listen" << YAML::Value << c.peer_listen;
  out << YAML::Key << "peers" << YAML::Value << c.peers;
  out << YAML::Key << "peer_dns" << YAML::Value << c.peer_dns;
  out << YAML::Key << "peer_timeout" << YAML::Value << absl::FormatDuration(c.peer_timeout);
  out << YAML::Key << "peer_tls_cert" << YAML::Value << c.peer_tls_cert;
  out << YAML::Key << "peer_tls_key" << YAML::Value << c.peer_tls_key;
  out << YAML::Key << "peer_tls_ca" << YAML::Value << c.peer_tls_ca;
  out << YAML::Key << "peer_insecure" << YAML::Value << (c.peer_insecure ? "true" : "false");
  out << YAML::Key << "peer_unkeyed_jobs" << YAML::Value
      << (c.peer_unkeyed_jobs ? "true" : "false");
  out << YAML::Key << "peer_reader_min_bytes" << YAML::Value << c.peer_reader_min_bytes;
  out << YAML::Key << "nccl_connect_timeout" << YAML::Value
      << absl::FormatDuration(c.nccl_connect_timeout);
  out << YAML::Key << "nccl_device" << YAML::Value << c.nccl_device;
  out << YAML::Key << "tcp_tls_cert" << YAML::Value << c.tcp_tls_cert;
  out << YAML::Key << "tcp_tls_key" << YAML::Value << c.tcp_tls_key;
  out << YAML::Key << "tcp_tls_ca" << YAML::Value << c.tcp_tls_ca;
  out << YAML::Key << "insecure_tcp" << YAML::Value << (c.insecure_tcp ? "true" : "false");
  out << YAML::Key << "tcp_uid" << YAML::Value << c.tcp_uid;
  out << YAML::Key << "admin_uids" << YAML::Value << YAML::Flow << c.admin_uids;
  out << YAML::Key << "access" << YAML::Value << YAML::BeginSeq;
  for (const RootAccess& a : c.access) {
    out << YAML::BeginMap << YAML::Key << "root" << YAML::Value << a.root;
    out << YAML::Key << "read_uids" << YAML::Value << YAML::Flow << a.read_uids;
    out << YAML::Key << "read_gids" << YAML::Value << YAML::Flow << a.read_gids;
    out << YAML::Key << "save_uids" << YAML::Value << YAML::Flow << a.save_uids;
    out << YAML::Key << "save_gids" << YAML::Value << YAML::Flow << a.save_gids;
    out << YAML::EndMap;
  }
  out << YAML::EndSeq;
  const Limits& l = c.limits;
  out << YAML::Key << "limits" << YAML::Value << YAML::BeginMap;
  for (const CountLimit& cl : kCountLimits) out << YAML::Key << cl.key << YAML::Value << l.*cl.field;
  out << YAML::Key << kBarrierLimit << YAML::Value << absl::FormatDuration(l.max_barrier_timeout);
  out << YAML::EndMap;
  const S3Config& s3 = c.s3;
  // Where a store is: the section's keys that s3.roots entries have too.
  auto where = [&out](const S3Config& w) {
    out << YAML::Key << "endpoint" << YAML::Value << w.endpoint;
    out << YAML::Key << "region" << YAML::Value << w.region;
    out << YAML::Key << "profile" << YAML::Value << w.profile;
    out << YAML::Key << "addressing" << YAML::Value << w.addressing;
    out << YAML::Key << "ca_file" << YAML::Value << w.ca_file;
  };
  out << YAML::Key << "s3" << YAML::Value << YAML::BeginMap;
  where(s3);
  out << YAML::Key << "part_size" << YAML::Value << s3.part_size;
  out << YAML::Key << "spool_dir" << YAML::Value << s3.spool_dir;
  out << YAML::Key << "max_attempts" << YAML::Value << s3.max_attempts;
  out << YAML::Key << "connect_timeout" << YAML::Value << absl::FormatDuration(s3.connect_timeout);
  out << YAML::Key << "stall_timeout" << YAML::Value << absl::FormatDuration(s3.stall_timeout);
  out << YAML::Key << "max_bandwidth" << YAML::Value << s3.max_bandwidth;
  out << YAML::Key << "max_requests" << YAML::Value << s3.max_requests;
  out << YAML::Key << "roots" << YAML::Value << YAML::BeginSeq;
  for (const S3RootConfig& r : s3.roots) {
    out << YAML::BeginMap << YAML::Key << "root" << YAML::Value << r.root;
    where(r.settings);
    out << YAML::EndMap;
  }
  out << YAML::EndSeq;
  out << YAML::EndMap;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::vector<std::string> RootProblems(const DaemonConfig& config) {
  std::vector<std::string> out;
  for (const std::string& root : config.roots) {
    if (IsObjectStorageUrl(root)) continue;  // checked by the storage when the daemon starts
    struct stat st;
    if (stat(root.c_str(), &st) != 0) {
      out.push_back(absl::StrCat("root ", root, ": ", std::strerror(errno),
                                 errno == ENOENT ? " (an unmounted volume, or a typo?)" : ""));
    } else if (!S_ISDIR(st.st_mode)) {
      out.push_back(absl::StrCat("root ", root, ": not a directory"));
    }
  }
  return out;
}

}  // namespace ckptd
