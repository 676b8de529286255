#include "core/io/s3/s3_config.h"

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "core/io/file.h"

namespace ckpt {
namespace s3 {

namespace {
constexpr size_t kMaxIniBytes = 1 << 20;

std::string Env(const Getenv& env, const char* name) {
  const char* v = env(name);
  return v != nullptr ? std::string(v) : std::string();
}

// A file read for its settings: absent is fine (empty), unreadable or
// malformed is an error naming it.
absl::StatusOr<IniFile> ReadIni(const std::string& path) {
  if (path.empty()) return IniFile();
  auto kind = Storage::Posix()->Kind(path);
  if (!kind.ok()) return kind.status();
  if (*kind == PathKind::kMissing) return IniFile();
  auto text = ReadSmallFile(path, kMaxIniBytes);
  if (!text.ok()) return text.status();
  auto ini = ParseIni(*text);
  if (!ini.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", ini.status().message()));
  return ini;
}

// A file's version (mtime, ctime, size, inode): changes when it is rewritten.
std::string FileVersion(const std::string& path) {
  if (path.empty()) return "-";
  auto st = Storage::Posix()->Stat(path);
  if (!st.ok()) return "-";
  return absl::StrCat(st->mtime_ns, ":", st->ctime_ns, ":", st->size, ":", st->ino);
}
}  // namespace

absl::StatusOr<IniFile> ParseIni(absl::string_view text) {
  if (text.size() > kMaxIniBytes) {
    return absl::ResourceExhaustedError(absl::StrCat("file of ", text.size(), " bytes, over 1 MiB"));
  }
  IniFile out;
  std::map<std::string, std::string>* section = nullptr;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    const bool indented = !raw.empty() && (raw[0] == ' ' || raw[0] == '\t');
    absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (line.empty() || line[0] == '#' || line[0] == ';') continue;
    if (line.front() == '[') {
      if (line.back() != ']') continue;
      std::string name(absl::StripAsciiWhitespace(line.substr(1, line.size() - 2)));
      section = &out[name];
      continue;
    }
    if (section == nullptr || indented) continue;  // nested (s3 = ...) settings: not ours
    const size_t eq = line.find('=');
    if (eq == absl::string_view::npos) continue;
    std::string key = absl::AsciiStrToLower(absl::StripAsciiWhitespace(line.substr(0, eq)));
    std::string value(absl::StripAsciiWhitespace(line.substr(eq + 1)));
    if (!key.empty()) (*section)[key] = value;
  }
  return out;
}

const std::map<std::string, std::string>* ConfigSection(const IniFile& f,
                                                         const std::string& profile) {
  auto it = f.find(profile == "default" ? "default" : "profile " + profile);
  if (it == f.end() && profile == "default") it = f.find("profile default");
  return it == f.end() ? nullptr : &it->second;
}

namespace {
std::string Home(const Getenv& env) { return Env(env, "HOME"); }

std::string ProfileOf(const S3Settings& s, const Getenv& env) {
  if (!s.profile.empty()) return s.profile;
  std::string p = Env(env, "AWS_PROFILE");
  return p.empty() ? "default" : p;
}

// An AWS file: the variable `var` names it, else ~/.aws/`name` (none without
// a HOME).
std::string AwsFile(const Getenv& env, const char* var, const char* name) {
  std::string p = Env(env, var);
  if (!p.empty()) return p;
  const std::string home = Home(env);
  return home.empty() ? std::string() : absl::StrCat(home, "/.aws/", name);
}

std::string ConfigPathOf(const Getenv& env) { return AwsFile(env, "AWS_CONFIG_FILE", "config"); }
}  // namespace

absl::StatusOr<Endpoint> ResolveEndpoint(const S3Settings& settings, const Getenv& env) {
  const std::string profile = ProfileOf(settings, env);
  auto config = ReadIni(ConfigPathOf(env));
  if (!config.ok()) return config.status();
  const auto* section = ConfigSection(*config, profile);
  auto from_profile = [&](const char* key) -> std::string {
    if (section == nullptr) return std::string();
    auto it = section->find(key);
    return it == section->end() ? std::string() : it->second;
  };
  Endpoint e;
  e.region = settings.region;
  if (e.region.empty()) e.region = Env(env, "AWS_REGION");
  if (e.region.empty()) e.region = Env(env, "AWS_DEFAULT_REGION");
  if (e.region.empty()) e.region = from_profile("region");
  if (e.region.empty()) e.region = "us-east-1";
  for (char c : e.region) {
    if (!(absl::ascii_isalnum(c) || c == '-' || c == '_')) {
      return absl::InvalidArgumentError(absl::StrCat("S3 region '", absl::CHexEscape(e.region),
                                                     "' holds characters a region has not"));
    }
  }
  e.url = settings.endpoint;
  if (e.url.empty()) e.url = Env(env, "AWS_ENDPOINT_URL_S3");
  if (e.url.empty()) e.url = Env(env, "AWS_ENDPOINT_URL");
  if (e.url.empty()) e.url = from_profile("endpoint_url");
  const bool aws = e.url.empty();
  if (aws) e.url = absl::StrCat("https://s3.", e.region, ".amazonaws.com");
  while (absl::EndsWith(e.url, "/")) e.url.pop_back();
  if (!absl::StartsWith(e.url, "http://") && !absl::StartsWith(e.url, "https://")) {
    return absl::InvalidArgumentError(
        absl::StrCat("S3 endpoint '", absl::CHexEscape(e.url), "' is not an http(s):// URL"));
  }
  for (char c : e.url) {
    if (static_cast<unsigned char>(c) <= 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError("S3 endpoint holds a space or control byte");
    }
  }
  switch (settings.addressing) {
    case Addressing::kPath: e.path_style = true; break;
    case Addressing::kVirtual: e.path_style = false; break;
    case Addressing::kAuto: e.path_style = !aws; break;
  }
  e.ca_file = settings.ca_file;
  if (e.ca_file.empty()) e.ca_file = Env(env, "AWS_CA_BUNDLE");
  return e;
}

CredentialSource::CredentialSource(S3Settings settings, Getenv env)
    : settings_(std::move(settings)), env_(std::move(env)) {}

std::string CredentialSource::Profile() const { return ProfileOf(settings_, env_); }
std::string CredentialSource::ConfigPath() const { return ConfigPathOf(env_); }
std::string CredentialSource::CredentialsPath() const {
  return AwsFile(env_, "AWS_SHARED_CREDENTIALS_FILE", "credentials");
}

absl::StatusOr<Credentials> CredentialSource::Load() {
  Credentials c;
  // A profile named in the settings (a root's own) wins over the
  // environment's keys, as the AWS CLI's --profile does.
  if (settings_.profile.empty()) {
    c.access_key = Env(env_, "AWS_ACCESS_KEY_ID");
    c.secret_key = Env(env_, "AWS_SECRET_ACCESS_KEY");
  }
  if (!c.access_key.empty() || !c.secret_key.empty()) {
    if (c.access_key.empty() || c.secret_key.empty()) {
      return absl::InvalidArgumentError(
          "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set together");
    }
    c.session_token = Env(env_, "AWS_SESSION_TOKEN");
    c.source = "environment";
    return c;
  }
  const std::string profile = Profile();
  for (const auto& [path, is_config] :
       {std::make_pair(CredentialsPath(), false), std::make_pair(ConfigPath(), true)}) {
    auto ini = ReadIni(path);
    if (!ini.ok()) return ini.status();
    const std::map<std::string, std::string>* section = nullptr;
    if (is_config) {
      section = ConfigSection(*ini, profile);
    } else if (auto it = ini->find(profile); it != ini->end()) {
      section = &it->second;
    }
    if (section == nullptr) continue;
    auto get = [&](const char* k) {
      auto it = section->find(k);
      return it == section->end() ? std::string() : it->second;
    };
    c.access_key = get("aws_access_key_id");
    c.secret_key = get("aws_secret_access_key");
    c.session_token = get("aws_session_token");
    if (c.access_key.empty() && c.secret_key.empty()) continue;
    if (c.access_key.empty() || c.secret_key.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, " [", profile, "]: aws_access_key_id and aws_secret_access_key must both be set"));
    }
    c.source = absl::StrCat(path, " [", profile, "]");
    return c;
  }
  // No credentials anywhere: anonymous requests (public buckets).
  c.source = "none (anonymous requests)";
  return c;
}

absl::StatusOr<Credentials> CredentialSource::Get() {
  absl::MutexLock lock(&mu_);
  const int64_t now = absl::GetCurrentTimeNanos();
  if (checked_ns_ != 0 && now - checked_ns_ < 1000000000) return cached_;
  checked_ns_ = now;
  const std::string stamp = FileVersion(CredentialsPath()) + "|" + FileVersion(ConfigPath());
  if (stamp != stamp_ || !cached_.ok()) {
    stamp_ = stamp;
    cached_ = Load();
  }
  return cached_;
}

}  // namespace s3
}  // namespace ckpt
