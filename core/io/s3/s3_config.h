// Where an S3 endpoint is and who we are to it: settings and credentials
// found the way the AWS CLI finds them (environment, then the shared
// credentials and config files, AWS_PROFILE's section), overridable per
// daemon (config's `s3` section). Credentials are never logged: Describe()
// names where they came from, not what they are.
#ifndef CKPTD_CORE_IO_S3_S3_CONFIG_H_
#define CKPTD_CORE_IO_S3_S3_CONFIG_H_

#include <cstdint>
#include <ctime>
#include <functional>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace ckpt {
namespace s3 {

// An INI file as the AWS tools write it: "[section]" lines, "key = value"
// lines, '#' and ';' comments; keys lower-cased, values trimmed. Lines that
// are neither (or nested "  key = value" continuation lines) are ignored, as
// the AWS CLI ignores what it does not know. Files over 1 MiB are refused.
using IniFile = std::map<std::string, std::map<std::string, std::string>>;
absl::StatusOr<IniFile> ParseIni(absl::string_view text);

struct Credentials {
  std::string access_key;
  std::string secret_key;
  std::string session_token;  // empty: none
  // Where they came from ("environment", "/root/.aws/credentials [default]").
  std::string source;
  bool anonymous() const { return access_key.empty(); }
};

enum class Addressing { kAuto, kPath, kVirtual };

// What the daemon's config (or a tool's flags) sets; empty fields fall back
// to the environment and the AWS files.
struct S3Settings {
  std::string endpoint;  // "http://127.0.0.1:7480", "https://storage.googleapis.com"
  std::string region;
  std::string profile;
  Addressing addressing = Addressing::kAuto;
  std::string ca_file;  // PEM bundle for https; empty: the system's
  int64_t connect_timeout_ms = 5000;
  // A transfer that moves no byte either way for this long is cut and retried.
  int64_t stall_timeout_ms = 15000;
  // Attempts per request (retries on 500, 502, 503, 504, SlowDown, resets,
  // timeouts), with exponential backoff and jitter from 50 ms up to 2 s.
  int max_attempts = 6;
  // Body bytes per second moved to and from the endpoint by this client (and
  // the clients sharing its bounds, S3Client::Create), all requests
  // together (a node's share of the store's or the network's bandwidth);
  // 0: no cap.
  uint64_t max_bytes_per_s = 0;
  // Requests in flight from this client (and the clients sharing its
  // bounds), all callers together (a node's share of the store's request
  // rate); 0: no bound (each caller's own requests: a load's I/O threads).
  int max_requests = 0;
};

using Getenv = std::function<const char*(const char*)>;

// The endpoint and region a client uses, resolved once.
struct Endpoint {
  std::string url;     // scheme://host[:port], no trailing '/'
  std::string region;
  bool path_style = true;
  std::string ca_file;
};
// settings.endpoint, else AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the
// profile's endpoint_url, else https://s3.<region>.amazonaws.com; region:
// settings, AWS_REGION, AWS_DEFAULT_REGION, the profile's, else us-east-1.
absl::StatusOr<Endpoint> ResolveEndpoint(const S3Settings& settings, const Getenv& env);

// Credentials as the AWS CLI finds them, re-read when the files change (a
// rotated session token is picked up within a second): the environment's
// keys, else the profile's in the shared credentials file, then in the
// config file; a profile named in the settings skips the environment (as
// the CLI's --profile). Thread-safe.
class CredentialSource {
 public:
  CredentialSource(S3Settings settings, Getenv env);
  absl::StatusOr<Credentials> Get();

 private:
  absl::StatusOr<Credentials> Load();
  std::string CredentialsPath() const;
  std::string ConfigPath() const;
  std::string Profile() const;

  const S3Settings settings_;
  const Getenv env_;
  absl::Mutex mu_;
  int64_t checked_ns_ ABSL_GUARDED_BY(mu_) = 0;
  std::string stamp_ ABSL_GUARDED_BY(mu_);  // the files' mtimes and sizes
  absl::StatusOr<Credentials> cached_ ABSL_GUARDED_BY(mu_) =
      absl::UnavailableError("not loaded");
};

// The profile's section of the config file ("[profile x]", or "[default]").
const std::map<std::string, std::string>* ConfigSection(const IniFile& f,
                                                         const std::string& profile);

}  // namespace s3
}  // namespace ckpt

#endif  // CKPTD_CORE_IO_S3_S3_CONFIG_H_
