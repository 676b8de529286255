#include "config/config.h"

#include <cmath>
#include <set>

#include <yaml-cpp/yaml.h>

#include "absl/strings/ascii.h"
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
      "metrics_address", "arena_pool",      "arena_limit",     "direct_io"};
  return *keys;
}

// The modes of `direct_io` (core's ckpt::DirectIo; config/ does not link core).
bool IsDirectIoMode(const std::string& s) { return s == "never" || s == "auto" || s == "always"; }

absl::Status Bad(const std::string& source, const std::string& key, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": key '", key, "': ", what));
}

}  // namespace

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
      } else if (key == "cache_budget" || key == "io_request_size" || key == "arena_pool" ||
                 key == "arena_limit") {
        auto b = ParseBytes(s);
        if (!b.ok()) return Bad(source, key, b.status().message());
        (key == "cache_budget"      ? c.cache_budget
         : key == "io_request_size" ? c.io_request_size
         : key == "arena_pool"      ? c.arena_pool
                                    : c.arena_limit) = *b;
      } else if (key == "direct_io") {
        if (!IsDirectIoMode(s)) return Bad(source, key, "must be never, auto or always");
        c.direct_io = s;
      } else if (key == "io_threads") {
        int n;
        if (!absl::SimpleAtoi(s, &n) || n < 1 || n > 256) {
          return Bad(source, key, "must be an integer in [1, 256]");
        }
        c.io_threads = n;
      } else if (key == "barrier_timeout" || key == "load_timeout" || key == "drain_timeout" ||
                 key == "peer_timeout") {
        auto d = ParseDuration(s);
        if (!d.ok()) return Bad(source, key, d.status().message());
        (key == "barrier_timeout"  ? c.barrier_timeout
         : key == "load_timeout"   ? c.load_timeout
         : key == "peer_timeout"   ? c.peer_timeout
                                   : c.drain_timeout) = *d;
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
    if (r.empty() || r[0] != '/') {
      return absl::InvalidArgumentError(
          absl::StrCat("config: root '", r, "' must be an absolute path"));
    }
  }
  if (c.io_request_size < 4096) {
    return absl::InvalidArgumentError("config: 'io_request_size' must be at least 4KiB");
  }
  if (!IsDirectIoMode(c.direct_io)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config: 'direct_io' is '", c.direct_io, "', not one of never, auto, always"));
  }
  for (const std::string& p : c.peers) {
    if (p.rfind(':') == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("config: peer '", p, "' must be host:port"));
    }
  }
  if ((!c.peers.empty() || !c.peer_dns.empty()) && c.peer_listen.empty()) {
    return absl::InvalidArgumentError(
        "config: 'peers'/'peer_dns' need 'peer_listen' (this daemon's own peer address)");
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
  out << YAML::Key << "arena_pool" << YAML::Value << c.arena_pool;
  out << YAML::Key << "arena_limit" << YAML::Value << c.arena_limit;
  out << YAML::Key << "io_threads" << YAML::Value << c.io_threads;
  out << YAML::Key << "direct_io" << YAML::Value << c.direct_io;
  out << YAML::Key << "io_request_size" << YAML::Value << c.io_request_size;
  out << YAML::Key << "barrier_timeout" << YAML::Value << absl::FormatDuration(c.barrier_timeout);
  out << YAML::Key << "load_timeout" << YAML::Value << absl::FormatDuration(c.load_timeout);
  out << YAML::Key << "drain_timeout" << YAML::Value << absl::FormatDuration(c.drain_timeout);
  out << YAML::Key << "log_level" << YAML::Value << c.log_level;
  out << YAML::Key << "log_format" << YAML::Value << c.log_format;
  out << YAML::Key << "metrics_address" << YAML::Value << c.metrics_address;
  out << YAML::Key << "peer_listen" << YAML::Value << c.peer_listen;
  out << YAML::Key << "peers" << YAML::Value << c.peers;
  out << YAML::Key << "peer_dns" << YAML::Value << c.peer_dns;
  out << YAML::Key << "peer_timeout" << YAML::Value << absl::FormatDuration(c.peer_timeout);
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

}  // namespace ckptd
